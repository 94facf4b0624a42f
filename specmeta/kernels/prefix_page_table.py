"""Per-request page tables over a request's own row (design §2.3 normal pass, §3.2, §3.4).

Request ``b`` covers ``len_b`` tokens of its ``req_to_token`` row::

    len_b               = L_b + extra_tokens            (or L_b − lpl_b + extra_tokens
                                                          with exclude_last_partial)
    page_table[b, c]    = row_b[c·ps] // ps             for c < ceil(len_b / ps)
    page_table[b, c]    = fill_value                    for ceil(len_b / ps) ≤ c < W
    cache_seqlens[b]    = len_b
    cu_seqlens_k[b]     = Σ_{b'<b} cache_seqlens[b']    for b in [0, B], entry 0 included

One op serves every page-table consumer that reads a request's own row: the FA3 normal pass
(``extra_tokens=0``, ``exclude_last_partial`` in slot layout B), draft decode with ``K == 1``
(``extra_tokens=1, num_rows=rows``: one table, ``cache_seqlens[s] = L + s + 1``), target verify
and draft extend (``extra_tokens=N``), and TRT-LLM MLA's ``block_kv_indices``
(``fill_value=-1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import page_table_width
from ..launch import Launcher
from ..status import Status
from ._common import (
    OUT_OF_CAPACITY,
    POOL_OOB,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    check_batch,
    chunk_programs,
    gather_rows_ref,
    load_request,
    vector_widths,
)

__all__ = ["prefix_page_table", "prefix_page_table_ref"]


# Page-table columns one program writes per iteration: 1024 entries keep 8 elements a thread in
# flight at 4 warps (as in the kv_indices kernels).
_BLOCK = 1024
# seq_lens entries per block of the cu_seqlens_k scan (one block up to B = 1024).
_BLOCK_B = 1024


@triton.jit
def _covered_len(L, page_size, extra_tokens, EXCLUDE_LAST_PARTIAL: tl.constexpr):
    """``len`` of step row 0 for a prefix ``L ≥ 0``: ``L (− L mod ps) + extra_tokens``."""
    if EXCLUDE_LAST_PARTIAL:
        L = L - L % page_size
    return L + extra_tokens


@triton.jit
def _prefix_cu_seqlens_program(
    seq_lens_ptr,  # [B] int32|int64
    cu_seqlens_k_ptr,  # [≥rows, ≥B+1] int32|int64, row stride stride_cu
    B,
    extra_tokens,
    num_rows,
    W,
    stride_cu,
    EXCLUDE_LAST_PARTIAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    WRITE_CU: tl.constexpr,  # else nothing to do
):
    """``cu_seqlens_k[r, :B + 1]`` of every row ``r < num_rows``: the exclusive scan of
    ``min(len_b + r, W·ps)``, closing entry included, by one program for the whole batch (int64
    sums: ΣL passes 2**31 for large batches of long contexts). A program of its own, so that no
    gathering program waits for a block-wide reduction after its gather: on an H200 a sum per
    request in the programs that gather cost the B = 256, ps = 1 FA3 build 0.5 µs, and a batch
    of one 0.35 µs."""
    if WRITE_CU:
        cap = W.to(tl.int64) * PAGE_SIZE
        stride_cu64 = stride_cu.to(tl.int64)
        offs = tl.arange(0, BLOCK_B)
        # The first BLOCK_B lengths (all of them up to B = 1024) once for every row.
        L_head = tl.load(seq_lens_ptr + offs, mask=offs < B, other=0).to(tl.int64)
        len_head = _covered_len(
            tl.maximum(L_head, 0), PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL
        )
        for r in range(0, num_rows):
            row = cu_seqlens_k_ptr + r * stride_cu64
            own = tl.where(offs < B, tl.minimum(len_head + r, cap), 0)
            # Entry b is the inclusive scan less request b's own length; entry B (own 0) closes.
            tl.store(row + offs, tl.cumsum(own, axis=0) - own, mask=offs <= B)
            carry = tl.sum(own, axis=0)
            for first in range(BLOCK_B, B + 1, BLOCK_B):  # B ≥ BLOCK_B only
                more = first + offs
                L_more = tl.load(seq_lens_ptr + more, mask=more < B, other=0).to(tl.int64)
                len_more = _covered_len(
                    tl.maximum(L_more, 0), PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL
                )
                own = tl.where(more < B, tl.minimum(len_more + r, cap), 0)
                tl.store(row + more, carry + tl.cumsum(own, axis=0) - own, mask=more <= B)
                carry += tl.sum(own, axis=0)


@triton.jit
def prefix_page_table_program(
    b,  # request
    c,  # first column chunk
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    page_table_ptr,  # [≥B, W] int32|int64, row stride stride_pt
    cache_seqlens_ptr,  # [≥rows, ≥B] int32|int64, row stride stride_cs
    cu_seqlens_k_ptr,  # [≥rows, ≥B+1] int32|int64, row stride stride_cu (unless WRITE_CU)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    extra_tokens,
    fill_value,
    num_rows,
    W,
    stride_pt,
    stride_cs,
    stride_cu,
    chunk_programs,
    EXCLUDE_LAST_PARTIAL: tl.constexpr,
    PAGED: tl.constexpr,  # PAGE_SIZE > 1
    PAGE_SIZE: tl.constexpr,  # a config constant: // and % by it compile to shifts or multiplies
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    VEC_IN: tl.constexpr,  # req_to_token entries per 16 B when rows allow vector loads, else 1
    VEC_OUT: tl.constexpr,  # page_table entries per 16 B when rows allow vector stores, else 1
    WRITE_CU: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """Program ``(b, c)`` of the grid ``(B + 1, chunk_programs)``. For ``b < B``: column chunks
    ``c, c + chunk_programs, …`` of row ``b``, and with ``c == 0`` also ``cache_seqlens[:, b]``
    and the status. Program ``(B, 0)`` writes ``cu_seqlens_k`` (entry 0 alone when ``B = 0``),
    the other programs of row ``B`` nothing. A device function so that a fused kernel can run
    it on part of its grid."""
    b = b.to(tl.int64)  # b·stride_pt passes 2**31 (below)
    if b < B:
        row_base, L, row_ok, L_ok = load_request(
            req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
        )
        length = _covered_len(L, PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL)
        # The table serves every row s < num_rows (length + s tokens): it covers the longest.
        longest = length + num_rows - 1
        if PAGED:
            pages_wanted = (longest + PAGE_SIZE - 1) // PAGE_SIZE
        else:
            pages_wanted = longest
        pages = tl.minimum(pages_wanted, W)
        # A sequence never claims more tokens than its table holds: cache_seqlens ≤ W·ps.
        cap = W.to(tl.int64) * PAGE_SIZE

        # Per-lane work is kept to a compare, an address and a select (a 4 MiB table at ps = 1 is
        # a million lanes): the row's bounds fold into scalar limits, and columns are int32 (a
        # table of 2**31 columns is not a thing) added to 64-bit row pointers.
        filled = pages.to(tl.int32)  # ≤ W: columns that hold a page, then fill_value
        readable = tl.where(row_ok, tl.minimum(filled, tl.cdiv(W_row, PAGE_SIZE)), 0)
        loadable = readable
        writable = W
        row_ptr = req_to_token_ptr + row_base
        out_ptr = page_table_ptr + b * stride_pt  # int64: B·W passes 2**31 at page size 1
        if VEC_IN > 1:
            # ps == 1, rows 16-byte aligned and W_row a multiple of VEC_IN (the launcher checked):
            # loads reach up to the next whole vector, still inside the row, so every vector is
            # loaded whole; the slots past `readable` are never used.
            row_ptr = tl.multiple_of(row_ptr, 16)
            loadable = (readable + VEC_IN - 1) // VEC_IN * VEC_IN
        if VEC_OUT > 1:
            # Rows 16-byte aligned and W a multiple of VEC_OUT (the launcher checked): written so
            # that the compiler sees it.
            out_ptr = tl.multiple_of(out_ptr, 16)
            writable = W // VEC_OUT * VEC_OUT
        col0 = tl.arange(0, BLOCK)
        for chunk in range(c, tl.cdiv(W, BLOCK), chunk_programs):
            col = col0 + chunk * BLOCK
            if PAGED:
                slot = tl.load(row_ptr + col * PAGE_SIZE, mask=col < loadable, other=0)
                page = tl.maximum(slot, 0) // PAGE_SIZE  # a negative slot reads page 0
            else:
                slot = tl.load(row_ptr + col, mask=col < loadable, other=0)
                page = tl.maximum(slot, 0)
            tl.store(out_ptr + col, tl.where(col < filled, page, fill_value), mask=col < writable)
            if HAS_STATUS:
                # A negative slot is reported after the store, by one atomic per vector a thread
                # holds (a reduction inside the thread), never by a reduction across the block: a
                # tl.max per chunk before the store cost the fused FA3 build at B = 256, ps = 1 (a
                # 4 MiB gather) 0.8 µs of 5.1 on an H200.
                neg = ((slot < 0) & (col < readable)).to(tl.int32)
                neg = tl.max(tl.reshape(neg, (BLOCK // VEC_IN, VEC_IN)), axis=1)
                tl.atomic_or(status_ptr + 0 * neg, POOL_OOB, mask=neg != 0, sem="relaxed")

        if c == 0:
            stride_cs64 = stride_cs.to(tl.int64)
            for r in range(0, num_rows):
                tl.store(cache_seqlens_ptr + r * stride_cs64 + b, tl.minimum(length + r, cap))

            if HAS_STATUS:
                last_pos = (pages - 1) * PAGE_SIZE
                pos_bad = ((pages > 0) & (last_pos >= W_row)) | ~L_ok
                bits = (
                    tl.where(row_ok, 0, ROW_OOB)
                    | tl.where(pos_bad, POS_OOB, 0)
                    | tl.where(pages_wanted > W, OUT_OF_CAPACITY, 0)
                )
                tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")
    elif c == 0:
        _prefix_cu_seqlens_program(
            seq_lens_ptr, cu_seqlens_k_ptr, B, extra_tokens, num_rows, W, stride_cu,
            EXCLUDE_LAST_PARTIAL, PAGE_SIZE, BLOCK_B, WRITE_CU,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "extra_tokens", "fill_value", "num_rows",
        "W", "stride_pt", "stride_cs", "stride_cu", "chunk_programs",
    ]
)  # fmt: skip
def _prefix_page_table_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    page_table_ptr,  # [≥B, W] int32|int64, row stride stride_pt
    cache_seqlens_ptr,  # [≥rows, ≥B] int32|int64, row stride stride_cs
    cu_seqlens_k_ptr,  # [≥rows, ≥B+1] int32|int64, row stride stride_cu (unless WRITE_CU)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    extra_tokens,
    fill_value,
    num_rows,
    W,
    stride_pt,
    stride_cs,
    stride_cu,
    chunk_programs,
    EXCLUDE_LAST_PARTIAL: tl.constexpr,
    PAGED: tl.constexpr,  # PAGE_SIZE > 1
    PAGE_SIZE: tl.constexpr,  # a config constant: // and % by it compile to shifts or multiplies
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    VEC_IN: tl.constexpr,
    VEC_OUT: tl.constexpr,
    WRITE_CU: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(B + 1, chunk_programs)``: program ``(b, c)`` runs
    :func:`prefix_page_table_program` (row ``B`` writes ``cu_seqlens_k``)."""
    prefix_page_table_program(
        tl.program_id(0),
        tl.program_id(1),
        req_pool_indices_ptr,
        req_to_token_ptr,
        seq_lens_ptr,
        page_table_ptr,
        cache_seqlens_ptr,
        cu_seqlens_k_ptr,
        status_ptr,
        B,
        R,
        W_row,
        stride_row,
        extra_tokens,
        fill_value,
        num_rows,
        W,
        stride_pt,
        stride_cs,
        stride_cu,
        chunk_programs,
        EXCLUDE_LAST_PARTIAL=EXCLUDE_LAST_PARTIAL,
        PAGED=PAGED,
        PAGE_SIZE=PAGE_SIZE,
        BLOCK=BLOCK,
        BLOCK_B=BLOCK_B,
        VEC_IN=VEC_IN,
        VEC_OUT=VEC_OUT,
        WRITE_CU=WRITE_CU,
        HAS_STATUS=HAS_STATUS,
    )


