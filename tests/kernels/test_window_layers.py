"""Sliding-window layers (design §2.10): the window read rail (``sliding_window_size``) and the
full → window pool map (``full_to_swa``) in draft_decode_kv_indices, verify_kv_indices (uniform
and ragged), tree_custom_mask (uniform and ragged) and assign_draft_cache_locs.

Each output is checked against the rules read directly (a Python loop per list: positions
``(p − w, p]``, ids through the row's space and then the map), and each kernel against its
torch reference, on fresh random inputs and on the edges: ``w`` 1, below, at and above ``L``;
``L = 0``; a ``−1`` of the map inside and outside what the rail reads; ids past the map.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.branch_kv_indices import branch_kv_indices, branch_kv_indices_ref
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, assign_draft_cache_locs_ref
from specmeta.kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from specmeta.kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from specmeta.kernels.tree_custom_mask import tree_custom_mask, tree_custom_mask_ref
from specmeta.kernels.verify_kv_indices import verify_kv_indices, verify_kv_indices_ref
from tests._support import emitted_id
from tests.guard_bands import Guarded, assert_equal

MAX_L = 24
POOL_PAGES = 48


def _draw(gen, *, B, K, S, ps, E, translate, lengths=None, extra=0, holes=0.2):
    """A batch (rows of token ids, or page ids with ``E > 1``; a page map with ``translate``)
    and a full → window pool map over the pool its ids name: a random injection into a pool
    twice the size, ``holes`` of its entries ``−1``, the sink kept in place."""
    R = B + 2
    W_row = -(-(MAX_L + K * (S + ps) + ps + extra) // E)
    r2t = torch.randint(0, POOL_PAGES * ps // E, (R, W_row), generator=gen)
    rpi = torch.randperm(R, generator=gen)[:B]
    if lengths is None:
        lengths = torch.randint(0, MAX_L + 1, (B,), generator=gen)
    else:
        lengths = torch.tensor(lengths)
    v2p = torch.randperm(2 * POOL_PAGES, generator=gen)[:POOL_PAGES] if translate else None
    full = (2 * POOL_PAGES if translate else POOL_PAGES) * ps
    f2s = torch.randperm(2 * full, generator=gen)[:full]
    f2s[torch.rand(full, generator=gen) < holes] = -1
    f2s[0] = 0
    return rpi, r2t, lengths, v2p, f2s


def _window_id(row, p, v2p, f2s, *, E, ps):
    """The id a window layer lists for row position ``p``: the row's own id (design §2.10),
    then the map; 0 where either does not map."""
    full = emitted_id(row, p, v2p, E=E, ps=ps)
    if f2s is None:
        return full
    if full < 0 or full >= f2s.shape[0] or int(f2s[full]) < 0:
        return 0
    return int(f2s[full])


def _chain(L, t, S, ps, K, j):
    """Row position of branch ``t``'s step-``j`` draft token (design §1)."""
    if ps > 1 and K > 1:
        lpl = L % ps
        nnp = -(-(lpl + S) // ps)
        return L - lpl + t * nnp * ps + lpl + j
    return L + t * S + j


# ------------------------------------------------------------------------------ draft decode
def _draft_spec(rpi, r2t, lengths, v2p, f2s, *, E, K, S, ps, rows, w):
    """``(kv_indptr, lists)`` read from the rail: step ``s`` of branch ``(b, t)`` lists the
    last ``min(L + s + 1, w)`` of [prefix positions 0 … L − 1, its chain's steps 0 … s]."""
    ptr, lists = [], []
    for s in range(rows):
        row_ptr, row_lists = [0], []
        for b, L in enumerate(lengths.tolist()):
            row = r2t[int(rpi[b])]
            for t in range(K):
                seq = list(range(L)) + [_chain(L, t, S, ps, K, j) for j in range(s + 1)]
                seq = seq[len(seq) - min(len(seq), w) :] if w else seq
                row_lists.append([_window_id(row, p, v2p, f2s, E=E, ps=ps) for p in seq])
                row_ptr.append(row_ptr[-1] + len(row_lists[-1]))
        ptr.append(row_ptr)
        lists.append(row_lists)
    return ptr, lists


def _draft_build(fn, inputs, *, K, S, ps, rows, width, E, w, device, use_map=True):
    rpi, r2t, lengths, v2p, f2s = (x.to(device) if x is not None else None for x in inputs)
    idx = Guarded((rows, width), torch.int64, device)
    ptr = Guarded((rows, len(lengths) * K + 1), torch.int32, device)
    status = new_status(device)
    fn(rpi, r2t, lengths, topk=K, num_steps=S, page_size=ps, num_rows=rows, kv_indices=idx.view,
       kv_indptr=ptr.view, status=status, v2p=v2p, entry_page_size=E, sliding_window_size=w,
       full_to_swa=f2s if use_map else None)  # fmt: skip
    idx.assert_intact(f"{fn.__name__} kv_indices")
    ptr.assert_intact(f"{fn.__name__} kv_indptr")
    return idx.view.cpu(), ptr.view.cpu(), int(status)


FORMS = {
    "tokens": dict(E=1, translate=False),
    "page_rows": dict(E=4, translate=False),
    "virtual": dict(E=1, translate=True),
    "pages_virtual": dict(E=2, translate=True),
}


@pytest.mark.parametrize("form,K,S,ps", [("tokens", 3, 2, 1), ("page_rows", 1, 3, 1),
                                          ("virtual", 2, 3, 4), ("pages_virtual", 2, 3, 4)])
def test_draft_lists_follow_the_rail_and_equal_the_reference(form, K, S, ps, gen, device):
    E, translate = FORMS[form]["E"], FORMS[form]["translate"]
    inputs = _draw(gen, B=4, K=K, S=S, ps=ps, E=E, translate=translate,
                   lengths=[0, 1, int(torch.randint(2, MAX_L + 1, (1,), generator=gen)), MAX_L])  # fmt: skip
    # w = 1 (the token itself), below every long L, at the longest L + 1, above all
    for w in (1, int(torch.randint(2, 6, (1,), generator=gen)), 1 + MAX_L, 2 * MAX_L):
        ptr, lists = _draft_spec(*inputs, E=E, K=K, S=S, ps=ps, rows=S, w=w)
        width = ptr[-1][-1] + 3
        got = [_draft_build(fn, inputs, K=K, S=S, ps=ps, rows=S, width=width, E=E, w=w,
                            device=device)
               for fn in (draft_decode_kv_indices, draft_decode_kv_indices_ref)]  # fmt: skip
        for (idx, kv_indptr, _), name in zip(got, ("kernel", "reference"), strict=True):
            for s in range(S):
                assert kv_indptr[s].tolist() == ptr[s], f"{name} w={w}: kv_indptr[{s}]"
                for z, want in enumerate(lists[s]):
                    have = idx[s, ptr[s][z] : ptr[s][z + 1]].tolist()
                    assert have == want, f"{name} w={w}: step {s} list {z}"
        assert got[0][2] == got[1][2], f"w={w}: status {got[0][2]} != {got[1][2]}"
        for s in range(S):
            assert_equal(got[0][0][s, : ptr[s][-1]], got[1][0][s, : ptr[s][-1]], f"w={w} row {s}")


def test_draft_rail_without_the_map_lists_full_pool_ids(gen, device):
    """The rail alone clips; the ids stay the full pool's (a full layer of a window model)."""
    inputs = _draw(gen, B=3, K=2, S=3, ps=1, E=1, translate=False)
    w = 5
    rpi, r2t, lengths, _, _ = inputs
    ptr, lists = _draft_spec(rpi, r2t, lengths, None, None, E=1, K=2, S=3, ps=1, rows=3, w=w)
    idx, kv_indptr, status = _draft_build(draft_decode_kv_indices, inputs, K=2, S=3, ps=1, rows=3,
                                          width=ptr[-1][-1], E=1, w=w, device=device,
                                          use_map=False)  # fmt: skip
    assert status == 0
    for s in range(3):
        assert kv_indptr[s].tolist() == ptr[s]
        assert idx[s, : ptr[s][-1]].tolist() == [i for z in lists[s] for i in z]


def _one_request(f2s_hole_at, *, L, w, S, device):
    """One request of a plain row ``row[p] = 10 + p`` (ids of a 64-slot pool), an identity map
    with a −1 at full slot ``f2s_hole_at``; returns (kernel status, reference status)."""
    r2t = torch.zeros(2, 64, dtype=torch.int64)
    r2t[1] = 10 + torch.arange(64)
    f2s = torch.arange(128)
    f2s[f2s_hole_at] = -1
    args = (torch.tensor([1]), r2t, torch.tensor([L]))
    got = []
    for fn in (draft_decode_kv_indices, draft_decode_kv_indices_ref):
        status = new_status(device)
        fn(*(a.to(device) for a in args), topk=1, num_steps=S, status=status,
           sliding_window_size=w, full_to_swa=f2s.to(device), seq_lens_sum=L)  # fmt: skip
        got.append(int(status))
    return got


def test_a_hole_the_rail_reads_is_reported_and_one_it_skips_is_not(device):
    L, w, S = 20, 4, 2
    # step 1 reads positions 18, 19 and the chain 20, 21 (w = 4); step 0: 17, 18, 19, 20.
    read = 10 + 17
    assert _one_request(read, L=L, w=w, S=S, device=device) == [int(Status.BAD_KV_ID)] * 2
    unread = 10 + 16  # inside the prefix, outside every step's rail
    assert _one_request(unread, L=L, w=w, S=S, device=device) == [0, 0]


def test_an_id_past_the_map_is_the_sink_and_reported(device):
    r2t = torch.zeros(2, 32, dtype=torch.int64)
    r2t[1] = torch.arange(32)
    r2t[1, 5] = 1000  # past the 64-slot map
    f2s = torch.arange(64) + 100
    f2s[0] = 0
    for fn in (verify_kv_indices, verify_kv_indices_ref):
        status = new_status(device)
        idx, ptr = fn(torch.tensor([1], device=device), r2t.to(device),
                      torch.tensor([6], device=device), extra_tokens=2, sliding_window_size=4,
                      full_to_swa=f2s.to(device), status=status)  # fmt: skip
        # w = 4: the list starts at 6 − 3 = 3, positions 3 … 7
        assert idx[: int(ptr[1])].tolist() == [103, 104, 0, 106, 107], fn.__name__
        assert int(status) == int(Status.BAD_KV_ID), fn.__name__


# --------------------------------------------------------------------- verify and extend lists
def _verify_spec(rpi, r2t, lengths, v2p, f2s, *, E, ps, extra, w):
    """Request ``b``'s list: row positions ``f … L + extra − 1``, ``f = max(0, L − w + 1)``."""
    ptr, ids = [0], []
    for b, L in enumerate(lengths.tolist()):
        first = max(0, L - w + 1) if w else 0
        row = r2t[int(rpi[b])]
        ids += [_window_id(row, p, v2p, f2s, E=E, ps=ps) for p in range(first, L + extra)]
        ptr.append(len(ids))
    return ptr, ids


@pytest.mark.parametrize("form", sorted(FORMS))
def test_verify_lists_follow_the_rail_and_equal_the_reference(form, gen, device):
    E, translate, ps, N = FORMS[form]["E"], FORMS[form]["translate"], 4, 3
    lengths = [0, 1, 2, int(torch.randint(3, MAX_L + 1, (1,), generator=gen)), MAX_L]
    inputs = _draw(gen, B=5, K=1, S=1, ps=ps, E=E, translate=translate, lengths=lengths, extra=N)
    for w in (1, 2, int(torch.randint(3, 8, (1,), generator=gen)), MAX_L, MAX_L + 1, None):
        ptr, ids = _verify_spec(*inputs, E=E, ps=ps, extra=N, w=w)
        got = []
        for fn in (verify_kv_indices, verify_kv_indices_ref):
            rpi, r2t, L, v2p, f2s = (x.to(device) if x is not None else None for x in inputs)
            idx = Guarded((sum(lengths) + 5 * N,), torch.int64, device)  # the host bound
            kv_indptr = Guarded((6,), torch.int32, device)
            status = new_status(device)
            fn(rpi, r2t, L, extra_tokens=N, kv_indices=idx.view, kv_indptr=kv_indptr.view,
               status=status, v2p=v2p, page_size=ps, entry_page_size=E, sliding_window_size=w,
               full_to_swa=f2s, seq_lens_sum=sum(lengths))  # fmt: skip
            idx.assert_intact(fn.__name__)
            kv_indptr.assert_intact(fn.__name__)
            assert kv_indptr.view.tolist() == ptr, f"{fn.__name__} w={w}: kv_indptr"
            assert idx.view[: ptr[-1]].tolist() == ids, f"{fn.__name__} w={w}: kv_indices"
            got.append(int(status))
        assert got[0] == got[1], f"w={w}: status {got}"


# ---------------------------------------------------------------------------------- tree mask
def _random_tree(gen, N):
    """Parents of an ``N``-node tree in topological order (node 0 the root), drawn at random:
    chains, bushes and everything between."""
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, N)]


