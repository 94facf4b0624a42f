"""FlashInfer's flat target-verify mask from a draft-tree mask (design §3.3).

Request ``i`` owns an ``N × (L_i + N)`` row-major block: query row ``j`` (tree node ``j``) sees
every prefix column and the tree columns of its ancestors and itself::

    mask_indptr[i]                                   = Σ_{i'<i} N·(L_i' + N)
    custom_mask[mask_indptr[i] + j·(L_i + N) + c]    = 1                    for c < L_i
    custom_mask[mask_indptr[i] + j·(L_i + N) + L_i + c'] = tree_mask[i, j, c']   for c' < N

The packed form is the one FlashInfer 0.7's prefill ``plan(packed_custom_mask=...)`` reads:
every request's segment packed eight elements a byte, element ``e`` at bit ``e % 8`` of byte
``e // 8`` (little-endian within the byte, as ``segment_packbits(..., bitorder="little")``),
padded with zero bits to a whole byte, and the segment of request ``i`` starting at byte
``mask_indptr[i]``, its *element* offset ``Σ_{i'<i} N·(L_i' + N)``. That ``plan()`` computes
the segment starts itself, in elements, and its kernel reads them as byte offsets; a compact
layout (segments back to back) is read at the wrong offsets for every request after the first.
Placing each segment at its element offset makes the two agree: the bytes between segments are
never written or read, so the packed buffer is as large as the bool one. What it saves is the
device-to-host copy that ``plan(custom_mask=...)`` makes to pack the bool form.

A ragged target verify (``verify_lens``, design §3.3) gives request ``i`` the first
``v_i ≤ N`` nodes of its tree: its block is ``v_i × (L_i + v_i)``, ``N`` replaced by ``v_i``
throughout (rows, tree columns, segment sizes and starts)::

    mask_indptr[i]                                   = Σ_{i'<i} v_i'·(L_i' + v_i')
    custom_mask[mask_indptr[i] + j·(L_i + v_i) + c]  = 1                    for j < v_i, c < L_i
    custom_mask[mask_indptr[i] + j·(L_i + v_i) + L_i + c'] = tree_mask[i, j, c']   for c' < v_i

(a padded ``v_i`` past ``N`` keeps ``N`` tree columns and adds filler rows, 1 in every
column: design §2.9), and the packed rule is the same: segment ``i`` is its elements packed
eight a byte, zero bits to a whole byte, starting at byte ``mask_indptr[i]`` (the element
offset, now of the ragged blocks: what ``plan()`` computes from the ragged ``qo_indptr`` and
``kv_indptr``). A request with ``v_i = 0`` has an empty segment: nothing is written for it.

A sliding-window layer (``sliding_window_size = w``, design §2.10) reads the lists of
:func:`~specmeta.kernels.verify_kv_indices.verify_kv_indices` clipped to ``min(L_i, w − 1)``
prefix positions (from ``f_i = L_i − min(L_i, w − 1)``), so its blocks are ``N × (min(L_i,
w − 1) + N)`` and node ``j``, at depth ``d_j`` (position ``L_i + d_j``), sees a column at
position ``k`` iff it did before (prefix, or ancestor-or-self) and ``k > L_i + d_j − w``. The
depths come from the tree mask itself: ``d_j`` is row ``j``'s ancestor-or-self count less one,
and an ancestor ``c`` of ``j`` sits at depth ``d_j + 1 − Σ_{c' ≥ c} tree_mask[i, j, c']``, so
it is seen iff ``Σ_{c' ≥ c} tree_mask[i, j, c'] ≤ w``; a prefix column ``c < min(L_i, w − 1)``
iff ``c ≥ min(L_i, w − 1) + d_j + 1 − w``. ``mask_indptr`` and the packed segments follow the
clipped widths. A window layer's ragged verify clips each ragged block alike: ``v_i × (min(L_i,
w − 1) + min(v_i, N))``, node ``j < min(v_i, N)`` by the same rule (its depth counted over the
block's ``min(v_i, N)`` tree columns), a filler row every column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, cdiv
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    OUT_OF_CAPACITY,
    POS_OOB,
    check_verify_lens,
    host_int,
    load_verify_rows,
    target_programs,
    verify_rows_ref,
)
from ._window import check_window, rail_mask_need, rail_verify_prefix, rail_verify_prefix_ref

__all__ = ["bind_tree_custom_mask", "tree_custom_mask", "tree_custom_mask_ref"]


# Output elements per program iteration: 1024 bools, or 256 bytes of eight bits (a [256, 8]
# tile of mask elements).
_BLOCK = 1024
_BLOCK_PACKED = 256
# seq_lens entries summed per iteration of the exclusive-prefix loop (one load up to B = 1024).
_BLOCK_B = 1024


@triton.jit
def _segment_start(seq_lens_ptr, b, N, rail, BLOCK_B: tl.constexpr, RAIL: tl.constexpr):
    """Σ_{i<b} N·(L_i + N): the segment's start in elements, and in bytes when packed
    (int64: N·ΣL passes 2**31 at long contexts); each ``L_i`` clipped to ``w − 1`` under the
    rail ``w > 0``."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        L = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        if RAIL:
            L = rail_verify_prefix(L, rail)
        cum += tl.sum(tl.where(before, N * (L + N), 0), axis=0)
    return cum


