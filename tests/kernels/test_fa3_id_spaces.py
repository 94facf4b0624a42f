"""The id spaces of design §2.10 in the FA3 page-table kernels: prefix_page_table,
draft_decode_page_tables (its normal pass), verify_expand_page_table and verify_expand_ragged.

A row of page ids (``entry_page_size = E``) or of virtual ids (``v2p``) builds, byte for byte,
what the plain row of the physical token ids it stands for builds; that plain row is read from
the rules by a Python loop here (no library helper). Each kernel also equals its torch
reference on fresh random inputs (the seed is reported on failure), and an id that does not
map gives the sink and ``BAD_KV_ID`` alone."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.draft_decode_page_tables import (
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from specmeta.kernels.prefix_page_table import prefix_page_table, prefix_page_table_ref
from specmeta.kernels.verify_expand_page_table import (
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from specmeta.kernels.verify_expand_ragged import verify_expand_ragged, verify_expand_ragged_ref
from specmeta.workloads import random_tree_mask
from tests._support import emitted_id, physical_rows
from tests.guard_bands import Guarded, assert_equal

POOL_PAGES = 24  # virtual pages of the pool (v2p's length)
MAX_L = 30
FORMS = {
    "page_rows": dict(E=4, translate=False),
    "page_rows_wide": dict(E=8, translate=False),  # E > ps: a page id spans two pool pages
    "virtual": dict(E=1, translate=True),
    "both": dict(E=2, translate=True),
}


def _draw(gen, *, B, E, ps, translate, positions):
    """``(rpi, rows, L, v2p)``: rows of ``ceil(positions / E)`` entries (token ids, or page ids
    of ``E`` positions) naming ids of a pool of ``POOL_PAGES`` pages of ``ps``, and with
    ``translate`` a random injection of those (virtual) pages into a pool three times larger."""
    R = B + 2
    W_row = -(-positions // E)
    rows = torch.randint(0, POOL_PAGES * ps // E, (R, W_row), generator=gen)
    rpi = torch.randperm(R, generator=gen)[:B]
    L = torch.randint(0, MAX_L + 1, (B,), generator=gen)
    v2p = torch.randperm(3 * POOL_PAGES, generator=gen)[:POOL_PAGES] if translate else None
    return rpi, rows, L, v2p


def _layout_slots(L, *, K, S, ps):
    """Draft slots ``[B·K·S]`` that follow the slot layout (design §1): branch row ``r`` owns
    consecutive tokens from offset ``lpl`` of page ``1 + r·(S + 1)`` (never the sink page)."""
    lpl = (L % ps).repeat_interleave(K).view(-1, 1)
    first = (1 + torch.arange(L.shape[0] * K) * (S + 1)).view(-1, 1) * ps
    return (first + lpl + torch.arange(S).view(1, -1)).reshape(-1)


def _spaces(E, v2p, device):
    return dict(entry_page_size=E, v2p=v2p.to(device) if v2p is not None else None)


# --------------------------------------------------------------------------------------------
# One build of each op: (outputs on the CPU, status), into guarded buffers.
# --------------------------------------------------------------------------------------------
def _prefix(fn, args, *, ps, device, extra=0, num_rows=None, width=None, **spaces):
    rpi, rows, L = (a.to(device) for a in args)
    B = rpi.shape[0]
    W = width or -(-(MAX_L + extra + (num_rows or 1)) // ps) + 1
    nr = num_rows or 1
    pt = Guarded((B, W), torch.int32, device)
    cs = Guarded((nr, B) if num_rows else (B,), torch.int32, device)
    cu = Guarded((nr, B + 1) if num_rows else (B + 1,), torch.int32, device)
    status = new_status(device)
    fn(rpi, rows, L, page_size=ps, extra_tokens=extra, num_rows=num_rows, page_table=pt.view,
       cache_seqlens=cs.view, cu_seqlens_k=cu.view, status=status, **spaces)  # fmt: skip
    for name, g in (("page_table", pt), ("cache_seqlens", cs), ("cu_seqlens_k", cu)):
        g.assert_intact(f"{fn.__name__} {name}")
    return (pt.view.cpu(), cs.view.cpu(), cu.view.cpu()), int(status)


def _fused(fn, args, out_cache_loc, *, K, S, ps, device, **spaces):
    rpi, rows, L = (a.to(device) for a in args)
    B = rpi.shape[0]
    W = -(-MAX_L // ps) + 1
    bufs = [Guarded(shape, torch.int32, device) for shape in
            ((B, W), (B,), (B + 1,), (S, B * K, S), (S, B * K), (S, B * K + 1))]  # fmt: skip
    status = new_status(device)
    fn(rpi, rows, L, out_cache_loc.to(device), topk=K, num_steps=S, page_size=ps,
       exclude_last_partial=K > 1 and ps > 1, page_table=bufs[0].view,
       cache_seqlens=bufs[1].view, cu_seqlens_k=bufs[2].view, expand_page_table=bufs[3].view,
       expand_cache_seqlens=bufs[4].view, expand_cu_seqlens_k=bufs[5].view, status=status,
       **spaces)  # fmt: skip
    for i, g in enumerate(bufs):
        g.assert_intact(f"{fn.__name__} output {i}")
    return tuple(g.view.cpu() for g in bufs), int(status)


def _verify(fn, args, tree, *, ps, device, verify_lens=None, **spaces):
    rpi, rows, L = (a.to(device) for a in args)
    B, N = tree.shape[0], tree.shape[1]
    pt = Guarded((B * N, N + 3), torch.int32, device)
    cs = Guarded((B * N,), torch.int32, device)
    cu = Guarded((B * N + 1,), torch.int32, device)
    status = new_status(device)
    kw = dict(verify_lens=verify_lens.to(device)) if verify_lens is not None else {}
    fn(rpi, rows, L, tree.to(device), page_table=pt.view, cache_seqlens=cs.view,
       cu_seqlens_k=cu.view, status=status, page_size=ps, **kw, **spaces)  # fmt: skip
    for name, g in (("page_table", pt), ("cache_seqlens", cs), ("cu_seqlens_k", cu)):
        g.assert_intact(f"{fn.__name__} {name}")
    return (pt.view.cpu(), cs.view.cpu(), cu.view.cpu()), int(status)


def _ragged(fn, args, tree, qo, T, *, ps, device, **spaces):
    rpi, rows, L = (a.to(device) for a in args)
    N = tree.shape[1]
    pt = Guarded((T, N + 2), torch.int32, device)
    cs = Guarded((T,), torch.int32, device)
    cu = Guarded((T + 1,), torch.int32, device)
    status = new_status(device)
    fn(rpi, rows, L, tree.to(device), qo.to(device), num_rows=T, page_table=pt.view,
       cache_seqlens=cs.view, cu_seqlens_k=cu.view, status=status, page_size=ps, **spaces)  # fmt: skip
    for name, g in (("page_table", pt), ("cache_seqlens", cs), ("cu_seqlens_k", cu)):
        g.assert_intact(f"{fn.__name__} {name}")
    return (pt.view.cpu(), cs.view.cpu(), cu.view.cpu()), int(status)


def _assert_same(got, want, what):
    (a, a_status), (b, b_status) = got, want
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_equal(x, y, f"{what}: output {i}")
    assert a_status == b_status, f"{what}: status {a_status} against {b_status}"


def _builds(op, gen, *, form, ps, K=2, S=3, N=4, device):
    """``{(fn, spaces): result}`` of ``op`` over a fresh batch: the kernel and the reference
    in the form's id space, and the kernel over the plain physical rows they stand for."""
    f = FORMS[form]
    E = f["E"]
    B = int(torch.randint(1, 5, (1,), generator=gen))
    positions = MAX_L + K * (S + ps) + ps + N + 8  # every position any op reads fits
    rpi, rows, L, v2p = _draw(gen, B=B, E=E, ps=ps, translate=f["translate"],
                              positions=positions)  # fmt: skip
    L[0] = MAX_L  # every draw spans several pages: a page read at a wrong position shows
    phys = physical_rows(rows, v2p, E=E, ps=ps)
    spaces = _spaces(E, v2p, device)
    if op == "prefix":
        extra = int(torch.randint(0, 5, (1,), generator=gen))
        nr = [None, 2][int(torch.randint(0, 2, (1,), generator=gen))]

        def run(fn, r, **sp):
            return _prefix(fn, (rpi, r, L), ps=ps, device=device, extra=extra, num_rows=nr, **sp)

        pair = (prefix_page_table, prefix_page_table_ref)
    elif op == "fused":
        slots = _layout_slots(L, K=K, S=S, ps=ps)

        def run(fn, r, **sp):
            return _fused(fn, (rpi, r, L), slots, K=K, S=S, ps=ps, device=device, **sp)

        pair = (draft_decode_page_tables, draft_decode_page_tables_ref)
    elif op in ("verify", "verify_lens"):
        tree = random_tree_mask(B, K, S, N, gen)
        v = torch.randint(0, N + 1, (B,), generator=gen) if op == "verify_lens" else None

        def run(fn, r, **sp):
            return _verify(fn, (rpi, r, L), tree, ps=ps, device=device, verify_lens=v, **sp)

        pair = (verify_expand_page_table, verify_expand_page_table_ref)
    else:
        tree = random_tree_mask(B, K, S, N, gen)
        lens = torch.randint(0, N + 3, (B,), generator=gen)  # past N: filler rows
        qo = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        T = int(qo[-1]) + int(torch.randint(0, 3, (1,), generator=gen))

        def run(fn, r, **sp):
            return _ragged(fn, (rpi, r, L), tree, qo, T, ps=ps, device=device, **sp)

        pair = (verify_expand_ragged, verify_expand_ragged_ref)
    return {
        "kernel": run(pair[0], rows, **spaces),
        "reference": run(pair[1], rows, **spaces),
        "physical": run(pair[0], phys),
    }


