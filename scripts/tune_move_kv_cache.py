"""Try the tile knobs of move_kv_cache on the GPU (a tuning aid, not a benchmark of record:
bench/ holds those). Prints device µs and % of the copy bandwidth, best settings first.

``python scripts/tune_move_kv_cache.py``: the wide tile of overlapping pairs in any order;
``--ordered``: the blocks walked in list order (``ordered=True``), ranked by the worst case."""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

from bench.bench_move_kv_cache import ROW_SHAPES, _pairs
from bench.harness import copy_bandwidth_gbs, graph_us

mod = importlib.import_module("specmeta.kernels.cache_loc_move")

CASES = [(32, 2048, 1024), (32, 2048, 4096), (64, 4096, 1024)]  # layers, row bytes, n
KNOBS = dict(vectors=(4, 8, 16), warps=(8, 16, 32), per_sm=(1, 2, 4))
ORDERED_CASES = [(32, 1152, 256), (64, 1152, 1024), (32, 1152, 4096), (32, 2048, 1024),
                 (64, 2048, 4096), (32, 4096, 256), (64, 4096, 4096)]  # fmt: skip
ORDERED_KNOBS = dict(vectors=(2, 4, 8), warps=(2, 4, 8), per_sm=(4, 8, 16), slice=(128,))


def _pool(layers, row_bytes, n):
    P = 2 * n + 64
    bufs = [torch.zeros((P, *ROW_SHAPES[row_bytes]), dtype=torch.bfloat16, device="cuda")
            for _ in range(2 * layers)]  # fmt: skip
    tgt, src = _pairs(P, n, "overlap", torch.Generator().manual_seed(n))
    return mod.KVPool(bufs), tgt, src, 2 * n * row_bytes * len(bufs)


def tune_any(copy_bw: float, sms: int) -> None:
    orig = (mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS, mod._move_programs)
    for layers, row_bytes, n in CASES:
        pool, tgt, src, moved = _pool(layers, row_bytes, n)
        results = []
        for vectors, warps, per_sm in itertools.product(*KNOBS.values()):
            # The wide-tile knobs of the launcher (every case here has n > _SMALL_BLOCK_N).
            mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS = vectors, warps
            mod._move_programs = lambda device, wide, k=per_sm: k * sms
            try:
                us = graph_us(lambda p=pool, t=tgt, s=src: mod.move_kv_cache(p, t, s), rep_ms=30)
            except Exception as exc:  # a tile the compiler refuses (out of registers)
                print(f"  {vectors=} {warps=} {per_sm=}: {type(exc).__name__}", flush=True)
                continue
            pct = 100 * moved / (us * 1e-6) / 1e9 / copy_bw
            results.append((us, pct, vectors, warps, per_sm))
        mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS, mod._move_programs = orig
        results.sort()
        print(f"{layers}x{row_bytes}B n={n}: best " + "; ".join(
            f"{us:.1f} us {pct:.1f} % v{v} w{w} p{p}" for us, pct, v, w, p in results[:4]),
            flush=True)  # fmt: skip
        del pool


def tune_ordered(copy_bw: float, sms: int) -> None:
    orig = (mod._ORDERED_VECTORS_PER_THREAD, mod._ORDERED_WARPS, mod._ORDERED_MIN_SLICE_BYTES,
            mod._move_programs)  # fmt: skip
    table = {}  # knobs -> [% per case]
    for case in ORDERED_CASES:
        pool, tgt, src, moved = _pool(*case)
        for knobs in itertools.product(*ORDERED_KNOBS.values()):
            vectors, warps, per_sm, slice_bytes = knobs
            mod._ORDERED_VECTORS_PER_THREAD, mod._ORDERED_WARPS = vectors, warps
            mod._ORDERED_MIN_SLICE_BYTES = slice_bytes
            mod._move_programs = lambda device, wide, k=per_sm: k * sms
            try:
                us = graph_us(lambda p=pool, t=tgt, s=src: mod.move_kv_cache(p, t, s, ordered=True),
                              rep_ms=20)  # fmt: skip
                pct = 100 * moved / (us * 1e-6) / 1e9 / copy_bw
            except Exception as exc:  # a tile the compiler refuses (out of registers)
                print(f"  {knobs}: {type(exc).__name__}", flush=True)
                pct = 0.0
            table.setdefault(knobs, []).append(pct)
        mod._ORDERED_VECTORS_PER_THREAD, mod._ORDERED_WARPS = orig[:2]
        mod._ORDERED_MIN_SLICE_BYTES, mod._move_programs = orig[2:]
        default = table[(orig[0], orig[1], 4, orig[2])][-1]
        print(f"{case}: default {default:.1f} %, best {max(v[-1] for v in table.values()):.1f} %",
              flush=True)  # fmt: skip
        del pool
    ranked = sorted(table.items(), key=lambda kv: -min(kv[1]))
    names = " ".join(f"{lay}x{rb}/{n}" for lay, rb, n in ORDERED_CASES)
    print(f"vectors warps per_sm slice | worst | {names}")
    for knobs, pcts in ranked:
        print(" ".join(map(str, knobs)), f"| {min(pcts):.1f} |", " ".join(f"{p:.1f}" for p in pcts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ordered", action="store_true", help="tune the ordered=True path")
    args = parser.parse_args()
    copy_bw = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (tune_ordered if args.ordered else tune_any)(copy_bw, sms)


if __name__ == "__main__":
    main()
