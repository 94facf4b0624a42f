"""tree_ancestor_kv_indices against its reference and against design §3.5 (FlashInfer MLA's
tree-verify ancestor pass) read directly; the host mirrors from node depths; the device check
of that host copy (design §3's ``check_host_lengths``)."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.host_lengths import check_host_lengths, publish_host_lengths
from specmeta.kernels.host_list_lengths import (
    check_host_list_lengths,
    check_host_list_lengths_ref,
    host_list_slot,
    publish_host_list_lengths,
)
from specmeta.kernels.tree_ancestor_kv_indices import (
    bind_tree_ancestor_kv_indices,
    tree_ancestor_host_mirrors_torch,
    tree_ancestor_kv_indices,
    tree_ancestor_kv_indices_need,
    tree_ancestor_kv_indices_ref,
)
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, no_host_sync, row_width
from tests.guard_bands import POISON, Guarded, assert_equal

CONFIGS = [(2, 3, 6, 1), (4, 2, 8, 16), (8, 2, 13, 64)]  # K S N ps
SHAPES = ["one", "odd", "near_row_end", "mod0", "random"]


def _draw(shape, gen, device, k, s, n, ps, batch_size=None, dtype=torch.int64):
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, extra=n), generator=gen, device=device,
                       extra_tokens=n, index_dtype=dtype)  # fmt: skip
    return batch, random_tree_mask(batch.batch_size, k, s, n, gen).to(device)


def _run(args, mask, device, *, capacity=None, dtype=torch.int32, **kw):
    """Launcher and reference into guarded, poisoned buffers; both must agree exactly (and
    leave the canaries); returns the launcher's ``(kv_indices, kv_indptr, kv_len, status)``."""
    B, N = mask.shape[0], mask.shape[1]
    cap = tree_ancestor_kv_indices_need(B, N) if capacity is None else capacity
    got, want = [], []
    for fn, out in ((tree_ancestor_kv_indices, got), (tree_ancestor_kv_indices_ref, want)):
        bufs = [Guarded((cap,), dtype, device), Guarded((B * N + 1,), dtype, device),
                Guarded((B * N,), dtype, device)]  # fmt: skip
        status = new_status(device)
        fn(*args, mask, kv_indices=bufs[0].view, kv_indptr=bufs[1].view, kv_len=bufs[2].view,
           status=status, **kw)  # fmt: skip
        for g, name in zip(bufs, ("kv_indices", "kv_indptr", "kv_len"), strict=True):
            g.assert_intact(f"{fn.__name__} {name}")
        out.extend([g.view for g in bufs] + [status])
    for a, b, name in zip(got, want, ("kv_indices", "kv_indptr", "kv_len", "status"), strict=True):
        assert_equal(a, b, name)
    return got


def _spec_lists(r2t, rpi, L, mask, *, E=1, v2p=None, ps=1):
    """design §3.5 read directly: list ``b·N + i`` holds the ids at ``L_b + j`` of every set
    ``j``, in increasing ``j``."""
    lists = []
    for b in range(mask.shape[0]):
        row = r2t[int(rpi[b])]
        for i in range(mask.shape[1]):
            js = [j for j in range(mask.shape[2]) if mask[b, i, j]]
            lists.append([emitted_id(row, int(L[b]) + j, v2p, E=E, ps=ps) for j in js])
    return lists


def _check_spec(got, lists):
    idx, ptr, lens, _ = (t.cpu().long() for t in got)
    assert lens.tolist() == [len(x) for x in lists]
    offsets = [0]
    for x in lists:
        offsets.append(offsets[-1] + len(x))
    assert ptr.tolist() == offsets
    assert idx[: offsets[-1]].tolist() == [v for x in lists for v in x]
    assert (idx[offsets[-1] :] == POISON).all(), "nothing written past the lists"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,n,ps", CONFIGS)
def test_random_trees_match_reference_and_spec(device, gen, shape, k, s, n, ps):
    batch, mask = _draw(shape, gen, device, k, s, n, ps)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    got = _run(args, mask, device)
    assert int(got[3]) == 0
    lists = _spec_lists(batch.req_to_token.cpu(), batch.req_pool_indices.cpu(),
                        batch.seq_lens_cpu, mask.cpu())  # fmt: skip
    for x in lists:
        assert 1 <= len(x) <= s + 1, "a tree node lists the root ... itself, at most S + 1 deep"
    _check_spec(got, lists)