OPS = ["prefix", "fused", "verify", "verify_lens", "ragged"]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("op", OPS)
def test_id_space_rows_build_what_their_physical_rows_build(op, form, ps, gen, device):
    got = _builds(op, gen, form=form, ps=ps, device=device)
    _assert_same(got["reference"], got["physical"], f"{op} reference against physical rows")
    _assert_same(got["kernel"], got["physical"], f"{op} kernel against physical rows")
    assert got["kernel"][1] == 0


@pytest.mark.parametrize("op", OPS)
def test_an_identity_map_builds_what_no_map_builds(op, gen, device):
    """``v2p = arange(P)``: the ids leave as they are read (rows of page ids, E = 2)."""
    B, E, ps = 3, 2, 4
    rpi, rows, L, _ = _draw(gen, B=B, E=E, ps=ps, translate=False, positions=80)
    tree = random_tree_mask(B, 2, 3, 4, gen)
    qo = torch.tensor([0, 2, 6, 11])
    got = []
    for v2p in (None, torch.arange(POOL_PAGES)):
        sp = _spaces(E, v2p, device)
        if op == "prefix":
            got.append(_prefix(prefix_page_table, (rpi, rows, L), ps=ps, device=device,
                               extra=3, **sp))  # fmt: skip
        elif op == "fused":
            slots = _layout_slots(L, K=2, S=3, ps=ps)
            got.append(_fused(draft_decode_page_tables, (rpi, rows, L), slots, K=2, S=3, ps=ps,
                              device=device, **sp))  # fmt: skip
        elif op.startswith("verify"):
            v = torch.tensor([4, 0, 2]) if op == "verify_lens" else None
            got.append(_verify(verify_expand_page_table, (rpi, rows, L), tree, ps=ps,
                               device=device, verify_lens=v, **sp))  # fmt: skip
        else:
            got.append(_ragged(verify_expand_ragged, (rpi, rows, L), tree, qo, 12, ps=ps,
                               device=device, **sp))  # fmt: skip
    _assert_same(got[1], got[0], f"{op}: identity map")


