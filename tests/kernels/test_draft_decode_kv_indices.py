"""draft_decode_kv_indices against its reference and against design §2.2 read directly."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

# The package re-exports the launcher under the module's name; fetch the module itself.
kv_module = importlib.import_module("specmeta.kernels.draft_decode_kv_indices")

CONFIGS = [(1, 3, 1), (2, 2, 4), (4, 3, 1), (3, 5, 16), (8, 2, 2), (2, 6, 64)]  # (K, S, ps)


def _run(batch, device, *, rows=None, width=None, idx_dtype=torch.int32, with_sum=True, spare=7,
         margin=64):  # fmt: skip
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    rows = S if rows is None else rows
    need = draft_decode_kv_indices_need(batch.seq_lens_sum, B, K, rows)
    width = need + spare if width is None else width
    kw = dict(topk=K, num_steps=S, page_size=batch.page_size, num_rows=rows)
    if with_sum:
        kw["seq_lens_sum"] = batch.seq_lens_sum
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    idx = Guarded((rows, width), idx_dtype, device, margin=margin)
    ptr = Guarded((rows, B * K + 1), torch.int32, device)
    status = new_status(device)
    draft_decode_kv_indices(*args, kv_indices=idx.view, kv_indptr=ptr.view, status=status, **kw)
    ref_idx = idx.view.clone().fill_(-3)
    ref_ptr = ptr.view.clone().fill_(-3)
    ref_status = new_status(device)
    draft_decode_kv_indices_ref(
        *args, kv_indices=ref_idx, kv_indptr=ref_ptr, status=ref_status, **kw
    )
    idx.assert_intact("kv_indices")
    ptr.assert_intact("kv_indptr")
    assert_equal(ptr.view, ref_ptr, f"kv_indptr [{batch.describe()}]")
    # Entries past a row's use are never read: compare the used prefix of each row only.
    for s in range(rows):
        used = min(draft_decode_kv_indices_need(batch.seq_lens_sum, B, K, s + 1), width)
        assert_equal(idx.view[s, :used], ref_idx[s, :used], f"kv_indices[{s}] [{batch.describe()}]")
    assert_equal(status, ref_status, "status")
    return idx.view, ptr.view, status


def _check_against_spec(batch, idx, ptr, rows):
    """Each branch's list is its prefix then its own chain (design §2.2), with the chain read from
    assign_draft_cache_locs' slots (design §1)."""
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=K, num_steps=S, page_size=batch.page_size)  # fmt: skip
    slots = slots.cpu().view(B, K, S)
    idx, ptr, r2t = idx.cpu(), ptr.cpu(), batch.req_to_token.cpu()
    for s in range(rows):
        assert int(ptr[s, 0]) == 0
        for b in range(B):
            row = r2t[int(batch.req_pool_indices[b])].long()
            L = int(batch.seq_lens_cpu[b])
            for t in range(K):
                z = b * K + t
                lo, hi = int(ptr[s, z]), int(ptr[s, z + 1])
                want = torch.cat([row[:L], slots[b, t, : s + 1]])
                assert hi - lo == L + s + 1
                assert torch.equal(idx[s, lo:hi].long(), want), f"step {s} branch {z}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps),
                       generator=gen, device=device)  # fmt: skip
    idx, ptr, status = _run(batch, device)
    assert int(status) == 0
    _check_against_spec(batch, idx, ptr, s)


# Vector stores (which the launcher picks only for launches of many MB) at the default tiles and
# at tiles far smaller than the defaults, so that the CPU tier's short rows cross chunk
# boundaries, lists split into several groups and a vector-aligned body meets a chunk edge (the
# shifted loads reach into the next chunk); and scalar stores at a small tile.
TILES = [(True, 1024, 8), (True, 64, 1), (True, 16, 3), (False, 16, 2), (True, 32, 40)]