def test_spec_example(device):
    r2t = torch.zeros(2, 10, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(45, 55)
    m = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool, device=device)
    idx, ptr, lens = tree_ancestor_kv_indices(torch.tensor([1], device=device), r2t,
                                              torch.tensor([5], device=device), m)  # fmt: skip
    assert lens.tolist() == [1, 2, 2] and ptr.tolist() == [0, 1, 3, 5]
    assert idx[:5].tolist() == [50, 50, 51, 50, 52] and idx.shape[0] == 9


@pytest.mark.parametrize("what", ["all_ones", "empty_row", "past_depth", "random_bits"])
def test_adversarial_masks_are_listed_as_they_are(device, gen, what):
    """Masks no valid tree has, in a strided uint8 view: each row's set columns are listed,
    all inside the planned B·N·N entries, nothing reported."""
    batch, tree = _draw("random", gen, device, 4, 2, 7, 4, batch_size=5)
    big = torch.zeros(5, 7, 9, dtype=torch.uint8, device=device)
    mask = big[:, :, :7]
    mask.copy_(tree)
    if what == "all_ones":
        mask.fill_(1)
    elif what == "empty_row":
        mask[2, 0] = 0
        mask[4, 6] = 0
    elif what == "past_depth":  # a row sees later nodes: more ones than its depth allows
        mask[1, 1, 2:] = 1
    else:
        mask.copy_(torch.randint(0, 2, (5, 7, 7), generator=gen, dtype=torch.uint8))
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    got = _run(args, mask, device)
    assert int(got[3]) == 0
    assert_equal(got[2], mask.sum(-1).reshape(-1), "kv_len counts the set columns")
    _check_spec(got, _spec_lists(batch.req_to_token.cpu(), batch.req_pool_indices.cpu(),
                                 batch.seq_lens_cpu, mask.cpu()))  # fmt: skip
    if what == "all_ones":
        assert int(got[1][-1]) == tree_ancestor_kv_indices_need(5, 7), "the plan is exact here"


def test_empty_prefixes(device, gen):
    """``L = 0``: the lists read the window from the row's first position."""
    batch, mask = _draw("random", gen, device, 2, 3, 6, 1, batch_size=4)
    batch.seq_lens.zero_()
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    got = _run(args, mask, device)
    assert int(got[3]) == 0
    _check_spec(got, _spec_lists(batch.req_to_token.cpu(), batch.req_pool_indices.cpu(),
                                 torch.zeros(4), mask.cpu()))  # fmt: skip


def test_empty_batch(device, gen):
    batch, mask = _draw("empty", gen, device, 2, 3, 6, 4)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    idx, ptr, lens, status = _run(args, mask, device, capacity=1)
    assert ptr.tolist() == [0] and lens.numel() == 0 and int(status) == 0
    assert int(idx[0]) == POISON


def test_offsets_over_several_blocks(device, gen):
    """More lists than one load of the offset loop (1024): the sums cross blocks."""
    batch, mask = _draw("random", gen, device, 4, 3, 16, 1, batch_size=70)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    got = _run(args, mask, device, dtype=torch.int64)
    assert int(got[3]) == 0 and got[2].shape[0] == 70 * 16 > 1024
    assert_equal(got[1][1:], mask.sum(-1).reshape(-1).cumsum(0), "kv_indptr")


