"""The one kernel behind the FA3 page-table ops (design §2.3): the normal pass, the expand pass,
or both in one launch.

:func:`~specmeta.kernels.prefix_page_table` launches it with ``NORMAL`` alone,
:func:`~specmeta.kernels.expand_page_table` with ``EXPAND`` alone and
:func:`~specmeta.kernels.draft_decode_page_tables` with both, so each pass's arguments are
listed once, in :func:`page_tables_kernel`'s signature, and each pass's launch keywords once,
in :func:`normal_pass` and :func:`expand_pass`. A launch passes ``None`` for the arguments of a
pass it does not run: Triton takes a ``None`` as a constant and the disabled pass compiles to
nothing.

A shared module rather than one of the three op modules, which each hold a launcher and a
reference and import the kernel from here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..launch import Launch, Launcher, next_power_of_2
from ._common import (
    BAD_KV_ID,
    BAD_PAGE,
    OUT_OF_CAPACITY,
    POOL_OOB,
    POS_OOB,
    ROW_OOB,
    id_space_arguments,
    load_request,
    row_offset,
    vector_widths,
)
from ._window import page_window_arguments, rail_floor, tree_prefix_start, window_page_ids

__all__ = [
    "NO_EXPAND",
    "NO_NORMAL",
    "bind_page_tables",
    "expand_pass",
    "normal_pass",
    "page_tables_kernel",
]


# --------------------------------------------------------------------------------------------
# Normal pass: request b's table over its own row.
# --------------------------------------------------------------------------------------------
@triton.jit
def _covered_len(L, page_size, extra_tokens, EXCLUDE_LAST_PARTIAL: tl.constexpr):
    """``len`` of step row 0 for a prefix ``L ≥ 0``: ``L (− L mod ps) + extra_tokens``."""
    if EXCLUDE_LAST_PARTIAL:
        L = L - L % page_size
    return L + extra_tokens


@triton.jit
def _tree_covered(L, length, rail, depth, PAGE_SIZE: tl.constexpr, TREE: tl.constexpr):
    """``(first, length)``: where a normal pass's table starts and the tokens it covers. A
    window layer's tree cascade (``TREE``, design §2.10) lists only ``[P0, length)``, the
    prefix every query row reads (``P0`` a page boundary, or past ``length``: nothing);
    ``(0, length)`` otherwise."""
    if TREE:
        first = tl.minimum(tree_prefix_start(L, rail, depth, PAGE_SIZE), length)
        return first, length - first
    else:
        return L * 0, length


@triton.jit
def _gather_pages(req_to_token_ptr, row_base, row_ok, page_table_ptr, out_base, filled, W,
                  W_row, fill_value, first_chunk, chunk_step, status_ptr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, VEC_IN: tl.constexpr,
                  VEC_OUT: tl.constexpr, HAS_STATUS: tl.constexpr):  # fmt: skip
    """``out[col] = row[col·ps] // ps`` for ``col < filled``, ``fill_value`` up to ``W``, over
    column chunks ``first_chunk, first_chunk + chunk_step, …``, where ``row`` starts at
    ``req_to_token_ptr + row_base`` and ``out`` at ``page_table_ptr + out_base``; a negative
    slot reads page 0 and sets ``POOL_OOB``. (The two pointers are formed here: ``tl.multiple_of``
    marks the operation that computes a pointer, which a function's argument does not have.)

    Per-lane work is kept to a compare, an address and a select (a 4 MiB table at ps = 1 is a
    million lanes): the row's bounds fold into scalar limits, and columns are int32 (a table of
    2**31 columns is not a thing) added to 64-bit row pointers."""
    filled = filled.to(tl.int32)  # ≤ W: columns that hold a page, then fill_value
    readable = tl.where(row_ok, tl.minimum(filled, tl.cdiv(W_row, PAGE_SIZE)), 0)
    loadable = readable
    writable = W
    row_ptr = req_to_token_ptr + row_base
    out_ptr = page_table_ptr + out_base  # int64: B·W passes 2**31 at page size 1
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
    for chunk in range(first_chunk, tl.cdiv(W, BLOCK), chunk_step):
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


@triton.jit
def _gather_page_ids(req_to_token_ptr, row_base, row_ok, page_table_ptr, out_base, filled, W,
                     W_row, fill_value, first_chunk, chunk_step, status_ptr, v2p_ptr, num_pages,
                     floor, full_to_swa_ptr, full_size, shift, PAGE_SIZE: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_STATUS: tl.constexpr,
                     ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
                     TO_WINDOW: tl.constexpr):  # fmt: skip
    """:func:`_gather_pages` over a row in another id space or of a window layer
    (design §2.10; :func:`~specmeta.kernels._window.window_page_ids`): column ``col`` holds the page of
    the id emitted at the first position of its page at or past ``floor`` (a row of page ids,
    a virtual id through ``v2p``, a full-pool id through ``full_to_swa``), for ``col <
    filled``, then ``fill_value``; a page wholly below ``floor`` is the sink page 0 and no
    fault; an id that does not map is the sink page 0 and sets ``BAD_KV_ID``, a plain row's
    negative slot ``POOL_OOB``. Column ``col`` reads the row's page ``col + shift`` (a window
    tree's normal pass starts at page ``shift``, design §2.10). Scalar loads: a page row's
    positions are not consecutive entries, and a translated id needs its map entry."""
    filled = filled.to(tl.int32)  # ≤ W: columns that hold a page, then fill_value
    row_ptr = req_to_token_ptr + row_base
    out_ptr = page_table_ptr + out_base  # int64: B·W passes 2**31 at page size 1
    col0 = tl.arange(0, BLOCK)
    for chunk in range(first_chunk, tl.cdiv(W, BLOCK), chunk_step):
        col = col0 + chunk * BLOCK
        pages, bad, negative = window_page_ids(
            row_ptr, col + shift, tl.where(row_ok, col < filled, False), floor, W_row, v2p_ptr,
            num_pages, full_to_swa_ptr, full_size, PAGE_SIZE, ENTRY_PAGE_SIZE, TRANSLATE,
            TO_WINDOW,
        )  # fmt: skip
        tl.store(out_ptr + col, tl.where(col < filled, pages, fill_value), mask=col < W)
        if HAS_STATUS:
            bad_any = tl.max(bad.to(tl.int32), axis=0)
            tl.atomic_or(status_ptr, BAD_KV_ID, mask=bad_any != 0, sem="relaxed")
            neg_any = tl.max(negative.to(tl.int32), axis=0)
            tl.atomic_or(status_ptr, POOL_OOB, mask=neg_any != 0, sem="relaxed")


@triton.jit
def _normal_cu_seqlens(seq_lens_ptr, cu_seqlens_k_ptr, B, extra_tokens, num_rows, W, stride_cu,
                       rail, depth, EXCLUDE_LAST_PARTIAL: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_B: tl.constexpr, WRITE_CU: tl.constexpr,
                       TREE: tl.constexpr):  # fmt: skip
    """``cu_seqlens_k[r, :B + 1]`` of every row ``r < num_rows``: the exclusive scan of
    ``min(len_b + r, W·ps)``, closing entry included, by one program for the whole batch (int64
    sums: ΣL passes 2**31 for large batches of long contexts). A program of its own, so that no
    gathering program waits for a block-wide reduction after its gather: on an H200 a sum per
    request in the programs that gather cost the B = 256, ps = 1 FA3 build 0.5 µs, and a batch
    of one 0.35 µs. Nothing unless ``WRITE_CU``."""
    if not WRITE_CU:
        return
    cap = W.to(tl.int64) * PAGE_SIZE
    offs = tl.arange(0, BLOCK_B)
    # The first BLOCK_B lengths (all of them up to B = 1024) once for every row.
    L_head = tl.maximum(tl.load(seq_lens_ptr + offs, mask=offs < B, other=0).to(tl.int64), 0)
    len_head = _covered_len(L_head, PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL)
    _, len_head = _tree_covered(L_head, len_head, rail, depth, PAGE_SIZE, TREE)
    for r in range(0, num_rows):
        row = cu_seqlens_k_ptr + row_offset(r, stride_cu)
        own = tl.where(offs < B, tl.minimum(len_head + r, cap), 0)
        # Entry b is the inclusive scan less request b's own length; entry B (own 0) closes.
        tl.store(row + offs, tl.cumsum(own, axis=0) - own, mask=offs <= B)
        carry = tl.sum(own, axis=0)
        for first in range(BLOCK_B, B + 1, BLOCK_B):  # B ≥ BLOCK_B only
            more = first + offs
            L_more = tl.load(seq_lens_ptr + more, mask=more < B, other=0).to(tl.int64)
            L_more = tl.maximum(L_more, 0)
            len_more = _covered_len(L_more, PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL)
            _, len_more = _tree_covered(L_more, len_more, rail, depth, PAGE_SIZE, TREE)
            own = tl.where(more < B, tl.minimum(len_more + r, cap), 0)
            tl.store(row + more, carry + tl.cumsum(own, axis=0) - own, mask=more <= B)
            carry += tl.sum(own, axis=0)


# --------------------------------------------------------------------------------------------
# Expand pass: every step of request b's K branch rows.
# --------------------------------------------------------------------------------------------
@triton.jit
def _chain_slot(out_cache_loc_ptr, first, t, j, live, NUM_STEPS: tl.constexpr):
    """Slots ``out_cache_loc[(first + t)·S + j]`` where ``live``, 0 elsewhere; a negative slot
    reads 0. Returns ``(slot, negative)``."""
    slot = tl.load(out_cache_loc_ptr + (first + t) * NUM_STEPS + j, mask=live, other=0)
    slot = slot.to(tl.int64)
    neg = live & (slot < 0)
    return tl.where(neg, 0, slot), neg


@triton.jit
def _lpl_sum_before(seq_lens_ptr, b, PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr):
    """``Σ_{b'<b} lpl_b'`` in int64. The first BLOCK_B lengths (all of them up to B = 1024) in
    straight-line code, so the load goes out with the caller's loads before it; a load in the
    loop only goes out once every load above has arrived (the loop is a separate block,
    entered after their first use)."""
    head = tl.arange(0, BLOCK_B)
    L_head = tl.load(seq_lens_ptr + head, mask=head < b, other=0).to(tl.int64)
    total = tl.sum(tl.where(head < b, tl.maximum(L_head, 0) % PAGE_SIZE, 0), axis=0)
    for start in range(BLOCK_B, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        prev_L = tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64)
        total += tl.sum(tl.where(before, tl.maximum(prev_L, 0) % PAGE_SIZE, 0), axis=0)
    return total


@triton.jit
def _page_runs(slot, prev, in_rows, lpl, j, c, PAGE_SIZE: tl.constexpr):
    """Collapse each branch's chain slots ``[K, S (j), 1]`` into runs of one page:
    ``(run_page [K, 1, S (c)], limit [K, S, 1], bad_page)`` — the page that opens run ``c``, the
    data columns of step ``s = j`` (extra runs dropped) and whether any branch breaks the slot
    layout."""
    page = slot // PAGE_SIZE
    new = in_rows & ((j == 0) | (prev // PAGE_SIZE != page))
    runs = tl.cumsum(new.to(tl.int32), axis=1)  # distinct pages among j' ≤ j
    u = (lpl + j + PAGE_SIZE) // PAGE_SIZE  # ceil((lpl + s + 1) / ps) for step s = j
    # The layout check skips sink slots (0): a padded request's chain is all sink (design §4)
    # and is consistent as it is; a real draft slot never lies on page 0.
    real = in_rows & (slot != 0)
    bad = real & ((slot % PAGE_SIZE != (lpl + j) % PAGE_SIZE) | (runs != u))
    bad_page = tl.max(bad.to(tl.int32)) != 0
    limit = tl.minimum(runs, u)  # [K, S, 1]: data columns of step s; extra runs dropped
    # run_page[t, c]: the page of the chain slot j that opened run c of branch t.
    hit = new & (runs - 1 == c)  # [K, S (j), S (c)]
    run_page = tl.sum(tl.where(hit, page, 0), axis=1)[:, None, :]  # [K, 1, S (c)]
    return run_page, limit, bad_page


@triton.jit
def _window_prefix_pages(L, s, rail, depth, PAGE_SIZE: tl.constexpr):
    """``(a, n, floor)`` of a window layer's tree, draft step ``s`` (design §2.10): a branch
    row's expand pass lists the ``n`` row pages ``a … a + n − 1`` (from the page of its read
    floor ``max(0, L + s − w + 1)`` up to where the normal pass starts, ``min(P0, L − lpl)``),
    then its branch's own pages; ``L ≥ 0``, shapes broadcast."""
    first = tl.minimum(tree_prefix_start(L, rail, depth, PAGE_SIZE), L - L % PAGE_SIZE)
    c0 = first // PAGE_SIZE
    floor = tl.maximum(L + s - rail + 1, 0)
    a = tl.minimum(c0, floor // PAGE_SIZE)
    return a, c0 - a, floor


@triton.jit
def _prefix_pages_before(seq_lens_ptr, b, rail, depth, PAGE_SIZE: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """``Σ_{b'<b} n_{b', s}`` for every step ``s < BLOCK_S`` (:func:`_window_prefix_pages`),
    int64 ``[BLOCK_S]``, from whole-vector loads of ``seq_lens``."""
    steps = tl.arange(0, BLOCK_S)[None, :]
    total = tl.zeros([BLOCK_S], dtype=tl.int64)
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)[:, None]
        before = offs < b
        prev = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        _, n, _ = _window_prefix_pages(prev, steps, rail, depth, PAGE_SIZE)
        total += tl.sum(tl.where(before, n, 0), axis=0)
    return total


@triton.jit
def _store_window_branch_tables(base, run_page, limit, in_rows, c, W, a, n, floor, row_ptr,
                                row_ok, W_row, v2p_ptr, num_pages, full_to_swa_ptr, full_size,
                                n_max, PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
                                ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
                                TO_WINDOW: tl.constexpr):  # fmt: skip
    """:func:`_store_branch_tables` of a window layer's tree (design §2.10): columns ``[0, n)``
    the row pages ``a …`` (:func:`~specmeta.kernels._window.window_page_ids` from the step's
    floor: window-pool pages), then the branch's pages from column ``n``, then 0 to ``W``.
    Returns ``(bad, negative)`` of the row pages read."""
    bad = tl.max(tl.max(tl.max(n, axis=2), axis=1), axis=0).to(tl.int32) * 0  # scalar flags
    negative = bad
    for p0 in range(0, n_max, BLOCK_W):
        pc = p0 + tl.arange(0, BLOCK_W)[None, None, :]
        need = tl.where(row_ok, pc < n, False)  # [1, S, BLOCK_W]
        pages, lost, neg = window_page_ids(row_ptr, a + pc, need, floor, W_row, v2p_ptr,
                                           num_pages, full_to_swa_ptr, full_size, PAGE_SIZE,
                                           ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        tl.store(base + pc, pages, mask=in_rows & (pc < n) & (pc < W))
        bad |= tl.max(tl.max(tl.max(lost.to(tl.int32), axis=2), axis=1), axis=0)
        negative |= tl.max(tl.max(tl.max(neg.to(tl.int32), axis=2), axis=1), axis=0)
    tl.store(base + n + c, tl.where(c < limit, run_page, 0), mask=in_rows & (n + c < W))
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)[None, None, :]
        tl.store(base + cols, tl.zeros([BLOCK_K, BLOCK_S, BLOCK_W], tl.int32),
                 mask=in_rows & (cols >= n + limit) & (cols < W))  # fmt: skip
    return bad != 0, negative != 0


@triton.jit
def _store_branch_tables(base, run_page, limit, in_rows, c, W, BLOCK_K: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """Page-table tiles ``[branch t, step s, column c]`` from row pointers ``base [K, S, 1]``:
    the ``c``-th distinct page of branch ``t`` for ``c < limit[t, s]``, then 0; columns from
    ``BLOCK_S`` on (a table wider than the steps) only hold 0."""
    tl.store(base + c, tl.where(c < limit, run_page, 0), mask=in_rows & (c < W))
    for c0 in range(BLOCK_S, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)[None, None, :]
        tl.store(base + cols, tl.zeros([BLOCK_K, BLOCK_S, BLOCK_W], tl.int32),
                 mask=in_rows & (cols < W))  # fmt: skip


# --------------------------------------------------------------------------------------------
# The kernel.
# --------------------------------------------------------------------------------------------
@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "extra_tokens", "fill_value", "num_rows", "W",
        "stride_pt", "stride_cs", "stride_cu", "chunk_programs", "num_pages", "full_size", "rail",
        "depth", "expand_rows", "expand_prefix_pages",
        "W_expand", "stride_ept_s", "stride_ept_r", "stride_ecs", "stride_ecu",
    ]
)  # fmt: skip
def page_tables_kernel(
    # both passes
    seq_lens_ptr,  # [B] int32|int64
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    # normal pass
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    page_table_ptr,  # [≥B, W] int32|int64, row stride stride_pt
    cache_seqlens_ptr,  # [≥rows, ≥B] int32|int64, row stride stride_cs
    cu_seqlens_k_ptr,  # [≥rows, ≥B+1] int32|int64, row stride stride_cu (unless WRITE_CU)
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE), or None
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
    num_pages,  # v2p's pages (None unless TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64 full -> window pool map (read with TO_WINDOW)
    full_size,
    rail,  # the window read rail w, 0 for none (None for a full layer: read with WINDOW_LAYER)
    depth,  # a window tree cascade's depth bound D (read with TREE)
    # expand pass
    out_cache_loc_ptr,  # [≥B*K*S] int32|int64, laid out [B, K, S]
    expand_page_table_ptr,  # [≥rows, ≥B*K, W_expand] int32|int64, strides (stride_ept_s, _r, 1)
    expand_cache_seqlens_ptr,  # [≥rows, ≥B*K] int32|int64, row stride stride_ecs
    expand_cu_seqlens_k_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_ecu
    expand_rows,
    expand_prefix_pages,  # the most row pages a window tree's expand row lists (with TREE)
    W_expand,
    stride_ept_s,
    stride_ept_r,
    stride_ecs,
    stride_ecu,
    # what runs
    NORMAL: tl.constexpr,
    EXPAND: tl.constexpr,  # with NORMAL: the cascade, whose normal pass has one plain row
    # both passes
    PAGED: tl.constexpr,  # PAGE_SIZE > 1
    PAGE_SIZE: tl.constexpr,  # a config constant: // and % by it compile to shifts or multiplies
    BLOCK_B: tl.constexpr,  # seq_lens entries per iteration of the prefix sums
    HAS_STATUS: tl.constexpr,
    # normal pass
    EXCLUDE_LAST_PARTIAL: tl.constexpr,
    BLOCK: tl.constexpr,  # page-table columns per iteration
    VEC_IN: tl.constexpr,  # req_to_token entries per 16 B when rows allow vector loads, else 1
    VEC_OUT: tl.constexpr,  # page_table entries per 16 B when rows allow vector stores, else 1
    WRITE_CU: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,  # E > 1: rows of page ids (design §2.10)
    TRANSLATE: tl.constexpr,  # ids leave through v2p, at the pool's page size PAGE_SIZE
    TO_WINDOW: tl.constexpr,  # ids leave through full_to_swa: a window layer's pages
    WINDOW_LAYER: tl.constexpr,  # a rail or a map (design §2.10): columns by window_page_ids
    TREE: tl.constexpr,  # a window layer's tree cascade: the table starts at P0 (design §2.10)
    # expand pass
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two ≥ K: branch t
    BLOCK_S: tl.constexpr,  # next power of two ≥ S: chain index j, step s, data column c
    BLOCK_W: tl.constexpr,  # columns per tile of zeros past column BLOCK_S
    WRITE_EXPAND_CU: tl.constexpr,
):
    """The normal pass, the expand pass, or both (design §2.3); neither reads what the other
    writes.

    * ``NORMAL`` alone, grid ``(B + 1, chunk_programs)``: program ``(b, c)`` with ``b < B``
      writes column chunks ``c, c + chunk_programs, …`` of request ``b``'s table, and with
      ``c == 0`` also ``cache_seqlens[:, b]`` and the status; program ``(B, 0)`` writes
      ``cu_seqlens_k`` (entry 0 alone when ``B = 0``), the other programs of row ``B`` nothing.
    * ``EXPAND`` alone, grid ``(max(B, 1),)``: program ``b`` writes every step of the ``K``
      branch rows of request ``b``; the last request also writes the closing
      ``expand_cu_seqlens_k`` entries (entry 0 when ``B == 0``).
    * Both, grid ``(B + 1, chunk_programs + 1)``: the columns ``c < chunk_programs`` are the
      normal pass's programs, the last column's rows ``b < max(B, 1)`` the expand pass's. The
      normal pass is then the cascade's: one row, no extra tokens, fill 0 (``extra_tokens``,
      ``fill_value``, ``num_rows``, ``stride_cs`` and ``stride_cu`` are not read).

    The expand pass's tiles are 3-D, ``[branch t, chain index j or step s, column c]`` with
    size-1 axes where a value does not depend on one, so that Triton keeps them all in one
    register layout (no shared-memory round trip between them). Every load is issued before the
    first store (the compiler cannot move a load above a store through a pointer that may
    alias) and, up to B = 1024, before the first use of a loaded value: all of them are in
    flight together."""
    b = tl.program_id(0)
    if NORMAL:
        c = tl.program_id(1)
    if NORMAL and EXPAND:
        in_normal = c < chunk_programs
        # The cascade's normal pass: literal sizes that Triton folds.
        extra_tokens = 0
        fill_value = 0
        num_rows = 1
        stride_cs = 0
        stride_cu = 0
    else:
        in_normal: tl.constexpr = NORMAL  # annotated: a plain assignment would make a tensor

    if in_normal:
        req = b.to(tl.int64)  # req·stride_pt (below) passes 2**31
        if req < B:
            row_base, L, row_ok, L_ok = load_request(
                req_pool_indices_ptr, seq_lens_ptr, req, B, R, stride_row
            )
            length = _covered_len(L, PAGE_SIZE, extra_tokens, EXCLUDE_LAST_PARTIAL)
            first, length = _tree_covered(L, length, rail, depth, PAGE_SIZE, TREE)
            shift = first // PAGE_SIZE  # a page boundary wherever a page is listed
            # The table serves every row s < num_rows (length + s tokens): it covers the longest.
            longest = length + num_rows - 1
            if PAGED:
                pages_wanted = (longest + PAGE_SIZE - 1) // PAGE_SIZE
            else:
                pages_wanted = longest
            pages = tl.minimum(pages_wanted, W)
            # A sequence never claims more tokens than its table holds: cache_seqlens ≤ W·ps.
            cap = W.to(tl.int64) * PAGE_SIZE
            if ENTRY_PAGE_SIZE == 1 and not TRANSLATE and not WINDOW_LAYER:
                _gather_pages(
                    req_to_token_ptr, row_base, row_ok, page_table_ptr, req * stride_pt, pages,
                    W, W_row, fill_value, c, chunk_programs, status_ptr, PAGED, PAGE_SIZE,
                    BLOCK, VEC_IN, VEC_OUT, HAS_STATUS,
                )  # fmt: skip
            else:
                # A window layer's columns below its read floor are never read (design §2.10).
                floor = rail_floor(L, rail) if WINDOW_LAYER else L * 0
                _gather_page_ids(
                    req_to_token_ptr, row_base, row_ok, page_table_ptr, req * stride_pt, pages,
                    W, W_row, fill_value, c, chunk_programs, status_ptr, v2p_ptr, num_pages,
                    floor, full_to_swa_ptr, full_size, shift, PAGE_SIZE, BLOCK, HAS_STATUS,
                    ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
                )  # fmt: skip
            if c == 0:
                for r in range(0, num_rows):
                    tl.store(cache_seqlens_ptr + row_offset(r, stride_cs) + req,
                             tl.minimum(length + r, cap))  # fmt: skip
                if HAS_STATUS:
                    last_pos = (shift + pages - 1) * PAGE_SIZE
                    # A row of W_row entries holds W_row·E positions (design §2.10).
                    pos_bad = ((pages > 0) & (last_pos >= W_row * ENTRY_PAGE_SIZE)) | ~L_ok
                    bits = (
                        tl.where(row_ok, 0, ROW_OOB)
                        | tl.where(pos_bad, POS_OOB, 0)
                        | tl.where(pages_wanted > W, OUT_OF_CAPACITY, 0)
                    )
                    tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")
        elif c == 0:
            _normal_cu_seqlens(
                seq_lens_ptr, cu_seqlens_k_ptr, B, extra_tokens, num_rows, W, stride_cu, rail,
                depth, EXCLUDE_LAST_PARTIAL, PAGE_SIZE, BLOCK_B, WRITE_CU, TREE,
            )  # fmt: skip
    # With both passes, the last column's rows b < max(B, 1), tested only there.
    elif (b < tl.maximum(B, 1)) if NORMAL else True:
        req = b.to(tl.int64)  # first·S and branch-row products are int64 from here
        live = req < B
        first = req * TOPK  # branch row of t = 0
        L = tl.load(seq_lens_ptr + req, mask=live, other=0).to(tl.int64)
        t = tl.arange(0, BLOCK_K)[:, None, None]
        j = tl.arange(0, BLOCK_S)[None, :, None]  # chain index j; also step s of the tiles
        col = tl.arange(0, BLOCK_S)[None, None, :]  # column c: data columns are < rows ≤ S
        in_rows = tl.where(live, (t < TOPK) & (j < expand_rows), False)  # [K, S, 1]
        # Every step's slot is loaded, built or not, so that a negative one is always reported;
        # the steps past expand_rows feed nothing else.
        in_steps = tl.where(live, (t < TOPK) & (j < NUM_STEPS), False)  # [K, S, 1]
        if PAGED:
            slot, neg = _chain_slot(out_cache_loc_ptr, first, t, j, in_steps, NUM_STEPS)
            # The previous slot gathered again rather than shifted out of `slot`: the two
            # loads are in flight together, a shift would wait for the first one.
            prev, _neg_prev = _chain_slot(out_cache_loc_ptr, first, t, j - 1, in_rows & (j >= 1),
                                          NUM_STEPS)  # fmt: skip
        else:
            # Every slot is its own page (duplicates are not collapsed): column c of every
            # step is chain slot c, gathered straight into the column axis. Columns past
            # expand_rows are never stored.
            in_cols = tl.where(live, (t < TOPK) & (col < NUM_STEPS), False)  # [K, 1, S]
            run_page, neg = _chain_slot(out_cache_loc_ptr, first, t, col, in_cols, NUM_STEPS)
        lpl_before = req * 0  # Σ_{b'<b} lpl_b' (0 when ps == 1), int64
        if WRITE_EXPAND_CU and PAGED:
            lpl_before += _lpl_sum_before(seq_lens_ptr, req, PAGE_SIZE, BLOCK_B)

        L_ok = L >= 0
        L = tl.maximum(L, 0)
        if PAGED:
            lpl = L % PAGE_SIZE
            run_page, limit, bad_page = _page_runs(slot, prev, in_rows, lpl, j, col, PAGE_SIZE)
        else:
            lpl = L * 0
            bad_page = False
            limit = j + 1
        seqlen = lpl + j + 1 + 0 * t  # [K, S, 1]: cache_seqlens of step s = j

        # step·(Bp·K·W) passes 2**31 only for huge tables
        base = expand_page_table_ptr + (first + t) * stride_ept_r + row_offset(j, stride_ept_s)
        if TREE:
            # A window layer's tree (design §2.10): the row pages from the step's read floor
            # up to the normal pass's start, then the branch's own pages.
            row_base, _, row_ok, _ = load_request(req_pool_indices_ptr, seq_lens_ptr, req, B,
                                                  R, stride_row)  # fmt: skip
            a, n_pre, floor = _window_prefix_pages(L, j, rail, depth, PAGE_SIZE)  # [1, S, 1]
            seqlen += n_pre * PAGE_SIZE
            pre_bad, pre_neg = _store_window_branch_tables(
                base, run_page, limit, in_rows, col, W_expand, a, n_pre, floor,
                req_to_token_ptr + row_base, row_ok, W_row, v2p_ptr, num_pages, full_to_swa_ptr,
                full_size, expand_prefix_pages, PAGE_SIZE, BLOCK_K, BLOCK_S, BLOCK_W,
                ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
            )  # fmt: skip
        else:
            _store_branch_tables(base, run_page, limit, in_rows, col, W_expand, BLOCK_K, BLOCK_S,
                                 BLOCK_W)  # fmt: skip
        rows = first + t  # [K, 1, 1] branch rows
        tl.store(expand_cache_seqlens_ptr + row_offset(j, stride_ecs) + rows, seqlen,
                 mask=in_rows)  # fmt: skip
        if WRITE_EXPAND_CU:
            # cu[s, r] = Σ_{r'<r} (lpl_r' + s + 1) = K·Σ_{b'<b} lpl_b' + t·lpl_b + r·(s+1),
            # int64 throughout.
            if TREE:
                pre_before = _prefix_pages_before(seq_lens_ptr, req, rail, depth, PAGE_SIZE,
                                                  BLOCK_B, BLOCK_S)[None, :, None]  # fmt: skip
                # Σ over earlier requests' rows of lpl + n·ps, then this request's earlier rows.
                before = TOPK * (lpl_before + pre_before * PAGE_SIZE)  # [1, S, 1]
                cu_start = before + (seqlen - j - 1) * t + rows * (j + 1)
            else:
                cu_start = TOPK * lpl_before + t * lpl + rows * (j + 1)
            cu_rows = expand_cu_seqlens_k_ptr + row_offset(j, stride_ecu)
            tl.store(cu_rows + rows, cu_start, mask=in_rows)
            # Closing entry cu[s, B·K] = cu[s, B·K − 1] + cache_seqlens[s, B·K − 1], from the
            # last request's last branch (0 when B == 0).
            last = req == tl.maximum(B, 1) - 1
            closing = tl.where(live, cu_start + seqlen, 0)
            at_end = tl.where(last, (t == TOPK - 1) & (j < expand_rows), False)
            tl.store(cu_rows + B * TOPK + 0 * t, closing, mask=at_end)

        if HAS_STATUS:
            neg_any = tl.max(neg.to(tl.int32)) != 0
            bits = (
                tl.where(live & ~L_ok, POS_OOB, 0)
                | tl.where(neg_any, POOL_OOB, 0)
                | tl.where(bad_page, BAD_PAGE, 0)
            )
            if TREE:
                bits |= tl.where(pre_bad, BAD_KV_ID, 0) | tl.where(pre_neg, POOL_OOB, 0)
            tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_launch = Launcher(page_tables_kernel)

