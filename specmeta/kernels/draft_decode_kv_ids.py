"""Draft-decode kv_indices in other id spaces: draft windows, page-granular rows, virtual ids
(design §2.10).

The same lists as :mod:`specmeta.kernels.draft_decode_kv_indices` (design §2.2), with every
prefix length ``L`` replaced by the window's ``Lw = min(L, window + sink)`` and every id read
through :func:`~specmeta.kernels._common.load_kv_ids`::

    kv_indptr[s, z] = K·Σ_{b'<b} Lw_b' + t·Lw_b + z·(s + 1)               for z in [0, B·K]
    kv_indices[s, kv_indptr[s, z] + k]        = id(row_b, q(k))              for k < Lw_b
    kv_indices[s, kv_indptr[s, z] + Lw_b + j] = id(row_b, p(b, t, j))        for j ≤ s

``q(k)`` is the window's ``k``-th position (the sink's first ``min(sink, L)`` positions, then
the most recent ones); the chain positions ``p`` are those of design §1, on the full ``L``.
:func:`~specmeta.kernels.draft_decode_kv_indices.bind_draft_decode_kv_indices` launches this
kernel when a call gives a window, ``entry_page_size > 1`` or ``v2p``; the plain form keeps its
bandwidth-tuned kernel. Program ``(c, d, b)`` writes chunks ``c, c + chunk_programs, …`` of
list ``d = s·K + t`` of request ``b``; programs with ``c == 0`` also write the chain, the
``kv_indptr`` entry and the status bits.

A window layer's lists (design §2.10, :mod:`specmeta.kernels._window`) come from the same
kernel: with the read rail ``w`` step ``s`` lists the last ``min(L + s + 1, w)`` entries of
``[prefix, chain]`` (``Lw`` becoming the prefix positions kept at that step and the chain its
last ``min(s + 1, w)`` steps), and with ``full_to_swa`` every id leaves in window-pool ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import uses_layout_b
from ..launch import Launcher, next_power_of_2
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    chunk_programs,
    draft_positions_ref,
    draft_slot_position,
    list_offsets,
    load_request,
    window_position,
    window_positions_ref,
    windowed_length,
    windowed_length_ref,
)
from ._window import (
    load_window_ids,
    load_window_ids_ref,
    rail_draft_lengths,
    rail_draft_lengths_ref,
    window_arguments,
)

__all__ = ["bind_draft_decode_kv_ids", "draft_decode_kv_ids_ref"]

# Prefix entries a program copies per iteration.
_BLOCK = 1024
# seq_lens entries summed per iteration of the exclusive windowed sum.
_BLOCK_B = 1024


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "W_idx", "stride_idx", "stride_ptr",
        "window", "sink", "num_pages", "chunk_programs", "full_size", "rail",
    ]
)  # fmt: skip
def _draft_decode_kv_ids_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    kv_indices_ptr,  # [≥rows, W_idx] int32|int64, row stride stride_idx
    kv_indptr_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_ptr
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64 (read only with TO_WINDOW)
    status_ptr,  # [1] int32
    B,
    R,
    W_row,
    stride_row,
    page_size,
    W_idx,
    stride_idx,
    stride_ptr,
    window,
    sink,
    num_pages,
    chunk_programs,
    full_size,
    rail,  # the window read rail w, 0 for none
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,
    TRANSLATE: tl.constexpr,
    TO_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two ≥ S
):
    c = tl.program_id(0)
    d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    s = d // TOPK
    t = d % TOPK
    # Lw prefix positions, then the chain's last `steps` steps (all s + 1 without a rail).
    Lw, steps = rail_draft_lengths(windowed_length(L, window, sink), s, rail)
    cum = b * 0
    for first in range(0, b, BLOCK_B):
        offs = first + tl.arange(0, BLOCK_B)
        before = tl.load(seq_lens_ptr + offs, mask=offs < b, other=0).to(tl.int64)
        kept, _ = rail_draft_lengths(windowed_length(tl.maximum(before, 0), window, sink), s,
                                     rail)  # fmt: skip
        cum += tl.sum(kept, axis=0)
    start = TOPK * cum + t * Lw + (b * TOPK + t) * steps
    list_ptr = kv_indices_ptr + s.to(tl.int64) * stride_idx + start
    row = req_to_token_ptr + row_base
    kept = tl.minimum(Lw, tl.maximum(W_idx - start, 0))  # entries that fit in the row
    bad = c * 0  # any id that did not map
    lane = tl.arange(0, BLOCK)
    for chunk in range(c, tl.cdiv(kept, BLOCK), chunk_programs):
        k = tl.cast(chunk, tl.int64) * BLOCK + lane
        m = k < kept
        pos = window_position(k, L, Lw, sink)
        ids, _, wrong = load_window_ids(row, pos, tl.where(row_ok, m, False), W_row, v2p_ptr,
                                        num_pages, page_size, full_to_swa_ptr, full_size,
                                        ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        tl.store(list_ptr + k, ids, mask=m)
        bad |= tl.max(wrong.to(tl.int32), axis=0)
    if c == 0:
        live = b < B
        j = tl.arange(0, BLOCK_S)
        chain = tl.where(live, (j < steps) & (start + Lw + j < W_idx), False)
        p = draft_slot_position(L, t, j + s + 1 - steps, page_size, NUM_STEPS, LAYOUT_B)
        ids, _, wrong = load_window_ids(row, p, tl.where(row_ok, chain, False), W_row, v2p_ptr,
                                        num_pages, page_size, full_to_swa_ptr, full_size,
                                        ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW)  # fmt: skip
        tl.store(list_ptr + Lw + j, ids, mask=chain)
        bad |= tl.max(wrong.to(tl.int32), axis=0)
        ptr_row = kv_indptr_ptr + s * stride_ptr
        tl.store(ptr_row + b * TOPK + t, start, mask=live)
        end = TOPK * (cum + Lw) + B * TOPK * steps
        tl.store(ptr_row + B * TOPK, end, mask=(b == tl.maximum(B, 1) - 1) & (t == 0))
        # Every position a list reads is below L (the prefix) or at most p(b, t, s) (the chain).
        tokens = W_row * ENTRY_PAGE_SIZE
        last = draft_slot_position(L, t, s, page_size, NUM_STEPS, LAYOUT_B)
        pos_bad = (L > tokens) | (last >= tokens) | ~L_ok
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(live & pos_bad, POS_OOB, 0)
            | tl.where(live & (start + Lw + steps > W_idx), OUT_OF_CAPACITY, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")
    bad_bit = tl.where(bad != 0, BAD_KV_ID, 0)
    tl.atomic_or(status_ptr, bad_bit, mask=bad_bit != 0, sem="relaxed")


_draft_decode_kv_ids_launch = Launcher(_draft_decode_kv_ids_kernel)


def bind_draft_decode_kv_ids(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    rows: int,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    status: torch.Tensor,
    window: int,
    sink: int,
    entry_page_size: int,
    v2p: torch.Tensor | None,
    rail: int = 0,
    full_to_swa: torch.Tensor | None = None,
):
    """The launch of the id-space form, bound to arguments its caller checked
    (:func:`~specmeta.kernels.draft_decode_kv_indices.bind_draft_decode_kv_indices`)."""
    B = req_pool_indices.shape[0]
    tokens = req_to_token.shape[1] * entry_page_size
    width = min(tokens, window + sink) if window else tokens
    width = min(width, rail) if rail else width
    programs = chunk_programs(req_to_token.device, B * rows * topk, width, _BLOCK)
    return _draft_decode_kv_ids_launch.bind(
        (programs, rows * topk, max(B, 1)),
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        kv_indices_ptr=kv_indices,
        kv_indptr_ptr=kv_indptr,
        v2p_ptr=v2p if v2p is not None else kv_indptr,
        **window_arguments(full_to_swa),
        rail=rail,
        status_ptr=status,
        page_size=page_size,
        W_idx=kv_indices.shape[1],
        stride_idx=kv_indices.stride(0),
        stride_ptr=kv_indptr.stride(0),
        window=window,
        sink=sink,
        num_pages=v2p.shape[0] if v2p is not None else 0,
        chunk_programs=programs,
        TOPK=topk,
        NUM_STEPS=num_steps,
        LAYOUT_B=uses_layout_b(topk, page_size),
        ENTRY_PAGE_SIZE=entry_page_size,
        TRANSLATE=v2p is not None,
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        BLOCK_S=next_power_of_2(num_steps),
    )


bind_draft_decode_kv_ids.kernel = _draft_decode_kv_ids_kernel  # for specmeta.registry


def draft_decode_kv_ids_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    rows: int,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    status: torch.Tensor,
    window: int,
    sink: int,
    entry_page_size: int,
    v2p: torch.Tensor | None,
    rail: int = 0,
    full_to_swa: torch.Tensor | None = None,
) -> None:
    """The torch twin of the id-space form (and of the plain one, which builds the same lists)
    on arguments its caller checked
    (:func:`~specmeta.kernels.draft_decode_kv_indices.draft_decode_kv_indices_ref`), one step
    row at a time, vectorised over the batch; syncs."""
    B, K, W_idx, device = seq_lens.shape[0], topk, kv_indices.shape[1], req_to_token.device
    L = seq_lens.to(torch.int64).clamp_min(0)
    read = dict(entry_page_size=entry_page_size, v2p=v2p, page_size=page_size,
                full_to_swa=full_to_swa)  # fmt: skip
    # Every draft slot a step row reads, for the bits: the kernel reports a chain position past
    # the row whether or not the rail lists it (the last step's always is).
    chain_pos = draft_positions_ref(seq_lens, K, num_steps, page_size)[:, :, :rows]
    _, _, bits = load_window_ids_ref(req_to_token, req_pool_indices, chain_pos,
                                     torch.ones_like(chain_pos, dtype=torch.bool), **read)  # fmt: skip
    if bool((L > req_to_token.shape[1] * entry_page_size).any()) or bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    Lw_all = windowed_length_ref(seq_lens, window, sink)
    bz = torch.arange(B * K, device=device) // K
    bad = full = False  # an id that did not map among those a list keeps; a list cut short
    for s in range(rows):
        Lw, steps = rail_draft_lengths_ref(Lw_all, s, rail)
        lengths = (Lw + steps).view(1, -1)
        offsets = list_offsets(lengths, K)[0]
        kv_indptr[s, : B * K + 1] = offsets.to(kv_indptr.dtype)
        start = offsets[: B * K]
        # Prefix entry k lands at start + k >= k: none past the output's width is read or kept,
        # so the work stops there whatever a garbage length says (design §2.5).
        k = torch.arange(min(int(Lw.max()), W_idx) if B else 0, device=device)
        in_prefix = k.view(1, -1) < Lw.view(-1, 1)
        pos = window_positions_ref(L.view(-1, 1), Lw.view(-1, 1), k.view(1, -1), sink)
        prefix, prefix_bad, prefix_bits = load_window_ids_ref(
            req_to_token, req_pool_indices, torch.where(in_prefix, pos, 0), in_prefix, **read)  # fmt: skip
        bits |= prefix_bits
        dst = start.view(-1, 1) + k.view(1, -1)
        keep = in_prefix[bz] & (dst < W_idx)
        kv_indices[s][dst[keep]] = prefix[bz][keep].to(kv_indices.dtype)
        bad |= bool(prefix_bad[bz][keep].any())
        # the chain's last `steps` steps: s + 1 - steps … s
        chain = chain_pos.reshape(B * K, rows)[:, s + 1 - steps : s + 1]
        ids, chain_bad, _ = load_window_ids_ref(req_to_token, req_pool_indices,
                                                chain.reshape(B, K * steps),
                                                torch.ones(B, K * steps, dtype=torch.bool,
                                                           device=device), **read)  # fmt: skip
        dst = (start + Lw[bz]).view(-1, 1) + torch.arange(steps, device=device).view(1, -1)
        keep = dst < W_idx
        kv_indices[s][dst[keep]] = ids.reshape(B * K, steps)[keep].to(kv_indices.dtype)
        bad |= bool(chain_bad.reshape(B * K, steps)[keep].any())
        full |= B > 0 and int(offsets[-1]) > W_idx
    if full:
        bits |= int(Status.OUT_OF_CAPACITY)
    if bad:
        bits |= int(Status.BAD_KV_ID)
    if bits:
        status |= bits
