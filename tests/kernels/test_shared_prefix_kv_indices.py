"""shared_prefix_kv_indices against its reference, against the per-branch lists it replaces,
and against design §1 read directly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import shared_prefix_chain_need
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indices_ref
from specmeta.kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

CONFIGS = [(1, 3, 1), (4, 3, 1), (2, 4, 4), (3, 5, 16), (8, 2, 2)]  # (K, S, ps)


def _run(batch, device, *, rows=None, prefix_width=None, idx_dtype=torch.int32, with_sum=True):
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    rows = S if rows is None else rows
    total = batch.seq_lens_sum
    pw = total + 5 if prefix_width is None else prefix_width
    out = dict(
        prefix_kv_indices=Guarded((pw,), idx_dtype, device),
        prefix_kv_indptr=Guarded((B + 1,), torch.int32, device),
        chain_kv_indices=Guarded(
            (rows, shared_prefix_chain_need(B, K, rows) + 3), idx_dtype, device
        ),
        chain_kv_indptr=Guarded((rows, B * K + 1), torch.int32, device),
    )
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=K, num_steps=S, page_size=batch.page_size, num_rows=rows,
              seq_lens_sum=total if with_sum else None)  # fmt: skip
    status = new_status(device)
    shared_prefix_kv_indices(*args, status=status, **{k: g.view for k, g in out.items()}, **kw)
    ref = {k: g.view.clone().fill_(-3) for k, g in out.items()}
    ref_status = new_status(device)
    shared_prefix_kv_indices_ref(*args, status=ref_status, **ref, **kw)
    for name, g in out.items():
        g.assert_intact(name)
    d = f"[{batch.describe()}]"
    assert_equal(out["prefix_kv_indptr"].view, ref["prefix_kv_indptr"], f"prefix_kv_indptr {d}")
    assert_equal(out["chain_kv_indptr"].view, ref["chain_kv_indptr"], f"chain_kv_indptr {d}")
    used = min(total, pw)
    assert_equal(
        out["prefix_kv_indices"].view[:used], ref["prefix_kv_indices"][:used], f"prefix {d}"
    )
    for s in range(rows):
        n = B * K * (s + 1)
        assert_equal(
            out["chain_kv_indices"].view[s, :n], ref["chain_kv_indices"][s, :n], f"chain {d}"
        )
    assert_equal(status, ref_status, "status")
    return {k: g.view for k, g in out.items()}, status


def _check_against_spec(batch, out, rows):
    """Prefix level: row_b[0:L_b] once per request; chain level: branch z's first s+1 draft
    slots (design §1). Concatenated, branch z's two lists are its per-branch list (design §2.2)."""
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = assign_draft_cache_locs(*args, topk=K, num_steps=S, page_size=batch.page_size)
    slots = slots.cpu().view(B, K, S)
    per_branch_idx, per_branch_ptr = draft_decode_kv_indices_ref(
        *args, topk=K, num_steps=S, page_size=batch.page_size, num_rows=rows
    )
    o = {k: v.cpu() for k, v in out.items()}
    r2t = batch.req_to_token.cpu()
    for b in range(B):
        L = int(batch.seq_lens_cpu[b])
        lo, hi = int(o["prefix_kv_indptr"][b]), int(o["prefix_kv_indptr"][b + 1])
        prefix = o["prefix_kv_indices"][lo:hi].long()
        assert torch.equal(prefix, r2t[int(batch.req_pool_indices[b])][:L].long())
        for s in range(rows):
            for t in range(K):
                z = b * K + t
                clo, chi = int(o["chain_kv_indptr"][s, z]), int(o["chain_kv_indptr"][s, z + 1])
                chain = o["chain_kv_indices"][s, clo:chi].long()
                assert torch.equal(chain, slots[b, t, : s + 1])
                plo, phi = int(per_branch_ptr[s, z]), int(per_branch_ptr[s, z + 1])
                assert torch.equal(
                    torch.cat([prefix, chain]), per_branch_idx[s, plo:phi].cpu().long()
                )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps),
                       generator=gen, device=device)  # fmt: skip
    out, status = _run(batch, device)
    assert int(status) == 0
    _check_against_spec(batch, out, s)


