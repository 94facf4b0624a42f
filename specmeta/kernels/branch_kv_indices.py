"""Per-branch page lists in CSR form, one row per draft step: tree drafts for FlashInfer with
``page_size > 1`` (its paged wrappers take ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len``, not a padded table).

Branch ``z = b·K + t`` at step ``s`` (``it = s + 1``) reads ``n_{b,s} = ceil((L_b + it) / ps)``
pages, the first ``n_{b,s}`` columns of its per-branch page row (see
:mod:`specmeta.kernels.branch_page_table`; the prefix-tail copies must be in place)::

    kv_indptr[s, z]                 = K·Σ_{b'<b} n_{b',s} + t·n_{b,s}      z in [0, B·K]
    kv_indices[s, kv_indptr[s,z] + c] = page c of branch (b, t)              c < n_{b,s}
    kv_last_page_len[s, z]          = (L_b + s) mod ps + 1

With ``ps == 1`` the rows equal :func:`draft_decode_kv_indices`' (layout A). The rows may be in
another id space (design §2.10): page ids of ``E`` positions each (``entry_page_size``) and
virtual ids through a page map (``v2p``); page ``c`` is then the physical page of the id its
first position names, and an id that does not map gives page 0 and ``BAD_KV_ID``.

A sliding-window layer (design §2.10) keeps the lists full length, as FA3's window tables do:
a page list cannot be cut inside a page, and the consumer plans FlashInfer's decode with its
own window, ``window_left = w − 1``, which hides every key a step does not read. With
``sliding_window_size = w`` a column whose page lies wholly below the read floor ``f_b =
max(0, L_b − w + 1)`` (the first position step 0 reads; later steps read less) holds the sink
page 0, nothing read; any other column holds the page of the id at the column's first
position at or after the floor, read through the row's space and then ``full_to_swa`` (the
window pool must page like the full pool: a full page's slots map to one window page at the
same offsets). ``kv_indptr`` and ``kv_last_page_len`` are a full layer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import branch_kv_indices_need
from ..launch import Launcher, cdiv, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    branch_position,
    branch_positions_ref,
    check_batch,
    check_id_spaces,
    check_steps,
    chunk_programs,
    host_int,
    list_offsets,
    load_kv_ids,
    load_kv_ids_ref,
    load_request,
    row_offset,
)
from ._window import (
    check_window,
    load_window_ids,
    load_window_ids_ref,
    rail_floor,
    rail_floor_ref,
    window_arguments,
)

__all__ = [
    "bind_branch_kv_indices",
    "branch_kv_indices",
    "branch_kv_indices_ref",
    "branch_kv_indptr",
]


# Page columns one program copies per iteration: page lists are ps times shorter than token
# lists, so a smaller block than the kv_indices kernels' keeps lanes busy.
_BLOCK = 256
# seq_lens entries summed per iteration of the per-step exclusive-prefix loop; the partial sums
# are a [BLOCK_ROWS, BLOCK_B] tile, kept small enough to stay in registers.
_BLOCK_B = 256
# Page columns per chunk when the grid is sized: programs per request are counted in chunks of
# 1024 columns, four of the kernel's blocks, so a program always has a few blocks to copy.
_CHUNK_COLUMNS = 1024


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "num_rows", "W_idx",
        "stride_idx", "stride_ptr", "stride_lpl", "chunk_programs", "num_pages", "full_size",
        "rail",
    ]
)  # fmt: skip
def _branch_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    kv_indices_ptr,  # [≥rows, W_idx] int32|int64, row stride stride_idx
    kv_indptr_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_ptr
    kv_last_page_len_ptr,  # [≥rows, ≥B*K] int32|int64, row stride stride_lpl
    v2p_ptr,  # [num_pages] int32|int64: virtual → physical pages (read only with TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64: full → window pool slots (read only with TO_WINDOW)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    page_size,
    num_rows,
    W_idx,
    stride_idx,
    stride_ptr,
    stride_lpl,
    chunk_programs,
    num_pages,
    full_size,
    rail,  # the window read rail w, 0 for none (read only with WINDOW_LAYER)
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,  # next power of two ≥ S
    BLOCK_K: tl.constexpr,  # next power of two ≥ K
    ENTRY_PAGE_SIZE: tl.constexpr,  # rows of page ids of E positions (1: token ids)
    TRANSLATE: tl.constexpr,  # ids through v2p (design §2.10)
    TO_WINDOW: tl.constexpr,  # ids through full_to_swa (design §2.10)
    WINDOW_LAYER: tl.constexpr,  # a rail or a map: the columns of a window layer's lists
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` copies page chunks ``c, c +
    chunk_programs, …`` of the ``K`` branches of request ``b`` into every step row; ``(b, 0)``
    also writes ``kv_indptr``, ``kv_last_page_len`` and the status."""
    b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    valid = b < B

    # heads[s] = K·Σ_{b'<b} ceil((L_b' + s + 1) / ps), int64 (K·ΣL passes 2**31).
    r = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    heads = r * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        prev = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        pages = (prev[None, :] + r[:, None] + page_size) // page_size
        heads += tl.sum(tl.where(before[None, :], pages, 0), axis=1)
    heads = heads * TOPK

    n_last = tl.where(valid, (L + num_rows - 1 + page_size) // page_size, 0)
    pos_bad = (b * 0).to(tl.int32)  # a scalar tensor: the loops OR into it
    unmapped = pos_bad  # an id stored that did not map
    c0 = tl.arange(0, BLOCK).to(tl.int64)
    # Columns past W_idx can hold nothing (every entry lands at or after its column), so the
    # loop stops there: a garbage length costs no more than a full buffer. The last used
    # column of the last branch holds the largest position, which decides POS_OOB whatever
    # the loop covered.
    lpl = L % page_size
    full = (L - lpl) // page_size
    nnp = (lpl + NUM_STEPS + page_size - 1) // page_size
    c_last = n_last - 1
    pos_last = tl.where(
        c_last < full, c_last * page_size, L - lpl + ((TOPK - 1) * nnp + c_last - full) * page_size
    )
    pos_bad |= ((n_last > 0) & (pos_last >= W_row * ENTRY_PAGE_SIZE)).to(tl.int32)
    floor = L * 0  # a window layer's read floor (design §2.10); 0 for a full layer
    if WINDOW_LAYER:
        floor = rail_floor(L, rail)
    for chunk in range(pid_c, tl.cdiv(tl.minimum(n_last, W_idx), BLOCK), chunk_programs):
        col = c0 + chunk * BLOCK
        for t in tl.static_range(TOPK):
            pos, used = branch_position(L, t, col, page_size, NUM_STEPS)
            need = used & (col < n_last)
            plain = need  # a window layer reads its columns below, from the floor on
            if WINDOW_LAYER:
                plain = need & False
            slot, in_row, wrong = load_kv_ids(
                req_to_token_ptr + row_base, pos, tl.where(row_ok, plain, False), W_row, v2p_ptr,
                num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,
            )  # fmt: skip
            page = slot // page_size
            if WINDOW_LAYER:
                # A page wholly below the floor is the sink page 0, nothing read; any other is
                # read at its first position from the floor on (design §2.10).
                read = need & ((col + 1) * page_size > floor)
                at = pos + tl.maximum(floor - col * page_size, 0)
                slot, _, wrong = load_window_ids(
                    req_to_token_ptr + row_base, at, tl.where(row_ok, read, False), W_row,
                    v2p_ptr, num_pages, page_size, full_to_swa_ptr, full_size, ENTRY_PAGE_SIZE,
                    TRANSLATE, TO_WINDOW,
                )  # fmt: skip
                page = tl.where(read, slot, 0) // page_size
            pos_bad |= tl.max((need & ~in_row).to(tl.int32), axis=0)
            for s in range(0, num_rows):
                n_s = (L + s + page_size) // page_size
                dst = tl.sum(tl.where(r == s, heads, 0), axis=0) + t * n_s + col
                stored = (col < n_s) & (dst < W_idx)
                tl.store(kv_indices_ptr + row_offset(s, stride_idx) + dst, page, mask=stored)
                unmapped |= tl.max((wrong & stored).to(tl.int32), axis=0)

    if pid_c == 0:
        tt = tl.arange(0, BLOCK_K)
        live_t = tl.where(valid, tt < TOPK, False)
        last = b == tl.maximum(B, 1) - 1
        for s in range(0, num_rows):
            n_s = tl.where(valid, (L + s + page_size) // page_size, 0)
            head = tl.sum(tl.where(r == s, heads, 0), axis=0)
            z = b * TOPK + tt
            tl.store(kv_indptr_ptr + row_offset(s, stride_ptr) + z, head + tt * n_s, mask=live_t)
            tl.store(
                kv_last_page_len_ptr + row_offset(s, stride_lpl) + z,
                tl.zeros_like(tt) + (L + s) % page_size + 1,
                mask=live_t,
            )
            # The closing entry [s, B·K], from the last program (entry 0 when B == 0).
            tl.store(
                kv_indptr_ptr + row_offset(s, stride_ptr) + B * TOPK + tt,
                head + TOPK * n_s + tt * 0,
                mask=tl.where(last, tt == 0, False),
            )
        if HAS_STATUS:
            over = valid & (
                tl.sum(tl.where(r == num_rows - 1, heads, 0), axis=0) + TOPK * n_last > W_idx
            )
            flags = tl.where(~L_ok, POS_OOB, 0) | tl.where(over, OUT_OF_CAPACITY, 0)
            tl.atomic_or(status_ptr, flags, mask=flags != 0, sem="relaxed")
    if HAS_STATUS:
        flags = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(pos_bad != 0, POS_OOB, 0)
            | tl.where(unmapped != 0, BAD_KV_ID, 0)
        )
        tl.atomic_or(status_ptr, flags, mask=flags != 0, sem="relaxed")


_branch_kv_indices_launch = Launcher(_branch_kv_indices_kernel)


def _prepare(
    where, req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
    kv_indices, kv_indptr, kv_last_page_len, seq_lens_sum, status, entry_page_size, v2p,
    sliding_window_size, full_to_swa,
):  # fmt: skip
    topk, num_steps, page_size, rows = check_steps(topk, num_steps, page_size, num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    _, _, E = check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    rail = check_window(where, sliding_window_size, full_to_swa, device)
    if kv_indices is None:
        # Without the host's ΣL, full rows: W_row entries of E positions each.
        total = seq_lens_sum if seq_lens_sum is not None else B * req_to_token.shape[1] * E
        width = max(1, branch_kv_indices_need(total, B, topk, rows, page_size))
        kv_indices = torch.empty((rows, width), dtype=torch.int32, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty((rows, B * topk + 1), dtype=torch.int32, device=device)
    if kv_last_page_len is None:
        kv_last_page_len = torch.empty((rows, B * topk), dtype=torch.int32, device=device)
    for name, t, cols in (
        ("kv_indices", kv_indices, 0),
        ("kv_indptr", kv_indptr, B * topk + 1),
        ("kv_last_page_len", kv_last_page_len, B * topk),
    ):
        validate.tensor(name, t, ndim=2, device=device)
        validate.at_least(name, t.shape[0], rows, "rows")
        validate.at_least(name, t.shape[1], cols, "columns")
    if seq_lens_sum is not None:
        total = host_int("seq_lens_sum", seq_lens_sum)
        need = branch_kv_indices_need(total, B, topk, rows, page_size)
        validate.at_least("kv_indices", kv_indices.shape[1], need,
                          "columns (K*(floor((ΣL + B*rows)/ps) + B))")  # fmt: skip
    status = validate.status(status, device)
    out = (kv_indices, kv_indptr, kv_last_page_len)
    return topk, num_steps, page_size, rows, B, out, status, (E, rail)


def bind_branch_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> Stage:
    """Bind once: build the per-branch page lists of every draft step in CSR form, in one launch.

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
        Step rows to build, ``0 ≤ rows ≤ S`` (default ``S``).
    kv_indices : torch.Tensor, optional
        ``[≥ rows, W_idx]`` int32 or int64 page ids; stores past ``W_idx`` are dropped and
        reported. Allocated int32 when omitted.
    kv_indptr : torch.Tensor, optional
        ``[≥ rows, ≥ B·K + 1]`` int32 or int64, in pages; entry 0 included.
    kv_last_page_len : torch.Tensor, optional
        ``[≥ rows, ≥ B·K]`` int32 or int64, in ``[1, ps]``.
    seq_lens_sum : int, optional
        Host-side ``ΣL``; when given, ``kv_indices`` is checked (against an upper bound)
        before launch.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB``, ``OUT_OF_CAPACITY``, ``BAD_KV_ID`` (a page
        stored whose id did not map: written as page 0).
    entry_page_size, v2p : int, torch.Tensor, optional
        The id space of the rows (design §2.10): rows of page ids of ``E`` positions each,
        and a ``[P]`` virtual → physical page map at page size ``ps``; the lists hold
        physical pages.
    sliding_window_size, full_to_swa
        A window layer (design §2.10): the lists keep their length, a column wholly below
        ``max(0, L_b − w + 1)`` holds the sink page 0 and any other the window-pool page of
        the id at its first position from there on (``full_to_swa``, ``[P_full]``, ``-1``
        where evicted; the window pool paging like the full pool). Plan the consumer with
        ``window_left = w − 1``.

    Returns
    -------
    Stage
        Its result is ``(kv_indices, kv_indptr, kv_last_page_len)`` (tuple of torch.Tensor), what
        the eager :func:`branch_kv_indices` returns.

    Examples
    --------
    ``seq_lens=[5]``, ``K=2``, ``S=2``, ``ps=4``, step 0 (6 tokens, 2 pages a branch):
    ``kv_indptr=[0, 2, 4]``, ``kv_indices=[row[0]//4, row[4]//4, row[0]//4, row[8]//4]``,
    ``kv_last_page_len=[2, 2]``.

    Grid ``(max(B, 1), chunk_programs)``. No host sync; ``B``, lengths and strides are runtime
    arguments.
    """
    topk, num_steps, page_size, rows, B, out, status, (E, rail) = _prepare(
        "branch_kv_indices", req_pool_indices, req_to_token, seq_lens, topk, num_steps,
        page_size, num_rows, kv_indices, kv_indptr, kv_last_page_len, seq_lens_sum, status,
        entry_page_size, v2p, sliding_window_size, full_to_swa,
    )  # fmt: skip
    window_layer = bool(rail) or full_to_swa is not None  # a full layer's launch as before
    if rows == 0:
        return Stage([], result=out)
    kv_indices, kv_indptr, kv_last_page_len = out
    device = req_to_token.device
    pages = cdiv(req_to_token.shape[1] * E, page_size)
    grid = (max(B, 1), chunk_programs(device, B, pages, _CHUNK_COLUMNS))
    launch = _branch_kv_indices_launch.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        kv_indices_ptr=kv_indices,
        kv_indptr_ptr=kv_indptr,
        kv_last_page_len_ptr=kv_last_page_len,
        v2p_ptr=v2p,
        **window_arguments(full_to_swa),
        rail=rail if window_layer else None,
        status_ptr=status,
        page_size=page_size,
        num_rows=rows,
        W_idx=kv_indices.shape[1],
        stride_idx=kv_indices.stride(0),
        stride_ptr=kv_indptr.stride(0),
        stride_lpl=kv_last_page_len.stride(0),
        chunk_programs=grid[1],
        num_pages=v2p.shape[0] if v2p is not None else 0,
        TOPK=topk,
        NUM_STEPS=num_steps,
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        BLOCK_ROWS=next_power_of_2(num_steps),
        BLOCK_K=next_power_of_2(topk),
        ENTRY_PAGE_SIZE=E,
        TRANSLATE=v2p is not None,
        WINDOW_LAYER=window_layer,
        HAS_STATUS=True,
        num_warps=4,
    )
    return Stage([launch], result=out)


branch_kv_indices = launcher(bind_branch_kv_indices)
branch_kv_indices.kernels = (_branch_kv_indices_kernel,)  # for specmeta.registry


def branch_kv_indptr(
    seq_lens: torch.Tensor,
    topk: int,
    rows: int,
    page_size: int,
    kv_indptr: torch.Tensor | None,
    kv_last_page_len: torch.Tensor,
) -> torch.Tensor:
    """``kv_indptr`` and ``kv_last_page_len`` of :func:`branch_kv_indices` in torch, written
    into the given buffers: branch ``b·K + t`` of step ``s`` holds ``ceil((L_b + s + 1) / ps)``
    pages, its last one ``(L_b + s) mod ps + 1`` tokens (negative lengths read as 0). The
    host mirrors call it on ``seq_lens_cpu``. Returns the offsets, a view of ``kv_indptr``, or
    new int64 offsets when ``kv_indptr`` is None (the reference places lists by these, and an
    int32 ``kv_indptr`` wraps past 2**31, as the kernel's does)."""
    L = seq_lens.to(torch.int64).clamp_min(0)
    B = L.shape[0]
    validate.tensor("kv_last_page_len", kv_last_page_len, ndim=2, contiguous_last=False)
    validate.at_least("kv_last_page_len", kv_last_page_len.shape[0], rows, "rows")
    validate.at_least("kv_last_page_len", kv_last_page_len.shape[1], B * topk, "columns")
    steps = torch.arange(rows, device=L.device).view(-1, 1)
    offsets = list_offsets((L.view(1, -1) + steps + page_size) // page_size, topk, kv_indptr)
    last = (L.view(1, -1) + steps) % page_size + 1
    kv_last_page_len[:rows, : B * topk] = last.repeat_interleave(topk, dim=1)
    return offsets


def branch_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`branch_kv_indices` (vectorised over the batch; syncs)."""
    topk, num_steps, page_size, rows, B, out, status, (E, rail) = _prepare(
        "branch_kv_indices_ref", req_pool_indices, req_to_token, seq_lens, topk, num_steps,
        page_size, num_rows, kv_indices, kv_indptr, kv_last_page_len, seq_lens_sum, status,
        entry_page_size, v2p, sliding_window_size, full_to_swa,
    )  # fmt: skip
    if rows == 0:
        return out
    kv_indices, kv_indptr, kv_last_page_len = out
    K, ps = topk, page_size
    L = seq_lens.to(torch.int64).clamp_min(0)
    n_last = (L + rows - 1 + ps) // ps
    # Page c of a list lands at start + c >= c: none past the output's width is kept, so the
    # work stops there whatever a garbage length says (design §2.5).
    width = min(int(n_last.max()), kv_indices.shape[1]) if B else 0
    pos, used = branch_positions_ref(seq_lens, K, num_steps, ps, width)
    c = torch.arange(width, device=L.device).view(1, 1, -1)
    need = used & (c < n_last.view(-1, 1, 1))
    slots, unmapped, bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos, need,
                                            entry_page_size=E, v2p=v2p, page_size=ps)  # fmt: skip
    pages = torch.where(need, slots // ps, 0)
    if rail or full_to_swa is not None:  # a window layer's columns, from the floor on
        floor = rail_floor_ref(L, rail).view(-1, 1, 1)
        read = need & ((c + 1) * ps > floor)
        at = torch.where(read, pos + (floor - c * ps).clamp_min(0), 0)
        slots, unmapped, _ = load_window_ids_ref(req_to_token, req_pool_indices, at, read,
                                                 entry_page_size=E, v2p=v2p, page_size=ps,
                                                 full_to_swa=full_to_swa)  # fmt: skip
        pages = torch.where(read, torch.div(slots, ps, rounding_mode="floor"), 0)
    bits &= int(Status.ROW_OOB)
    if bool((need & (pos >= req_to_token.shape[1] * E)).any()) or bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    W_idx = kv_indices.shape[1]
    zb = torch.arange(B * K, device=L.device) // K
    pages = pages.reshape(B * K, width)
    unmapped = unmapped.reshape(B * K, width)
    offsets = branch_kv_indptr(seq_lens, K, rows, ps, None, kv_last_page_len)
    kv_indptr[:rows, : B * K + 1] = offsets
    for s in range(rows):
        n = (L + s + ps) // ps  # [B]
        start = offsets[s, : B * K]
        dst = start.view(-1, 1) + c.view(1, -1)
        keep = (c.view(1, -1) < n[zb].view(-1, 1)) & (dst < W_idx)
        kv_indices[s][dst[keep]] = pages[keep].to(kv_indices.dtype)
        if bool((unmapped & keep).any()):
            bits |= int(Status.BAD_KV_ID)
        if B and K * int(n.sum()) > W_idx:
            bits |= int(Status.OUT_OF_CAPACITY)
    if bits:
        status |= bits
    return out
