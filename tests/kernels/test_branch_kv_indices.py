"""branch_kv_indices against its reference, against the per-branch page rows it flattens, and
against draft_decode_kv_indices (which it equals for page size 1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import branch_kv_indices_need
from specmeta.kernels.branch_kv_indices import branch_kv_indices, branch_kv_indices_ref
from specmeta.kernels.branch_page_table import branch_page_table_ref
from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indices_ref
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

CONFIGS = [(1, 3, 4), (4, 3, 1), (2, 4, 4), (3, 5, 16), (8, 2, 2)]  # (K, S, ps)


def _run(batch, device, *, rows=None, width=None, with_sum=True):
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    rows = S if rows is None else rows
    need = branch_kv_indices_need(batch.seq_lens_sum, B, K, rows, ps)
    width = need + 3 if width is None else width
    out = dict(
        kv_indices=Guarded((rows, width), torch.int32, device),
        kv_indptr=Guarded((rows, B * K + 1), torch.int32, device),
        kv_last_page_len=Guarded((rows, B * K), torch.int32, device),
    )
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=K, num_steps=S, page_size=ps, num_rows=rows,
              seq_lens_sum=batch.seq_lens_sum if with_sum else None)  # fmt: skip
    status = new_status(device)
    branch_kv_indices(*args, status=status, **{k: g.view for k, g in out.items()}, **kw)
    ref = {k: g.view.clone().fill_(-3) for k, g in out.items()}
    ref_status = new_status(device)
    branch_kv_indices_ref(*args, status=ref_status, **ref, **kw)
    for name, g in out.items():
        g.assert_intact(name)
    d = f"[{batch.describe()}]"
    assert_equal(out["kv_indptr"].view, ref["kv_indptr"], f"kv_indptr {d}")
    assert_equal(out["kv_last_page_len"].view, ref["kv_last_page_len"], f"kv_last_page_len {d}")
    for s in range(rows):
        used = min(int(ref["kv_indptr"][s, -1]), width)
        assert_equal(out["kv_indices"].view[s, :used], ref["kv_indices"][s, :used], f"row {s} {d}")
    assert_equal(status, ref_status, "status")
    return {k: g.view for k, g in out.items()}, status


def _check_against_spec(batch, out, rows):
    """Branch z at step s lists the first ceil((L + s + 1)/ps) pages of its per-branch row, and
    its last page holds (L + s) mod ps + 1 tokens."""
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    table, _ = branch_page_table_ref(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                     topk=K, num_steps=S, page_size=ps)  # fmt: skip
    o = {k: v.cpu() for k, v in out.items()}
    for s in range(rows):
        assert int(o["kv_indptr"][s, 0]) == 0
        for b in range(B):
            L = int(batch.seq_lens_cpu[b])
            n = -(-(L + s + 1) // ps)
            for t in range(K):
                z = b * K + t
                lo, hi = int(o["kv_indptr"][s, z]), int(o["kv_indptr"][s, z + 1])
                assert hi - lo == n
                assert torch.equal(o["kv_indices"][s, lo:hi], table[z, :n].cpu())
                assert int(o["kv_last_page_len"][s, z]) == (L + s) % ps + 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps),
                       generator=gen, device=device)  # fmt: skip
    out, status = _run(batch, device)
    assert int(status) == 0
    _check_against_spec(batch, out, s)


@pytest.mark.parametrize("k", [1, 4])
def test_page_size_one_equals_the_per_branch_token_lists(device, gen, k):
    batch = make_batch("random", batch_size=5, topk=k, num_steps=3, page_size=1,
                       row_width=row_width(k, 3, 1), generator=gen, device=device)  # fmt: skip
    out, _ = _run(batch, device)
    idx, ptr = draft_decode_kv_indices_ref(batch.req_pool_indices, batch.req_to_token,
                                           batch.seq_lens, topk=k, num_steps=3)  # fmt: skip
    assert_equal(out["kv_indptr"], ptr, "kv_indptr")
    for s in range(3):
        n = int(ptr[s, -1])
        assert_equal(out["kv_indices"][s, :n], idx[s, :n], f"kv_indices[{s}]")
    assert out["kv_last_page_len"].eq(1).all()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 7),
    k=st.sampled_from([1, 2, 3, 8]),
    s=st.integers(1, 5),
    ps=st.sampled_from([1, 2, 16, 64]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end"]),
    seed=st.integers(0, 2**31 - 1),
    rows_short=st.integers(0, 2),
)
def test_property(device, b, k, s, ps, shape, seed, rows_short):
    batch = make_batch(shape, batch_size=b, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=2 * ps + 8),
                       generator=torch.Generator().manual_seed(seed), device=device)  # fmt: skip
    rows = max(s - rows_short, 0)
    out, status = _run(batch, device, rows=rows)
    assert int(status) == 0
    _check_against_spec(batch, out, rows)


def test_empty_batch_writes_entry_zero(device, gen):
    batch = make_batch("empty", topk=4, num_steps=3, page_size=4, row_width=64, generator=gen,
                       device=device)  # fmt: skip
    out, status = _run(batch, device)
    assert out["kv_indptr"][:, 0].tolist() == [0, 0, 0] and int(status) == 0


def test_too_small_buffer_without_host_total_is_masked(device, gen):
    batch = make_batch("max", batch_size=3, topk=4, num_steps=3, page_size=4,
                       row_width=row_width(4, 3, 4), generator=gen, device=device)  # fmt: skip
    need = branch_kv_indices_need(batch.seq_lens_sum, 3, 4, 3, 4)
    _, status = _run(batch, device, width=need // 2, with_sum=False)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_out_of_range_inputs_are_masked(device, gen):
    batch = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=16,
                       row_width=row_width(2, 3, 16), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[2] = W - 2  # the branch regions run past the row
    batch.seq_lens_cpu[2] = W - 2
    out, status = _run(batch, device)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)
    assert out["kv_indices"][0, : int(out["kv_indptr"][0, 2])].eq(0).all()


def test_bad_input_raises_before_launch(device, gen):
    batch = make_batch("random", batch_size=4, topk=2, num_steps=3, page_size=4, row_width=64,
                       generator=gen, device=device)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=2, num_steps=3, page_size=4)
    need = branch_kv_indices_need(batch.seq_lens_sum, 4, 2, 3, 4)
    with pytest.raises(ValueError, match=f"need {need} columns"):
        branch_kv_indices(*args, **kw, seq_lens_sum=batch.seq_lens_sum,
                          kv_indices=torch.zeros(3, need - 1, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="kv_last_page_len is too small"):
        branch_kv_indices(*args, **kw,
                          kv_last_page_len=torch.zeros(3, 7, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="kv_indptr is too small"):
        branch_kv_indices(
            *args, **kw, kv_indptr=torch.zeros(2, 9, dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="num_rows"):
        branch_kv_indices(*args, **kw, num_rows=4)