def _tree_mask(parents):
    N = len(parents)
    m = torch.zeros(N, N, dtype=torch.bool)
    for j in range(N):
        c = j
        while c >= 0:
            m[j, c] = True
            c = parents[c]
    return m


def _depth(parents, j):
    d = 0
    while parents[j] >= 0:
        j, d = parents[j], d + 1
    return d


def _mask_spec(lengths, trees, w):
    """Request ``i``'s block over its clipped list (positions ``f … L + N − 1``, the tree
    columns at ``L + c``): node ``j`` at position ``L + d_j`` sees prefix position ``k`` iff
    ``k > L + d_j − w``, and its ancestor-or-self ``c`` (at ``L + d_c``) iff ``d_c > d_j − w``."""
    blocks = []
    for L, parents in zip(lengths, trees, strict=True):
        N = len(parents)
        first = max(0, L - w + 1) if w else 0
        anc = _tree_mask(parents)
        block = []
        for j in range(N):
            dj = _depth(parents, j)
            row = [(not w) or k > L + dj - w for k in range(first, L)]
            row += [bool(anc[j, c]) and ((not w) or _depth(parents, c) > dj - w) for c in range(N)]
            block.append(row)
        blocks.append(torch.tensor(block, dtype=torch.bool).reshape(-1))
    return blocks


