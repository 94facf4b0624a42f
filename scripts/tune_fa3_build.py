"""Try the launch knobs of the fused FA3 draft-decode build (draft_decode_page_tables) on the GPU
(a tuning aid, not a benchmark of record: bench/ holds those).

Sweeps warps per program and the bounds of the normal pass's block of page-table columns
over the cases
nearest the issue's 3 µs target, checks every setting against the reference builder, and prints
per case the default and the best settings with their device µs from graph replay.
Usage: ``python scripts/tune_fa3_build.py``.
"""

from __future__ import annotations

import importlib
import itertools

import torch

from bench.bench_fa3 import _setup
from bench.harness import graph_us
from specmeta import new_status
from specmeta.metadata.fa3 import FA3MetadataBuilder

# The package re-exports the launcher under the module's name; fetch the module itself.
mod = importlib.import_module("specmeta.kernels.draft_decode_page_tables")

CASES = [(256, 2, 1), (256, 2, 16), (256, 2, 64), (64, 8, 16), (64, 4, 64), (8, 8, 16)]
# One warp is left out: on Triton 3.6 it built wrong expand tables (steps 2-4 at ps = 16).
KNOBS = dict(warps=(2, 4, 8), min_block=(128, 256, 512), block=(512, 1024))
DEFAULT = dict(warps=mod._NUM_WARPS, min_block=mod._MIN_BLOCK, block=mod._BLOCK)


def set_knobs(knob: dict) -> None:
    mod._NUM_WARPS, mod._MIN_BLOCK, mod._BLOCK = knob["warps"], knob["min_block"], knob["block"]


def main() -> None:
    for bs, k, ps in CASES:
        cfg, batch, slots = _setup(bs, k, ps)
        fa3 = FA3MetadataBuilder(cfg, "cuda")
        want = FA3MetadataBuilder(cfg, "cuda", reference=True).draft_decode(
            batch.req_pool_indices, batch.req_to_token, batch.seq_lens, slots
        )
        status = new_status("cuda")

        def run(fa3=fa3, batch=batch, slots=slots, status=status):
            return fa3.draft_decode(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    slots, status=status)  # fmt: skip

        results = []
        for values in itertools.product(*KNOBS.values()):
            knob = dict(zip(KNOBS, values, strict=True))
            set_knobs(knob)
            wrong = [  # every setting is checked first; a wrong one is reported, not timed
                f"step {i} {part}.{name}"
                for i, (got, ref) in enumerate(zip(run(), want, strict=True))
                for part in ("normal", "expand")
                for name, value in getattr(got, part).kwargs().items()
                if isinstance(value, torch.Tensor)
                and not torch.equal(value, getattr(getattr(ref, part), name))
            ]
            if wrong:
                print(f"  WRONG with {knob}: {', '.join(wrong[:4])}", flush=True)
                continue
            results.append((graph_us(run, rep_ms=30), knob))
        set_knobs(DEFAULT)
        print(f"  status word: {int(status)}")
        results.sort(key=lambda r: r[0])
        base = next(us for us, knob in results if knob == DEFAULT)
        print(f"B={bs:>3} K={k} ps={ps:<2}  default {base:5.2f} us  best " + "; ".join(
            f"{us:.2f} us {knob}" for us, knob in results[:3]), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
