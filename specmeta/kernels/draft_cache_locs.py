"""Draft KV slots and layout-B prefix-tail copy pairs (design §1, §2.1).

Branch ``t`` of request ``b`` writes its step-``j`` token at row position ``p(b, t, j)``:

* layout A (``ps == 1`` or ``K == 1``): ``p = L_b + t·S + j``;
* layout B (``ps > 1`` and ``K > 1``): ``p = base_b + t·nnp_b·ps + lpl_b + j``, every branch
  owning a page-aligned region of ``nnp_b`` pages whose first ``lpl_b`` slots (for ``t ≥ 1``)
  must hold a copy of the prefix tail.

``out_cache_loc[(b·K + t)·S + j] = row_b[p(b, t, j)]``. The position rule lives in one
``@triton.jit`` helper, :func:`draft_slot_position` in :mod:`specmeta.kernels._common`, shared
with every kernel that reads draft slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import uses_layout_b
from ..launch import Launcher, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    POS_OOB,
    ROW_OOB,
    batch_arguments,
    check_batch,
    check_id_spaces,
    check_steps,
    draft_positions_ref,
    draft_slot_position,
    load_kv_ids,
    load_kv_ids_ref,
    load_request,
    or_status,
)
from ._window import check_window, load_window_ids, load_window_ids_ref, window_arguments

__all__ = [
    "bind_assign_draft_cache_locs",
    "bind_prefix_tail_copy_pairs",
    "assign_draft_cache_locs",
    "assign_draft_cache_locs_ref",
    "prefix_tail_copy_pairs",
    "prefix_tail_copy_pairs_ref",
    "draft_positions_ref",
]


# --------------------------------------------------------------------------------------------
# assign_draft_cache_locs
# --------------------------------------------------------------------------------------------
@triton.jit(
    do_not_specialize=["B", "R", "W_row", "stride_row", "page_size", "num_pages", "full_size"]
)
def _assign_draft_cache_locs_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    out_cache_loc_ptr,  # [B*K*S] int32|int64
    positions_ptr,  # [B*K] int32|int64 (unused unless WRITE_POSITIONS)
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE)
    full_to_swa_ptr,  # [full_size] int32|int64 (read only with TO_WINDOW)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    page_size,
    num_pages,
    full_size,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    LAYOUT_B: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,
    TRANSLATE: tl.constexpr,
    TO_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two ≥ K*S
    WRITE_POSITIONS: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """One program per request; the ``K·S`` slots of the request are one vector, each read
    as its row and the id space say (:func:`~specmeta.kernels._common.load_kv_ids`)."""
    b = tl.program_id(0).to(tl.int64)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )

    e = tl.arange(0, BLOCK)
    live = e < TOPK * NUM_STEPS
    t = e // NUM_STEPS
    j = e % NUM_STEPS
    p = draft_slot_position(L, t, j, page_size, NUM_STEPS, LAYOUT_B)
    # A scalar condition joins a vector mask through tl.where: Triton 3.9's interpreter mistypes
    # a splatted scalar comparison in `vector & scalar`.
    slot, in_row, bad = load_window_ids(req_to_token_ptr + row_base, p,
                                        tl.where(row_ok, live, False), W_row, v2p_ptr, num_pages,
                                        page_size, full_to_swa_ptr, full_size, ENTRY_PAGE_SIZE,
                                        TRANSLATE, TO_WINDOW)  # fmt: skip
    tl.store(out_cache_loc_ptr + b * (TOPK * NUM_STEPS) + e, slot, mask=live)

    if WRITE_POSITIONS:
        k = tl.arange(0, BLOCK)
        tl.store(positions_ptr + b * TOPK + k, tl.zeros_like(k).to(tl.int64) + L, mask=k < TOPK)

    if HAS_STATUS:
        pos_bad = tl.max((live & ~in_row).to(tl.int32), axis=0) | (~L_ok).to(tl.int32)
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(pos_bad != 0, POS_OOB, 0)
            | tl.where(tl.max(bad.to(tl.int32), axis=0) != 0, BAD_KV_ID, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_assign_draft_cache_locs_launch = Launcher(_assign_draft_cache_locs_kernel)


def _check_out(name, buf, need, device, dtypes=validate.INDEX_DTYPES):
    validate.tensor(name, buf, dtypes=dtypes, ndim=1, device=device)
    validate.at_least(name, buf.shape[0], need)
    return buf


def bind_assign_draft_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    out_cache_loc: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> Stage:
    """Bind once: fill ``out_cache_loc`` with the draft KV slot of every (request, branch, step).

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64, the ``req_to_token`` row of each request.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64, row → position → KV slot; row 0 reserved.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix length ``L_b``.
    topk, num_steps, page_size : int
        ``K``, ``S`` and ``ps``; the slot layout follows from ``K`` and ``ps`` (design §1).
    out_cache_loc : torch.Tensor, optional
        ``[≥ B·K·S]`` int32 or int64; ``[:B·K·S]`` is written, laid out ``[B, K, S]``.
        Allocated as int64 when omitted.
    positions : torch.Tensor, optional
        ``[≥ B·K]`` int32 or int64; when given, ``positions[b·K + t] = L_b``.
    status : torch.Tensor, optional
        ``int32 [1]``; ``ROW_OOB`` / ``POS_OOB`` are ORed in when a gather was masked (the slot
        reads 0, the sink), ``BAD_KV_ID`` when a slot did not map (design §2.10).
    entry_page_size : int
        ``E > 1``: the rows hold page ids, position ``p`` being ``row[p // E]·E + p mod E``.
    v2p : torch.Tensor, optional
        ``[P]`` virtual → physical page map at page size ``page_size``: the slots are written
        as physical ids, ``v2p[id // ps]·ps + id mod ps`` (design §2.10).
    full_to_swa : torch.Tensor, optional
        ``[P_full]`` full → window pool slot map of a hybrid model (design §2.10): the slots
        are written in window-pool ids, where an engine writes a window layer's draft KV. Every
        draft slot is read, so an entry of ``-1`` gives the sink and ``BAD_KV_ID``.

    Returns
    -------
    Stage
        Its result is what the eager :func:`assign_draft_cache_locs` returns: torch.Tensor,
        ``out_cache_loc`` (the whole buffer that was passed, or a new ``[B·K·S]`` int64 tensor).

    Examples
    --------
    ``seq_lens=[3, 1]``, ``K=2``, ``S=2``, ``ps=1`` → positions
    ``[[3, 4], [5, 6]]`` for request 0 and ``[[1, 2], [3, 4]]`` for request 1, each looked up
    in that request's row.

    One program per request; no host sync; ``B`` and every length are runtime arguments.
    """
    topk, num_steps, page_size, _ = check_steps(topk, num_steps, page_size, None)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    _, _, entry = check_id_spaces("assign_draft_cache_locs", 0, 0, entry_page_size, v2p, device)
    check_window("assign_draft_cache_locs", None, full_to_swa, device)
    n = B * topk * num_steps
    if out_cache_loc is None:
        out_cache_loc = torch.empty(n, dtype=torch.int64, device=device)
    _check_out("out_cache_loc", out_cache_loc, n, device)
    if positions is not None:
        _check_out("positions", positions, B * topk, device)
    status = validate.status(status, device)
    if B == 0:
        return Stage([], result=out_cache_loc)
    launch = _assign_draft_cache_locs_launch.bind(
        (B,),
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        out_cache_loc_ptr=out_cache_loc,
        positions_ptr=positions if positions is not None else out_cache_loc,
        v2p_ptr=v2p if v2p is not None else out_cache_loc,
        **window_arguments(full_to_swa),
        status_ptr=status,
        page_size=page_size,
        num_pages=v2p.shape[0] if v2p is not None else 0,
        TOPK=topk,
        NUM_STEPS=num_steps,
        LAYOUT_B=uses_layout_b(topk, page_size),
        ENTRY_PAGE_SIZE=entry,
        TRANSLATE=v2p is not None,
        BLOCK=next_power_of_2(topk * num_steps),
        WRITE_POSITIONS=positions is not None,
        HAS_STATUS=True,
    )
    return Stage([launch], result=out_cache_loc)


assign_draft_cache_locs = launcher(bind_assign_draft_cache_locs)
assign_draft_cache_locs.kernels = (_assign_draft_cache_locs_kernel,)  # for specmeta.registry


# --------------------------------------------------------------------------------------------
# prefix_tail_copy_pairs
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["B", "R", "W_row", "stride_row", "page_size", "num_pages"])
def _prefix_tail_copy_pairs_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    tgt_ptr,  # [B*(K-1)*(ps-1)] int32|int64
    src_ptr,  # [B*(K-1)*(ps-1)] int32|int64
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE)
    status_ptr,  # [1] int32
    B,
    R,
    W_row,
    stride_row,
    page_size,
    num_pages,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,
    TRANSLATE: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two ≥ (K-1)*(ps-1)
    HAS_STATUS: tl.constexpr,
):
    """One program per request; its ``(K−1)·(ps−1)`` pairs are one vector, unused ones (0, 0)."""
    b = tl.program_id(0).to(tl.int64)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    lpl = L % page_size
    base = L - lpl
    nnp = (lpl + NUM_STEPS + page_size - 1) // page_size

    # Outside layout B (K == 1 or ps == 1) the list is empty and the program only checks the
    # request's row and length, so a bad one is reported as every other op reports it.
    width = (TOPK - 1) * (page_size - 1)
    per_branch = tl.maximum(page_size - 1, 1)  # pairs per branch; 1 keeps // and % defined
    e = tl.arange(0, BLOCK)
    live = e < width
    t = 1 + e // per_branch
    u = e % per_branch
    used = live & (u < lpl)
    src_pos = base + u
    tgt_pos = base + t * nnp * page_size + u
    tokens = W_row * ENTRY_PAGE_SIZE  # positions a row covers
    ok = tl.where(row_ok, used & (tgt_pos < tokens), False)  # src_pos < L ≤ tgt_pos
    row = req_to_token_ptr + row_base
    src, _, src_bad = load_kv_ids(row, src_pos, ok, W_row, v2p_ptr, num_pages, page_size,
                                  ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
    tgt, _, tgt_bad = load_kv_ids(row, tgt_pos, ok, W_row, v2p_ptr, num_pages, page_size,
                                  ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
    lost = src_bad | tgt_bad  # a pair with an id that did not map is (0, 0)
    tl.store(src_ptr + b * width + e, tl.where(lost, 0, src), mask=live)
    tl.store(tgt_ptr + b * width + e, tl.where(lost, 0, tgt), mask=live)

    if HAS_STATUS:
        pos_bad = tl.max((used & (tgt_pos >= tokens)).to(tl.int32), axis=0) | (~L_ok).to(tl.int32)
        bits = (
            tl.where(row_ok, 0, ROW_OOB)
            | tl.where(pos_bad != 0, POS_OOB, 0)
            | tl.where(tl.max(lost.to(tl.int32), axis=0) != 0, BAD_KV_ID, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_prefix_tail_copy_pairs_launch = Launcher(_prefix_tail_copy_pairs_kernel)


def _pair_buffers(B, topk, page_size, tgt, src, device):
    """``(width, n, tgt, src)``: pairs per request (``(K−1)·(ps−1)`` in layout B, else none),
    ``n = B·width`` in all, and the pair lists, allocated int64 where omitted."""
    width = (topk - 1) * (page_size - 1) if uses_layout_b(topk, page_size) else 0
    n = B * width
    if tgt is None:
        tgt = torch.empty(n, dtype=torch.int64, device=device)
    if src is None:
        src = torch.empty(n, dtype=torch.int64, device=device)
    return width, n, tgt, src


def bind_prefix_tail_copy_pairs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    tgt: torch.Tensor | None = None,
    src: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
) -> Stage:
    """Bind once: slot pairs that copy each request's prefix tail into branches ``1 … K−1`` (layout
    B).

    Pair ``q = (b·(K−1) + t−1)·(ps−1) + u`` is ``src = row_b[base_b + u]``,
    ``tgt = row_b[base_b + t·nnp_b·ps + u]`` for ``u < lpl_b``, and ``(0, 0)`` (a self-move of
    the sink) otherwise. The list has a fixed length ``B·(K−1)·(ps−1)``, so it needs no host
    sync; feed it to ``move_kv_cache``. Outside layout B it is empty, and the launch only
    checks every request's row and length (a bad one is reported all the same).

    Parameters
    ----------
    req_pool_indices, req_to_token, seq_lens : torch.Tensor
        As in :func:`assign_draft_cache_locs`.
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps``.
    tgt, src : torch.Tensor, optional
        ``[≥ B·(K−1)·(ps−1)]`` int32 or int64 each; allocated as int64 when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``; ``ROW_OOB`` / ``POS_OOB`` when a gather was masked (the pair reads (0, 0)),
        ``BAD_KV_ID`` when a slot did not map (the pair is (0, 0)).
    entry_page_size, v2p
        The rows' id space, as in :func:`assign_draft_cache_locs` (design §2.10): the pairs
        leave as physical slots, ready for ``move_kv_cache``.

    Returns
    -------
    Stage
        Its result is ``(tgt, src)`` (tuple of torch.Tensor), what the eager
        :func:`prefix_tail_copy_pairs` returns.

    Examples
    --------
    ``seq_lens=[5]``, ``K=2``, ``S=2``, ``ps=4`` → ``lpl=1``, ``nnp=1``: one used pair
    ``src=row[4]``, ``tgt=row[8]``, then two ``(0, 0)`` pairs.
    """
    topk, num_steps, page_size, _ = check_steps(topk, num_steps, page_size, None)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    _, _, entry = check_id_spaces("prefix_tail_copy_pairs", 0, 0, entry_page_size, v2p, device)
    width, n, tgt, src = _pair_buffers(B, topk, page_size, tgt, src, device)
    _check_out("tgt", tgt, n, device)
    _check_out("src", src, n, device)
    status = validate.status(status, device)
    if B == 0:
        return Stage([], result=(tgt, src))
    launch = _prefix_tail_copy_pairs_launch.bind(
        (B,),
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        tgt_ptr=tgt,
        src_ptr=src,
        v2p_ptr=v2p if v2p is not None else tgt,
        status_ptr=status,
        page_size=page_size,
        num_pages=v2p.shape[0] if v2p is not None else 0,
        TOPK=topk,
        NUM_STEPS=num_steps,
        ENTRY_PAGE_SIZE=entry,
        TRANSLATE=v2p is not None,
        BLOCK=next_power_of_2(max(width, 1)),
        HAS_STATUS=True,
    )
    return Stage([launch], result=(tgt, src))


prefix_tail_copy_pairs = launcher(bind_prefix_tail_copy_pairs)
prefix_tail_copy_pairs.kernels = (_prefix_tail_copy_pairs_kernel,)  # for specmeta.registry


# --------------------------------------------------------------------------------------------
# References (plain torch; they may sync)
# --------------------------------------------------------------------------------------------


def assign_draft_cache_locs_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    out_cache_loc: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    full_to_swa: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`assign_draft_cache_locs`."""
    status = validate.status(status, req_to_token.device)
    check_id_spaces("assign_draft_cache_locs_ref", 0, 0, entry_page_size, v2p, req_to_token.device)
    check_window("assign_draft_cache_locs_ref", None, full_to_swa, req_to_token.device)
    B = req_pool_indices.shape[0]
    n = B * topk * num_steps
    if out_cache_loc is None:
        out_cache_loc = torch.empty(n, dtype=torch.int64, device=req_to_token.device)
    pos = draft_positions_ref(seq_lens, topk, num_steps, page_size)
    vals, bad, bits = load_window_ids_ref(req_to_token, req_pool_indices, pos,
                                          torch.ones_like(pos, dtype=torch.bool),
                                          entry_page_size=entry_page_size, v2p=v2p,
                                          page_size=page_size, full_to_swa=full_to_swa)  # fmt: skip
    if bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    if bool(bad.any()):
        bits |= int(Status.BAD_KV_ID)
    out_cache_loc[:n] = vals.reshape(-1).to(out_cache_loc.dtype)
    if positions is not None:
        positions[: B * topk] = seq_lens.to(torch.int64).clamp_min(0).repeat_interleave(topk)
    or_status(status, bits)
    return out_cache_loc


def prefix_tail_copy_pairs_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    tgt: torch.Tensor | None = None,
    src: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`prefix_tail_copy_pairs`."""
    device = req_to_token.device
    status = validate.status(status, device)
    check_id_spaces("prefix_tail_copy_pairs_ref", 0, 0, entry_page_size, v2p, device)
    B = req_pool_indices.shape[0]
    _, n, tgt, src = _pair_buffers(B, topk, page_size, tgt, src, device)
    if n == 0:
        # Outside layout B nothing is gathered; a bad row or length is reported all the same.
        rows = req_pool_indices.to(torch.int64)
        bits = (
            0 if bool(((rows >= 0) & (rows < req_to_token.shape[0])).all()) else int(Status.ROW_OOB)
        )
        if bool((seq_lens < 0).any()):
            bits |= int(Status.POS_OOB)
        or_status(status, bits)
        return tgt, src
    L = seq_lens.to(torch.int64).clamp_min(0).view(-1, 1, 1)
    lpl = L % page_size
    base = L - lpl
    nnp = (lpl + num_steps + page_size - 1) // page_size
    t = torch.arange(1, topk, device=device).view(1, -1, 1)
    u = torch.arange(page_size - 1, device=device).view(1, 1, -1)
    used = (u < lpl).expand(B, topk - 1, page_size - 1)
    src_pos = (base + u).expand_as(used)
    tgt_pos = base + t * nnp * page_size + u
    in_row = tgt_pos < req_to_token.shape[1] * entry_page_size
    keep = used & in_row
    read = dict(entry_page_size=entry_page_size, v2p=v2p, page_size=page_size)
    src_vals, src_bad, bits_s = load_kv_ids_ref(req_to_token, req_pool_indices,
                                                torch.where(keep, src_pos, 0), keep, **read)  # fmt: skip
    tgt_vals, tgt_bad, bits_t = load_kv_ids_ref(req_to_token, req_pool_indices,
                                                torch.where(keep, tgt_pos, 0), keep, **read)  # fmt: skip
    lost = src_bad | tgt_bad  # a pair with an id that did not map is (0, 0)
    bits = (bits_s | bits_t) & int(Status.ROW_OOB)
    if bool((used & ~in_row).any()) or bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    if bool(lost.any()):
        bits |= int(Status.BAD_KV_ID)
    src[:n] = torch.where(keep & ~lost, src_vals, 0).reshape(-1).to(src.dtype)
    tgt[:n] = torch.where(keep & ~lost, tgt_vals, 0).reshape(-1).to(tgt.dtype)
    or_status(status, bits)
    return tgt, src
