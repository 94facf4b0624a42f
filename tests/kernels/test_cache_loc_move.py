"""accept_cache_locs and move_kv_cache against their references and design §2.4 read directly."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import SpecConfig, plan_buffers
from specmeta.kernels import cache_loc_move
from specmeta.kernels.cache_loc_move import (
    DISJOINT_BLOCK_N,
    MAX_OVERLAPPING_PAIRS,
    KVPool,
    accept_cache_locs,
    accept_cache_locs_ref,
    bind_move_kv_cache,
    move_kv_cache,
    move_kv_cache_ref,
)
from specmeta.runners import collector_off
from specmeta.workloads import random_accept, random_tree_mask
from tests.guard_bands import Guarded, GuardedPool, assert_equal

# (K, S, N): chains, wide trees, deep trees, a window narrower than S + 1.
TREES = [(1, 3, 4), (4, 3, 8), (2, 5, 12), (8, 2, 16), (3, 6, 5)]


# --------------------------------------------------------------------------------------------
# accept_cache_locs
# --------------------------------------------------------------------------------------------
def _accept_inputs(B, K, S, N, gen, device, *, idx_dtype=torch.int32, len_dtype=torch.int32,
                   slot_dtype=torch.int64):  # fmt: skip
    mask = random_tree_mask(B, K, S, N, gen)
    accept_index, accept_lens = random_accept(mask, S, gen)
    out_cache_loc = torch.randperm(4 * B * N + 8, generator=gen)[: B * N] + 1
    return (accept_index.to(idx_dtype).to(device), accept_lens.to(len_dtype).to(device),
            out_cache_loc.to(slot_dtype).to(device))  # fmt: skip


def _accept_spec(accept_index, accept_lens, out_cache_loc, N):
    """design §2.4 read directly, with loops: valid rows only."""
    idx, lens, slots = accept_index.cpu().tolist(), accept_lens.cpu().tolist(), out_cache_loc.cpu()
    tgt, src = [], []
    for i, (row, acc) in enumerate(zip(idx, lens, strict=True)):
        for k in range(acc):
            tgt.append(int(slots[i * N + k]))
            src.append(int(slots[row[k]]))
    pad = len(idx) * (len(idx[0]) if idx else 0) - len(tgt)
    return torch.tensor(tgt + [0] * pad), torch.tensor(src + [0] * pad)


def _run_accept(accept_index, accept_lens, out_cache_loc, N, device, out_dtype=torch.int64):
    n = accept_index.numel()
    tgt, src = Guarded((n,), out_dtype, device), Guarded((n,), out_dtype, device)
    status = new_status(device)
    got_t, got_s = accept_cache_locs(accept_index, accept_lens, out_cache_loc, num_draft_tokens=N,
                                     tgt=tgt.view, src=src.view, status=status)  # fmt: skip
    ref_status = new_status(device)
    want_t, want_s = accept_cache_locs_ref(accept_index, accept_lens, out_cache_loc,
                                           num_draft_tokens=N, status=ref_status)  # fmt: skip
    tgt.assert_intact("tgt")
    src.assert_intact("src")
    assert got_t.data_ptr() == tgt.view.data_ptr() and got_t.shape == (n,)
    assert_equal(got_t, want_t, "tgt")
    assert_equal(got_s, want_s, "src")
    assert_equal(status, ref_status, "status")
    return got_t, got_s, int(status)


@pytest.mark.parametrize("B", [1, 7, 13])
@pytest.mark.parametrize("k,s,n", TREES)
def test_accept_matches_reference_and_spec(device, gen, B, k, s, n):
    inputs = _accept_inputs(B, k, s, n, gen, device)
    tgt, src, status = _run_accept(*inputs, n, device)
    assert status == 0
    spec_t, spec_s = _accept_spec(*inputs, n)
    assert_equal(tgt, spec_t, "tgt vs design")
    assert_equal(src, spec_s, "src vs design")


@pytest.mark.parametrize(
    "idx_dtype,len_dtype,slot_dtype,out_dtype",
    [(torch.int64, torch.int64, torch.int32, torch.int32), (torch.int32, torch.int64, torch.int64, torch.int32)],
)  # fmt: skip
def test_accept_index_dtypes(device, gen, idx_dtype, len_dtype, slot_dtype, out_dtype):
    inputs = _accept_inputs(9, 4, 3, 8, gen, device, idx_dtype=idx_dtype, len_dtype=len_dtype,
                            slot_dtype=slot_dtype)  # fmt: skip
    tgt, src, status = _run_accept(*inputs, 8, device, out_dtype=out_dtype)
    assert status == 0
    spec_t, spec_s = _accept_spec(*inputs, 8)
    assert_equal(tgt, spec_t, "tgt vs design")
    assert_equal(src, spec_s, "src vs design")


def test_accept_spec_example(device):
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32, device=device)
    accept_lens = torch.tensor([2, 1], device=device)
    out_cache_loc = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23], device=device)
    tgt, src = accept_cache_locs(accept_index, accept_lens, out_cache_loc, num_draft_tokens=4)
    assert tgt.tolist() == [10, 11, 20, 0, 0, 0]
    assert src.tolist() == [10, 12, 20, 0, 0, 0]


def test_accept_lengths_zero_partial_full_and_many_blocks(device, gen):
    """More requests than one scan block (128), acceptances of every length, the tail (0, 0)
    over poisoned memory (seed 003: never uninitialised)."""
    B, S, N = 300, 3, 4  # K = 1: a chain, so a full acceptance is all S + 1 nodes
    lens = torch.randint(0, S + 2, (B,), generator=gen)
    lens[:3] = torch.tensor([0, S + 1, 2])
    accept_index = torch.full((B, S + 1), -1, dtype=torch.int32)
    for i in range(B):
        accept_index[i, : lens[i]] = torch.arange(int(lens[i])) + i * N
    slots = torch.randperm(2 * B * N, generator=gen)[: B * N] + 1
    args = (accept_index.to(device), lens.to(device), slots.to(device))
    tgt, src, status = _run_accept(*args, N, device)
    assert status == 0
    total = int(lens.sum())
    assert tgt[total:].abs().sum() == 0 and src[total:].abs().sum() == 0
    assert bool((tgt[:total] > 0).all()), "every accepted pair names a real slot"
    assert_equal(src[:total], tgt[:total], "a chain moves nothing")


def test_accept_invalid_entries_are_skipped_and_reported(device, gen):
    N = 5
    slots = (torch.arange(4 * N) + 100).to(device)
    cases = [
        # (row, acc): a foreign entry (request 0's node in request 1's row)
        ([1 * N + 0, 0 * N + 2, -1, -1], 2),
        # a -1 inside the run
        ([2 * N + 0, -1, 2 * N + 3, -1], 3),
        # an entry after the run: the -1 run is not a suffix
        ([3 * N + 0, -1, 3 * N + 1, -1], 1),
    ]
    good = [0 * N + 0, 0 * N + 3, 0 * N + 4, -1]
    rows = [good] + [r for r, _ in cases]
    lens = [3] + [a for _, a in cases]
    accept_index = torch.tensor(rows, dtype=torch.int32, device=device)
    accept_lens = torch.tensor(lens, device=device)
    tgt, src, status = _run_accept(accept_index, accept_lens, slots, N, device)
    assert status == int(Status.BAD_ACCEPT)
    # request 0 is intact; skipped pairs keep their place as (0, 0)
    want_t = [100, 101, 102, 105, 0, 110, 0, 112, 115] + [0] * 7
    want_s = [100, 103, 104, 105, 0, 110, 0, 113, 115] + [0] * 7
    assert tgt.tolist() == want_t
    assert src.tolist() == want_s


def test_accept_entry_past_its_window_is_skipped_and_reported(device):
    """A node of the next request's window in a row (index >= its own window's end) is not
    the request's: the pair is skipped as (0, 0) and reported, by the kernel and the
    reference alike."""
    N = 4
    slots = (torch.arange(2 * N) + 100).to(device)
    accept_index = torch.tensor([[0 * N + 0, 1 * N + 1, -1], [1 * N + 0, -1, -1]],
                                dtype=torch.int32, device=device)  # fmt: skip
    accept_lens = torch.tensor([2, 1], device=device)
    tgt, src, status = _run_accept(accept_index, accept_lens, slots, N, device)
    assert status == int(Status.BAD_ACCEPT)
    assert tgt.tolist() == [100, 0, 104, 0, 0, 0]
    assert src.tolist() == [100, 0, 104, 0, 0, 0]


@pytest.mark.parametrize("bad_len", [-1, 5, 1 << 20])
def test_accept_lengths_out_of_range_are_clamped_and_reported(device, bad_len):
    N = 4
    accept_index = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]], dtype=torch.int32, device=device)
    accept_lens = torch.tensor([bad_len, 2], device=device)
    slots = (torch.arange(2 * N) + 50).to(device)
    tgt, src, status = _run_accept(accept_index, accept_lens, slots, N, device)
    assert status == int(Status.BAD_ACCEPT)
    if bad_len < 0:  # an empty run; its entries then break the -1 suffix
        assert tgt.tolist()[:2] == [54, 55]
    else:  # clamped to S + 1
        assert tgt.tolist()[:6] == [50, 51, 52, 53, 54, 55]


def test_accept_window_narrower_than_path(device):
    """acc > N: node k ≥ N would take a slot of the next window; those pairs are skipped."""
    N = 2
    accept_index = torch.tensor([[0, 1, 1, -1], [2, 3, -1, -1]], dtype=torch.int32, device=device)
    accept_lens = torch.tensor([3, 2], device=device)
    slots = torch.tensor([7, 8, 9, 10], device=device)
    tgt, src, status = _run_accept(accept_index, accept_lens, slots, N, device)
    assert status == int(Status.BAD_ACCEPT)
    assert tgt.tolist()[:5] == [7, 8, 0, 9, 10]


def test_accept_empty_batch(device):
    accept_index = torch.empty((0, 4), dtype=torch.int32, device=device)
    lens = torch.empty(0, dtype=torch.int32, device=device)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    tgt = Guarded((8,), torch.int64, device)
    status = new_status(device)
    t, s = accept_cache_locs(accept_index, lens, slots, num_draft_tokens=5, tgt=tgt.view,
                             status=status)  # fmt: skip
    assert t.numel() == 0 and s.numel() == 0 and int(status) == 0
    tgt.assert_intact("tgt")
    assert bool((tgt.view != 0).all()), "B = 0 writes nothing"
    rt, rs = accept_cache_locs_ref(accept_index, lens, slots, num_draft_tokens=5)
    assert rt.numel() == 0 and rs.numel() == 0


def test_accept_bad_input_raises_before_launch(device):
    ai = torch.tensor([[0, -1]], dtype=torch.int32, device=device)
    al = torch.tensor([1], device=device)
    sl = torch.arange(4, device=device)
    with pytest.raises(TypeError, match="accept_index"):
        accept_cache_locs(ai.float(), al, sl, num_draft_tokens=4)
    with pytest.raises(ValueError, match="accept_index must have rank 2"):
        accept_cache_locs(ai[0], al, sl, num_draft_tokens=4)
    with pytest.raises(ValueError, match="accept_lens must have 1"):
        accept_cache_locs(ai, torch.tensor([1, 1], device=device), sl, num_draft_tokens=4)
    with pytest.raises(ValueError, match="out_cache_loc is too small: need 8"):
        accept_cache_locs(ai, al, sl, num_draft_tokens=8)
    with pytest.raises(ValueError, match="tgt is too small: need 2"):
        accept_cache_locs(ai, al, sl, num_draft_tokens=4,
                          tgt=torch.zeros(1, dtype=torch.int64, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="num_draft_tokens"):
        accept_cache_locs(ai, al, sl, num_draft_tokens=0)
    with pytest.raises(TypeError, match="status"):
        accept_cache_locs(ai, al, sl, num_draft_tokens=4, status=torch.zeros(1, device=device))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    tree=st.sampled_from(TREES),
    seed=st.integers(0, 2**31 - 1),
    foreign=st.integers(0, 3),
)
def test_accept_property(device, b, tree, seed, foreign):
    k, s, n = tree
    g = torch.Generator().manual_seed(seed)
    accept_index, accept_lens, slots = _accept_inputs(b, k, s, n, g, device)
    for _ in range(foreign if b else 0):  # corrupt random entries: foreign ids, stray -1s
        i, c = (
            int(torch.randint(0, b, (1,), generator=g)),
            int(torch.randint(0, s + 1, (1,), generator=g)),
        )
        accept_index[i, c] = int(torch.randint(-1, b * n, (1,), generator=g))
    _, _, status = _run_accept(accept_index, accept_lens, slots, n, device)
    assert status in (0, int(Status.BAD_ACCEPT))


def test_plan_holds_the_pair_buffers():
    cfg = SpecConfig(topk=4, num_steps=5, num_draft_tokens=16, max_bs=48)
    plan = plan_buffers(cfg)
    for name in ("verify.tgt_cache_loc", "verify.src_cache_loc"):
        assert plan[name].shape == (48 * 6,) and plan[name].dtype == torch.int64


# --------------------------------------------------------------------------------------------
# move_kv_cache
# Row widths the issue names: 576·2 B (MLA bf16), 1152 B (fp8 as uint8), 2048 B, 4 B.
POOLS = {
    "mixed_8b_words": [((576,), torch.bfloat16, 0), ((1152,), torch.uint8, 0),
                       ((8, 128), torch.float16, 0), ((512,), torch.float32, 0)],
    "4_byte_rows": [((), torch.float32, 0), ((2,), torch.bfloat16, 0)],
    "odd_widths_padded": [((7,), torch.uint8, 0), ((3,), torch.float16, 5),
                          ((576,), torch.bfloat16, 3)],
}  # fmt: skip
if hasattr(torch, "float8_e4m3fn"):
    POOLS["mixed_8b_words"].append(((1152,), torch.float8_e4m3fn, 0))


# --------------------------------------------------------------------------------------------
def _make_pools(kind, P, device, gen):
    return [GuardedPool(P - 8 * i, shape, dtype, device, gen, pad=pad)
            for i, (shape, dtype, pad) in enumerate(POOLS[kind])]  # fmt: skip


def _overlapping_pairs(P, n, gen, *, oob=False, dtype=torch.int64):
    """Pairs with distinct targets: a chain, a swap, a 3-cycle, self-moves, sink pairs, then
    fresh targets whose sources may be other pairs' targets; shuffled."""
    perm = (torch.randperm(P - 1, generator=gen) + 1).tolist()
    chain = perm[0:5]
    x, y = perm[5:7]
    a, b, c = perm[7:10]
    z = perm[10]
    tgt = chain[:-1] + [x, y, a, b, c, z, 0, 0]
    src = chain[1:] + [y, x, b, c, a, z, 0, 0]
    fresh = perm[11 : 11 + max(0, n - len(tgt))]
    tgt += fresh
    src += torch.randint(0, P, (len(fresh),), generator=gen).tolist()
    if oob:
        big = (1 << 40) if dtype == torch.int64 else (1 << 30)
        tgt += [P, perm[-1], -5, big, perm[-2], 3]
        src += [1, -1, -5, 2, P + 7, big]
    order = torch.randperm(len(tgt), generator=gen)
    t = torch.tensor(tgt, dtype=dtype)[order]
    s = torch.tensor(src, dtype=dtype)[order]
    return t, s