_prefix_page_table_launch = Launcher(_prefix_page_table_kernel)


def prepare_prefix_page_table(
    req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
    fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status,
):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference."""
    page_size = validate.positive("page_size", page_size)
    extra_tokens = validate.positive("extra_tokens", extra_tokens, minimum=0)
    if not isinstance(exclude_last_partial, bool):
        raise TypeError(
            f"exclude_last_partial must be a bool, got {type(exclude_last_partial).__name__}"
        )
    if isinstance(fill_value, bool) or not isinstance(fill_value, int):
        raise TypeError(f"fill_value must be an int, got {type(fill_value).__name__}")
    rows = 1 if num_rows is None else validate.positive("num_rows", num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    if page_table is None:
        width = page_table_width(req_to_token.shape[1], page_size)
        page_table = torch.empty((B, width), dtype=torch.int32, device=device)
    validate.tensor("page_table", page_table, ndim=2, device=device)
    validate.at_least("page_table", page_table.shape[0], B, "rows")
    if page_table.shape[1] < 1:
        raise ValueError(f"page_table needs at least 1 column, got shape {tuple(page_table.shape)}")
    seq_ndim = 1 if num_rows is None else 2
    if cache_seqlens is None:
        shape = (B,) if num_rows is None else (rows, B)
        cache_seqlens = torch.empty(shape, dtype=torch.int32, device=device)
    for name, buf, cols in (
        ("cache_seqlens", cache_seqlens, B),
        ("cu_seqlens_k", cu_seqlens_k, B + 1),
    ):
        if buf is None:
            continue
        validate.tensor(name, buf, ndim=seq_ndim, device=device)
        validate.at_least(
            name, buf.shape[-1], cols, f"entries per row (B{' + 1' if cols > B else ''})"
        )
        if seq_ndim == 2:
            validate.at_least(name, buf.shape[0], rows, "rows (num_rows)")
    status = validate.status(status, device)
    return page_size, extra_tokens, rows, B, page_table, cache_seqlens, status


def prefix_page_table(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    extra_tokens: int = 0,
    exclude_last_partial: bool = False,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_rows: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table and KV lengths of every request over its own ``req_to_token`` row.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64, the row of each request; row 0 reserved.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64, row → position → KV slot.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    page_size : int
        ``ps`` ≥ 1; slot ``s`` lives on page ``s // ps``.
    extra_tokens : int
        Tokens past the prefix the table covers (``N`` for target verify and draft extend, the
        step's ``s + 1`` for draft decode). Default 0.
    exclude_last_partial : bool
        Cover ``L_b − (L_b mod ps)`` (whole pages only) before ``extra_tokens``: the normal pass
        of the FA3 cascade in slot layout B, whose last partial page each branch reads itself.
    fill_value : int
        Value of the columns past ``ceil(len_b / ps)`` up to the buffer width: 0 (the sink page,
        FA3) by default, −1 for TRT-LLM MLA's ``block_kv_indices``.
    page_table : torch.Tensor, optional
        ``[≥ B, W]`` int32 or int64 (unit column stride); rows ``[:B]`` are written entirely.
        Pages past column ``W`` are dropped (``OUT_OF_CAPACITY``). Allocated int32
        ``[B, ceil(W_row / ps)]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        int32 or int64. ``[≥ B]`` with ``len_b`` when ``num_rows`` is None; ``[≥ rows, ≥ B]``
        with ``cache_seqlens[s, b] = len_b + s`` otherwise. Clamped to ``W·ps`` (a consumer
        never reads past its table). Allocated int32 when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB`` (bad ``req_pool_indices``: the row reads as the sink),
        ``POS_OOB`` (a page start at or past ``W_row``, or a negative ``seq_lens``),
        ``OUT_OF_CAPACITY`` (more pages than ``W``), ``POOL_OOB`` (a negative slot id in the
        row; its page reads 0).
    num_rows : int, optional
        ``rows ≥ 1``: build ``rows`` consecutive steps at once — ``len_b + s`` for ``s < rows``
        — sharing one table that covers the longest (draft decode with ``K == 1``).
    cu_seqlens_k : torch.Tensor, optional
        Shaped like ``cache_seqlens`` with one more entry per row; when given,
        ``cu_seqlens_k[..., b] = Σ_{b'<b} cache_seqlens[..., b']`` for ``b ∈ [0, B]``.

    Returns
    -------
    (page_table, cache_seqlens) : tuple of torch.Tensor
        The buffers passed (whole), or new ones.

    Examples
    --------
    ``ps=4``, ``seq_lens=[5]``, row ``[40, 41, 42, 43, 12, 13, …]``, ``W=3``:
    ``page_table=[[10, 3, 0]]``, ``cache_seqlens=[5]``; with ``exclude_last_partial``
    ``[[10, 0, 0]]`` and ``[4]``; with ``extra_tokens=2, num_rows=2``: ``[[10, 3, 0]]``,
    ``cache_seqlens=[[7], [8]]``.

    Grid ``(B + 1, chunk_programs)``: programs ``(b, c)`` gather request ``b``'s row, program
    ``(B, 0)`` scans ``seq_lens`` for ``cu_seqlens_k``. No host sync; ``B``, lengths, widths
    and strides are runtime arguments.
    """
    page_size, extra_tokens, rows, B, page_table, cache_seqlens, status = prepare_prefix_page_table(
        req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
        fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status,
    )  # fmt: skip
    W = page_table.shape[1]
    # Rows b < B gather request b, row B has the cu_seqlens_k program.
    grid = (B + 1, chunk_programs(req_to_token.device, B, W, _BLOCK))
    two_d = cache_seqlens.dim() == 2
    _prefix_page_table_launch(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        page_table_ptr=page_table,
        cache_seqlens_ptr=cache_seqlens,
        cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
        status_ptr=status,
        extra_tokens=extra_tokens,
        fill_value=fill_value,
        num_rows=rows,
        W=W,
        stride_pt=page_table.stride(0),
        stride_cs=cache_seqlens.stride(0) if two_d else 0,
        stride_cu=cu_seqlens_k.stride(0) if two_d and cu_seqlens_k is not None else 0,
        chunk_programs=grid[1],
        EXCLUDE_LAST_PARTIAL=exclude_last_partial,
        PAGED=page_size > 1,
        PAGE_SIZE=page_size,
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        **vector_widths(req_to_token, page_table, page_size),
        WRITE_CU=cu_seqlens_k is not None,
        HAS_STATUS=True,
        num_warps=4,
    )
    return page_table, cache_seqlens


