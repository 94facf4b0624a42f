"""The id spaces of design §2.10 in branch_page_table, TRT-LLM MLA's per-branch block tables.

A row of page ids (``entry_page_size = E``) or of virtual ids (``v2p``) builds, byte for byte,
what the plain row of the physical token ids it stands for builds, and what the rules read
directly say (a Python loop here: the page of the id emitted at each column's first position,
design §1 over pages). The kernel equals its torch reference on fresh random inputs (the seed
is reported on failure); an id that does not map gives the sink page 0 and ``BAD_KV_ID`` alone,
and only where a page is stored."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.branch_page_table import branch_page_table, branch_page_table_ref
from tests._support import emitted_id, physical_rows
from tests.guard_bands import Guarded, assert_equal

POOL_PAGES = 48  # virtual pages of the pool (v2p's length)
MAX_L = 26
FILL = -1  # TRT-LLM MLA's unused entries
FORMS = {
    "page_rows": dict(E=4, translate=False),
    "page_rows_wide": dict(E=8, translate=False),  # E > ps: a page id spans two pool pages
    "virtual": dict(E=1, translate=True),
    "both": dict(E=2, translate=True),
}
# (K, S, ps): chains, slot layout B (K > 1, ps > 1), layout A (ps = 1)
CONFIGS = [(1, 3, 4), (3, 2, 4), (2, 3, 1)]


# --------------------------------------------------------------------------------------------
# The rules, read directly (design §1, §2.10).
# --------------------------------------------------------------------------------------------
def _column(L, t, c, *, S, ps):
    """``(position, used)`` of column ``c`` of branch ``t``: the ``L // ps`` full prefix pages,
    then the ``ceil((L mod ps + S) / ps)`` pages of the branch's region (design §1)."""
    lpl = L % ps
    full, nnp = (L - lpl) // ps, -(-(lpl + S) // ps)
    pos = c * ps if c < full else L - lpl + (t * nnp + c - full) * ps
    return pos, c < full + nnp


def _expected(rows, rpi, L, v2p, *, K, S, ps, E, width):
    """``page_table [B·K, width]`` from the rules: the page of the id emitted at each used
    column's first position (page 0 past the row's ``W_row·E`` positions), ``FILL`` beyond."""
    B = rpi.shape[0]
    out = torch.full((B * K, width), FILL, dtype=torch.int32)
    for b in range(B):
        row = rows[int(rpi[b])]
        for t in range(K):
            for c in range(width):
                p, used = _column(int(L[b]), t, c, S=S, ps=ps)
                if used:
                    inside = p < rows.shape[1] * E
                    out[b * K + t, c] = emitted_id(row, p, v2p, E=E, ps=ps) // ps if inside else 0
    return out