def _packed(bits):
    """Eight elements a byte, element ``e`` at bit ``e % 8`` (design §3.3)."""
    padded = torch.cat([bits.to(torch.int64), bits.new_zeros(-bits.numel() % 8, dtype=torch.int64)])
    return (padded.view(-1, 8) << torch.arange(8)).sum(1)


@pytest.mark.parametrize("packed", [False, True])
def test_tree_mask_follows_the_rail_and_equals_the_reference(packed, gen, device):
    N, B = 6, 4
    lengths = [0, 2, int(torch.randint(3, MAX_L + 1, (1,), generator=gen)), MAX_L]
    trees = [_random_tree(gen, N) for _ in range(B)]
    trees[0] = list(range(-1, N - 1))  # a chain
    tree_mask = torch.stack([_tree_mask(p) for p in trees]).to(device)
    for w in (1, 2, 3, int(torch.randint(4, 10, (1,), generator=gen)), MAX_L + N, None):
        blocks = _mask_spec(lengths, trees, w)
        starts = [0]
        for blk in blocks:
            starts.append(starts[-1] + blk.numel())
        for fn in (tree_custom_mask, tree_custom_mask_ref):
            dtype = torch.uint8 if packed else torch.bool
            mask = torch.zeros(N * sum(lengths) + B * N * N, dtype=dtype, device=device)
            status = new_status(device)
            _, mask_indptr = fn(torch.tensor(lengths, device=device), tree_mask, packed=packed,
                                custom_mask=mask, status=status, sliding_window_size=w,
                                seq_lens_sum=sum(lengths))  # fmt: skip
            assert mask_indptr.tolist() == starts, f"{fn.__name__} w={w}: mask_indptr"
            assert int(status) == 0
            for i, blk in enumerate(blocks):
                want = _packed(blk) if packed else blk
                have = mask.cpu()[starts[i] : starts[i] + want.numel()]
                assert_equal(have, want, f"{fn.__name__} w={w} packed={packed}: request {i}")


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
@pytest.mark.parametrize("packed", [False, True])
def test_tree_mask_rows_wider_than_a_chunk_under_the_rail(packed, ragged, gen, device):
    """Rows of more prefix columns than a chunk holds: whole chunks inside one row's prefix
    take the row's first seen column once (the kernel's fast path), the others element by
    element; both as the rule says. Ragged: a padded length's filler rows (every column) and
    one node."""
    N, w = 4, int(torch.randint(2100, 2400, (1,), generator=gen))
    lengths = [int(torch.randint(2400, 2600, (1,), generator=gen)), 1800]
    trees = [_random_tree(gen, N), list(range(-1, N - 1))]
    tree_mask = torch.stack([_tree_mask(p) for p in trees]).to(device)
    verify = [N + 2, 1] if ragged else None
    if ragged:
        blocks = _ragged_blocks(lengths, trees, verify, N=N, w=w)
    else:
        blocks = _mask_spec(lengths, trees, w)
    starts = [0, blocks[0].numel(), blocks[0].numel() + blocks[1].numel()]
    for fn in (tree_custom_mask, tree_custom_mask_ref):
        mask = torch.zeros(starts[-1], dtype=torch.uint8 if packed else torch.bool, device=device)
        v = torch.tensor(verify, device=device) if ragged else None
        _, mask_indptr = fn(torch.tensor(lengths, device=device), tree_mask, packed=packed,
                            custom_mask=mask, sliding_window_size=w, verify_lens=v)  # fmt: skip
        assert mask_indptr.tolist() == starts, fn.__name__
        for i, blk in enumerate(blocks):
            want = _packed(blk) if packed else blk
            have = mask.cpu()[starts[i] : starts[i] + want.numel()]
            assert_equal(have, want, f"{fn.__name__} w={w} packed={packed}: request {i}")


