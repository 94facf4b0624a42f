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

from .. import validate
from ..config import expand_page_table_width
from ..stage import Stage, launcher
from ..status import Status
from ._common import check_steps
from ._page_tables import bind_page_tables, expand_pass, page_tables_kernel

__all__ = ["bind_expand_page_table", "expand_page_table", "expand_page_table_ref"]


# seq_lens entries summed per iteration of the exclusive Σ lpl loop (one load up to B = 1024).
_BLOCK_B = 1024


def prepare_expand_page_table(
    out_cache_loc, seq_lens, topk, num_steps, page_size, num_rows, page_table, cache_seqlens,
    cu_seqlens_k, status, prefix="",
):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. ``prefix`` goes before
    the output buffers' names in messages (a fused op's ``expand_page_table``, …)."""
    topk, num_steps, page_size, rows = check_steps(topk, num_steps, page_size, num_rows)
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


def bind_expand_page_table(
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
) -> Stage:
    """Bind once: page tables and lengths of the FA3 expand pass, every draft step in one launch.

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
    Stage
        Its result is ``(page_table, cache_seqlens)`` (tuple of torch.Tensor), what the eager
        :func:`expand_page_table` returns. The buffers passed (whole), or new ones.

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
        return Stage([], result=(page_table, cache_seqlens))
    expand = expand_pass(out_cache_loc, page_table, cache_seqlens, cu_seqlens_k, topk=topk,
                         num_steps=num_steps, rows=rows)  # fmt: skip
    launch = bind_page_tables((max(B, 1),), seq_lens, status, page_size=page_size,
                              block_b=_BLOCK_B, num_warps=2, expand=expand)  # fmt: skip
    return Stage([launch], result=(page_table, cache_seqlens))


expand_page_table = launcher(bind_expand_page_table)
expand_page_table.kernels = (page_tables_kernel,)  # for specmeta.registry


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