def _draw(gen, *, B, E, ps, translate, positions, distinct=False):
    """``(rpi, rows, L, v2p)``: rows of ``ceil(positions / E)`` entries naming ids of a pool of
    ``POOL_PAGES`` pages of ``ps`` (``distinct``: every entry a different page id, E = ps), and
    with ``translate`` a random injection of those virtual pages into a pool three times
    larger."""
    R = B + 2
    W_row = -(-positions // E)
    if distinct:
        rows = torch.randperm(POOL_PAGES, generator=gen)[: R * W_row].view(R, W_row)
    else:
        rows = torch.randint(0, POOL_PAGES * ps // E, (R, W_row), generator=gen)
    rpi = torch.randperm(R, generator=gen)[:B]
    L = torch.randint(0, MAX_L + 1, (B,), generator=gen)
    v2p = torch.randperm(3 * POOL_PAGES, generator=gen)[:POOL_PAGES] if translate else None
    return rpi, rows, L, v2p


def _positions(K, S, ps):
    """Row positions every branch of a prefix up to ``MAX_L`` reads."""
    return MAX_L + K * (S + ps) + ps


# --------------------------------------------------------------------------------------------
# One build: (page_table, seq_lens_k) on the CPU and the status, into guarded buffers.
# --------------------------------------------------------------------------------------------
def _build(fn, rpi, rows, L, *, K, S, ps, device, width, rows_k=None, v2p=None, E=1):
    B = rpi.shape[0]
    rows_k = S if rows_k is None else rows_k
    pt = Guarded((B * K, width), torch.int32, device)
    sl = Guarded((rows_k, B * K), torch.int32, device)
    status = new_status(device)
    spaces = dict(entry_page_size=E, v2p=v2p.to(device) if v2p is not None else None)
    fn(rpi.to(device), rows.to(device), L.to(device), topk=K, num_steps=S, page_size=ps,
       num_rows=rows_k, fill_value=FILL, page_table=pt.view, seq_lens_k=sl.view, status=status,
       **spaces)  # fmt: skip
    pt.assert_intact(f"{fn.__name__} page_table")
    sl.assert_intact(f"{fn.__name__} seq_lens_k")
    return (pt.view.cpu(), sl.view.cpu()), int(status)


def _assert_same(got, want, what):
    (a, a_status), (b, b_status) = got, want
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_equal(x, y, f"{what}: output {i}")
    assert a_status == b_status, f"{what}: status {a_status} against {b_status}"


def _width(K, S, ps):
    """A table one column wider than the longest row needs."""
    return -(-(MAX_L + S) // ps) + 1


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_id_space_rows_build_what_their_physical_rows_build(form, k, s, ps, gen, device):
    E, translate = FORMS[form]["E"], FORMS[form]["translate"]
    B = int(torch.randint(1, 5, (1,), generator=gen))
    rpi, rows, L, v2p = _draw(gen, B=B, E=E, ps=ps, translate=translate,
                              positions=_positions(k, s, ps))  # fmt: skip
    phys = physical_rows(rows, v2p, E=E, ps=ps)
    rows_k = int(torch.randint(0, s + 1, (1,), generator=gen))
    kw = dict(K=k, S=s, ps=ps, device=device, width=_width(k, s, ps), rows_k=rows_k)
    kernel = _build(branch_page_table, rpi, rows, L, v2p=v2p, E=E, **kw)
    ref = _build(branch_page_table_ref, rpi, rows, L, v2p=v2p, E=E, **kw)
    plain = _build(branch_page_table, rpi, phys, L, **kw)
    _assert_same(ref, plain, f"{form}: reference against physical rows")
    _assert_same(kernel, plain, f"{form}: kernel against physical rows")
    assert kernel[1] == 0
    want = _expected(rows, rpi, L, v2p, K=k, S=s, ps=ps, E=E, width=kw["width"])
    assert_equal(kernel[0][0], want, f"{form}: page_table against the rules")
    lens = torch.tensor([[int(L[r // k]) + j + 1 for r in range(B * k)] for j in range(rows_k)],
                        dtype=torch.int32).view(rows_k, B * k)  # fmt: skip
    assert_equal(kernel[0][1], lens, f"{form}: seq_lens_k")


@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_an_identity_map_builds_what_no_map_builds(k, s, ps, gen, device):
    """``v2p = arange(P)``: the ids leave as they are read (rows of page ids, E = 2)."""
    E = 2
    rpi, rows, L, _ = _draw(gen, B=3, E=E, ps=ps, translate=False,
                            positions=_positions(k, s, ps))  # fmt: skip
    kw = dict(K=k, S=s, ps=ps, device=device, width=_width(k, s, ps), E=E)
    none = _build(branch_page_table, rpi, rows, L, **kw)
    identity = _build(branch_page_table, rpi, rows, L, v2p=torch.arange(POOL_PAGES), **kw)
    _assert_same(identity, none, "identity map")
    assert none[1] == 0


# --------------------------------------------------------------------------------------------
# Edges: an id that does not map, an unread one, a row just wide enough, L = 0 and ps − 1.
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


@pytest.mark.parametrize("where", ["prefix", "region"])
@pytest.mark.parametrize("fault", FAULTS)
def test_an_id_that_does_not_map_is_page_0_and_bad_kv_id_alone(fault, where, gen, device):
    """Rows of distinct page ids (E = ps = 4, K = 3, slot layout B) through a map; request 0
    (L = 9: pages 0, 1 of its prefix, then one region page a branch) has one entry naming an
    id that does not map: its prefix page 1 (every branch row reads it), or the region page of
    branch 2 (its row alone reads it). The kernel and the reference give page 0 there and
    ``BAD_KV_ID``, no other bit, and otherwise what the physical rows build."""
    E = ps = 4
    K, S = 3, 2
    rpi, rows, L, v2p = _draw(gen, B=2, E=E, ps=ps, translate=True, positions=_positions(K, S, ps),
                              distinct=True)  # fmt: skip
    L[0] = 9
    entry = 1 if where == "prefix" else (8 + 2 * ps) // E  # region of branch 2: 8 + 2·1·4
    _plant(fault, rows, v2p, int(rpi[0]), entry, E=E, ps=ps)
    phys = physical_rows(rows, v2p, E=E, ps=ps)
    assert int(phys[int(rpi[0]), entry * E]) == 0, "the planted id does not map"
    kw = dict(K=K, S=S, ps=ps, device=device, width=_width(K, S, ps))
    kernel = _build(branch_page_table, rpi, rows, L, v2p=v2p, E=E, **kw)
    ref = _build(branch_page_table_ref, rpi, rows, L, v2p=v2p, E=E, **kw)
    plain = _build(branch_page_table, rpi, phys, L, **kw)
    assert plain[1] == 0
    want = _expected(rows, rpi, L, v2p, K=K, S=S, ps=ps, E=E, width=kw["width"])
    hit = [(r, 1) for r in range(K)] if where == "prefix" else [(2, 2)]
    for r, c in hit:
        assert int(want[r, c]) == 0, "the rules give the sink page there"
    for got, name in ((kernel, "kernel"), (ref, "reference")):
        assert_equal(got[0][0], plain[0][0], f"{fault} {where} {name}: page_table")
        assert_equal(got[0][0], want, f"{fault} {where} {name}: page_table against the rules")
        assert_equal(got[0][1], plain[0][1], f"{fault} {where} {name}: seq_lens_k")
        assert got[1] == int(Status.BAD_KV_ID), f"{fault} {where} {name}: status {got[1]}"


@pytest.mark.parametrize("case", ["inside_a_page", "past_the_pages", "dropped_for_capacity"])
def test_an_unread_id_that_does_not_map_is_not_reported(case, gen, device):
    """Only stored pages count: an unmapped id at a position no column names (the second half
    of a page, past every used page), or on a page past the table's width (dropped and
    reported as OUT_OF_CAPACITY alone), sets no BAD_KV_ID."""
    E, ps, K, S = 2, 4, 2, 3
    rpi, rows, L, v2p = _draw(gen, B=2, E=E, ps=ps, translate=True, positions=64)
    # Request 0: prefix page 0, then two region pages a branch (positions 4, 8 and 12, 16).
    L[0], L[1] = 6, 5
    row = int(rpi[0])
    width = _width(K, S, ps)
    bits = 0
    if case == "inside_a_page":
        rows[row, 1] = -1  # positions 2, 3: inside page 0, named by position 0
        rows[row, 5] = -1  # positions 10, 11: inside branch 0's second region page
    elif case == "past_the_pages":
        rows[row, 14] = -1  # positions 28, 29: past branch 1's region (12 … 19)
    else:
        width = 2  # column 2 is dropped: branch 1's second region page (position 16) too
        rows[row, 8] = -1
        bits = int(Status.OUT_OF_CAPACITY)
    kw = dict(K=K, S=S, ps=ps, device=device, width=width, v2p=v2p, E=E)
    kernel = _build(branch_page_table, rpi, rows, L, **kw)
    ref = _build(branch_page_table_ref, rpi, rows, L, **kw)
    _assert_same(kernel, ref, case)
    assert kernel[1] == bits, (case, kernel[1])
    want = _expected(rows, rpi, L, v2p, K=K, S=S, ps=ps, E=E, width=width)
    assert_equal(kernel[0][0], want, f"{case}: page_table against the rules")


@pytest.mark.parametrize("k,E", [(2, 2), (2, 4), (1, 4)])
def test_a_page_row_just_wide_enough_and_one_entry_short(k, E, gen, device):
    """The longest branch row's last page starts on the row's last entry: every page is read
    and nothing is reported; one entry narrower, that page lies past the row (POS_OOB, the
    sink page), in the kernel and the reference alike. L = 0 and L one short of a page ride
    along in the same batch."""
    ps, S = 4, 3
    L = torch.tensor([13, 0, ps - 1])
    last = max(_column(int(x), k - 1, c, S=S, ps=ps)[0]
               for x in L for c in range(-(-(int(x) + S) // ps)))  # fmt: skip
    for entries, bits in ((last // E + 1, 0), (last // E, int(Status.POS_OOB))):
        rpi, rows, _, v2p = _draw(gen, B=3, E=E, ps=ps, translate=True, positions=entries * E)
        kw = dict(K=k, S=S, ps=ps, device=device, width=8, v2p=v2p, E=E)
        kernel = _build(branch_page_table, rpi, rows, L, **kw)
        ref = _build(branch_page_table_ref, rpi, rows, L, **kw)
        _assert_same(kernel, ref, f"{entries} entries")
        assert kernel[1] == bits, (entries, kernel[1])
        want = _expected(rows, rpi, L, v2p, K=k, S=S, ps=ps, E=E, width=8)
        assert_equal(kernel[0][0], want, f"{entries} entries: page_table against the rules")
        if bits == 0:  # the plain rows they stand for build the same
            phys = physical_rows(rows, v2p, E=E, ps=ps)
            plain = _build(branch_page_table, rpi, phys, L, K=k, S=S, ps=ps, device=device,
                           width=8)  # fmt: skip
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
@pytest.mark.parametrize("fn", [branch_page_table, branch_page_table_ref])
def test_bad_id_space_arguments_are_refused_before_any_write(fn, kw, error, words, device):
    rpi = torch.tensor([1], device=device)
    rows = torch.zeros((2, 16), dtype=torch.int64, device=device)
    L = torch.tensor([3], device=device)
    if isinstance(kw.get("v2p"), torch.Tensor):
        kw = dict(v2p=kw["v2p"].to(device))
    pt = torch.full((2, 8), -7, dtype=torch.int32, device=device)
    sl = torch.full((2, 2), -7, dtype=torch.int32, device=device)
    status = new_status(device)
    with pytest.raises(error) as info:
        fn(rpi, rows, L, topk=2, num_steps=2, page_size=4, page_table=pt, seq_lens_k=sl,
           status=status, **kw)  # fmt: skip
    message = str(info.value)
    assert message.startswith(f"{fn.__name__}: ") and words in message, message
    assert "design §2.10" in message, message
    assert bool((pt == -7).all()) and bool((sl == -7).all()) and int(status) == 0
