"""Sweep of draft_decode_kv_indices: device µs from graph replay, bytes moved, % of the copy
bandwidth measured in the same run, host µs of the launcher, and the pure-torch reference."""

from __future__ import annotations

import time

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import SpecConfig, new_status, plan_buffers
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from specmeta.workloads import make_batch

S = 5
CASES = [
    (bs, k, ps, ctx)
    for bs in (1, 8, 64, 256)
    for k in (1, 4, 8)
    for ps in (1, 16, 64)
    for ctx in (1024, 4096, 32768)
] + [
    (32, 4, 1, 32768),
    (32, 4, 16, 32768),
]  # few requests, long context: parallelism within a request
# The <= 3 us target: B <= 8, L <= 2048.
CASES += [(bs, k, 1, 2048) for bs in (1, 8) for k in (1, 4, 8)]


def _ref_ms(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


@pytest.mark.parametrize("bs,k,ps,ctx", CASES, ids=lambda v: str(v))
def bench_draft_decode_kv_indices(benchmark, bs, k, ps, ctx):
    cfg = SpecConfig(
        topk=k, num_steps=S, num_draft_tokens=S + 1, page_size=ps, max_bs=bs, max_context_len=ctx
    )
    g = torch.Generator().manual_seed(bs * 1000 + k * 100 + ps + ctx)
    batch = make_batch("max", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda")  # fmt: skip
    # Every request at the full context: the buffer's worst case, the largest write.
    batch.seq_lens.fill_(ctx)
    batch.seq_lens_cpu.fill_(ctx)
    plan = plan_buffers(cfg)
    idx = plan["draft_decode.kv_indices"].allocate("cuda", fill=-1)
    ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
    status = new_status("cuda")
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=k, num_steps=S, page_size=ps)

    def run():
        draft_decode_kv_indices(*args, kv_indices=idx, kv_indptr=ptr, status=status, **kw)

    # Correctness first.
    run()
    ref_idx, ref_ptr = draft_decode_kv_indices_ref(*args, kv_indices=torch.full_like(idx, -1), **kw)
    assert torch.equal(ptr, ref_ptr)
    for s in range(S):
        used = draft_decode_kv_indices_need(batch.seq_lens_sum, bs, k, s + 1)
        assert torch.equal(idx[s, :used], ref_idx[s, :used])
    assert int(status) == 0
    del ref_idx, ref_ptr

    device_us = graph_us(run)
    written = (
        sum(draft_decode_kv_indices_need(batch.seq_lens_sum, bs, k, s + 1) for s in range(S)) * 4
    )
    written += S * (bs * k + 1) * 4
    read = batch.seq_lens_sum * 4 + 2 * bs * 8
    ref_ms = _ref_ms(
        lambda: draft_decode_kv_indices_ref(*args, kv_indices=idx, kv_indptr=ptr, **kw)
    )
    record(benchmark, device_us=device_us, bytes_moved=written + read, bs=bs, topk=k, page_size=ps,
           ctx=ctx, steps=S, MB_written=round(written / 1e6, 3), ref_us=round(1e3 * ref_ms, 1),
           speedup_vs_ref=round(1e3 * ref_ms / device_us, 1))  # fmt: skip
    torch.cuda.synchronize()
    benchmark.pedantic(run, setup=torch.cuda.synchronize, rounds=30, warmup_rounds=3)
