"""GPU tier of the draft-slot and draft-decode kv_indices kernels: production shapes, CUDA-graph
capture and replay. No host sync and no recompilation for a new batch size are checked for
every op at once in tests/kernels/test_registry.py."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, allocate_buffers
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, assign_draft_cache_locs_ref
from specmeta.kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from specmeta.runners import collector_off
from specmeta.workloads import make_batch
from tests.guard_bands import assert_equal

pytestmark = pytest.mark.gpu


def _compare_kv(batch, rows, idx, ptr, ref_idx, ref_ptr):
    B, K = batch.batch_size, batch.topk
    assert_equal(ptr[:rows, : B * K + 1], ref_ptr[:rows, : B * K + 1], "kv_indptr")
    for s in range(rows):
        used = draft_decode_kv_indices_need(batch.seq_lens_sum, B, K, s + 1)
        assert_equal(idx[s, :used], ref_idx[s, :used], f"kv_indices[{s}]")


@pytest.mark.parametrize("ps", [1, 16])
def test_production_shape_matches_reference(gen, ps):
    """B = 256, K = 8, S = 5, contexts up to 32k: the shape the reference engine under-sized."""
    B, K, S, ctx = 256, 8, 5, 32768
    cfg = SpecConfig(
        topk=K, num_steps=S, num_draft_tokens=16, page_size=ps, max_bs=B, max_context_len=ctx
    )
    batch = make_batch("long_short", batch_size=B, topk=K, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda", max_len=cfg.max_context_len)  # fmt: skip
    batch.seq_lens[1::2] = torch.randint(ctx // 2, ctx, (B // 2,), device="cuda")
    batch.seq_lens_cpu = batch.seq_lens.cpu()
    bufs = allocate_buffers(
        cfg, "cuda", ["draft_decode.kv_indices", "draft_decode.kv_indptr", "status"]
    )
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=K, num_steps=S, page_size=ps, seq_lens_sum=batch.seq_lens_sum)
    idx, ptr = draft_decode_kv_indices(*args, kv_indices=bufs["draft_decode.kv_indices"],
                                       kv_indptr=bufs["draft_decode.kv_indptr"], status=bufs["status"], **kw)  # fmt: skip
    ref_idx, ref_ptr = draft_decode_kv_indices_ref(*args, kv_indices=torch.full_like(idx, -1), **kw)
    _compare_kv(batch, S, idx, ptr, ref_idx, ref_ptr)
    assert int(bufs["status"]) == 0
    out = assign_draft_cache_locs(*args, topk=K, num_steps=S, page_size=ps)
    assert_equal(
        out, assign_draft_cache_locs_ref(*args, topk=K, num_steps=S, page_size=ps), "out_cache_loc"
    )


@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16), (8, 64)])
def test_graph_replay_equals_eager_with_changing_inputs(gen, k, ps):
    B, S, ctx = 32, 5, 2048
    cfg = SpecConfig(
        topk=k, num_steps=S, num_draft_tokens=S + 1, page_size=ps, max_bs=B, max_context_len=ctx
    )
    bufs = allocate_buffers(cfg, "cuda")
    draws = [
        make_batch(
            shape,
            batch_size=B,
            topk=k,
            num_steps=S,
            page_size=ps,
            row_width=cfg.req_to_token_width,
            generator=gen,
            device="cuda",
            num_rows=B + 8,
            max_len=ctx,
        )
        for shape in ("random", "long_short", "modm1", "max")
    ]
    # Static inputs: the graph reads whatever these hold at replay time.
    rpi = draws[0].req_pool_indices.clone()
    r2t = draws[0].req_to_token.clone()
    sl = draws[0].seq_lens.clone()

    def build():
        assign_draft_cache_locs(rpi, r2t, sl, topk=k, num_steps=S, page_size=ps,
                                out_cache_loc=bufs["draft.out_cache_loc"], positions=bufs["draft.positions"],
                                status=bufs["status"])  # fmt: skip
        draft_decode_kv_indices(rpi, r2t, sl, topk=k, num_steps=S, page_size=ps,
                                kv_indices=bufs["draft_decode.kv_indices"],
                                kv_indptr=bufs["draft_decode.kv_indptr"], status=bufs["status"])  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        build()

    for batch in draws[1:] + draws[:1]:
        rpi.copy_(batch.req_pool_indices)
        r2t.copy_(batch.req_to_token)
        sl.copy_(batch.seq_lens)
        bufs["draft_decode.kv_indices"].fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
        ref_idx, ref_ptr = draft_decode_kv_indices_ref(
            *args, topk=k, num_steps=S, page_size=ps,
            kv_indices=torch.full_like(bufs["draft_decode.kv_indices"], -1),
        )  # fmt: skip
        _compare_kv(
            batch,
            S,
            bufs["draft_decode.kv_indices"],
            bufs["draft_decode.kv_indptr"],
            ref_idx,
            ref_ptr,
        )
        want = assign_draft_cache_locs_ref(*args, topk=k, num_steps=S, page_size=ps)
        assert_equal(bufs["draft.out_cache_loc"], want, f"out_cache_loc [{batch.shape}]")
        assert int(bufs["status"]) == 0