#: Launch keywords of a launch without the normal pass, or without the expand pass: unread
#: (the compile check builds its configurations from them too).
NO_NORMAL = dict(
    req_pool_indices_ptr=None, req_to_token_ptr=None, page_table_ptr=None,
    cache_seqlens_ptr=None, cu_seqlens_k_ptr=None, R=None, W_row=None, stride_row=None,
    extra_tokens=None, fill_value=None, num_rows=None, W=None, stride_pt=None, stride_cs=None,
    stride_cu=None, chunk_programs=None, NORMAL=False, EXCLUDE_LAST_PARTIAL=None, BLOCK=None,
    VEC_IN=None, VEC_OUT=None, WRITE_CU=None, v2p_ptr=None, num_pages=None,
    ENTRY_PAGE_SIZE=None, TRANSLATE=None, full_to_swa_ptr=None, full_size=None, rail=None,
    TO_WINDOW=None, WINDOW_LAYER=None, depth=None, TREE=None,
)  # fmt: skip
NO_EXPAND = dict(
    out_cache_loc_ptr=None, expand_page_table_ptr=None, expand_cache_seqlens_ptr=None,
    expand_cu_seqlens_k_ptr=None, expand_rows=None, expand_prefix_pages=None, W_expand=None, stride_ept_s=None,
    stride_ept_r=None, stride_ecs=None, stride_ecu=None, EXPAND=False, TOPK=None,
    NUM_STEPS=None, BLOCK_K=None, BLOCK_S=None, BLOCK_W=None, WRITE_EXPAND_CU=None,
)  # fmt: skip