# --------------------------------------------------------------------- ragged verify, railed
def _ragged_lists(rpi, r2t, lengths, v2p, f2s, verify, *, E, ps, N, w):
    """A window layer's ragged lists read from the rules (design §2.9, §2.10): request ``b``
    lists positions ``f … L + min(v, N) − 1``, ``f = max(0, L − w + 1)`` (its first query row
    is still at ``L``)."""
    ptr, ids = [0], []
    for b, (L, v) in enumerate(zip(lengths.tolist(), verify, strict=True)):
        row = r2t[int(rpi[b])]
        last = L + min(max(v, 0), N)
        ids += [_window_id(row, p, v2p, f2s, E=E, ps=ps) for p in range(max(0, L - w + 1), last)]
        ptr.append(len(ids))
    return ptr, ids


def _ragged_blocks(lengths, trees, verify, *, N, w):
    """A window layer's ragged mask blocks read from the rules: request ``b``'s ``v × (min(L,
    w − 1) + min(v, N))`` block gives node ``j < min(v, N)`` (at ``L + d_j``) the prefix
    positions above ``L + d_j − w`` and its ancestors ``c`` among the first ``min(v, N)`` with
    ``d_c > d_j − w``, and a filler row ``j ≥ N`` every column."""
    blocks = []
    for L, v, parents in zip(lengths, verify, trees, strict=True):
        v = max(v, 0)
        nodes, first = min(v, N), max(0, L - w + 1)
        anc = _tree_mask(parents)
        block = []
        for j in range(v):
            if j >= N:
                block.append([True] * (L - first + nodes))
                continue
            dj = _depth(parents, j)
            block.append([k > L + dj - w for k in range(first, L)]
                         + [bool(anc[j, c]) and _depth(parents, c) > dj - w
                            for c in range(nodes)])  # fmt: skip
        blocks.append(torch.tensor(block, dtype=torch.bool).reshape(-1))
    return blocks


