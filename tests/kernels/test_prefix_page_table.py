"""prefix_page_table against its reference and against design §2.3 (normal pass) read directly."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import ROW_ALIGN
from specmeta.kernels._common import vector_widths as _vectors
from specmeta.kernels.prefix_page_table import prefix_page_table, prefix_page_table_ref
from specmeta.workloads import SHAPES, make_batch
from tests._support import check_prefix_page_table_spec, row_width
from tests.guard_bands import Guarded, assert_equal

# (K, S, ps, extra_tokens, exclude_last_partial, num_rows, fill_value): the FA3 normal pass
# (layout A and B), K == 1 draft decode (extra 1, rows S), verify/extend (extra N), TRT-LLM (-1).
CASES = [
    (1, 3, 1, 0, False, None, 0),
    (4, 3, 16, 0, True, None, 0),
    (2, 4, 4, 0, True, None, 0),
    (1, 4, 4, 1, False, 4, 0),
    (1, 3, 16, 1, False, 2, -1),
    (4, 2, 1, 5, False, None, 0),
    (2, 3, 64, 7, False, None, -1),
]


def _draw(shape, gen, device, k, s, ps, extra, batch_size=None, prefix=40):
    return make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                      row_width=row_width(k, s, ps, extra=extra, prefix=prefix), generator=gen, device=device,
                      extra_tokens=extra + s)  # fmt: skip


def _run(batch, device, *, extra, exclude, rows, fill, width=None, dtype=torch.int32):
    """Kernel into guarded, poisoned buffers; reference into plain ones; both compared exactly."""
    B, ps = batch.batch_size, batch.page_size
    width = -(-batch.req_to_token.shape[1] // ps) if width is None else width
    kw = dict(page_size=ps, extra_tokens=extra, exclude_last_partial=exclude, fill_value=fill,
              num_rows=rows)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    seq_shape = (B,) if rows is None else (rows, B)
    cu_shape = (B + 1,) if rows is None else (rows, B + 1)
    pt = Guarded((B, width), dtype, device)
    cs = Guarded(seq_shape, dtype, device)
    cu = Guarded(cu_shape, dtype, device)
    status = new_status(device)
    prefix_page_table(*args, page_table=pt.view, cache_seqlens=cs.view, cu_seqlens_k=cu.view,
                      status=status, **kw)  # fmt: skip
    ref_pt = torch.full((B, width), -3, dtype=dtype, device=device)
    ref_cs = torch.full(seq_shape, -3, dtype=dtype, device=device)
    ref_cu = torch.full(cu_shape, -3, dtype=dtype, device=device)
    ref_status = new_status(device)
    prefix_page_table_ref(*args, page_table=ref_pt, cache_seqlens=ref_cs, cu_seqlens_k=ref_cu,
                          status=ref_status, **kw)  # fmt: skip
    for g, name in ((pt, "page_table"), (cs, "cache_seqlens"), (cu, "cu_seqlens_k")):
        g.assert_intact(name)
    what = batch.describe()
    assert_equal(pt.view, ref_pt, f"page_table [{what}]")
    assert_equal(cs.view, ref_cs, f"cache_seqlens [{what}]")
    assert_equal(cu.view, ref_cu, f"cu_seqlens_k [{what}]")
    assert_equal(status, ref_status, "status")
    return pt.view, cs.view, cu.view, status


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps,extra,exclude,rows,fill", CASES)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps, extra, exclude, rows, fill):
    batch = _draw(shape, gen, device, k, s, ps, extra)
    kw = dict(extra=extra, exclude=exclude, rows=rows, fill=fill)
    pt, cs, cu, status = _run(batch, device, **kw)
    assert int(status) == 0
    check_prefix_page_table_spec(batch, pt, cs, cu, **kw)


def test_spec_example(device):
    r2t = torch.zeros(2, 12, dtype=torch.int32, device=device)
    r2t[1] = torch.tensor([40, 41, 42, 43, 12, 13, 14, 15, 80, 81, 82, 83])
    args = (torch.tensor([1], device=device), r2t, torch.tensor([5], device=device))
    pt = torch.full((1, 3), -1, dtype=torch.int32, device=device)
    _, cs = prefix_page_table(*args, page_size=4, page_table=pt)
    assert pt.tolist() == [[10, 3, 0]] and cs.tolist() == [5]
    _, cs = prefix_page_table(*args, page_size=4, exclude_last_partial=True, page_table=pt)
    assert pt.tolist() == [[10, 0, 0]] and cs.tolist() == [4]
    _, cs = prefix_page_table(*args, page_size=4, extra_tokens=2, num_rows=2, page_table=pt)
    assert pt.tolist() == [[10, 3, 0]] and cs.tolist() == [[7], [8]]
    _, cs = prefix_page_table(*args, page_size=4, extra_tokens=4, fill_value=-1, page_table=pt)
    assert pt.tolist() == [[10, 3, 20]] and cs.tolist() == [9]
    prefix_page_table(*args, page_size=4, fill_value=-1, page_table=pt)
    assert pt.tolist() == [[10, 3, -1]], "the tail is rewritten, nothing stale is left"


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    ps=st.sampled_from([1, 2, 4, 16, 64]),
    extra=st.integers(0, 9),
    exclude=st.booleans(),
    rows=st.sampled_from([None, 1, 3]),
    fill=st.sampled_from([0, -1]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end", "long_short"]),
    seed=st.integers(0, 2**31 - 1),
    out64=st.booleans(),
    idx32=st.booleans(),
)
def test_property(device, b, ps, extra, exclude, rows, fill, shape, seed, out64, idx32):
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(shape, batch_size=b, topk=2, num_steps=3, page_size=ps,
                       row_width=row_width(2, 3, ps, extra=extra + 3, prefix=2 * ps + 8), generator=g,
                       device=device, extra_tokens=extra + 3,
                       index_dtype=torch.int32 if idx32 else torch.int64)  # fmt: skip
    kw = dict(extra=extra, exclude=exclude, rows=rows, fill=fill)
    pt, cs, cu, status = _run(batch, device, dtype=torch.int64 if out64 else torch.int32, **kw)
    assert int(status) == 0
    check_prefix_page_table_spec(batch, pt, cs, cu, **kw)


def test_vector_access_needs_aligned_rows_of_whole_vectors():
    t = torch.zeros(4, 32, dtype=torch.int32)
    assert _vectors(t, t, 1) == dict(VEC_IN=4, VEC_OUT=4)
    assert _vectors(t.long(), t.long(), 1) == dict(VEC_IN=2, VEC_OUT=2)
    assert _vectors(t, t, 4)["VEC_IN"] == 1, "a strided gather (ps > 1) loads scalars"
    assert _vectors(t[:, 1:], t[:, 2:], 1) == dict(VEC_IN=1, VEC_OUT=1), "rows off a vector"
    u = torch.zeros(4, 30, dtype=torch.int32)
    assert _vectors(u, u, 1) == dict(VEC_IN=1, VEC_OUT=1), "120-byte rows"
    assert _vectors(t[:, :30], t[:, :30], 1) == dict(VEC_IN=1, VEC_OUT=1), "30 of 32 columns"


@pytest.mark.parametrize("slot64", [False, True])
@pytest.mark.parametrize("rows,fill", [(None, 0), (3, -1)])
def test_vector_gather_uses_only_the_slots_it_covers(device, gen, slot64, rows, fill):
    """Page size 1 with rows of whole 16-position lines (SpecConfig's default width): the gather
    loads whole 16-byte vectors, up to 3 slots past a request's last page. Those slots, here
    negative or a page of another request, are neither written nor reported."""
    width = -(-row_width(2, 3, 1, extra=3) // ROW_ALIGN) * ROW_ALIGN
    batch = make_batch("random", batch_size=7, topk=2, num_steps=3, page_size=1, row_width=width,
                       generator=gen, device=device, extra_tokens=3)  # fmt: skip
    if slot64:
        batch.req_to_token = batch.req_to_token.long()
    extra = 0 if rows is None else 1
    for b in range(batch.batch_size):
        end = int(batch.seq_lens_cpu[b]) + extra + (rows or 1) - 1  # positions the table covers
        for pos, junk in zip(range(end, min(end + 3, width)), (-6, 7777, -6), strict=False):
            batch.req_to_token[int(batch.req_pool_indices[b]), pos] = junk
    table = torch.empty(batch.batch_size, width, dtype=torch.int32, device=device)
    vec = _vectors(batch.req_to_token, table, 1)
    assert vec == dict(VEC_IN=16 // batch.req_to_token.element_size(), VEC_OUT=4)
    kw = dict(extra=extra, exclude=False, rows=rows, fill=fill)
    pt, cs, cu, status = _run(batch, device, width=width, **kw)
    assert int(status) == 0
    check_prefix_page_table_spec(batch, pt, cs, cu, **kw)


@pytest.mark.parametrize("B", [12, 13])
def test_cu_seqlens_scan_past_one_block(device, gen, monkeypatch, B):
    """One program scans seq_lens for cu_seqlens_k in blocks of BLOCK_B (1024), carrying the
    sum from block to block and row to row. A 4-wide block runs the loop with 12 requests (the
    closing entry alone in the last block) and with 13."""
    # The package re-exports a function of the module's name: fetch the module itself.
    module = importlib.import_module("specmeta.kernels.prefix_page_table")
    monkeypatch.setattr(module, "_BLOCK_B", 4)
    batch = _draw("random", gen, device, 1, 3, 4, 1, batch_size=B)
    kw = dict(extra=1, exclude=False, rows=3, fill=0)
    pt, cs, cu, status = _run(batch, device, **kw)
    assert int(status) == 0
    check_prefix_page_table_spec(batch, pt, cs, cu, **kw)


def test_empty_batch_writes_only_entry_zero(device, gen):
    batch = _draw("empty", gen, device, 1, 3, 4, 1)
    _, cs, cu, status = _run(batch, device, extra=1, exclude=False, rows=3, fill=0)
    assert cu.tolist() == [[0], [0], [0]] and cs.numel() == 0 and int(status) == 0
    out, _ = prefix_page_table(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                               page_size=4)  # fmt: skip
    assert out.shape[0] == 0


def test_out_of_range_inputs_are_masked(device, gen):
    batch = _draw("random", gen, device, 2, 3, 4, 0, batch_size=6)
    R, W_row = batch.req_to_token.shape
    batch.req_pool_indices[0] = R  # ROW_OOB: the row reads as the sink
    batch.seq_lens[1] = -5  # POS_OOB: read as L = 0
    batch.seq_lens[2] = W_row + 9  # POS_OOB: pages past the row read 0
    row3 = int(batch.req_pool_indices[3])
    batch.seq_lens[3] = batch.seq_lens[3].clamp_min(1)  # the negative slot is in its table
    batch.req_to_token[row3, 0] = -4  # POOL_OOB: a negative slot id reads page 0
    n_row = W_row // 4  # the table is wide enough for request 2: no capacity problem
    pt, cs, _, status = _run(batch, device, extra=0, exclude=False, rows=None, fill=0,
                             width=n_row + 4)  # fmt: skip
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB | Status.POOL_OOB)
    assert not pt[0].any() and int(cs[1]) == 0 and int(pt[3, 0]) == 0
    assert not pt[2, n_row:].any() and int(cs[2]) == W_row + 9


def test_narrow_table_drops_pages_and_clamps_lengths(device, gen):
    batch = _draw("max", gen, device, 1, 2, 4, 0, batch_size=3)
    _, cs, cu, status = _run(batch, device, extra=0, exclude=False, rows=2, fill=0, width=2)
    assert int(status) == int(Status.OUT_OF_CAPACITY)
    assert int(cs.max()) <= 2 * 4, "a consumer is never told to read past its table"
    assert torch.equal(cu[:, 1:].long(), cs.long().cumsum(1))


def test_bad_arguments_raise_before_launch(device, gen):
    batch = _draw("random", gen, device, 1, 2, 4, 0, batch_size=4)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)

    def i32(*shape):
        return torch.zeros(shape, dtype=torch.int32, device=device)

    with pytest.raises(ValueError, match="page_table is too small: need 4 rows"):
        prefix_page_table(*args, page_size=4, page_table=i32(3, 8))
    with pytest.raises(ValueError, match="cache_seqlens is too small: need 4"):
        prefix_page_table(*args, page_size=4, cache_seqlens=i32(3))
    with pytest.raises(ValueError, match="cu_seqlens_k is too small: need 5"):
        prefix_page_table(*args, page_size=4, cu_seqlens_k=i32(4))
    with pytest.raises(ValueError, match="cache_seqlens is too small: need 3 rows"):
        prefix_page_table(*args, page_size=4, num_rows=3, cache_seqlens=i32(2, 4))
    with pytest.raises(ValueError, match="cache_seqlens must have rank 2"):
        prefix_page_table(*args, page_size=4, num_rows=2, cache_seqlens=i32(4))
    with pytest.raises(TypeError, match="page_table must be int32 or int64"):
        prefix_page_table(*args, page_size=4, page_table=i32(4, 8).float())
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        prefix_page_table(*args, page_size=4, num_rows=0)
    with pytest.raises(ValueError, match="extra_tokens must be >= 0"):
        prefix_page_table(*args, page_size=4, extra_tokens=-1)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        prefix_page_table(*args, page_size=0)
    with pytest.raises(TypeError, match="fill_value"):
        prefix_page_table(*args, page_size=4, fill_value=True)
    with pytest.raises(TypeError, match="exclude_last_partial"):
        prefix_page_table(*args, page_size=4, exclude_last_partial=1)
    with pytest.raises(ValueError, match="seq_lens must have 4 elements"):
        prefix_page_table(batch.req_pool_indices, batch.req_to_token, batch.seq_lens[:3],
                          page_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="status"):
        prefix_page_table(*args, page_size=4, status=i32(2))