def _spec_move(rows_before, tgt, src):
    """design §2.4 read directly: every in-range pair copies the *old* source row."""
    P = rows_before.shape[0]
    new = rows_before.clone()
    for t, s in zip(tgt.tolist(), src.tolist(), strict=True):
        if 0 <= t < P and 0 <= s < P:
            new[t] = rows_before[s]
    return new


def _run_move(pools, tgt, src, device, *, addressing, disjoint=False, ordered=False):
    before = [p.rows().cpu().clone() for p in pools]
    ref = [p.view.clone() for p in pools]
    status, ref_status = new_status(device), new_status(device)
    pool = KVPool([p.view for p in pools], addressing=addressing)
    flags = dict(disjoint=disjoint, ordered=ordered)
    move_kv_cache(pool, tgt.to(device), src.to(device), status=status, **flags)
    move_kv_cache_ref(ref, tgt.to(device), src.to(device), status=ref_status, **flags)
    for i, p in enumerate(pools):
        p.assert_intact(f"buffers[{i}]")
        got = p.rows()
        ref_rows = ref[i].as_strided((ref[i].shape[0], ref[i][0].numel()), (ref[i].stride(0), 1))
        assert_equal(got, ref_rows.view(torch.uint8), f"buffers[{i}] vs reference")
        assert_equal(got, _spec_move(before[i], tgt, src), f"buffers[{i}] vs design")
    assert_equal(status, ref_status, "status")
    return int(status)


