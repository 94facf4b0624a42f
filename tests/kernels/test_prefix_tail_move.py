"""Layout-B prefix-tail copies: prefix_tail_copy_pairs fed to move_kv_cache, checked against
design §1 read directly: afterwards every branch t ≥ 1's region starts with a copy of the prefix
tail, and nothing else in any pool changed."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, allocate_buffers, new_status
from specmeta.config import draft_pages_per_branch
from specmeta.kernels.cache_loc_move import KVPool, move_kv_cache, move_kv_cache_ref
from specmeta.kernels.draft_cache_locs import prefix_tail_copy_pairs
from specmeta.runners import collector_off
from specmeta.workloads import SHAPES, make_batch
from tests._support import no_host_sync, row_width
from tests.guard_bands import GuardedPool, assert_equal

CONFIGS = [(2, 2, 4), (3, 5, 16), (8, 2, 2), (4, 3, 64)]  # (K, S, ps), all layout B


def _spec_tail_copy(batch, rows_before):
    """design §1: slot row_b[base + t·nnp·ps + u] receives slot row_b[base + u], t ∈ [1, K),
    u < lpl_b; every other slot keeps its bytes."""
    K, S, ps = batch.topk, batch.num_steps, batch.page_size
    r2t = batch.req_to_token.cpu().long()
    new = rows_before.clone()
    for b in range(batch.batch_size):
        row = r2t[int(batch.req_pool_indices[b])]
        L = int(batch.seq_lens_cpu[b])
        lpl, nnp = L % ps, draft_pages_per_branch(L, S, ps)
        base = L - lpl
        for t in range(1, K):
            for u in range(lpl):
                new[row[base + t * nnp * ps + u]] = rows_before[row[base + u]]
    return new


def _check_tail_move(batch, device, gen, *, disjoint, addressing="auto"):
    K, S, ps = batch.topk, batch.num_steps, batch.page_size
    P = batch.pool_size
    pools = [GuardedPool(P, (64,), torch.bfloat16, device, gen),
             GuardedPool(P, (9,), torch.uint8, device, gen, pad=3),
             GuardedPool(P, (), torch.float32, device, gen)]  # fmt: skip
    before = [p.rows().cpu().clone() for p in pools]
    ref = [p.view.clone() for p in pools]
    status = new_status(device)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    tgt, src = prefix_tail_copy_pairs(*args, topk=K, num_steps=S, page_size=ps, status=status)
    assert tgt.numel() == batch.batch_size * (K - 1) * (ps - 1)
    pool = KVPool([p.view for p in pools], addressing=addressing)
    move_kv_cache(pool, tgt, src, disjoint=disjoint, status=status)
    move_kv_cache_ref(ref, tgt, src)
    assert int(status) == 0
    for i, (p, old) in enumerate(zip(pools, before, strict=True)):
        p.assert_intact(f"buffers[{i}]")
        assert_equal(p.rows(), _spec_tail_copy(batch, old), f"buffers[{i}] vs design §1")
        ref_rows = ref[i].reshape(ref[i].shape[0], -1).view(torch.uint8)
        assert_equal(p.rows(), ref_rows, f"buffers[{i}] vs reference")


@pytest.mark.parametrize("disjoint", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_prefix_tail_lands_in_every_branch(device, gen, shape, k, s, ps, disjoint):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps, prefix=48),
                       generator=gen, device=device)  # fmt: skip
    _check_tail_move(batch, device, gen, disjoint=disjoint)


def test_prefix_tail_over_the_pointer_table(device, gen):
    batch = make_batch("modm1", batch_size=6, topk=4, num_steps=3, page_size=16,
                       row_width=row_width(4, 3, 16, prefix=48), generator=gen, device=device)  # fmt: skip
    _check_tail_move(batch, device, gen, disjoint=False, addressing="table")
    _check_tail_move(batch, device, gen, disjoint=True, addressing="table")


def test_every_branch_sees_the_tail_after_the_move(device, gen):
    """The consumer's view (design §1): reading a branch region page by page, its first lpl slots
    equal the prefix's last partial page, for every branch."""
    K, S, ps = 3, 2, 8
    batch = make_batch("modm1", batch_size=4, topk=K, num_steps=S, page_size=ps,
                       row_width=row_width(K, S, ps, prefix=48), generator=gen, device=device)  # fmt: skip
    P = batch.pool_size
    kv = torch.randn(P, 4, generator=gen).to(device)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    tgt, src = prefix_tail_copy_pairs(*args, topk=K, num_steps=S, page_size=ps)
    move_kv_cache([kv], tgt, src, disjoint=True)
    r2t = batch.req_to_token.cpu().long()
    kv = kv.cpu()
    assert int((batch.seq_lens_cpu % ps).max()) > 0, "some request has a partial last page"
    for b in range(batch.batch_size):
        row = r2t[int(batch.req_pool_indices[b])]
        L = int(batch.seq_lens_cpu[b])
        lpl, nnp = L % ps, draft_pages_per_branch(L, S, ps)
        tail = kv[row[L - lpl : L]]
        for t in range(K):
            region = row[L - lpl + t * nnp * ps :][:lpl]
            assert torch.equal(kv[region], tail), f"request {b} branch {t}"


@pytest.mark.gpu
def test_gpu_prefix_tails_in_a_graph_without_sync(gen):
    """Production shape: B = 64, K = 8, ps = 64 gives 28 224 pairs (disjoint=True lifts the
    bound), 16 layers × (K, V) in one launch, captured in a graph and replayed with new
    lengths; no host sync on the path."""
    B, K, S, ps, layers = 64, 8, 3, 64, 16
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=8, page_size=ps, max_bs=B,
                     max_context_len=1024)  # fmt: skip
    bufs = allocate_buffers(
        cfg, "cuda", ["draft.prefix_tail_tgt", "draft.prefix_tail_src", "status"]
    )
    draws = [
        make_batch(
            shape,
            batch_size=B,
            topk=K,
            num_steps=S,
            page_size=ps,
            row_width=cfg.req_to_token_width,
            generator=gen,
            device="cuda",
            num_rows=B + 4,
        )  # fmt: skip
        for shape in ("random", "modm1", "mod1")
    ]
    P = max(d.pool_size for d in draws)
    base = torch.randn(P, 576, generator=gen).cuda()
    pools = [(base + i).to(torch.bfloat16) for i in range(2 * layers)]
    pool = KVPool(pools)
    rpi, r2t, sl = (
        x.clone() for x in (draws[0].req_pool_indices, draws[0].req_to_token, draws[0].seq_lens)
    )

    def step():
        tgt, src = prefix_tail_copy_pairs(rpi, r2t, sl, topk=K, num_steps=S, page_size=ps,
                                          tgt=bufs["draft.prefix_tail_tgt"],
                                          src=bufs["draft.prefix_tail_src"], status=bufs["status"])  # fmt: skip
        move_kv_cache(pool, tgt, src, disjoint=True, status=bufs["status"])

    step()
    torch.cuda.synchronize()
    with no_host_sync():
        step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        step()
    for batch in draws[1:] + draws[:1]:
        rpi.copy_(batch.req_pool_indices)
        r2t.copy_(batch.req_to_token)
        sl.copy_(batch.seq_lens)
        before = [p.view(torch.int16).cpu() for p in pools[:4]]
        graph.replay()
        torch.cuda.synchronize()
        for p, old in zip(pools[:4], before, strict=True):
            assert_equal(p.view(torch.int16), _spec_tail_copy(batch, old), "pool vs design §1")
        assert int(bufs["status"]) == 0