@pytest.mark.parametrize("aligned,block,lists", TILES)
@pytest.mark.parametrize("shape", ["random", "long_short", "near_row_end"])
def test_tiles_match_reference(device, gen, monkeypatch, shape, aligned, block, lists):
    monkeypatch.setattr(kv_module, "_VECTOR_STORES_MIN", 0 if aligned else 1 << 62)
    monkeypatch.setattr(kv_module, "_BLOCK", block)
    monkeypatch.setattr(kv_module, "_LISTS_PER_PROGRAM", lists)
    # Each configuration with one index dtype, the two dtypes in turn (the CPU tier's time).
    configs = [(2, 3, 1, torch.int32), (4, 2, 4, torch.int64), (1, 4, 16, torch.int32)]
    if shape == "long_short":
        configs = [(k, s, ps, torch.int64 if d == torch.int32 else torch.int32)
                   for k, s, ps, d in configs]  # fmt: skip
    for k, s, ps, idx_dtype in configs:
        batch = make_batch(shape, topk=k, num_steps=s, page_size=ps,
                           row_width=row_width(k, s, ps, prefix=97), generator=gen,
                           device=device)  # fmt: skip
        _, _, status = _run(batch, device, idx_dtype=idx_dtype)
        assert int(status) == 0


def test_spec_example(device):
    r2t = torch.zeros(3, 16, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(100, 116)
    r2t[2] = torch.arange(200, 216)
    rpi, sl = torch.tensor([1, 2], device=device), torch.tensor([3, 1], device=device)
    idx, ptr = draft_decode_kv_indices(rpi, r2t, sl, topk=2, num_steps=2, num_rows=1)
    assert ptr[0].tolist() == [0, 4, 8, 10, 12]
    # branch (0,0): prefix 100..102 + own slot 103; branch (0,1): prefix + slot 105 (L + t·S)
    assert idx[0, :12].tolist() == [100, 101, 102, 103, 100, 101, 102, 105, 200, 201, 200, 203]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    k=st.sampled_from([1, 2, 3, 4, 8]),
    s=st.integers(1, 6),
    ps=st.sampled_from([1, 2, 4, 16, 64]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end", "long_short"]),
    seed=st.integers(0, 2**31 - 1),
    rows_short=st.integers(0, 2),
    idx64=st.booleans(),
)
def test_property(device, b, k, s, ps, shape, seed, rows_short, idx64):
    batch = make_batch(shape, batch_size=b, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=2 * ps + 8),
                       generator=torch.Generator().manual_seed(seed), device=device)  # fmt: skip
    rows = max(s - rows_short, 0)
    idx, ptr, status = _run(
        batch, device, rows=rows, idx_dtype=torch.int64 if idx64 else torch.int32
    )
    assert int(status) == 0
    _check_against_spec(batch, idx, ptr, rows)


def test_empty_batch_writes_entry_zero(device, gen):
    batch = make_batch(
        "empty", topk=4, num_steps=3, page_size=1, row_width=64, generator=gen, device=device
    )
    idx, ptr, status = _run(batch, device)
    assert ptr[:, 0].tolist() == [0, 0, 0] and int(status) == 0


def test_too_small_buffer_without_host_total_is_masked(device, gen):
    batch = make_batch("max", batch_size=3, topk=4, num_steps=3, page_size=4,
                       row_width=row_width(4, 3, 4), generator=gen, device=device)  # fmt: skip
    need = draft_decode_kv_indices_need(batch.seq_lens_sum, 3, 4, 3)
    # Guard bands as wide as the whole need: an unmasked store lands in them, not past them.
    _, _, status = _run(batch, device, width=need // 2, with_sum=False, margin=3 * need)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_out_of_range_inputs_are_masked(device, gen):
    batch = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=16,
                       row_width=row_width(2, 3, 16), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[2] = W + 3  # the prefix itself runs past the row
    batch.seq_lens_cpu[2] = W + 3
    _, _, status = _run(batch, device)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)


