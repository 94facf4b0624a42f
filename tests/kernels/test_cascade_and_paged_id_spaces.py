"""The id spaces of design §2.10 in FlashInfer's two other draft forms: the draft window in
shared_prefix_kv_indices' prefix level, and page-granular rows and virtual ids in
branch_kv_indices' page lists. Each output is checked against the rules read directly (a
Python loop per list, no shared helper) and each kernel against its torch reference, on fresh
random inputs and on the edges (L = 0, L < Sk, L just past W + Sk, an unmapped id, rows of
page ids, lengths one short of a page)."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.branch_kv_indices import branch_kv_indices, branch_kv_indices_ref
from specmeta.kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from tests.guard_bands import Guarded, assert_equal

MAX_L = 40
POOL_PAGES = 64


def _draw(gen, *, B, K, S, ps, E, translate, lengths=None):
    """A batch whose rows hold token ids (``E == 1``) or page ids of ``E`` positions, and,
    with ``translate``, a page map of its (virtual) ids: a random injection into a larger
    pool."""
    R = B + 2
    row_tokens = MAX_L + K * (S + ps) + 2 * ps  # every draft position of layouts A and B fits
    W_row = -(-row_tokens // E)
    r2t = torch.randint(0, POOL_PAGES * ps // E, (R, W_row), generator=gen)
    rpi = torch.randperm(R, generator=gen)[:B]
    if lengths is None:
        lengths = torch.randint(0, MAX_L + 1, (B,), generator=gen)
    else:
        lengths = torch.tensor(lengths)
    v2p = torch.randperm(3 * POOL_PAGES, generator=gen)[:POOL_PAGES] if translate else None
    return rpi, r2t, lengths, v2p


def _emit(row, pos, v2p, *, E, ps):
    """The id a row names at ``pos``, read as design §2.10 says; ``None`` where it does not
    map (the kernels emit the sink slot 0 there and set BAD_KV_ID)."""
    tid = int(row[pos]) if E == 1 else int(row[pos // E]) * E + pos % E
    if E > 1 and tid < 0:
        return None
    if v2p is None:
        return tid
    page = tid // ps
    if tid < 0 or page >= v2p.shape[0] or int(v2p[page]) < 0:
        return None
    return int(v2p[page]) * ps + tid % ps


def _chain(L, t, S, ps, K):
    """Row positions of branch ``t``'s draft tokens (design §1)."""
    if ps > 1 and K > 1:
        lpl = L % ps
        nnp = -(-(lpl + S) // ps)
        return [L - lpl + t * nnp * ps + lpl + j for j in range(S)]
    return [L + t * S + j for j in range(S)]


def _on(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


# ------------------------------------------------------------------------------------------
# The draft window in the shared-prefix cascade
# ------------------------------------------------------------------------------------------
def _cascade_spec(rpi, r2t, lengths, v2p, *, E, K, S, ps, window, sink):
    """``(prefix_ptr, prefix, chains, bad)`` from the rules: each request's window (its first
    ``min(sink, L)`` positions, then the most recent, ``min(L, W + Sk)`` in all) once, and
    every branch's chain per step on the full ``L``."""
    prefix, ptr, chains, bad = [], [0], [[] for _ in range(S)], False
    for b in range(len(lengths)):
        row, L = r2t[int(rpi[b])], int(lengths[b])
        kept = min(L, window + sink) if window else L
        head = min(sink, L) if window else 0
        for p in list(range(head)) + list(range(L - (kept - head), L)):
            got = _emit(row, p, v2p, E=E, ps=ps)
            bad |= got is None
            prefix.append(0 if got is None else got)
        ptr.append(len(prefix))
        for t in range(K):
            slots = [_emit(row, p, v2p, E=E, ps=ps) for p in _chain(L, t, S, ps, K)]
            bad |= any(x is None for x in slots)
            for s in range(S):
                chains[s] += [0 if x is None else x for x in slots[: s + 1]]
    return ptr, prefix, chains, bad


def _cascade(args, device, *, K, S, ps, width, **kw):
    """The kernel and the reference into guarded buffers; ``(prefix, ptr, chain, status)``."""
    rpi, r2t, lengths, v2p = _on(device, *args)
    got = []
    for fn in (shared_prefix_kv_indices, shared_prefix_kv_indices_ref):
        status = new_status(device)
        pre = Guarded((width,), torch.int64, device)
        ptr = Guarded((len(lengths) + 1,), torch.int32, device)
        out = fn(rpi, r2t, lengths, topk=K, num_steps=S, page_size=ps, status=status,
                 prefix_kv_indices=pre.view, prefix_kv_indptr=ptr.view, v2p=v2p, **kw)  # fmt: skip
        pre.assert_intact(f"{fn.__name__} prefix_kv_indices")
        ptr.assert_intact(f"{fn.__name__} prefix_kv_indptr")
        # Row s of the chain level uses B·K·(s + 1) entries; the rest was never written.
        chain = torch.cat([out[2][s, : len(lengths) * K * (s + 1)].cpu() for s in range(S)])
        got.append((pre.view.cpu(), ptr.view.cpu(), chain, int(status)))
    return got


def _assert_cascade(got, spec, S, what):
    ptr, prefix, chains, _ = spec
    assert got[1].tolist() == ptr, f"{what}: prefix_kv_indptr"
    assert got[0][: len(prefix)].tolist() == prefix, f"{what}: prefix_kv_indices"
    assert got[2].tolist() == sum(chains, []), f"{what}: chain_kv_indices"


CASCADE_FORMS = {
    "window": dict(window=6, sink=2, E=1, translate=False),
    "window_no_sink": dict(window=5, sink=0, E=1, translate=False),
    "window_page_rows": dict(window=7, sink=3, E=4, translate=False),
    "window_virtual": dict(window=4, sink=1, E=1, translate=True),
    "all": dict(window=7, sink=3, E=2, translate=True),
}


@pytest.mark.parametrize("form", sorted(CASCADE_FORMS))
@pytest.mark.parametrize("K,S,ps", [(1, 3, 1), (2, 3, 4), (4, 2, 1)])
def test_cascade_window_follows_the_rules_and_equals_the_reference(form, K, S, ps, gen, device):
    f = CASCADE_FORMS[form]
    B = int(torch.randint(1, 6, (1,), generator=gen))
    window = f["window"] + int(torch.randint(0, 4, (1,), generator=gen))
    args = _draw(gen, B=B, K=K, S=S, ps=ps, E=f["E"], translate=f["translate"])
    spec = _cascade_spec(*args, E=f["E"], K=K, S=S, ps=ps, window=window, sink=f["sink"])
    kernel, ref = _cascade(args, device, K=K, S=S, ps=ps, width=len(spec[1]) + 4,
                           window_size=window, sink_size=f["sink"], entry_page_size=f["E"])  # fmt: skip
    _assert_cascade(ref, spec, S, "reference")
    _assert_cascade(kernel, spec, S, "kernel")
    assert kernel[3] == ref[3] == 0, (Status(kernel[3]), Status(ref[3]))


@pytest.mark.parametrize("E", [1, 4])
def test_cascade_window_edges_each_length_around_the_sink_and_the_window(E, gen, device):
    """L = 0, inside the sink, on it, inside the window, on W + Sk, one past it, far past."""
    window, sink, K, S, ps = 5, 3, 2, 2, 1
    lengths = [0, 2, 3, 7, 8, 9, MAX_L]
    args = _draw(gen, B=len(lengths), K=K, S=S, ps=ps, E=E, translate=False, lengths=lengths)
    spec = _cascade_spec(*args, E=E, K=K, S=S, ps=ps, window=window, sink=sink)
    assert spec[0] == [0, 0, 2, 5, 12, 20, 28, 36], spec[0]  # min(L, 8) a request
    kernel, ref = _cascade(args, device, K=K, S=S, ps=ps, width=spec[0][-1],
                           window_size=window, sink_size=sink, entry_page_size=E)  # fmt: skip
    _assert_cascade(ref, spec, S, "reference")
    _assert_cascade(kernel, spec, S, "kernel")
    assert kernel[3] == ref[3] == 0


def test_cascade_window_size_zero_builds_what_no_window_builds(gen, device):
    """W = 0 is no window: sink_size is not read, and both levels are the plain ones."""
    args = _draw(gen, B=4, K=2, S=3, ps=4, E=1, translate=False)
    plain = _cascade(args, device, K=2, S=3, ps=4, width=4 * MAX_L + 4)
    sunk = _cascade(args, device, K=2, S=3, ps=4, width=4 * MAX_L + 4, sink_size=5)
    for a, b in zip(plain + plain, sunk + list(reversed(plain)), strict=True):
        for i, name in enumerate(("prefix_kv_indices", "prefix_kv_indptr", "chain_kv_indices")):
            assert_equal(b[i], a[i], name)
        assert a[3] == b[3] == 0


@pytest.mark.parametrize("where", ["sink", "recent", "dropped"])
def test_cascade_window_an_unmapped_id_is_the_sink_and_bad_kv_id_only_if_kept(where, gen,
                                                                               device):  # fmt: skip
    """One unmapped page in request 1's prefix: in the sink or among the recent tokens it is
    listed as the sink slot 0 with BAD_KV_ID alone; in the part the window drops it is never
    read, and the status stays 0."""
    window, sink, K, S, ps, E = 4, 4, 2, 2, 4, 4
    args = _draw(gen, B=2, K=K, S=S, ps=ps, E=E, translate=True, lengths=[9, 30])
    rpi, r2t, lengths, v2p = args
    row = int(rpi[1])
    # Request 1 keeps positions 0-3 (its sink, page entry 0) and 26-29 (the recent four,
    # entries 6 and 7); entry 3 (positions 12-15) is dropped. Each entry has its own page.
    r2t[row] = torch.arange(r2t.shape[1]) + 16
    entry = {"sink": 0, "recent": 7, "dropped": 3}[where]
    planted = int(r2t[row, entry])
    v2p[planted] = -1  # E == ps: page entry e holds virtual page r2t[row, e]
    # Request 0's random row must not name the planted page: only request 1 reads it.
    others = torch.arange(r2t.shape[0]) != row
    r2t[others] = torch.where(r2t[others] == planted, planted + 1, r2t[others])
    spec = _cascade_spec(*args, E=E, K=K, S=S, ps=ps, window=window, sink=sink)
    assert spec[3] == (where != "dropped")
    kernel, ref = _cascade(args, device, K=K, S=S, ps=ps, width=len(spec[1]),
                           window_size=window, sink_size=sink, entry_page_size=E)  # fmt: skip
    _assert_cascade(ref, spec, S, "reference")
    _assert_cascade(kernel, spec, S, "kernel")
    want = int(Status.BAD_KV_ID) if spec[3] else 0
    assert kernel[3] == ref[3] == want, (Status(kernel[3]), Status(ref[3]))


def test_cascade_window_short_buffer_reports_capacity_alone(gen, device):
    """A prefix buffer one entry short of ΣLw: OUT_OF_CAPACITY alone, the entries that fit
    written as the reference writes them."""
    args = _draw(gen, B=3, K=2, S=2, ps=1, E=1, translate=False, lengths=[20, 3, 30])
    spec = _cascade_spec(*args, E=1, K=2, S=2, ps=1, window=6, sink=2)
    assert spec[0][-1] == 19
    kernel, ref = _cascade(args, device, K=2, S=2, ps=1, width=18, window_size=6, sink_size=2)
    assert kernel[0].tolist() == ref[0].tolist() == spec[1][:18]
    assert kernel[3] == ref[3] == int(Status.OUT_OF_CAPACITY), (kernel[3], ref[3])


def test_cascade_seq_lens_sum_bounds_the_prefix_level_by_the_window(device):
    """With a window the host bound is min(ΣL, B·(W + Sk)): a buffer of that size passes, one
    entry less is refused before anything is written, naming the call, the argument and the
    sizes."""
    r2t = torch.zeros((3, 64), dtype=torch.int64, device=device)
    args = (torch.tensor([0, 1], device=device), r2t, torch.tensor([30, 20], device=device))
    kw = dict(topk=2, num_steps=2, window_size=4, sink_size=1, seq_lens_sum=50)
    for fn in (shared_prefix_kv_indices, shared_prefix_kv_indices_ref):
        fn(*args, prefix_kv_indices=torch.zeros(10, dtype=torch.int64, device=device), **kw)
        short = torch.full((9,), -7, dtype=torch.int64, device=device)
        ptr = torch.full((3,), -7, dtype=torch.int32, device=device)
        with pytest.raises(ValueError) as info:
            fn(*args, prefix_kv_indices=short, prefix_kv_indptr=ptr, **kw)
        message = str(info.value)
        assert "prefix_kv_indices" in message and "10" in message and "9" in message, message
        assert "window_size + sink_size" in message, message
        assert bool((short == -7).all()) and bool((ptr == -7).all())


@pytest.mark.parametrize("fn", [shared_prefix_kv_indices, shared_prefix_kv_indices_ref])
@pytest.mark.parametrize(
    "kw,error,words",
    [
        (dict(window_size=-1), ValueError, "window_size must be >= 0, got -1"),
        (dict(window_size=4, sink_size=-2), ValueError, "sink_size must be >= 0, got -2"),
        (dict(window_size=2.0), TypeError, "window_size must be an int"),
    ],
)
def test_cascade_bad_window_arguments_are_refused_before_any_write(fn, kw, error, words,
                                                                   device):  # fmt: skip
    r2t = torch.zeros((2, 16), dtype=torch.int64, device=device)
    pre = torch.full((64,), -7, dtype=torch.int64, device=device)
    ptr = torch.full((2,), -7, dtype=torch.int32, device=device)
    with pytest.raises(error) as info:
        fn(torch.tensor([0], device=device), r2t, torch.tensor([3], device=device), topk=2,
           num_steps=2, prefix_kv_indices=pre, prefix_kv_indptr=ptr, **kw)  # fmt: skip
    message = str(info.value)
    assert message.startswith(f"{fn.__name__}: ") and words in message, message
    assert "design §2.10: window_size 0 is no window" in message, message
    assert bool((pre == -7).all()) and bool((ptr == -7).all())


# ------------------------------------------------------------------------------------------
# Page-granular rows and virtual ids in the paged draft form
# ------------------------------------------------------------------------------------------
def _paged_spec(rpi, r2t, lengths, v2p, *, E, K, S, ps, rows):
    """``(kv_indptr, lists, last, bad)`` from the rules: branch ``(b, t)`` at step ``s`` lists
    the physical pages of its page row's first ``ceil((L + s + 1) / ps)`` columns: the
    request's full prefix pages, then its own region's (design §1 over pages)."""
    ptr, lists, last, bad = [], [], [], False
    for s in range(rows):
        row_ptr, row_lists, row_last = [0], [], []
        for b in range(len(lengths)):
            row, L = r2t[int(rpi[b])], int(lengths[b])
            lpl, full = L % ps, L // ps
            nnp = -(-(lpl + S) // ps)
            n = -(-(L + s + 1) // ps)
            for t in range(K):
                pages = []
                for c in range(n):
                    pos = c * ps if c < full else L - lpl + (t * nnp + c - full) * ps
                    got = _emit(row, pos, v2p, E=E, ps=ps)
                    bad |= got is None
                    pages.append(0 if got is None else got // ps)
                row_lists.append(pages)
                row_ptr.append(row_ptr[-1] + n)
                row_last.append((L + s) % ps + 1)
        ptr.append(row_ptr)
        lists.append(row_lists)
        last.append(row_last)
    return ptr, lists, last, bad


def _paged(args, device, *, K, S, ps, rows, width, **kw):
    """The kernel and the reference into guarded buffers; ``(indices, indptr, last, status)``."""
    rpi, r2t, lengths, v2p = _on(device, *args)
    got = []
    for fn in (branch_kv_indices, branch_kv_indices_ref):
        status = new_status(device)
        idx = Guarded((rows, width), torch.int64, device)
        ptr = Guarded((rows, len(lengths) * K + 1), torch.int32, device)
        last = Guarded((rows, len(lengths) * K), torch.int32, device)
        fn(rpi, r2t, lengths, topk=K, num_steps=S, page_size=ps, num_rows=rows,
           kv_indices=idx.view, kv_indptr=ptr.view, kv_last_page_len=last.view, status=status,
           v2p=v2p, **kw)  # fmt: skip
        for name, g in (("kv_indices", idx), ("kv_indptr", ptr), ("kv_last_page_len", last)):
            g.assert_intact(f"{fn.__name__} {name}")
        got.append((idx.view.cpu(), ptr.view.cpu(), last.view.cpu(), int(status)))
    return got


def _assert_paged(got, spec, what):
    ptr, lists, last, _ = spec
    idx, kv_indptr, kv_last, _ = got
    for s, (row_ptr, row_lists) in enumerate(zip(ptr, lists, strict=True)):
        assert kv_indptr[s].tolist() == row_ptr, f"{what}: kv_indptr[{s}]"
        assert kv_last[s].tolist() == last[s], f"{what}: kv_last_page_len[{s}]"
        for z, want in enumerate(row_lists):
            have = idx[s, row_ptr[z] : row_ptr[z + 1]].tolist()
            assert have == want, f"{what}: step {s} list {z}: {have} != {want}"


PAGED_FORMS = {
    "page_rows": dict(E=4, translate=False),
    "page_rows_coarse": dict(E=8, translate=False),
    "virtual": dict(E=1, translate=True),
    "all": dict(E=2, translate=True),
}


@pytest.mark.parametrize("form", sorted(PAGED_FORMS))
@pytest.mark.parametrize("K,S,ps", [(1, 3, 4), (2, 3, 4), (3, 2, 2), (2, 2, 1)])
def test_paged_lists_follow_the_rules_and_equal_the_reference(form, K, S, ps, gen, device):
    f = PAGED_FORMS[form]
    B = int(torch.randint(1, 6, (1,), generator=gen))
    args = _draw(gen, B=B, K=K, S=S, ps=ps, E=f["E"], translate=f["translate"])
    rows = int(torch.randint(1, S + 1, (1,), generator=gen))
    spec = _paged_spec(*args, E=f["E"], K=K, S=S, ps=ps, rows=rows)
    kernel, ref = _paged(args, device, K=K, S=S, ps=ps, rows=rows,
                         width=spec[0][-1][-1] + 3, entry_page_size=f["E"])  # fmt: skip
    _assert_paged(ref, spec, "reference")
    _assert_paged(kernel, spec, "kernel")
    assert kernel[3] == ref[3] == 0, (Status(kernel[3]), Status(ref[3]))


@pytest.mark.parametrize("E", [4, 8])
def test_paged_lengths_at_page_edges(E, gen, device):
    """L = 0, one short of a page, on a page, one past it, in page-id rows with a page map."""
    K, S, ps = 2, 3, 4
    lengths = [0, 3, 4, 5, 7, 8, 11]
    args = _draw(gen, B=len(lengths), K=K, S=S, ps=ps, E=E, translate=True, lengths=lengths)
    spec = _paged_spec(*args, E=E, K=K, S=S, ps=ps, rows=S)
    kernel, ref = _paged(args, device, K=K, S=S, ps=ps, rows=S, width=spec[0][-1][-1],
                         entry_page_size=E)  # fmt: skip
    _assert_paged(ref, spec, "reference")
    _assert_paged(kernel, spec, "kernel")
    assert kernel[3] == ref[3] == 0


@pytest.mark.parametrize("E", [2, 4, 8])
def test_paged_page_rows_build_what_the_token_rows_they_stand_for_build(E, gen, device):
    """Rows of page ids build, byte for byte, the lists (and status) that the rows of token
    ids they stand for (position p at row[p // E]·E + p mod E) build; so does an identity
    page map against no page map."""
    K, S, ps = 2, 3, 4
    rpi, pages, lengths, _ = _draw(gen, B=5, K=K, S=S, ps=ps, E=E, translate=False)
    tokens = pages.repeat_interleave(E, 1) * E + torch.arange(E).repeat(pages.shape[1])
    width = 2 * K * (5 * MAX_L // ps + 10)
    plain = _paged((rpi, tokens, lengths, None), device, K=K, S=S, ps=ps, rows=S, width=width)
    paged = _paged((rpi, pages, lengths, None), device, K=K, S=S, ps=ps, rows=S, width=width,
                   entry_page_size=E)  # fmt: skip
    identity = torch.arange(pages.shape[0] * pages.shape[1] * E // ps + POOL_PAGES * 4)
    mapped = _paged((rpi, tokens, lengths, identity), device, K=K, S=S, ps=ps, rows=S,
                    width=width)  # fmt: skip
    for want, other in ((plain, paged), (plain, mapped)):
        for a, b in zip(want, other, strict=True):
            for i, name in enumerate(("kv_indices", "kv_indptr", "kv_last_page_len")):
                assert_equal(b[i], a[i], name)
            assert a[3] == b[3] == 0


@pytest.mark.parametrize("fault", ["unmapped_page", "page_past_map", "negative_entry"])
def test_paged_an_id_that_does_not_map_is_page_zero_and_bad_kv_id_alone(fault, gen, device):
    """The second prefix page of request 1, listed by each of its branches: page 0 there and
    BAD_KV_ID alone."""
    K, S, ps, E = 2, 2, 4, 4
    args = _draw(gen, B=2, K=K, S=S, ps=ps, E=E, translate=True, lengths=[9, 12])
    rpi, r2t, lengths, v2p = args
    row, entry = int(rpi[1]), 1
    if fault == "unmapped_page":
        v2p[int(r2t[row, entry])] = -1  # E == ps: the entry is the virtual page
    elif fault == "page_past_map":
        r2t[row, entry] = v2p.shape[0]  # the first page past the map
    else:
        r2t[row, entry] = -1
    spec = _paged_spec(*args, E=E, K=K, S=S, ps=ps, rows=S)
    assert spec[3] and all(spec[1][0][K + t][1] == 0 for t in range(K)), "the fault is read"
    kernel, ref = _paged(args, device, K=K, S=S, ps=ps, rows=S, width=40, entry_page_size=E)
    _assert_paged(ref, spec, "reference")
    _assert_paged(kernel, spec, "kernel")
    assert kernel[3] == ref[3] == int(Status.BAD_KV_ID), (Status(kernel[3]), Status(ref[3]))


def test_paged_an_unmapped_page_dropped_for_capacity_is_not_reported(gen, device):
    """The last request's lists fall wholly past a short buffer: OUT_OF_CAPACITY alone, though
    every page of its row is unmapped (pages dropped for capacity are never emitted)."""
    K, S, ps = 2, 2, 4
    args = _draw(gen, B=3, K=K, S=S, ps=ps, E=1, translate=True, lengths=[12, 7, 9])
    rpi, r2t, lengths, v2p = args
    r2t[int(rpi[2])] = 4 * ps  # every token of request 2's row on virtual page 4
    r2t[int(rpi[0])] = r2t[int(rpi[0])] % (4 * ps)  # requests 0 and 1 on pages 0-3
    r2t[int(rpi[1])] = r2t[int(rpi[1])] % (4 * ps)
    v2p[4] = -1
    # Request 2 starts at column 2·4 + 2·2 = 12 at step 0 and 2·4 + 2·3 = 14 at step 1.
    kernel, ref = _paged(args, device, K=K, S=S, ps=ps, rows=S, width=12)
    assert_equal(kernel[0], ref[0], "kv_indices (both leave the poison past what they write)")
    assert_equal(kernel[1], ref[1], "kv_indptr")
    assert kernel[3] == ref[3] == int(Status.OUT_OF_CAPACITY), (kernel[3], ref[3])


@pytest.mark.parametrize("fn", [branch_kv_indices, branch_kv_indices_ref])
@pytest.mark.parametrize(
    "kw,error,words",
    [
        (dict(entry_page_size=0), ValueError, "entry_page_size must be >= 1, got 0"),
        (dict(entry_page_size=2.0), TypeError, "entry_page_size must be an int"),
        (dict(v2p="pages"), TypeError, "v2p"),
        (dict(v2p=torch.zeros((2, 2), dtype=torch.int64)), ValueError, "v2p"),
        (dict(v2p=torch.zeros(4)), TypeError, "v2p"),
    ],
)
def test_paged_bad_id_space_arguments_are_refused_before_any_write(fn, kw, error, words,
                                                                   device):  # fmt: skip
    r2t = torch.zeros((2, 16), dtype=torch.int64, device=device)
    idx = torch.full((2, 64), -7, dtype=torch.int64, device=device)
    ptr = torch.full((2, 3), -7, dtype=torch.int32, device=device)
    if isinstance(kw.get("v2p"), torch.Tensor):
        kw = dict(v2p=kw["v2p"].to(device))
    with pytest.raises(error) as info:
        fn(torch.tensor([0], device=device), r2t, torch.tensor([3], device=device), topk=2,
           num_steps=2, page_size=4, kv_indices=idx, kv_indptr=ptr, **kw)  # fmt: skip
    message = str(info.value)
    assert message.startswith(f"{fn.__name__}: ") and words in message, message
    assert message.endswith("(design §2.10: window_size 0 is no window, entry_page_size 1 rows "
                            "of token ids, v2p the pool's [P] int32 or int64 virtual -> "
                            "physical page map on the call's device)"), message  # fmt: skip
    assert bool((idx == -7).all()) and bool((ptr == -7).all())
