"""Draft-decode CSR kv_indices / kv_indptr for page-size-1 consumers, all steps in one launch
(design §2.2).

For step row ``s`` (``it = s + 1``) and branch ``z = b·K + t``::

    kv_indptr[s, z] = K·Σ_{b'<b} L_b' + t·L_b + z·it            for z in [0, B·K]
    kv_indices[s, kv_indptr[s, z] + k]       = row_b[k]           for k < L_b   (the prefix)
    kv_indices[s, kv_indptr[s, z] + L_b + j] = row_b[p(b, t, j)]  for j < it    (its own chain)

Everything is derived from ``seq_lens``, so padded requests stay self-consistent. Entries of a
row past ``K·ΣL + B·K·it`` are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import uses_layout_b
from ..launch import Launcher, cdiv, next_power_of_2
from ..stage import Stage, launcher
from ._common import (
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    check_batch,
    check_id_spaces,
    check_steps,
    draft_slot_position,
    host_int,
    load_request,
    offsets_out,
    sizing_total,
    target_programs,
)
from ._window import check_window, rail_draft_need
from .draft_decode_kv_ids import bind_draft_decode_kv_ids, draft_decode_kv_ids_ref

__all__ = [
    "DraftDecodeIndptr",
    "bind_draft_decode_kv_indices",
    "draft_decode_kv_indices",
    "draft_decode_kv_indices_ref",
    "draft_decode_kv_indptr",
]


# Prefix entries a program loads per iteration and stores into each of its lists. 1024 int32
# entries keep 8 elements a thread in flight at 4 warps.
_BLOCK = 1024
# seq_lens entries summed per iteration of a program's exclusive-prefix loop (one vector load
# covers every batch up to 1024 requests).
_BLOCK_B = 1024
# Lists of one request a program fills from each chunk it loads: one load then feeds this many
# stores, so a program waits on one load per chunk, not one per list. (On an H200, 16 or all of
# a request's lists did no better, and a larger edge tile slowed the small launches.)
_LISTS_PER_PROGRAM = 8
# Warps per program: 4 keeps 8 entries a thread in flight at BLOCK = 1024.
_NUM_WARPS = 4
# Programs per multiprocessor the grid aims at.
_PROGRAMS_PER_SM = 8
# Most chunks of a row one program copies: rows are split further even when the grid already
# holds the target number of programs. Rows of more than _LONG_ROW_CHUNKS chunks take one chunk
# a program, so that many programs write neighbouring chunks at once (B = 256, K = 8, 32k: 93 %
# of copy bandwidth with one, 88 % with two, 66 % with all 33 in one program); shorter rows take
# two, so that a program's fixed work (its request, the prefix sum, the edges) is shared.
_MAX_CHUNKS = 2
_LONG_ROW_CHUNKS = 8
# Store each list's 16-byte-aligned body in vectors when the launch's lists can hold
# _VECTOR_STORES_MIN entries: vectors lift the large launches by 10-15 points of copy
# bandwidth, and scalar stores finish the small latency-bound ones 0.4 us sooner.
# All knobs were swept on an H200 with scripts/tune_kv_indices.py.
_VECTOR_STORES_MIN = 1 << 22


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "num_rows",
        "W_idx", "stride_idx", "stride_ptr", "chunk_programs", "lists_per_program",
        "vector_stores",
    ]
)  # fmt: skip
def _draft_decode_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    kv_indices_ptr,  # [≥rows, W_idx] int32|int64, row stride stride_idx
    kv_indptr_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_ptr
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
    chunk_programs,
    lists_per_program,
    vector_stores,  # 0: scalar stores; else bodies in VEC-entry vectors
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_LISTS: tl.constexpr,  # next power of two ≥ lists_per_program
    BLOCK_EDGE: tl.constexpr,  # next power of two ≥ 2·VEC + S
    VEC: tl.constexpr,  # kv_indices entries per 16 bytes
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(chunk_programs, list_groups, max(B, 1))``: program ``(c, g, b)`` owns lists
    ``d ∈ [g·lists_per_program, (g+1)·lists_per_program)`` (``d = s·K + t``: step ``s``,
    branch ``t``) of request ``b``. For each prefix chunk ``c, c + chunk_programs, …`` it loads
    the chunk once and stores it into every list it owns, so a program waits on one load per
    chunk whatever the number of lists; neighbouring programs write neighbouring chunks, so
    the device sees long sequential write streams. Programs with ``c == 0`` then write every
    owned list's edges (the entries before and after its vector-aligned body), its own chain,
    its ``kv_indptr`` entry and its status bits, all lists at once."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    cum = _lengths_before(seq_lens_ptr, b, BLOCK_B)
    head = TOPK * cum  # K·Σ_{b'<b} L_b', 64-bit: K·ΣL passes 2**31 at long contexts
    d_first = g * lists_per_program
    d_end = tl.minimum(d_first + lists_per_program, num_rows * TOPK)
    src = req_to_token_ptr + row_base
    vector = vector_stores != 0

    # Loads of the edge-and-chain tile go out before the bodies' loads, its stores after the
    # bodies' stores, so a short list costs one memory round trip, not two.
    d, live_d, list_off, start, s_d, t_d, room, pos, j, keep, edge = _edge_tile(
        src, c, b, B, L, head, row_ok, d_first, d_end, W_row, W_idx, stride_idx, page_size,
        vector, TOPK, NUM_STEPS, LAYOUT_B, BLOCK_LISTS, BLOCK_EDGE, VEC,
    )  # fmt: skip
    # No list stores past W_idx, which bounds the loop whatever L is.
    src_lim = tl.where(row_ok, tl.minimum(L, W_row), 0)  # loads past the row give 0
    n_chunks = tl.cdiv(tl.minimum(L, W_idx), BLOCK)
    # Each path takes its own lane offsets, so the compiler gives each its own register layout
    # (four entries a thread for vectors, one for coalesced scalar stores).
    if vector:
        _vector_bodies(src, src_lim, n_chunks, c, chunk_programs, d_first, d_end, b, L, head,
                       W_idx, stride_idx, kv_indices_ptr, TOPK, BLOCK, VEC)  # fmt: skip
    else:
        _scalar_bodies(src, src_lim, n_chunks, c, chunk_programs, d_first, d_end, b, L, head,
                       W_idx, stride_idx, kv_indices_ptr, TOPK, BLOCK)  # fmt: skip
    dst = tl.where(j < 0, pos, L + j)  # entry within the list
    tl.store(kv_indices_ptr + list_off[:, None] + dst, edge, mask=keep)
    _write_indptr_and_status(
        kv_indptr_ptr, status_ptr, b, B, L, L_ok, row_ok, cum, start, d, live_d, s_d, t_d,
        room, W_row, stride_ptr, page_size, TOPK, NUM_STEPS, LAYOUT_B, HAS_STATUS,
    )  # fmt: skip


@triton.jit
def _lengths_before(seq_lens_ptr, b, BLOCK_B: tl.constexpr):
    """``Σ_{b'<b} max(L_b', 0)``: the first block is one vector load issued beside the
    request's own loads; batches past ``BLOCK_B`` requests loop over further blocks."""
    offs = tl.arange(0, BLOCK_B)
    prev = tl.load(seq_lens_ptr + offs, mask=offs < b, other=0).to(tl.int64)
    cum = tl.sum(tl.maximum(prev, 0), axis=0)
    for first in range(BLOCK_B, b, BLOCK_B):
        more = first + tl.arange(0, BLOCK_B)
        lens = tl.load(seq_lens_ptr + more, mask=more < b, other=0).to(tl.int64)
        cum += tl.sum(tl.maximum(lens, 0), axis=0)
    return cum


