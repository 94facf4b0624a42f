"""The FA3 expand pass of every draft step in one launch (design §2.3).

FA3 serves ``K > 1`` draft decode as a cascade: a normal pass over the shared prefix
(:mod:`specmeta.kernels.prefix_page_table`) and an expand pass over each branch's own tokens,
merged by log-sum-exp. For step ``s`` (``dl = s + 1``) and branch row ``r = b·K + t``:

* ``ps > 1``: the pages ``P_j = out_cache_loc[r·S + j] // ps``, ``j < dl``, collapsed where
  consecutive slots share a page — never assumed contiguous — fill
  ``page_table[s, r, 0 … u−1]``, ``u = ceil((lpl_b + dl) / ps)``;
  ``cache_seqlens[s, r] = lpl_b + dl`` (the branch region starts with the prefix tail, design §1);
* ``ps == 1``: ``page_table[s, r, j] = out_cache_loc[r·S + j]`` for ``j < dl``;
  ``cache_seqlens[s, r] = dl``;
* columns ``[u, W)`` hold 0, the sink page: nothing stale is left behind.

Data columns stay below ``u ≤ dl ≤ rows ≤ W`` (``W ≥ rows`` is checked before launch), and every
store is masked by the buffer's extent whatever ``out_cache_loc`` holds, so no scatter runs
past its rows; an empty batch (``B = 0``) is a valid call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import expand_page_table_width
from ..launch import Launcher, next_power_of_2
from ..status import Status
from ._common import BAD_PAGE, POOL_OOB, POS_OOB

__all__ = ["expand_page_table", "expand_page_table_ref"]


# seq_lens entries summed per iteration of the exclusive Σ lpl loop (one load up to B = 1024).
_BLOCK_B = 1024


@triton.jit
def _chain_slot(out_cache_loc_ptr, first, t, j, live, NUM_STEPS: tl.constexpr):
    """Slots ``out_cache_loc[(first + t)·S + j]`` where ``live``, 0 elsewhere; a negative slot
    reads 0. Returns ``(slot, negative)``."""
    slot = tl.load(out_cache_loc_ptr + (first + t) * NUM_STEPS + j, mask=live, other=0)
    slot = slot.to(tl.int64)
    neg = live & (slot < 0)
    return tl.where(neg, 0, slot), neg


@triton.jit
def expand_page_table_program(
    b,  # request
    out_cache_loc_ptr,  # [≥B*K*S] int32|int64, laid out [B, K, S]
    seq_lens_ptr,  # [B] int32|int64
    page_table_ptr,  # [≥rows, ≥B*K, W] int32|int64, strides (stride_pt_s, stride_pt_r, 1)
    cache_seqlens_ptr,  # [≥rows, ≥B*K] int32|int64, row stride stride_cs
    cu_seqlens_k_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_cu (unless WRITE_CU)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    num_rows,
    W,
    stride_pt_s,
    stride_pt_r,
    stride_cs,
    stride_cu,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    PAGED: tl.constexpr,  # PAGE_SIZE > 1
    PAGE_SIZE: tl.constexpr,  # a config constant: // and % by it compile to shifts or multiplies
    BLOCK_K: tl.constexpr,  # next power of two ≥ K: branch t
    BLOCK_S: tl.constexpr,  # next power of two ≥ S: chain index j, step s, data column c
    BLOCK_W: tl.constexpr,  # columns per tile of zeros past column BLOCK_S
    BLOCK_B: tl.constexpr,
    WRITE_CU: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """Program ``b`` of the grid ``(max(B, 1),)``: every step of the ``K`` branch rows of
    request ``b``; the last request also writes the closing ``cu_seqlens_k`` entries (entry 0
    when ``B == 0``). A device function so that a fused kernel can run it on part of its grid.

    Every tile is 3-D, ``[branch t, chain index j or step s, column c]`` with size-1 axes where
    a value does not depend on one, so that Triton keeps them all in one register layout (no
    shared-memory round trip between them). Every load is issued before the first store (the
    compiler cannot move a load above a store through a pointer that may alias) and, up to
    B = 1024, before the first use of a loaded value: all of them are in flight together."""
    b = b.to(tl.int64)  # first·S and branch-row products are int64 from here
    live = b < B
    first = b * TOPK  # branch row of t = 0
    L = tl.load(seq_lens_ptr + b, mask=live, other=0).to(tl.int64)

    t = tl.arange(0, BLOCK_K)[:, None, None]
    j = tl.arange(0, BLOCK_S)[None, :, None]  # chain index j; also step s of the tiles
    c = tl.arange(0, BLOCK_S)[None, None, :]  # column c: data columns are < rows ≤ S
    in_rows = tl.where(live, (t < TOPK) & (j < num_rows), False)  # [K, S, 1]
    # Every step's slot is loaded, built or not, so that a negative one is always reported;
    # the steps past num_rows feed nothing else.
    in_steps = tl.where(live, (t < TOPK) & (j < NUM_STEPS), False)  # [K, S, 1]
    if PAGED:
        slot, neg = _chain_slot(out_cache_loc_ptr, first, t, j, in_steps, NUM_STEPS)
        # The previous slot gathered again rather than shifted out of `slot`: the two loads
        # are in flight together, a shift would wait for the first one.
        prev, _neg_prev = _chain_slot(out_cache_loc_ptr, first, t, j - 1, in_rows & (j >= 1),
                                      NUM_STEPS)  # fmt: skip
    else:
        # Every slot is its own page (duplicates are not collapsed): column c of every step is
        # chain slot c, gathered straight into the column axis.
        # Every step's slot, built or not (a negative one is reported); columns past num_rows
        # are never stored.
        in_cols = tl.where(live, (t < TOPK) & (c < NUM_STEPS), False)  # [K, 1, S]
        run_page, neg = _chain_slot(out_cache_loc_ptr, first, t, c, in_cols, NUM_STEPS)
    lpl_before = b * 0  # Σ_{b'<b} lpl_b' (0 when ps == 1), int64
    if WRITE_CU and PAGED:
        # The first BLOCK_B lengths (all of them up to B = 1024) in straight-line code, so the
        # load goes out with the ones above; a load in the loop only goes out once every load
        # above has arrived (the loop is a separate block, entered after their first use).
        head = tl.arange(0, BLOCK_B)
        L_head = tl.load(seq_lens_ptr + head, mask=head < b, other=0).to(tl.int64)
        lpl_before += tl.sum(tl.where(head < b, tl.maximum(L_head, 0) % PAGE_SIZE, 0), axis=0)
        for start in range(BLOCK_B, b, BLOCK_B):
            offs = start + tl.arange(0, BLOCK_B)
            before = offs < b
            prev_L = tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64)
            lpl_before += tl.sum(tl.where(before, tl.maximum(prev_L, 0) % PAGE_SIZE, 0), axis=0)

    L_ok = L >= 0
    L = tl.maximum(L, 0)
    if PAGED:
        lpl = L % PAGE_SIZE
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
    else:
        lpl = L * 0
        bad_page = False
        limit = j + 1
    seqlen = lpl + j + 1 + 0 * t  # [K, S, 1]: cache_seqlens of step s = j

    # Page-table tiles [branch t, step s, column c]: the c-th distinct page of branch t for
    # c < limit[t, s], then 0; columns from S on (a table wider than the steps) only hold 0.
    stride_s64 = stride_pt_s.to(tl.int64)  # step·(Bp·K·W) passes 2**31 only for huge tables
    base = page_table_ptr + (first + t) * stride_pt_r + j * stride_s64  # [K, S, 1]
    tl.store(base + c, tl.where(c < limit, run_page, 0), mask=in_rows & (c < W))
    for c0 in range(BLOCK_S, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)[None, None, :]
        tl.store(base + cols, tl.zeros([BLOCK_K, BLOCK_S, BLOCK_W], tl.int32),
                 mask=in_rows & (cols < W))  # fmt: skip

    rows = first + t  # [K, 1, 1] branch rows
    tl.store(cache_seqlens_ptr + j * stride_cs.to(tl.int64) + rows, seqlen, mask=in_rows)
    if WRITE_CU:
        # cu_seqlens_k[s, r] = Σ_{r'<r} (lpl_r' + s + 1) = K·Σ_{b'<b} lpl_b' + t·lpl_b + r·(s+1),
        # int64 throughout.
        cu_start = TOPK * lpl_before + t * lpl + rows * (j + 1)
        cu_rows = cu_seqlens_k_ptr + j * stride_cu.to(tl.int64)
        tl.store(cu_rows + rows, cu_start, mask=in_rows)
        # Closing entry cu[s, B·K] = cu[s, B·K − 1] + cache_seqlens[s, B·K − 1], from the
        # last request's last branch (0 when B == 0).
        BK = B * TOPK
        last = b == tl.maximum(B, 1) - 1
        closing = tl.where(live, cu_start + seqlen, 0)
        at_end = tl.where(last, (t == TOPK - 1) & (j < num_rows), False)
        tl.store(cu_rows + BK + 0 * t, closing, mask=at_end)

    if HAS_STATUS:
        pos_bad = live & ~L_ok
        neg_any = tl.max(neg.to(tl.int32)) != 0
        bits = (
            tl.where(pos_bad, POS_OOB, 0)
            | tl.where(neg_any, POOL_OOB, 0)
            | tl.where(bad_page, BAD_PAGE, 0)
        )
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


@triton.jit(
    do_not_specialize=[
        "B", "num_rows", "W", "stride_pt_s", "stride_pt_r", "stride_cs",
        "stride_cu",
    ]
)  # fmt: skip
def _expand_page_table_kernel(
    out_cache_loc_ptr,  # [≥B*K*S] int32|int64, laid out [B, K, S]
    seq_lens_ptr,  # [B] int32|int64
    page_table_ptr,  # [≥rows, ≥B*K, W] int32|int64, strides (stride_pt_s, stride_pt_r, 1)
    cache_seqlens_ptr,  # [≥rows, ≥B*K] int32|int64, row stride stride_cs
    cu_seqlens_k_ptr,  # [≥rows, ≥B*K+1] int32|int64, row stride stride_cu (unless WRITE_CU)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    num_rows,
    W,
    stride_pt_s,
    stride_pt_r,
    stride_cs,
    stride_cu,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    PAGED: tl.constexpr,  # PAGE_SIZE > 1
    PAGE_SIZE: tl.constexpr,  # a config constant: // and % by it compile to shifts or multiplies
    BLOCK_K: tl.constexpr,  # next power of two ≥ K: branch t
    BLOCK_S: tl.constexpr,  # next power of two ≥ S: chain index j, step s, data column c
    BLOCK_W: tl.constexpr,  # columns per tile of zeros past column BLOCK_S
    BLOCK_B: tl.constexpr,
    WRITE_CU: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1),)``: program ``b`` runs :func:`expand_page_table_program`."""
    expand_page_table_program(
        tl.program_id(0),
        out_cache_loc_ptr,
        seq_lens_ptr,
        page_table_ptr,
        cache_seqlens_ptr,
        cu_seqlens_k_ptr,
        status_ptr,
        B,
        num_rows,
        W,
        stride_pt_s,
        stride_pt_r,
        stride_cs,
        stride_cu,
        TOPK=TOPK,
        NUM_STEPS=NUM_STEPS,
        PAGED=PAGED,
        PAGE_SIZE=PAGE_SIZE,
        BLOCK_K=BLOCK_K,
        BLOCK_S=BLOCK_S,
        BLOCK_W=BLOCK_W,
        BLOCK_B=BLOCK_B,
        WRITE_CU=WRITE_CU,
        HAS_STATUS=HAS_STATUS,
    )


