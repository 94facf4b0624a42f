"""Per-branch page tables: tree drafts for single-pass paged consumers (TRT-LLM MLA, FlashMLA).

Consumers that take one page list per query row and have no cascade can still serve ``K > 1``
draft decode if every branch gets a row of its own. Over slot layout B (design §1), branch row
``r = b·K + t`` lists the request's full prefix pages, then the pages of the branch's own
region, whose first ``lpl_b`` slots hold the prefix tail (the real last partial page for
``t = 0``, a copy made by ``prefix_tail_copy_pairs`` + ``move_kv_cache`` for ``t ≥ 1``)::

    page_table[r, c]      = row_b[c·ps] // ps                               c < L_b // ps
    page_table[r, P0 + c] = row_b[base_b + t·nnp_b·ps + c·ps] // ps          c < nnp_b
    page_table[r, c]      = fill_value                                      beyond
    seq_lens_k[s, r]      = L_b + s + 1                                     s < rows

so logical position ``q < L_b + S`` of branch ``t`` sits on page ``page_table[r, q // ps]`` at
offset ``q % ps``. One formula covers every layout: with ``ps == 1`` the region of branch ``t``
is ``L_b + t·S`` (layout A), with ``K == 1`` it continues the prefix, and a row then equals the
request's own page row. A row uses ``ceil((L_b + S) / ps)`` columns.

The rows may be in another id space (design §2.10): page ids of ``E`` positions each
(``entry_page_size``), virtual ids through a page map (``v2p``). ``row_b[p]`` above is then the
id the row names at position ``p`` as emitted, ``row_b[p // E]·E + p mod E`` and through
``v2p[id // ps]·ps + id mod ps``; an id that does not map gives page 0 and ``BAD_KV_ID``. The
branch regions are read through the row too: in a virtual pool their draft slots are virtual in
the row (``assign_draft_cache_locs(v2p=)`` emits them physical, the table translates them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import draft_pages_per_branch
from ..launch import Launcher, cdiv, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    branch_page,
    branch_pages_ref,
    check_batch,
    check_id_spaces,
    check_steps,
    chunk_programs,
    host_int,
    id_space_arguments,
    load_request,
    row_offset,
)

__all__ = [
    "bind_branch_page_table",
    "branch_page_table",
    "branch_page_table_ref",
    "branch_page",
    "branch_pages_ref",
]


# Columns one program writes per iteration for all K rows of its request (page tables are ps
# times narrower than token lists).
_BLOCK = 256


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "num_rows", "W",
        "stride_pt", "stride_sl", "fill_value", "chunk_programs", "num_pages",
    ]
)  # fmt: skip
def _branch_page_table_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    page_table_ptr,  # [≥B*K, W] int32|int64, row stride stride_pt
    seq_lens_k_ptr,  # [≥rows, ≥B*K] int32|int64, row stride stride_sl
    v2p_ptr,  # [num_pages] int32|int64: virtual → physical pages (None unless TRANSLATE)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    page_size,
    num_rows,
    W,
    stride_pt,
    stride_sl,
    fill_value,
    chunk_programs,
    num_pages,  # v2p's pages (None unless TRANSLATE)
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_PTR: tl.constexpr,  # next power of two ≥ S*K
    ENTRY_PAGE_SIZE: tl.constexpr,  # E > 1: rows of page ids (design §2.10)
    TRANSLATE: tl.constexpr,  # ids leave through v2p, at the pool's page size
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` writes column chunks ``c, c +
    chunk_programs, …`` of the ``K`` rows of request ``b`` (prefix pages loaded once);
    ``(b, 0)`` also writes ``seq_lens_k`` and the status."""
    b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    valid = b < B
    pos_bad = (b * 0).to(tl.int32)  # a scalar tensor: the loops OR into it
    unmapped = pos_bad  # a page stored whose id did not map
    c0 = tl.arange(0, BLOCK).to(tl.int64)
    for chunk in range(pid_c, tl.cdiv(W, BLOCK), chunk_programs):
        col = c0 + chunk * BLOCK
        in_w = tl.where(valid, col < W, False)
        for t in tl.static_range(TOPK):
            page, used, bad, wrong = branch_page(
                req_to_token_ptr, row_base, row_ok, L, t, col, W_row, page_size, v2p_ptr,
                num_pages, NUM_STEPS, ENTRY_PAGE_SIZE, TRANSLATE,
            )  # fmt: skip
            val = tl.where(used, page, fill_value)
            row = page_table_ptr + row_offset(b * TOPK + t, stride_pt)
            tl.store(row + col, val, mask=in_w)
            pos_bad |= tl.max((bad & in_w).to(tl.int32), axis=0)
            if ENTRY_PAGE_SIZE > 1 or TRANSLATE:  # a plain row's ids all map
                unmapped |= tl.max((wrong & in_w).to(tl.int32), axis=0)

    if pid_c == 0:
        f = tl.arange(0, BLOCK_PTR)
        s = f // TOPK
        z = b * TOPK + f % TOPK
        tl.store(
            seq_lens_k_ptr + row_offset(s, stride_sl) + z,
            L + s + 1,
            mask=tl.where(valid, s < num_rows, False),
        )
    if HAS_STATUS:
        nnp = (L % page_size + NUM_STEPS + page_size - 1) // page_size
        over = tl.where(valid, L // page_size + nnp > W, False) & (pid_c == 0)
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where((pos_bad != 0) | ~L_ok, POS_OOB, 0)
            | tl.where(over, OUT_OF_CAPACITY, 0)
            | tl.where(unmapped != 0, BAD_KV_ID, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_branch_page_table_launch = Launcher(_branch_page_table_kernel)


def _prepare(where, req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size,
             num_rows, page_table, seq_lens_k, max_seq_len, status, entry_page_size,
             v2p):  # fmt: skip
    topk, num_steps, page_size, rows = check_steps(topk, num_steps, page_size, num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    _, _, E = check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    if page_table is None:
        # A row of W_row entries covers W_row·E positions (design §2.10).
        width = cdiv(req_to_token.shape[1] * E, page_size)
        page_table = torch.empty((B * topk, width), dtype=torch.int32, device=device)
    if seq_lens_k is None:
        seq_lens_k = torch.empty((rows, B * topk), dtype=torch.int32, device=device)
    validate.tensor("page_table", page_table, ndim=2, device=device)
    validate.tensor("seq_lens_k", seq_lens_k, ndim=2, device=device)
    validate.at_least("page_table", page_table.shape[0], B * topk, "rows (B*topk)")
    validate.at_least("seq_lens_k", seq_lens_k.shape[0], rows, "rows")
    validate.at_least("seq_lens_k", seq_lens_k.shape[1], B * topk, "columns (B*topk)")
    if max_seq_len is not None:
        host_int("max_seq_len", max_seq_len)
        # L // ps + nnp(L) == ceil((L + S) / ps), monotone in L.
        need = max_seq_len // page_size + draft_pages_per_branch(max_seq_len, num_steps, page_size)
        validate.at_least("page_table", page_table.shape[1], need, "columns (ceil((L+S)/ps))")
    status = validate.status(status, device)
    return topk, num_steps, page_size, rows, B, page_table, seq_lens_k, status, E


def bind_branch_page_table(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    seq_lens_k: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
) -> Stage:
    """Bind once: build one page row per draft branch and its per-step KV lengths, in one launch.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps``.
    num_rows : int, optional
        Steps of ``seq_lens_k`` to write, ``0 ≤ rows ≤ S`` (default ``S``); the table itself
        covers all ``S`` draft slots.
    fill_value : int
        Written to every column past a row's ``ceil((L_b + S) / ps)`` pages: 0 (the sink page)
        for FlashMLA-style consumers, −1 for TRT-LLM MLA.
    page_table : torch.Tensor, optional
        ``[≥ B·K, W]`` int32 or int64; rows ``[0, B·K)`` are written over all ``W`` columns;
        pages past ``W`` are dropped and reported. Allocated ``[B·K, ceil(W_row·E / ps)]``
        int32 when omitted.
    seq_lens_k : torch.Tensor, optional
        ``[≥ rows, ≥ B·K]`` int32 or int64: ``seq_lens_k[s, b·K + t] = L_b + s + 1``.
    max_seq_len : int, optional
        Host-side ``max L_b``; when given, ``page_table`` is checked before launch.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (a page start past the row's ``W_row·E``
        positions, or a negative length), ``OUT_OF_CAPACITY``, ``BAD_KV_ID`` (a page stored
        whose id did not map: written as page 0).
    entry_page_size : int
        ``E ≥ 1``: with ``E > 1`` the rows hold page ids, position ``p`` at
        ``row[p // E]·E + p mod E`` (design §2.10). Default 1, rows of token ids.
    v2p : torch.Tensor, optional
        ``[P]`` int32 or int64 virtual → physical page map at page size ``ps``: column ``c``
        holds the physical page of the id at the column's first position. Default ``None``.

    Returns
    -------
    Stage
        Its result is ``(page_table, seq_lens_k)`` (tuple of torch.Tensor), what the eager
        :func:`branch_page_table` returns.

    Examples
    --------
    ``seq_lens=[5]``, ``K=2``, ``S=2``, ``ps=4``: ``lpl=1``, ``nnp=1``; row 0 =
    ``[row[0]//4, row[4]//4]``, row 1 = ``[row[0]//4, row[8]//4]`` (its region's page, slot
    ``row[8]`` holding the copy of position 4); ``seq_lens_k=[[6, 6], [7, 7]]``.

    Grid ``(max(B, 1), chunk_programs)``. No host sync; ``B``, lengths, widths and strides are
    runtime arguments.
    """
    topk, num_steps, page_size, rows, B, page_table, seq_lens_k, status, E = _prepare(
        "branch_page_table", req_pool_indices, req_to_token, seq_lens, topk, num_steps,
        page_size, num_rows, page_table, seq_lens_k, max_seq_len, status, entry_page_size, v2p,
    )  # fmt: skip
    if B == 0:
        return Stage([], result=(page_table, seq_lens_k))
    device = req_to_token.device
    W = page_table.shape[1]
    grid = (B, chunk_programs(device, B, W, _BLOCK))
    launch = _branch_page_table_launch.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        page_table_ptr=page_table,
        seq_lens_k_ptr=seq_lens_k,
        status_ptr=status,
        page_size=page_size,
        num_rows=rows,
        W=W,
        stride_pt=page_table.stride(0),
        stride_sl=seq_lens_k.stride(0),
        fill_value=fill_value,
        chunk_programs=grid[1],
        TOPK=topk,
        NUM_STEPS=num_steps,
        BLOCK=_BLOCK,
        BLOCK_PTR=next_power_of_2(num_steps * topk),
        **id_space_arguments(E, v2p),
        HAS_STATUS=True,
        num_warps=4,
    )
    return Stage([launch], result=(page_table, seq_lens_k))


branch_page_table = launcher(bind_branch_page_table)
branch_page_table.kernels = (_branch_page_table_kernel,)  # for specmeta.registry


def branch_page_table_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    seq_lens_k: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`branch_page_table` (vectorised; syncs)."""
    topk, num_steps, page_size, rows, B, page_table, seq_lens_k, status, E = _prepare(
        "branch_page_table_ref", req_pool_indices, req_to_token, seq_lens, topk, num_steps,
        page_size, num_rows, page_table, seq_lens_k, max_seq_len, status, entry_page_size, v2p,
    )  # fmt: skip
    if B == 0:
        return page_table, seq_lens_k
    W = page_table.shape[1]
    # One column more than the table: a used page past W is what the kernel drops and reports.
    pages, used, bad, unmapped, bits = branch_pages_ref(
        req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, W + 1,
        entry_page_size=E, v2p=v2p,
    )  # fmt: skip
    if bool(bad[:, :, :W].any()):
        bits |= int(Status.POS_OOB)
    if bool(unmapped[:, :, :W].any()):  # only the pages stored count
        bits |= int(Status.BAD_KV_ID)
    table = torch.where(used, pages, fill_value).reshape(B * topk, W + 1)
    page_table[: B * topk] = table[:, :W].to(page_table.dtype)
    if bool(used[:, :, W].any()):
        bits |= int(Status.OUT_OF_CAPACITY)
    if bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    L = seq_lens.to(torch.int64).clamp_min(0).repeat_interleave(topk)
    s = torch.arange(rows, device=seq_lens.device).view(-1, 1)
    seq_lens_k[:rows, : B * topk] = (L.view(1, -1) + s + 1).to(seq_lens_k.dtype)
    if bits:
        status |= bits
    return page_table, seq_lens_k
