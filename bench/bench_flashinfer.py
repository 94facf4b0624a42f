"""FlashInfer builders: device µs of every mode from CUDA-graph replay, host µs of the builder
call (with its host mirrors), bytes written, and the memory of per-branch vs shared-prefix
draft-decode buffers from the capacity plan."""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import SpecConfig, plan_buffers
from specmeta.kernels.branch_kv_indices import branch_kv_indices_ref
from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indices_ref
from specmeta.kernels.shared_prefix_kv_indices import shared_prefix_kv_indices_ref
from specmeta.kernels.tree_custom_mask import tree_custom_mask_ref
from specmeta.kernels.verify_kv_indices import verify_kv_indices_ref
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.testing.masks import written_part
from specmeta.workloads import make_batch, random_tree_mask

S = 5  # draft steps: S - 1 = 4 draft-decode forwards per iteration
MODES = (
    "draft_decode",
    "draft_decode_shared_prefix",
    "draft_decode_paged",
    "target_verify",
    "target_verify_packed",
    "draft_extend",
)
CASES = [
    (bs, k, ps, ctx)
    for bs in (1, 8, 64, 256)
    for k in (1, 8)
    for ps in (1, 64)
    for ctx in (4096, 32768)
]


def _setup(bs, k, ps, ctx):
    n = S + 1 if k == 1 else 16
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=bs,
                     max_context_len=ctx)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 1000 + k * 100 + ps + ctx)
    batch = make_batch("max", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    # Every request at the full context: the buffers' worst case, the largest write.
    batch.seq_lens.fill_(ctx)
    batch.seq_lens_cpu.fill_(ctx)
    tree = random_tree_mask(bs, k, S, n, g).cuda()
    return cfg, batch, tree


def _used(ptr) -> int:
    return int(ptr[-1])


def _check(mode, meta, batch, tree, cfg):
    """Correctness first: the used part of every list against the references."""
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=cfg.topk, num_steps=S, page_size=cfg.page_size)
    if mode == "draft_decode":
        idx, ptr = draft_decode_kv_indices_ref(*a, **kw)
        for s, step in enumerate(meta.steps):
            assert torch.equal(step.kv_indptr, ptr[s].to(step.kv_indptr.dtype))
            assert torch.equal(step.kv_indices[: _used(ptr[s])], idx[s, : _used(ptr[s])].int())
    elif mode == "draft_decode_shared_prefix":
        pi, pp, ci, cp = shared_prefix_kv_indices_ref(*a, **kw)
        for s, step in enumerate(meta.steps):
            assert torch.equal(step.paged_kv_indices_arr[0][: _used(pp)], pi[: _used(pp)].int())
            assert torch.equal(step.paged_kv_indices_arr[1][: _used(cp[s])],
                               ci[s, : _used(cp[s])].int())  # fmt: skip
    elif mode == "draft_decode_paged":
        idx, ptr, _ = branch_kv_indices_ref(*a, **kw)
        for s, step in enumerate(meta.steps):
            assert torch.equal(step.kv_indices[: _used(ptr[s])], idx[s, : _used(ptr[s])])
    else:
        idx, ptr = verify_kv_indices_ref(*a, extra_tokens=cfg.num_draft_tokens)
        assert torch.equal(meta.kv_indices[: _used(ptr)], idx[: _used(ptr)].int())
        if mode.startswith("target_verify"):
            packed = mode.endswith("packed")
            mask, mptr = tree_custom_mask_ref(batch.seq_lens, tree, packed=packed,
                                              seq_lens_sum=batch.seq_lens_sum)  # fmt: skip
            got = meta.packed_custom_mask if packed else meta.custom_mask
            assert torch.equal(meta.mask_indptr, mptr.to(meta.mask_indptr.dtype))
            # Packed segments start at element offsets; the bytes between them are never written.
            assert torch.equal(written_part(got, mptr, packed), written_part(mask, mptr, packed))


def _bytes_written(mode, cfg, batch) -> int:
    B, K, n, ps = batch.batch_size, cfg.topk, cfg.num_draft_tokens, cfg.page_size
    total, rows = batch.seq_lens_sum, S - 1
    if mode == "draft_decode":
        return 4 * sum(K * total + B * K * (s + 1) + B * K + 1 for s in range(rows))
    if mode == "draft_decode_shared_prefix":
        return 4 * (total + B + 1 + sum(B * K * (s + 1) + B * K + 1 for s in range(rows)))
    if mode == "draft_decode_paged":
        lens = batch.seq_lens_cpu
        return 4 * sum(K * int(((lens + s + ps) // ps).sum()) + 2 * B * K for s in range(rows))
    lists = 4 * (total + B * n + B + 1)
    if mode == "target_verify":
        return lists + n * (total + B * n)
    if mode == "target_verify_packed":
        return lists + (n * (total + B * n)) // 8
    return lists


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bs,k,ps,ctx", CASES, ids=lambda v: str(v))
def bench_flashinfer(benchmark, mode, bs, k, ps, ctx):
    cfg, batch, tree = _setup(bs, k, ps, ctx)
    fi = FlashInferBuilder(cfg, "cuda")
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)

    def build(lens=None):
        if mode.startswith("target_verify"):
            return fi.target_verify(*a, tree, packed=mode.endswith("packed"), seq_lens_cpu=lens)
        return getattr(fi, mode)(*a, seq_lens_cpu=lens)

    meta = build(batch.seq_lens_cpu)
    torch.cuda.synchronize()
    _check(mode, meta, batch, tree, cfg)
    assert int(fi.status) == 0

    device_us = graph_us(build)
    written = _bytes_written(mode, cfg, batch)
    read = 4 * (batch.seq_lens_sum + bs * cfg.num_draft_tokens) + 16 * bs
    record(benchmark, device_us=device_us, bytes_moved=written + read, mode=mode, bs=bs, topk=k,
           page_size=ps, ctx=ctx, steps=S, MB_written=round(written / 1e6, 3))  # fmt: skip
    torch.cuda.synchronize()
    # Host µs of the builder call as an engine makes it: launches plus the host mirrors.
    benchmark.pedantic(build, args=(batch.seq_lens_cpu,), setup=torch.cuda.synchronize,
                       rounds=30, warmup_rounds=3)  # fmt: skip


@pytest.mark.parametrize(
    "bs,k,ctx", [(256, 8, 32768), (256, 4, 32768), (64, 8, 8192), (8, 8, 4096)]
)
def bench_flashinfer_memory(benchmark, bs, k, ctx):
    """Draft-decode kv_indices memory, per-branch vs shared-prefix, from the capacity plan
    (S = 5, page size 1). The reference engine's per-branch buffers: ≈1.3 GB at the first row."""
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=16, page_size=1, max_bs=bs,
                     max_context_len=ctx)  # fmt: skip
    plan = benchmark(plan_buffers, cfg)
    per_branch = plan["flashinfer.draft_decode.kv_indices"].nbytes
    shared = sum(plan[f"flashinfer.draft_decode_shared.{f}_kv_indices"].nbytes
                 for f in ("prefix", "chain"))  # fmt: skip
    assert per_branch > k * shared * 0.9
    record(benchmark, device_us=0.0, bs=bs, topk=k, ctx=ctx, steps=S,
           per_branch_MB=round(per_branch / 1e6, 1), shared_prefix_MB=round(shared / 1e6, 1),
           ratio=round(per_branch / shared, 1))  # fmt: skip