def test_bound_move_makes_one_launch_per_buffer_on_every_call(device, gen):
    """bind_move_kv_cache with direct addressing binds one launch per buffer, all in one stage;
    called twice, with new pairs in the same pair tensors before each call, it moves what the
    reference and the design move, both times."""
    P, n = 64, 24
    pools = _make_pools("odd_widths_padded", P, device, gen)  # P, P - 8 and P - 16 rows
    tgt = torch.zeros(n, dtype=torch.int64, device=device)
    src = torch.zeros_like(tgt)
    status = new_status(device)
    pool = KVPool([p.view for p in pools], addressing="direct")
    stage = bind_move_kv_cache(pool, tgt, src, status=status)
    assert len(stage.launches) == len(pools)
    for call in range(2):
        t, s = _overlapping_pairs(P - 16, n, gen)
        tgt.copy_(t)
        src.copy_(s)
        before = [p.rows().cpu().clone() for p in pools]
        ref, ref_status = [p.view.clone() for p in pools], new_status(device)
        move_kv_cache_ref(ref, tgt, src, status=ref_status)
        assert stage() is None
        for i, p in enumerate(pools):
            p.assert_intact(f"buffers[{i}], call {call}")
            ref_rows = ref[i].as_strided((ref[i].shape[0], ref[i][0].numel()),
                                         (ref[i].stride(0), 1))  # fmt: skip
            assert_equal(p.rows(), ref_rows.view(torch.uint8), f"buffers[{i}], call {call}")
            assert_equal(p.rows(), _spec_move(before[i], t, s), f"buffers[{i}] vs design")
        assert int(status) == int(ref_status) == 0


@pytest.mark.parametrize("addressing", ["direct", "table"])
@pytest.mark.parametrize("kind", list(POOLS))
def test_move_overlapping_pairs(device, gen, kind, addressing):
    P = 64
    pools = _make_pools(kind, P, device, gen)
    tgt, src = _overlapping_pairs(P - 8 * (len(pools) - 1), 40, gen)
    assert _run_move(pools, tgt, src, device, addressing=addressing) == 0


@pytest.mark.parametrize("addressing", ["direct", "table"])
def test_move_many_pairs_narrow_slices(device, gen, addressing):
    """n = 200 pairs: the tile narrows to 256 B slices, so a 2 KiB row takes 8 programs."""
    pools = [GuardedPool(256, (1024,), torch.float16, device, gen),
             GuardedPool(256, (512,), torch.float32, device, gen)]  # fmt: skip
    tgt, src = _overlapping_pairs(256, 200, gen, dtype=torch.int32)
    assert _run_move(pools, tgt, src, device, addressing=addressing) == 0


def test_move_chain_rotation_and_swap_directly(device):
    """In-place safety stated without the reference: a chain shifts left, a cycle rotates."""
    rows = torch.arange(10, dtype=torch.float32, device=device).repeat_interleave(3).view(10, 3)
    tgt = torch.tensor([1, 2, 3, 4, 6, 7, 8, 9, 5, 0], device=device)
    src = torch.tensor([2, 3, 4, 5, 7, 8, 6, 9, 5, 0], device=device)
    move_kv_cache([rows], tgt, src)
    assert rows[:, 0].tolist() == [0, 2, 3, 4, 5, 5, 7, 8, 6, 9]
    swap = torch.arange(8, dtype=torch.int32, device=device).view(4, 2)
    move_kv_cache([swap], torch.tensor([1, 2], device=device), torch.tensor([2, 1], device=device))
    assert swap.tolist() == [[0, 1], [4, 5], [2, 3], [6, 7]]


@pytest.mark.parametrize("addressing", ["direct", "table"])
def test_move_out_of_range_is_skipped_and_reported(device, gen, addressing):
    """Locations outside [0, P) are skipped per buffer (pools of different sizes) and reported;
    guard rows around every pool stay intact."""
    pools = _make_pools("mixed_8b_words", 64, device, gen)  # P = 64, 56, 48, 40(, 32)
    for dtype in (torch.int64, torch.int32):
        tgt, src = _overlapping_pairs(64, 30, gen, oob=True, dtype=dtype)
        assert _run_move(pools, tgt, src, device, addressing=addressing) == int(Status.POOL_OOB)


@pytest.mark.parametrize("addressing", ["direct", "table"])
def test_move_disjoint_blocks(device, gen, addressing):
    """disjoint=True splits the pairs into blocks; with no target that is another pair's source
    the result is the same."""
    P = 160
    pools = [GuardedPool(P, (576,), torch.bfloat16, device, gen),
             GuardedPool(P, (3,), torch.float16, device, gen, pad=1)]  # fmt: skip
    perm = torch.randperm(P - 1, generator=gen) + 1
    n = 2 * DISJOINT_BLOCK_N + 5
    tgt, src = perm[:n].clone(), perm[n : 2 * n].clone()
    tgt[::7] = 0  # sink pairs and self-moves mixed in
    src[::7] = 0
    src[3::11] = tgt[3::11]
    assert _run_move(pools, tgt, src, device, addressing=addressing, disjoint=True) == 0


