"""Cascade (shared-prefix) draft-decode KV lists for page-size-1 consumers, in one launch.

The per-branch lists of :mod:`specmeta.kernels.draft_decode_kv_indices` copy every request's
prefix ``K`` times into each of the ``S`` step rows: ``S·K·ΣL`` entries written per draft
iteration. A cascade consumer (FlashInfer's ``MultiLevelCascadeAttentionWrapper``, or two
attention passes merged by log-sum-exp) needs each prefix once:

* **prefix level**, step independent, query stride ``K`` (the ``K`` branches of request ``b``
  are its ``K`` query rows)::

      prefix_kv_indptr[b]                         = Σ_{b'<b} L_b'          b in [0, B]
      prefix_kv_indices[prefix_kv_indptr[b] + k]  = row_b[k]               k < L_b

* **chain level**, one row per step ``s`` (``it = s + 1``), query stride 1, branch
  ``z = b·K + t``::

      chain_kv_indptr[s, z]                       = z·it                   z in [0, B·K]
      chain_kv_indices[s, z·it + j]               = row_b[p(b, t, j)]      j < it

``ΣL + B·K·S·(S+1)/2`` entries in all instead of ``S·(K·ΣL + B·K·(S+1)/2)``.

With a draft window (``window_size = W > 0``, ``sink_size = Sk``, design §2.10) the prefix
level lists ``Lw_b = min(L_b, W + Sk)`` tokens, the first ``min(Sk, L_b)`` positions then the
most recent ones, and its offsets are ``Σ_{b'<b} Lw_b'``; the chains are those of the full
``L_b``. Ids are read in the rows' id space (``entry_page_size``, ``v2p``) at both levels.

A sliding-window layer (``sliding_window_size = w``, design §2.10) reads at step ``s`` the last
``min(L + s + 1, w)`` entries of each branch's prefix and chain: the chain's last ``c_s =
min(s + 1, w)`` steps and the prefix's last ``P_b(s) = min(L_b, max(w − s − 1, 0))``
positions. The prefix part shrinks with the step, so the prefix level has **one row a step**,
as the chain level has (``prefix_kv_indices [rows, ·]``, ``prefix_kv_indptr [rows, B + 1]``)::

    prefix_kv_indptr[s, b]                         = Σ_{b'<b} P_b'(s)
    prefix_kv_indices[s, prefix_kv_indptr[s,b] + k] = row_b[L_b − P_b(s) + k]   k < P_b(s)
    chain_kv_indptr[s, z]                           = z·c_s
    chain_kv_indices[s, z·c_s + j − (s + 1 − c_s)]  = row_b[p(b, t, j)]         s + 1 − c_s ≤ j ≤ s

and ``full_to_swa`` emits every id of both levels in window-pool ids (with or without the
rail, design §2.10).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import shared_prefix_chain_need, uses_layout_b, verify_kv_indices_need
from ..launch import Launcher, next_power_of_2
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
    check_steps,
    chunk_programs,
    draft_positions_ref,
    draft_slot_position,
    host_int,
    load_kv_ids,
    load_kv_ids_ref,
    load_request,
    row_offset,
    window_position,
    window_positions_ref,
    windowed_length,
    windowed_length_ref,
)
from ._window import (
    check_window,
    copy_window_list,
    rail_draft_lengths,
    rail_draft_lengths_ref,
    rail_prefix_total,
    window_arguments,
    window_lists_ref,
    window_pool_ids,
    window_pool_ids_ref,
)

__all__ = [
    "bind_shared_prefix_kv_indices",
    "shared_prefix_kv_indices",
    "shared_prefix_kv_indices_ref",
]


# Prefix entries one program copies per iteration (as in draft_decode_kv_indices).
_BLOCK = 1024
# seq_lens entries summed per iteration of the exclusive-prefix loop (one load up to B = 1024).
_BLOCK_B = 1024


@triton.jit
def _rail_prefix_rows(req_to_token_ptr, row_base, row_ok, seq_lens_ptr, L, b, B, W_row,
                      prefix_kv_indices_ptr, prefix_kv_indptr_ptr, W_prefix, stride_prefix,
                      stride_prefix_ptr, num_rows, rail, first_chunk, chunk_step, v2p_ptr,
                      num_pages, page_size, full_to_swa_ptr, full_size, BLOCK: tl.constexpr,
                      BLOCK_B: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr,
                      TRANSLATE: tl.constexpr, TO_WINDOW: tl.constexpr):  # fmt: skip
    """The prefix level of a window layer (design §2.10), one row a step: row ``s`` lists
    request ``b``'s last ``P_b(s) = min(L_b, max(w − s − 1, 0))`` positions after the
    ``P`` of the requests before it (:func:`~._window.copy_window_list`, which also writes
    ``prefix_kv_indptr[s, b + 1]``). Returns ``(bad, over)``: an id stored did not map; a
    row's list ran past ``W_prefix``."""
    bad = first_chunk * 0
    over = b < 0
    for s in range(0, num_rows):
        kept, _ = rail_draft_lengths(L, s, rail)
        n = tl.where(b < B, kept, 0)
        start = b * 0
        for first in range(0, b, BLOCK_B):
            offs = first + tl.arange(0, BLOCK_B)
            before = tl.maximum(tl.load(seq_lens_ptr + offs, mask=offs < b, other=0), 0)
            prior, _ = rail_draft_lengths(before.to(tl.int64), s, rail)
            start += tl.sum(tl.where(offs < b, prior, 0), axis=0)
        bad |= copy_window_list(
            req_to_token_ptr, row_base, row_ok, L - n, n, b, B, start, W_row,
            prefix_kv_indices_ptr + row_offset(s, stride_prefix),
            prefix_kv_indptr_ptr + row_offset(s, stride_prefix_ptr), W_prefix, first_chunk,
            chunk_step, v2p_ptr, num_pages, page_size, full_to_swa_ptr, full_size, BLOCK,
            ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
        )  # fmt: skip
        over |= start + n > W_prefix
    return bad, over


