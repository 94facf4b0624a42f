"""The FA3 expand pass of target verify with a draft tree (``K > 1``, design §3.2).

Node ``j`` of request ``i`` is query row ``r = i·N + j``; its keys beyond the shared prefix are
its tree ancestors and itself, ``m[i, j, c] = 1``. The row lists the verify slots
``row_i[L_i + c]`` of those columns first, in increasing ``c``, then the other columns (never
read, but every column is defined)::

    page_table[r, k]   = row_i[L_i + c_k]       c_0 < c_1 < … the ancestor columns, then the rest
    page_table[r, k]   = 0                      for N ≤ k < W
    cache_seqlens[r]   = Σ_c m[i, j, c]
    cu_seqlens_k[r]    = Σ_{r'<r} cache_seqlens[r']         r in [0, B·N]

The table holds token slots, so the consumer reads it with a page-size-1 view of the KV cache.

A ragged target verify (``verify_lens``, design §3.2) keeps the rows ``r = i·N + j`` of every
``j < N`` (the uniform layout a graph captured) but lets request ``i`` verify only its first
``v_i ≤ N`` nodes: the mask is read as ``m'[i, j, c] = m[i, j, c] ∧ j < v_i ∧ c < v_i`` (a
prefix of nodes is a tree, so no ancestor of a node ``j < v_i`` is cut; the mask is applied
anyway) and only the window slots ``c < v_i`` are read::

    page_table[r, k]   = row_i[L_i + c_k]       j < v_i: c_0 < c_1 < … the ancestor columns
                                                of m', then the other columns c < v_i
    page_table[r, k]   = 0                      j < v_i and v_i ≤ k < W; every k for j ≥ v_i
    cache_seqlens[r]   = Σ_c m'[i, j, c]        (0 for j ≥ v_i: an empty list)
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
    POOL_OOB,
    POS_OOB,
    ROW_OOB,
    ancestor_order,
    batch_arguments,
    check_batch,
    check_expand_outputs,
    check_id_spaces,
    check_verify_lens,
    id_space_arguments,
    load_kv_ids_ref,
    load_request,
    load_verify_len,
    verify_lens_ref,
    window_slots,
)
from ._window import (
    check_tree_depth,
    check_window,
    load_window_ids,
    tree_prefix_start,
    window_arguments,
    window_tree_expand_width,
    window_tree_row_ref,
    window_tree_rows,
)

__all__ = [
    "bind_verify_expand_page_table",
    "verify_expand_page_table",
    "verify_expand_page_table_ref",
]


@triton.jit(do_not_specialize=["n"])
def inclusive_sums_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst[1 + r] = Σ_{r' ≤ r} src[r']`` for ``r < n``: one program, ``BLOCK`` entries a
    step, the running total carried in 64 bits. ``n`` is the host's row count (the buffers'
    size), never a device value, so the loop is bounded by capacity."""
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    for start in range(0, n, BLOCK):
        r = start + tl.arange(0, BLOCK)
        v = tl.load(src_ptr + r, mask=r < n, other=0).to(tl.int64)
        tl.store(dst_ptr + 1 + r, (tl.cumsum(v, 0) + carry).to(dst_ptr.dtype.element_ty),
                 mask=r < n)  # fmt: skip
        carry += tl.sum(v, 0)


_INCLUSIVE_SUMS = Launcher(inclusive_sums_kernel)


