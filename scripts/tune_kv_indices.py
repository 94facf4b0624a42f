"""Try the launch knobs of draft_decode_kv_indices on the GPU (a tuning aid, not a benchmark of
record: bench/ holds those).

Sweeps the most chunks a program copies, the lists a program fills from one load, warps, block size and
programs per multiprocessor over the cases that miss the issue's targets, and prints, per case,
the default and the best settings with their device µs and % of the copy bandwidth measured in
this run, then the settings whose worst case is best, and registers per variant.
Usage: ``python scripts/tune_kv_indices.py [--quick]``.
"""

from __future__ import annotations

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
    (8, 8, 32768),
    (64, 1, 32768),
    (64, 8, 4096),
    (256, 4, 4096),
    (256, 8, 32768),
    (8, 8, 1024),
    (8, 8, 2048),
    (8, 4, 2048),
]
S = 5
KNOBS = dict(
    chunks=(1, 2, 4),  # most chunks a program copies of a row of <= _LONG_ROW_CHUNKS chunks
    lists=(8, 16),
    warps=(4, 8),
    block=(512, 1024),
    per_sm=(4, 8, 12),
)
DEFAULT = dict(
    chunks=mod._MAX_CHUNKS,
    lists=mod._LISTS_PER_PROGRAM,
    warps=mod._NUM_WARPS,
    block=mod._BLOCK,
    per_sm=mod._PROGRAMS_PER_SM,
)


def set_knobs(knob: dict) -> None:
    mod._MAX_CHUNKS, mod._LISTS_PER_PROGRAM, mod._NUM_WARPS, mod._BLOCK = (
        knob["chunks"], knob["lists"], knob["warps"], knob["block"],
    )  # fmt: skip
    mod._PROGRAMS_PER_SM = knob["per_sm"]


def compiled(launch):
    """The compiled kernel that ``launch`` runs."""
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
    return seen["k"]


def describe(launch) -> str:
    """Registers, spills and 16-byte stores of the kernel ``launch`` runs."""
    k = compiled(launch)
    ptx = k.asm["ptx"]
    vectors = ptx.count("st.global.v4") + ptx.count("st.global.v2.b64")
    return f"{k.n_regs} registers, {k.n_spills} spills, {vectors} vector stores"


def main() -> None:
    quick = "--quick" in sys.argv
    copy_bw, write_bw = copy_bandwidth_gbs(), write_bandwidth_gbs()
    print(f"copy {copy_bw:.0f} GB/s, write {write_bw:.0f} GB/s", flush=True)
    summary = []
    table = {}  # knob settings → [(case, written bytes, us, % of copy bandwidth)]
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

        def launch(args=args, k=k, idx=idx, ptr=ptr, status=status):
            return mod.draft_decode_kv_indices(*args, topk=k, num_steps=S, kv_indices=idx,
                                               kv_indptr=ptr, status=status)  # fmt: skip

        results = []
        for values in itertools.product(*KNOBS.values()):
            knob = dict(zip(KNOBS, values, strict=True))
            if quick and (knob["per_sm"] != DEFAULT["per_sm"] or knob["block"] != 1024):
                continue
            set_knobs(knob)
            us = graph_us(launch, rep_ms=30)
            results.append((us, knob))
            pct_us = 100 * moved / (us * 1e-6) / 1e9 / copy_bw
            table.setdefault(tuple(values), []).append((written, us, pct_us))
        set_knobs(DEFAULT)
        results.sort(key=lambda r: r[0])
        base = next(us for us, knob in results if knob == DEFAULT)
        pct = lambda us, moved=moved: 100 * moved / (us * 1e-6) / 1e9 / copy_bw  # noqa: E731
        best = results[:3]
        line = (f"{bs:>3}-{k}-{ctx:<5} {written / 1e6:7.1f} MB  default {base:7.2f} us "
                f"({pct(base):4.1f} %)  best: " + "; ".join(
                    f"{us:.2f} us {pct(us):.1f} % {knob}" for us, knob in best))  # fmt: skip
        print(line, flush=True)
        summary.append(line)
    # One setting for every case: the targets are >= 75 % for launches writing >= 32 MB and
    # <= 3 us for the small ones, so rank by the worst of each.
    ranked = []
    for values, rows in table.items():
        worst_pct = min(p for w, us, p in rows if w >= 32e6)
        worst_us = max(us for w, us, p in rows if w < 32e6)
        ranked.append((-worst_pct, worst_us, values))
    ranked.sort()
    for neg_pct, worst_us, values in ranked[:6]:
        print(f"{dict(zip(KNOBS, values, strict=True))}: worst {-neg_pct:.1f} % over >= 32 MB, "
              f"slowest small case {worst_us:.2f} us")  # fmt: skip
    code = ("lists", "warps", "block")
    for values in itertools.product(*(KNOBS[name] for name in code)):
        knob = dict(DEFAULT, **dict(zip(code, values, strict=True)))
        set_knobs(knob)
        print(f"{knob}: {describe(launch)}")
    set_knobs(DEFAULT)


if __name__ == "__main__":
    main()