def test_spec_example(device):
    r2t = torch.zeros(3, 16, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(100, 116)
    r2t[2] = torch.arange(200, 216)
    rpi, sl = torch.tensor([1, 2], device=device), torch.tensor([3, 1], device=device)
    pi, pp, ci, cp = shared_prefix_kv_indices(rpi, r2t, sl, topk=2, num_steps=2)
    assert pp.tolist() == [0, 3, 4] and pi[:4].tolist() == [100, 101, 102, 200]
    assert cp[1].tolist() == [0, 2, 4, 6, 8]
    assert ci[1, :8].tolist() == [103, 104, 105, 106, 201, 202, 203, 204]


def test_writes_k_times_fewer_prefix_entries(device, gen):
    """The point of the cascade: ΣL prefix entries once, not K·ΣL in each of S rows."""
    batch = make_batch("max", batch_size=4, topk=4, num_steps=3, page_size=1,
                       row_width=row_width(4, 3, 1), generator=gen, device=device)  # fmt: skip
    out, _ = _run(batch, device)
    assert int(out["prefix_kv_indptr"][-1]) == batch.seq_lens_sum
    assert out["chain_kv_indptr"][:, -1].tolist() == [4 * 4 * (s + 1) for s in range(3)]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    k=st.sampled_from([1, 2, 3, 8]),
    s=st.integers(1, 5),
    ps=st.sampled_from([1, 2, 16]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end"]),
    seed=st.integers(0, 2**31 - 1),
    rows_short=st.integers(0, 2),
    idx64=st.booleans(),
)
def test_property(device, b, k, s, ps, shape, seed, rows_short, idx64):
    batch = make_batch(shape, batch_size=b, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=2 * ps + 8),
                       generator=torch.Generator().manual_seed(seed), device=device)  # fmt: skip
    rows = max(s - rows_short, 0)
    out, status = _run(batch, device, rows=rows, idx_dtype=torch.int64 if idx64 else torch.int32)
    assert int(status) == 0
    _check_against_spec(batch, out, rows)


def test_empty_batch_writes_entry_zero(device, gen):
    batch = make_batch("empty", topk=4, num_steps=3, page_size=1, row_width=64, generator=gen,
                       device=device)  # fmt: skip
    out, status = _run(batch, device)
    assert out["prefix_kv_indptr"].tolist() == [0]
    assert out["chain_kv_indptr"][:, 0].tolist() == [0, 0, 0] and int(status) == 0


def test_too_small_prefix_buffer_without_host_total_is_masked(device, gen):
    batch = make_batch("max", batch_size=3, topk=4, num_steps=3, page_size=4,
                       row_width=row_width(4, 3, 4), generator=gen, device=device)  # fmt: skip
    _, status = _run(batch, device, prefix_width=batch.seq_lens_sum // 2, with_sum=False)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_out_of_range_inputs_are_masked(device, gen):
    batch = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=16,
                       row_width=row_width(2, 3, 16), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[2] = W - 2  # the draft region runs past the row
    batch.seq_lens_cpu[2] = W - 2
    out, status = _run(batch, device)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)
    assert out["prefix_kv_indices"][: int(out["prefix_kv_indptr"][1])].eq(0).all()


def test_bad_input_raises_before_launch(device, gen):
    batch = make_batch("random", batch_size=4, topk=2, num_steps=3, page_size=1, row_width=64,
                       generator=gen, device=device)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=2, num_steps=3)
    total = batch.seq_lens_sum
    with pytest.raises(ValueError, match=f"need {total} entries"):
        shared_prefix_kv_indices(*args, **kw, seq_lens_sum=total,
                                 prefix_kv_indices=torch.zeros(total - 1, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="need 24 columns"):
        shared_prefix_kv_indices(*args, **kw,
                                 chain_kv_indices=torch.zeros(3, 23, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="chain_kv_indptr is too small"):
        shared_prefix_kv_indices(*args, **kw,
                                 chain_kv_indptr=torch.zeros(3, 8, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="num_rows"):
        shared_prefix_kv_indices(*args, **kw, num_rows=4)
    with pytest.raises(TypeError, match="prefix_kv_indices"):
        shared_prefix_kv_indices(*args, **kw, prefix_kv_indices=torch.zeros(512, device=device))