@triton.jit
def _ragged_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, BLOCK_B: tl.constexpr):
    """Σ_{i<b} r_i·(L_i + min(r_i, N)), ``r_i = max(v_i, 0)`` the rows of request ``i`` as
    :func:`~specmeta.kernels._common.load_verify_rows` reads them: a ragged segment's start in
    elements, and in bytes when packed (int64)."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        L = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        rows = tl.maximum(tl.load(verify_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        cum += tl.sum(tl.where(before, rows * (L + tl.minimum(rows, N)), 0), axis=0)
    return cum


@triton.jit
def _window_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, rail, BLOCK_B: tl.constexpr):
    """:func:`_ragged_segment_start` of a window layer (design §2.10): each ``L_i`` clipped to
    ``min(L_i, w − 1)``, the prefix columns of its block."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        L = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        L = rail_verify_prefix(L, rail)
        rows = tl.maximum(tl.load(verify_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        cols = L + tl.minimum(rows, N)  # the block's clipped width
        cum += tl.sum(tl.where(before, rows * cols, 0), axis=0)
    return cum


@triton.jit
def _mask_value(tree_ptr, live, j, col, L, Nt, stride_mj):
    """The mask elements at row ``j``, column ``col`` of a request's block (any shape): 1 in the
    prefix columns, the tree mask's ``[j, col − L]`` after them; a filler row ``j ≥ Nt`` (a
    ragged request's rows past its ``Nt`` tree nodes) is 1 in every column; 0 where not
    ``live``."""
    in_tree = (col >= L) & (j < Nt)
    m = tl.load(tree_ptr + j * stride_mj + (col - L), mask=live & in_tree, other=0)
    return (live & (~in_tree | (m != 0))).to(tl.int32)


@triton.jit
def _window_mask_value(tree_ptr, live, j, col, L, Nt, stride_mj, rail):
    """:func:`_mask_value` of a window layer's clipped block (``L`` its ``min(L_i, w − 1)``
    prefix columns, ``Nt`` tree columns): node ``j``'s depth is its row's ancestor-or-self
    count (over the block's ``Nt`` tree columns) less one, and of that row's entries a column
    keeps those the rail ``w`` reaches (design §2.10): a prefix column ``col ≥ L + d_j + 1 −
    w``, an ancestor column ``c`` with at most ``w`` of the row's entries at or after it. A
    filler row ``j ≥ Nt`` (a ragged request's rows past its nodes) sees every column."""
    in_tree = col >= L
    c = col - L
    node = live & (j < Nt)  # a tree row, read; a filler row reads nothing
    count = tl.zeros_like(col)  # the row's ancestors-or-self
    after = tl.zeros_like(col)  # those at or after column c
    for a in range(0, Nt):
        anc = tl.load(tree_ptr + j * stride_mj + a, mask=node, other=0) != 0
        count += anc.to(col.dtype)
        after += (anc & (a >= c)).to(col.dtype)
    m = tl.load(tree_ptr + j * stride_mj + c, mask=node & in_tree, other=0) != 0
    seen = tl.where(in_tree, m & (after <= rail), col >= L + count - rail)
    return (live & (seen | (j >= Nt))).to(tl.int32)


@triton.jit
def _first_seen_column(tree_ptr, valid, j, L, Nt, stride_mj, rail):
    """The first of a window layer's ``L`` prefix columns that node ``j`` sees (design §2.10):
    ``L + d_j + 1 − w``, its depth read as its row's ancestor-or-self count less one (``Nt``
    scalar loads: one row a chunk, where :func:`_window_mask_value` reads a row an element).
    A filler row ``j ≥ Nt`` reads nothing: its count is 0, and ``L − w < 0`` (``L ≤ w − 1``),
    so it sees every column."""
    count = L * 0
    for a in range(0, Nt):
        anc = tl.load(tree_ptr + j * stride_mj + a, mask=valid & (j < Nt), other=0)
        count += (anc != 0).to(L.dtype)
    return L + count - rail


@triton.jit
def _chunk_values(tree_ptr, valid, first, j0, col0, offs, n_bits, L, N, stride_mj, inv_cols,
                  rail, SPAN: tl.constexpr, RAIL: tl.constexpr):  # fmt: skip
    """The mask elements ``first + offs`` of a request's block (``offs`` in ``[0, SPAN)``, any
    shape), ``cols = L + N`` to a row, the first of them at row ``j0``, column ``col0``.

    Where a row is at least ``SPAN`` wide, the chunk reaches at most one row further, so every
    element's row is ``j0`` or ``j0 + 1``. Narrower rows take each element's row from a float64
    multiply by ``inv_cols = 1 / cols`` (an int64 division is tens of instructions an element):
    below 2**52 the truncated product is the quotient or one less (``cols = 49``:
    ``49 · fl(1/49) < 1``), never more, and one step corrects it."""
    cols = tl.maximum(L + N, 1)  # N = 0: no element is live
    bit = first + offs
    live = tl.where(valid, bit < n_bits, False)
    if cols >= SPAN:
        col = col0 + offs
        wrap = col >= cols
        j = j0 + wrap.to(tl.int64)
        col = tl.where(wrap, col - cols, col)
    else:
        j = (bit.to(tl.float64) * inv_cols).to(tl.int64)
        j += (bit - j * cols >= cols).to(tl.int64)
        col = bit - j * cols
    if RAIL:
        v = _window_mask_value(tree_ptr, live, j, col, L, N, stride_mj, rail)
    else:
        v = _mask_value(tree_ptr, live, j, col, L, N, stride_mj)
    return v


@triton.jit(
    do_not_specialize=["B", "N", "stride_mb", "stride_mj", "W_mask", "chunk_programs", "rail"]
)
def _tree_custom_mask_kernel(
    seq_lens_ptr,  # [B] int32|int64
    verify_lens_ptr,  # [B] int32|int64, or None (uniform: every request has N rows)
    tree_mask_ptr,  # [B, N, N] uint8 view of bool, strides (stride_mb, stride_mj, 1)
    custom_mask_ptr,  # [W_mask] uint8 (bool view, or packed bytes)
    mask_indptr_ptr,  # [≥B+1] int32|int64
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    N,
    stride_mb,
    stride_mj,
    W_mask,
    chunk_programs,
    rail,  # the window read rail w (read only with RAIL; None without)
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_VERIFY_LENS: tl.constexpr,  # verify_lens_ptr is a tensor: v_b × (L_b + v_b) blocks
    HAS_STATUS: tl.constexpr,
    RAIL: tl.constexpr,  # a window layer's clipped blocks (design §2.10)
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` writes chunks ``c, c +
    chunk_programs, …`` of request ``b``'s segment; ``(b, 0)`` also writes ``mask_indptr[b + 1]``
    (entry 0 from ``b = 0``) and the status. A request has ``rows`` query rows over ``Nb``
    tree columns: ``N`` and ``N``, or in a ragged verify ``max(v_b, 0)`` and ``min(rows, N)``
    (a padded length past ``N`` adds filler rows, 1 in every column)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    valid = b < B
    L = tl.load(seq_lens_ptr + b, mask=valid, other=0).to(tl.int64)
    L_ok = L >= 0
    L = tl.maximum(L, 0)
    if HAS_VERIFY_LENS:
        # Ragged verify: v_b rows over the first Nb = min(v_b, N) nodes; the rows past N of a
        # padded length are filler rows (design §2.9); a v_b < 0 reads as 0 and is reported
        # (POS_OOB, below).
        rows, Nb, v_ok = load_verify_rows(verify_lens_ptr, b, B, N)
        L_ok = L_ok & v_ok
        if RAIL:  # a window layer's clipped blocks
            start = _window_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, rail, BLOCK_B)
        else:
            start = _ragged_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, BLOCK_B)
    else:
        rows = N
        Nb = N
        start = _segment_start(seq_lens_ptr, b, N, rail, BLOCK_B, RAIL)
    if RAIL:
        L = rail_verify_prefix(L, rail)  # the block's prefix columns, min(L, w − 1)
    n_bits = tl.where(valid, rows * (L + Nb), 0)
    n = n_bits
    if PACKED:
        n = (n_bits + 7) // 8
    tree_ptr = tree_mask_ptr + tl.where(valid, b, 0) * stride_mb
    inv_cols = 1.0 / tl.maximum(L + Nb, 1).to(tl.float64)  # Nb = 0: no element is live

    # The loop covers only what the buffer can hold: a garbage length (2**40) costs no more than
    # a full buffer, and is reported (OUT_OF_CAPACITY, below).
    n_fit = tl.minimum(n, tl.minimum(tl.maximum(W_mask - start, 0), W_mask))
    offs = tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    cols = tl.maximum(L + Nb, 1)
    for chunk in range(c, tl.cdiv(n_fit, BLOCK), chunk_programs):
        first = b * 0 + chunk * BLOCK  # the chunk's first output, an int64 scalar
        bit0 = first * 8 if PACKED else first  # and its first mask element
        j0 = bit0 // cols  # one scalar division a chunk
        col0 = bit0 - j0 * cols
        if (col0 + BLOCK * (8 if PACKED else 1) <= L) & (j0 < rows):
            # Inside one row's prefix columns: every element 1, nothing to compute; under the
            # rail, those from the row's first seen column on (one depth a chunk).
            if RAIL:
                first_seen = _first_seen_column(tree_ptr, valid, j0, L, Nb, stride_mj, rail)
                if PACKED:
                    seen = (col0 + offs[:, None] * 8 + k[None, :] >= first_seen).to(tl.int32)
                    v = tl.sum(seen << k[None, :], axis=1)
                else:
                    v = (col0 + offs >= first_seen).to(tl.int32)
            else:
                v = tl.full([BLOCK], 255 if PACKED else 1, tl.int32)
        elif PACKED:  # byte e holds elements 8e … 8e + 7, element 8e + k at bit k
            bits = _chunk_values(tree_ptr, valid, bit0, j0, col0, offs[:, None] * 8 + k[None, :],
                                 n_bits, L, Nb, stride_mj, inv_cols, rail, SPAN=BLOCK * 8,
                                 RAIL=RAIL)  # fmt: skip
            v = tl.sum(bits << k[None, :], axis=1)
        else:
            v = _chunk_values(tree_ptr, valid, bit0, j0, col0, offs, n_bits, L, Nb, stride_mj,
                              inv_cols, rail, SPAN=BLOCK, RAIL=RAIL)  # fmt: skip
        # n_fit keeps the stores in the segment and the buffer; int32 offsets from the chunk.
        here = tl.minimum(tl.maximum(n_fit - first, 0), BLOCK).to(tl.int32)
        tl.store(custom_mask_ptr + (start + first) + offs, v.to(tl.uint8), mask=offs < here)

    if c == 0:
        tl.store(mask_indptr_ptr + b + 1, start + n_bits, mask=valid)
        tl.store(mask_indptr_ptr + b, start * 0, mask=b == 0)
        if HAS_STATUS:
            flags = tl.where(L_ok, 0, POS_OOB) | tl.where(start + n > W_mask, OUT_OF_CAPACITY, 0)
            # A branch rather than a masked atomic: Triton 3.6 dropped the masked form here
            # when seq_lens is int64 (seen on an H200; the interpreter was right).
            if flags != 0:
                tl.atomic_or(status_ptr, flags, sem="relaxed")


_tree_custom_mask_launch = Launcher(_tree_custom_mask_kernel)


def _prepare(where, seq_lens, tree_mask, packed, custom_mask, mask_indptr, seq_lens_sum,
             verify_lens, status, sliding_window_size):  # fmt: skip
    validate.tensor("seq_lens", seq_lens, ndim=1)
    device = seq_lens.device
    B = seq_lens.shape[0]
    rail = check_window(where, sliding_window_size, None, device)
    if verify_lens is not None:
        check_verify_lens(where, verify_lens, B, device)
    validate.tensor("tree_mask", tree_mask, dtypes=(torch.bool,), ndim=3, device=device)
    N = tree_mask.shape[1]
    if tree_mask.shape != (B, N, N):
        raise ValueError(
            f"tree_mask must have shape [B, N, N] = [{B}, N, N], got {tuple(tree_mask.shape)}"
        )
    if not isinstance(packed, bool):
        raise TypeError(f"packed must be a bool, got {type(packed).__name__}")
    out_dtype = torch.uint8 if packed else torch.bool
    if custom_mask is None:
        if seq_lens_sum is None:
            raise ValueError("tree_custom_mask needs custom_mask or seq_lens_sum to size the mask")
        need = rail_mask_need(seq_lens_sum, B, N, rail)
        custom_mask = torch.empty(max(1, need), dtype=out_dtype, device=device)
    if mask_indptr is None:
        mask_indptr = torch.empty(B + 1, dtype=torch.int32, device=device)
    validate.tensor("custom_mask", custom_mask, dtypes=(out_dtype,), ndim=1, device=device)
    validate.tensor("mask_indptr", mask_indptr, ndim=1, device=device)
    validate.at_least("mask_indptr", mask_indptr.shape[0], B + 1, "entries (B + 1)")
    if seq_lens_sum is not None:
        _check_total(seq_lens_sum, custom_mask, B, N, packed, rail)
    status = validate.status(status, device)
    return B, N, custom_mask, mask_indptr, status, rail


def _check_total(seq_lens_sum: object, custom_mask: torch.Tensor, B: int, N: int, packed: bool,
                 rail: int):  # fmt: skip
    """``custom_mask`` holds the whole mask ``seq_lens_sum`` (the host's ``ΣL``) makes."""
    host_int("seq_lens_sum", seq_lens_sum)
    need = rail_mask_need(seq_lens_sum, B, N, rail)
    what = "bytes (N*ΣL + B*N²)" if packed else "elements (N*ΣL + B*N²)"
    what = what.replace("ΣL", "Σmin(L, w-1)") if rail else what
    validate.at_least("custom_mask", custom_mask.shape[0], need, what)


def bind_tree_custom_mask(
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    packed: bool = False,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
) -> Stage:
    """Bind once: build FlashInfer's flat verify mask (or its packed-bit form) in one launch.

    Parameters
    ----------
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_i``.
    tree_mask : torch.Tensor
        ``[B, N, N]`` bool, ``tree_mask[i, j, c]`` iff ``c == j`` or ``c`` is an ancestor of
        ``j`` (unit stride in the last dimension).
    packed : bool
        ``False``: one bool per element. ``True``: eight elements a byte, little-endian bit
        order, each request's segment padded to a whole byte and starting at byte
        ``mask_indptr[i]`` (its element offset: what FlashInfer 0.7's ``plan()`` reads).
    custom_mask : torch.Tensor, optional
        ``[W_mask]`` bool (or uint8 when ``packed``); stores past ``W_mask`` are dropped and
        reported. Allocated from ``seq_lens_sum`` when omitted (one of the two is required).
    mask_indptr : torch.Tensor, optional
        ``[≥ B + 1]`` int32 or int64: segment starts in elements (the same values, read as
        byte offsets, when ``packed``), entry 0 included.
    seq_lens_sum : int, optional
        Host-side ``ΣL``; when given, ``custom_mask`` is checked before launch (for the
        uniform ``N·ΣL + B·N²``, the bound of a ragged verify too).
    verify_lens : torch.Tensor, optional
        ``[B]`` int32 or int64 on the device: a ragged target verify (design §3.3). Request
        ``i`` verifies its first ``v_i`` nodes: its block is ``v_i × (L_i + v_i)`` (rows
        ``j < v_i``, prefix columns 1, tree columns ``tree_mask[i, j, :v_i]``), its segment
        starts at ``mask_indptr[i] = Σ_{i'<i} v_i'·(L_i' + v_i')``, packed by the same rule
        (whole bytes, at that element offset read as a byte offset). In a captured bucket, the
        padded lengths of ``pad_verify_lens_to_bucket``. ``None`` (the default): ``v_i = N``.
    status : torch.Tensor, optional
        ``int32 [1]``: ``POS_OOB`` (negative ``seq_lens`` or ``v_i``, read as 0),
        ``OUT_OF_CAPACITY``.
    sliding_window_size : int, optional
        A window layer's ``w`` (design §2.10): blocks over the clipped lists of
        ``verify_kv_indices(sliding_window_size=w)``, ``N × (min(L_i, w − 1) + N)``, each node
        seeing only what lies within ``w`` positions of it. With ``verify_lens``: ``v_i ×
        (min(L_i, w − 1) + min(v_i, N))`` blocks, the same rule over the first ``min(v_i,
        N)`` nodes (a node's depth counted over them), filler rows every column.

    Returns
    -------
    Stage
        Its result is ``(custom_mask, mask_indptr)`` (tuple of torch.Tensor), what the eager
        :func:`tree_custom_mask` returns.

    Examples
    --------
    ``seq_lens=[1]``, ``N=2``, root 0 with child 1 → rows ``[1, 1, 0]`` and ``[1, 1, 1]``:
    ``custom_mask=[1, 1, 0, 1, 1, 1]``, ``mask_indptr=[0, 6]``; packed: the byte
    ``0b111011 = 59`` at offset 0, ``mask_indptr=[0, 6]``. Ragged, ``seq_lens=[1, 2]``,
    ``verify_lens=[1, 2]`` and the same tree in both → ``[1, 1]`` then rows ``[1, 1, 1, 0]``,
    ``[1, 1, 1, 1]``: ``mask_indptr=[0, 2, 10]``; packed: ``3`` at byte 0, ``0b11110111 = 247``
    at byte 2.

    A padded ``v_i`` past ``N`` (a bucket's leftover, design §2.9) has ``v_i`` rows over its
    ``N`` nodes: block ``v_i × (L_i + N)``, rows ``j ≥ N`` filler rows, 1 in every column (they
    see what the request holds, so their attention stays finite). A ``v_i < 0`` is a fault,
    read as 0 and reported (``POS_OOB``); nothing is written past ``custom_mask[W_mask − 1]``
    or ``mask_indptr[B]``.

    Grid ``(max(B, 1), chunk_programs)``; every program finds its segment's start by summing
    ``seq_lens`` with vector loads. No host sync; ``B``, ``N`` and lengths are runtime arguments.
    """
    B, N, custom_mask, mask_indptr, status, rail = _prepare(
        "tree_custom_mask", seq_lens, tree_mask, packed, custom_mask, mask_indptr, seq_lens_sum,
        verify_lens, status, sliding_window_size,
    )  # fmt: skip
    device = seq_lens.device
    grid = (max(B, 1), max(1, cdiv(target_programs(device), max(B, 1))))
    launch = _tree_custom_mask_launch.bind(
        grid,
        seq_lens_ptr=seq_lens,
        verify_lens_ptr=verify_lens,
        tree_mask_ptr=tree_mask.view(torch.uint8),
        custom_mask_ptr=custom_mask.view(torch.uint8),
        mask_indptr_ptr=mask_indptr,
        status_ptr=status,
        B=B,
        N=N,
        stride_mb=tree_mask.stride(0),
        stride_mj=tree_mask.stride(1),
        W_mask=custom_mask.shape[0],
        chunk_programs=grid[1],
        rail=rail if rail else None,
        PACKED=packed,
        BLOCK=_BLOCK_PACKED if packed else _BLOCK,
        BLOCK_B=_BLOCK_B,
        HAS_VERIFY_LENS=verify_lens is not None,
        HAS_STATUS=True,
        RAIL=bool(rail),
        num_warps=4,
    )
    return Stage([launch], result=(custom_mask, mask_indptr))


tree_custom_mask = launcher(bind_tree_custom_mask)
tree_custom_mask.kernels = (_tree_custom_mask_kernel,)  # for specmeta.registry


def tree_custom_mask_ref(
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    packed: bool = False,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`tree_custom_mask` (vectorised over every element; syncs)."""
    B, N, custom_mask, mask_indptr, status, rail = _prepare(
        "tree_custom_mask_ref", seq_lens, tree_mask, packed, custom_mask, mask_indptr,
        seq_lens_sum, verify_lens, status, sliding_window_size,
    )  # fmt: skip
    device = seq_lens.device
    L = rail_verify_prefix_ref(seq_lens.to(torch.int64).clamp_min(0), rail)
    bits = 0
    rows = V = torch.full_like(L, N)  # rows and tree columns of each block
    anc = tree_mask.to(torch.int64)
    if verify_lens is not None:  # ragged verify: max(v_i, 0) rows over min(rows, N) nodes
        rows, V, bits = verify_rows_ref(verify_lens, N)
        anc = anc * (torch.arange(N, device=device) < V.view(-1, 1, 1))  # the block's columns
    n_bits = rows * (L + V)
    n = (n_bits + 7) // 8 if packed else n_bits  # elements written per request
    start = torch.cumsum(n_bits, 0) - n_bits
    mask_indptr[0] = 0
    mask_indptr[1 : B + 1] = (start + n_bits).to(mask_indptr.dtype)
    if B and bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    # Only what the buffer holds is built, as in the kernel: a garbage length costs no more.
    fit = torch.minimum(n, (custom_mask.shape[0] - start).clamp(0, custom_mask.shape[0]))
    if B and bool((fit < n).any()):
        bits |= int(Status.OUT_OF_CAPACITY)
    total = int(fit.sum()) if B else 0
    if total:
        req = torch.repeat_interleave(torch.arange(B, device=device), fit)
        e = torch.arange(total, device=device) - (torch.cumsum(fit, 0) - fit)[req]
        if packed:
            bit = e.view(-1, 1) * 8 + torch.arange(8, device=device).view(1, 8)
            req_b = req.view(-1, 1).expand_as(bit)
        else:
            bit, req_b = e, req
        cols = (L + V)[req_b]
        j, col = bit // cols, bit % cols
        prefix_len = L[req_b]
        live = bit < n_bits[req_b]
        tree = tree_mask[req_b, j.clamp_max(N - 1), (col - prefix_len).clamp(0, N - 1)]
        filler = j >= V[req_b]  # a padded request's rows past its nodes: every column
        val = live & ((col < prefix_len) | filler | tree)
        if rail:  # what lies within w positions of node j (design §2.10)
            after = anc.flip(2).cumsum(2).flip(2)  # [b, j, c]: ancestors-or-self at or after c
            rows_j, cols_c = j.clamp_max(N - 1), (col - prefix_len).clamp(0, N - 1)
            depth = anc.sum(2)[req_b, rows_j] - 1
            near = torch.where(col < prefix_len, col >= prefix_len + depth + 1 - rail,
                               after[req_b, rows_j, cols_c] <= rail)  # fmt: skip
            val = val & (near | filler)
        if packed:
            val = (val.to(torch.int64) << torch.arange(8, device=device)).sum(1)
        custom_mask[start[req] + e] = val.to(custom_mask.dtype)
    if bits:
        status |= bits
    return custom_mask, mask_indptr
