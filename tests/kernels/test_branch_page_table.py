"""branch_page_table against its reference and against what a per-branch row must mean: every
logical position of a branch lands on the slot that holds its token (design §1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.kernels.branch_page_table import branch_page_table, branch_page_table_ref
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

CONFIGS = [(1, 3, 1), (1, 3, 4), (4, 3, 1), (2, 4, 4), (3, 5, 16), (8, 2, 2)]  # (K, S, ps)


def _run(batch, device, *, width=None, fill=-1, rows=None, with_max=True):
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    rows = S if rows is None else rows
    width = -(-batch.req_to_token.shape[1] // ps) if width is None else width
    pt = Guarded((B * K, width), torch.int32, device)
    sl = Guarded((rows, B * K), torch.int32, device)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    max_len = int(batch.seq_lens_cpu.max()) if B and with_max else None
    kw = dict(topk=K, num_steps=S, page_size=ps, num_rows=rows, fill_value=fill,
              max_seq_len=max_len)  # fmt: skip
    status = new_status(device)
    branch_page_table(*args, page_table=pt.view, seq_lens_k=sl.view, status=status, **kw)
    ref_pt, ref_sl, ref_status = pt.view.clone().fill_(-3), sl.view.clone(), new_status(device)
    branch_page_table_ref(*args, page_table=ref_pt, seq_lens_k=ref_sl, status=ref_status, **kw)
    pt.assert_intact("page_table")
    sl.assert_intact("seq_lens_k")
    assert_equal(pt.view, ref_pt, f"page_table [{batch.describe()}]")
    assert_equal(sl.view, ref_sl, f"seq_lens_k [{batch.describe()}]")
    assert_equal(status, ref_status, "status")
    return pt.view, sl.view, status


def expected_branch_slots(batch):
    """``[B][K]`` lists of the slot holding each logical position ``q < L_b + S`` of a branch:
    the prefix's own slot, except the tail ``[base, L)`` of branches ``t ≥ 1``, which lives at
    the target of its prefix-tail copy pair, then the branch's draft slots (design §1, §2.1)."""
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = assign_draft_cache_locs(*args, topk=K, num_steps=S, page_size=ps).cpu().view(B, K, S)
    tgt, src = (x.cpu() for x in prefix_tail_copy_pairs(*args, topk=K, num_steps=S, page_size=ps))
    r2t = batch.req_to_token.cpu()
    out = []
    for b in range(B):
        L = int(batch.seq_lens_cpu[b])
        row = r2t[int(batch.req_pool_indices[b])].long()
        base = L - L % ps
        per_branch = []
        for t in range(K):
            seq = row[:L].clone()
            if t >= 1 and tgt.numel():
                first = (b * (K - 1) + t - 1) * (ps - 1)
                pairs = dict(zip(src[first : first + ps - 1].tolist(),
                                 tgt[first : first + ps - 1].tolist(), strict=True))  # fmt: skip
                for q in range(base, L):
                    seq[q] = pairs[int(row[q])]
            per_branch.append(torch.cat([seq, slots[b, t]]))
        out.append(per_branch)
    return out


def _check_against_spec(batch, pt, sl, fill):
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    pt, sl = pt.cpu().long(), sl.cpu()
    want = expected_branch_slots(batch)
    for b in range(B):
        L = int(batch.seq_lens_cpu[b])
        for t in range(K):
            r = b * K + t
            q = torch.arange(L + S)
            got = pt[r, q // ps] * ps + q % ps
            assert torch.equal(got, want[b][t]), f"branch {r}"
            used = -(-(L + S) // ps)
            assert pt[r, used:].eq(fill).all(), f"branch {r}: columns past its pages"
            assert sl[:, r].tolist() == [L + s + 1 for s in range(sl.shape[0])]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps),
                       generator=gen, device=device)  # fmt: skip
    pt, sl, status = _run(batch, device)
    assert int(status) == 0
    _check_against_spec(batch, pt, sl, -1)


