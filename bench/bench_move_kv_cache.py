"""Sweep of move_kv_cache: every K and V buffer of 32 or 64 layers in one launch, rows of 1152,
2048 or 4096 bytes, n ∈ {64, 256, 1024, 4096} moved rows. Device µs from graph replay, GB/s
counting bytes read and written, % of the copy bandwidth measured in the same run (target: ≥ 70 %
for n ≥ 256), host µs of the launcher, and a per-buffer torch index copy for comparison.

Three pair patterns: ``overlap`` (a chain through random slots shifted by n/4: three targets in
four are other pairs' sources, so only read-all-then-write-all is right; the default mode),
``ordered`` (the same pairs with ``ordered=True``: no pair reads a slot an earlier pair writes,
as with accept_cache_locs pairs, so blocks of whole rows go in list order) and ``disjoint``
(targets and sources apart, ``disjoint=True``: whole-row blocks, the prefix-tail path)."""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import new_status
from specmeta.kernels.cache_loc_move import KVPool, move_kv_cache, move_kv_cache_ref

ROW_SHAPES = {1152: (576,), 2048: (8, 128), 4096: (16, 128)}  # bf16 rows: MLA, 8 and 16 heads
CASES = [
    (layers, row_bytes, n, pattern)
    for pattern in ("overlap", "ordered", "disjoint")
    for layers in (32, 64)
    for row_bytes in (1152, 2048, 4096)
    for n in (64, 256, 1024, 4096)
]


def _pairs(P: int, n: int, pattern: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.randperm(P - 1, generator=g)[: 2 * n] + 1  # the sink stays out
    tgt = slots[:n]
    src = slots[n:] if pattern == "disjoint" else slots[n // 4 : n // 4 + n]
    return tgt.cuda(), src.cuda()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


@pytest.mark.parametrize("layers,row_bytes,n,pattern", CASES, ids=lambda v: str(v))
def bench_move_kv_cache(benchmark, layers, row_bytes, n, pattern):
    P = 2 * n + 64
    g = torch.Generator().manual_seed(layers * 100_000 + row_bytes * 10 + n)
    gc = torch.Generator(device="cuda").manual_seed(n)
    shape = (P, *ROW_SHAPES[row_bytes])
    bufs = [
        torch.randint(0, 256, (P * row_bytes,), dtype=torch.uint8, device="cuda", generator=gc)
        .view(torch.bfloat16)
        .view(shape)
        for _ in range(2 * layers)
    ]
    pool = KVPool(bufs)
    tgt, src = _pairs(P, n, pattern, g)
    status = new_status("cuda")
    promise = dict(disjoint=pattern == "disjoint", ordered=pattern == "ordered")

    def run():
        move_kv_cache(pool, tgt, src, status=status, **promise)

    # Correctness first, on the first and last two buffers (a full copy would double memory).
    watched = [0, 1, len(bufs) - 2, len(bufs) - 1]
    ref = [bufs[i].clone() for i in watched]
    move_kv_cache_ref(ref, tgt, src)
    run()
    for i, want in zip(watched, ref, strict=True):
        assert torch.equal(_bytes(bufs[i]), _bytes(want)), f"buffers[{i}] differs"
    assert int(status) == 0
    del ref

    device_us = graph_us(run)

    def torch_copy():  # what an engine without the kernel does: one index copy per buffer
        for b in bufs:
            b.index_copy_(0, tgt, b.index_select(0, src))

    torch_us = graph_us(torch_copy)
    moved = 2 * n * row_bytes * len(bufs)  # every moved row is read once and written once
    record(benchmark, device_us=device_us, bytes_moved=moved, layers=layers, buffers=len(bufs),
           row_bytes=row_bytes, n=n, pattern=pattern, word_bytes=pool.word_bytes,
           vec16=pool.aligned16, torch_index_copy_us=round(torch_us, 1),
           speedup_vs_torch=round(torch_us / device_us, 2))  # fmt: skip
    torch.cuda.synchronize()
    benchmark.pedantic(run, setup=torch.cuda.synchronize, rounds=30, warmup_rounds=3)
