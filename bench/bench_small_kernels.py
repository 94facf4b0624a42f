"""Device time of the kernels beside the metadata ops: ``merge_state`` (the FA3 cascade's
log-sum-exp merge), ``copy_pad_many`` (the graph runner's one pad-and-copy launch for up to four
static inputs) and ``tree_custom_mask`` (FlashInfer's target-verify mask, the largest write of a
verify). Each row records the bytes the launch must move and the share of the copy bandwidth
measured in the same run (and of the write-only bandwidth, ``write_GB/s``), with host µs beside
device µs.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta.config import tree_custom_mask_need
from specmeta.kernels.merge_state import merge_state
from specmeta.kernels.tree_custom_mask import tree_custom_mask, tree_custom_mask_ref
from specmeta.runners.padding import copy_pad_many
from specmeta.workloads import random_tree_mask

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


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("bs,ctx", [(8, 4096), (64, 4096), (256, 4096), (64, 32768), (256, 32768)])
def bench_tree_custom_mask(benchmark, bs, ctx, packed):
    """FlashInfer's flat verify mask of a 16-node tree (K = 8, S = 5) over prefixes drawn in
    ``[ctx / 2, ctx]``: ``N·ΣL + B·N²`` elements, a byte each (bool) or a bit each (packed, at
    the bool form's offsets). Bytes moved: those written, the tree masks read."""
    n = 16
    g = torch.Generator().manual_seed(bs * 7 + ctx)
    lens = torch.randint(ctx // 2, ctx + 1, (bs,), generator=g).cuda()
    tree = random_tree_mask(bs, 8, 5, n, g).cuda()
    total = int(lens.sum())
    need = tree_custom_mask_need(total, bs, n, packed)
    mask = torch.empty(need, dtype=torch.uint8 if packed else torch.bool, device="cuda")
    indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")

    def fn():
        tree_custom_mask(lens, tree, packed=packed, custom_mask=mask, mask_indptr=indptr,
                         status=status)  # fmt: skip

    fn()
    want, want_ptr = tree_custom_mask_ref(lens, tree, packed=packed, seq_lens_sum=total)
    assert int(status) == 0 and torch.equal(indptr, want_ptr.to(torch.int32))
    # What the launch writes: each segment, from its start (packed: its bytes, whose gaps to
    # the next segment neither form writes).
    written = torch.zeros(need, dtype=torch.bool, device="cuda")
    for lo, hi in zip(want_ptr[:-1].tolist(), want_ptr[1:].tolist(), strict=True):
        written[lo : lo + ((hi - lo + 7) // 8 if packed else hi - lo)] = True
    assert torch.equal(mask[written], want[written])
    device_us = graph_us(fn)
    benchmark.pedantic(fn, setup=torch.cuda.synchronize, rounds=50, warmup_rounds=3)
    moved = int(written.sum()) + tree.numel()
    record(benchmark, device_us=device_us, bytes_moved=moved, op="tree_custom_mask", bs=bs,
           ctx=ctx, packed=packed, draft_tokens=n)  # fmt: skip
