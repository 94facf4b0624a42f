"""Try the tile knobs of move_kv_cache with overlapping pairs on the GPU (a tuning aid, not a
benchmark of record: bench/ holds those). Prints device µs and % of the copy bandwidth."""

from __future__ import annotations

import importlib
import itertools

import torch

from bench.bench_move_kv_cache import ROW_SHAPES, _pairs
from bench.harness import copy_bandwidth_gbs, graph_us

mod = importlib.import_module("specmeta.kernels.cache_loc_move")

CASES = [(32, 2048, 1024), (32, 2048, 4096), (64, 4096, 1024)]  # layers, row bytes, n
KNOBS = dict(vectors=(4, 8, 16), warps=(8, 16, 32), per_sm=(1, 2, 4))


def main() -> None:
    copy_bw = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    orig = (mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS, mod._target_programs)
    for layers, row_bytes, n in CASES:
        P = 2 * n + 64
        bufs = [torch.zeros((P, *ROW_SHAPES[row_bytes]), dtype=torch.bfloat16, device="cuda")
                for _ in range(2 * layers)]  # fmt: skip
        pool = mod.KVPool(bufs)
        tgt, src = _pairs(P, n, "overlap", torch.Generator().manual_seed(n))
        moved = 2 * n * row_bytes * len(bufs)
        results = []
        for vectors, warps, per_sm in itertools.product(*KNOBS.values()):
            # The wide-tile knobs of the launcher (every case here has n > _SMALL_BLOCK_N).
            mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS = vectors, warps
            mod._target_programs = lambda device, wide, k=per_sm: k * sms
            try:
                us = graph_us(lambda p=pool, t=tgt, s=src: mod.move_kv_cache(p, t, s), rep_ms=30)
            except Exception as exc:  # a tile the compiler refuses (out of registers)
                print(f"  {vectors=} {warps=} {per_sm=}: {type(exc).__name__}", flush=True)
                continue
            pct = 100 * moved / (us * 1e-6) / 1e9 / copy_bw
            results.append((us, pct, vectors, warps, per_sm))
        mod._WIDE_VECTORS_PER_THREAD, mod._WIDE_WARPS, mod._target_programs = orig
        results.sort()
        print(f"{layers}x{row_bytes}B n={n}: best " + "; ".join(
            f"{us:.1f} us {pct:.1f} % v{v} w{w} p{p}" for us, pct, v, w, p in results[:4]),
            flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