_expand_page_table_launch = Launcher(_expand_page_table_kernel)


def prepare_expand_page_table(
    out_cache_loc, seq_lens, topk, num_steps, page_size, num_rows, page_table, cache_seqlens,
    cu_seqlens_k, status, prefix="",
):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. ``prefix`` goes before
    the output buffers' names in messages (a fused op's ``expand_page_table``, …)."""
    topk = validate.positive("topk", topk)
    num_steps = validate.positive("num_steps", num_steps)
    page_size = validate.positive("page_size", page_size)
    rows = num_steps if num_rows is None else validate.positive("num_rows", num_rows, minimum=0)
    if rows > num_steps:
        raise ValueError(f"num_rows must be <= num_steps={num_steps}, got {rows}")
    validate.tensor("seq_lens", seq_lens, ndim=1)
    device = seq_lens.device
    B = seq_lens.shape[0]
    BK = B * topk
    validate.tensor("out_cache_loc", out_cache_loc, ndim=1, device=device)
    validate.at_least("out_cache_loc", out_cache_loc.shape[0], BK * num_steps)
    width = expand_page_table_width(rows)
    if page_table is None:
        page_table = torch.empty((rows, BK, width), dtype=torch.int32, device=device)
    if cache_seqlens is None:
        cache_seqlens = torch.empty((rows, BK), dtype=torch.int32, device=device)
    name = f"{prefix}page_table"
    validate.tensor(name, page_table, ndim=3, device=device)
    validate.at_least(name, page_table.shape[0], rows, "step rows")
    validate.at_least(name, page_table.shape[1], BK, "branch rows (B*topk)")
    validate.at_least(name, page_table.shape[2], width, "columns (num_rows)")
    for name, buf, cols in (
        (f"{prefix}cache_seqlens", cache_seqlens, BK),
        (f"{prefix}cu_seqlens_k", cu_seqlens_k, BK + 1),
    ):
        if buf is None:
            continue
        validate.tensor(name, buf, ndim=2, device=device)
        validate.at_least(name, buf.shape[0], rows, "step rows")
        validate.at_least(name, buf.shape[1], cols, "entries per row")
    status = validate.status(status, device)
    return topk, num_steps, page_size, rows, B, page_table, cache_seqlens, status


def expand_page_table(
    out_cache_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page tables and lengths of the FA3 expand pass, every draft step in one launch.

    Parameters
    ----------
    out_cache_loc : torch.Tensor
        ``[≥ B·K·S]`` int32 or int64, the draft slots laid out ``[B, K, S]`` (design §1, from
        :func:`specmeta.assign_draft_cache_locs`).
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, prefix lengths ``L_b``; only ``lpl_b = L_b mod ps`` is read.
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps``.
    num_rows : int, optional
        Step rows to build, ``0 ≤ rows ≤ S`` (default ``S``).
    page_table : torch.Tensor, optional
        ``[≥ rows, ≥ B·K, W]`` int32 or int64, ``W ≥ rows`` (unit column stride). Rows
        ``[:rows, :B·K]`` are written entirely: data columns, then 0. Allocated int32
        ``[rows, B·K, rows]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        ``[≥ rows, ≥ B·K]`` int32 or int64: ``lpl_b + s + 1`` (``s + 1`` when ``ps == 1``).
        Allocated int32 when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``: ``BAD_PAGE`` when a branch's slots do not follow the slot layout (a slot
        at the wrong page offset, or more or fewer distinct pages than ``u``: extra pages are
        dropped, missing ones read the sink), ``POOL_OOB`` for a negative slot (its page reads
        0; every step's slots are checked, built or not), ``POS_OOB`` for a negative ``seq_lens``. Sink slots (0, what a padded request
        holds, design §4) are exempt from the layout check.
    cu_seqlens_k : torch.Tensor, optional
        ``[≥ rows, ≥ B·K + 1]``; when given ``cu_seqlens_k[s, r] = Σ_{r'<r} cache_seqlens[s, r']``
        for ``r ∈ [0, B·K]``.

    Returns
    -------
    (page_table, cache_seqlens) : tuple of torch.Tensor
        The buffers passed (whole), or new ones.

    Examples
    --------
    ``ps=4``, ``K=2``, ``S=2``, ``seq_lens=[7]`` (``lpl=3``); branch 0's slots ``[43, 20]``
    (pages 10, 5), branch 1's ``[63, 36]`` (pages 15, 9) →
    step 0: ``page_table=[[10, 0], [15, 0]]``, ``cache_seqlens=[4, 4]``;
    step 1: ``[[10, 5], [15, 9]]``, ``[5, 5]``.

    Grid ``(max(B, 1),)``, one program per request writing all steps of its ``K`` branches.
    No host sync; ``B``, ``W`` and strides are runtime arguments, ``K`` and ``S`` constexpr.
    """
    topk, num_steps, page_size, rows, B, page_table, cache_seqlens, status = prepare_expand_page_table(
        out_cache_loc, seq_lens, topk, num_steps, page_size, num_rows, page_table, cache_seqlens,
        cu_seqlens_k, status,
    )  # fmt: skip
    if rows == 0:
        return page_table, cache_seqlens
    W = page_table.shape[2]
    _expand_page_table_launch(
        (max(B, 1),),
        out_cache_loc_ptr=out_cache_loc,
        seq_lens_ptr=seq_lens,
        page_table_ptr=page_table,
        cache_seqlens_ptr=cache_seqlens,
        cu_seqlens_k_ptr=cu_seqlens_k if cu_seqlens_k is not None else cache_seqlens,
        status_ptr=status,
        B=B,
        num_rows=rows,
        W=W,
        stride_pt_s=page_table.stride(0),
        stride_pt_r=page_table.stride(1),
        stride_cs=cache_seqlens.stride(0),
        stride_cu=cu_seqlens_k.stride(0) if cu_seqlens_k is not None else 0,
        TOPK=topk,
        NUM_STEPS=num_steps,
        PAGED=page_size > 1,
        PAGE_SIZE=page_size,
        BLOCK_K=next_power_of_2(topk),
        BLOCK_S=next_power_of_2(num_steps),
        BLOCK_W=min(next_power_of_2(W), 16),
        BLOCK_B=_BLOCK_B,
        WRITE_CU=cu_seqlens_k is not None,
        HAS_STATUS=True,
        num_warps=2,
    )
    return page_table, cache_seqlens