@pytest.mark.parametrize("packed", [False, True])
def test_ragged_verify_follows_the_rail_and_equals_the_reference(packed, gen, device):
    """Each request's clipped list and block with its own ``v_b``: ``v`` 0, 1, ``N``, a padded
    length past ``N`` (filler rows), random; ``L`` 0, short, long; ``w`` 1, below, at and above
    ``L``; both id spaces at once (a page map, the window map with holes)."""
    N, E, ps = 4, 1, 4
    lengths = [0, 1, MAX_L, int(torch.randint(2, MAX_L, (1,), generator=gen)), MAX_L, 3]
    verify = [N, 0, 1, N + 3, int(torch.randint(0, N + 1, (1,), generator=gen)), N]
    B = len(lengths)
    inputs = _draw(gen, B=B, K=1, S=1, ps=ps, E=E, translate=True, lengths=lengths, extra=N)
    trees = [_random_tree(gen, N) for _ in range(B)]
    tree_mask = torch.stack([_tree_mask(p) for p in trees]).to(device)
    v_dev = torch.tensor(verify, dtype=torch.int32, device=device)
    L_dev = inputs[2].to(device)
    for w in (1, 2, int(torch.randint(3, 8, (1,), generator=gen)), MAX_L, MAX_L + 1):
        ptr, ids = _ragged_lists(*inputs, verify, E=E, ps=ps, N=N, w=w)
        blocks = _ragged_blocks(lengths, trees, verify, N=N, w=w)
        starts = [0]
        for blk in blocks:
            starts.append(starts[-1] + blk.numel())
        got = []
        for vfn, mfn in ((verify_kv_indices, tree_custom_mask),
                         (verify_kv_indices_ref, tree_custom_mask_ref)):  # fmt: skip
            rpi, r2t, L, v2p, f2s = (x.to(device) for x in inputs)
            idx = Guarded((sum(lengths) + B * N,), torch.int64, device)  # the host bound
            kv_indptr = Guarded((B + 1,), torch.int32, device)
            status = new_status(device)
            vfn(rpi, r2t, L, extra_tokens=N, kv_indices=idx.view, kv_indptr=kv_indptr.view,
                status=status, v2p=v2p, page_size=ps, verify_lens=v_dev, sliding_window_size=w,
                full_to_swa=f2s, seq_lens_sum=sum(lengths))  # fmt: skip
            idx.assert_intact(vfn.__name__)
            kv_indptr.assert_intact(vfn.__name__)
            assert kv_indptr.view.tolist() == ptr, f"{vfn.__name__} w={w}: kv_indptr"
            assert idx.view[: ptr[-1]].tolist() == ids, f"{vfn.__name__} w={w}: kv_indices"
            fill = 0xA5 if packed else True  # past the last block: never written
            mask = torch.full((starts[-1] + 16,), fill, device=device,
                              dtype=torch.uint8 if packed else torch.bool)  # fmt: skip
            mask_indptr = Guarded((B + 1,), torch.int32, device)
            mfn(L_dev, tree_mask, packed=packed, custom_mask=mask, mask_indptr=mask_indptr.view,
                status=status, verify_lens=v_dev, sliding_window_size=w)  # fmt: skip
            mask_indptr.assert_intact(mfn.__name__)
            assert mask[starts[-1] :].eq(fill).all(), f"{mfn.__name__} w={w}: written past"
            assert mask_indptr.view.tolist() == starts, f"{mfn.__name__} w={w}: mask_indptr"
            for i, blk in enumerate(blocks):
                want = _packed(blk) if packed else blk
                have = mask.cpu()[starts[i] : starts[i] + want.numel()]
                assert_equal(have, want, f"{mfn.__name__} w={w} {packed=}: request {i}")
            got.append(int(status))
        assert got[0] == got[1], f"w={w}: status {got}"
    # a mask that is no tree (bits past a node, past v): the kernel and its twin still agree,
    # each depth counted over the block's min(v, N) tree columns alone
    garbage = torch.rand(B, N, N, generator=gen).lt(0.5).to(device)
    for w in (2, 5):
        masks = []
        for mfn in (tree_custom_mask, tree_custom_mask_ref):
            mask = torch.zeros(N * sum(lengths) + B * (N + 3) * N, dtype=torch.bool, device=device)
            mfn(L_dev, garbage, custom_mask=mask, verify_lens=v_dev, sliding_window_size=w)
            masks.append(mask.cpu())
        assert_equal(masks[0], masks[1], f"a mask that is no tree, w={w}")
    # a negative length reads as 0 and is reported by both, under the rail as without it
    for vfn, mfn in ((verify_kv_indices, tree_custom_mask),
                     (verify_kv_indices_ref, tree_custom_mask_ref)):  # fmt: skip
        status = new_status(device)
        bad = torch.tensor([-1] + verify[1:], dtype=torch.int32, device=device)
        _, kv_indptr = vfn(*(x.to(device) for x in inputs[:3]), extra_tokens=N, verify_lens=bad,
                           sliding_window_size=3, status=status, seq_lens_sum=sum(lengths))  # fmt: skip
        assert int(kv_indptr[1]) == 0 and int(status) == int(Status.POS_OOB), vfn.__name__
        status = new_status(device)
        _, mask_indptr = mfn(L_dev, tree_mask, verify_lens=bad, sliding_window_size=3,
                             status=status, seq_lens_sum=sum(lengths))  # fmt: skip
        assert int(mask_indptr[1]) == 0 and int(status) == int(Status.POS_OOB), mfn.__name__


