"""Try block sizes / warps / program targets of draft_decode_kv_indices on the GPU (a tuning
aid, not a benchmark of record: bench/ holds those)."""

from __future__ import annotations

import importlib
import itertools

import torch

from bench.harness import graph_us
from specmeta import SpecConfig, plan_buffers
from specmeta.workloads import make_batch

# The package re-exports the launcher under the module's name; fetch the module itself.
mod = importlib.import_module("specmeta.kernels.draft_decode_kv_indices")

CASES = [
    (256, 8, 1024),
    (256, 4, 1024),
    (64, 8, 1024),
    (8, 8, 1024),
    (8, 8, 2048),
    (8, 4, 2048),
    (1, 8, 2048),
    (32, 4, 32768),
]
S = 5

rows = []
for bs, k, ctx in CASES:
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=S + 1, max_bs=bs, max_context_len=ctx)
    batch = make_batch(
        "max",
        batch_size=bs,
        topk=k,
        num_steps=S,
        page_size=1,
        row_width=cfg.req_to_token_width,
        generator=torch.Generator().manual_seed(0),
        device="cuda",
    )
    batch.seq_lens.fill_(ctx)
    plan = plan_buffers(cfg)
    idx = plan["draft_decode.kv_indices"].allocate("cuda")
    ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    line = [f"{bs}-{k}-{ctx}"]

    def launch(args=args, k=k, idx=idx, ptr=ptr):
        return mod.draft_decode_kv_indices(
            *args, topk=k, num_steps=S, kv_indices=idx, kv_indptr=ptr
        )

    for block, warps, per_sm in itertools.product((1, 4, 8, 16), (4,), (4, 8)):
        mod._MIN_CHUNKS, mod._NUM_WARPS = block, warps
        mod._target_programs.cache_clear()
        orig = mod._target_programs
        mod._target_programs = lambda device, n=per_sm: n * 132
        us = graph_us(launch, rep_ms=50)
        mod._target_programs = orig
        line.append((us, block, warps, per_sm))
    best = sorted(line[1:])[:3]
    base = [x for x in line[1:] if x[1:] == (8, 4, 4)][0]
    print(
        f"{line[0]:>14}: default {base[0]:.2f} us; best "
        + "; ".join(f"{u:.2f} us (minchunks{b},w{w},p{p})" for u, b, w, p in best),
        flush=True,
    )