# --------------------------------------------------------------------------------------------
# Id spaces (design §2.10)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("E,translate", [(4, False), (1, True), (2, True)])
def test_id_spaces_list_the_emitted_ids(device, gen, E, translate):
    """Rows of page ids and virtual ids through a page map with holes: every listed id is the
    one the row names, translated (design §2.10); an unmapped one is the sink and
    ``BAD_KV_ID``."""
    B, N, ps, pages = 4, 6, 4, 16
    W_row = -(-(20 + N) // E)
    rows = torch.randint(0, pages * ps // E, (B + 1, W_row), generator=gen)
    rpi = torch.randperm(B + 1, generator=gen)[:B]
    L = torch.randint(0, 21, (B,), generator=gen)
    mask = random_tree_mask(B, 2, 3, N, gen)
    v2p = None
    if translate:
        v2p = torch.randperm(3 * pages, generator=gen)[:pages]
        v2p[torch.randperm(pages, generator=gen)[:3]] = -1  # unmapped pages
        hole = v2p < 0
    args = tuple(t.to(device) for t in (rpi, rows, L))
    kw = dict(entry_page_size=E, v2p=v2p.to(device) if v2p is not None else None, page_size=ps)
    got = _run(args, mask.to(device), device, **kw)
    _check_spec(got, _spec_lists(rows, rpi, L, mask, E=E, v2p=v2p, ps=ps))
    expect_bad = False
    if translate:  # BAD_KV_ID iff a listed (every window) id falls on an unmapped page
        for b in range(B):
            for j in range(N):
                p = int(L[b]) + j
                tid = (
                    int(rows[int(rpi[b]), p])
                    if E == 1
                    else int(rows[int(rpi[b]), p // E]) * E + p % E
                )
                expect_bad |= bool(hole[tid // ps])
    assert Status(int(got[3])) == (Status.BAD_KV_ID if expect_bad else Status.OK)


# --------------------------------------------------------------------------------------------
# One planted fault, one bit (design §2.5, §7)
# --------------------------------------------------------------------------------------------
def _clean(device):
    """Requests on rows 2, 5, 1 of an [8, 32] table whose row r holds r·32 + p (all > 0 off row
    0), prefixes [5, 9, 3], a 4-node tree (root, two children, a grandchild)."""
    r2t = torch.arange(8 * 32, dtype=torch.int32).view(8, 32)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rpi, L = torch.tensor([2, 5, 1]), torch.tensor([5, 9, 3])
    return (
        rpi.to(device),
        r2t.to(device),
        L.to(device),
        tree.expand(3, 4, 4).contiguous().to(device),
    )


FAULTS = {
    "clean": Status.OK,
    "row": Status.ROW_OOB,
    "negative_row": Status.ROW_OOB,
    "past_row": Status.POS_OOB,
    "negative_len": Status.POS_OOB,
    "capacity": Status.OUT_OF_CAPACITY,
    "unmapped": Status.BAD_KV_ID,
}


@pytest.mark.parametrize("fault", FAULTS)
def test_one_fault_one_bit(device, fault):
    rpi, r2t, L, mask = _clean(device)
    kw, cap = {}, None
    if fault == "row":
        rpi[1] = 8
    elif fault == "negative_row":
        rpi[0] = -1
    elif fault == "past_row":
        L[2] = 32 - 3  # the 4-node window's last slot at position 32
    elif fault == "negative_len":
        L[1] = -4
    elif fault == "capacity":
        cap = 3 * 8 - 1  # each request lists 1 + 2 + 2 + 3 = 8 entries
    elif fault == "unmapped":
        v2p = torch.arange(256)
        v2p[int(r2t[5, 9 + 2])] = -1  # node 2 of request 1: listed by node 2 alone
        kw = dict(v2p=v2p.to(device), page_size=1)
    got = _run((rpi, r2t, L), mask, device, capacity=cap, **kw)
    assert Status(int(got[3])) == FAULTS[fault]
    if fault == "capacity":
        assert int(got[1][-1]) == 24, "the offsets stay exact; only the stores are dropped"
    if fault == "unmapped":
        assert int(got[0][8 + 1 + 2 + 1]) == 0, "the unmapped id is listed as the sink"


def test_kv_len_sum_checks_capacity_before_launch(device):
    rpi, r2t, L, mask = _clean(device)
    small = torch.full((23,), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="kv_indices is too small: need 24 entries"):
        tree_ancestor_kv_indices(rpi, r2t, L, mask, kv_indices=small, kv_len_sum=24)
    assert (small == -1).all()


def test_bad_arguments_raise_before_launch(device, gen):
    rpi, r2t, L, mask = _clean(device)
    args = (rpi, r2t, L)

    def i32(n):
        return torch.zeros(n, dtype=torch.int32, device=device)

    with pytest.raises(ValueError, match="tree_ancestor_kv_indices: tree_mask must have shape"):
        tree_ancestor_kv_indices(*args, mask[:2])
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        tree_ancestor_kv_indices_ref(*args, mask[:, :3])
    with pytest.raises(TypeError, match="tree_mask must be bool or uint8"):
        tree_ancestor_kv_indices(*args, mask.float())
    with pytest.raises(ValueError, match=r"kv_len is too small: need 12 entries \(B\*N\)"):
        tree_ancestor_kv_indices(*args, mask, kv_len=i32(11))
    with pytest.raises(ValueError, match="kv_indptr is too small: need 13"):
        tree_ancestor_kv_indices(*args, mask, kv_indptr=i32(12))
    with pytest.raises(TypeError, match="kv_len_sum must be a host int"):
        tree_ancestor_kv_indices(*args, mask, kv_len_sum=torch.tensor(3))
    with pytest.raises(TypeError, match="tree_ancestor_kv_indices: entry_page_size"):
        tree_ancestor_kv_indices(*args, mask, entry_page_size=2.0)


def test_need_is_every_masks_worst_case():
    assert tree_ancestor_kv_indices_need(3, 4) == 48
    assert tree_ancestor_kv_indices_need(0, 8) == 0


# --------------------------------------------------------------------------------------------
# The host side: mirrors from node depths, and the device check of that copy
# --------------------------------------------------------------------------------------------
def _depths(mask):
    """Node depths of valid trees: ancestors besides itself."""
    return mask.sum(-1) - 1


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_mirrors_equal_a_cumsum_of_depths(gen, dtype):
    mask = random_tree_mask(5, 4, 3, 9, gen)
    depths = _depths(mask).to(dtype)
    qo, ptr, lens = (torch.full((n,), -9, dtype=torch.int32) for n in (47, 47, 46))
    got = tree_ancestor_host_mirrors_torch(depths, qo_indptr_host=qo, kv_indptr_host=ptr,
                                           kv_len_host=lens)  # fmt: skip
    want_len = depths.reshape(-1).long() + 1
    assert got.kv_len.tolist() == want_len.tolist() and got.kv_len.data_ptr() == lens.data_ptr()
    assert got.kv_indptr.tolist() == [0, *want_len.cumsum(0).tolist()]
    assert got.qo_indptr.tolist() == list(range(46))
    assert (got.lists, got.total, got.longest) == (45, int(want_len.sum()), int(want_len.max()))
    assert int(qo[-1]) == int(ptr[-1]) == int(lens[-1]) == -9, "only B*N (+1) entries written"


def test_host_mirrors_equal_the_device_lists(device, gen):
    """A valid tree's depth copy gives exactly the device's kv_len and kv_indptr."""
    batch, mask = _draw("random", gen, device, 4, 3, 9, 16, batch_size=6)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    _, ptr, lens = tree_ancestor_kv_indices(*args, mask)
    host = tree_ancestor_host_mirrors_torch(_depths(mask.cpu()))
    assert_equal(lens, host.kv_len, "kv_len")
    assert_equal(ptr, host.kv_indptr, "kv_indptr")


def test_host_mirrors_of_an_empty_batch():
    got = tree_ancestor_host_mirrors_torch(torch.zeros(0, 4, dtype=torch.int64))
    assert got.kv_indptr.tolist() == [0] and got.qo_indptr.tolist() == [0]
    assert (got.lists, got.total, got.longest) == (0, 0, 0)


@pytest.mark.parametrize(
    "depths,error,match",
    [
        (
            [[0, 1, 3]],
            ValueError,
            r"node_depths_cpu\[0, 2\] = 3 is outside \[0, N - 1\] = \[0, 2\]",
        ),
        ([[0, -1, 1]], ValueError, r"node_depths_cpu\[0, 1\] = -1 is outside"),
        ("float", TypeError, "node_depths_cpu must be an int32 or int64 tensor, got torch.float32"),
        ("flat", ValueError, r"node_depths_cpu must be a \[B, N\] CPU tensor"),
    ],
)
def test_host_mirrors_refuse_bad_depths_before_writing(depths, error, match):
    lens = torch.full((3,), -9, dtype=torch.int32)
    if depths == "float":
        depths = torch.zeros(1, 3)
    elif depths == "flat":
        depths = torch.zeros(3, dtype=torch.int64)
    else:
        depths = torch.tensor(depths)
    with pytest.raises(error, match="tree_ancestor_host_mirrors_torch: " + match):
        tree_ancestor_host_mirrors_torch(depths, kv_len_host=lens)
    assert (lens == -9).all()


def test_host_mirrors_refuse_bad_views():
    depths = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="kv_len_host must be an int32 CPU tensor, got torch.int64"):
        tree_ancestor_host_mirrors_torch(depths, kv_len_host=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_indptr_host must be a 1-D CPU view of at least 7"):
        tree_ancestor_host_mirrors_torch(depths, kv_indptr_host=torch.zeros(6, dtype=torch.int32))


def _published_check(device, kv_len, host):
    """One round of design §3's check: the host publishes (B·N, Σ, max) of its copy, the device
    compares them with its kv_len; returns the status."""
    slot = torch.zeros(8, dtype=torch.int64)
    slot = slot.pin_memory() if device.type == "cuda" else slot
    assert publish_host_lengths(slot, host.lists, host.total, host.longest)
    status = new_status(device)
    check_host_lengths(kv_len, slot, torch.zeros(1, dtype=torch.int64, device=device),
                       status=status)  # fmt: skip
    return Status(int(status))


def test_stale_depth_copy_sets_stale_host_lengths(device, gen):
    """A depth copy that disagrees with the mask by one node (still a valid depth) is reported;
    the copy of this batch's tree is not."""
    batch, mask = _draw("random", gen, device, 4, 3, 9, 16, batch_size=5)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    _, _, kv_len = tree_ancestor_kv_indices(*args, mask)
    depths = _depths(mask.cpu())
    assert _published_check(device, kv_len, tree_ancestor_host_mirrors_torch(depths)) == Status.OK
    b, i = (
        int(torch.randint(0, 5, (1,), generator=gen)),
        int(torch.randint(1, 9, (1,), generator=gen)),
    )
    stale = depths.clone()
    stale[b, i] = 1 if int(depths[b, i]) != 1 else 2  # one node one level off
    got = _published_check(device, kv_len, tree_ancestor_host_mirrors_torch(stale))
    assert got == Status.STALE_HOST_LENGTHS


def test_sum_and_max_miss_two_swapped_nodes(device):
    """The limit of the (n, Σ, max) check: two nodes of different depths swapped in the copy
    keep the sum and the maximum, so the check passes while both lists' host lengths (and the
    offsets between them) are wrong. A stronger check compares every length."""
    rpi, r2t, L, mask = _clean(device)
    _, _, kv_len = tree_ancestor_kv_indices(rpi, r2t, L, mask)
    depths = _depths(mask.cpu())
    swapped = depths.clone()
    swapped[0, 1], swapped[0, 3] = depths[0, 3], depths[0, 1]  # depths 1 and 2
    host = tree_ancestor_host_mirrors_torch(swapped)
    assert host.kv_len.tolist() != kv_len.cpu().tolist()
    assert _published_check(device, kv_len, host) == Status.OK


# The exact check: every length compared (host_list_lengths).
@pytest.mark.parametrize("fn", [check_host_list_lengths, check_host_list_lengths_ref])
@pytest.mark.parametrize("copy", ["this_batch", "one_node", "swapped"])
def test_exact_check_catches_what_sum_and_max_miss(device, fn, copy):
    """Every length compared: the copy of this batch's tree passes, a one-node-stale copy and
    two swapped nodes (the case the sum and maximum miss) set ``STALE_HOST_LENGTHS`` alone;
    the slot is consumed either way."""
    rpi, r2t, L, mask = _clean(device)
    _, _, kv_len = tree_ancestor_kv_indices(rpi, r2t, L, mask)
    depths = _depths(mask.cpu())
    if copy == "one_node":
        depths[2, 2] = 2  # depth 1 in the mask
    elif copy == "swapped":
        depths[0, 1], depths[0, 3] = 2, 1
    host = tree_ancestor_host_mirrors_torch(depths)
    slot, seen = host_list_slot(16, device), torch.zeros(1, dtype=torch.int64, device=device)
    assert publish_host_list_lengths(slot, host.kv_len)
    status = new_status(device)
    fn(kv_len, slot, seen, status=status)
    want = Status.OK if copy == "this_batch" else Status.STALE_HOST_LENGTHS
    assert Status(int(status)) == want
    assert int(slot[4]) == int(seen[0]) == 1, "consumed"


def test_exact_check_over_several_programs_and_launches(device, gen):
    """More lengths than one load (4096): a difference in the last block is found; each launch
    checks only what was published since the last."""
    n = 9000
    lens = torch.randint(1, 9, (n,), generator=gen, dtype=torch.int32)
    slot, seen = host_list_slot(n + 5, device), torch.zeros(1, dtype=torch.int64, device=device)
    stage_args = (lens.to(device), slot, seen)
    stale = lens.clone()
    stale[n - 3] += 1
    for host, want in ((lens, Status.OK), (stale, Status.STALE_HOST_LENGTHS), (None, Status.OK),
                       (lens, Status.OK)):  # fmt: skip
        if host is not None:
            assert publish_host_list_lengths(slot, host)
        status = new_status(device)
        check_host_list_lengths(*stage_args, status=status)
        assert Status(int(status)) == want and int(seen[0]) == int(slot[0])


def test_exact_check_handshake_and_refusals(device):
    """A host part that runs ahead of the device publishes nothing; a slot too small is
    refused before anything is written; a wrong ``seen``, and on CUDA a pageable slot, are
    refused before launch."""
    slot = host_list_slot(4, device)
    assert publish_host_list_lengths(slot, torch.tensor([1, 2]))
    assert not publish_host_list_lengths(slot, torch.tensor([3, 3, 3]))
    assert slot[:11].tolist() == [1, 2, 3, 2, 0, 0, 0, 0, 1, 2, 0]
    with pytest.raises(
        ValueError, match="publish_host_list_lengths: 5 lengths, but the slot holds 4"
    ):
        publish_host_list_lengths(slot, torch.ones(5, dtype=torch.int64))
    lens = torch.ones(2, device=device, dtype=torch.int32)
    with pytest.raises(TypeError, match="seen must be int64"):
        check_host_list_lengths(lens, slot, torch.zeros(1, dtype=torch.int32, device=device))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="slot must be pinned host memory"):
            check_host_list_lengths(lens, torch.zeros(12, dtype=torch.int64),
                                    torch.zeros(1, dtype=torch.int64, device=device))  # fmt: skip


# --------------------------------------------------------------------------------------------
# GPU tier: production shape, graph replay with inputs changed in place
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_production_shape_matches_reference(gen):
    """B = 64, K = 8, S = 5, N = 64 nodes; then the same trees over rows of 64-token page ids
    (4096 positions, prefixes up to 4000) read through a page map of 16-token pages."""
    B, K, S, N, E = 64, 8, 5, 64, 64
    batch, mask = _draw("long_short", gen, "cuda", K, S, N, 1, batch_size=B)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    got = _run(args, mask, torch.device("cuda"))
    assert int(got[3]) == 0
    R = batch.req_to_token.shape[0]
    pages = torch.randint(0, 1 << 14, (R, 4096 // E), generator=gen).cuda()
    v2p = torch.randperm(1 << 17, generator=gen)[: 1 << 16].cuda()  # 16-token pages of 64-token ids
    lens = torch.randint(0, 4001, (B,), generator=gen).cuda()
    got = _run((batch.req_pool_indices, pages, lens), mask,
               torch.device("cuda"), entry_page_size=E, v2p=v2p, page_size=16)  # fmt: skip
    assert int(got[3]) == 0


@pytest.mark.gpu
def test_gpu_graph_replay_follows_inputs_without_sync(gen):
    B, K, S, N = 32, 4, 4, 16
    batch, mask = _draw("random", gen, "cuda", K, S, N, 16, batch_size=B)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    status = new_status("cuda")
    stage = bind_tree_ancestor_kv_indices(*args, mask, status=status)
    stage.launch()  # loads the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage.launch()
    for _ in range(3):
        nxt, nmask = _draw("random", gen, "cuda", K, S, N, 16, batch_size=B)
        with no_host_sync():
            batch.seq_lens.copy_(nxt.seq_lens)
            mask.copy_(nmask)
            stage.result[0].fill_(-1)
            graph.replay()
        want = tree_ancestor_kv_indices_ref(
            *args, mask, kv_indices=torch.full_like(stage.result[0], -1)
        )
        for a, b, name in zip(
            stage.result, want, ("kv_indices", "kv_indptr", "kv_len"), strict=True
        ):
            assert_equal(a, b, name)
    assert int(status) == 0