# --------------------------------------------------------------------- shared-prefix cascade
def _cascade_spec(rpi, r2t, lengths, v2p, f2s, *, E, K, S, ps, rows, w):
    """Both levels of the cascade read from the rail (design §2.10): step ``s``'s prefix row
    lists each request's last ``min(L, max(w − s − 1, 0))`` positions (every position without
    a rail, one row for all steps), its chain row each branch's last ``min(s + 1, w)`` steps."""
    prefix, chain = [], []
    for s in range(rows if w else 1):
        keep = max(w - s - 1, 0) if w else None
        ptr, ids = [0], []
        for b, L in enumerate(lengths.tolist()):
            n = min(L, keep) if w else L
            ids += [_window_id(r2t[int(rpi[b])], p, v2p, f2s, E=E, ps=ps) for p in range(L - n, L)]
            ptr.append(len(ids))
        prefix.append((ptr, ids))
    for s in range(rows):
        width = min(s + 1, w) if w else s + 1
        ptr, ids = [0], []
        for b, L in enumerate(lengths.tolist()):
            row = r2t[int(rpi[b])]
            for t in range(K):
                ids += [_window_id(row, _chain(L, t, S, ps, K, j), v2p, f2s, E=E, ps=ps)
                        for j in range(s + 1 - width, s + 1)]  # fmt: skip
                ptr.append(len(ids))
        chain.append((ptr, ids))
    return prefix, chain


@pytest.mark.parametrize("form,K,S,ps", [("tokens", 3, 3, 1), ("pages_virtual", 2, 3, 4)])
def test_cascade_levels_follow_the_rail_and_equal_the_reference(form, K, S, ps, gen, device):
    """The shared-prefix cascade of a window layer: a prefix row a step, the chains clipped,
    both levels in window-pool ids; ``w`` 1 (no prefix at all), below, at and above ``L``, and
    the map without a rail (one prefix row, every position); ``L`` 0 and ``MAX_L``."""
    E, translate = FORMS[form]["E"], FORMS[form]["translate"]
    lengths = [0, 1, int(torch.randint(2, MAX_L, (1,), generator=gen)), MAX_L]
    inputs = _draw(gen, B=4, K=K, S=S, ps=ps, E=E, translate=translate, lengths=lengths)
    B = len(lengths)
    for w in (1, 2, int(torch.randint(3, 8, (1,), generator=gen)), MAX_L + S, None):
        prefix, chain = _cascade_spec(*inputs, E=E, K=K, S=S, ps=ps, rows=S, w=w)
        # the host's bound: ΣL, at most B·(w − 1) (step 0 keeps min(L, w − 1)) under the rail
        width = max(1, min(sum(lengths), B * (w - 1)) if w else sum(lengths))
        got = []
        for fn in (shared_prefix_kv_indices, shared_prefix_kv_indices_ref):
            rpi, r2t, L, v2p, f2s = (x.to(device) if x is not None else None for x in inputs)
            shape = (S, width) if w else (width,)
            p_idx = Guarded(shape, torch.int64, device)
            p_ptr = Guarded((S, B + 1) if w else (B + 1,), torch.int32, device)
            c_idx = Guarded((S, B * K * S), torch.int64, device)
            c_ptr = Guarded((S, B * K + 1), torch.int32, device)
            status = new_status(device)
            fn(rpi, r2t, L, topk=K, num_steps=S, page_size=ps, prefix_kv_indices=p_idx.view,
               prefix_kv_indptr=p_ptr.view, chain_kv_indices=c_idx.view,
               chain_kv_indptr=c_ptr.view, status=status, v2p=v2p, entry_page_size=E,
               sliding_window_size=w, full_to_swa=f2s, seq_lens_sum=sum(lengths))  # fmt: skip
            for buf, name in ((p_idx, "prefix_kv_indices"), (p_ptr, "prefix_kv_indptr"),
                              (c_idx, "chain_kv_indices"), (c_ptr, "chain_kv_indptr")):  # fmt: skip
                buf.assert_intact(f"{fn.__name__} w={w} {name}")
            pi, pp = p_idx.view.view(len(prefix), -1).cpu(), p_ptr.view.view(len(prefix), -1)
            for s, (ptr, ids) in enumerate(prefix):
                assert pp[s].tolist() == ptr, f"{fn.__name__} w={w}: prefix_kv_indptr[{s}]"
                assert pi[s, : ptr[-1]].tolist() == ids, f"{fn.__name__} w={w}: prefix row {s}"
            for s, (ptr, ids) in enumerate(chain):
                assert c_ptr.view[s].tolist() == ptr, f"{fn.__name__} w={w}: chain_kv_indptr[{s}]"
                assert c_idx.view[s, : ptr[-1]].tolist() == ids, f"{fn.__name__} w={w}: chain {s}"
            got.append(int(status))
        assert got[0] == got[1], f"w={w}: status {got}"