def normal_pass(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, page_table: torch.Tensor,
    cache_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None, *, page_size: int,
    exclude_last_partial: bool, extra_tokens, fill_value, num_rows, stride_cs, stride_cu,
    chunk_programs: int, block: int, entry_page_size: int = 1, v2p: torch.Tensor | None = None,
    rail: int = 0, full_to_swa: torch.Tensor | None = None, tree_depth: int | None = None,
) -> dict:  # fmt: skip
    """The normal pass's launch keywords (the launcher checked the buffers). ``extra_tokens``,
    ``fill_value``, ``num_rows``, ``stride_cs`` and ``stride_cu`` are ``None`` in the cascade,
    whose normal pass has them as literals. ``entry_page_size`` and ``v2p``: the rows' id space
    (design §2.10), ``v2p`` at the pool's page size ``page_size``; ``rail`` (``w``, 0 for none)
    and ``full_to_swa``: a window layer's table (design §2.10); ``tree_depth`` (``D``, with a
    rail): a window layer's tree cascade, whose table starts at ``P0`` (design §2.10)."""
    return dict(
        req_pool_indices_ptr=req_pool_indices,
        req_to_token_ptr=req_to_token,
        page_table_ptr=page_table,
        cache_seqlens_ptr=cache_seqlens,
        cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
        R=req_to_token.shape[0],
        W_row=req_to_token.shape[1],
        stride_row=req_to_token.stride(0),
        extra_tokens=extra_tokens,
        fill_value=fill_value,
        num_rows=num_rows,
        W=page_table.shape[1],
        stride_pt=page_table.stride(0),
        stride_cs=stride_cs,
        stride_cu=stride_cu,
        chunk_programs=chunk_programs,
        NORMAL=True,
        EXCLUDE_LAST_PARTIAL=exclude_last_partial,
        BLOCK=block,
        **vector_widths(req_to_token, page_table, page_size),
        WRITE_CU=cu_seqlens_k is not None,
        **id_space_arguments(entry_page_size, v2p),
        **page_window_arguments(rail, full_to_swa),
        depth=tree_depth,
        TREE=tree_depth is not None,
    )