def expand_page_table_ref(
    out_cache_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_rows: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`expand_page_table` (vectorised; syncs)."""
    topk, num_steps, ps, rows, B, page_table, cache_seqlens, status = prepare_expand_page_table(
        out_cache_loc, seq_lens, topk, num_steps, page_size, num_rows, page_table, cache_seqlens,
        cu_seqlens_k, status,
    )  # fmt: skip
    if rows == 0:
        return page_table, cache_seqlens
    device = seq_lens.device
    BK, W = B * topk, page_table.shape[2]
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    lpl = (L.clamp_min(0) % ps).repeat_interleave(topk).view(-1, 1)  # [BK, 1]
    every = out_cache_loc[: BK * num_steps].view(BK, num_steps)  # every step, built or not
    slots = every[:, :rows].to(torch.int64)
    if bool((every < 0).any()):
        bits |= int(Status.POOL_OOB)
    slots = slots.clamp_min(0)
    j = torch.arange(rows, device=device).view(1, -1)
    if ps > 1:
        page = slots // ps
        new = torch.ones_like(page, dtype=torch.bool)
        new[:, 1:] = page[:, 1:] != page[:, :-1]
        runs = torch.cumsum(new.to(torch.int64), dim=1)
        u = (lpl + j + ps) // ps
        real = slots != 0  # sink slots (padded requests) are not checked against the layout
        if bool((real & ((slots % ps != (lpl + j) % ps) | (runs != u))).any()):
            bits |= int(Status.BAD_PAGE)
        limit = torch.minimum(runs, u)  # [BK, rows]: data columns of step s
        run_page = torch.zeros_like(page).scatter_(1, runs - 1, page)  # runs share one page
        seqlen = lpl + j + 1
    else:
        limit = (j + 1).expand(BK, rows)
        run_page = slots
        seqlen = (j + 1).expand(BK, rows)
    col = torch.arange(W, device=device).view(1, 1, -1)
    padded = torch.zeros(BK, W, dtype=torch.int64, device=device)
    padded[:, :rows] = run_page
    table = torch.where(col < limit.t().unsqueeze(-1), padded.unsqueeze(0), 0)  # [rows, BK, W]
    page_table[:rows, :BK] = table.to(page_table.dtype)
    cache_seqlens[:rows, :BK] = seqlen.t().to(cache_seqlens.dtype)
    if cu_seqlens_k is not None:
        cu_seqlens_k[:rows, 0] = 0
        cu_seqlens_k[:rows, 1 : BK + 1] = torch.cumsum(seqlen.t(), dim=1).to(cu_seqlens_k.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens
