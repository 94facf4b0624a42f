"""assign_draft_cache_locs and prefix_tail_copy_pairs against their references and design §1."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import draft_pages_per_branch, uses_layout_b
from specmeta.kernels.draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

CONFIGS = [(1, 3, 1), (2, 2, 4), (4, 3, 1), (3, 5, 16), (8, 2, 2), (2, 6, 64)]  # (K, S, ps)


def _run_assign(batch, device):
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    kw = dict(topk=K, num_steps=S, page_size=batch.page_size)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    out = Guarded((B * K * S,), torch.int64, device)
    pos = Guarded((B * K,), torch.int32, device)
    status = new_status(device)
    assign_draft_cache_locs(*args, out_cache_loc=out.view, positions=pos.view, status=status, **kw)
    ref_out = torch.full((B * K * S,), -1, dtype=torch.int64, device=device)
    ref_pos = torch.full((B * K,), -1, dtype=torch.int32, device=device)
    ref_status = new_status(device)
    assign_draft_cache_locs_ref(
        *args, out_cache_loc=ref_out, positions=ref_pos, status=ref_status, **kw
    )
    out.assert_intact("out_cache_loc")
    pos.assert_intact("positions")
    assert_equal(out.view, ref_out, f"out_cache_loc [{batch.describe()}]")
    assert_equal(pos.view, ref_pos, f"positions [{batch.describe()}]")
    assert_equal(status, ref_status, "status")
    return out.view, status


def _run_pairs(batch, device):
    B, K, ps = batch.batch_size, batch.topk, batch.page_size
    kw = dict(topk=K, num_steps=batch.num_steps, page_size=ps)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    n = B * (K - 1) * (ps - 1) if uses_layout_b(K, ps) else 0
    tgt, src = Guarded((n,), torch.int64, device), Guarded((n,), torch.int64, device)
    status = new_status(device)
    prefix_tail_copy_pairs(*args, tgt=tgt.view, src=src.view, status=status, **kw)
    rt, rs = prefix_tail_copy_pairs_ref(*args, **kw)
    ref_status = new_status(device)
    prefix_tail_copy_pairs_ref(*args, status=ref_status, **kw)
    tgt.assert_intact("tgt")
    src.assert_intact("src")
    assert_equal(tgt.view, rt, f"tgt [{batch.describe()}]")
    assert_equal(src.view, rs, f"src [{batch.describe()}]")
    assert_equal(status, ref_status, "status")
    return tgt.view, src.view


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps, prefix=48),
                       generator=gen, device=device)  # fmt: skip
    out, status = _run_assign(batch, device)
    assert int(status) == 0
    _run_pairs(batch, device)
    _check_layout_semantics(batch, out)


def _check_layout_semantics(batch, out):
    """design §1 read directly (not through the reference): slots are distinct, layout A is
    contiguous in the row, layout-B branch regions are page aligned and disjoint."""
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    out = out.cpu().view(B, K, S)
    r2t = batch.req_to_token.cpu()
    for b in range(B):
        row = r2t[int(batch.req_pool_indices[b])]
        L = int(batch.seq_lens_cpu[b])
        slots = out[b].flatten()
        assert slots.unique().numel() == K * S, "draft slots of one request must be distinct"
        if not uses_layout_b(K, ps):
            assert torch.equal(out[b].flatten(), row[L : L + K * S].long())
            continue
        lpl, nnp = L % ps, draft_pages_per_branch(L, S, ps)
        for t in range(K):
            region = row[L - lpl + t * nnp * ps : L - lpl + (t + 1) * nnp * ps].long()
            assert torch.equal(out[b, t], region[lpl : lpl + S])
            assert int(region[0]) % ps == 0, "a branch region starts on a page boundary"


def test_spec_example(device):
    r2t = torch.zeros(3, 16, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(100, 116)
    r2t[2] = torch.arange(200, 216)
    out = assign_draft_cache_locs(torch.tensor([1, 2], device=device), r2t,
                                  torch.tensor([3, 1], device=device), topk=2, num_steps=2)  # fmt: skip
    assert out.tolist() == [103, 104, 105, 106, 201, 202, 203, 204]
    # ps = 4, L = 5: lpl = 1, nnp = 1; branch 1's region starts at 4 + 4 = 8.
    tgt, src = prefix_tail_copy_pairs(torch.tensor([1], device=device), r2t, torch.tensor([5], device=device),
                                      topk=2, num_steps=2, page_size=4)  # fmt: skip
    assert src.tolist() == [104, 0, 0] and tgt.tolist() == [108, 0, 0]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    k=st.sampled_from([1, 2, 3, 4, 8]),
    s=st.integers(1, 6),
    ps=st.sampled_from([1, 2, 4, 16, 64]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end"]),
    seed=st.integers(0, 2**31 - 1),
    idx32=st.booleans(),
)
def test_property(device, b, k, s, ps, shape, seed, idx32):
    batch = make_batch(shape, batch_size=b, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=2 * ps + 8),
                       generator=torch.Generator().manual_seed(seed), device=device,
                       index_dtype=torch.int32 if idx32 else torch.int64)  # fmt: skip
    out, _ = _run_assign(batch, device)
    _run_pairs(batch, device)
    _check_layout_semantics(batch, out)


def test_out_of_range_rows_and_positions_are_masked(device, gen):
    batch = make_batch("random", batch_size=6, topk=4, num_steps=3, page_size=4,
                       row_width=row_width(4, 3, 4, prefix=48), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[1] = R + 5  # past the table
    batch.req_pool_indices[2] = -1
    batch.seq_lens[3] = W - 1  # draft region runs past the row
    batch.seq_lens[4] = 10 * W
    out, status = _run_assign(batch, device)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)
    K, S = 4, 3
    assert int(out.view(-1, K, S)[1].abs().sum()) == 0, "a masked gather reads the sink"
    _run_pairs(batch, device)


def test_bad_input_raises_before_launch(device):
    r2t = torch.zeros(4, 32, dtype=torch.int32, device=device)
    rpi = torch.tensor([1, 2], device=device)
    sl = torch.tensor([3, 4], device=device)
    kw = dict(topk=2, num_steps=3)
    with pytest.raises(TypeError, match="seq_lens"):
        assign_draft_cache_locs(rpi, r2t, sl.float(), **kw)
    with pytest.raises(TypeError, match="req_to_token"):
        assign_draft_cache_locs(rpi, r2t.to(torch.int16), sl, **kw)
    with pytest.raises(ValueError, match="rank"):
        assign_draft_cache_locs(rpi, r2t[0], sl, **kw)
    with pytest.raises(ValueError, match="seq_lens must have 2"):
        assign_draft_cache_locs(rpi, r2t, sl[:1], **kw)
    with pytest.raises(ValueError, match="need 12"):
        assign_draft_cache_locs(
            rpi, r2t, sl, out_cache_loc=torch.zeros(11, dtype=torch.int64, device=device), **kw
        )
    with pytest.raises(ValueError, match="must be on"):
        assign_draft_cache_locs(rpi.to("meta"), r2t, sl, **kw)
    with pytest.raises(ValueError, match="topk"):
        assign_draft_cache_locs(rpi, r2t, sl, topk=0, num_steps=3)
    with pytest.raises(TypeError, match="status"):
        assign_draft_cache_locs(rpi, r2t, sl, status=torch.zeros(1, device=device), **kw)
    with pytest.raises(ValueError, match="tgt is too small"):
        prefix_tail_copy_pairs(rpi, r2t, sl, topk=2, num_steps=3, page_size=4,
                               tgt=torch.zeros(5, dtype=torch.int64, device=device))  # fmt: skip