def expand_pass(
    out_cache_loc: torch.Tensor, page_table: torch.Tensor, cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None, *, topk: int, num_steps: int, rows: int,
    prefix_pages: int | None = None,
) -> dict:  # fmt: skip
    """The expand pass's launch keywords (the launcher checked the buffers). ``prefix_pages``:
    a window layer's tree (the fused launch's normal pass has ``tree_depth``), the most row
    pages an expand row lists before its branch's (design §2.10)."""
    W = page_table.shape[2]
    return dict(
        out_cache_loc_ptr=out_cache_loc,
        expand_page_table_ptr=page_table,
        expand_cache_seqlens_ptr=cache_seqlens,
        expand_cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
        expand_rows=rows,
        expand_prefix_pages=prefix_pages,
        W_expand=W,
        stride_ept_s=page_table.stride(0),
        stride_ept_r=page_table.stride(1),
        stride_ecs=cache_seqlens.stride(0),
        stride_ecu=cu_seqlens_k.stride(0) if cu_seqlens_k is not None else 0,
        EXPAND=True,
        TOPK=topk,
        NUM_STEPS=num_steps,
        BLOCK_K=next_power_of_2(topk),
        BLOCK_S=next_power_of_2(num_steps),
        # W ≥ rows ≥ 1 wherever the pass has work; a 1-wide tile where it has none.
        BLOCK_W=min(next_power_of_2(max(W, 1)), 16),
        WRITE_EXPAND_CU=cu_seqlens_k is not None,
    )


def bind_page_tables(
    grid: tuple, seq_lens: torch.Tensor, status: torch.Tensor, *, page_size: int, block_b: int,
    num_warps: int, normal: dict | None = None, expand: dict | None = None,
) -> Launch | functools.partial:  # fmt: skip
    """The launch of :func:`page_tables_kernel` on ``grid`` with the keywords of
    :func:`normal_pass` and/or :func:`expand_pass` (at least one), bound (not launched)."""
    return _launch.bind(
        grid,
        seq_lens_ptr=seq_lens,
        status_ptr=status,
        B=seq_lens.shape[0],
        **(normal or NO_NORMAL),
        **(expand or NO_EXPAND),
        PAGED=page_size > 1,
        PAGE_SIZE=page_size,
        BLOCK_B=block_b,
        HAS_STATUS=True,
        num_warps=num_warps,
    )
