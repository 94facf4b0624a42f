"""FA3 draft-decode metadata: the expand pass alone and the whole multi-step build (normal +
expand, every step) captured in one graph. Device µs from graph replay, host µs of the launcher
or builder, and the pure-torch reference for comparison.

Target (issue 3): ≤ 3 µs of device time for the whole multi-step build at B·K ≤ 512. The
reference engine's expand step alone (a chain of torch ops) takes 20–27 µs per step in a graph
and 32–73 µs eagerly on an H200.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import SpecConfig, new_status
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.expand_page_table import expand_page_table, expand_page_table_ref
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.workloads import make_batch

S = 5  # draft steps: every row of the expand table, as the sweep's worst case
CTX = 4096  # prefix length of every request: sizes the normal pass's page table
CASES = [(bs, k, ps) for bs in (1, 8, 64, 256) for k in (2, 4, 8) for ps in (1, 16, 64)]
TARGET_US = 3.0


def _ids(v):
    return str(v)


def _setup(bs, k, ps):
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=S + 1, page_size=ps, max_bs=bs,
                     max_context_len=CTX)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 1000 + k * 100 + ps)
    batch = make_batch("modm1" if ps > 1 else "max", batch_size=bs, topk=k, num_steps=S,
                       page_size=ps, row_width=cfg.req_to_token_width, generator=g,
                       device="cuda")  # fmt: skip
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=S, page_size=ps)  # fmt: skip
    return cfg, batch, slots


def _eager_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / reps


@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_expand_page_table(benchmark, bs, k, ps):
    cfg, batch, slots = _setup(bs, k, ps)
    fa3 = FA3MetadataBuilder(cfg, "cuda")  # only for its planned buffers
    BK = bs * k
    pt = fa3.buffers["draft_decode.expand_page_table"][:, :BK]
    cs = fa3.buffers["draft_decode.expand_cache_seqlens"][:, :BK]
    cu = fa3.buffers["draft_decode.expand_cu_seqlens_k"][:, : BK + 1]
    status = new_status("cuda")
    kw = dict(topk=k, num_steps=S, page_size=ps)

    def run():
        expand_page_table(slots, batch.seq_lens, page_table=pt, cache_seqlens=cs,
                          cu_seqlens_k=cu, status=status, **kw)  # fmt: skip

    run()  # correctness first
    ref = [torch.full_like(t, -1) for t in (pt, cs, cu)]
    expand_page_table_ref(slots, batch.seq_lens, page_table=ref[0], cache_seqlens=ref[1],
                          cu_seqlens_k=ref[2], **kw)  # fmt: skip
    for got, want in zip((pt, cs, cu), ref, strict=True):
        assert torch.equal(got, want)
    assert int(status) == 0

    device_us = graph_us(run)
    written = 4 * (pt.numel() + cs.numel() + cu.numel())
    read = slots.element_size() * BK * S + batch.seq_lens.element_size() * bs
    ref_us = _eager_us(lambda: expand_page_table_ref(slots, batch.seq_lens, page_table=ref[0],
                                                     cache_seqlens=ref[1], cu_seqlens_k=ref[2],
                                                     **kw))  # fmt: skip
    record(benchmark, device_us=device_us, bytes_moved=written + read, bs=bs, topk=k,
           page_size=ps, steps=S, ref_eager_us=round(ref_us, 1))  # fmt: skip
    torch.cuda.synchronize()
    benchmark.pedantic(run, setup=torch.cuda.synchronize, rounds=30, warmup_rounds=3)


@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_fa3_draft_decode_build(benchmark, bs, k, ps):
    """The whole draft-decode metadata of every step — the normal pass's page table, lengths
    and cu_seqlens_k over L (or L − lpl), and the expand pass — as one graph of one launch
    (draft_decode_page_tables for K > 1, prefix_page_table for K == 1)."""
    cfg, batch, slots = _setup(bs, k, ps)
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    ref = FA3MetadataBuilder(cfg, "cuda", reference=True)
    status = new_status("cuda")
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, slots)

    def run():
        return fa3.draft_decode(*args, num_rows=S, status=status)

    steps, want = run(), ref.draft_decode(*args, num_rows=S)  # correctness first
    for got_step, want_step in zip(steps, want, strict=True):
        for part in ("normal", "expand"):
            got_m, want_m = getattr(got_step, part), getattr(want_step, part)
            for name, value in got_m.kwargs().items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, getattr(want_m, name)), (part, name)
    assert int(status) == 0

    device_us = graph_us(run)
    tables = [fa3.buffers[f"draft_decode.{f}"] for f in (
        "page_table", "cache_seqlens", "cu_seqlens_k", "expand_page_table",
        "expand_cache_seqlens", "expand_cu_seqlens_k")]  # fmt: skip
    written = 4 * sum(t.numel() for t in tables)
    pages_read = sum(-(-int(x) // ps) for x in batch.seq_lens_cpu)
    read = 4 * pages_read + slots.element_size() * slots.numel() + 16 * bs
    ref_us = _eager_us(lambda: ref.draft_decode(*args, num_rows=S), reps=5)
    record(benchmark, device_us=device_us, bytes_moved=written + read, bs=bs, topk=k,
           page_size=ps, steps=S, ctx=CTX, launches=1, ref_eager_us=round(ref_us, 1),
           meets_3us_target=(device_us <= TARGET_US) if bs * k <= 512 else None)  # fmt: skip
    torch.cuda.synchronize()
    benchmark.pedantic(run, setup=torch.cuda.synchronize, rounds=30, warmup_rounds=3)
