"""The FA3 expand pass of a ragged target verify (design §2.9, §3.2): one row per query token.

In a ragged verify the query tokens of request ``i`` are rows ``qo_indptr[i] + j``,
``j < v_i = qo_indptr[i + 1] − qo_indptr[i]`` (the lengths padded to the bucket, so
``qo_indptr[B] = T``); its tree nodes are its first ``V_i = min(v_i, N)`` rows, and rows
``j ≥ N`` are filler rows of the bucket's padding. Every query row is its own sequence of the
expand pass, listing the verify-window slots it may see beyond the shared prefix::

    r = qo_indptr[i] + j
    page_table[r, k]   = row_i[L_i + c_k]   j < V_i: c_0 < c_1 < … the columns c < V_i with
                                            m[i, j, c] (ancestors and itself), then the other
                                            columns c < V_i
                                            j ≥ N (filler): c_k = k for k < V_i
    page_table[r, k]   = 0                  V_i ≤ k < W
    cache_seqlens[r]   = Σ_{c<V_i} m[i, j, c]    (V_i for a filler row)
    cu_seqlens_k[r]    = Σ_{r'<r} cache_seqlens[r']         r in [0, T]

The tree is ``tree_mask`` (``[B, N, N]``), or a chain (``m[i, j, c] = c ≤ j``) when it is
``None``: a ragged verify is a cascade for every ``K``, since a causal pass over ``L + v``
keys would shift the real rows of a request with filler rows. Rows ``[qo_indptr[B], T)``
belong to no request and are written empty, so every row of the bucket is defined. The table
holds token slots: the consumer reads it with a page-size-1 view of the KV cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POOL_OOB,
    POS_OOB,
    ROW_OOB,
    ancestor_order,
    batch_arguments,
    check_batch,
    check_expand_outputs,
    check_id_spaces,
    gather_rows_ref,
    host_int,
    id_space_arguments,
    load_request,
    window_slots,
)
from ._window import (
    check_tree_depth,
    check_window,
    load_window_ids,
    load_window_ids_ref,
    tree_prefix_start,
    window_arguments,
    window_tree_expand_width,
    window_tree_row_ref,
    window_tree_rows,
)
from .verify_expand_page_table import bind_inclusive_sums, inclusive_sums_kernel

__all__ = ["bind_verify_expand_ragged", "verify_expand_ragged", "verify_expand_ragged_ref"]

# Filler rows (or rows of no request) written per loop iteration.
_BLOCK_F = 16


@triton.jit
def _empty_rows(page_table_ptr, cache_seqlens_ptr, first, last, T, W, stride_pt,
                BLOCK_F: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """Rows ``[first, last)`` within ``[0, T)``: an empty list (``cache_seqlens`` 0, every
    column 0, the sink)."""
    for f0 in range(first, last, BLOCK_F):
        r = f0 + tl.arange(0, BLOCK_F)[:, None]
        ok = (r < last) & (r >= 0) & (r < T)
        for w0 in range(0, W, BLOCK_W):
            k = w0 + tl.arange(0, BLOCK_W)[None, :]
            tl.store(page_table_ptr + r * stride_pt + k, 0 * r + 0 * k, mask=ok & (k < W))
        tl.store(cache_seqlens_ptr + r, 0 * r, mask=ok)


@triton.jit(
    do_not_specialize=["B", "R", "W_row", "stride_row", "N", "W", "T", "stride_pt", "stride_mb",
                       "stride_mj", "num_pages", "page_size", "full_size", "rail", "depth",
                       "band_max"]
)  # fmt: skip
def _verify_expand_ragged_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    qo_indptr_ptr,  # [B + 1] int32|int64: request i's rows qo_indptr[i] … qo_indptr[i+1] − 1
    tree_mask_ptr,  # [B, N, N] uint8 (bool viewed as bytes), or unused for a chain
    page_table_ptr,  # [≥ T, W] int32|int64, row stride stride_pt
    cache_seqlens_ptr,  # [≥ T] int32|int64
    cu_seqlens_k_ptr,  # [≥ T + 1] int32|int64: entry 0 only (unless WRITE_CU0)
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE), or None
    status_ptr,  # [1] int32
    B,
    R,
    W_row,
    stride_row,
    N,
    W,
    T,  # rows of the bucket: every row [0, T) is written, none past it
    stride_pt,
    stride_mb,
    stride_mj,
    num_pages,  # v2p's pages (None unless TRANSLATE)
    page_size,  # the pool's page size (None unless TRANSLATE or WINDOW_LAYER)
    full_to_swa_ptr,  # [full_size] int32|int64 full -> window pool map (read with TO_WINDOW)
    full_size,
    rail,  # a window layer's w (read with WINDOW_LAYER)
    depth,  # its tree cascade's depth bound D (read with WINDOW_LAYER)
    band_max,  # D + 2·ps − 2: the longest band of prefix positions a row lists (WINDOW_LAYER)
    BLOCK_N: tl.constexpr,  # next power of two ≥ N
    BLOCK_W: tl.constexpr,  # columns per store tile past the window
    BLOCK_F: tl.constexpr,  # filler rows per iteration
    CHAIN: tl.constexpr,  # no tree mask: node j's ancestors are the nodes c ≤ j
    WRITE_CU0: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,  # E > 1: rows of page ids (design §2.10)
    TRANSLATE: tl.constexpr,  # ids leave through v2p
    WINDOW_LAYER: tl.constexpr,  # a window layer's rows (design §2.10): window_tree_rows
    TO_WINDOW: tl.constexpr,  # ids leave through full_to_swa
    BLOCK_P: tl.constexpr,  # band positions per chunk (WINDOW_LAYER)
):
    """Grid ``(B + 1,)``: program ``i < B`` writes request ``i``'s rows (its ``V × V`` tile of
    the mask, then its filler rows); program ``B`` writes the rows of no request,
    ``[qo_indptr[B], T)``."""
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(qo_indptr_ptr + i).to(tl.int64)
    if i == B:  # the rows after the last request's
        _empty_rows(page_table_ptr, cache_seqlens_ptr, tl.maximum(start, 0), T, T, W, stride_pt,
                    BLOCK_F, BLOCK_W)  # fmt: skip
        if WRITE_CU0:
            tl.store(cu_seqlens_k_ptr + i * 0, i * 0)
        bad_end = tl.where(start > T, OUT_OF_CAPACITY, 0) | tl.where(start < 0, POS_OOB, 0)
        tl.atomic_or(status_ptr, bad_end, mask=bad_end != 0, sem="relaxed")
    else:
        end = tl.load(qo_indptr_ptr + i + 1).to(tl.int64)
        _request_rows(req_pool_indices_ptr, req_to_token_ptr, seq_lens_ptr, tree_mask_ptr,
                      page_table_ptr, cache_seqlens_ptr, v2p_ptr, status_ptr, i, start, end, B,
                      R, W_row, stride_row, N, W, T, stride_pt, stride_mb, stride_mj, num_pages,
                      page_size, full_to_swa_ptr, full_size, rail, depth, band_max, BLOCK_N,
                      BLOCK_W, BLOCK_F, CHAIN, ENTRY_PAGE_SIZE, TRANSLATE, WINDOW_LAYER,
                      TO_WINDOW, BLOCK_P)  # fmt: skip


@triton.jit
def _request_rows(req_pool_indices_ptr, req_to_token_ptr, seq_lens_ptr, tree_mask_ptr,
                  page_table_ptr, cache_seqlens_ptr, v2p_ptr, status_ptr, i, start, end, B, R,
                  W_row, stride_row, N, W, T, stride_pt, stride_mb, stride_mj, num_pages,
                  page_size, full_to_swa_ptr, full_size, rail, depth, band_max,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr,
                  CHAIN: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
                  WINDOW_LAYER: tl.constexpr, TO_WINDOW: tl.constexpr,
                  BLOCK_P: tl.constexpr):  # fmt: skip
    """Request ``i``'s rows ``start … end − 1``: its ``V × V`` tile of the mask, then its
    filler rows, and its status bits."""
    rows = tl.maximum(end - start, 0)
    V = tl.minimum(rows, N)  # the tree nodes this request verifies
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, i, B, R, stride_row
    )
    jj = tl.arange(0, BLOCK_N)[:, None]  # node j: query row
    cc = tl.arange(0, BLOCK_N)[None, :]  # column c: tree node whose slot may be read
    in_tile = (jj < V) & (cc < V)
    if CHAIN:
        m = in_tile & (cc <= jj)
    else:
        m = tl.load(tree_mask_ptr + i * stride_mb + jj * stride_mj + cc, mask=in_tile, other=0)
        m = in_tile & (m != 0)
    pos, cnt = ancestor_order(m, cc)  # rank of column c in row j; keys of node j

    c = tl.arange(0, BLOCK_N)
    want = c < V  # the window slots read
    r = start + jj  # the node rows
    ok = (jj < V) & (r >= 0) & (r < T)
    if WINDOW_LAYER:
        # A window layer (design §2.10): each row its band of prefix positions below the
        # normal pass, then its ancestors within the window; a filler row is a node whose
        # ancestors are all V nodes. Ids through the map.
        slot, in_row, bad = load_window_ids(req_to_token_ptr + row_base, L + c,
                                            tl.where(row_ok, want, False), W_row, v2p_ptr,
                                            num_pages, page_size, full_to_swa_ptr, full_size,
                                            ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        neg = want & ~bad & (slot < 0)
        slot = tl.where(neg, 0, slot)
        past = want & ~in_row
        p0 = tree_prefix_start(L, rail, depth, page_size)
        counts, b_past, b_bad, b_neg = window_tree_rows(
            page_table_ptr, r, ok, m, pos, cnt, slot, L, p0, rail, band_max, W, stride_pt,
            req_to_token_ptr + row_base, row_ok, W_row, v2p_ptr, num_pages, page_size,
            full_to_swa_ptr, full_size, BLOCK_P, BLOCK_W, ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
        )  # fmt: skip
        rc = start + c
        tl.store(cache_seqlens_ptr + rc, counts, mask=(c < V) & (rc >= 0) & (rc < T))
        for f0 in range(N, rows, BLOCK_F):
            jf = f0 + tl.arange(0, BLOCK_F)[:, None]
            rf = start + jf
            okf = (jf < rows) & (rf >= 0) & (rf < T)
            mf = okf & (cc < V)
            f_counts, f_past, f_bad, f_neg = window_tree_rows(
                page_table_ptr, rf, okf, mf, cc + 0 * jf, tl.sum(mf.to(tl.int32), axis=1),
                slot, L, p0, rail, band_max, W, stride_pt, req_to_token_ptr + row_base, row_ok,
                W_row, v2p_ptr, num_pages, page_size, full_to_swa_ptr, full_size, BLOCK_P,
                BLOCK_W, ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
            )  # fmt: skip
            tl.store(cache_seqlens_ptr + start + f0 + tl.arange(0, BLOCK_F), f_counts,
                     mask=tl.sum(okf.to(tl.int32), axis=1) != 0)  # fmt: skip
            b_past |= f_past
            b_bad |= f_bad
            b_neg |= f_neg
        past = past | b_past
        bad = bad | b_bad
        neg = neg | b_neg
    else:
        # The slots in the row's id space (design §2.10); the table lists each translated id.
        slot, past, neg, bad = window_slots(req_to_token_ptr, row_base, row_ok, L, want,
                                            W_row, v2p_ptr, num_pages, page_size, BLOCK_N,
                                            ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip

        tl.store(page_table_ptr + r * stride_pt + pos, slot[None, :] + 0 * pos, mask=ok & in_tile)
        for w0 in range(0, W, BLOCK_W):  # columns [V, W) of the node rows
            k = w0 + tl.arange(0, BLOCK_W)[None, :]
            tl.store(page_table_ptr + r * stride_pt + k, 0 * r + 0 * k,
                     mask=ok & (k >= V) & (k < W))  # fmt: skip
        rc = start + c
        tl.store(cache_seqlens_ptr + rc, cnt, mask=(c < V) & (rc >= 0) & (rc < T))

        # Filler rows j ≥ N: every node of the window, in order.
        for f0 in range(N, rows, BLOCK_F):
            jf = f0 + tl.arange(0, BLOCK_F)[:, None]
            rf = start + jf
            okf = (jf < rows) & (rf >= 0) & (rf < T)
            tl.store(page_table_ptr + rf * stride_pt + cc, slot[None, :] + 0 * rf,
                     mask=okf & (cc < V))  # fmt: skip
            for w0 in range(0, W, BLOCK_W):
                k = w0 + tl.arange(0, BLOCK_W)[None, :]
                tl.store(page_table_ptr + rf * stride_pt + k, 0 * rf + 0 * k,
                         mask=okf & (k >= V) & (k < W))  # fmt: skip
            tl.store(cache_seqlens_ptr + rf, V + 0 * rf, mask=okf)

    pos_bad = tl.max(past.to(tl.int32), axis=0) != 0
    # Only emitted ids count (design §2.10): the slots reach the table only when a row of
    # the request lies in [0, T).
    emitted = (start < T) & (start + rows > 0)
    bad_id = tl.max(bad.to(tl.int32), axis=0) != 0
    bits = (
        tl.where(row_ok, 0, ROW_OOB)
        | tl.where(pos_bad | ~L_ok | (start < 0) | (end < start), POS_OOB, 0)
        | tl.where(tl.max(neg.to(tl.int32), axis=0) != 0, POOL_OOB, 0)
        | tl.where(start + rows > T, OUT_OF_CAPACITY, 0)
        | tl.where(bad_id & emitted, BAD_KV_ID, 0)
    )
    tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_verify_expand_ragged_launch = Launcher(_verify_expand_ragged_kernel)


def _prepare(where, req_pool_indices, req_to_token, seq_lens, tree_mask, qo_indptr, num_rows,
             num_draft_tokens, page_table, cache_seqlens, cu_seqlens_k, status, entry_page_size,
             v2p, page_size, sliding_window_size=None, full_to_swa=None,
             tree_depth=None):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. Returns ``B``, ``N``,
    ``T``, the outputs and a window layer's ``(w, D)`` (``w = 0``: a full layer); every
    message names ``where``."""
    check_id_spaces(where, 0, 0, entry_page_size, v2p, getattr(req_to_token, "device", None))
    try:
        B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
        validate.positive("page_size", page_size)
        T = host_int("num_rows", num_rows)
        validate.tensor("qo_indptr", qo_indptr, ndim=1, device=device)
        validate.at_least("qo_indptr", qo_indptr.shape[0], B + 1, "entries (B + 1)")
        if tree_mask is None:
            N = validate.positive("num_draft_tokens", num_draft_tokens)
        else:
            validate.tensor("tree_mask", tree_mask, dtypes=(torch.bool, torch.uint8), ndim=3,
                            device=device)  # fmt: skip
            N = tree_mask.shape[1]
            if tree_mask.shape != (B, N, N) or N < 1:
                raise ValueError(f"tree_mask must have shape [B, N, N] = [{B}, N, N] with "
                                 f"N >= 1, got {tuple(tree_mask.shape)}")  # fmt: skip
            if num_draft_tokens is not None and num_draft_tokens != N:
                raise ValueError(f"num_draft_tokens={num_draft_tokens} disagrees with the "
                                 f"tree_mask's N = {N}; pass one of them")  # fmt: skip
        if T < 0:
            raise ValueError(f"num_rows must be >= 0, got {T}; pass the bucket's tokens T")
        rail = check_window(where, sliding_window_size, full_to_swa, device)
        if full_to_swa is not None and not rail:
            raise ValueError("full_to_swa was given without sliding_window_size; a window "
                             "layer's rows are listed by its window w (design §2.10): pass "
                             "sliding_window_size=w with the map")  # fmt: skip
        D = check_tree_depth(where, tree_depth, rail, N - 1)
        # A window layer's rows hold a band of prefix positions too (design §2.10).
        cols = window_tree_expand_width(D, page_size) if rail else N
        if rail and page_table is not None and page_table.shape[-1] < cols:
            raise ValueError(
                f"page_table has {page_table.shape[-1]} columns; a window layer's rows "
                f"(sliding_window_size={rail}, tree_depth={D}, page_size={page_size}) list up to "
                f"D + 2*page_size - 1 = {cols} keys: pass at least {cols} (design §2.10)"
            )
        page_table, cache_seqlens = check_expand_outputs(page_table, cache_seqlens,
                                                         cu_seqlens_k, T, cols, device,
                                                         "num_rows")  # fmt: skip
        status = validate.status(status, device)
    except TypeError as err:
        raise TypeError(f"{where}: {err}") from None
    except ValueError as err:
        msg = str(err)
        raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    return B, N, T, page_table, cache_seqlens, status, (rail, D)


