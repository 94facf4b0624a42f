"""The metadata build beside the attention it feeds, through the real kernels, for one
production draft iteration: B = 64, K = 8, S = 5, L = 4096, page size 16, 32 query and 8 KV
heads, head dim 128, bf16, one layer.

Device µs of each from CUDA-graph replay, over the same S draft forwards: the FA3 build of
every forward (one launch) against FlashAttention's CuTe cascades (normal + expand + merge per
forward); the FlashInfer per-branch and shared-prefix builds against their wrappers' runs.
Host µs of the builder beside them (pytest-benchmark's figure). Target (issue 15): the build's
device time is at most 2 % of the attention's.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import SpecConfig
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.workloads import make_batch

B, K, S, L, PS = 64, 8, 5, 4096, 16
H, H_KV, D = 32, 8, 128
TARGET_PCT = 2.0


def _case():
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=16, page_size=PS, max_bs=B,
                     max_context_len=L)  # fmt: skip
    g = torch.Generator().manual_seed(15)
    batch = make_batch("max", batch_size=B, topk=K, num_steps=S, page_size=PS,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       max_len=L)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = assign_draft_cache_locs(*args, topk=K, num_steps=S, page_size=PS)
    pool = batch.pool_size
    kp = torch.randn(pool, H_KV, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn(pool, H_KV, D, device="cuda", dtype=torch.bfloat16)
    tgt, src = prefix_tail_copy_pairs(*args, topk=K, num_steps=S, page_size=PS)
    kp[tgt.long()], vp[tgt.long()] = kp[src.long()], vp[src.long()]
    q = torch.randn(B * K, H, D, device="cuda", dtype=torch.bfloat16)
    return cfg, batch, args, slots, kp, vp, q


def _record(benchmark, build_us, attn_us, **extra):
    pct = 100 * build_us / attn_us
    record(benchmark, device_us=build_us, attention_us=round(attn_us, 2),
           build_pct_of_attention=round(pct, 2), target_pct=TARGET_PCT, **extra)  # fmt: skip
    return pct


def bench_fa3_build_vs_flash_attn_cute(benchmark):
    from specmeta.testing.attention import CuteFlashAttention

    cfg, batch, args, slots, kp, vp, q = _case()
    fa3, cute = FA3MetadataBuilder(cfg, "cuda"), CuteFlashAttention()
    steps = fa3.draft_decode(*args, slots, num_rows=S)

    def attention():
        for cascade in steps:
            cute(cascade, q, kp, vp)

    build_us = graph_us(lambda: fa3.draft_decode(*args, slots, num_rows=S))
    attn_us = graph_us(attention)
    lens_cpu = batch.seq_lens_cpu
    benchmark(lambda: fa3.draft_decode(*args, slots, seq_lens_cpu=lens_cpu, num_rows=S))
    _record(benchmark, build_us, attn_us, backend="fa3 + flash_attn.cute")


@pytest.mark.parametrize("form", ["draft_decode", "draft_decode_shared_prefix"])
def bench_flashinfer_build_vs_flashinfer(benchmark, form):
    from specmeta.testing.attention import FlashInferAttention

    cfg, batch, args, slots, kp, vp, q = _case()
    fi = FlashInferBuilder(cfg, "cuda")
    attn = FlashInferAttention(H, H_KV, D, torch.bfloat16, "cuda")
    lens_cpu = batch.seq_lens_cpu
    res = getattr(fi, form)(*args, seq_lens_cpu=lens_cpu, num_rows=S)
    handles = [attn.prepare(step) for step in res.steps]

    def attention():
        for h in handles:
            attn(h, q, kp, vp)

    build_us = graph_us(lambda: getattr(fi, form)(*args, num_rows=S))
    attn_us = graph_us(attention)
    benchmark(lambda: getattr(fi, form)(*args, seq_lens_cpu=lens_cpu, num_rows=S))
    _record(benchmark, build_us, attn_us, backend=f"flashinfer {form}")
