"""Ragged page-size-1 KV lists of target verify and draft extend (design §3.3).

Request ``b`` reads its prefix and the ``extra_tokens`` (``N``) slots that follow it::

    kv_indptr[b]                  = Σ_{b'<b} (L_b' + extra)      for b in [0, B], entry 0 included
    kv_indices[kv_indptr[b] + k]  = row_b[k]                     for k < L_b + extra

A ragged target verify (``verify_lens``, design §3.3) reads only the first ``v_b ≤ N`` slots of
each window, ``extra`` becoming the per-request ``v_b``::

    kv_indptr[b]                  = Σ_{b'<b} (L_b' + v_b')
    kv_indices[kv_indptr[b] + k]  = row_b[k]                     for k < L_b + v_b

For target verify the extra slots are the verify window (node ``j`` at ``row_b[L_b + j]``); for
draft extend they are the extend tokens. With ``extra_tokens=0`` the same lists are the shared
level of the cascade draft decode (see :mod:`specmeta.kernels.shared_prefix_kv_indices`); both
kernels copy their lists with :func:`~specmeta.kernels._common.copy_list_at`, ids read in the
row's id space (design §2.10).

A sliding-window layer (``sliding_window_size = w``, design §2.10) clips each list to the
positions its queries read: request ``b``'s list starts at ``f_b = max(0, L_b − w + 1)``, the
earliest position its first query row (at ``L_b``) reads, so it holds ``min(L_b, w − 1) +
extra`` entries, and ``full_to_swa`` emits every id in window-pool ids::

    kv_indptr[b]                  = Σ_{b'<b} (min(L_b', w − 1) + extra)
    kv_indices[kv_indptr[b] + k]  = full_to_swa[row_b[f_b + k]]   for k < min(L_b, w − 1) + extra

A window layer's ragged verify clips each ragged list the same way (its first query row is at
``L_b`` whatever ``v_b`` is): ``extra`` becomes ``min(max(v_b, 0), N)``, the list
``row_b[f_b : L_b + min(v_b, N)]`` of ``min(L_b, w − 1) + min(v_b, N)`` entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    check_batch,
    check_id_spaces,
    check_verify_lens,
    chunk_programs,
    copy_list_at,
    exclusive_length_sum,
    host_int,
    load_request,
    load_verify_rows,
    ragged_prefix_ref,
    sizing_total,
    verify_rows_ref,
)
from ._window import (
    check_window,
    copy_window_list,
    exclusive_rail_sum,
    rail_verify_need,
    rail_verify_prefix,
    rail_verify_prefix_ref,
    window_arguments,
    window_lists_ref,
)

__all__ = [
    "bind_verify_kv_indices",
    "verify_kv_indices",
    "verify_kv_indices_ref",
    "exclusive_length_sum",
]


# Entries one program copies per iteration: 1024 int32 keep 8 elements a thread in flight at
# 4 warps, enough to saturate the store path (as in draft_decode_kv_indices).
_BLOCK = 1024
# seq_lens entries summed per iteration of the exclusive-prefix loop (one load up to B = 1024).
_BLOCK_B = 1024


@triton.jit
def _exclusive_window_sum(seq_lens_ptr, verify_lens_ptr, b, N, rail, BLOCK_B: tl.constexpr,
                          WINDOW_LAYER: tl.constexpr):  # fmt: skip
    """``Σ_{b'<b} (max(L_b', 0) + v_b')`` in int64, each ``v_b'`` clamped to ``[0, N]`` as
    :func:`~specmeta.kernels._common.load_verify_rows` reads it: the start of request ``b``'s
    list in a ragged verify, from whole-vector loads of both length arrays. A window layer
    (``WINDOW_LAYER``) sums each prefix as the rail ``w`` clips it, ``min(L_b', w − 1)``
    (design §2.10)."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        L = tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64)
        if WINDOW_LAYER:
            L = rail_verify_prefix(tl.maximum(L, 0), rail)
        v = tl.load(verify_lens_ptr + offs, mask=before, other=0).to(tl.int64)
        v = tl.minimum(tl.maximum(v, 0), N)
        cum += tl.sum(tl.where(before, tl.maximum(L, 0) + v, 0), axis=0)
    return cum


@triton.jit(
    do_not_specialize=["B", "R", "W_row", "stride_row", "extra_tokens", "W_idx", "chunk_programs",
                       "num_pages", "page_size", "full_size", "rail"]
)  # fmt: skip
def _verify_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    verify_lens_ptr,  # [B] int32|int64, or None (uniform: every request reads extra_tokens)
    kv_indices_ptr,  # [W_idx] int32|int64
    kv_indptr_ptr,  # [≥B+1] int32|int64
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64 (read only with TO_WINDOW)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    extra_tokens,
    W_idx,
    chunk_programs,
    num_pages,
    page_size,
    full_size,
    rail,  # the window read rail w, 0 for none (None for a full layer: read only with WINDOW_LAYER)
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_VERIFY_LENS: tl.constexpr,  # verify_lens_ptr is a tensor: lists of L_b + v_b entries
    ENTRY_PAGE_SIZE: tl.constexpr,
    TRANSLATE: tl.constexpr,
    TO_WINDOW: tl.constexpr,
    WINDOW_LAYER: tl.constexpr,  # a rail or a map: the lists of design §2.10's window layers
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` copies chunks ``c, c +
    chunk_programs, …`` of request ``b``'s list; ``(b, 0)`` also writes ``kv_indptr[b + 1]``
    (and entry 0 from ``b = 0``) and the status."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    n = tl.where(b < B, L + extra_tokens, 0)
    if HAS_VERIFY_LENS:
        # Ragged verify: request b reads the first min(v_b, N) window slots (N = extra_tokens;
        # a padded length past N adds filler query rows, no slots); v_b < 0 reads as 0 and is
        # reported (POS_OOB, below).
        _, v, v_ok = load_verify_rows(verify_lens_ptr, b, B, extra_tokens)
        n = tl.where(b < B, L + v, 0)
        start = _exclusive_window_sum(seq_lens_ptr, verify_lens_ptr, b, extra_tokens, rail,
                                      BLOCK_B, WINDOW_LAYER)  # fmt: skip
        L_ok = L_ok & v_ok
    elif WINDOW_LAYER:
        start = exclusive_rail_sum(seq_lens_ptr, b, extra_tokens, rail, BLOCK_B)
    else:
        start = exclusive_length_sum(seq_lens_ptr, b, extra_tokens, BLOCK_B)
    # Ids read as the row and the id space say (design §2.10).
    if WINDOW_LAYER:
        # The list starts at f = L − min(L, w − 1) (0 without a rail), a ragged one too.
        first = L - rail_verify_prefix(L, rail)
        n = tl.where(b < B, n - first, 0)
        bad = copy_window_list(req_to_token_ptr, row_base, row_ok, first, n, b, B, start, W_row,
                               kv_indices_ptr, kv_indptr_ptr, W_idx, c, chunk_programs, v2p_ptr,
                               num_pages, page_size, full_to_swa_ptr, full_size, BLOCK,
                               ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        n = n + first  # the last position read, for POS_OOB
    else:
        bad = copy_list_at(req_to_token_ptr, row_base, row_ok, n, b, B, start, W_row,
                           kv_indices_ptr, kv_indptr_ptr, W_idx, c, chunk_programs, v2p_ptr,
                           num_pages, page_size, BLOCK, ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
        first = n * 0
    if HAS_STATUS:
        bits = tl.where(bad != 0, BAD_KV_ID, 0)
        if c == 0:
            bits |= (
                tl.where(row_ok, 0, ROW_OOB)
                | tl.where((n > W_row * ENTRY_PAGE_SIZE) | ~L_ok, POS_OOB, 0)
                | tl.where(start + n - first > W_idx, OUT_OF_CAPACITY, 0)
            )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_verify_kv_indices_launch = Launcher(_verify_kv_indices_kernel)


def _prepare(where, req_pool_indices, req_to_token, seq_lens, extra_tokens, kv_indices,
             kv_indptr, seq_lens_sum, verify_lens, status, entry_page_size, v2p,
             page_size, sliding_window_size, full_to_swa):  # fmt: skip
    extra_tokens = validate.positive("extra_tokens", extra_tokens, minimum=0)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    rail = check_window(where, sliding_window_size, full_to_swa, device)
    validate.positive("page_size", page_size)
    if verify_lens is not None:
        check_verify_lens(where, verify_lens, B, device)
    if kv_indices is None:
        total = sizing_total(seq_lens_sum, B, req_to_token)
        width = max(1, rail_verify_need(total, B, extra_tokens, rail))
        kv_indices = torch.empty(width, dtype=req_to_token.dtype, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty(B + 1, dtype=torch.int32, device=device)
    validate.tensor("kv_indices", kv_indices, ndim=1, device=device)
    validate.tensor("kv_indptr", kv_indptr, ndim=1, device=device)
    validate.at_least("kv_indptr", kv_indptr.shape[0], B + 1, "entries (B + 1)")
    if seq_lens_sum is not None:
        _check_total(seq_lens_sum, kv_indices, B, extra_tokens, rail)
    status = validate.status(status, device)
    return extra_tokens, B, kv_indices, kv_indptr, status, rail


def _check_total(seq_lens_sum: object, kv_indices: torch.Tensor, B: int, extra_tokens: int,
                 rail: int):  # fmt: skip
    """``kv_indices`` holds every entry ``seq_lens_sum`` (the host's ``ΣL``) makes."""
    host_int("seq_lens_sum", seq_lens_sum)
    need = rail_verify_need(seq_lens_sum, B, extra_tokens, rail)
    what = "entries (Σmin(L, w-1) + B*extra)" if rail else "entries (ΣL + B*extra)"
    validate.at_least("kv_indices", kv_indices.shape[0], need, what)


def bind_verify_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    extra_tokens: int,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> Stage:
    """Bind once: build every request's list ``row_b[0 : L_b + extra]`` and its CSR offsets, in one
    launch.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    extra_tokens : int
        Slots after the prefix each request reads: ``N`` for target verify and draft extend,
        0 for the shared prefix of a cascade. With ``verify_lens``, the upper bound ``N`` of
        every ``v_b`` (the buffers stay sized for ``L_b + N``).
    kv_indices : torch.Tensor, optional
        ``[W_idx]`` int32 or int64; ``ΣL + B·extra`` entries are written, stores past ``W_idx``
        are dropped and reported. Allocated (``req_to_token``'s dtype) when omitted.
    kv_indptr : torch.Tensor, optional
        ``[≥ B + 1]`` int32 or int64; entries ``0 … B`` are written, entry 0 included.
    seq_lens_sum : int, optional
        Host-side ``ΣL``; when given, ``kv_indices`` is checked before launch (for
        ``ΣL + B·extra`` entries, the bound of a ragged verify too).
    verify_lens : torch.Tensor, optional
        ``[B]`` int32 or int64 on the device: a ragged target verify (design §3.3). Request
        ``b`` reads the first ``v_b`` slots of its window: its list is ``row_b[0 : L_b + v_b]``
        and ``kv_indptr = [0, cumsum(L + v)]``. In a captured bucket, the padded lengths of
        ``pad_verify_lens_to_bucket``. ``None`` (the default): every request reads
        ``extra_tokens`` slots, as without ragged verify.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (a list runs past ``W_row``, ``L < 0`` or
        ``v_b < 0``), ``OUT_OF_CAPACITY``, ``BAD_KV_ID``.
    entry_page_size, v2p, page_size
        The rows' id space (design §2.10): page ids with ``entry_page_size > 1``, virtual ids
        emitted through the page map ``v2p`` at page size ``page_size``.
    sliding_window_size, full_to_swa
        A window layer (design §2.10): each list starts at ``max(0, L_b − w + 1)``
        (``min(L_b, w − 1) + extra`` entries, offsets alike), and ``full_to_swa`` (``[P_full]``,
        ``-1`` where evicted) emits every id in window-pool ids. With ``verify_lens`` each
        list starts there too: ``min(L_b, w − 1) + min(v_b, N)`` entries.

    Returns
    -------
    Stage
        Its result is ``(kv_indices, kv_indptr)`` (tuple of torch.Tensor), what the eager
        :func:`verify_kv_indices` returns.

    Notes
    -----
    A padded ``v_b`` past ``N = extra_tokens`` (a bucket's leftover, design §2.9) lists the
    request's ``N`` window slots: its rows past ``N`` are filler queries over the same keys
    (``tree_custom_mask`` gives them every column). A ``v_b < 0`` is a fault, read as 0 and
    reported (``POS_OOB``); nothing is written past ``kv_indices[W_idx − 1]`` or
    ``kv_indptr[B]``.

    Examples
    --------
    ``seq_lens=[3, 1]``, ``extra_tokens=2`` → ``kv_indptr=[0, 5, 8]``,
    ``kv_indices=[r0[0], …, r0[4], r1[0], r1[1], r1[2]]``; with ``verify_lens=[0, 2]`` →
    ``kv_indptr=[0, 3, 6]``, ``kv_indices=[r0[0], r0[1], r0[2], r1[0], r1[1], r1[2]]``.

    Grid ``(max(B, 1), chunk_programs)``; every program finds its offset by summing
    ``seq_lens`` with vector loads. No host sync; ``B``, lengths and strides are runtime
    arguments.
    """
    extra_tokens, B, kv_indices, kv_indptr, status, rail = _prepare(
        "verify_kv_indices", req_pool_indices, req_to_token, seq_lens, extra_tokens, kv_indices,
        kv_indptr, seq_lens_sum, verify_lens, status, entry_page_size, v2p, page_size,
        sliding_window_size, full_to_swa,
    )  # fmt: skip
    device = req_to_token.device
    grid = (max(B, 1), chunk_programs(device, B, req_to_token.shape[1], _BLOCK))
    window_layer = bool(rail) or full_to_swa is not None  # a full layer's launch as before
    launch = _verify_kv_indices_launch.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        verify_lens_ptr=verify_lens,
        kv_indices_ptr=kv_indices,
        kv_indptr_ptr=kv_indptr,
        v2p_ptr=v2p if v2p is not None else kv_indptr,
        **window_arguments(full_to_swa),
        rail=rail if window_layer else None,
        status_ptr=status,
        extra_tokens=extra_tokens,
        W_idx=kv_indices.shape[0],
        chunk_programs=grid[1],
        num_pages=v2p.shape[0] if v2p is not None else 0,
        page_size=page_size,
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        HAS_VERIFY_LENS=verify_lens is not None,
        ENTRY_PAGE_SIZE=entry_page_size,
        TRANSLATE=v2p is not None,
        WINDOW_LAYER=window_layer,
        HAS_STATUS=True,
        num_warps=4,
    )
    return Stage([launch], result=(kv_indices, kv_indptr))


verify_kv_indices = launcher(bind_verify_kv_indices)
verify_kv_indices.kernels = (_verify_kv_indices_kernel,)  # for specmeta.registry


def verify_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    extra_tokens: int,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`verify_kv_indices` (vectorised over the batch; syncs)."""
    extra_tokens, B, kv_indices, kv_indptr, status, rail = _prepare(
        "verify_kv_indices_ref", req_pool_indices, req_to_token, seq_lens, extra_tokens,
        kv_indices, kv_indptr, seq_lens_sum, verify_lens, status, entry_page_size, v2p,
        page_size, sliding_window_size, full_to_swa,
    )  # fmt: skip
    n = seq_lens.to(torch.int64).clamp_min(0) + extra_tokens
    bits = 0
    if verify_lens is not None:  # ragged verify: min(max(v_b, 0), N) window slots
        _, v, bits = verify_rows_ref(verify_lens, extra_tokens)
        n = n - extra_tokens + v
    L = seq_lens.to(torch.int64).clamp_min(0)
    first = L - rail_verify_prefix_ref(L, rail)  # a window layer's lists start there
    n = n - first
    end = torch.cumsum(n, 0)
    kv_indptr[0] = 0
    kv_indptr[1 : B + 1] = end.to(kv_indptr.dtype)
    read = dict(entry_page_size=entry_page_size, v2p=v2p, page_size=page_size)
    if rail or full_to_swa is not None:
        bits |= window_lists_ref(req_pool_indices, req_to_token, first, n, kv_indices, end - n,
                                 full_to_swa=full_to_swa, **read)  # fmt: skip
    else:
        bits |= ragged_prefix_ref(req_pool_indices, req_to_token, n, kv_indices, end - n, **read)
    if B and bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    if B and int(end[-1]) > kv_indices.shape[0]:
        bits |= int(Status.OUT_OF_CAPACITY)
    if bits:
        status |= bits
    return kv_indices, kv_indptr