def prefix_page_table_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    extra_tokens: int = 0,
    exclude_last_partial: bool = False,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_rows: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`prefix_page_table` (vectorised over the batch; syncs)."""
    page_size, extra_tokens, rows, B, page_table, cache_seqlens, status = prepare_prefix_page_table(
        req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
        fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status,
    )  # fmt: skip
    device = req_to_token.device
    W = page_table.shape[1]
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    L = L.clamp_min(0)
    length = (L - L % page_size if exclude_last_partial else L) + extra_tokens  # [B]
    wanted = (length + rows - 1 + page_size - 1) // page_size
    pages = wanted.clamp_max(W)
    cap = W * page_size

    col = torch.arange(W, device=device)
    need = col.view(1, -1) < pages.view(-1, 1)  # [B, W]
    pos = torch.where(need, col * page_size, 0)
    slots, gather_bits = gather_rows_ref(req_to_token, req_pool_indices, pos)
    bits |= gather_bits
    slots = torch.where(need, slots.to(torch.int64), 0)
    if bool((slots < 0).any()):
        bits |= int(Status.POOL_OOB)
    pages_of = slots.clamp_min(0) // page_size
    page_table[:B] = torch.where(need, pages_of, fill_value).to(page_table.dtype)
    if bool((wanted > W).any()):
        bits |= int(Status.OUT_OF_CAPACITY)

    r = torch.arange(rows, device=device).view(-1, 1)
    lens = torch.minimum(length.view(1, -1) + r, torch.tensor(cap, device=device))  # [rows, B]
    csl = cache_seqlens if cache_seqlens.dim() == 2 else cache_seqlens.view(1, -1)
    csl[:rows, :B] = lens.to(csl.dtype)
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k if cu_seqlens_k.dim() == 2 else cu_seqlens_k.view(1, -1)
        cu[:rows, 0] = 0
        cu[:rows, 1 : B + 1] = torch.cumsum(lens, dim=1).to(cu.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens
