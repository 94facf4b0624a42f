"""tree_custom_mask against its reference, design §3.3 read directly, and numpy's packbits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import tree_custom_mask_need
from specmeta.kernels.tree_custom_mask import tree_custom_mask, tree_custom_mask_ref
from specmeta.workloads import random_tree_mask
from tests.guard_bands import Guarded, assert_equal

_CANARY, _POISON = 0xA5, 0x3C  # neither is a bool (0/1) nor a packed byte we compare against


class _ByteGuarded:
    """tests.guard_bands.Guarded for a byte buffer: canary margins, poisoned output."""

    def __init__(self, width: int, device, margin: int = 64):
        self.storage = torch.full((width + 2 * margin,), _CANARY, dtype=torch.uint8, device=device)
        self.view = self.storage[margin : margin + width]
        self.view.fill_(_POISON)
        self.margin = margin

    def assert_intact(self, name: str) -> None:
        m = self.margin
        for part in (self.storage[:m], self.storage[-m:]):
            assert part.eq(_CANARY).all(), f"{name}: canary overwritten"


TREES = [(1, 3, 4), (2, 3, 6), (4, 2, 8), (3, 5, 13)]  # (K, S, N)


def _lengths(gen, batch, hi):
    return torch.randint(0, hi + 1, (batch,), generator=gen)


def _run(seq_lens, tree, device, *, packed, width=None, with_sum=True):
    B, N = tree.shape[0], tree.shape[1]
    total = int(seq_lens.clamp_min(0).sum())
    need = tree_custom_mask_need(total, B, N, packed)
    width = need + 9 if width is None else width
    dtype = torch.uint8 if packed else torch.bool
    # Byte canary and poison (guard_bands' values do not fit a byte); bool is a view of them.
    buf = _ByteGuarded(width, device)
    out = buf.view.view(dtype)
    ptr = Guarded((B + 1,), torch.int64, device)
    sl, tm = seq_lens.to(device), tree.to(device)
    kw = dict(packed=packed, seq_lens_sum=total if with_sum else None)
    status = new_status(device)
    tree_custom_mask(sl, tm, custom_mask=out, mask_indptr=ptr.view, status=status, **kw)
    ref = torch.full_like(buf.view, _POISON).view(dtype)  # packed: gaps stay poisoned in both
    ref_ptr, ref_status = ptr.view.clone(), new_status(device)
    tree_custom_mask_ref(sl, tm, custom_mask=ref, mask_indptr=ref_ptr, status=ref_status,
                         **kw)  # fmt: skip
    buf.assert_intact("custom_mask")
    ptr.assert_intact("mask_indptr")
    assert_equal(ptr.view, ref_ptr, "mask_indptr")
    used = min(int(ref_ptr[-1]), width)
    assert_equal(out[:used].view(torch.uint8), ref[:used].view(torch.uint8), "custom_mask")
    assert_equal(status, ref_status, "status")
    return out, ptr.view, status


def _spec_blocks(seq_lens, tree):
    """Request i's N × (L_i + N) block, row-major: prefix columns 1, tree columns from m."""
    N = tree.shape[1]
    return [
        torch.cat([torch.ones(N, int(L), dtype=torch.bool), tree[i]], dim=1).reshape(-1)
        for i, L in enumerate(seq_lens.tolist())
    ]


def _assert_spec_blocks(out, ptr, seq_lens, tree, packed):
    """Each request's segment is its :func:`_spec_blocks` block, at ``mask_indptr``'s element
    offset; packed, as ``segment_packbits(..., bitorder="little")`` (numpy's ``packbits`` per
    segment), the bytes FlashInfer 0.7's ``plan()`` reads there."""
    out, ptr = out.cpu(), ptr.cpu()
    assert int(ptr[0]) == 0
    for i, block in enumerate(_spec_blocks(seq_lens, tree.cpu())):
        lo, hi = int(ptr[i]), int(ptr[i + 1])
        where = f"request {i}, L={int(seq_lens[i])}"
        assert hi - lo == block.numel(), f"{where}: segment starts count elements"
        if packed:
            want = torch.from_numpy(np.packbits(block.numpy(), bitorder="little"))
            assert torch.equal(out[lo : lo + want.numel()], want), where
        else:
            assert torch.equal(out[lo:hi], block), where


def _row_padded(tree, device):
    """``tree`` on ``device`` with each row padded to ``N + 3`` entries (row stride ``N + 3``):
    with contiguous rows, an element placed one row short reads the same address (``j·N +
    col − L`` with ``col`` one row too far), so only padded rows show a row found wrong."""
    B, n = tree.shape[0], tree.shape[1]
    padded = torch.zeros(B, n, n + 3, dtype=torch.bool, device=device)[:, :, :n]
    padded.copy_(tree)  # made on the device: a copy there would drop the padding
    assert padded.stride(1) == n + 3
    return padded


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 7])
@pytest.mark.parametrize("k,s,n", TREES)
def test_matches_reference_and_spec(device, gen, k, s, n, batch, packed):
    seq_lens = _lengths(gen, batch, 40)
    tree = random_tree_mask(batch, k, s, n, gen)
    out, ptr, status = _run(seq_lens, tree, device, packed=packed)
    assert int(status) == 0
    _assert_spec_blocks(out, ptr, seq_lens, tree, packed)


