"""Draft-decode CSR kv_indices / kv_indptr for page-size-1 consumers, all steps in one launch
(SPEC §2.2).

For step row ``s`` (``it = s + 1``) and branch ``z = b·K + t``::

    kv_indptr[s, z] = K·Σ_{b'<b} L_b' + t·L_b + z·it            for z in [0, B·K]
    kv_indices[s, kv_indptr[s, z] + k]       = row_b[k]           for k < L_b   (the prefix)
    kv_indices[s, kv_indptr[s, z] + L_b + j] = row_b[p(b, t, j)]  for j < it    (its own chain)

Everything is derived from ``seq_lens``, so padded requests stay self-consistent. Entries of a
row past ``K·ΣL + B·K·it`` are left untouched.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import draft_decode_kv_indices_need, uses_layout_b
from ..status import Status
from .draft_cache_locs import (
    _check_batch,
    draft_positions_ref,
    draft_slot_position,
    gather_rows_ref,
    load_request,
)

__all__ = ["draft_decode_kv_indices", "draft_decode_kv_indices_ref"]

_ROW_OOB = tl.constexpr(int(Status.ROW_OOB))  # kernels read only constexpr globals
_POS_OOB = tl.constexpr(int(Status.POS_OOB))  # kernels read only constexpr globals
_OUT_OF_CAPACITY = tl.constexpr(int(Status.OUT_OF_CAPACITY))  # kernels read only constexpr globals

# Prefix entries one program loads per iteration and stores K·rows times. 1024 int32 entries
# keep 8 elements a thread in flight at 4 warps, enough to saturate the store path.
_BLOCK = 1024
# seq_lens entries summed per iteration of a program's exclusive-prefix loop (one vector load
# covers every batch up to 1024 requests).
_BLOCK_B = 1024
# Chunks of work a program should have before lists are grouped (tuned on an H200).
_MIN_CHUNKS = 8
# Warps per program: 4 keeps 8 entries a thread in flight at BLOCK = 1024.
_NUM_WARPS = 4
# Store each list's 16-byte-aligned body in vectors (a tuning switch; see _write_list).
_ALIGNED_STORES = True


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "num_rows",
        "W_idx", "stride_idx", "stride_ptr", "chunk_programs", "lists_per_program",
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
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_STEPS: tl.constexpr,  # next power of two ≥ S
    VEC: tl.constexpr,  # kv_indices entries per 16 bytes
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(chunk_programs, list_groups, max(B, 1))``: program ``(c, g, b)`` takes lists
    ``d = g·lists_per_program + i`` (``d = s·K + t``: step ``s``, branch ``t``) of request ``b``
    one after the other and copies prefix chunks ``c, c + chunk_programs, …`` into each.
    Neighbouring programs write neighbouring chunks of one list, so the device sees long
    sequential write streams; the source chunk is re-read from L2. Grouping lists bounds the
    number of programs when lists are short. Programs with ``c == 0`` also write each list's
    own chain, its ``kv_indptr`` entry and its status bits."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )

    # Exclusive prefix Σ_{b'<b} L_b': the first block is one vector load issued beside the
    # request's own loads; batches past BLOCK_B requests loop over further blocks.
    offs = tl.arange(0, BLOCK_B)
    prev = tl.load(seq_lens_ptr + offs, mask=offs < b, other=0).to(tl.int64)
    cum = tl.sum(tl.maximum(prev, 0), axis=0)
    for first in range(BLOCK_B, b, BLOCK_B):
        more = first + tl.arange(0, BLOCK_B)
        lens = tl.load(seq_lens_ptr + more, mask=more < b, other=0).to(tl.int64)
        cum += tl.sum(tl.maximum(lens, 0), axis=0)
    head = TOPK * cum  # K·Σ_{b'<b} L_b', 64-bit: K·ΣL passes 2**31 at long contexts

    for i in range(0, lists_per_program):
        d = g * lists_per_program + i
        if d < num_rows * TOPK:
            _write_list(
                req_to_token_ptr, kv_indices_ptr, kv_indptr_ptr, status_ptr,
                row_base, L, row_ok, L_ok, cum, head, b, d, c,
                B, W_row, page_size, W_idx, stride_idx, stride_ptr, chunk_programs,
                TOPK, NUM_STEPS, LAYOUT_B, BLOCK, BLOCK_STEPS, VEC, HAS_STATUS,
            )  # fmt: skip


@triton.jit
def _write_list(
    req_to_token_ptr, kv_indices_ptr, kv_indptr_ptr, status_ptr,
    row_base, L, row_ok, L_ok, cum, head, b, d, c,
    B, W_row, page_size, W_idx, stride_idx, stride_ptr, chunk_programs,
    TOPK: tl.constexpr, NUM_STEPS: tl.constexpr, LAYOUT_B: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_STEPS: tl.constexpr, VEC: tl.constexpr, HAS_STATUS: tl.constexpr,
):  # fmt: skip
    """List ``d = s·K + t`` of request ``b``: its prefix chunks ``c, c + chunk_programs, …``
    and, for ``c == 0``, its chain, ``kv_indptr`` entry and status bits."""
    # List (s, t) of request b starts at kv_indptr[s, b·K + t] = head + t·L + (b·K + t)·(s+1).
    s_d = d // TOPK
    t_d = d % TOPK
    start = head + t_d * L + (b * TOPK + t_d) * (s_d + 1)
    # step·row_width passes 2**31 at long contexts: the row offset is 64-bit.
    list_off = s_d.to(tl.int64) * stride_idx + start
    list_ptr = kv_indices_ptr + list_off
    room = W_idx - start  # entries left in the row; stores past it are dropped
    # Stored entries: the prefix, cut at the row's end. From the list's first VEC-aligned
    # entry on, whole 16-byte vectors are stored with a mask that is uniform over each vector,
    # so the compiler emits vector stores (the buffer itself is 16-byte aligned when Triton
    # specialises it so; otherwise the hints stay true and the stores stay scalar). The head
    # before it and the tail after the last whole vector, under VEC entries each, are stored
    # with the chain.
    lim = tl.minimum(L, tl.maximum(room, 0))
    head_n = tl.minimum((VEC - list_off % VEC) % VEC, lim)
    body_n = tl.multiple_of((lim - head_n) // VEC * VEC, VEC)
    body_ptr = kv_indices_ptr + tl.multiple_of(list_off + head_n, VEC)
    k0 = tl.arange(0, BLOCK).to(tl.int64)
    for chunk in range(c, tl.cdiv(body_n, BLOCK), chunk_programs):
        kk = k0 + chunk * BLOCK
        k = kk + head_n
        m = kk < body_n
        # Scalar conditions join vector masks through tl.where (see draft_cache_locs).
        v = tl.load(
            req_to_token_ptr + row_base + k, mask=tl.where(row_ok, m & (k < W_row), False), other=0
        )
        tl.store(body_ptr + kk, v, mask=m)

    if c == 0:
        # Lanes [0, VEC): the head; lanes [VEC, 2·VEC): the tail.
        e = tl.arange(0, 2 * VEC).to(tl.int64)
        is_head = e < VEC
        ke = tl.where(is_head, e, head_n + body_n + e - VEC)
        me = tl.where(is_head, e < head_n, ke < lim)
        ve = tl.load(
            req_to_token_ptr + row_base + ke,
            mask=tl.where(row_ok, me & (ke < W_row), False),
            other=0,
        )
        tl.store(list_ptr + ke, ve, mask=me)
        live_b = b < B
        # The list's own chain, j ≤ s, after its prefix.
        j = tl.arange(0, BLOCK_STEPS)
        live = tl.where(live_b, j <= s_d, False)
        p = draft_slot_position(L, t_d, j, page_size, NUM_STEPS, LAYOUT_B)
        v = tl.load(
            req_to_token_ptr + row_base + p,
            mask=tl.where(row_ok, live & (p < W_row), False),
            other=0,
        )
        tl.store(list_ptr + L + j, v, mask=live & (L + j < room))
        tl.store(kv_indptr_ptr + s_d * stride_ptr + b * TOPK + t_d, start, mask=live_b)
        # The closing entry kv_indptr[s, B·K] = K·ΣL + B·K·(s+1), from the last request's
        # branch 0 (entry 0 = 0 when B == 0).
        last = (b == tl.maximum(B, 1) - 1) & (t_d == 0)
        end = TOPK * (cum + L) + B * TOPK * (s_d + 1)
        tl.store(kv_indptr_ptr + s_d * stride_ptr + B * TOPK, end, mask=last)

        if HAS_STATUS:
            # Positions grow with j: the chain's last one (j = s) decides whether any is past
            # the row, without a reduction. The atomic sits behind a branch, so nothing is
            # issued when all is well.
            last_p = draft_slot_position(L, t_d, s_d, page_size, NUM_STEPS, LAYOUT_B)
            over = (L + s_d + 1 > room) & live_b
            pos_bad = (live_b & (last_p >= W_row)) | (L > W_row) | ~L_ok
            bits = (
                tl.where(row_ok, 0, _ROW_OOB)
                | tl.where(pos_bad, _POS_OOB, 0)
                | tl.where(over, _OUT_OF_CAPACITY, 0)
            )
            if bits != 0:
                tl.atomic_or(status_ptr, bits, sem="relaxed")


@functools.lru_cache(maxsize=16)
def _target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: 8 per multiprocessor on CUDA (on an H200, 8 beat 4
    by 13% at B = 32, L = 32k and tied elsewhere once short lists are grouped; see
    scripts/tune_kv_indices.py); a handful under the CPU interpreter, where each program
    costs host time."""
    if device.type == "cuda":
        return 8 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _grid(
    device: torch.device, batch: int, lists: int, row_width: int
) -> tuple[int, int, int, int]:
    """``(chunk_programs, list_groups, requests, lists_per_program)``.

    Lists are grouped so that a program has at least ``_MIN_CHUNKS`` chunks of work when rows
    are short (thousands of tiny programs cost more to schedule than to run) while the grid
    still holds the target number of programs; chunks of one list are split over programs
    when few long requests carry all the work. Only host-known sizes enter: ``B``, the list
    count and the row width, never a device value.
    """
    target = _target_programs(device)
    requests = max(batch, 1)
    row_chunks = triton.cdiv(row_width, _BLOCK)
    per_program = max(1, min(triton.cdiv(_MIN_CHUNKS, row_chunks), lists))
    # Keep at least `target` programs where there are that many lists.
    per_program = max(1, min(per_program, (requests * lists) // target))
    groups = triton.cdiv(lists, per_program)
    per_program = triton.cdiv(lists, groups)  # balance the groups
    chunk_programs = max(1, min(triton.cdiv(target, requests * groups), row_chunks))
    return chunk_programs, groups, requests, per_program


def _prepare(
    req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
    kv_indices, kv_indptr, seq_lens_sum, status,
):  # fmt: skip
    """Validate and allocate; shared by the kernel launcher and the reference."""
    topk = validate.positive("topk", topk)
    num_steps = validate.positive("num_steps", num_steps)
    validate.positive("page_size", page_size)
    rows = num_steps if num_rows is None else validate.positive("num_rows", num_rows, minimum=0)
    if rows > num_steps:
        raise ValueError(f"num_rows must be <= num_steps={num_steps}, got {rows}")
    B, device = _check_batch(req_pool_indices, req_to_token, seq_lens)
    if kv_indices is None:
        # Without a host total, size for full rows: no device read, no sync.
        total = seq_lens_sum if seq_lens_sum is not None else B * req_to_token.shape[1]
        width = max(1, draft_decode_kv_indices_need(total, B, topk, rows))
        kv_indices = torch.empty((rows, width), dtype=req_to_token.dtype, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty((rows, B * topk + 1), dtype=torch.int32, device=device)
    validate.tensor("kv_indices", kv_indices, ndim=2, device=device)
    validate.tensor("kv_indptr", kv_indptr, ndim=2, device=device)
    validate.at_least("kv_indices", kv_indices.shape[0], rows, "rows")
    validate.at_least("kv_indptr", kv_indptr.shape[0], rows, "rows")
    validate.at_least("kv_indptr", kv_indptr.shape[1], B * topk + 1, "columns (B*topk + 1)")
    if seq_lens_sum is not None:
        if isinstance(seq_lens_sum, bool) or not isinstance(seq_lens_sum, int):
            raise TypeError(f"seq_lens_sum must be a host int, got {type(seq_lens_sum).__name__}")
        need = draft_decode_kv_indices_need(seq_lens_sum, B, topk, rows)
        validate.at_least("kv_indices", kv_indices.shape[1], need, "columns (K*ΣL + B*K*rows)")
    validate.status(status, device)
    return topk, num_steps, rows, B, kv_indices, kv_indptr


def draft_decode_kv_indices(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the per-branch KV lists of every draft step in one launch.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps`` (``ps`` places the draft slots, SPEC §1).
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
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB``, ``OUT_OF_CAPACITY``.

    Returns
    -------
    (kv_indices, kv_indptr) : tuple of torch.Tensor

    Examples
    --------
    ``seq_lens=[3, 1]``, ``K=2``, one row (``it=1``) → ``kv_indptr=[0, 4, 8, 10, 12]``.

    Grid ``(chunk_programs, list_groups, max(B, 1))``: programs split long lists into chunk
    groups and group short lists, from host-known sizes only; every program computes its
    request's offset from ``seq_lens`` with vector loads. No host sync; ``B``, lengths and strides are runtime arguments.
    """
    topk, num_steps, rows, B, kv_indices, kv_indptr = _prepare(
        req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
        kv_indices, kv_indptr, seq_lens_sum, status,
    )  # fmt: skip
    if rows == 0:
        return kv_indices, kv_indptr
    device = req_to_token.device
    chunk_programs, groups, requests, lists_per_program = _grid(
        device, B, rows * topk, req_to_token.shape[1]
    )
    grid = (chunk_programs, groups, requests)
    _draft_decode_kv_indices_kernel[grid](
        req_pool_indices,
        req_to_token,
        seq_lens,
        kv_indices,
        kv_indptr,
        status if status is not None else kv_indptr,
        # sizes
        B,
        req_to_token.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0),
        page_size,
        rows,
        kv_indices.shape[1],
        kv_indices.stride(0),
        kv_indptr.stride(0),
        chunk_programs,
        lists_per_program,
        # code shape
        TOPK=topk,
        NUM_STEPS=num_steps,
        LAYOUT_B=uses_layout_b(topk, page_size),
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        BLOCK_STEPS=triton.next_power_of_2(num_steps),
        VEC=16 // kv_indices.element_size() if _ALIGNED_STORES else 1,
        HAS_STATUS=status is not None,
        num_warps=_NUM_WARPS,
    )
    return kv_indices, kv_indptr


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`draft_decode_kv_indices` (vectorised over the batch; syncs)."""
    topk, num_steps, rows, B, kv_indices, kv_indptr = _prepare(
        req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
        kv_indices, kv_indptr, seq_lens_sum, status,
    )  # fmt: skip
    if rows == 0:
        return kv_indices, kv_indptr
    device = req_to_token.device
    K = topk
    L = seq_lens.to(torch.int64).clamp_min(0)
    cum = torch.cumsum(L, 0) - L
    total = int(L.sum())
    max_len = int(L.max()) if B else 0
    W_idx = kv_indices.shape[1]

    k = torch.arange(max_len, device=device)
    in_prefix = k.view(1, -1) < L.view(-1, 1)  # [B, maxL]
    prefix, bits = gather_rows_ref(req_to_token, req_pool_indices, torch.where(in_prefix, k, 0))
    chain_pos = draft_positions_ref(seq_lens, K, num_steps, page_size)[:, :, :rows]
    chain, chain_bits = gather_rows_ref(req_to_token, req_pool_indices, chain_pos)
    bits |= chain_bits
    if bool((L > req_to_token.shape[1]).any()) or bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)

    z = torch.arange(B * K, device=device)
    bz, tz = z // K, z % K
    for s in range(rows):
        it = s + 1
        start = K * cum[bz] + tz * L[bz] + z * it  # [B*K]
        kv_indptr[s, : B * K] = start.to(kv_indptr.dtype)
        kv_indptr[s, B * K] = K * total + B * K * it
        # prefix of every branch
        dst = start.view(-1, 1) + k.view(1, -1)
        keep = in_prefix[bz] & (dst < W_idx)
        kv_indices[s][dst[keep]] = prefix[bz][keep].to(kv_indices.dtype)
        # own chain, j < it
        j = torch.arange(it, device=device)
        dst = (start + L[bz]).view(-1, 1) + j.view(1, -1)
        vals = chain.reshape(B * K, rows)[:, :it]
        keep = dst < W_idx
        kv_indices[s][dst[keep]] = vals[keep].to(kv_indices.dtype)
    if B and draft_decode_kv_indices_need(total, B, K, rows) > W_idx:
        bits |= int(Status.OUT_OF_CAPACITY)
    if status is not None and bits:
        status |= bits
    return kv_indices, kv_indptr
