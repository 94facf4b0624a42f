"""FA3 page tables of a window layer (design §2.10, §2.3): ``sliding_window_size`` and
``full_to_swa`` on ``prefix_page_table`` and the normal pass of ``draft_decode_page_tables``.

Each table is checked against the rule read directly (a Python loop per column: a page wholly
below the read floor ``f = max(0, L − w + 1)`` is the sink page 0 and no fault; any other
column is the window-pool page of the id at ``max(c·ps, f)``, through the row's own space and
then the map, the sink with ``BAD_KV_ID`` where either does not map), and each kernel against
its torch reference, exactly, on fresh random maps (holes, and ``−1`` runs below, at and above
the floor), ``L`` below, at and above ``w``, page sizes 1, 16 and 64.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.draft_decode_page_tables import (
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from specmeta.kernels.prefix_page_table import prefix_page_table, prefix_page_table_ref
from tests._support import emitted_id
from tests.guard_bands import Guarded, assert_equal

FORMS = {"tokens": dict(E=1, translate=False), "pages_virtual": dict(E=4, translate=True)}


def _draw(gen, *, B, ps, E, translate, lengths, extra, holes=0.15):
    """Rows over a pool of whole pages (token ids, or page ids with ``E > 1``; virtual ids
    through a page map with ``translate``) and a full → window pool map that pages like the
    full pool (page ``P`` to a random window page at the same offsets), ``holes`` of its
    entries ``−1``, the sink kept in place."""
    need = max(lengths) + extra + ps
    W_row = -(-need // E) + 1
    R = B + 2
    per_row = -(-(W_row * E) // ps)
    pages = R * per_row + 1
    # Each row a run of distinct whole pages (page aligned, as an allocator hands them out),
    # no page in two rows or twice in one.
    perm = (torch.randperm(pages - 1, generator=gen) + 1).view(R, per_row)
    tokens = (perm.view(R, per_row, 1) * ps + torch.arange(ps)).view(R, -1)[:, : W_row * E]
    v2p = None
    if translate:  # the rows hold virtual ids; v2p a random page permutation
        v2p = torch.randperm(pages, generator=gen)
        v2p[0] = 0
        inv = torch.argsort(v2p)
        tokens = inv[tokens // ps] * ps + tokens % ps
    # A row of page ids of E positions (E divides ps here), or of token ids.
    r2t = tokens[:, ::E] // E if E > 1 else tokens
    window_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    window_pages[0] = 0
    f2s = (window_pages.view(-1, 1) * ps + torch.arange(ps)).flatten()
    f2s[torch.rand(f2s.shape[0], generator=gen) < holes] = -1
    f2s[0] = 0
    rpi = torch.randperm(R - 1, generator=gen)[:B] + 1
    return rpi, r2t.contiguous(), torch.tensor(lengths), v2p, f2s


def _spec(rpi, r2t, lengths, v2p, f2s, *, ps, E, w, extra, rows, exclude, W):
    """``(page_table, bad)`` read from the rule, column by column."""
    out, bad = [], False
    for b, L in enumerate(lengths.tolist()):
        row = r2t[int(rpi[b])]
        length = (L - L % ps if exclude else L) + extra
        pages = min(-(-(length + rows - 1) // ps), W)
        f = max(0, L - w + 1) if w else 0
        cols = []
        for c in range(W):
            if c >= pages or (c + 1) * ps <= f:
                cols.append(0)
                continue
            full = emitted_id(row, max(c * ps, f), v2p, E=E, ps=ps)
            if full < 0 or full >= f2s.shape[0] or int(f2s[full]) < 0:
                bad = True
                cols.append(0)
            else:
                cols.append(int(f2s[full]) // ps)
        out.append(cols)
    return torch.tensor(out, dtype=torch.int32), bad


def _prefix(inputs, device, *, ps, E, w, extra, rows, use_map=True):
    """The kernel into guarded buffers and the reference, compared exactly; returns the
    kernel's table, lengths and status."""
    rpi, r2t, lengths, v2p, f2s = (x.to(device) if x is not None else None for x in inputs)
    B, W = len(lengths), -(-(r2t.shape[1] * E) // ps)
    kw = dict(page_size=ps, extra_tokens=extra, num_rows=rows, entry_page_size=E, v2p=v2p,
              sliding_window_size=w, full_to_swa=f2s if use_map else None)  # fmt: skip
    cs_shape = (B,) if rows is None else (rows, B)
    cu_shape = (B + 1,) if rows is None else (rows, B + 1)
    pt, cs, cu = (Guarded(s, torch.int32, device) for s in ((B, W), cs_shape, cu_shape))
    status = new_status(device)
    prefix_page_table(rpi, r2t, lengths, page_table=pt.view, cache_seqlens=cs.view,
                      cu_seqlens_k=cu.view, status=status, **kw)  # fmt: skip
    ref = [torch.full(s, -3, dtype=torch.int32, device=device) for s in ((B, W), cs_shape,
                                                                       cu_shape)]  # fmt: skip
    ref_status = new_status(device)
    prefix_page_table_ref(rpi, r2t, lengths, page_table=ref[0], cache_seqlens=ref[1],
                          cu_seqlens_k=ref[2], status=ref_status, **kw)  # fmt: skip
    for g, name in ((pt, "page_table"), (cs, "cache_seqlens"), (cu, "cu_seqlens_k")):
        g.assert_intact(name)
    for g, want, name in zip((pt, cs, cu), ref, ("page_table", "cache_seqlens", "cu_seqlens_k"),
                             strict=True):  # fmt: skip
        assert_equal(g.view, want, f"{name} (w={w}, ps={ps}, E={E})")
    assert_equal(status, ref_status, "status")
    return pt.view.cpu(), cs.view.cpu(), int(status)


@pytest.mark.parametrize("form,ps,extra,rows", [
    ("tokens", 1, 3, None), ("pages_virtual", 16, 0, 3), ("tokens", 16, 4, None),
    ("pages_virtual", 64, 5, None), ("tokens", 64, 1, 2),
])  # fmt: skip
def test_window_tables_follow_the_floor_and_equal_the_reference(form, ps, extra, rows, gen,
                                                                  device):  # fmt: skip
    E, translate = FORMS[form]["E"], FORMS[form]["translate"]
    E = min(E, ps)
    top = 3 * ps + 7
    lengths = [0, 1, int(torch.randint(2, top, (1,), generator=gen)), top]
    inputs = _draw(gen, B=4, ps=ps, E=E, translate=translate, lengths=lengths, extra=extra)
    rpi, r2t, L, v2p, f2s = inputs
    # w = 1, below the long L (inside a page and a page apart), at the longest L, above all
    for w in (1, int(torch.randint(2, ps + 2, (1,), generator=gen)), 2 * ps + 3, top, 2 * top):
        pt, cs, status = _prefix(inputs, device, ps=ps, E=E, w=w, extra=extra, rows=rows)
        want, bad = _spec(*inputs, ps=ps, E=E, w=w, extra=extra, rows=rows or 1, exclude=False,
                          W=pt.shape[1])  # fmt: skip
        assert_equal(pt, want, f"page_table against the rule (w={w}, ps={ps})")
        # The tables keep their full length: the kernel's own window excludes the rest.
        r = torch.arange(rows or 1).view(-1, 1)
        assert_equal(cs.view(-1, 4), (L + extra + r).to(torch.int32), "cache_seqlens")
        assert status == (int(Status.BAD_KV_ID) if bad else 0)
    # -1 runs below, at and above the longest request's floor (w inside its prefix)
    w = 2 * ps + 3
    f = top - w + 1
    row = r2t[int(rpi[3])]
    for lo, hi in ((max(0, f - ps - 2), f), (f, f + 2), (f + ps, f + ps + 3)):
        runs = f2s.clone()
        for p in range(lo, hi):
            runs[emitted_id(row, p, v2p, E=E, ps=ps)] = -1
        runs[0] = 0
        inputs = (rpi, r2t, L, v2p, runs)
        pt, _, status = _prefix(inputs, device, ps=ps, E=E, w=w, extra=extra, rows=rows)
        want, bad = _spec(*inputs, ps=ps, E=E, w=w, extra=extra, rows=rows or 1, exclude=False,
                          W=pt.shape[1])  # fmt: skip
        assert_equal(pt, want, f"page_table with a -1 run over [{lo}, {hi}) (floor {f})")
        assert bad or lo != f, "a run at the floor is read"
        assert status == (int(Status.BAD_KV_ID) if bad else 0)


def test_rail_without_map_sinks_only_what_lies_below_the_floor(gen, device):
    ps = 16
    lengths = [5, 40, 70]
    inputs = _draw(gen, B=3, ps=ps, E=1, translate=False, lengths=lengths, extra=2)
    rpi, r2t, _, _, _ = inputs
    w = 20
    pt, _, status = _prefix(inputs, device, ps=ps, E=1, w=w, extra=2, rows=None, use_map=False)
    assert status == 0
    for b, L in enumerate(lengths):
        f = max(0, L - w + 1)
        for c in range(-(-(L + 2) // ps)):
            want = 0 if (c + 1) * ps <= f else int(r2t[int(rpi[b]), max(c * ps, f)]) // ps
            assert int(pt[b, c]) == want, (b, c)


@pytest.mark.parametrize("ps", [1, 16])
def test_one_evicted_slot_read_sets_bad_kv_id_alone(ps, gen, device):
    """A map without holes; one ``−1`` planted at the floor of one request (read: the fault
    alone), then one wholly below it (never read: no fault, and the page below is the sink)."""
    L, w, extra = 3 * ps + 5, ps + 3, 2
    inputs = _draw(gen, B=2, ps=ps, E=1, translate=False, lengths=[L, L], extra=extra, holes=0)
    rpi, r2t, lengths, v2p, f2s = inputs
    f = L - w + 1
    at_floor = int(r2t[int(rpi[1]), f])
    clean = f2s.clone()
    f2s[at_floor] = -1
    pt, _, status = _prefix(inputs, device, ps=ps, E=1, w=w, extra=extra, rows=None)
    assert status == int(Status.BAD_KV_ID)
    assert int(pt[1, f // ps]) == 0
    # Evicted where no query reads: position 0 and a page wholly below the floor.
    f2s.copy_(clean)
    below = f - ps  # its page ends at or before f
    f2s[int(r2t[int(rpi[1]), below])] = -1
    f2s[int(r2t[int(rpi[1]), 0])] = -1
    pt, _, status = _prefix(inputs, device, ps=ps, E=1, w=w, extra=extra, rows=None)
    assert status == 0
    assert int(pt[1, 0]) == 0 and int(pt[1, below // ps]) == 0
    assert int(pt[1, f // ps]) == int(clean[at_floor]) // ps


def test_a_straddling_page_is_read_from_the_floor(gen, device):
    """The page that holds the floor reads its map at the floor: its first position, below the
    floor, evicted (as an engine evicts below ``L − w + 1``), is no fault."""
    ps, L, w = 16, 50, 20  # f = 31: page 1 holds 16 … 31
    inputs = _draw(gen, B=1, ps=ps, E=1, translate=False, lengths=[L], extra=1, holes=0)
    rpi, r2t, _, _, f2s = inputs
    row = r2t[int(rpi[0])]
    f2s[row[: L - w + 1]] = -1  # everything below the floor evicted
    f2s[0] = 0
    pt, _, status = _prefix(inputs, device, ps=ps, E=1, w=w, extra=1, rows=None)
    assert status == 0
    assert int(pt[0, 0]) == 0
    assert int(pt[0, 1]) == int(f2s[int(row[L - w + 1])]) // ps


def test_cascade_normal_pass_takes_the_window(gen, device):
    """``draft_decode_page_tables``' normal pass under the rail and the map, against its
    reference (both passes) and against the rule (layout B: whole pages only)."""
    K, S, ps, w = 2, 2, 16, 21
    lengths = [0, 9, 37, 60]
    inputs = _draw(gen, B=4, ps=ps, E=1, translate=False, lengths=lengths, extra=K * 2 * ps)
    rpi, r2t, L, _, f2s = (x.to(device) if x is not None else None for x in inputs)
    B, W = 4, -(-r2t.shape[1] // ps)
    slots = torch.randint(1, 20 * ps, (B * K * S,), generator=gen).to(device)
    names = ("page_table", "cache_seqlens", "cu_seqlens_k", "expand_page_table",
             "expand_cache_seqlens", "expand_cu_seqlens_k")  # fmt: skip
    shapes = ((B, W), (B,), (B + 1,), (S, B * K, S), (S, B * K), (S, B * K + 1))
    kw = dict(topk=K, num_steps=S, page_size=ps, exclude_last_partial=True,
              sliding_window_size=w, full_to_swa=f2s)  # fmt: skip
    got = {n: Guarded(s, torch.int32, device) for n, s in zip(names, shapes, strict=True)}
    ref = {n: torch.full(s, -3, dtype=torch.int32, device=device)
           for n, s in zip(names, shapes, strict=True)}  # fmt: skip
    status, ref_status = new_status(device), new_status(device)
    draft_decode_page_tables(rpi, r2t, L, slots, status=status, **kw,
                             **{n: g.view for n, g in got.items()})  # fmt: skip
    draft_decode_page_tables_ref(rpi, r2t, L, slots, status=ref_status, **kw, **ref)
    for n in names:
        got[n].assert_intact(n)
        assert_equal(got[n].view, ref[n], n)
    assert_equal(status, ref_status, "status")
    want, bad = _spec(*inputs, ps=ps, E=1, w=w, extra=0, rows=1, exclude=True, W=W)
    assert_equal(got["page_table"].view.cpu(), want, "normal pass against the rule")
    assert bool(int(status) & int(Status.BAD_KV_ID)) == bad


def test_refusals_name_the_call(device):
    r2t = torch.zeros((2, 8), dtype=torch.int32, device=device)
    rpi = torch.ones(1, dtype=torch.int32, device=device)
    L = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="prefix_page_table: .*sliding_window_size"):
        prefix_page_table(rpi, r2t, L, page_size=1, sliding_window_size=-2)
    with pytest.raises(TypeError, match="prefix_page_table: .*full_to_swa"):
        prefix_page_table(rpi, r2t, L, page_size=1, sliding_window_size=4,
                          full_to_swa=[0, 1])  # fmt: skip
    with pytest.raises(ValueError, match="draft_decode_page_tables: .*full_to_swa"):
        draft_decode_page_tables(rpi, r2t, L, torch.zeros(4, dtype=torch.int32, device=device),
                                 topk=2, num_steps=2, page_size=1, exclude_last_partial=False,
                                 sliding_window_size=4,
                                 full_to_swa=torch.zeros((2, 2), dtype=torch.int32,
                                                         device=device))  # fmt: skip