def bind_inclusive_sums(src: torch.Tensor, dst: torch.Tensor, n: int):
    """The bound launch of :func:`inclusive_sums_kernel` over ``n`` entries: the
    ``cu_seqlens_k`` of an FA3 expand pass from its ``cache_seqlens`` (``dst[0]`` is the
    caller's)."""
    return _INCLUSIVE_SUMS.bind((1,), src_ptr=src, dst_ptr=dst, n=n, BLOCK=1024)


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "N", "W", "stride_pt", "stride_mb", "stride_mj",
        "num_pages", "page_size", "full_size", "rail", "depth", "band_max",
    ]
)  # fmt: skip
def _verify_expand_page_table_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    verify_lens_ptr,  # [B] int32|int64, or None (uniform: every request verifies N nodes)
    tree_mask_ptr,  # [B, N, N] uint8 (bool viewed as bytes), strides (stride_mb, stride_mj, 1)
    page_table_ptr,  # [≥B*N, W] int32|int64, row stride stride_pt
    cache_seqlens_ptr,  # [≥B*N] int32|int64
    cu_seqlens_k_ptr,  # [≥B*N+1] int32|int64: entry 0 only (unless WRITE_CU0)
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE), or None
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    N,
    W,
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
    BLOCK_T: tl.constexpr,  # tail columns per store tile
    WRITE_CU0: tl.constexpr,
    HAS_VERIFY_LENS: tl.constexpr,  # verify_lens_ptr is a tensor: nodes j ≥ v_i get no keys
    HAS_STATUS: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,  # E > 1: rows of page ids (design §2.10)
    TRANSLATE: tl.constexpr,  # ids leave through v2p
    WINDOW_LAYER: tl.constexpr,  # a window layer's tree (design §2.10): window_tree_rows
    TO_WINDOW: tl.constexpr,  # ids leave through full_to_swa
    BLOCK_P: tl.constexpr,  # band positions per chunk (WINDOW_LAYER)
):
    """Grid ``(max(B, 1),)``: program ``i`` orders the ``V × V`` tile of request ``i``'s mask
    (``V = N``, or its clamped ``v_i`` in a ragged verify) and scatters its verify slots into
    the ``N`` rows of its nodes."""
    i = tl.program_id(0).to(tl.int64)
    live = i < B
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, i, B, R, stride_row
    )
    if HAS_VERIFY_LENS:
        # Ragged verify: the first v_i ≤ N nodes; a v_i outside [0, N] is read clamped and
        # reported (POS_OOB, below).
        V, v_ok = load_verify_len(verify_lens_ptr, i, B, N)
        L_ok = L_ok & v_ok
    else:
        V = N
    jj = tl.arange(0, BLOCK_N)[:, None]  # node j: query row
    cc = tl.arange(0, BLOCK_N)[None, :]  # column c: tree node whose slot may be read
    in_tile = tl.where(live, (jj < V) & (cc < V), False)
    m = tl.load(tree_mask_ptr + i * stride_mb + jj * stride_mj + cc, mask=in_tile, other=0)
    m = in_tile & (m != 0)
    pos, cnt = ancestor_order(m, cc)  # rank of column c in row j; keys of node j

    c = tl.arange(0, BLOCK_N)
    want = tl.where(live, c < V, False)  # the window slots read
    rows = i * N + jj  # int64: B·N·W passes 2**31 only for huge tables, but costs nothing
    if WINDOW_LAYER:
        # A window layer's tree (design §2.10): each row its band of prefix positions below
        # the normal pass, then its ancestors within the window, ids through the map.
        slot, in_row, bad = load_window_ids(req_to_token_ptr + row_base, L + c,
                                            tl.where(row_ok, want, False), W_row, v2p_ptr,
                                            num_pages, page_size, full_to_swa_ptr, full_size,
                                            ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        neg = want & ~bad & (slot < 0)
        slot = tl.where(neg, 0, slot)
        start = tree_prefix_start(L, rail, depth, page_size)
        cnt, band_past, band_bad, band_neg = window_tree_rows(
            page_table_ptr, rows, tl.where(live, jj < N, False), m, pos, cnt, slot, L, start,
            rail, band_max, W, stride_pt, req_to_token_ptr + row_base, row_ok, W_row, v2p_ptr,
            num_pages, page_size, full_to_swa_ptr, full_size, BLOCK_P, BLOCK_T,
            ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
        )  # fmt: skip
        past = (want & ~in_row) | band_past
        bad = bad | band_bad
        neg = neg | band_neg
    else:
        # The slots in the row's id space (design §2.10); the table lists each translated id.
        slot, past, neg, bad = window_slots(req_to_token_ptr, row_base, row_ok, L, want, W_row,
                                            v2p_ptr, num_pages, page_size, BLOCK_N,
                                            ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
        tl.store(page_table_ptr + rows * stride_pt + pos, slot[None, :] + 0 * pos, mask=in_tile)
        row_live = tl.where(live, jj < N, False)
        if HAS_VERIFY_LENS:
            # The N × N tile outside the V × V one: columns [V, N) of rows j < V (the tile's
            # ranks stay below V there), every column of the rows j ≥ V.
            tl.store(page_table_ptr + rows * stride_pt + cc, 0 * rows + 0 * cc,
                     mask=row_live & (cc < N) & ~in_tile)  # fmt: skip
        for c0 in range(N, W, BLOCK_T):
            t = c0 + tl.arange(0, BLOCK_T)[None, :]
            tl.store(page_table_ptr + rows * stride_pt + t, 0 * rows + 0 * t,
                     mask=row_live & (t < W))  # fmt: skip
    tl.store(cache_seqlens_ptr + i * N + c, cnt, mask=tl.where(live, c < N, False))
    if WRITE_CU0:
        tl.store(cu_seqlens_k_ptr + i, i * 0, mask=i == 0)

    if HAS_STATUS:
        pos_bad = tl.max(past.to(tl.int32), axis=0) != 0
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(pos_bad | ~L_ok, POS_OOB, 0)
            | tl.where(tl.max(neg.to(tl.int32), axis=0) != 0, POOL_OOB, 0)
            | tl.where(tl.max(bad.to(tl.int32), axis=0) != 0, BAD_KV_ID, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_verify_expand_page_table_launch = Launcher(_verify_expand_page_table_kernel)


def _prepare(where, req_pool_indices, req_to_token, seq_lens, tree_mask, page_table,
             cache_seqlens, cu_seqlens_k, verify_lens, status, entry_page_size, v2p,
             page_size, sliding_window_size=None, full_to_swa=None, tree_depth=None):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. Returns ``B``, ``N``,
    the outputs, the status word and a window layer's ``(w, D)`` (``w = 0``: a full layer)."""
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    validate.positive("page_size", page_size)
    rail = check_window(where, sliding_window_size, full_to_swa, device)
    if full_to_swa is not None and not rail:
        raise ValueError(f"{where}: full_to_swa was given without sliding_window_size; a "
                         "window layer's tree lists its rows by its window w (design §2.10): "
                         "pass sliding_window_size=w with the map")  # fmt: skip
    if verify_lens is not None:
        check_verify_lens(where, verify_lens, B, device)
    validate.tensor("tree_mask", tree_mask, dtypes=(torch.bool, torch.uint8), ndim=3,
                    device=device)  # fmt: skip
    N = tree_mask.shape[1]
    if tree_mask.shape != (B, N, N) or N < 1:
        raise ValueError(
            f"tree_mask must have shape [B, N, N] = [{B}, N, N] with N >= 1, "
            f"got {tuple(tree_mask.shape)}"
        )
    D = check_tree_depth(where, tree_depth, rail, N - 1)
    # A window layer's rows hold a band of prefix positions too (design §2.10).
    cols = window_tree_expand_width(D, page_size) if rail else N
    if rail and page_table is not None and page_table.shape[-1] < cols:
        raise ValueError(
            f"{where}: page_table has {page_table.shape[-1]} columns; a window layer's rows "
            f"(sliding_window_size={rail}, tree_depth={D}, page_size={page_size}) list up to "
            f"D + 2*page_size - 1 = {cols} keys: pass at least {cols} (design §2.10)"
        )
    page_table, cache_seqlens = check_expand_outputs(page_table, cache_seqlens, cu_seqlens_k,
                                                     B * N, cols, device, "B*N")  # fmt: skip
    status = validate.status(status, device)
    return B, N, page_table, cache_seqlens, status, (rail, D)


def bind_verify_expand_page_table(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> Stage:
    """Bind once: token-slot tables of every tree node's ancestors, for the FA3 verify cascade.

    Parameters
    ----------
    req_pool_indices, req_to_token, seq_lens : torch.Tensor
        ``[B]``, ``[R, W_row]``, ``[B]`` int32 or int64; node ``j``'s KV slot is
        ``row_i[L_i + j]``.
    tree_mask : torch.Tensor
        ``[B, N, N]`` bool (or uint8), unit stride in the last dimension: ``m[i, j, c]`` is 1
        iff ``c == j`` or ``c`` is an ancestor of ``j``.
    page_table : torch.Tensor, optional
        ``[≥ B·N, W ≥ N]`` int32 or int64; rows ``[:B·N]`` written entirely (0 past column
        ``N``). Allocated int32 ``[B·N, N]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        ``[≥ B·N]`` int32 or int64, keys per node. Allocated int32 when omitted.
    cu_seqlens_k : torch.Tensor, optional
        ``[≥ B·N + 1]``; when given, its exclusive prefix sum (entry 0 by the kernel, the rest
        by a second, one-program launch: a per-node prefix over the masks of all earlier
        requests would cost every program O(i·N²) reads).
    verify_lens : torch.Tensor, optional
        ``[B]`` int32 or int64 on the device: a ragged target verify (design §3.2). Rows stay
        ``i·N + j`` for every ``j < N``; node ``j < v_i`` lists its ancestors ``c < v_i`` (the
        mask read as ``m ∧ j < v_i ∧ c < v_i``), then the other window slots ``c < v_i``, then
        0; a node ``j ≥ v_i`` gets an empty list (``cache_seqlens`` 0, its row all 0, the
        sink). Only the slots ``row_i[L_i + c]``, ``c < v_i``, are read. In a captured
        bucket, the padded lengths of ``pad_verify_lens_to_bucket``. ``None`` (the default):
        ``v_i = N``.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (``L_i + N`` past the row's positions
        (``L_i + v_i`` when ragged) or negative ``seq_lens``, those slots read 0; a ``v_i``
        outside ``[0, N]``, read clamped to it), ``POOL_OOB`` (a negative slot id of a plain
        row reads 0), ``BAD_KV_ID`` (an id of a row in another id space that does not map:
        the sink slot 0).
    entry_page_size, v2p, page_size
        The rows' id space (design §2.10): page ids of ``entry_page_size`` positions each
        (a row of ``W_row`` entries holds ``W_row·entry_page_size`` positions), virtual ids
        emitted through the page map ``v2p`` at the pool's page size ``page_size``; the
        table lists each slot as emitted. Defaults: rows of token ids, as they are.
    sliding_window_size : int, optional
        A window layer's ``w`` (design §2.10; ``None`` or 0: a full layer). Node ``j`` at depth
        ``d = cnt − 1`` (position ``L + d``) reads ``(L + d − w, L + d]``; the normal pass
        (``prefix_page_table(..., tree_depth=D)``) holds only ``[P0, L)``, the prefix every
        node reads, ``P0`` a page boundary (``page_size`` is then the pool's). Its row lists
        the band ``[max(0, L + d − w + 1), P0)`` of prefix ids, then its last ``min(cnt, w)``
        ancestors, then 0; ``cache_seqlens`` counts both. At most ``D + 2·ps − 1`` entries, so
        ``page_table`` needs that many columns (allocated so when omitted).
    full_to_swa : torch.Tensor, optional
        ``[P_full]`` int32 or int64 full → window pool map (with ``sliding_window_size``): every
        id listed, band and nodes, is ``full_to_swa[id]`` after the row's own translation; an
        id read whose entry is −1 (or past the map) is the sink slot 0 with ``BAD_KV_ID``.
    tree_depth : int, optional
        ``D ≥ N − 1`` (default ``N − 1``), the depth bound the normal pass was built with
        (design §2.10); only with ``sliding_window_size``.

    Returns
    -------
    Stage
        Its result is ``(page_table, cache_seqlens)`` (tuple of torch.Tensor), what the eager
        :func:`verify_expand_page_table` returns.

    Examples
    --------
    ``N=3``, node 1 and node 2 both children of the root, ``L=5``, row ``[…, 50, 51, 52]``
    at positions 5, 6, 7 → rows ``[50, 51, 52]``, ``[50, 51, 52]``, ``[50, 52, 51]``;
    ``cache_seqlens=[1, 2, 2]``. With ``verify_lens=[2]``: rows ``[50, 51, 0]``,
    ``[50, 51, 0]``, ``[0, 0, 0]``; ``cache_seqlens=[1, 2, 0]``.

    A ``v_i`` outside ``[0, N]`` is a fault: it is read clamped to that range and ``POS_OOB``
    is set; every row ``[:B·N]`` is still written, nothing past it.

    Grid ``(max(B, 1),)``, one program per request, and ``(1,)`` for ``cu_seqlens_k``. No
    host sync.
    """
    B, N, page_table, cache_seqlens, status, (rail, D) = _prepare(
        "verify_expand_page_table", req_pool_indices, req_to_token, seq_lens, tree_mask,
        page_table, cache_seqlens, cu_seqlens_k, verify_lens, status, entry_page_size, v2p,
        page_size, sliding_window_size, full_to_swa, tree_depth,
    )  # fmt: skip
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    W = page_table.shape[1]
    launches = [
        _verify_expand_page_table_launch.bind(
            (max(B, 1),),
            **batch_arguments(req_pool_indices, req_to_token, seq_lens),
            verify_lens_ptr=verify_lens,
            tree_mask_ptr=mask,
            page_table_ptr=page_table,
            cache_seqlens_ptr=cache_seqlens,
            cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
            status_ptr=status,
            N=N,
            W=W,
            stride_pt=page_table.stride(0),
            stride_mb=mask.stride(0),
            stride_mj=mask.stride(1),
            BLOCK_N=next_power_of_2(N),
            BLOCK_T=min(next_power_of_2(max(W - N, 1)), 64),
            WRITE_CU0=cu_seqlens_k is not None,
            HAS_VERIFY_LENS=verify_lens is not None,
            HAS_STATUS=True,
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
    if cu_seqlens_k is not None and B * N:
        # Entry 0 is the kernel's; the rest are the nodes' inclusive sums.
        launches.append(bind_inclusive_sums(cache_seqlens, cu_seqlens_k, B * N))
    return Stage(launches, result=(page_table, cache_seqlens))


verify_expand_page_table = launcher(bind_verify_expand_page_table)


# for specmeta.registry
verify_expand_page_table.kernels = (_verify_expand_page_table_kernel, inclusive_sums_kernel)


def verify_expand_page_table_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    verify_lens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`verify_expand_page_table` (vectorised; a window layer's rows one by
    one; syncs)."""
    B, N, page_table, cache_seqlens, status, (rail, D) = _prepare(
        "verify_expand_page_table_ref", req_pool_indices, req_to_token, seq_lens, tree_mask,
        page_table, cache_seqlens, cu_seqlens_k, verify_lens, status, entry_page_size, v2p,
        page_size, sliding_window_size, full_to_swa, tree_depth,
    )  # fmt: skip
    if rail:
        return _window_rows_ref(req_pool_indices, req_to_token, seq_lens, tree_mask, page_table,
                                cache_seqlens, cu_seqlens_k, verify_lens, status,
                                entry_page_size, v2p, page_size, rail, full_to_swa, D)  # fmt: skip
    device = req_to_token.device
    BN = B * N
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    c = torch.arange(N, device=device)
    V = torch.full((B, 1), N, dtype=torch.int64, device=device)  # nodes verified
    if verify_lens is not None:  # ragged verify: v_i, clamped to [0, N]
        v, v_bits = verify_lens_ref(verify_lens, N)
        V, bits = v.view(B, 1), bits | v_bits
    read = c < V  # [B, N]: the window slots read (position 0 stands in for the others)
    slots, bad, gather_bits = load_kv_ids_ref(
        req_to_token, req_pool_indices, torch.where(read, L.clamp_min(0).view(-1, 1) + c, 0),
        read, entry_page_size=entry_page_size, v2p=v2p, page_size=page_size,
    )  # [B, N], in the rows' id space (design §2.10)
    bits |= gather_bits
    if bool(bad.any()):
        bits |= int(Status.BAD_KV_ID)
    if bool((slots < 0).any()):  # a plain row's negative slot
        bits |= int(Status.POOL_OOB)
    slots = slots.clamp_min(0)
    node = read.view(B, N, 1)  # node j is verified
    m = tree_mask.to(torch.bool) & node & read.view(B, 1, N)
    order = torch.argsort(torch.where(m, c, N + c), dim=-1)  # ancestors first, then the rest
    table = torch.gather(slots.view(B, 1, N).expand(B, N, N), 2, order)
    table = torch.where(node, table, 0).reshape(BN, N)
    page_table[:BN, :N] = table.to(page_table.dtype)
    page_table[:BN, N:] = 0
    counts = m.sum(-1).reshape(BN)
    cache_seqlens[:BN] = counts.to(cache_seqlens.dtype)
    if cu_seqlens_k is not None:
        cu_seqlens_k[0] = 0
        cu_seqlens_k[1 : BN + 1] = torch.cumsum(counts, 0).to(cu_seqlens_k.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens


def _window_rows_ref(req_pool_indices, req_to_token, seq_lens, tree_mask, page_table,
                     cache_seqlens, cu_seqlens_k, verify_lens, status, entry_page_size, v2p,
                     page_size, rail, full_to_swa, D):  # fmt: skip
    """:func:`verify_expand_page_table_ref` of a window layer's tree (design §2.10): each node's
    row from its ancestor set, position by position (:func:`window_tree_row_ref`)."""
    B, N = tree_mask.shape[0], tree_mask.shape[1]
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    V = [N] * B
    if verify_lens is not None:
        v, v_bits = verify_lens_ref(verify_lens, N)
        V, bits = v.view(-1).tolist(), bits | v_bits
    page_table[: B * N] = 0
    counts = torch.zeros(B * N, dtype=torch.int64)
    rows_ok = (req_pool_indices.to(torch.int64) >= 0) & (req_pool_indices < req_to_token.shape[0])
    if not bool(rows_ok.all()):
        bits |= int(Status.ROW_OOB)
    for b in range(B):
        Lb, Vb = max(int(L[b]), 0), int(V[b])
        m = tree_mask[b].to(torch.bool).cpu()
        # The window slots are read whatever the rows list (a fault among them is reported).
        _, read_bits = window_tree_row_ref(req_to_token, req_pool_indices, b, Lb, list(range(Vb)),
                                           1 << 30, D, page_size,
                                           entry_page_size=entry_page_size, v2p=v2p,
                                           full_to_swa=full_to_swa)  # fmt: skip
        bits |= read_bits
        for j in range(min(Vb, N)):
            nodes = [c for c in range(Vb) if bool(m[j, c])]
            ids, row_bits = window_tree_row_ref(req_to_token, req_pool_indices, b, Lb, nodes,
                                                rail, D, page_size,
                                                entry_page_size=entry_page_size, v2p=v2p,
                                                full_to_swa=full_to_swa)  # fmt: skip
            bits |= row_bits
            page_table[b * N + j, : len(ids)] = torch.tensor(ids, dtype=page_table.dtype)
            counts[b * N + j] = len(ids)
    cache_seqlens[: B * N] = counts.to(cache_seqlens.device, cache_seqlens.dtype)
    if cu_seqlens_k is not None:
        cu_seqlens_k[0] = 0
        cu_seqlens_k[1 : B * N + 1] = torch.cumsum(counts, 0).to(cu_seqlens_k.device,
                                                                 cu_seqlens_k.dtype)  # fmt: skip
    if bits:
        status |= bits
    return page_table, cache_seqlens
