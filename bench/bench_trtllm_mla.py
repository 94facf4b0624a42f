"""TRT-LLM MLA builders: device µs of every mode from CUDA-graph replay, host µs of the builder
call, bytes written. Draft decode with K > 1 is the per-branch page table (trees over layout B)."""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import SpecConfig
from specmeta.kernels.branch_page_table import branch_page_table_ref
from specmeta.kernels.prefix_page_table import prefix_page_table_ref
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.workloads import make_batch

S = 5
MODES = ("draft_decode", "target_verify", "draft_extend")
CASES = [
    (bs, k, ps, ctx)
    for bs in (1, 8, 64, 256)
    for k in (1, 8)
    for ps in (32, 64)
    for ctx in (4096, 32768)
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bs,k,ps,ctx", CASES, ids=lambda v: str(v))
def bench_trtllm_mla(benchmark, mode, bs, k, ps, ctx):
    if mode == "target_verify" and k > 1:
        pytest.skip("a tree's verify (a two-kernel cascade, design §3.4) is not timed here")
    n = S + 1 if k == 1 else 16
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=bs,
                     max_context_len=ctx)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 1000 + k * 100 + ps + ctx)
    batch = make_batch("max", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    batch.seq_lens.fill_(ctx)
    batch.seq_lens_cpu.fill_(ctx)
    mla = TrtllmMlaBuilder(cfg, "cuda")
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)

    def build():
        return getattr(mla, mode)(*a)

    meta = build()
    torch.cuda.synchronize()
    W = mla.max_blocks
    if mode == "draft_decode":
        table = torch.empty(bs * k, W, dtype=torch.int32, device="cuda")
        want, lens = branch_page_table_ref(*a, topk=k, num_steps=S, page_size=ps, fill_value=-1,
                                           page_table=table)  # fmt: skip
        assert torch.equal(meta.steps[0].block_kv_indices, want)
        assert torch.equal(meta.steps[-1].seq_lens_k, lens[len(meta.steps) - 1])
        written = 4 * (bs * k * W + (S - 1) * bs * k)
    else:
        table = torch.empty(bs, W, dtype=torch.int32, device="cuda")
        want, lens = prefix_page_table_ref(*a, page_size=ps, extra_tokens=n, fill_value=-1,
                                           page_table=table)  # fmt: skip
        assert torch.equal(meta.block_kv_indices, want) and torch.equal(meta.seq_lens_k, lens)
        written = 4 * (bs * W + bs)
    assert int(mla.status) == 0

    device_us = graph_us(build)
    read = 4 * -(-(batch.seq_lens_sum + bs * max(S, n)) // ps) + 16 * bs
    record(benchmark, device_us=device_us, bytes_moved=written + read, mode=mode, bs=bs, topk=k,
           page_size=ps, ctx=ctx, steps=S, MB_written=round(written / 1e6, 3))  # fmt: skip
    torch.cuda.synchronize()
    benchmark.pedantic(build, setup=torch.cuda.synchronize, rounds=30, warmup_rounds=3)