def test_cascade_capacity_under_the_rail(device):
    """A prefix row of exactly step 0's clipped need passes the host check, one entry less is
    refused; a row a step is required; a draft window beside the rail is refused."""
    args = _batch(device)  # one request, L = 5
    w, S = 3, 2
    full = dict(topk=2, num_steps=S, sliding_window_size=w, seq_lens_sum=5)
    ptr = torch.empty(S, 2, dtype=torch.int32, device=device)
    shared_prefix_kv_indices(*args, **full, prefix_kv_indptr=ptr,
                             prefix_kv_indices=torch.empty(S, w - 1, dtype=torch.int32,
                                                           device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"prefix_kv_indices is too small: need 2"):
        shared_prefix_kv_indices(*args, **full, prefix_kv_indptr=ptr,
                                 prefix_kv_indices=torch.empty(S, w - 2, dtype=torch.int32,
                                                               device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"prefix_kv_indices must have rank 2"):
        shared_prefix_kv_indices(*args, **full,
                                 prefix_kv_indices=torch.empty(9, dtype=torch.int32,
                                                               device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"shared_prefix_kv_indices: window_size=4.*never both"):
        shared_prefix_kv_indices(*args, **full, window_size=4)


# ------------------------------------------------------------------------- paged draft lists
def _paged_spec(rpi, r2t, lengths, v2p, f2s, *, E, K, S, ps, rows, w):
    """A window layer's per-branch page lists read from the rules (design §1, §2.10): step
    ``s`` of branch ``(b, t)`` keeps its ``ceil((L + s + 1) / ps)`` columns (the full prefix
    pages, then its region's); a column wholly below ``f = max(0, L − w + 1)`` is the sink
    page 0, any other the page of the id at its first position from ``f`` on."""
    ptr, lists, last = [], [], []
    for s in range(rows):
        row_ptr, row_lists, row_last = [0], [], []
        for b, L in enumerate(lengths.tolist()):
            row, f = r2t[int(rpi[b])], (max(0, L - w + 1) if w else 0)
            lpl = L % ps
            full, nnp = (L - lpl) // ps, -(-(lpl + S) // ps)
            for t in range(K):
                pages = []
                for c in range(-(-(L + s + 1) // ps)):
                    first = c * ps if c < full else L - lpl + (t * nnp + c - full) * ps
                    if (c + 1) * ps <= f:
                        pages.append(0)
                        continue
                    at = first + max(f - c * ps, 0)
                    pages.append(_window_id(row, at, v2p, f2s, E=E, ps=ps) // ps)
                row_lists.append(pages)
                row_ptr.append(row_ptr[-1] + len(pages))
                row_last.append((L + s) % ps + 1)
        ptr.append(row_ptr)
        lists.append(row_lists)
        last.append(row_last)
    return ptr, lists, last


@pytest.mark.parametrize("form,K,S,ps", [("pages_virtual", 3, 2, 4), ("virtual", 1, 3, 8)])
def test_paged_lists_follow_the_floor_and_equal_the_reference(form, K, S, ps, gen, device):
    """Full-length page lists of a window layer: the sink page below the read floor, window-pool
    pages from it on (read at the floor where it falls inside a page, in a branch's region
    too); ``w`` 1, below, at and above ``L``, and the map without a rail (every column
    through the map); ``L`` 0 and ``MAX_L``. A page map that keeps pages together, with
    holes (``−1`` slots) inside and outside what the floor reads."""
    E, translate = FORMS[form]["E"], FORMS[form]["translate"]
    lengths = [0, 1, int(torch.randint(2, MAX_L, (1,), generator=gen)), MAX_L]
    inputs = list(_draw(gen, B=4, K=K, S=S, ps=ps, E=E, translate=translate, lengths=lengths,
                        holes=0.0))  # fmt: skip
    pages = inputs[4].shape[0] // ps  # the window pool pages like the full pool
    f2s = (torch.randperm(2 * pages, generator=gen)[:pages].view(-1, 1) * ps
           + torch.arange(ps)).view(-1)  # fmt: skip
    f2s[: ps] = torch.arange(ps)  # the sink page in place
    f2s[torch.rand(f2s.shape[0], generator=gen) < 0.1] = -1
    f2s[0] = 0
    inputs[4] = f2s
    B = len(lengths)
    for w in (1, int(torch.randint(2, 2 * ps, (1,), generator=gen)), MAX_L, MAX_L + S, None):
        ptr, lists, last = _paged_spec(*inputs, E=E, K=K, S=S, ps=ps, rows=S, w=w)
        width = max(r[-1] for r in ptr) + 2
        got = []
        for fn in (branch_kv_indices, branch_kv_indices_ref):
            rpi, r2t, L, v2p, f2s_d = (x.to(device) if x is not None else None for x in inputs)
            idx = Guarded((S, width), torch.int64, device)
            kv_ptr = Guarded((S, B * K + 1), torch.int32, device)
            lpl = Guarded((S, B * K), torch.int32, device)
            status = new_status(device)
            fn(rpi, r2t, L, topk=K, num_steps=S, page_size=ps, kv_indices=idx.view,
               kv_indptr=kv_ptr.view, kv_last_page_len=lpl.view, status=status, v2p=v2p,
               entry_page_size=E, sliding_window_size=w, full_to_swa=f2s_d)  # fmt: skip
            for buf, name in ((idx, "kv_indices"), (kv_ptr, "kv_indptr"), (lpl, "last")):
                buf.assert_intact(f"{fn.__name__} w={w} {name}")
            for s in range(S):
                assert kv_ptr.view[s].tolist() == ptr[s], f"{fn.__name__} w={w}: kv_indptr[{s}]"
                assert lpl.view[s].tolist() == last[s], f"{fn.__name__} w={w}: last[{s}]"
                for z, want in enumerate(lists[s]):
                    have = idx.view[s, ptr[s][z] : ptr[s][z + 1]].tolist()
                    assert have == want, f"{fn.__name__} w={w}: step {s} list {z}"
            got.append(int(status))
        assert got[0] == got[1], f"w={w}: status {got}"


# ------------------------------------------------------------------------------ draft slots
@pytest.mark.parametrize("K,S,ps", [(1, 3, 1), (2, 2, 4)])
def test_draft_slots_in_window_pool_ids(K, S, ps, gen, device):
    inputs = _draw(gen, B=3, K=K, S=S, ps=ps, E=1, translate=True, holes=0.0)
    rpi, r2t, lengths, v2p, f2s = inputs
    want = [_window_id(r2t[int(rpi[b])], _chain(L, t, S, ps, K, j), v2p, f2s, E=1, ps=ps)
            for b, L in enumerate(lengths.tolist()) for t in range(K) for j in range(S)]  # fmt: skip
    for fn in (assign_draft_cache_locs, assign_draft_cache_locs_ref):
        status = new_status(device)
        out = fn(*(x.to(device) for x in inputs[:3]), topk=K, num_steps=S, page_size=ps,
                 v2p=v2p.to(device), full_to_swa=f2s.to(device), status=status)  # fmt: skip
        assert out.tolist() == want, fn.__name__
        assert int(status) == 0, fn.__name__
    # every draft slot is read: one evicted slot is a fault
    first_slot = emitted_id(r2t[int(rpi[1])], _chain(int(lengths[1]), 0, S, ps, K, 0), v2p,
                            E=1, ps=ps)  # fmt: skip
    f2s[f2s == f2s[first_slot]] = -1  # request 1's first draft slot (and any id sharing it)
    for fn in (assign_draft_cache_locs, assign_draft_cache_locs_ref):
        status = new_status(device)
        out = fn(*(x.to(device) for x in inputs[:3]), topk=K, num_steps=S, page_size=ps,
                 v2p=v2p.to(device), full_to_swa=f2s.to(device), status=status)  # fmt: skip
        assert int(out[K * S]) == 0 and int(status) == int(Status.BAD_KV_ID), fn.__name__


# ------------------------------------------------------------------------------ host checks
def _batch(device):
    r2t = torch.zeros(3, 32, dtype=torch.int32, device=device)
    return torch.tensor([1], device=device), r2t, torch.tensor([5], device=device)


def test_host_refusals_name_the_call_the_argument_and_the_fix(device):
    args = _batch(device)
    with pytest.raises(ValueError, match=r"draft_decode_kv_indices: window_size=4.*"
                                         r"sliding_window_size=8.*never both"):  # fmt: skip
        draft_decode_kv_indices(*args, topk=1, num_steps=2, window_size=4, sliding_window_size=8)
    with pytest.raises(ValueError, match=r"verify_kv_indices: sliding_window_size must be >= 0"):
        verify_kv_indices(*args, extra_tokens=2, sliding_window_size=-1)
    with pytest.raises(TypeError, match=r"assign_draft_cache_locs: full_to_swa.*design §2.10"):
        assign_draft_cache_locs(*args, topk=1, num_steps=2,
                                full_to_swa=torch.zeros(8, device=device))  # fmt: skip
    with pytest.raises(TypeError, match=r"draft_decode_kv_indices: sliding_window_size"):
        draft_decode_kv_indices(*args, topk=1, num_steps=2, sliding_window_size=2.5)


def test_capacity_checks_use_the_clipped_lengths(device):
    """A buffer of exactly the clipped need passes the host check; one entry less is refused."""
    args = _batch(device)  # one request, L = 5
    w, N = 3, 2
    need = min(5, w - 1) + N
    verify_kv_indices(*args, extra_tokens=N, sliding_window_size=w, seq_lens_sum=5,
                      kv_indices=torch.empty(need, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_indices is too small: need 4"):
        verify_kv_indices(*args, extra_tokens=N, sliding_window_size=w, seq_lens_sum=5,
                          kv_indices=torch.empty(need - 1, dtype=torch.int32, device=device))  # fmt: skip
    # draft decode, 2 branches of 2 steps: the last step lists min(5 + 2, 3) = 3 entries each
    draft_decode_kv_indices(*args, topk=2, num_steps=2, sliding_window_size=w, seq_lens_sum=5,
                            kv_indices=torch.empty(2, 6, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_indices is too small: need 6"):
        draft_decode_kv_indices(*args, topk=2, num_steps=2, sliding_window_size=w, seq_lens_sum=5,
                                kv_indices=torch.empty(2, 5, dtype=torch.int32, device=device))  # fmt: skip
    mask = torch.empty(N * need, dtype=torch.bool, device=device)
    tree = torch.ones(1, N, N, dtype=torch.bool, device=device).tril()
    tree_custom_mask(args[2], tree, custom_mask=mask, sliding_window_size=w, seq_lens_sum=5)
    with pytest.raises(ValueError, match=r"custom_mask is too small"):
        tree_custom_mask(args[2], tree, custom_mask=mask[:-1], sliding_window_size=w,
                         seq_lens_sum=5)  # fmt: skip