def test_capacity_checked_before_launch(device, gen):
    batch = make_batch("random", batch_size=4, topk=2, num_steps=3, page_size=1, row_width=64,
                       generator=gen, device=device)  # fmt: skip
    need = draft_decode_kv_indices_need(batch.seq_lens_sum, 4, 2, 3)
    small = torch.zeros(3, need - 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"need {need} columns"):
        draft_decode_kv_indices(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, topk=2,
                                num_steps=3, kv_indices=small, seq_lens_sum=batch.seq_lens_sum)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    with pytest.raises(ValueError, match="kv_indptr is too small"):
        draft_decode_kv_indices(*args, topk=2, num_steps=3,
                                kv_indptr=torch.zeros(3, 8, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        draft_decode_kv_indices(*args, topk=2, num_steps=3,
                                kv_indices=torch.zeros(2, 4096, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="num_rows"):
        draft_decode_kv_indices(*args, topk=2, num_steps=3, num_rows=4)
    with pytest.raises(TypeError, match="kv_indices"):
        draft_decode_kv_indices(*args, topk=2, num_steps=3,
                                kv_indices=torch.zeros(3, 4096, dtype=torch.float32, device=device))  # fmt: skip
    with pytest.raises(TypeError, match="seq_lens_sum"):
        draft_decode_kv_indices(*args, topk=2, num_steps=3, seq_lens_sum=torch.tensor(5))


def test_host_indptr_helpers_reject_a_small_buffer_before_writing(device):
    """The torch helpers the FlashInfer mirrors call write into buffers they are given: a
    buffer too small is refused, naming it, before anything is written."""
    from specmeta.kernels.branch_kv_indices import branch_kv_indptr
    from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indptr

    lens = torch.tensor([3, 5], dtype=torch.int64)
    small = torch.full((2, 4), -1, dtype=torch.int32)  # B·K + 1 = 5 columns needed
    with pytest.raises(ValueError, match=r"out is too small: need 5 columns"):
        draft_decode_kv_indptr(lens, 2, 2, out=small)
    ptr = torch.full((2, 5), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_last_page_len is too small: need 4 columns"):
        branch_kv_indptr(lens, 2, 2, 4, ptr, torch.full((2, 3), -1, dtype=torch.int32))
    assert small.eq(-1).all() and ptr.eq(-1).all(), "nothing was written"
    # And the values themselves: list b·K + t of step s holds L_b + s + 1 entries.
    got = draft_decode_kv_indptr(lens, 2, 2)
    assert got.tolist() == [[0, 4, 8, 14, 20], [0, 5, 10, 17, 24]]


def test_indptr_rule_with_constants_rejects_shapes_it_was_not_made_for():
    """DraftDecodeIndptr (the mirrors' form of the rule) refuses, naming the value and the
    fix, a batch or rows past its maxima, an out of the wrong width or dtype, and lengths of
    the wrong dtype, each before writing; within them, list b·K + t of step s holds
    L_b + s + 1 entries, whatever shapes came before."""
    from specmeta.kernels.draft_decode_kv_indices import DraftDecodeIndptr

    def blank(*shape, dtype=torch.int32):
        return torch.full(shape, -1, dtype=dtype)

    rule = DraftDecodeIndptr(2, 3, 4, torch.int32)
    lens = torch.tensor([3, 5, 0], dtype=torch.int32)
    bad = [
        (ValueError, r"5 requests and 3 rows, over the 4 and 3",
         torch.zeros(5, dtype=torch.int32), blank(3, 11)),
        (ValueError, r"3 requests and 4 rows, over the 4 and 3", lens, blank(4, 7)),
        (ValueError, r"out has shape \[3, 6\]; pass the \[rows, B\*topk \+ 1\] = \[3, 7\]",
         lens, blank(3, 6)),
        (TypeError, r"out must be int32, got int64", lens, blank(3, 7, dtype=torch.int64)),
        (TypeError, r"seq_lens must be int32, got int64", lens.long(), blank(3, 7)),
    ]  # fmt: skip
    for error, message, lengths, target in bad:
        with pytest.raises(error, match=message):
            rule(lengths, target)
        assert target.eq(-1).all(), f"{message}: nothing was written"
    with pytest.raises(ValueError, match="max_batch must be >= 0, got -1"):
        DraftDecodeIndptr(2, 3, -1, torch.int32)
    with pytest.raises(TypeError, match="dtype must be torch.int32 or torch.int64"):
        DraftDecodeIndptr(2, 3, 4, torch.float32)
    for rows, B in ((3, 3), (1, 2), (3, 0), (2, 3)):  # the views of each shape, reused
        got = rule(lens[:B], blank(rows, 2 * B + 1))
        sizes = [[lens[z // 2].item() + s + 1 for z in range(2 * B)] for s in range(rows)]
        want = [[sum(row[:z]) for z in range(2 * B + 1)] for row in sizes]
        assert got.tolist() == want, (rows, B)
