"""Where the host time of a call goes, on a GPU machine: cProfile over many back-to-back calls.

    python3 scripts/profile_host.py [runner|builders|all] [--calls N] [--top K]

``runner``: ``GraphRunner.run`` of the draft loop's three stages (``examples/draft_loop.py``,
B = 8, K = 4, S = 5, page size 16); ``builders``: the FA3 and FlashInfer draft-decode and
target-verify builds with ``seq_lens_cpu`` (B = 64, K = 8). Prints the per-call wall time, then
the functions with the most own time. Timing belongs in ``bench/``; this says where it goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _runner_calls():
    from bench.bench_runner import StageSetup

    st = StageSetup(4, 5, 16, 16)
    calls = {}
    for stage in ("draft", "verify", "accept"):
        raw, host = st.inputs(stage, 8)
        runner = st.runners[stage]
        calls[f"runner.{stage}"] = lambda r=runner, x=raw, h=host: r.run(8, x, host_inputs=h)
    return calls


def _builder_calls():
    from bench.bench_host import draft_cache_locs, production_batch
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder

    cfg, batch, tree = production_batch(64, 8, 16)
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    lens = batch.seq_lens_cpu
    slots = draft_cache_locs.assign_draft_cache_locs(*a, topk=8, num_steps=5, page_size=16)
    fa = FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode", "target_verify"))
    fi = FlashInferBuilder(cfg, "cuda", modes=("draft_decode", "target_verify"))
    return {
        "assign": lambda: draft_cache_locs.assign_draft_cache_locs(
            *a, out_cache_loc=slots, topk=8, num_steps=5, page_size=16),
        "fa3.draft_decode": lambda: fa.draft_decode(*a, slots, seq_lens_cpu=lens),
        "fa3.target_verify": lambda: fa.target_verify(*a, tree, seq_lens_cpu=lens),
        "flashinfer.draft_decode": lambda: fi.draft_decode(*a, seq_lens_cpu=lens),
        "flashinfer.target_verify": lambda: fi.target_verify(*a, tree, seq_lens_cpu=lens),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=("runner", "builders", "all"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    calls = {}
    if args.what in ("builders", "all"):
        calls.update(_builder_calls())
    if args.what in ("runner", "all"):
        calls.update(_runner_calls())
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        us = 1e6 * (time.perf_counter() - t) / args.calls
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        body = out.getvalue().split("ncalls", 1)[-1]
        print(f"=== {name}: {us:.1f} us per call (unprofiled)\n   ncalls{body}")


if __name__ == "__main__":
    main()
