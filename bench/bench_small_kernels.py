"""Device time of the two kernels added beside the metadata ops: ``merge_state`` (the FA3
cascade's log-sum-exp merge) and ``copy_pad_many`` (the graph runner's one pad-and-copy launch
for up to four static inputs). Each row records the bytes the launch must move and the share of
the copy bandwidth measured in the same run, with host µs beside device µs.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta.kernels.merge_state import merge_state
from specmeta.runners.padding import copy_pad_many

HEADS, DIM = 32, 128


@pytest.mark.parametrize("rows", [8, 512, 4096])
def bench_merge_state(benchmark, rows):
    """Two passes of ``rows`` query rows (bf16 outputs, float32 LSE ``[rows, H]``) merged into
    the first pass's output."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    o1, o2 = (torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(2))  # fmt: skip
    lse1, lse2 = (torch.randn(rows, HEADS, device="cuda", generator=g) for _ in range(2))
    out = torch.empty_like(o1)

    def fn():
        merge_state(o1, lse1, o2, lse2, out=out)

    device_us = graph_us(fn)
    benchmark.pedantic(fn, setup=torch.cuda.synchronize, rounds=50, warmup_rounds=3)
    moved = 3 * o1.numel() * o1.element_size() + 2 * lse1.numel() * 4
    record(benchmark, device_us=device_us, bytes_moved=moved, op="merge_state", rows=rows)


@pytest.mark.parametrize("bucket,batch", [(8, 5), (256, 200)])
def bench_copy_pad_many(benchmark, bucket, batch):
    """The accept stage's three inputs (``[B, S+1]`` int32, ``[B]`` int32, ``[B·N]`` int64):
    rows ``[:B]`` copied, ``[B:Bp]`` padded, in one launch."""
    s1, n = 6, 16
    dst = [torch.empty(bucket, s1, dtype=torch.int32, device="cuda"),
           torch.empty(bucket, dtype=torch.int32, device="cuda"),
           torch.empty(bucket * n, dtype=torch.int64, device="cuda")]  # fmt: skip
    src = [torch.zeros(batch, s1, dtype=torch.int32, device="cuda"),
           torch.ones(batch, dtype=torch.int32, device="cuda"),
           torch.arange(batch * n, device="cuda")]  # fmt: skip
    pairs = [(src[0], dst[0], -1), (src[1], dst[1], 1), (src[2], dst[2], 0)]

    def fn():
        copy_pad_many(pairs)

    fn()
    torch.cuda.synchronize()
    assert torch.equal(dst[2][: batch * n], src[2]) and bool((dst[0][batch:] == -1).all())
    device_us = graph_us(fn)
    benchmark.pedantic(fn, setup=torch.cuda.synchronize, rounds=50, warmup_rounds=3)
    moved = sum(s.numel() * s.element_size() for s in src) + sum(
        d.numel() * d.element_size() for d in dst
    )
    record(benchmark, device_us=device_us, bytes_moved=moved, op="copy_pad_many",
           bucket=bucket, bs=batch)  # fmt: skip