def test_spec_example(device):
    r2t = torch.zeros(2, 16, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(32, 48)  # pages 8, 9, 10, 11
    pt, sl = branch_page_table(torch.tensor([1], device=device), r2t,
                               torch.tensor([5], device=device), topk=2, num_steps=2, page_size=4)  # fmt: skip
    assert pt[:, :3].tolist() == [[8, 9, 0], [8, 10, 0]]
    assert sl.tolist() == [[6, 6], [7, 7]]


def test_k1_rows_equal_the_requests_own_pages(device, gen):
    """With one branch the row is the request's page row over L + S tokens."""
    batch = make_batch("random", batch_size=6, topk=1, num_steps=4, page_size=4,
                       row_width=row_width(1, 4, 4), generator=gen, device=device)  # fmt: skip
    pt, _, _ = _run(batch, device, fill=0)
    r2t = batch.req_to_token.cpu()
    for b in range(6):
        L = int(batch.seq_lens_cpu[b])
        n = -(-(L + 4) // 4)
        row = r2t[int(batch.req_pool_indices[b])].long()
        assert pt[b, :n].cpu().long().tolist() == (row[: n * 4 : 4] // 4).tolist()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 7),
    k=st.sampled_from([1, 2, 3, 8]),
    s=st.integers(1, 5),
    ps=st.sampled_from([1, 2, 16, 64]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end"]),
    seed=st.integers(0, 2**31 - 1),
    fill=st.sampled_from([0, -1]),
)
def test_property(device, b, k, s, ps, shape, seed, fill):
    batch = make_batch(shape, batch_size=b, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=2 * ps + 8),
                       generator=torch.Generator().manual_seed(seed), device=device)  # fmt: skip
    pt, sl, status = _run(batch, device, fill=fill)
    assert int(status) == 0
    _check_against_spec(batch, pt, sl, fill)


def test_empty_batch(device, gen):
    batch = make_batch("empty", topk=4, num_steps=3, page_size=4, row_width=64, generator=gen,
                       device=device)  # fmt: skip
    pt, sl, status = _run(batch, device)
    assert pt.shape[0] == 0 and int(status) == 0


def test_narrow_table_without_host_max_is_masked(device, gen):
    batch = make_batch("max", batch_size=3, topk=2, num_steps=3, page_size=4,
                       row_width=row_width(2, 3, 4), generator=gen, device=device)  # fmt: skip
    _, _, status = _run(batch, device, width=3, with_max=False)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_out_of_range_inputs_are_masked(device, gen):
    batch = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=16,
                       row_width=row_width(2, 3, 16), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[2] = W - 2  # the branch regions run past the row
    batch.seq_lens_cpu[2] = W - 2
    pt, _, status = _run(batch, device, width=W // 16 + 4, with_max=False)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)
    used = -(-(int(batch.seq_lens_cpu[0]) + 3) // 16)
    assert pt[0:2, :used].eq(0).all(), "a bad row reads the sink page"


def test_bad_input_raises_before_launch(device, gen):
    batch = make_batch("random", batch_size=4, topk=2, num_steps=3, page_size=4, row_width=64,
                       generator=gen, device=device)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=2, num_steps=3, page_size=4)
    with pytest.raises(ValueError, match="need 6 columns"):
        branch_page_table(*args, **kw, max_seq_len=20,
                          page_table=torch.zeros(8, 5, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="page_table is too small"):
        branch_page_table(
            *args, **kw, page_table=torch.zeros(7, 16, dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="seq_lens_k is too small"):
        branch_page_table(
            *args, **kw, seq_lens_k=torch.zeros(3, 7, dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="page_size"):
        branch_page_table(*args, topk=2, num_steps=3, page_size=0)
    with pytest.raises(TypeError, match="max_seq_len"):
        branch_page_table(*args, **kw, max_seq_len=torch.tensor(20))