@triton.jit
def _edge_tile(
    src, c, b, B, L, head, row_ok, d_first, d_end, W_row, W_idx, stride_idx, page_size, vector,
    TOPK: tl.constexpr, NUM_STEPS: tl.constexpr, LAYOUT_B: tl.constexpr,
    BLOCK_LISTS: tl.constexpr, BLOCK_EDGE: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Load what programs with ``c == 0`` write besides the bodies, one tile row per owned
    list ``d``: lanes ``[0, VEC)`` are the entries before the list's 16-byte-aligned body,
    ``[VEC, 2·VEC)`` those after it, ``[2·VEC, 2·VEC + S)`` its own chain (``j ≤ s``) after
    its prefix. Other programs compute the tile with every lane masked off (no memory traffic,
    no branch). Returns the lists' ``(d, live_d, list_off, start, s_d, t_d, room)`` and the
    tile's ``(pos, j, keep, edge)``."""
    d = d_first + tl.arange(0, BLOCK_LISTS).to(tl.int64)
    live_d = tl.where(c == 0, d < d_end, False)
    list_off, start, lim, head_n = _list_extent(d, b, L, head, W_idx, stride_idx, TOPK, VEC)
    # Scalar stores leave no edge before or after the body: the body is the whole prefix.
    head_n = tl.where(vector, head_n, 0)
    s_d = d // TOPK
    t_d = d % TOPK
    room = W_idx - start  # entries left in the row; stores past it are dropped
    body_end = tl.where(vector, head_n + (lim - head_n) // VEC * VEC, lim)
    live_b = b < B
    e = tl.arange(0, BLOCK_EDGE)[None, :]
    j = e - 2 * VEC  # chain step of the chain lanes
    is_head = e < VEC
    is_tail = (e >= VEC) & (j < 0)
    chain_pos = draft_slot_position(L, t_d[:, None], j, page_size, NUM_STEPS, LAYOUT_B)
    pos = tl.where(is_head, e, tl.where(is_tail, body_end[:, None] + e - VEC, chain_pos))
    keep = tl.where(
        is_head,
        e < head_n[:, None],
        tl.where(
            is_tail,
            pos < lim[:, None],
            tl.where(live_b, (j <= s_d[:, None]) & (L + j < room[:, None]), False),
        ),
    )
    keep = keep & live_d[:, None]
    edge = tl.load(src + pos, mask=tl.where(row_ok, keep & (pos < W_row), False), other=0)
    return d, live_d, list_off, start, s_d, t_d, room, pos, j, keep, edge


@triton.jit
def _vector_bodies(
    src, src_lim, n_chunks, c, chunk_programs, d_first, d_end, b, L, head, W_idx, stride_idx,
    kv_indices_ptr, TOPK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """The prefix bodies in 16-byte vectors. A list starts anywhere in its row, so its aligned
    body begins ``h = 0 … VEC−1`` entries into the prefix: each chunk is loaded at every shift
    ``h`` (the extra loads hit L1) and each list stores the one that lines up with its vectors,
    with a mask uniform over each vector so the compiler emits 16-byte stores. One load of a
    chunk feeds every owned list. Lane offsets are int32 within a chunk, the chunk's base
    int64."""
    tl.static_assert(VEC <= 4, "four shifted loads cover vectors of at most 4 entries")
    k0 = tl.arange(0, BLOCK)
    for chunk in range(c, n_chunks, chunk_programs):
        base = tl.cast(chunk, tl.int64) * BLOCK
        row_chunk = src + base
        # The shifted loads reach VEC − 1 entries into the next chunk.
        n_load = tl.minimum(tl.maximum(src_lim - base, 0), BLOCK + VEC).to(tl.int32)
        v0 = tl.load(row_chunk + k0, mask=k0 < n_load, other=0)
        v1 = v0
        v2 = v0
        v3 = v0
        if VEC > 1:
            v1 = tl.load(row_chunk + k0 + 1, mask=k0 + 1 < n_load, other=0)
        if VEC > 2:
            v2 = tl.load(row_chunk + k0 + 2, mask=k0 + 2 < n_load, other=0)
            v3 = tl.load(row_chunk + k0 + 3, mask=k0 + 3 < n_load, other=0)
        for dd in range(d_first, d_end):
            dd_off, _, dd_lim, dd_head = _list_extent(dd, b, L, head, W_idx, stride_idx, TOPK,
                                                      VEC)  # fmt: skip
            # Entries of this chunk in the list's body: a multiple of VEC, as is the body's
            # start, so the mask is uniform over each vector.
            body_n = (dd_lim - dd_head) // VEC * VEC
            n_store = tl.multiple_of(
                tl.minimum(tl.maximum(body_n - base, 0), BLOCK).to(tl.int32), VEC
            )
            body_ptr = kv_indices_ptr + tl.multiple_of(dd_off + dd_head, VEC) + base
            v = tl.where(
                dd_head == 0, v0, tl.where(dd_head == 1, v1, tl.where(dd_head == 2, v2, v3))
            )
            # Streaming stores (.cs, evict first): lists this large (16 MB and more) are not
            # kept in L2 for the consumer anyway, and on an H200 the hint lifts the 40-80 MB
            # launches from 73-75 % to 77-87 % of copy bandwidth.
            tl.store(body_ptr + k0, v, mask=k0 < n_store, cache_modifier=".cs")


@triton.jit
def _scalar_bodies(
    src, src_lim, n_chunks, c, chunk_programs, d_first, d_end, b, L, head, W_idx, stride_idx,
    kv_indices_ptr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The prefix bodies in coalesced scalar stores: the whole prefix is the body."""
    lane = tl.arange(0, BLOCK)
    for chunk in range(c, n_chunks, chunk_programs):
        base = tl.cast(chunk, tl.int64) * BLOCK
        n_load = tl.minimum(tl.maximum(src_lim - base, 0), BLOCK).to(tl.int32)
        v = tl.load(src + base + lane, mask=lane < n_load, other=0)
        for dd in range(d_first, d_end):
            dd_off, _, dd_lim, _ = _list_extent(dd, b, L, head, W_idx, stride_idx, TOPK, 1)
            n_store = tl.minimum(tl.maximum(dd_lim - base, 0), BLOCK).to(tl.int32)
            tl.store(kv_indices_ptr + dd_off + base + lane, v, mask=lane < n_store)


@triton.jit
def _write_indptr_and_status(
    kv_indptr_ptr, status_ptr, b, B, L, L_ok, row_ok, cum, start, d, live_d, s_d, t_d, room,
    W_row, stride_ptr, page_size, TOPK: tl.constexpr, NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr, HAS_STATUS: tl.constexpr,
):  # fmt: skip
    """``kv_indptr[s, b·K + t]`` = the list's start; the closing entry ``kv_indptr[s, B·K] =
    K·ΣL + B·K·(s+1)`` comes from the last request's branch 0 (entry 0 = 0 when ``B == 0``);
    then the lists' status bits."""
    live_b = b < B
    ptr_row = kv_indptr_ptr + s_d * stride_ptr
    tl.store(ptr_row + b * TOPK + t_d, start, mask=tl.where(live_b, live_d, False))
    last = tl.where(b == tl.maximum(B, 1) - 1, (t_d == 0) & live_d, False)
    end = TOPK * (cum + L) + B * TOPK * (s_d + 1)
    tl.store(ptr_row + B * TOPK, end, mask=last)
    if HAS_STATUS:
        # Positions grow with j: the chain's last one (j = s) decides whether any is past the
        # row. The atomic is masked per list, so nothing is issued when all is well.
        last_p = draft_slot_position(L, t_d, s_d, page_size, NUM_STEPS, LAYOUT_B)
        over = tl.where(live_b, L + s_d + 1 > room, False)
        pos_bad = tl.where(live_b, last_p >= W_row, False) | (L > W_row) | ~L_ok
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(pos_bad, POS_OOB, 0)
            | tl.where(over, OUT_OF_CAPACITY, 0)
        )
        bits = tl.where(live_d, bits, 0)
        tl.atomic_or(status_ptr + 0 * d, bits, mask=bits != 0, sem="relaxed")


_draft_decode_kv_indices_launch = Launcher(_draft_decode_kv_indices_kernel)


@triton.jit
def _list_extent(d, b, L, head, W_idx, stride_idx, TOPK: tl.constexpr, VEC: tl.constexpr):
    """``(list_off, start, lim, head_n)`` of list ``d = s·K + t`` of request ``b`` (``d`` a
    scalar or a vector): its offset in ``kv_indices``, its start in its step row
    ``kv_indptr[s, b·K + t] = head + t·L + (b·K + t)·(s+1)``, the prefix entries that fit in
    the row, and the entries before its first ``VEC``-aligned one."""
    s_d = d // TOPK
    t_d = d % TOPK
    start = head + t_d * L + (b * TOPK + t_d) * (s_d + 1)
    # step·row_width passes 2**31 at long contexts: the row offset is 64-bit.
    list_off = s_d.to(tl.int64) * stride_idx + start
    lim = tl.minimum(L, tl.maximum(W_idx - start, 0))
    head_n = tl.minimum((VEC - list_off % VEC) % VEC, lim)
    return list_off, start, lim, head_n


def _grid(
    device: torch.device, batch: int, lists: int, row_width: int
) -> tuple[int, int, int, int]:
    """``(chunk_programs, list_groups, requests, lists_per_program)``.

    A program owns up to ``_LISTS_PER_PROGRAM`` lists of one request (the groups balanced), and
    the chunks of a row are split over as many programs as it takes to reach the target
    number, with at most ``_MAX_CHUNKS`` (one for long rows) a program. Only host-known sizes
    enter: ``B``, the list count and the row width, never a device value.
    """
    target = target_programs(device, _PROGRAMS_PER_SM)
    requests = max(batch, 1)
    groups = cdiv(lists, max(1, min(lists, _LISTS_PER_PROGRAM)))
    per_program = cdiv(lists, groups)  # balance the groups
    row_chunks = cdiv(row_width, _BLOCK)
    most = 1 if row_chunks > _LONG_ROW_CHUNKS else _MAX_CHUNKS
    chunk_programs = max(cdiv(target, requests * groups), cdiv(row_chunks, most))
    return max(1, min(chunk_programs, row_chunks)), groups, requests, per_program


def _prepare(
    req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
    kv_indices, kv_indptr, seq_lens_sum, status, window_size, sink_size, entry_page_size, v2p,
    sliding_window_size, full_to_swa,
):  # fmt: skip
    """Validate and allocate; shared by the kernel launcher and the reference."""
    topk, num_steps, page_size, rows = check_steps(topk, num_steps, page_size, num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    where = "draft_decode_kv_indices"
    spaces = check_id_spaces(where, window_size, sink_size, entry_page_size, v2p, device)
    rail = check_window(where, sliding_window_size, full_to_swa, device, spaces[0])
    spaces = (*spaces, rail)
    if kv_indices is None:
        total = _windowed_total(sizing_total(seq_lens_sum, B, req_to_token), B, *spaces[:2])
        width = max(1, rail_draft_need(total, B, topk, rows, rail))
        kv_indices = torch.empty((rows, width), dtype=req_to_token.dtype, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty((rows, B * topk + 1), dtype=torch.int32, device=device)
    validate.tensor("kv_indices", kv_indices, ndim=2, device=device)
    validate.tensor("kv_indptr", kv_indptr, ndim=2, device=device)
    validate.at_least("kv_indices", kv_indices.shape[0], rows, "rows")
    validate.at_least("kv_indptr", kv_indptr.shape[0], rows, "rows")
    validate.at_least("kv_indptr", kv_indptr.shape[1], B * topk + 1, "columns (B*topk + 1)")
    if seq_lens_sum is not None:
        host_int("seq_lens_sum", seq_lens_sum)
        need = rail_draft_need(_windowed_total(seq_lens_sum, B, *spaces[:2]), B, topk, rows, rail)
        validate.at_least("kv_indices", kv_indices.shape[1], need, "columns (K*ΣLw + B*K*rows)")
    status = validate.status(status, device)
    return topk, num_steps, rows, B, kv_indices, kv_indptr, status, spaces


def _windowed_total(total: int, batch: int, window: int, sink: int) -> int:
    """The most prefix entries a batch of ``ΣL = total`` lists per branch: ``ΣL``, at most
    ``B·(window + sink)`` with a draft window."""
    return min(total, batch * (window + sink)) if window else total


def bind_draft_decode_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    num_rows: int | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    window_size: int = 0,
    sink_size: int = 0,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> Stage:
    """Bind once: build the per-branch KV lists of every draft step in one launch.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps`` (``ps`` places the draft slots, design §1).
    num_rows : int, optional
        Step rows to build, ``0 ≤ rows ≤ S`` (default ``S``; draft decode runs ``S − 1``
        forwards).
    kv_indices : torch.Tensor, optional
        ``[≥ rows, W_idx]`` int32 or int64 (unit stride in the last dimension). Row ``s`` uses
        ``K·ΣL + B·K·(s+1)`` entries; stores past ``W_idx`` are dropped and reported. Allocated
        (with ``req_to_token``'s dtype) when omitted, wide enough for full rows.
    kv_indptr : torch.Tensor, optional
        ``[≥ rows, ≥ B·K + 1]`` int32 or int64; entries ``[s, 0 … B·K]`` are written, entry 0
        included.
    seq_lens_sum : int, optional
        Host-side ``ΣL``. When given, ``kv_indices`` is checked before launch and a
        ``ValueError`` names what is needed and what there is.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB``, ``OUT_OF_CAPACITY``, ``BAD_KV_ID``.
    window_size, sink_size : int
        A draft window (design §2.10): each prefix lists its first ``min(sink_size, L)``
        tokens and then its most recent ones, ``min(L, window_size + sink_size)`` in all, and
        every offset and bound uses that count in place of ``L``. ``window_size = 0`` (the
        default) is no window, and ``sink_size`` is then not read.
    entry_page_size : int
        ``E > 1``: ``req_to_token`` rows hold page ids, position ``p`` being
        ``row[p // E]·E + p mod E`` (default 1: token ids).
    v2p : torch.Tensor, optional
        ``[P]`` int32 or int64 virtual → physical page map at page size ``page_size``: every
        id is emitted as ``v2p[id // ps]·ps + id mod ps``. Ids that do not map (negative, a
        page past the map, an unmapped page) give the sink slot 0 and ``BAD_KV_ID``.
    sliding_window_size, full_to_swa
        A window layer (design §2.10, :mod:`._window`): step ``s`` lists the last
        ``min(L + s + 1, w)`` entries of each branch's prefix and chain, and ``full_to_swa``
        (``[P_full]``, ``-1`` where evicted) emits every id in window-pool ids. Not with a draft window.

    Returns
    -------
    Stage
        Its result is ``(kv_indices, kv_indptr)`` (tuple of torch.Tensor), what the eager
        :func:`draft_decode_kv_indices` returns.

    Examples
    --------
    ``seq_lens=[3, 1]``, ``K=2``, one row (``it=1``) → ``kv_indptr=[0, 4, 8, 10, 12]``.

    The grid is sized from host-known sizes only (no host sync); ``B``, lengths and strides
    are runtime arguments. A window, ``E > 1`` or ``v2p`` launches the kernel of
    :mod:`.draft_decode_kv_ids` instead of the bandwidth-tuned one.
    """
    topk, num_steps, rows, B, kv_indices, kv_indptr, status, spaces = _prepare(
        req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
        kv_indices, kv_indptr, seq_lens_sum, status, window_size, sink_size, entry_page_size,
        v2p, sliding_window_size, full_to_swa,
    )  # fmt: skip
    if rows == 0:
        return Stage([], result=(kv_indices, kv_indptr))
    window, sink, entry, rail = spaces
    if window or entry > 1 or v2p is not None or rail or full_to_swa is not None:
        launch = bind_draft_decode_kv_ids(
            req_pool_indices, req_to_token, seq_lens, topk=topk, num_steps=num_steps,
            page_size=page_size, rows=rows, kv_indices=kv_indices, kv_indptr=kv_indptr,
            status=status, window=window, sink=sink, entry_page_size=entry, v2p=v2p, rail=rail,
            full_to_swa=full_to_swa,
        )  # fmt: skip
        return Stage([launch], result=(kv_indices, kv_indptr))
    device = req_to_token.device
    chunk_programs, groups, requests, lists_per_program = _grid(
        device, B, rows * topk, req_to_token.shape[1]
    )
    grid = (chunk_programs, groups, requests)
    vec = 16 // kv_indices.element_size()
    # Vector stores need shifted loads (see the kernel): worth it once the launch writes tens of
    # MB; below, the launch is latency-bound and scalar stores finish sooner.
    vector = B * rows * topk * req_to_token.shape[1] >= _VECTOR_STORES_MIN
    launch = _draft_decode_kv_indices_launch.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        kv_indices_ptr=kv_indices,
        kv_indptr_ptr=kv_indptr,
        status_ptr=status,
        page_size=page_size,
        num_rows=rows,
        W_idx=kv_indices.shape[1],
        stride_idx=kv_indices.stride(0),
        stride_ptr=kv_indptr.stride(0),
        chunk_programs=chunk_programs,
        lists_per_program=lists_per_program,
        vector_stores=int(vector),
        TOPK=topk,
        NUM_STEPS=num_steps,
        LAYOUT_B=uses_layout_b(topk, page_size),
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        BLOCK_LISTS=next_power_of_2(_LISTS_PER_PROGRAM),
        BLOCK_EDGE=next_power_of_2(2 * vec + num_steps),
        VEC=vec,
        HAS_STATUS=True,
        num_warps=_NUM_WARPS,
    )
    return Stage([launch], result=(kv_indices, kv_indptr))


draft_decode_kv_indices = launcher(bind_draft_decode_kv_indices)
draft_decode_kv_indices.kernels = (  # for specmeta.registry
    _draft_decode_kv_indices_kernel,
    bind_draft_decode_kv_ids.kernel,
)


class DraftDecodeIndptr:
    """``kv_indptr`` of :func:`draft_decode_kv_indices` in torch, its constants made once.

    ``kv_indptr[s, z] = base[z] + z·(s + 1)`` (design §2.2), ``base`` the offsets of the
    prefixes alone: ``K·Σ_{b'<b} L_b' + t·L_b``, the cumulative sum of every branch's prefix
    length. The table ``z·(s + 1)`` and the branch-to-request index are made here, so a call
    is three torch ops in one dtype into buffers made before; the FlashInfer host mirrors make
    one on every build.

    Parameters
    ----------
    topk : int
        ``K``.
    max_rows, max_batch : int
        The most step rows and requests a call writes.
    dtype : torch.dtype
        The integer dtype of the lengths read and the offsets written (int32 wraps as the
        kernel's int32 stores do: the sums are the same modulo 2**32).
    device : torch.device or str
        Where the lengths, and the offsets written, live.
    """

    def __init__(self, topk: int, max_rows: int, max_batch: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):  # fmt: skip
        validate.positive("topk", topk)
        validate.positive("max_rows", max_rows, 0)
        validate.positive("max_batch", max_batch, 0)
        if dtype not in validate.INDEX_DTYPES:
            raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        lists = max_batch * topk
        z = torch.arange(lists + 1, dtype=dtype, device=device)
        steps = torch.arange(1, max_rows + 1, dtype=dtype, device=device).view(-1, 1)
        self._ramp = steps * z  # [max_rows, B·K + 1]: z·(s + 1)
        self._branch_request = torch.arange(lists, device=device) // topk  # z → b
        self._lists = torch.empty(lists, dtype=dtype, device=device)
        self._base = torch.zeros(lists + 1, dtype=dtype, device=device)  # entry 0 stays 0
        self._topk, self._dtype, self._device = topk, dtype, torch.device(device)
        self._max = (max_rows, max_batch)
        self._views: dict[tuple, tuple] = {}

    def __call__(self, seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the offsets of ``seq_lens`` (``[B]`` of this object's dtype and device, every
        value ≥ 0; the values are not checked) into ``out``, ``[rows, B·K + 1]`` of this
        object's dtype and device (the caller's view of its own buffer, ``B`` and ``rows``
        within the maxima), and return ``out``. Shapes and dtypes are checked the first time
        they are seen, before anything is written."""
        key = (seq_lens.shape, seq_lens.dtype, out.shape, out.dtype)
        views = self._views.get(key)
        if views is None:
            validate.tensor("seq_lens", seq_lens, dtypes=(self._dtype,), ndim=1,
                            device=self._device, contiguous_last=False)  # fmt: skip
            views = self._views[key] = self.bind(seq_lens.shape[0], out)
        return self.write(views, seq_lens, out)

    def bind(self, batch: int, out: torch.Tensor) -> tuple:
        """The views a call of ``batch`` requests into ``out`` reads, after checking ``out``:
        a caller that writes into the same view on every call binds it once and passes the
        views to :meth:`write`."""
        validate.tensor("out", out, dtypes=(self._dtype,), ndim=2, device=self._device,
                        contiguous_last=False)  # fmt: skip
        (rows, B), (max_rows, max_batch) = (out.shape[0], batch), self._max
        if B > max_batch or rows > max_rows:
            raise ValueError(
                f"DraftDecodeIndptr: {B} requests and {rows} rows, over the {max_batch} and "
                f"{max_rows} it was made for; make one with max_batch >= {B} and "
                f"max_rows >= {rows}"
            )
        n = B * self._topk
        if out.shape[1] != n + 1:
            raise ValueError(
                f"DraftDecodeIndptr: out has shape {list(out.shape)}; pass the [rows, B*topk + 1]"
                f" = [{rows}, {n + 1}] view of the buffer the offsets go into"
            )
        return (
            self._branch_request[:n],
            self._lists[:n],
            self._base[1 : n + 1],
            self._base[: n + 1],
            self._ramp[:rows, : n + 1],
        )

    @staticmethod
    def write(views: tuple, seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The three ops of a call into the ``out`` that :meth:`bind` made ``views`` for;
        ``seq_lens`` is ``[B]`` of the rule's dtype (``index_select`` refuses another dtype
        or a shorter tensor)."""
        branch_request, lists, tail, base, ramp = views
        torch.index_select(seq_lens, 0, branch_request, out=lists)  # each branch's L_b
        torch.cumsum(lists, 0, out=tail)
        return torch.add(base, ramp, out=out)


def draft_decode_kv_indptr(
    seq_lens: torch.Tensor, topk: int, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``kv_indptr`` of :func:`draft_decode_kv_indices` in torch: ``[rows, B·K + 1]``, list
    ``b·K + t`` of step ``s`` holding ``L_b + s + 1`` entries (negative lengths read as 0).
    Written into ``out[:rows, :B·K + 1]`` and returned as that view when ``out`` is given (any
    integer dtype), else returned in a new int64 tensor (:class:`DraftDecodeIndptr`)."""
    L = seq_lens.to(torch.int64).clamp_min(0)
    B = L.shape[0]
    validate.positive("topk", topk)
    offsets = offsets_out(out, rows, B * topk, L.device)
    rule = DraftDecodeIndptr(topk, rows, B, offsets.dtype, L.device)
    return rule(L.to(offsets.dtype), offsets)  # int32 sums wrap as int64 ones cast would


def draft_decode_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    num_rows: int | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    window_size: int = 0,
    sink_size: int = 0,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`draft_decode_kv_indices` (vectorised over the batch; syncs)."""
    topk, num_steps, rows, B, kv_indices, kv_indptr, status, spaces = _prepare(
        req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
        kv_indices, kv_indptr, seq_lens_sum, status, window_size, sink_size, entry_page_size,
        v2p, sliding_window_size, full_to_swa,
    )  # fmt: skip
    if rows:
        window, sink, entry, rail = spaces
        draft_decode_kv_ids_ref(
            req_pool_indices, req_to_token, seq_lens, topk=topk, num_steps=num_steps,
            page_size=page_size, rows=rows, kv_indices=kv_indices, kv_indptr=kv_indptr,
            status=status, window=window, sink=sink, entry_page_size=entry, v2p=v2p, rail=rail,
            full_to_swa=full_to_swa,
        )  # fmt: skip
    return kv_indices, kv_indptr