# --------------------------------------------------------------------------------------------
# Edges: an id that does not map, a row just wide enough, L = 0 and one short of a page.
# --------------------------------------------------------------------------------------------
FAULTS = ["negative_entry", "page_past_map", "unmapped_page"]


def _plant(fault, rows, v2p, row, entry, *, E, ps):
    """Make entry ``entry`` of row ``row`` name an id that does not map."""
    if fault == "negative_entry":
        rows[row, entry] = -1
    elif fault == "page_past_map":
        rows[row, entry] = POOL_PAGES * ps // E  # the first id whose page is past the map
    else:
        v2p[int(rows[row, entry]) * E // ps] = -1


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", OPS)
def test_an_id_that_does_not_map_is_the_sink_and_bad_kv_id_alone(op, fault, gen, device):
    """Rows of page ids (E = ps = 4) through a map: request 0's entry holding position 8 (its
    third page; L ≥ 12, read by every op) names an id that does not map. The kernel and the
    reference give the sink there and BAD_KV_ID, no other bit, and otherwise what the
    physical rows build."""
    E = ps = 4
    B, K, S, N = 2, 2, 3, 4
    rpi, rows, L, v2p = _draw(gen, B=B, E=E, ps=ps, translate=True, positions=96)
    if op in ("verify", "verify_lens", "ragged"):
        L[0] = 8 - int(torch.randint(0, 3, (1,), generator=gen))  # the fault in the window
    else:
        L[0] = 13  # whole pages 0, 4, 8 (and 12) of the prefix
    _plant(fault, rows, v2p, int(rpi[0]), 2, E=E, ps=ps)
    phys = physical_rows(rows, v2p, E=E, ps=ps)
    assert int(phys[int(rpi[0]), 8]) == 0, "the planted id does not map"
    sp = _spaces(E, v2p, device)
    tree = random_tree_mask(B, K, S, N, gen)
    results = []
    for fn_pair in ((prefix_page_table, prefix_page_table_ref),
                    (draft_decode_page_tables, draft_decode_page_tables_ref),
                    (verify_expand_page_table, verify_expand_page_table_ref),
                    (verify_expand_ragged, verify_expand_ragged_ref)):  # fmt: skip
        if fn_pair[0].__name__ != {"prefix": "prefix_page_table",
                                   "fused": "draft_decode_page_tables",
                                   "verify": "verify_expand_page_table",
                                   "verify_lens": "verify_expand_page_table",
                                   "ragged": "verify_expand_ragged"}[op]:  # fmt: skip
            continue
        for fn, r, s in ((fn_pair[0], rows, sp), (fn_pair[1], rows, sp), (fn_pair[0], phys, {})):
            if op == "prefix":
                results.append(_prefix(fn, (rpi, r, L), ps=ps, device=device, extra=2, **s))
            elif op == "fused":
                slots = _layout_slots(L, K=K, S=S, ps=ps)
                results.append(_fused(fn, (rpi, r, L), slots, K=K, S=S, ps=ps, device=device,
                                      **s))  # fmt: skip
            elif op == "ragged":
                qo = torch.tensor([0, 3, 7])
                results.append(_ragged(fn, (rpi, r, L), tree, qo, 7, ps=ps, device=device, **s))
            else:
                v = torch.tensor([N, N]) if op == "verify_lens" else None
                results.append(_verify(fn, (rpi, r, L), tree, ps=ps, device=device,
                                       verify_lens=v, **s))  # fmt: skip
    kernel, ref, plain = results
    for got, name in ((kernel, "kernel"), (ref, "reference")):
        for i, (x, y) in enumerate(zip(got[0], plain[0], strict=True)):
            assert_equal(x, y, f"{op} {name}: output {i}")
        assert got[1] == int(Status.BAD_KV_ID), f"{op} {name}: status {got[1]}"
    assert plain[1] == 0


@pytest.mark.parametrize("op", ["prefix", "verify"])
def test_an_unread_id_that_does_not_map_is_not_reported(op, gen, device):
    """Only emitted ids count: an unmapped id at a position no output reads (past the prefix
    table's pages, or the second token of a page the table names by its first) sets
    nothing."""
    E, ps, B = 2, 4, 2
    rpi, rows, L, v2p = _draw(gen, B=B, E=E, ps=ps, translate=True, positions=64)
    L[0], L[1] = 6, 5
    row = int(rpi[0])
    if op == "prefix":
        rows[row, 1] = -1  # positions 2, 3: inside page 0, which the table names by position 0
        rows[row, 20] = -1  # position 40: past every page of the table (L + 2 < 40)
        got = [_prefix(fn, (rpi, rows, L), ps=ps, device=device, extra=2, **_spaces(E, v2p, device))
               for fn in (prefix_page_table, prefix_page_table_ref)]  # fmt: skip
    else:
        rows[row, 2] = -1  # positions 4, 5: the prefix, which the expand pass does not read
        rows[row, 10] = -1  # position 20: past the window L + N = 10
        tree = random_tree_mask(B, 2, 2, 4, gen)
        got = [_verify(fn, (rpi, rows, L), tree, ps=ps, device=device, **_spaces(E, v2p, device))
               for fn in (verify_expand_page_table, verify_expand_page_table_ref)]  # fmt: skip
    _assert_same(got[0], got[1], op)
    assert got[0][1] == 0


@pytest.mark.parametrize("E", [2, 4])
def test_a_page_row_just_wide_enough_and_one_entry_short(E, gen, device):
    """Request 0's prefix ends on the row's last position (W_row·E = L + extra): every page is
    read and nothing is reported; one entry narrower, its last page lies past the row
    (POS_OOB, the sink page), in the kernel and the reference alike. L = 0 and L one short of
    a page ride along in the same batch."""
    ps, extra = 4, 2
    # need = 17: the last page starts at 16, inside the row's last entry for E = 2 and 4.
    L = torch.tensor([15, 0, ps - 1, ps])
    need = int(L.max()) + extra
    for width, bits in ((-(-need // E), 0), (-(-need // E) - 1, int(Status.POS_OOB))):
        rpi, rows, _, v2p = _draw(gen, B=4, E=E, ps=ps, translate=True, positions=width * E)
        rows = rows[:, :width]
        phys = physical_rows(rows, v2p, E=E, ps=ps)
        sp = _spaces(E, v2p, device)
        kernel = _prefix(prefix_page_table, (rpi, rows, L), ps=ps, device=device, extra=extra,
                         width=8, **sp)  # fmt: skip
        ref = _prefix(prefix_page_table_ref, (rpi, rows, L), ps=ps, device=device, extra=extra,
                      width=8, **sp)  # fmt: skip
        _assert_same(kernel, ref, f"width {width}")
        assert kernel[1] == bits, (width, kernel[1])
        table = kernel[0][0]
        for b in range(4):
            n = int(L[b]) + extra
            for c in range(-(-n // ps)):
                p = c * ps
                want = emitted_id(rows[int(rpi[b])], p, v2p, E=E, ps=ps) // ps if p < width * E else 0
                assert int(table[b, c]) == want, (width, b, c)
            assert all(int(x) == 0 for x in table[b, -(-n // ps):]), (width, b)
        assert_equal(kernel[0][1], (L + extra).to(torch.int32), "cache_seqlens")
        if bits == 0:  # the plain rows they stand for build the same
            plain = _prefix(prefix_page_table, (rpi, phys, L), ps=ps, device=device,
                            extra=extra, width=8)  # fmt: skip
            _assert_same(kernel, plain, "physical rows")


# --------------------------------------------------------------------------------------------
# Host checks: refused before any launch and any write, naming the call and the fix.
# --------------------------------------------------------------------------------------------
BAD_ARGUMENTS = [
    (dict(entry_page_size=0), ValueError, "entry_page_size must be >= 1, got 0"),
    (dict(entry_page_size=2.0), TypeError, "entry_page_size must be an int"),
    (dict(v2p="pages"), TypeError, "v2p"),
    (dict(v2p=torch.zeros((2, 2), dtype=torch.int64)), ValueError, "v2p"),
    (dict(v2p=torch.zeros(4)), TypeError, "v2p"),
]


@pytest.mark.parametrize("kw,error,words", BAD_ARGUMENTS)
@pytest.mark.parametrize("op", ["prefix_page_table", "draft_decode_page_tables",
                                "verify_expand_page_table", "verify_expand_ragged"])  # fmt: skip
def test_bad_id_space_arguments_are_refused_before_any_write(op, kw, error, words, device):
    rpi = torch.tensor([1], device=device)
    rows = torch.zeros((2, 16), dtype=torch.int64, device=device)
    L = torch.tensor([3], device=device)
    if isinstance(kw.get("v2p"), torch.Tensor):
        kw = dict(v2p=kw["v2p"].to(device))
    pt = torch.full((4, 8), -7, dtype=torch.int32, device=device)
    cs = torch.full((4,), -7, dtype=torch.int32, device=device)
    tree = torch.ones((1, 2, 2), dtype=torch.bool, device=device)
    calls = {
        "prefix_page_table": lambda: prefix_page_table(
            rpi, rows, L, page_size=1, page_table=pt, cache_seqlens=cs, **kw),
        "draft_decode_page_tables": lambda: draft_decode_page_tables(
            rpi, rows, L, torch.zeros(4, dtype=torch.int64, device=device), topk=2,
            num_steps=2, page_size=1, exclude_last_partial=False, page_table=pt,
            cache_seqlens=cs, **kw),
        "verify_expand_page_table": lambda: verify_expand_page_table(
            rpi, rows, L, tree, page_table=pt, cache_seqlens=cs, **kw),
        "verify_expand_ragged": lambda: verify_expand_ragged(
            rpi, rows, L, tree, torch.tensor([0, 2], device=device), num_rows=2, page_table=pt,
            cache_seqlens=cs, **kw),
    }  # fmt: skip
    with pytest.raises(error) as info:
        calls[op]()
    message = str(info.value)
    assert message.startswith(f"{op}: ") and words in message, message
    assert "design §2.10" in message, message
    assert bool((pt == -7).all()) and bool((cs == -7).all())
