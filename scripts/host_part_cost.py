"""What a bound stage's host part costs on this CPU, with and without the compiled host ops.

Usage: ``TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/host_part_cost.py [--only RE]
[--json OUT]``. The host part, ``stage.host(seq_lens_cpu)``, is CPU work only (it checks the
lengths and writes FlashInfer's ``plan()`` mirrors or FA3/TRT-LLM's maxima), so builders on
device ``cpu`` measure it; a CPU slower than a GPU host's gives larger figures, so each row
also gives the ratio of the Python path (a builder made with ``host_ops=False``) to the
compiled one (after :func:`specmeta.warmup`) timed in the same rounds. The targets of
design §2.8 are 3 µs at ``B ≤ 64`` and 8 µs at ``B = 256`` compiled, twice that without.

Every mode is bound once per builder; then ``rounds`` rounds each time ``calls`` host-part
calls of every builder in turn (compiled, Python), and a row gives the median µs a call.
The cases are those of ``scripts/host_targets.py``: ``(B, K)`` of (64, 8), (1, 4), (256, 8),
(64, 1), page size 16, ``S = 5``, ``N = 16`` (``S + 1`` for a chain), 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch

S, N, CTX, PS = 5, 16, 4096, 16


def _builders(cls, cfg, **kw):
    """The same builder twice: with the compiled host ops and with ``host_ops=False``."""
    return cls(cfg, "cpu", **kw), cls(cfg, "cpu", host_ops=False, **kw)


def cases(bs: int, k: int):
    """``(name, compiled stage, Python stage, host keywords)`` of every host part of one case."""
    from specmeta import SpecConfig
    from specmeta.kernels import assign_draft_cache_locs
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder
    from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
    from specmeta.workloads import make_batch, random_tree_mask

    n = N if k > 1 else S + 1
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=PS, max_bs=bs,
                     max_context_len=CTX)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 100 + k)
    batch = make_batch("random", batch_size=bs, topk=k, num_steps=S, page_size=PS,
                       row_width=cfg.req_to_token_width, generator=g, device="cpu",
                       extra_tokens=n, max_len=CTX)  # fmt: skip
    tree = random_tree_mask(bs, k, S, n, g)
    t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = assign_draft_cache_locs(*t, topk=k, num_steps=S, page_size=PS)
    real = torch.randint(0, n + 1, (bs - 1,), generator=g, dtype=torch.int32) if bs > 1 else None
    ragged = {"verify_lens": real, "num_tokens": bs * n}
    rows = []

    def add(name, pair, mode, args, kw=None, host_kw=None):
        stages = tuple(b.bind(mode, *args, **(kw or {})) for b in pair)
        rows.append((name, *stages, host_kw or {}))

    fa3 = _builders(FA3MetadataBuilder, cfg)
    fi_modes = ("draft_decode", "draft_decode_shared_prefix", "target_verify")
    fi = _builders(FlashInferBuilder, cfg, modes=fi_modes)
    add("fa3.draft_decode", fa3, "draft_decode", (*t, slots))
    add("fa3.target_verify", fa3, "target_verify", (*t, tree))
    add("flashinfer.draft_decode", fi, "draft_decode", t)
    add("flashinfer.draft_decode_shared_prefix", fi, "draft_decode_shared_prefix", t)
    add("flashinfer.target_verify", fi, "target_verify", (*t, tree), {"packed": True})
    if real is not None:
        add("flashinfer.target_verify.ragged", fi, "target_verify", (*t, tree),
            {"packed": True, **ragged}, {"verify_lens_cpu": real})  # fmt: skip
        add("fa3.target_verify.ragged", fa3, "target_verify", (*t, tree), ragged)
    if k > 1:
        fip = _builders(FlashInferBuilder, cfg, modes=("draft_decode_paged",))
        add("flashinfer.draft_decode_paged", fip, "draft_decode_paged", t)
        mla = _builders(TrtllmMlaBuilder, cfg, modes=("draft_decode",))
        add("trtllm_mla.draft_decode", mla, "draft_decode", t)
        fmla = _builders(FlashInferMLABuilder, cfg, modes=("draft_decode",))
        add("flashinfer_mla.draft_decode", fmla, "draft_decode", t)
    else:  # the chain verifies of the MLA builders
        mla = _builders(TrtllmMlaBuilder, cfg, modes=("target_verify",))
        add("trtllm_mla.target_verify", mla, "target_verify", t)
        if real is not None:
            add("trtllm_mla.target_verify.ragged", mla, "target_verify", t, ragged)
        fmla = _builders(FlashInferMLABuilder, cfg, modes=("target_verify",))
        add("flashinfer_mla.target_verify", fmla, "target_verify", t)
    return rows, batch.seq_lens_cpu


def time_pair(fast, slow, lens, host_kw, rounds: int, calls: int) -> tuple[float, float]:
    """Median µs a call of ``fast.host`` and ``slow.host``, timed in alternating rounds."""
    timed = {0: [], 1: []}
    for stage in (fast, slow):  # the first calls fill each set of the ring's results
        for _ in range(40):
            stage.host(lens, **host_kw)
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for i, stage in enumerate((fast, slow)):
            host = stage.host
            start = clock()
            for _ in range(calls):
                host(lens, **host_kw)
            timed[i].append((clock() - start) / calls / 1000)
    return statistics.median(timed[0]), statistics.median(timed[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", help="time only the rows whose names match this expression")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--calls", type=int, default=50)
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        p.error("run with TRITON_INTERPRET=1 (the stages are bound on the CPU)")
    import specmeta
    from specmeta.metadata import host_ops

    print("warmup:", specmeta.warmup("cpu"), flush=True)
    compiled = host_ops.compiled() is not None
    only = re.compile(a.only) if a.only else None
    out = []
    print(f"{'host part':40s} {'B':>4s} {'K':>2s} {'compiled':>9s} {'python':>8s} "
          f"{'ratio':>6s} {'target':>7s}")  # fmt: skip
    for bs, k in ((64, 8), (1, 4), (256, 8), (64, 1)):
        rows, lens = cases(bs, k)
        for name, fast, slow, host_kw in rows:
            if only and not only.search(name):
                continue
            c, py = time_pair(fast, slow, lens, host_kw, a.rounds, a.calls)
            target = 6.0 if bs <= 64 else 16.0
            row = dict(name=name, bs=bs, topk=k, compiled_us=round(c, 2),
                       python_us=round(py, 2), ratio=round(py / c, 2), compiled=compiled,
                       python_target_us=target)  # fmt: skip
            out.append(row)
            print(f"{name:40s} {bs:4d} {k:2d} {c:9.2f} {py:8.2f} {py / c:6.2f} "
                  f"{target:7.1f}", flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"compiled": compiled, "torch": torch.__version__, "rows": out}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