def bind_verify_expand_ragged(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    qo_indptr: torch.Tensor,
    *,
    num_rows: int,
    num_draft_tokens: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> Stage:
    """Bind once: the expand pass of a ragged verify, one token-slot list per query row.

    Parameters
    ----------
    req_pool_indices, req_to_token, seq_lens : torch.Tensor
        ``[B]``, ``[R, W_row]``, ``[B]`` int32 or int64; node ``j``'s KV slot is
        ``row_i[L_i + j]``.
    tree_mask : torch.Tensor or None
        ``[B, N, N]`` bool (or uint8) ancestor mask, unit stride in the last dimension; ``None``
        for a chain (``num_draft_tokens`` then gives ``N``).
    qo_indptr : torch.Tensor
        ``[≥ B + 1]`` int32 or int64 on the device: the query offsets of the padded lengths
        (:func:`specmeta.pad_verify_lens_to_bucket`).
    num_rows : int
        ``T``, the bucket's query tokens (a host int): rows ``[0, T)`` are written.
    num_draft_tokens : int, optional
        ``N``; required without ``tree_mask``.
    page_table : torch.Tensor, optional
        ``[≥ T, W ≥ N]`` int32 or int64; rows ``[:T]`` written entirely. Allocated int32
        ``[T, N]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        ``[≥ T]`` int32 or int64. Allocated int32 when omitted.
    cu_seqlens_k : torch.Tensor, optional
        ``[≥ T + 1]``: its exclusive prefix sum over the rows, when given.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (a slot past ``W_row`` or a negative
        ``seq_lens``, read 0; a negative or decreasing ``qo_indptr``), ``POOL_OOB`` (a negative
        slot id of a plain row, read 0), ``OUT_OF_CAPACITY`` (a request's rows past ``T``:
        not written), ``BAD_KV_ID`` (an id of a row in another id space that does not map,
        listed as the sink slot 0, of a request with a row in ``[0, T)``).
    entry_page_size, v2p, page_size
        The rows' id space (design §2.10): page ids of ``entry_page_size`` positions each,
        virtual ids emitted through the page map ``v2p`` at the pool's page size
        ``page_size``; the table lists each slot as emitted. Defaults: rows of token ids.
    sliding_window_size, full_to_swa, tree_depth
        A window layer's rows (design §2.10), as in
        :func:`~specmeta.kernels.verify_expand_page_table.verify_expand_page_table`: node
        ``j`` (depth ``d``, its ancestor count less one) lists the band ``[max(0, L + d − w +
        1), P0)`` of prefix ids below the normal pass (``prefix_page_table(...,
        tree_depth=D)``), then its last ``min(cnt, w)`` ancestors; a filler row is a node
        whose ancestors are all ``V_i`` nodes (depth ``V_i − 1``). ``page_table`` needs
        ``D + 2·ps − 1`` columns; every id goes through ``full_to_swa`` when given.

    Returns
    -------
    Stage
        Its result is ``(page_table, cache_seqlens)``, what the eager
        :func:`verify_expand_ragged` returns.

    Examples
    --------
    ``N=2``, a chain, ``L=[3, 1]``, rows ``r0 = […, 30, 31]`` at positions 3, 4 and
    ``r1 = […, 10, 11]`` at positions 1, 2, ``qo_indptr=[0, 1, 4]``, ``T=5`` → rows
    ``[30, 0]`` (request 0 verifies one node), ``[10, 11]`` (node 0: its own slot, then the
    other node's, not read), ``[10, 11]``, ``[10, 11]`` (a filler row), ``[0, 0]`` (no
    request); ``cache_seqlens=[1, 1, 2, 2, 0]``.

    Grid ``(B + 1,)``, then ``(1,)`` for ``cu_seqlens_k``. No host sync: ``T`` is the host's.
    """
    B, N, T, page_table, cache_seqlens, status, (rail, D) = _prepare(
        "verify_expand_ragged", req_pool_indices, req_to_token, seq_lens, tree_mask, qo_indptr,
        num_rows, num_draft_tokens, page_table, cache_seqlens, cu_seqlens_k, status,
        entry_page_size, v2p, page_size, sliding_window_size, full_to_swa, tree_depth,
    )  # fmt: skip
    chain = tree_mask is None
    mask = page_table if chain else (
        tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask)  # fmt: skip
    W = page_table.shape[1]
    launches = [
        _verify_expand_ragged_launch.bind(
            (B + 1,),
            **batch_arguments(req_pool_indices, req_to_token, seq_lens),
            qo_indptr_ptr=qo_indptr,
            tree_mask_ptr=mask,
            page_table_ptr=page_table,
            cache_seqlens_ptr=cache_seqlens,
            cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
            status_ptr=status,
            N=N,
            W=W,
            T=T,
            stride_pt=page_table.stride(0),
            stride_mb=0 if chain else mask.stride(0),
            stride_mj=0 if chain else mask.stride(1),
            BLOCK_N=next_power_of_2(N),
            BLOCK_W=min(next_power_of_2(max(W, 1)), 64),
            BLOCK_F=_BLOCK_F,
            CHAIN=chain,
            WRITE_CU0=cu_seqlens_k is not None,
            page_size=page_size if v2p is not None or rail else None,
            **id_space_arguments(entry_page_size, v2p),
            **window_arguments(full_to_swa),
            rail=rail or None,
            depth=D if rail else None,
            band_max=D + 2 * page_size - 2 if rail else None,
            WINDOW_LAYER=bool(rail),
            BLOCK_P=min(next_power_of_2(max(D + 2 * page_size - 2, 1)), 64) if rail else 1,
        )
    ]
    if cu_seqlens_k is not None and T:
        launches.append(bind_inclusive_sums(cache_seqlens, cu_seqlens_k, T))
    return Stage(launches, result=(page_table, cache_seqlens))


verify_expand_ragged = launcher(bind_verify_expand_ragged)
verify_expand_ragged.kernels = (_verify_expand_ragged_kernel, inclusive_sums_kernel)


def verify_expand_ragged_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    qo_indptr: torch.Tensor,
    *,
    num_rows: int,
    num_draft_tokens: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`verify_expand_ragged` (a loop over the requests; syncs)."""
    B, N, T, page_table, cache_seqlens, status, (rail, D) = _prepare(
        "verify_expand_ragged_ref", req_pool_indices, req_to_token, seq_lens, tree_mask,
        qo_indptr, num_rows, num_draft_tokens, page_table, cache_seqlens, cu_seqlens_k, status,
        entry_page_size, v2p, page_size, sliding_window_size, full_to_swa, tree_depth,
    )  # fmt: skip
    device = req_to_token.device
    qo = qo_indptr[: B + 1].to(torch.int64).tolist()
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    c = torch.arange(N, device=device)
    slots, bad, _ = load_window_ids_ref(
        req_to_token, req_pool_indices, L.clamp_min(0).view(-1, 1) + c,
        torch.ones(B, N, dtype=torch.bool, device=device), entry_page_size=entry_page_size,
        v2p=v2p, page_size=page_size, full_to_swa=full_to_swa,
    )  # [B, N]: every window slot in the rows' id space; the bits are those of the first V_i
    table = torch.zeros(T, page_table.shape[1], dtype=torch.int64, device=device)
    counts = torch.zeros(T, dtype=torch.int64, device=device)
    chain = torch.ones(N, N, dtype=torch.bool, device=device).tril()
    for i in range(B):
        start, end = qo[i], qo[i + 1]
        rows = max(end - start, 0)
        V = min(rows, N)
        if start < 0 or end < start:
            bits |= int(Status.POS_OOB)
        if start + rows > T:
            bits |= int(Status.OUT_OF_CAPACITY)
        bits |= gather_bits_of(req_to_token, req_pool_indices, L, i, V, entry_page_size)
        if bool(bad[i, :V].any()) and start < T and start + rows > 0:  # emitted ids only
            bits |= int(Status.BAD_KV_ID)
        s = slots[i, :V].to(torch.int64)
        if bool((s < 0).any()):
            bits |= int(Status.POOL_OOB)
        s = s.clamp_min(0)
        m = (chain if tree_mask is None else tree_mask[i].to(torch.bool))[:V, :V]
        for j in range(rows):
            r = start + j
            if not 0 <= r < T:
                continue
            if rail:  # a window layer (design §2.10): a filler row's ancestors are all V nodes
                nodes = [c for c in range(V) if j >= N or bool(m[j, c])]
                ids, row_bits = window_tree_row_ref(
                    req_to_token, req_pool_indices, i, max(int(L[i]), 0), nodes, rail, D,
                    page_size, entry_page_size=entry_page_size, v2p=v2p, full_to_swa=full_to_swa,
                )  # fmt: skip
                bits |= row_bits  # a row in [0, T) emits its ids
                table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
                counts[r] = len(ids)
            elif j < N:
                order = torch.argsort(torch.where(m[j], c[:V], N + c[:V]))
                table[r, :V] = s[order]
                counts[r] = int(m[j].sum())
            else:
                table[r, :V] = s
                counts[r] = V
    if qo[B] > T:
        bits |= int(Status.OUT_OF_CAPACITY)
    if qo[B] < 0:
        bits |= int(Status.POS_OOB)
    page_table[:T] = table.to(page_table.dtype)
    cache_seqlens[:T] = counts.to(cache_seqlens.dtype)
    if cu_seqlens_k is not None:
        cu_seqlens_k[0] = 0
        cu_seqlens_k[1 : T + 1] = torch.cumsum(counts, 0).to(cu_seqlens_k.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens


def gather_bits_of(req_to_token, req_pool_indices, L, i, V, entry_page_size=1) -> int:
    """The bits of reading request ``i``'s first ``V`` window slots (the kernel reads only
    those): ``ROW_OOB`` for a row outside ``req_to_token``, ``POS_OOB`` past its width (its
    entries, each ``entry_page_size`` positions)."""
    pos = L[i : i + 1].clamp_min(0).view(1, 1) + torch.arange(V, device=L.device).view(1, -1)
    _, bits = gather_rows_ref(req_to_token, req_pool_indices[i : i + 1], pos // entry_page_size)
    return bits
