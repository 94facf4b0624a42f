"""The id spaces of design §2.10 (draft windows, page-granular rows, virtual ids) in
draft_decode_kv_indices, verify_kv_indices, assign_draft_cache_locs, prefix_tail_copy_pairs
and accept_cache_locs. Each output is checked against the rules
read directly (a Python loop per list, no shared helper), and each kernel against its torch
reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.cache_loc_move import accept_cache_locs, accept_cache_locs_ref
from specmeta.kernels.draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from specmeta.kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from specmeta.kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from specmeta.kernels.verify_kv_indices import verify_kv_indices, verify_kv_indices_ref
from tests.guard_bands import Guarded, assert_equal

MAX_L = 40


def _draw(gen, *, B, K, S, ps, E, translate, lengths=None):
    """A batch whose rows hold token ids (``E == 1``) or page ids, and, with ``translate``, a
    page map of its (virtual) ids."""
    R = B + 2
    row_tokens = MAX_L + K * (S + ps) + ps  # every draft position of layouts A and B fits
    W_row = -(-row_tokens // E)
    pool_pages = 64
    r2t = torch.randint(0, pool_pages * ps // E, (R, W_row), generator=gen)
    rpi = torch.randperm(R, generator=gen)[:B]
    if lengths is None:
        lengths = torch.randint(0, MAX_L + 1, (B,), generator=gen)
    else:
        lengths = torch.tensor(lengths)
    # Physical pages are a random injection of the virtual ones into a larger pool.
    v2p = torch.randperm(3 * pool_pages, generator=gen)[:pool_pages] if translate else None
    return rpi, r2t, lengths, v2p


def _emit(row, pos, v2p, *, E, ps):
    """The id a row names at ``pos``: a token entry, or a page entry's token, then through
    the page map; in those forms an id that does not map is the sink slot 0."""
    tid = int(row[pos]) if E == 1 else int(row[pos // E]) * E + pos % E
    if E == 1 and v2p is None:
        return tid
    if tid < 0:
        return 0
    if v2p is None:
        return tid
    page = tid // ps
    if page >= v2p.shape[0] or int(v2p[page]) < 0:
        return 0
    return int(v2p[page]) * ps + tid % ps


def _chain(L, t, S, ps, K, steps):
    """Row positions of branch ``t``'s first ``steps`` draft tokens (design §1)."""
    if ps > 1 and K > 1:
        lpl = L % ps
        nnp = -(-(lpl + S) // ps)
        return [L - lpl + t * nnp * ps + lpl + j for j in range(steps)]
    return [L + t * S + j for j in range(steps)]


def _spec(rpi, r2t, lengths, v2p, *, E, K, S, ps, rows, window, sink):
    """``(kv_indptr, lists)`` read from the rules: ``lists[s][z]`` the ids of list ``z`` of
    step ``s``: the window's sink, its recent tokens, the branch's chain."""
    B = len(lengths)

    def emit(b, pos):
        return _emit(r2t[int(rpi[b])], pos, v2p, E=E, ps=ps)

    ptr, lists = [], []
    for s in range(rows):
        row_ptr, row_lists = [0], []
        for b in range(B):
            L = int(lengths[b])
            Lw = min(L, window + sink) if window else L
            keep_sink = min(sink, L) if window else 0
            prefix = list(range(keep_sink)) + list(range(L - (Lw - keep_sink), L))
            for t in range(K):
                chain = _chain(L, t, S, ps, K, s + 1)
                row_lists.append([emit(b, p) for p in prefix + chain])
                row_ptr.append(row_ptr[-1] + len(row_lists[-1]))
        ptr.append(row_ptr)
        lists.append(row_lists)
    return ptr, lists


def _build(args, *, K, S, ps, rows, width, device, **kw):
    """The kernel and the reference into guarded buffers of ``width`` entries a row."""
    rpi, r2t, lengths = (a.to(device) for a in args[:3])
    v2p = kw.pop("v2p", None)
    v2p = v2p.to(device) if v2p is not None else None
    got = []
    for fn in (draft_decode_kv_indices, draft_decode_kv_indices_ref):
        idx = Guarded((rows, width), torch.int64, device)
        ptr = Guarded((rows, len(lengths) * K + 1), torch.int32, device)
        status = new_status(device)
        fn(rpi, r2t, lengths, topk=K, num_steps=S, page_size=ps, num_rows=rows,
           kv_indices=idx.view, kv_indptr=ptr.view, status=status, v2p=v2p, **kw)  # fmt: skip
        idx.assert_intact(f"{fn.__name__} kv_indices")
        ptr.assert_intact(f"{fn.__name__} kv_indptr")
        got.append((idx.view.cpu(), ptr.view.cpu(), int(status)))
    return got


def _assert_lists(got, ptr, lists, what):
    idx, kv_indptr, _ = got
    for s, (row_ptr, row_lists) in enumerate(zip(ptr, lists, strict=True)):
        assert kv_indptr[s].tolist() == row_ptr, f"{what}: kv_indptr[{s}]"
        for z, want in enumerate(row_lists):
            have = idx[s, row_ptr[z] : row_ptr[z + 1]].tolist()
            assert have == want, f"{what}: step {s} list {z}"


FORMS = {
    "window": dict(window=6, sink=2, E=1, translate=False),
    "window_no_sink": dict(window=5, sink=0, E=1, translate=False),
    "page_rows": dict(window=0, sink=0, E=4, translate=False),
    "virtual": dict(window=0, sink=0, E=1, translate=True),
    "all": dict(window=7, sink=3, E=2, translate=True),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("K,S,ps", [(1, 3, 1), (2, 3, 4), (3, 2, 1)])
def test_lists_follow_the_rules_and_equal_the_reference(form, K, S, ps, gen, device):
    f = FORMS[form]
    B = int(torch.randint(1, 5, (1,), generator=gen))
    window = f["window"] + int(torch.randint(0, 3, (1,), generator=gen)) if f["window"] else 0
    args = _draw(gen, B=B, K=K, S=S, ps=ps, E=f["E"], translate=f["translate"])
    rpi, r2t, lengths, v2p = args
    rows = int(torch.randint(1, S + 1, (1,), generator=gen))
    ptr, lists = _spec(rpi, r2t, lengths, v2p, E=f["E"], K=K, S=S, ps=ps, rows=rows,
                       window=window, sink=f["sink"])  # fmt: skip
    width = ptr[-1][-1] + 5
    kernel, ref = _build(args, K=K, S=S, ps=ps, rows=rows, width=width, device=device,
                         window_size=window, sink_size=f["sink"], entry_page_size=f["E"],
                         v2p=v2p)  # fmt: skip
    _assert_lists(ref, ptr, lists, "reference")
    _assert_lists(kernel, ptr, lists, "kernel")
    assert kernel[2] == ref[2] == 0, f"status kernel {kernel[2]} reference {ref[2]}"


def test_window_edges_each_length_around_the_sink_and_the_window(gen, device):
    """L = 0, inside the sink, on the sink, inside the window, on it, one past it, far past."""
    window, sink, K, S, ps = 5, 3, 2, 2, 1
    lengths = [0, 2, 3, 7, 8, 9, MAX_L]
    args = _draw(gen, B=len(lengths), K=K, S=S, ps=ps, E=1, translate=False, lengths=lengths)
    rpi, r2t, L, _ = args
    ptr, lists = _spec(rpi, r2t, L, None, E=1, K=K, S=S, ps=ps, rows=S, window=window,
                       sink=sink)  # fmt: skip
    # Each list holds min(L, window + sink) prefix tokens and its chain.
    assert [len(lists[0][b * K]) - 1 for b in range(len(lengths))] == [0, 2, 3, 7, 8, 8, 8]
    kernel, ref = _build(args, K=K, S=S, ps=ps, rows=S, width=ptr[-1][-1], device=device,
                         window_size=window, sink_size=sink)  # fmt: skip
    _assert_lists(ref, ptr, lists, "reference")
    _assert_lists(kernel, ptr, lists, "kernel")
    assert kernel[2] == ref[2] == 0


def test_window_size_zero_reads_no_sink(gen, device):
    """No window: sink_size is not read, and the lists are the plain ones."""
    args = _draw(gen, B=3, K=2, S=2, ps=4, E=1, translate=False)
    plain = _build(args, K=2, S=2, ps=4, rows=2, width=300, device=device)
    sunk = _build(args, K=2, S=2, ps=4, rows=2, width=300, device=device, sink_size=4)
    for a, b in zip(plain, sunk, strict=True):
        assert_equal(b[0], a[0], "kv_indices")
        assert_equal(b[1], a[1], "kv_indptr")


@pytest.mark.parametrize("fault", ["unmapped_page", "page_past_map", "negative_entry"])
def test_an_id_that_does_not_map_gives_the_sink_slot_and_bad_kv_id_alone(fault, gen, device):
    K, S, ps, E = 2, 2, 4, 4
    args = _draw(gen, B=2, K=K, S=S, ps=ps, E=E, translate=True, lengths=[9, 12])
    rpi, r2t, L, v2p = args
    row, entry = int(rpi[1]), 1  # the second page of request 1's prefix: read by its branches
    if fault == "unmapped_page":
        v2p[int(r2t[row, entry]) * E // ps] = -1
    elif fault == "page_past_map":
        r2t[row, entry] = v2p.shape[0] * ps // E  # the first page id past the map
    else:
        r2t[row, entry] = -1
    ptr, lists = _spec(rpi, r2t, L, v2p, E=E, K=K, S=S, ps=ps, rows=S, window=0, sink=0)
    assert all(lists[0][K][k] == 0 for k in range(E, 2 * E)), "the fault is read"
    kernel, ref = _build(args, K=K, S=S, ps=ps, rows=S, width=200, device=device,
                         entry_page_size=E, v2p=v2p)  # fmt: skip
    _assert_lists(ref, ptr, lists, "reference")
    _assert_lists(kernel, ptr, lists, "kernel")
    assert kernel[2] == ref[2] == int(Status.BAD_KV_ID), (kernel[2], ref[2])


def test_a_short_buffer_reports_capacity_and_no_id_it_did_not_read(gen, device):
    """The last request's lists fall wholly past a short buffer: OUT_OF_CAPACITY alone, though
    every id of its row is unmapped (ids dropped for capacity are never read)."""
    args = _draw(gen, B=3, K=2, S=3, ps=1, E=2, translate=True, lengths=[20, 30, 25])
    rpi, r2t, _, v2p = args
    r2t[r2t == 31] = 30
    r2t[int(rpi[2])] = 31  # page 31 holds tokens 62 and 63, unmapped below
    v2p[62:64] = -1
    # Lists of 10 window tokens and the chain: request 2's first starts at 2·(10 + 10) + 4.
    kernel, ref = _build(args, K=2, S=3, ps=1, rows=3, width=44, device=device,
                         window_size=8, sink_size=2, entry_page_size=2, v2p=v2p)  # fmt: skip
    assert_equal(kernel[1], ref[1], "kv_indptr")
    assert_equal(kernel[0], ref[0], "kv_indices (both leave the poison past what they write)")
    assert kernel[2] == ref[2] == int(Status.OUT_OF_CAPACITY), (kernel[2], ref[2])


def test_seq_lens_sum_bounds_a_windowed_buffer_by_the_window(device):
    """With a window the host bound is min(ΣL, B·(window + sink)): a buffer sized for the
    window passes, one entry less is refused before anything is written."""
    B, K, S, window, sink = 2, 2, 2, 4, 1
    r2t = torch.zeros((3, 64), dtype=torch.int64, device=device)
    args = (torch.tensor([0, 1], device=device), r2t, torch.tensor([30, 20], device=device))
    need = K * B * (window + sink) + B * K * S
    ptr = torch.zeros((S, B * K + 1), dtype=torch.int32, device=device)
    kw = dict(topk=K, num_steps=S, window_size=window, sink_size=sink, seq_lens_sum=50,
              kv_indptr=ptr)  # fmt: skip
    draft_decode_kv_indices(*args, kv_indices=torch.zeros((S, need), dtype=torch.int64,
                                                          device=device), **kw)  # fmt: skip
    short = torch.full((S, need - 1), -7, dtype=torch.int64, device=device)
    ptr.fill_(-7)
    with pytest.raises(ValueError, match="kv_indices"):
        draft_decode_kv_indices(*args, kv_indices=short, **kw)
    assert bool((short == -7).all()) and bool((ptr == -7).all())


@pytest.mark.parametrize(
    "kw,error,words",
    [
        (dict(window_size=-1), ValueError, "window_size must be >= 0, got -1"),
        (dict(window_size=4, sink_size=-2), ValueError, "sink_size must be >= 0, got -2"),
        (dict(entry_page_size=0), ValueError, "entry_page_size must be >= 1, got 0"),
        (dict(window_size=2.0), TypeError, "window_size must be an int"),
        (dict(v2p="pages"), TypeError, "v2p"),
        (dict(v2p=torch.zeros((2, 2), dtype=torch.int64)), ValueError, "v2p"),
        (dict(v2p=torch.zeros(4)), TypeError, "v2p"),
    ],
)
def test_bad_id_space_arguments_are_refused_before_any_write(kw, error, words, device):
    r2t = torch.zeros((2, 16), dtype=torch.int64, device=device)
    idx = torch.full((2, 64), -7, dtype=torch.int64, device=device)
    ptr = torch.full((2, 3), -7, dtype=torch.int32, device=device)
    if isinstance(kw.get("v2p"), torch.Tensor):
        kw = dict(v2p=kw["v2p"].to(device))
    with pytest.raises(error) as info:
        draft_decode_kv_indices(torch.tensor([0], device=device), r2t,
                                torch.tensor([3], device=device), topk=2, num_steps=2,
                                kv_indices=idx, kv_indptr=ptr, **kw)  # fmt: skip
    message = str(info.value)
    assert message.startswith("draft_decode_kv_indices: ") and words in message, message
    assert message.endswith("(design §2.10: window_size 0 is no window, entry_page_size 1 rows "
                            "of token ids, v2p the pool's [P] int32 or int64 virtual -> "
                            "physical page map on the call's device)"), message  # fmt: skip
    assert bool((idx == -7).all()) and bool((ptr == -7).all())


@pytest.mark.parametrize("form", ["page_rows", "virtual", "all"])
@pytest.mark.parametrize("K,S,ps", [(1, 3, 4), (2, 3, 4), (3, 2, 1)])
def test_draft_slots_are_read_and_translated_as_the_rules_say(form, K, S, ps, gen, device):
    f = FORMS[form]
    B = int(torch.randint(1, 5, (1,), generator=gen))
    rpi, r2t, lengths, v2p = _draw(gen, B=B, K=K, S=S, ps=ps, E=f["E"], translate=f["translate"])
    if f["translate"]:  # one unmapped page among the virtual ones, read or not
        v2p[int(torch.randint(0, v2p.shape[0], (1,), generator=gen))] = -1
    want, bad = [], False
    for b in range(B):
        row, L = r2t[int(rpi[b])], int(lengths[b])
        for t in range(K):
            for p in _chain(L, t, S, ps, K, S):
                want.append(_emit(row, p, v2p, E=f["E"], ps=ps))
                tid = int(row[p // f["E"]]) * f["E"] + p % f["E"]
                bad |= v2p is not None and int(v2p[tid // ps]) < 0
    got = []
    for fn in (assign_draft_cache_locs, assign_draft_cache_locs_ref):
        out = Guarded((B * K * S,), torch.int64, device)
        status = new_status(device)
        fn(rpi.to(device), r2t.to(device), lengths.to(device), topk=K, num_steps=S,
           page_size=ps, out_cache_loc=out.view, status=status, entry_page_size=f["E"],
           v2p=v2p.to(device) if v2p is not None else None)  # fmt: skip
        out.assert_intact(fn.__name__)
        got.append((out.view.cpu().tolist(), int(status)))
    expected = int(Status.BAD_KV_ID) if bad else 0
    assert got[1] == (want, expected), "reference"
    assert got[0] == (want, expected), "kernel"


@pytest.mark.parametrize("unmapped", [False, True], ids=["mapped", "one_unmapped"])
def test_accept_pairs_leave_as_physical_slots(unmapped, gen, device):
    """Virtual verify slots through a page map: each accepted pair is (v2p(tgt), v2p(src)) in
    request order, then (0, 0); a pair with an unmapped slot is (0, 0) and BAD_KV_ID alone."""
    B, N, C, ps = 3, 4, 3, 4
    v2p = torch.randperm(64, generator=gen)[:16]  # 16 virtual pages of 4 slots
    slots = torch.randperm(16 * ps, generator=gen)[: B * N]
    accept_index = torch.tensor([[0, 2, -1], [4, 5, 7], [8, -1, -1]])
    accept_lens = torch.tensor([2, 3, 1])
    if unmapped:
        v2p[int(slots[7]) // ps] = -1  # request 1's node 3: the source of its third pair

    def phys(v):
        return int(v2p[v // ps]) * ps + v % ps

    want_tgt, want_src = [], []
    for i in range(B):
        for k in range(int(accept_lens[i])):
            t, s = int(slots[i * N + k]), int(slots[int(accept_index[i, k])])
            lost = int(v2p[t // ps]) < 0 or int(v2p[s // ps]) < 0
            want_tgt.append(0 if lost else phys(t))
            want_src.append(0 if lost else phys(s))
    want_tgt += [0] * (B * C - len(want_tgt))
    want_src += [0] * (B * C - len(want_src))
    for fn in (accept_cache_locs, accept_cache_locs_ref):
        status = new_status(device)
        tgt, src = fn(accept_index.to(device), accept_lens.to(device), slots.to(device),
                      num_draft_tokens=N, v2p=v2p.to(device), page_size=ps, status=status)  # fmt: skip
        assert tgt.tolist() == want_tgt and src.tolist() == want_src, fn.__name__
        assert int(status) == (int(Status.BAD_KV_ID) if unmapped else 0), fn.__name__


@pytest.mark.parametrize("form", ["page_rows", "virtual", "all"])
def test_prefix_tail_pairs_are_read_and_translated_as_the_rules_say(form, gen, device):
    """Layout B (K = 3, ps = 4): branch t ≥ 1 copies the prefix tail u < lpl from
    ``base + u`` to ``base + t·nnp·ps + u``, both ids read and translated; the unused pairs and
    a pair with an unmapped slot are (0, 0), the latter with BAD_KV_ID."""
    f, K, S, ps = FORMS[form], 3, 2, 4
    B = int(torch.randint(1, 5, (1,), generator=gen))
    rpi, r2t, lengths, v2p = _draw(gen, B=B, K=K, S=S, ps=ps, E=f["E"], translate=f["translate"])
    lengths[0] = 10  # lpl = 2: request 0 copies two tail tokens to each branch
    if f["translate"]:  # the page of request 0's first tail token is unmapped
        row, E = r2t[int(rpi[0])], f["E"]
        v2p[(int(row[8 // E]) * E + 8 % E) // ps] = -1
    want_tgt, want_src, bad = [], [], False
    for b in range(B):
        row, L = r2t[int(rpi[b])], int(lengths[b])
        lpl, base = L % ps, L - L % ps
        nnp = -(-(lpl + S) // ps)
        for t in range(1, K):
            for u in range(ps - 1):
                pair = (0, 0)
                if u < lpl:
                    pair = (_emit(row, base + t * nnp * ps + u, v2p, E=f["E"], ps=ps),
                            _emit(row, base + u, v2p, E=f["E"], ps=ps))  # fmt: skip
                    lost = v2p is not None and any(
                        int(v2p[(int(row[p // f["E"]]) * f["E"] + p % f["E"]) // ps]) < 0
                        for p in (base + u, base + t * nnp * ps + u)
                    )
                    pair = (0, 0) if lost else pair
                    bad |= lost
                want_tgt.append(pair[0])
                want_src.append(pair[1])
    for fn in (prefix_tail_copy_pairs, prefix_tail_copy_pairs_ref):
        status = new_status(device)
        tgt, src = fn(rpi.to(device), r2t.to(device), lengths.to(device), topk=K, num_steps=S,
                      page_size=ps, status=status, entry_page_size=f["E"],
                      v2p=v2p.to(device) if v2p is not None else None)  # fmt: skip
        assert tgt.tolist() == want_tgt and src.tolist() == want_src, fn.__name__
        assert int(status) == (int(Status.BAD_KV_ID) if bad else 0), fn.__name__


@pytest.mark.parametrize("form", ["page_rows", "virtual", "all"])
@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_verify_lists_are_read_and_translated_as_the_rules_say(form, ragged, gen, device):
    """Target verify and draft extend lists ``id(row_b, k)`` for ``k < L_b + n_b`` (``n_b = N``,
    or the ragged ``v_b``), CSR offsets from those lengths; with ``v2p`` the page of request
    0's first token unmapped: the sink slot 0 there and BAD_KV_ID."""
    f, N, ps = FORMS[form], 4, 4
    B = int(torch.randint(1, 5, (1,), generator=gen))
    rpi, r2t, lengths, v2p = _draw(gen, B=B, K=2, S=3, ps=ps, E=f["E"], translate=f["translate"])
    lengths[0] = max(int(lengths[0]), 1)
    if f["translate"]:  # the page of request 0's first token is unmapped
        v2p[int(r2t[int(rpi[0]), 0]) * f["E"] // ps] = -1
    v = torch.randint(0, N + 1, (B,), generator=gen) if ragged else None
    E, want, ptr, bad = f["E"], [], [0], False
    for b in range(B):
        row, L = r2t[int(rpi[b])], int(lengths[b])
        n = L + (int(v[b]) if ragged else N)
        for k in range(n):
            want.append(_emit(row, k, v2p, E=E, ps=ps))
            tid = int(row[k // E]) * E + k % E
            bad |= v2p is not None and int(v2p[tid // ps]) < 0
        ptr.append(len(want))
    for fn in (verify_kv_indices, verify_kv_indices_ref):
        status = new_status(device)
        idx = Guarded((len(want) + 3,), torch.int64, device)
        kw = dict(verify_lens=v.to(device)) if ragged else {}
        _, got_ptr = fn(rpi.to(device), r2t.to(device), lengths.to(device), extra_tokens=N,
           kv_indices=idx.view, status=status, entry_page_size=E, page_size=ps,
           v2p=v2p.to(device) if v2p is not None else None, **kw)  # fmt: skip
        idx.assert_intact(fn.__name__)
        assert idx.view[: len(want)].tolist() == want, fn.__name__
        assert got_ptr[: B + 1].tolist() == ptr, f"{fn.__name__} kv_indptr"
        assert int(status) == (int(Status.BAD_KV_ID) if bad else 0), fn.__name__


@pytest.mark.parametrize("form", ["page_rows", "virtual", "all"])
@pytest.mark.parametrize("K,S,ps", [(2, 3, 4), (4, 2, 1)])
def test_shared_prefix_levels_are_read_and_translated_as_the_rules_say(form, K, S, ps, gen,
                                                                        device):  # fmt: skip
    """The shared-prefix cascade's two levels (FlashInfer's second draft form): the prefix
    level ``id(row_b, k)`` for ``k < L_b``, the chain level branch ``(b, t)``'s slots of steps
    ``0 … s`` at row ``s``, every id read in the row's id space; with ``v2p`` the page of
    request 0's first token unmapped: the sink slot 0 there and BAD_KV_ID alone."""
    f = FORMS[form]
    E = f["E"]
    B = int(torch.randint(1, 5, (1,), generator=gen))
    rpi, r2t, lengths, v2p = _draw(gen, B=B, K=K, S=S, ps=ps, E=E, translate=f["translate"])
    lengths[0] = max(int(lengths[0]), 1)
    if f["translate"]:
        v2p[int(r2t[int(rpi[0]), 0]) * E // ps] = -1
    prefix, chains, bad = [], [[] for _ in range(S)], False
    for b in range(B):
        row, L = r2t[int(rpi[b])], int(lengths[b])
        ids = [_emit(row, k, v2p, E=E, ps=ps) for k in range(L)]
        prefix += ids
        bad |= f["translate"] and b == 0  # request 0's first token (L ≥ 1) is unmapped
        for t in range(K):
            slots = [_emit(row, p, v2p, E=E, ps=ps) for p in _chain(L, t, S, ps, K, S)]
            for s in range(S):
                chains[s] += slots[: s + 1]
    ptr = [0] + [int(x) for x in torch.cumsum(lengths[:B], 0)]
    for fn in (shared_prefix_kv_indices, shared_prefix_kv_indices_ref):
        status = new_status(device)
        pre = Guarded((len(prefix) + 3,), torch.int64, device)
        got = fn(rpi.to(device), r2t.to(device), lengths.to(device), topk=K, num_steps=S,
                 page_size=ps, prefix_kv_indices=pre.view, status=status, entry_page_size=E,
                 v2p=v2p.to(device) if v2p is not None else None)  # fmt: skip
        pre.assert_intact(fn.__name__)
        assert pre.view[: len(prefix)].tolist() == prefix, fn.__name__
        assert got[1][: B + 1].tolist() == ptr, f"{fn.__name__} prefix_kv_indptr"
        for s in range(S):
            assert got[2][s, : len(chains[s])].tolist() == chains[s], f"{fn.__name__} chain {s}"
        want = int(Status.BAD_KV_ID) if bad else 0
        assert int(status) == want, (fn.__name__, Status(int(status)))