@triton.jit(
    do_not_specialize=[
        "B", "R", "W_row", "stride_row", "page_size", "num_rows", "W_prefix",
        "W_chain", "stride_chain", "stride_chain_ptr", "chunk_programs", "num_pages",
        "window", "sink", "full_size", "rail", "stride_prefix", "stride_prefix_ptr",
    ]
)  # fmt: skip
def _shared_prefix_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    prefix_kv_indices_ptr,  # [W_prefix] int32|int64 ([≥rows, W_prefix] with RAIL)
    prefix_kv_indptr_ptr,  # [≥B+1] int32|int64 ([≥rows, ≥B+1] with RAIL)
    chain_kv_indices_ptr,  # [≥rows, W_chain] int32|int64, row stride stride_chain
    chain_kv_indptr_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_chain_ptr
    v2p_ptr,  # [num_pages] int32|int64: virtual → physical pages (read only with TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64: full → window pool slots (read only with TO_WINDOW)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    page_size,
    num_rows,
    W_prefix,
    W_chain,
    stride_chain,
    stride_chain_ptr,
    chunk_programs,
    num_pages,
    window,
    sink,
    full_size,
    rail,  # the window read rail w (read only with RAIL)
    stride_prefix,  # the prefix level's row strides (read only with RAIL)
    stride_prefix_ptr,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_CHAIN: tl.constexpr,  # next power of two ≥ S*K*S
    BLOCK_PTR: tl.constexpr,  # next power of two ≥ S*K
    BLOCK_ROWS: tl.constexpr,  # next power of two ≥ S
    ENTRY_PAGE_SIZE: tl.constexpr,  # rows of page ids of E positions (1: token ids)
    TRANSLATE: tl.constexpr,  # ids through v2p (design §2.10)
    TO_WINDOW: tl.constexpr,  # ids through full_to_swa (design §2.10)
    RAIL: tl.constexpr,  # a window layer's rail: a prefix row a step, the chains clipped
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` copies prefix chunks ``c, c +
    chunk_programs, …`` of request ``b`` once (under the rail, of each step's row); ``(b, 0)``
    also writes the request's chains, both indptrs and the status."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    if RAIL:
        # The prefix level of a window layer: one row a step (design §2.10).
        prefix_bad, prefix_over = _rail_prefix_rows(
            req_to_token_ptr, row_base, row_ok, seq_lens_ptr, L, b, B, W_row,
            prefix_kv_indices_ptr, prefix_kv_indptr_ptr, W_prefix, stride_prefix,
            stride_prefix_ptr, num_rows, rail, c, chunk_programs, v2p_ptr, num_pages, page_size,
            full_to_swa_ptr, full_size, BLOCK, BLOCK_B, ENTRY_PAGE_SIZE, TRANSLATE, TO_WINDOW,
        )  # fmt: skip
    else:
        # The prefix level: Lw = min(L, window + sink) tokens (L without a window), placed
        # after the windowed lengths of the requests before b.
        Lw = windowed_length(L, window, sink)
        n = tl.where(b < B, Lw, 0)
        start = b * 0
        for first in range(0, b, BLOCK_B):
            offs = first + tl.arange(0, BLOCK_B)
            before = tl.load(seq_lens_ptr + offs, mask=offs < b, other=0).to(tl.int64)
            start += tl.sum(windowed_length(tl.maximum(before, 0), window, sink), axis=0)
        # Entries past W_prefix are never stored, so the loop stops there: a garbage length
        # costs no more than a full buffer (the status reports it).
        kept = tl.minimum(n, tl.maximum(W_prefix - start, 0))
        lane = tl.arange(0, BLOCK)
        prefix_bad = c * 0
        for chunk in range(c, tl.cdiv(kept, BLOCK), chunk_programs):
            k = tl.cast(chunk, tl.int64) * BLOCK + lane
            m = tl.where(row_ok, k < kept, False)
            ids, in_row, wrong = load_kv_ids(
                req_to_token_ptr + row_base, window_position(k, L, Lw, sink),
                m, W_row, v2p_ptr, num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,
            )  # fmt: skip
            # Then the window pool map (design §2.10): an id the row did not map stays 0.
            ids, lost = window_pool_ids(ids, m & in_row & ~wrong, full_to_swa_ptr, full_size,
                                        TO_WINDOW)  # fmt: skip
            tl.store(prefix_kv_indices_ptr + start + k, ids, mask=k < kept)
            prefix_bad |= tl.max((wrong | lost).to(tl.int32), axis=0)
        prefix_over = start + n > W_prefix
        if c == 0:
            tl.store(prefix_kv_indptr_ptr + b + 1, start + n, mask=b < B)
            tl.store(prefix_kv_indptr_ptr + b, start * 0, mask=b == 0)
    if HAS_STATUS:  # every program reports the ids of its own chunks
        unmapped_prefix = tl.where(prefix_bad != 0, BAD_KV_ID, 0)
        tl.atomic_or(status_ptr, unmapped_prefix, mask=unmapped_prefix != 0, sem="relaxed")

    if c == 0:
        # Own chains: entry (s, t, j) for j ≤ s < rows.
        e = tl.arange(0, BLOCK_CHAIN)
        s = e // (TOPK * NUM_STEPS)
        t = (e // NUM_STEPS) % TOPK
        j = e % NUM_STEPS
        live = tl.where(b < B, (s < num_rows) & (j <= s), False)
        width = s + 1  # chain entries a branch lists at step s
        if RAIL:  # the last c_s = min(s + 1, w) steps (design §2.10)
            _, width = rail_draft_lengths(L, s, rail)
            live = live & (j >= s + 1 - width)
        p = draft_slot_position(L, t, j, page_size, NUM_STEPS, LAYOUT_B)
        v, in_row, chain_unmapped = load_kv_ids(
            req_to_token_ptr + row_base, p, tl.where(row_ok, live, False), W_row, v2p_ptr,
            num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,
        )  # fmt: skip
        v, lost = window_pool_ids(v, tl.where(row_ok, live, False) & in_row & ~chain_unmapped,
                                  full_to_swa_ptr, full_size, TO_WINDOW)  # fmt: skip
        chain_unmapped |= lost
        dst = (b * TOPK + t) * (s + 1) + j  # int64 (b is): B·K·S stays small, but cheap
        if RAIL:
            dst = (b * TOPK + t) * width + j - (s + 1 - width)
        tl.store(
            chain_kv_indices_ptr + row_offset(s, stride_chain) + dst,
            v,
            mask=live & (dst < W_chain),
        )

        # chain_kv_indptr[s, b·K + t] = (b·K + t)·(s + 1) for t < K (c_s under the rail).
        f = tl.arange(0, BLOCK_PTR)
        s = f // TOPK
        z = b * TOPK + f % TOPK
        width = s + 1
        if RAIL:
            _, width = rail_draft_lengths(L, s, rail)
        tl.store(
            chain_kv_indptr_ptr + row_offset(s, stride_chain_ptr) + z,
            z * width,
            mask=tl.where(b < B, s < num_rows, False),
        )
        # The closing entry [s, B·K] = B·K·(s + 1), from the last program (entry 0 when B == 0).
        last = b == tl.maximum(B, 1) - 1
        r = tl.arange(0, BLOCK_ROWS)
        width = r + 1
        if RAIL:
            _, width = rail_draft_lengths(L, r, rail)
        tl.store(
            chain_kv_indptr_ptr + row_offset(r, stride_chain_ptr) + B * TOPK,
            width.to(tl.int64) * (B * TOPK),
            mask=tl.where(last, r < num_rows, False),
        )

        if HAS_STATUS:
            chain_bad = tl.max((live & ~in_row).to(tl.int32), axis=0) != 0
            # The prefix level reads positions below L whether or not a window keeps them all.
            n_read = tl.where(b < B, L, 0)
            chain_rows = num_rows  # the widest row's chain entries a branch (c_s under the rail)
            if RAIL:
                chain_rows = tl.minimum(num_rows, rail)
            over = prefix_over | ((b + 1) * TOPK * chain_rows > W_chain)
            # Only the chain ids stored count as unmapped (the prefix's are reported above).
            unmapped = (chain_unmapped & live & (dst < W_chain)).to(tl.int32)
            bits = (
                tl.where(row_ok, 0, ROW_OOB)
                | tl.where(chain_bad | (n_read > W_row * ENTRY_PAGE_SIZE) | ~L_ok, POS_OOB, 0)
                | tl.where(over & (b < B), OUT_OF_CAPACITY, 0)
                | tl.where(tl.max(unmapped, axis=0) != 0, BAD_KV_ID, 0)
            )
            tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_shared_prefix_kv_indices_launch = Launcher(_shared_prefix_kv_indices_kernel)


def _prepare(
    where, req_pool_indices, req_to_token, seq_lens, topk, num_steps, page_size, num_rows,
    prefix_kv_indices, prefix_kv_indptr, chain_kv_indices, chain_kv_indptr, seq_lens_sum, status,
    window_size, sink_size, entry_page_size, v2p, sliding_window_size, full_to_swa,
):  # fmt: skip
    topk, num_steps, page_size, rows = check_steps(topk, num_steps, page_size, num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    window, sink, E = check_id_spaces(where, window_size, sink_size, entry_page_size, v2p,
                                      device)  # fmt: skip
    rail = check_window(where, sliding_window_size, full_to_swa, device, window)
    if seq_lens_sum is not None:
        host_int("seq_lens_sum", seq_lens_sum)
    # Under the rail the prefix level has a row a step, as the chain level (design §2.10).
    prefix_shape = lambda width: (rows, width) if rail else (width,)  # noqa: E731
    if prefix_kv_indices is None:
        # Without the host's ΣL, full rows: W_row entries of E positions each.
        total = seq_lens_sum if seq_lens_sum is not None else B * req_to_token.shape[1] * E
        prefix_kv_indices = torch.empty(
            prefix_shape(max(1, _prefix_need(total, B, window, sink, rail))),
            dtype=req_to_token.dtype, device=device,
        )  # fmt: skip
    if prefix_kv_indptr is None:
        prefix_kv_indptr = torch.empty(prefix_shape(B + 1), dtype=torch.int32, device=device)
    chain_width = shared_prefix_chain_need(B, topk, min(rows, rail) if rail else rows)
    if chain_kv_indices is None:
        chain_kv_indices = torch.empty(
            (rows, max(1, chain_width)),
            dtype=req_to_token.dtype,
            device=device,
        )
    if chain_kv_indptr is None:
        chain_kv_indptr = torch.empty((rows, B * topk + 1), dtype=torch.int32, device=device)
    levels = 2 if rail else 1
    validate.tensor("prefix_kv_indices", prefix_kv_indices, ndim=levels, device=device)
    validate.tensor("prefix_kv_indptr", prefix_kv_indptr, ndim=levels, device=device)
    validate.tensor("chain_kv_indices", chain_kv_indices, ndim=2, device=device)
    validate.tensor("chain_kv_indptr", chain_kv_indptr, ndim=2, device=device)
    if rail:  # a row a step (design §2.10)
        validate.at_least("prefix_kv_indices", prefix_kv_indices.shape[0], rows, "rows")
        validate.at_least("prefix_kv_indptr", prefix_kv_indptr.shape[0], rows, "rows")
    validate.at_least("prefix_kv_indptr", prefix_kv_indptr.shape[-1], B + 1, "entries (B + 1)")
    validate.at_least("chain_kv_indices", chain_kv_indices.shape[0], rows, "rows")
    validate.at_least("chain_kv_indptr", chain_kv_indptr.shape[0], rows, "rows")
    validate.at_least(
        "chain_kv_indptr", chain_kv_indptr.shape[1], B * topk + 1, "columns (B*topk + 1)"
    )
    validate.at_least(
        "chain_kv_indices", chain_kv_indices.shape[1], chain_width,
        "columns (B*topk*min(rows, w))" if rail else "columns (B*topk*rows)",
    )  # fmt: skip
    if seq_lens_sum is not None:
        validate.at_least("prefix_kv_indices", prefix_kv_indices.shape[-1],
                          _prefix_need(seq_lens_sum, B, window, sink, rail),
                          "entries a row (min(ΣL, B*(w - 1)) under the rail)" if rail else
                          "entries (min(ΣL, B*(window_size + sink_size)) with a draft window, "
                          "else ΣL)")  # fmt: skip
    status = validate.status(status, device)
    out = (prefix_kv_indices, prefix_kv_indptr, chain_kv_indices, chain_kv_indptr)
    return topk, num_steps, rows, B, out, status, (window, sink, E, rail)


def _prefix_need(seq_lens_sum: int, batch: int, window: int, sink: int, rail: int = 0) -> int:
    """Entries of the prefix level (a row of it under the rail) for a host ``ΣL``: ``ΣL``,
    bounded by ``B·(W + Sk)`` with a draft window (each list keeps at most ``W + Sk`` tokens),
    by ``B·(w − 1)`` under the rail (step 0's lists, the longest, keep ``min(L, w − 1)``;
    design §2.10)."""
    total = verify_kv_indices_need(seq_lens_sum, batch, 0)
    if rail:
        return rail_prefix_total(total, batch, rail)
    return min(total, batch * (window + sink)) if window else total


def bind_shared_prefix_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    num_rows: int | None = None,
    prefix_kv_indices: torch.Tensor | None = None,
    prefix_kv_indptr: torch.Tensor | None = None,
    chain_kv_indices: torch.Tensor | None = None,
    chain_kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    window_size: int = 0,
    sink_size: int = 0,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> Stage:
    """Bind once: build both levels of the cascade draft decode, all steps, in one launch.

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
        Chain rows (steps) to build, ``0 ≤ rows ≤ S`` (default ``S``). The prefix level is
        built whatever ``rows`` is.
    prefix_kv_indices : torch.Tensor, optional
        ``[W_prefix]`` int32 or int64; ``ΣL`` entries are written (``ΣLw`` with a window),
        stores past ``W_prefix`` are dropped and reported.
    prefix_kv_indptr : torch.Tensor, optional
        ``[≥ B + 1]`` int32 or int64; entries ``0 … B`` (entry 0 included).
    chain_kv_indices : torch.Tensor, optional
        ``[≥ rows, ≥ B·K·rows]`` int32 or int64; row ``s`` uses ``B·K·(s+1)`` entries.
    chain_kv_indptr : torch.Tensor, optional
        ``[≥ rows, ≥ B·K + 1]`` int32 or int64; entries ``[s, 0 … B·K]``.
    seq_lens_sum : int, optional
        Host-side ``ΣL``; when given, ``prefix_kv_indices`` is checked before launch (against
        ``min(ΣL, B·(W + Sk))`` with a window).
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB``, ``OUT_OF_CAPACITY``, ``BAD_KV_ID`` (an id
        stored that did not map: written as the sink slot 0).
    window_size, sink_size : int, optional
        A draft window (design §2.10): the prefix level lists ``Lw = min(L, W + Sk)`` tokens
        of each request, its first ``min(Sk, L)`` then its most recent ones, and
        ``prefix_kv_indptr`` sums the ``Lw``. ``window_size = 0`` (the default) is no window;
        ``sink_size`` is then not read.
    entry_page_size, v2p : int, torch.Tensor, optional
        The id space of the rows (design §2.10): rows of page ids of ``E`` positions each,
        and a virtual → physical page map at page size ``ps``; both levels hold physical ids.
    sliding_window_size, full_to_swa
        A window layer (design §2.10): under the rail ``w`` the prefix level has a row a step
        (``prefix_kv_indices [≥ rows, W_prefix]``, ``prefix_kv_indptr [≥ rows, ≥ B + 1]``),
        row ``s`` listing each request's last ``min(L, max(w − s − 1, 0))`` positions, and
        chain row ``s`` each branch's last ``min(s + 1, w)`` steps (``chain_kv_indptr[s, z] =
        z·min(s + 1, w)``); ``full_to_swa`` (``[P_full]``, ``-1`` where evicted) emits the ids
        of both levels in window-pool ids. Not with a draft window.

    Returns
    -------
    Stage
        Its result is ``(prefix_kv_indices, prefix_kv_indptr, chain_kv_indices, chain_kv_indptr)``,
        what the eager :func:`shared_prefix_kv_indices` returns.

    Examples
    --------
    ``seq_lens=[3, 1]``, ``K=2``, ``S=2``, ``ps=1`` → ``prefix_kv_indptr=[0, 3, 4]``,
    ``prefix_kv_indices=[r0[0], r0[1], r0[2], r1[0]]``; chain row 1 (``it=2``):
    ``chain_kv_indptr=[0, 2, 4, 6, 8]``, ``chain_kv_indices=[r0[3], r0[4], r0[5], r0[6],
    r1[1], r1[2], r1[3], r1[4]]``.

    Grid ``(max(B, 1), chunk_programs)``, as :func:`draft_decode_kv_indices`. No host sync;
    ``B``, lengths and strides are runtime arguments.
    """
    topk, num_steps, rows, B, out, status, (window, sink, E, rail) = _prepare(
        "shared_prefix_kv_indices", req_pool_indices, req_to_token, seq_lens, topk, num_steps,
        page_size, num_rows, prefix_kv_indices, prefix_kv_indptr, chain_kv_indices,
        chain_kv_indptr, seq_lens_sum, status, window_size, sink_size, entry_page_size, v2p,
        sliding_window_size, full_to_swa,
    )  # fmt: skip
    prefix_kv_indices, prefix_kv_indptr, chain_kv_indices, chain_kv_indptr = out
    device = req_to_token.device
    tokens = req_to_token.shape[1] * E
    width = min(tokens, window + sink) if window else tokens
    if rail:
        width = min(tokens, rail - 1)
    grid = (max(B, 1), chunk_programs(device, B, width, _BLOCK))
    launch = _shared_prefix_kv_indices_launch.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        prefix_kv_indices_ptr=prefix_kv_indices,
        prefix_kv_indptr_ptr=prefix_kv_indptr,
        chain_kv_indices_ptr=chain_kv_indices,
        chain_kv_indptr_ptr=chain_kv_indptr,
        v2p_ptr=v2p,
        **window_arguments(full_to_swa),
        status_ptr=status,
        page_size=page_size,
        num_rows=rows,
        W_prefix=prefix_kv_indices.shape[-1],
        W_chain=chain_kv_indices.shape[1],
        stride_chain=chain_kv_indices.stride(0),
        stride_chain_ptr=chain_kv_indptr.stride(0),
        chunk_programs=grid[1],
        num_pages=v2p.shape[0] if v2p is not None else 0,
        window=window,
        sink=sink,
        rail=rail if rail else None,
        stride_prefix=prefix_kv_indices.stride(0) if rail else 0,
        stride_prefix_ptr=prefix_kv_indptr.stride(0) if rail else 0,
        TOPK=topk,
        NUM_STEPS=num_steps,
        LAYOUT_B=uses_layout_b(topk, page_size),
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        BLOCK_CHAIN=next_power_of_2(num_steps * topk * num_steps),
        BLOCK_PTR=next_power_of_2(num_steps * topk),
        BLOCK_ROWS=next_power_of_2(num_steps),
        ENTRY_PAGE_SIZE=E,
        TRANSLATE=v2p is not None,
        RAIL=bool(rail),
        HAS_STATUS=True,
        num_warps=4,
    )
    return Stage([launch], result=out)


shared_prefix_kv_indices = launcher(bind_shared_prefix_kv_indices)
shared_prefix_kv_indices.kernels = (_shared_prefix_kv_indices_kernel,)  # for specmeta.registry


def shared_prefix_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    num_rows: int | None = None,
    prefix_kv_indices: torch.Tensor | None = None,
    prefix_kv_indptr: torch.Tensor | None = None,
    chain_kv_indices: torch.Tensor | None = None,
    chain_kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
    window_size: int = 0,
    sink_size: int = 0,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`shared_prefix_kv_indices` (vectorised over the batch; syncs)."""
    topk, num_steps, rows, B, out, status, (window, sink, E, rail) = _prepare(
        "shared_prefix_kv_indices_ref", req_pool_indices, req_to_token, seq_lens, topk,
        num_steps, page_size, num_rows, prefix_kv_indices, prefix_kv_indptr, chain_kv_indices,
        chain_kv_indptr, seq_lens_sum, status, window_size, sink_size, entry_page_size, v2p,
        sliding_window_size, full_to_swa,
    )  # fmt: skip
    spaces = dict(entry_page_size=E, v2p=v2p, page_size=page_size)
    prefix_kv_indices, prefix_kv_indptr, chain_kv_indices, chain_kv_indptr = out
    device = req_to_token.device
    K = topk
    L = seq_lens.to(torch.int64).clamp_min(0)
    if rail:
        bits = _rail_prefix_rows_ref(req_pool_indices, req_to_token, L, rows, rail,
                                     prefix_kv_indices, prefix_kv_indptr, full_to_swa, spaces)  # fmt: skip
        if B and bool(((seq_lens < 0) | (L > req_to_token.shape[1] * E)).any()):
            bits |= int(Status.POS_OOB)
        _chains_ref(req_pool_indices, req_to_token, seq_lens, K, num_steps, page_size, rows,
                    rail, chain_kv_indices, chain_kv_indptr, full_to_swa, spaces, bits, status)
        return out
    Lw = windowed_length_ref(seq_lens, window, sink)
    end = torch.cumsum(Lw, 0)
    prefix_kv_indptr[0] = 0
    prefix_kv_indptr[1 : B + 1] = end.to(prefix_kv_indptr.dtype)
    # Entry k of request b lands at end_b − Lw_b + k ≥ k: none past the buffer is kept, so the
    # work stops there whatever a garbage length says.
    W_prefix = prefix_kv_indices.shape[0]
    width = min(int(Lw.max()), W_prefix) if B else 0
    k = torch.arange(width, device=device).view(1, -1)
    dst = (end - Lw).view(-1, 1) + k
    keep = (k < Lw.view(-1, 1)) & (dst < W_prefix)
    pos = torch.where(keep, window_positions_ref(L.view(-1, 1), Lw.view(-1, 1), k, sink), 0)
    ids, unmapped, bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos, keep, **spaces)
    ids, lost = window_pool_ids_ref(ids, _read(req_pool_indices, req_to_token, pos, keep, E)
                                    & ~unmapped, full_to_swa)  # fmt: skip
    unmapped |= lost
    prefix_kv_indices[dst[keep]] = ids[keep].to(prefix_kv_indices.dtype)
    bits &= int(Status.ROW_OOB)
    if bool(unmapped.any()):
        bits |= int(Status.BAD_KV_ID)
    if B and int(end[-1]) > W_prefix:
        bits |= int(Status.OUT_OF_CAPACITY)
    if B and bool(((seq_lens < 0) | (L > req_to_token.shape[1] * E)).any()):
        bits |= int(Status.POS_OOB)

    _chains_ref(req_pool_indices, req_to_token, seq_lens, K, num_steps, page_size, rows, 0,
                chain_kv_indices, chain_kv_indptr, full_to_swa, spaces, bits, status)
    return out


def _read(req_pool_indices, req_to_token, pos, mask, E):
    """The lanes a row read reaches (its row in range, its position inside the row): those
    whose id goes on to the window pool map."""
    R, W = req_to_token.shape
    rows = req_pool_indices.to(torch.int64).view(-1, *([1] * (pos.dim() - 1)))
    return mask & (rows >= 0) & (rows < R) & (pos // E < W)


def _rail_prefix_rows_ref(req_pool_indices, req_to_token, L, rows, rail, prefix_kv_indices,
                          prefix_kv_indptr, full_to_swa, spaces) -> int:  # fmt: skip
    """The torch twin of :func:`_rail_prefix_rows`: row ``s`` of both prefix buffers from the
    last ``min(L, max(w − s − 1, 0))`` positions of each request; returns the status bits
    (``ROW_OOB``, ``BAD_KV_ID``, ``OUT_OF_CAPACITY``)."""
    B, bits = L.shape[0], 0
    for s in range(rows):
        kept, _ = rail_draft_lengths_ref(L, s, rail)
        end = torch.cumsum(kept, 0)
        prefix_kv_indptr[s, 0] = 0
        prefix_kv_indptr[s, 1 : B + 1] = end.to(prefix_kv_indptr.dtype)
        found = window_lists_ref(req_pool_indices, req_to_token, L - kept, kept,
                                 prefix_kv_indices[s], end - kept, full_to_swa=full_to_swa,
                                 **spaces)  # fmt: skip
        bits |= found & int(Status.ROW_OOB | Status.BAD_KV_ID)
        if B and int(end[-1]) > prefix_kv_indices.shape[-1]:
            bits |= int(Status.OUT_OF_CAPACITY)
    return bits


def _chains_ref(req_pool_indices, req_to_token, seq_lens, K, num_steps, page_size, rows, rail,
                chain_kv_indices, chain_kv_indptr, full_to_swa, spaces, bits,
                status) -> None:  # fmt: skip
    """The chain level (design §2.6; under the rail each step's last ``min(s + 1, w)`` steps,
    design §2.10), ids through the row's space and the window pool map; reports ``bits`` and
    the chains' own into ``status``."""
    B, device = seq_lens.shape[0], req_to_token.device
    chain_pos = draft_positions_ref(seq_lens, K, num_steps, page_size)[:, :, :rows]
    read = torch.ones_like(chain_pos, dtype=torch.bool)
    chain, unmapped, chain_bits = load_kv_ids_ref(req_to_token, req_pool_indices, chain_pos,
                                                  read, **spaces)  # fmt: skip
    E = spaces["entry_page_size"]
    chain, lost = window_pool_ids_ref(chain, _read(req_pool_indices, req_to_token, chain_pos,
                                                   read, E) & ~unmapped, full_to_swa)  # fmt: skip
    unmapped |= lost
    bits |= chain_bits | (int(Status.BAD_KV_ID) if bool(unmapped.any()) else 0)
    chain = chain.reshape(B * K, rows)
    z = torch.arange(B * K + 1, device=device)
    for s in range(rows):
        it = s + 1
        _, width = rail_draft_lengths_ref(seq_lens, s, rail)  # the last width steps
        chain_kv_indptr[s, : B * K + 1] = (z * width).to(chain_kv_indptr.dtype)
        chain_kv_indices[s, : B * K * width] = chain[:, it - width : it].reshape(-1).to(
            chain_kv_indices.dtype)  # fmt: skip
    if bits:
        status |= bits
