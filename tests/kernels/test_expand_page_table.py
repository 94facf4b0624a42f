"""expand_page_table against its reference and against design §1 / §2.3 read directly, including
the adversarial inputs of seed 001 (a scatter past its rows) and the empty batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.expand_page_table import expand_page_table, expand_page_table_ref
from specmeta.workloads import SHAPES, make_batch
from tests._support import check_expand_page_table_spec, row_width
from tests.guard_bands import POISON, Guarded, assert_equal

CONFIGS = [(1, 3, 1), (2, 2, 4), (4, 3, 1), (3, 5, 16), (8, 2, 2), (2, 6, 64), (1, 4, 4)]


def _draw(shape, gen, device, k, s, ps, batch_size=None, prefix=40):
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=prefix), generator=gen, device=device)  # fmt: skip
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    return batch, slots


def _run(slots, seq_lens, device, *, k, s, ps, rows=None, width=None, spare_rows=0,
         dtype=torch.int32):  # fmt: skip
    """Kernel into guarded, poisoned buffers (``spare_rows`` extra branch rows, as a planned
    ``Bp·K`` buffer has); reference into plain ones; compared exactly."""
    B = seq_lens.shape[0]
    rows = s if rows is None else rows
    width = rows if width is None else width
    BK = B * k
    pt = Guarded((rows, BK + spare_rows, width), dtype, device)
    cs = Guarded((rows, BK + spare_rows), dtype, device)
    cu = Guarded((rows, BK + 1 + spare_rows), dtype, device)
    status = new_status(device)
    kw = dict(topk=k, num_steps=s, page_size=ps, num_rows=rows)
    expand_page_table(slots, seq_lens, page_table=pt.view, cache_seqlens=cs.view,
                      cu_seqlens_k=cu.view, status=status, **kw)  # fmt: skip
    ref_pt, ref_cs, ref_cu = (g.view.clone() for g in (pt, cs, cu))
    ref_status = new_status(device)
    expand_page_table_ref(slots, seq_lens, page_table=ref_pt, cache_seqlens=ref_cs,
                          cu_seqlens_k=ref_cu, status=ref_status, **kw)  # fmt: skip
    for g, name in ((pt, "page_table"), (cs, "cache_seqlens"), (cu, "cu_seqlens_k")):
        g.assert_intact(name)
    assert_equal(pt.view, ref_pt, "page_table")
    assert_equal(cs.view, ref_cs, "cache_seqlens")
    assert_equal(cu.view, ref_cu, "cu_seqlens_k")
    assert_equal(status, ref_status, "status")
    # Nothing at or past row B·K of any step (seed 001): the spare rows still hold the poison.
    assert (pt.view[:, BK:] == POISON).all() and (cs.view[:, BK:] == POISON).all()
    assert (cu.view[:, BK + 1 :] == POISON).all()
    return pt.view[:, :BK], cs.view[:, :BK], cu.view[:, : BK + 1], status


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps):
    batch, slots = _draw(shape, gen, device, k, s, ps)
    pt, cs, cu, status = _run(slots, batch.seq_lens, device, k=k, s=s, ps=ps, spare_rows=k)
    assert int(status) == 0
    check_expand_page_table_spec(batch, slots, pt, cs, cu, s)


def test_spec_example(device):
    ocl = torch.tensor([43, 20, 63, 36], device=device)
    pt, cs = expand_page_table(ocl, torch.tensor([7], device=device), topk=2, num_steps=2,
                               page_size=4)  # fmt: skip
    assert pt.tolist() == [[[10, 0], [15, 0]], [[10, 5], [15, 9]]]
    assert cs.tolist() == [[4, 4], [5, 5]]
    pt, cs = expand_page_table(ocl, torch.tensor([7], device=device), topk=2, num_steps=2,
                               page_size=1)  # fmt: skip
    assert pt.tolist() == [[[43, 0], [63, 0]], [[43, 20], [63, 36]]]
    assert cs.tolist() == [[1, 1], [2, 2]]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    k=st.sampled_from([1, 2, 3, 4, 8]),
    s=st.integers(1, 6),
    ps=st.sampled_from([1, 2, 4, 16, 64]),
    shape=st.sampled_from(["mod0", "mod1", "modm1", "random", "near_row_end", "long_short"]),
    seed=st.integers(0, 2**31 - 1),
    rows_short=st.integers(0, 2),
    wide=st.integers(0, 70),
    out64=st.booleans(),
)
def test_property(device, b, k, s, ps, shape, seed, rows_short, wide, out64):
    g = torch.Generator().manual_seed(seed)
    batch, slots = _draw(shape, g, device, k, s, ps, batch_size=b, prefix=2 * ps + 8)
    rows = max(s - rows_short, 0)
    pt, cs, cu, status = _run(slots, batch.seq_lens, device, k=k, s=s, ps=ps, rows=rows,
                              width=rows + wide, spare_rows=3,
                              dtype=torch.int64 if out64 else torch.int32)  # fmt: skip
    assert int(status) == 0
    check_expand_page_table_spec(batch, slots, pt, cs, cu, rows)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_adversarial_slots_never_write_outside(device, gen, ps):
    """Seed 001: slots spread over more pages than a row holds, pages that return, negative ids,
    a table exactly ``rows`` wide and fewer rows than steps. Stores stay inside the buffer, the
    extra pages are dropped and reported, the kernel still equals its reference."""
    B, K, S, rows = 5, 4, 6, 4
    slots = torch.randint(-3, 50 * ps, (B * K * S,), generator=gen).to(device)
    seq_lens = torch.randint(-1, 40, (B,), generator=gen).to(device)
    seq_lens[0] = -2  # a negative length reads as 0 and is reported
    slots[1] = -1  # a negative slot (branch 0, step 1 < rows) reads page 0 and is reported
    _, cs, _, status = _run(slots, seq_lens, device, k=K, s=S, ps=ps, rows=rows, spare_rows=K)
    want = Status.POOL_OOB | Status.POS_OOB | (Status.BAD_PAGE if ps > 1 else 0)
    assert int(status) == int(want)


def test_misaligned_but_few_pages_is_reported(device):
    """A chain whose first slot is not at offset ``lpl`` of its page would make FA3 read the
    wrong tokens even with the right page count: BAD_PAGE."""
    ocl = torch.tensor([41, 42], device=device)  # lpl = 3 wants offset 3 first, 41 is offset 1
    status = new_status(device)
    expand_page_table(ocl, torch.tensor([7], device=device), topk=1, num_steps=2, page_size=4,
                      status=status)  # fmt: skip
    assert int(status) == int(Status.BAD_PAGE)


def test_empty_batch(device):
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    pt, cs, cu, status = _run(empty, empty, device, k=4, s=3, ps=16, spare_rows=8)
    assert cu.tolist() == [[0], [0], [0]] and pt.numel() == 0 and int(status) == 0
    pt, cs = expand_page_table(empty, empty, topk=4, num_steps=3, page_size=16)
    assert pt.shape == (3, 0, 3) and cs.shape == (3, 0)


def test_bad_arguments_raise_before_launch(device, gen):
    batch, slots = _draw("random", gen, device, 2, 3, 4, batch_size=4)
    sl = batch.seq_lens

    def i32(*shape):
        return torch.zeros(shape, dtype=torch.int32, device=device)

    kw = dict(topk=2, num_steps=3, page_size=4)
    with pytest.raises(ValueError, match="page_table is too small: need 3 columns"):
        expand_page_table(slots, sl, page_table=i32(3, 8, 2), **kw)
    with pytest.raises(ValueError, match="page_table is too small: need 8 branch rows"):
        expand_page_table(slots, sl, page_table=i32(3, 7, 3), **kw)
    with pytest.raises(ValueError, match="page_table is too small: need 3 step rows"):
        expand_page_table(slots, sl, page_table=i32(2, 8, 3), **kw)
    with pytest.raises(ValueError, match="out_cache_loc is too small: need 24"):
        expand_page_table(slots[:23], sl, **kw)
    with pytest.raises(ValueError, match="cache_seqlens is too small: need 8"):
        expand_page_table(slots, sl, cache_seqlens=i32(3, 7), **kw)
    with pytest.raises(ValueError, match="cu_seqlens_k is too small: need 9"):
        expand_page_table(slots, sl, cu_seqlens_k=i32(3, 8), **kw)
    with pytest.raises(ValueError, match="num_rows must be <= num_steps=3"):
        expand_page_table(slots, sl, num_rows=4, **kw)
    with pytest.raises(TypeError, match="page_table must be int32 or int64"):
        expand_page_table(slots, sl, page_table=i32(3, 8, 3).float(), **kw)
    with pytest.raises(ValueError, match="page_table must have rank 3"):
        expand_page_table(slots, sl, page_table=i32(8, 3), **kw)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        expand_page_table(slots, sl, topk=0, num_steps=3, page_size=4)


@pytest.mark.parametrize("ps,fill", [(4, 1), (16, 6), (64, 5)])
def test_padded_requests_are_consistent_and_report_nothing(device, gen, ps, fill):
    """design §4: a padded request (row 0, draft slots 0, seq_lens = a fill value) reads the sink
    page only and sets no status bit, whatever the fill's residue mod ps."""
    K, S = 4, 3
    batch, slots = _draw("random", gen, device, K, S, ps, batch_size=3)
    slots = torch.cat([slots, torch.zeros(2 * K * S, dtype=slots.dtype, device=device)])
    seq_lens = torch.cat([batch.seq_lens, torch.full((2,), fill, dtype=batch.seq_lens.dtype,
                                                     device=device)])  # fmt: skip
    pt, cs, _, status = _run(slots, seq_lens, device, k=K, s=S, ps=ps)
    assert int(status) == 0
    assert not pt[:, 3 * K :].any(), "padded branches read the sink page"
    assert cs[:, 3 * K :].tolist() == [[fill % ps + s + 1] * 2 * K for s in range(S)]