@pytest.mark.parametrize("packed", [False, True])
def test_row_widths_whose_float_quotient_falls_short(device, gen, packed):
    """The kernel finds an element's row by a float64 multiply by ``1 / (L + N)``: at widths 49,
    98, 103 and 107, ``q · width · fl(1 / width)`` truncates to ``q − 1`` for small ``q`` (row
    starts 1, 2, 3, 4, 6, ...), which the kernel's correction step must catch. Requests of those
    widths, with a 13-node tree (its rows reach those multiples, and are padded), in random
    order."""
    n = 13
    widths = torch.tensor([49, 98, 103, 107, 49, 98])
    seq_lens = widths[torch.randperm(widths.numel(), generator=gen)] - n
    dense = random_tree_mask(seq_lens.numel(), 3, 5, n, gen)
    out, ptr, status = _run(seq_lens, _row_padded(dense, device), device, packed=packed)
    assert int(status) == 0
    _assert_spec_blocks(out, ptr, seq_lens, dense, packed)


@pytest.mark.parametrize("packed", [False, True])
def test_rows_wider_than_a_chunk(device, gen, packed):
    """Rows of thousands of columns, where the kernel writes whole chunks of prefix ones and
    finds each other element's row as the chunk's first row or the next: random widths in
    ``[2048, 5000]`` and the edges of a chunk (1024 elements, 2048 when packed: a row exactly
    one chunk wide, one element less and more), with a 6-node tree (rows padded), in random
    order."""
    n = 6
    edges = torch.tensor([1023, 1024, 1025, 2047, 2048, 2049]) - n
    seq_lens = torch.cat([edges, torch.randint(2048, 5001, (3,), generator=gen)])
    seq_lens = seq_lens[torch.randperm(seq_lens.numel(), generator=gen)]
    tree = random_tree_mask(seq_lens.numel(), 2, 3, n, gen)
    out, ptr, status = _run(seq_lens, _row_padded(tree, device), device, packed=packed)
    assert int(status) == 0
    _assert_spec_blocks(out, ptr, seq_lens, tree, packed)


def test_spec_example(device):
    sl = torch.tensor([1], device=device)
    tree = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool, device=device)
    mask, ptr = tree_custom_mask(sl, tree, seq_lens_sum=1)
    assert mask.tolist() == [True, True, False, True, True, True] and ptr.tolist() == [0, 6]
    mask, ptr = tree_custom_mask(sl, tree, packed=True, seq_lens_sum=1)
    assert mask.tolist()[0] == 59 and ptr.tolist() == [0, 6]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(0, 6), k=st.integers(1, 4), s=st.integers(1, 4), hi=st.integers(0, 70),
       packed=st.booleans(), seed=st.integers(0, 2**31 - 1), transposed=st.booleans())  # fmt: skip
def test_property(device, b, k, s, hi, packed, seed, transposed):
    g = torch.Generator().manual_seed(seed)
    n = min(1 + k + (s - 1) * k * k, 16)
    seq_lens = _lengths(g, b, hi)
    tree = random_tree_mask(b, k, s, n, g)
    if transposed:  # a non-contiguous batch stride: [N, B, N] storage viewed as [B, N, N]
        tree = tree.transpose(0, 1).contiguous().transpose(0, 1)
    _, _, status = _run(seq_lens, tree, device, packed=packed)
    assert int(status) == 0


def test_too_small_buffer_without_host_total_is_masked(device, gen):
    seq_lens = _lengths(gen, 5, 30) + 10
    tree = random_tree_mask(5, 2, 3, 6, gen)
    need = tree_custom_mask_need(int(seq_lens.sum()), 5, 6)
    _, _, status = _run(seq_lens, tree, device, packed=False, width=need // 2, with_sum=False)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_negative_length_is_masked(device, gen):
    seq_lens = _lengths(gen, 4, 30)
    seq_lens[1] = -5
    tree = random_tree_mask(4, 2, 3, 6, gen)
    out, ptr, status = _run(seq_lens, tree, device, packed=False)
    assert int(status) == int(Status.POS_OOB)
    assert int(ptr[2] - ptr[1]) == 6 * 6, "a negative prefix reads as 0: the block is N × N"


def test_bad_input_raises_before_launch(device, gen):
    sl = torch.tensor([3, 4], device=device)
    tree = random_tree_mask(2, 2, 2, 4, gen).to(device)
    with pytest.raises(ValueError, match="need 60 elements"):
        tree_custom_mask(sl, tree, custom_mask=torch.zeros(59, dtype=torch.bool, device=device),
                         seq_lens_sum=7)  # fmt: skip
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        tree_custom_mask(sl, tree[:1], seq_lens_sum=7)
    with pytest.raises(TypeError, match="tree_mask"):
        tree_custom_mask(sl, tree.int(), seq_lens_sum=7)
    with pytest.raises(TypeError, match="custom_mask"):
        tree_custom_mask(sl, tree, packed=True, custom_mask=torch.zeros(64, dtype=torch.bool,
                                                                        device=device))  # fmt: skip
    with pytest.raises(ValueError, match="mask_indptr is too small"):
        tree_custom_mask(sl, tree, seq_lens_sum=7,
                         mask_indptr=torch.zeros(2, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="seq_lens_sum"):
        tree_custom_mask(sl, tree)
