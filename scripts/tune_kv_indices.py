"""Try the launch knobs of draft_decode_kv_indices on the GPU (a tuning aid, not a benchmark of
record: bench/ holds those).

Sweeps 16-byte vector stores on/off, the block size, warps per program and programs per
multiprocessor over the cases that miss the issue's targets, and prints, per case, the default
and the best settings with their device µs and % of the copy bandwidth measured in this run.
Usage: ``python scripts/tune_kv_indices.py [--quick]``.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys

import torch

from bench.harness import copy_bandwidth_gbs, graph_us, write_bandwidth_gbs
from specmeta import SpecConfig, plan_buffers
from specmeta.config import draft_decode_kv_indices_need
from specmeta.workloads import make_batch

# The package re-exports the launcher under the module's name; fetch the module itself.
mod = importlib.import_module("specmeta.kernels.draft_decode_kv_indices")

CASES = [  # (B, K, L): the >= 32 MB launches furthest from 75 %, and the <= 3 us cases
    (32, 4, 32768),
    (256, 8, 1024),
    (256, 1, 32768),
    (64, 8, 4096),
    (256, 8, 32768),
    (8, 8, 1024),
    (8, 8, 2048),
    (8, 4, 2048),
]
S = 5
KNOBS = dict(
    aligned=(False, True),
    block=(1024, 2048),
    warps=(4, 8),
    per_sm=(8, 16),
    status=(False, True),  # the status word costs a reduction and an atomic per list
)
DEFAULT = dict(
    aligned=mod._ALIGNED_STORES, block=mod._BLOCK, warps=mod._NUM_WARPS, per_sm=8, status=True
)


def vector_stores(launch) -> int:
    """16-byte stores in the PTX of the kernel ``launch`` runs."""
    kernel = mod._draft_decode_kv_indices_kernel
    seen = {}

    class Capture:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen["k"] = kernel[grid](*args, **kwargs)
                return seen["k"]

            return run

    mod._draft_decode_kv_indices_kernel = Capture()
    try:
        launch()
    finally:
        mod._draft_decode_kv_indices_kernel = kernel
    ptx = seen["k"].asm["ptx"]
    return ptx.count("st.global.v4") + ptx.count("st.global.v2.b64")


def main() -> None:
    quick = "--quick" in sys.argv
    copy_bw, write_bw = copy_bandwidth_gbs(), write_bandwidth_gbs()
    print(f"copy {copy_bw:.0f} GB/s, write {write_bw:.0f} GB/s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    orig_target = mod._target_programs
    summary = []
    for bs, k, ctx in CASES:
        cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=S + 1, max_bs=bs,
                         max_context_len=ctx)  # fmt: skip
        batch = make_batch("max", batch_size=bs, topk=k, num_steps=S, page_size=1,
                           row_width=cfg.req_to_token_width,
                           generator=torch.Generator().manual_seed(0), device="cuda")  # fmt: skip
        batch.seq_lens.fill_(ctx)
        plan = plan_buffers(cfg)
        idx = plan["draft_decode.kv_indices"].allocate("cuda")
        ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
        args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
        total = bs * ctx
        written = 4 * sum(draft_decode_kv_indices_need(total, bs, k, s + 1) for s in range(S))
        moved = written + 4 * total + 4 * S * (bs * k + 1)

        status = torch.zeros(1, dtype=torch.int32, device="cuda")

        def launch(args=args, k=k, idx=idx, ptr=ptr, status=status, with_status=True):
            return mod.draft_decode_kv_indices(*args, topk=k, num_steps=S, kv_indices=idx,
                                               kv_indptr=ptr,
                                               status=status if with_status else None)  # fmt: skip

        results = []
        for values in itertools.product(*KNOBS.values()):
            knob = dict(zip(KNOBS, values, strict=True))
            if quick and (knob["block"] != 1024 or knob["per_sm"] != 8):
                continue
            mod._ALIGNED_STORES, mod._BLOCK, mod._NUM_WARPS = (
                knob["aligned"], knob["block"], knob["warps"],
            )  # fmt: skip
            mod._target_programs = lambda device, n=knob["per_sm"]: n * sms
            us = graph_us(functools.partial(launch, with_status=knob["status"]), rep_ms=30)
            results.append((us, knob))
        mod._target_programs = orig_target
        mod._ALIGNED_STORES, mod._BLOCK, mod._NUM_WARPS = (
            DEFAULT["aligned"], DEFAULT["block"], DEFAULT["warps"],
        )  # fmt: skip
        results.sort(key=lambda r: r[0])
        base = next(us for us, knob in results if knob == DEFAULT)
        pct = lambda us, moved=moved: 100 * moved / (us * 1e-6) / 1e9 / copy_bw  # noqa: E731
        best = results[:3]
        line = (f"{bs:>3}-{k}-{ctx:<5} {written / 1e6:7.1f} MB  default {base:7.2f} us "
                f"({pct(base):4.1f} %)  best " + "; ".join(
                    f"{us:.2f} us {pct(us):.1f} % {knob}" for us, knob in best))  # fmt: skip
        print(line, flush=True)
        summary.append(line)
    mod._ALIGNED_STORES = True
    print("vector stores in PTX (aligned on):", vector_stores(launch))
    mod._ALIGNED_STORES = False
    print("vector stores in PTX (aligned off):", vector_stores(launch))
    mod._ALIGNED_STORES = DEFAULT["aligned"]


if __name__ == "__main__":
    main()