def _ordered_pairs(P, n, gen, *, dtype=torch.int64):
    """Pairs safe in list order whose dependencies cross blocks: a chain shifted by n // 4 (pair
    ``i`` writes the slot pair ``i - n//4`` read), with self-moves and sink pairs mixed in.
    Moving the blocks in any other order, or in parallel, reads overwritten rows."""
    slots = torch.randperm(P - 1, generator=gen)[: 2 * n] + 1
    tgt, src = slots[:n].clone(), slots[n // 4 : n // 4 + n].clone()
    tgt[5::9] = 0
    src[5::9] = 0
    src[7::13] = tgt[7::13]
    return tgt.to(dtype), src.to(dtype)


@pytest.mark.parametrize("addressing", ["direct", "table"])
@pytest.mark.parametrize("programs", ["default", "many"])
def test_move_ordered_blocks_in_list_order(device, gen, addressing, programs, monkeypatch):
    """ordered=True walks blocks of pairs in list order: a chain whose reads and writes sit in
    different blocks moves as the reference says. "many" asks for more programs than the rows
    have 128-byte lines, so slices narrow to one line and blocks grow."""
    if programs == "many":
        monkeypatch.setattr(cache_loc_move, "_move_programs", lambda device, wide: 10_000)
    P = 200
    pools = [GuardedPool(P, (576,), torch.bfloat16, device, gen),
             GuardedPool(P - 8, (3,), torch.float16, device, gen, pad=1),
             GuardedPool(P, (40,), torch.uint8, device, gen)]  # fmt: skip
    pool = KVPool([p.view for p in pools], addressing=addressing)
    n = 90
    shape = cache_loc_move._launch_shape(n, pool, False, True)
    assert shape["pair_programs"] == 1 and shape["blocks_per_program"] >= 2, shape
    tgt, src = _ordered_pairs(P - 8, n, gen)
    assert _run_move(pools, tgt, src, device, addressing=addressing, ordered=True) == 0


def test_move_ordered_out_of_range_is_skipped_and_reported(device, gen):
    pools = _make_pools("mixed_8b_words", 64, device, gen)
    tgt, src = _ordered_pairs(40, 30, gen, dtype=torch.int32)
    # Targets the pairs above do not write (a shared target lands either way): 45 <- 60 is in
    # range of the first pool only.
    tgt = torch.cat([tgt, torch.tensor([64, 45, -2, 1 << 30], dtype=torch.int32)])
    src = torch.cat([src, torch.tensor([2, 60, 5, 4], dtype=torch.int32)])
    got = _run_move(pools, tgt, src, device, addressing="table", ordered=True)
    assert got == int(Status.POOL_OOB)


def test_move_ordered_lifts_the_pair_bound(device, gen):
    """More pairs than one program can order in registers: fine when they are ordered."""
    n = MAX_OVERLAPPING_PAIRS + 3
    pool = GuardedPool(2 * n + 8, (), torch.float32, device, gen)
    tgt, src = _ordered_pairs(2 * n + 8, n, gen)
    assert _run_move([pool], tgt, src, device, addressing="direct", ordered=True) == 0


def test_move_nothing(device, gen):
    pool = GuardedPool(16, (4,), torch.float16, device, gen)
    status = new_status(device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    move_kv_cache([pool.view], empty, empty, status=status)
    zeros = torch.zeros(16, dtype=torch.int64, device=device)  # the tail of an unused pair list
    move_kv_cache([pool.view], zeros, zeros, status=status)
    pool.assert_intact("buffer")
    assert_equal(pool.bytes, pool.before, "sink self-moves change nothing")
    assert int(status) == 0


@pytest.mark.parametrize("ordered", [False, True])
def test_move_after_accept(device, gen, ordered):
    """End to end (design §2.4): after accept_cache_locs + move_kv_cache, the first acc_i slots of
    every request's verify window hold the KV its accepted nodes had. The paths list node ids
    in increasing order, so the pairs are ordered; 13 requests span several pair blocks."""
    B, K, S, N = 13, 4, 3, 8
    accept_index, accept_lens, slots = _accept_inputs(B, K, S, N, gen, device)
    P = int(slots.max()) + 1
    pools = [GuardedPool(P, (64,), torch.bfloat16, device, gen),
             GuardedPool(P, (16,), torch.uint8, device, gen)]  # fmt: skip
    before = [p.rows().cpu().clone() for p in pools]
    tgt, src = accept_cache_locs(accept_index, accept_lens, slots, num_draft_tokens=N)
    status = new_status(device)
    move_kv_cache([p.view for p in pools], tgt, src, ordered=ordered, status=status)
    assert int(status) == 0
    sl = slots.cpu()
    for p, old in zip(pools, before, strict=True):
        p.assert_intact("buffer")
        new = p.rows().cpu()
        for i in range(B):
            for k in range(int(accept_lens[i])):
                node = int(accept_index[i, k])
                assert torch.equal(new[sl[i * N + k]], old[sl[node]]), f"request {i} node {k}"


def test_move_bad_input_raises_before_launch(device):
    buf = torch.zeros(8, 4, device=device)
    idx = torch.tensor([1, 2], device=device)
    with pytest.raises(TypeError, match="buffers must be a KVPool or a sequence"):
        move_kv_cache(buf, idx, idx)
    with pytest.raises(ValueError, match="at least one tensor"):
        move_kv_cache([], idx, idx)
    with pytest.raises(TypeError, match=r"buffers\[1\] must be a torch.Tensor"):
        move_kv_cache([buf, 3], idx, idx)
    with pytest.raises(ValueError, match=r"buffers\[1\] must be on"):
        move_kv_cache([buf, torch.zeros(8, 4, device="meta")], idx, idx)
    with pytest.raises(ValueError, match="P >= 1"):
        move_kv_cache([torch.zeros(0, 4, device=device)], idx, idx)
    with pytest.raises(TypeError, match="real numeric"):
        move_kv_cache([torch.zeros(8, 4, dtype=torch.bool, device=device)], idx, idx)
    with pytest.raises(ValueError, match="contiguous rows"):
        move_kv_cache([torch.zeros(8, 4, device=device).t()], idx, idx)
    with pytest.raises(ValueError, match="same memory"):
        move_kv_cache([buf, buf], idx, idx)
    with pytest.raises(TypeError, match="tgt"):
        move_kv_cache([buf], idx.float(), idx)
    with pytest.raises(ValueError, match="src must have 2"):
        move_kv_cache([buf], idx, idx[:1])
    with pytest.raises(TypeError, match="disjoint"):
        move_kv_cache([buf], idx, idx, disjoint=1)
    with pytest.raises(TypeError, match="ordered"):
        move_kv_cache([buf], idx, idx, ordered="yes")
    with pytest.raises(ValueError, match="addressing"):
        KVPool([buf], addressing="fast")
    big = torch.zeros(MAX_OVERLAPPING_PAIRS + 1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=f"need at most {MAX_OVERLAPPING_PAIRS} pairs, have"):
        move_kv_cache([buf], big, big)
    with pytest.raises(ValueError, match="at most"):
        move_kv_cache_ref([buf], big, big)


def test_pool_keeps_its_buffers_and_picks_the_widest_word(device):
    bufs = [torch.zeros(4, 576, dtype=torch.bfloat16, device=device),
            torch.zeros(4, 12, dtype=torch.uint8, device=device)]  # fmt: skip
    pool = KVPool(bufs)
    assert pool.word_bytes == 4 and len(pool) == 2 and pool.buffers[0] is bufs[0]
    assert KVPool(bufs[:1]).word_bytes == 8
    assert KVPool([torch.zeros(4, 3, dtype=torch.uint8, device=device)]).word_bytes == 1
    assert pool.addressing == ("table" if device.type == "cuda" else "direct")


# The interpreter accepts code that Triton's compiler rejects (loop-carried type changes, plain
# globals, pointer casts): compile every variant for sm_90 ahead of time, with no GPU, in a
# process where the interpreter is off, and check that aligned rows get 16-byte vector accesses.
_AOT = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import specmeta.kernels.cache_loc_move as m

a = importlib.import_module("specmeta.kernels.accept_cache_locs")  # the package's name is the op

target = GPUTarget("cuda", 90, 32)
out = {}
for status, translate, ragged in ((True, False, False), (False, False, False), (True, True, False),
                                  (True, False, True), (True, True, True)):
    acc = {"accept_index_ptr": "*i32", "accept_lens_ptr": "*i64", "out_cache_loc_ptr": "*i64",
           "qo_indptr_ptr": "*i32" if ragged else "constexpr", "tgt_ptr": "*i64", "src_ptr": "*i32",
           "v2p_ptr": "*i64", "status_ptr": "*i32", "B": "i32", "N": "i32", "C": "i32",
           "stride_acc": "i32", "n_out": "i32", "n_slots": "i32" if ragged else "constexpr",
           "num_pages": "i32", "page_size": "i32", "BLOCK_B": "constexpr", "BLOCK_C": "constexpr",
           "BLOCK_TAIL": "constexpr", "RAGGED": "constexpr", "TRANSLATE": "constexpr",
           "HAS_STATUS": "constexpr"}
    consts = {"BLOCK_B": a._BLOCK_B, "BLOCK_C": 8, "BLOCK_TAIL": a._BLOCK_TAIL, "RAGGED": ragged,
              "TRANSLATE": translate, "HAS_STATUS": status}
    consts.update({} if ragged else {"qo_indptr_ptr": None, "n_slots": None})
    triton.compile(ASTSource(a._accept_cache_locs_kernel, acc, consts), target=target)
for table, word, vec, block_n, cols, warps in [(True, 8, 2, 256, 32, 8), (True, 8, 2, 4096, 2, 16),
                                               (True, 4, 1, 8192, 1, 16), (False, 8, 2, 64, 64, 8),
                                               (False, 1, 1, 32, 256, 8), (True, 2, 1, 1024, 8, 8)]:
    wt = {8: "i64", 4: "i32", 2: "i16", 1: "u8"}[word]
    sig = {"table_ptr": "*i64", "buf_ptr": f"*{wt}", "tgt_ptr": "*i64", "src_ptr": "*i32",
           "status_ptr": "*i32", "n": "i32", "blocks_per_program": "i32", "num_buffers": "i32",
           "buffers_per_program": "i32", "min_rows": "i32", "buf_stride": "i32",
           "buf_width": "i32", "buf_rows": "i32",
           "BLOCK_N": "constexpr", "COLS": "constexpr", "TABLE": "constexpr",
           "WORD_BYTES": "constexpr", "VEC": "constexpr", "HAS_STATUS": "constexpr"}
    consts = {"BLOCK_N": block_n, "COLS": cols, "TABLE": table, "WORD_BYTES": word, "VEC": vec,
              "HAS_STATUS": True}
    k = triton.compile(ASTSource(m._move_kv_cache_kernel, sig, consts), target=target,
                       options={"num_warps": warps})
    ptx = k.asm["ptx"]
    out[f"{table}-{word}-{vec}-{block_n}"] = [len(re.findall(r"ld\.global[^\n]*\.v[24]", ptx)),
                                             len(re.findall(r"st\.global[^\n]*\.v[24]", ptx)),
                                             len(re.findall(r"bar\.sync|barrier\.sync", ptx))]
print(json.dumps(out))
"""


def test_kernels_compile_for_the_gpu(tmp_path):
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("needs Triton's NVIDIA backend, which this Triton build lacks")
    script = tmp_path / "aot.py"
    script.write_text(_AOT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for key, (vec_ld, vec_st, barriers) in got.items():
        assert barriers >= 1, f"{key}: no barrier between the loads and the stores"
        if key.split("-")[2] != "1":
            assert vec_ld >= 1 and vec_st >= 1, f"{key}: aligned rows without 16-byte vectors"


# --------------------------------------------------------------------------------------------
# GPU tier
# --------------------------------------------------------------------------------------------
def _gpu_pools(layers, P, row_shape, dtype, gen):
    """K and V of ``layers`` layers, random bytes drawn on the device from a seed of ``gen``."""
    gc = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    nbytes = P * math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (nbytes,), generator=gc, dtype=torch.uint8, device="cuda")
            .view(dtype).view(P, *row_shape) for _ in range(2 * layers)]  # fmt: skip


def _bytes(t):
    return t.reshape(t.shape[0], -1).view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("n,row_shape,dtype", [(4096, (576,), torch.bfloat16),
                                              (1024, (1152,), torch.uint8),
                                              (300, (8, 128), torch.float16),
                                              (8192, (1,), torch.float32)])  # fmt: skip
def test_gpu_pointer_table_matches_reference(gen, n, row_shape, dtype):
    """64 buffers in one launch over the pointer table, and the direct path, against the
    reference at production sizes."""
    P = 2 * n + 64
    bufs = _gpu_pools(32, P, row_shape, dtype, gen)
    tgt, src = _overlapping_pairs(P, n - 6, gen, oob=True)  # 6 out-of-range pairs on top
    _check_gpu_move(bufs, tgt.cuda(), src.cuda(), ordered=False)


@pytest.mark.gpu
@pytest.mark.parametrize("n,row_shape,dtype", [(4096, (576,), torch.bfloat16),
                                              (1024, (1152,), torch.uint8),
                                              (300, (8, 128), torch.float16),
                                              (20000, (1,), torch.float32)])  # fmt: skip
def test_gpu_ordered_pairs_match_reference(gen, n, row_shape, dtype):
    """ordered=True at production sizes: a chain whose dependencies cross blocks (thousands of
    programs run at once, so moving the blocks in parallel would read overwritten rows), with
    out-of-range pairs appended; past MAX_OVERLAPPING_PAIRS too."""
    P = 2 * n + 64
    bufs = _gpu_pools(32, P, row_shape, dtype, gen)
    tgt, src = _ordered_pairs(P, n, gen)
    tgt = torch.cat([tgt, torch.tensor([P, 3, -1, 1 << 40, 5, 6])])
    src = torch.cat([src, torch.tensor([1, P + 9, 4, 2, -7, 1 << 40])])
    _check_gpu_move(bufs, tgt.cuda(), src.cuda(), ordered=True)


def _check_gpu_move(bufs, tgt, src, *, ordered):
    for addressing in ("table", "direct"):
        got = [b.clone() for b in bufs]
        ref = [b.clone() for b in bufs]
        status, ref_status = new_status("cuda"), new_status("cuda")
        move_kv_cache(KVPool(got, addressing=addressing), tgt, src, ordered=ordered,
                      status=status)  # fmt: skip
        move_kv_cache_ref(ref, tgt, src, ordered=ordered, status=ref_status)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert_equal(_bytes(a), _bytes(b), f"buffers[{i}] ({addressing})")
        assert int(status) == int(ref_status) == int(Status.POOL_OOB)


# The race the barrier prevents (issue 17): without it, a warp that has loaded its sources may
# store its targets before another warp of the same program has loaded a source that is one of
# those targets. The CPU interpreter runs a program's lanes in lock step and cannot show it.
# Here every target is another pair's source, the pairs sit in one program's tile (so reader
# and writer are almost always different warps), rows are 4 KiB over 64 buffers (many vector
# loads per thread, so a warp's loads stay in flight long after the first warps store), and
# the "one_group" cases make each program walk every buffer: with no barrier in the loop, warps
# drift apart by whole iterations and a fast warp's stores land before a slow warp's loads.
_RACE_BUFFERS = 64  # K and V of 32 layers
_RACE_ROW_BYTES = 4096  # 8-byte words, 16-byte vectors: 16 loads a thread in the wide tile
_RACE_DRAWS = 4  # pair lists, each with its own reference
_RACE_LAUNCHES = 25  # launches per pair list, each on a fresh copy of the pool
_RACE_MAX_SHIFT = 64  # ordered pairs: pair i reads the slot pair i + d writes, d in [1, 64]


def _racy_pairs(P, n, gen, *, ordered):
    """``n`` pairs over slots ``[1, P)`` where every target but a few is another pair's source.

    Unordered: ``src`` is a random permutation of ``tgt`` (chains and cycles of every length;
    a fixed point is a self-move). Ordered: pair ``i`` reads the slot that pair ``i + d_i``
    writes, ``d_i`` in ``[1, _RACE_MAX_SHIFT]`` (past the end: an untouched slot), so the list
    is ordered (no pair reads a slot an earlier pair writes) and its hazards lie within a block
    and across neighbouring blocks."""
    slots = torch.randperm(P - 1, generator=gen) + 1
    tgt = slots[:n]
    if ordered:
        shift = torch.randint(1, _RACE_MAX_SHIFT + 1, (n,), generator=gen)
        src = slots[torch.arange(n) + shift]
    else:
        src = tgt[torch.randperm(n, generator=gen)]
    return tgt.clone(), src.clone()


def _racy_moves(device, gen, *, n, ordered, addressing, buffers=_RACE_BUFFERS,
                row_bytes=_RACE_ROW_BYTES, draws=_RACE_DRAWS, launches=_RACE_LAUNCHES):  # fmt: skip
    """Move ``draws`` racy pair lists ``launches`` times each over a fresh copy of the pool and
    compare every result exactly with the reference. Returns ``(stale, total, first, status)``:
    the launches that left a stale row, the launches made, the first stale row, the status."""
    P = n + _RACE_MAX_SHIFT + 64
    seed = int(torch.randint(2**31, (1,), generator=gen))
    dgen = torch.Generator(device=device).manual_seed(seed)
    # One allocation holds every buffer: one copy restores the pool, one compare checks it.
    original = torch.randint(0, 256, (buffers, P, row_bytes), generator=dgen, dtype=torch.uint8,
                             device=device)  # fmt: skip
    work = torch.empty_like(original)
    pool = KVPool(list(work), addressing=addressing)
    status = new_status(device)
    stale, first = 0, None
    for _ in range(draws):
        tgt, src = (t.to(device) for t in _racy_pairs(P, n, gen, ordered=ordered))
        want = original.clone()
        move_kv_cache_ref(list(want), tgt, src, ordered=ordered)
        for _ in range(launches):
            work.copy_(original)
            move_kv_cache(pool, tgt, src, ordered=ordered, status=status)
            if torch.equal(work, want):
                continue
            stale += 1
            if first is None:
                b, row = (work != want).any(dim=-1).nonzero()[0].tolist()
                q = (tgt == row).nonzero().flatten().tolist()
                pair = f" (pair {q[0]}: row {row} <- slot {int(src[q[0]])})" if q else ""
                first = f"buffer {b} row {row}{pair}"
    return stale, draws * launches, first, int(status)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,ordered,addressing,programs",
    [(1024, False, "table", "default"),  # one block of 1024 pairs: the 16-warp, 128 KiB tile
     (1024, False, "table", "one_group"),  # ... and every program walks all 64 buffers
     (256, False, "table", "one_group"),  # the 8-warp, 32 KiB tile
     (1024, False, "direct", "default"),  # one launch per buffer
     (4096, True, "table", "default"),  # ordered: blocks walked in list order
     (4096, True, "table", "one_group")],
)  # fmt: skip
def test_gpu_overlapping_moves_read_every_source_before_any_write(
    gen, monkeypatch, n, ordered, addressing, programs
):
    """Stress for the read-before-write barrier: thousands of launches of pair lists whose
    targets are other pairs' sources, each result exactly equal to the reference. With the
    barrier deleted (``scripts/mutations.py --gpu-only``, mutation ``k-move-no-barrier``) reads
    see already-overwritten rows and this test fails."""
    if programs == "one_group":
        monkeypatch.setattr(cache_loc_move, "_move_programs", lambda device, wide: 1)
    stale, total, first, status = _racy_moves(torch.device("cuda"), gen, n=n, ordered=ordered,
                                              addressing=addressing)  # fmt: skip
    assert stale == 0, (
        f"{stale} of {total} launches left a target row that is not its source's old value "
        f"(a source read after another warp overwrote it?); first: {first}"
    )
    assert status == 0


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager_with_changing_inputs(gen):
    B, K, S, N = 64, 4, 3, 8
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=N, max_bs=B)
    plan = plan_buffers(cfg)
    tgt_buf = plan["verify.tgt_cache_loc"].allocate("cuda")
    src_buf = plan["verify.src_cache_loc"].allocate("cuda")
    status = new_status("cuda")
    P = 4 * B * N + 16  # _accept_inputs draws slots below 4·B·N + 9
    bufs = _gpu_pools(8, P, (576,), torch.bfloat16, gen)
    pool = KVPool(bufs)
    draws = [_accept_inputs(B, K, S, N, gen, "cuda") for _ in range(4)]
    ai, al, slots = (x.clone() for x in draws[0])

    def step():
        tgt, src = accept_cache_locs(ai, al, slots, num_draft_tokens=N, tgt=tgt_buf, src=src_buf,
                                     status=status)  # fmt: skip
        move_kv_cache(pool, tgt, src, status=status)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        step()
    for draw in draws[1:] + draws[:1]:
        for static, new in zip((ai, al, slots), draw, strict=True):
            static.copy_(new)
        ref = [b.clone() for b in bufs]
        rt, rs = accept_cache_locs_ref(*draw, num_draft_tokens=N)
        move_kv_cache_ref(ref, rt, rs)
        tgt_buf.fill_(-7)  # stale contents must not survive a replay
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(tgt_buf, rt, "tgt")
        assert_equal(src_buf, rs, "src")
        for i, (a, b) in enumerate(zip(bufs, ref, strict=True)):
            assert_equal(_bytes(a), _bytes(b), f"buffers[{i}]")
        assert int(status) == 0


_SANITIZED = """
import torch, specmeta
from specmeta.kernels.cache_loc_move import KVPool, accept_cache_locs, move_kv_cache
g = torch.Generator().manual_seed(0)
P = 300
bufs = [torch.randn(P - 40 * i, 576).to(torch.bfloat16).cuda() for i in range(4)]
tgt = torch.randint(-3, P + 3, (257,), generator=g).cuda()
src = torch.randint(-3, P + 3, (257,), generator=g).cuda()
status = specmeta.new_status("cuda")
move_kv_cache(KVPool(bufs), tgt, src, status=status)
move_kv_cache(bufs, tgt, src, disjoint=True, status=status)
move_kv_cache(KVPool(bufs), tgt, src, ordered=True, status=status)
ai = torch.randint(-1, 40, (5, 4), generator=g).int().cuda()
al = torch.randint(-1, 6, (5,), generator=g).cuda()
t, s = accept_cache_locs(ai, al, torch.arange(40).cuda(), num_draft_tokens=8, status=status)
torch.cuda.synchronize()
print("status", int(status))
"""


@pytest.mark.gpu
def test_gpu_compute_sanitizer_memcheck_clean(tmp_path):
    """Out-of-range pairs and corrupt accept rows under compute-sanitizer: no access outside
    any buffer."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("needs compute-sanitizer (CUDA toolkit) on PATH")
    script = tmp_path / "sanitized.py"
    script.write_text(_SANITIZED)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    run = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, str(script)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr
    assert f"status {int(Status.POOL_OOB | Status.BAD_ACCEPT)}" in run.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("addressing", ["table", "direct"])
def test_gpu_bound_moves_equal_the_reference(gen, addressing):
    """A move bound once on one KVPool and the same pair tensors (bind_move_kv_cache), called
    every round with new pair values: every round equals the torch reference, and pairs that
    leave the pool still report POOL_OOB through the bound launches."""
    P, n = 512, 40
    bufs = [torch.randn(P, 4, 32, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    pool = KVPool(bufs, addressing=addressing)
    tgt = torch.zeros(n, dtype=torch.int64, device="cuda")
    src = torch.zeros_like(tgt)
    status = new_status("cuda")
    move = bind_move_kv_cache(pool, tgt, src, disjoint=True, status=status)
    for round_ in range(4):
        perm = torch.randperm(P, generator=gen)[: 2 * n]
        if round_ == 3:
            perm[0] = P + 5  # a target past the pool: skipped and reported
        tgt.copy_(perm[:n])
        src.copy_(perm[n:])
        want = [b.clone() for b in bufs]
        status.zero_()
        ref_status = new_status("cuda")
        move_kv_cache_ref(want, tgt, src, disjoint=True, status=ref_status)
        assert move() is None
        for i, (got, w) in enumerate(zip(bufs, want, strict=True)):
            assert torch.equal(got, w), (round_, i)
        assert int(status) == int(ref_status) == (int(Status.POOL_OOB) if round_ == 3 else 0)
