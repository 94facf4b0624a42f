"""Both page-table passes of FA3 draft decode with ``K > 1`` in one launch (design §2.3, §3.2).

FA3 serves ``K > 1`` draft decode as a cascade of a normal pass over each request's shared
prefix and an expand pass over each branch's own tokens. Neither pass reads what the other
writes, so one grid runs both::

    normal pass  (as prefix_page_table, extra_tokens = 0, fill 0, one row)
        len_b               = L_b            (L_b − lpl_b with exclude_last_partial)
        page_table[b, c]    = id(row_b, c·ps) // ps for c < ceil(len_b / ps), else 0
        cache_seqlens[b]    = len_b,  cu_seqlens_k[b] = Σ_{b'<b} len_b'
    expand pass  (as expand_page_table), step s, branch row r = b·K + t, dl = s + 1
        expand_page_table[s, r, :u]   the u = ceil((lpl_b + dl) / ps) distinct pages of
                                      out_cache_loc[r·S : r·S + dl] // ps, then 0
                                      (ps == 1: the dl slots themselves)
        expand_cache_seqlens[s, r]    = lpl_b + dl   (dl when ps == 1)
        expand_cu_seqlens_k[s, r]     = Σ_{r'<r} expand_cache_seqlens[s, r']

Each pass alone costs little more than a launch (an empty kernel takes about 0.8 µs on an
H200), so running the cascade's two passes in one launch is the point of this op: the first
``chunk_programs`` columns of the grid are the normal pass's programs, the last column the
expand pass's.

The normal pass reads the rows in their id space (``entry_page_size``, ``v2p``, design §2.10:
``id(row_b, p)`` as in :mod:`specmeta.kernels.prefix_page_table`). The expand pass reads the
draft slots ``out_cache_loc`` as they are: :func:`specmeta.assign_draft_cache_locs` emits
them in the pool's physical ids already, whatever the rows' id space.
"""

from __future__ import annotations

import torch

from ..launch import next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import chunk_programs
from ._page_tables import bind_page_tables, expand_pass, normal_pass, page_tables_kernel
from ._window import load_window_ids_ref, tree_prefix_start_ref, window_tree_prefix_pages
from .expand_page_table import expand_page_table_ref, prepare_expand_page_table
from .prefix_page_table import prefix_page_table_ref, prepare_prefix_page_table

__all__ = [
    "bind_draft_decode_page_tables",
    "draft_decode_page_tables",
    "draft_decode_page_tables_ref",
]

# Warps per program, and the fewest page-table columns of a normal-pass block: the block is the
# table's width rounded up to a power of two, between _MIN_BLOCK and _BLOCK, so a narrow table
# (ps = 16 or 64 at a 4k context: 257 or 65 columns) is one block with few idle lanes. On an
# H200 this took B = 256, K = 2 from 3.20 to 2.80 us (ps = 16) and from 3.07 to 2.74 us
# (ps = 64); see scripts/tune_fa3_build.py.
_NUM_WARPS = 4
_MIN_BLOCK = 256
# The widest normal-pass block, and the column chunk the grid is sized by: the standalone
# prefix_page_table's block. seq_lens entries per iteration of the prefix sums, as there.
_BLOCK = 1024
_BLOCK_B = 1024


def _prepare(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_steps, page_size,
    exclude_last_partial, num_rows, page_table, cache_seqlens, cu_seqlens_k, expand_page_table,
    expand_cache_seqlens, expand_cu_seqlens_k, status, where, entry_page_size, v2p,
    sliding_window_size=None, full_to_swa=None, tree_depth=None,
):  # fmt: skip
    """Validate both passes (each with its own op's checks) and allocate what is missing, before
    anything is written; shared by the launcher and the reference. A window layer's tree
    (``tree_depth``) also returns the most row pages an expand row lists (else ``None``)."""
    page_size, _, _, B, page_table, cache_seqlens, status, rail, depth = (
        prepare_prefix_page_table(
        req_pool_indices, req_to_token, seq_lens, page_size, 0, exclude_last_partial, 0, None,
        page_table, cache_seqlens, cu_seqlens_k, status, where, entry_page_size, v2p,
        sliding_window_size, full_to_swa, tree_depth,
    ))  # fmt: skip
    pre = None if depth is None else window_tree_prefix_pages(rail, depth, page_size)
    if pre is not None and expand_page_table is None:
        rows = num_steps if num_rows is None else num_rows
        expand_page_table = torch.empty((rows, B * topk, rows + pre), dtype=torch.int32,
                                        device=seq_lens.device)  # fmt: skip
    topk, num_steps, _, rows, _, expand_page_table, expand_cache_seqlens, status = (
        prepare_expand_page_table(
        out_cache_loc, seq_lens, topk, num_steps, page_size, num_rows, expand_page_table,
            expand_cache_seqlens, expand_cu_seqlens_k, status, prefix="expand_",
        )
    )  # fmt: skip
    if pre is not None and expand_page_table.shape[2] < rows + pre:
        raise ValueError(
            f"{where}: expand_page_table has {expand_page_table.shape[2]} columns; a window "
            f"layer's tree (sliding_window_size={rail}, tree_depth={depth}) lists up to {pre} "
            f"row pages before a branch's {rows}: pass at least {rows + pre} (design §2.10)"
        )
    return (topk, num_steps, page_size, rows, B, page_table, cache_seqlens, expand_page_table,
            expand_cache_seqlens, status, rail, (depth, pre))  # fmt: skip


def bind_draft_decode_page_tables(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    exclude_last_partial: bool,
    num_rows: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    expand_page_table: torch.Tensor | None = None,
    expand_cache_seqlens: torch.Tensor | None = None,
    expand_cu_seqlens_k: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> Stage:
    """Bind once: normal and expand page tables of FA3 draft decode (the ``K > 1`` cascade) in one
    launch.

    Writes exactly what :func:`specmeta.kernels.prefix_page_table` (normal pass) followed by
    :func:`specmeta.kernels.expand_page_table` (every step's expand pass) write.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64, the row of each request; row 0 reserved.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64, row → position → KV slot.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    out_cache_loc : torch.Tensor
        ``[≥ B·K·S]`` int32 or int64, the draft slots laid out ``[B, K, S]`` (design §1).
    topk, num_steps, page_size : int
        ``K``, ``S``, ``ps`` (all ≥ 1).
    exclude_last_partial : bool
        Normal pass over ``L_b − (L_b mod ps)`` (slot layout B, where every branch's region
        starts with the prefix's last partial page) instead of ``L_b``.
    num_rows : int, optional
        Expand step rows to build, ``0 ≤ rows ≤ S`` (default ``S``); the normal pass is built
        whatever ``rows``.
    page_table : torch.Tensor, optional
        Normal pass, ``[≥ B, W]`` int32 or int64 (unit column stride); rows ``[:B]`` are written
        entirely, pages past ``W`` dropped (``OUT_OF_CAPACITY``). Allocated int32
        ``[B, ceil(W_row / ps)]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        Normal pass, ``[≥ B]`` int32 or int64: ``len_b`` (clamped to ``W·ps``). Allocated int32
        when omitted.
    cu_seqlens_k : torch.Tensor, optional
        Normal pass, ``[≥ B + 1]``: ``Σ_{b'<b} cache_seqlens[b']`` for ``b ∈ [0, B]``.
    expand_page_table : torch.Tensor, optional
        ``[≥ rows, ≥ B·K, W_e]`` int32 or int64, ``W_e ≥ rows`` (unit column stride); rows
        ``[:rows, :B·K]`` written entirely. Allocated int32 ``[rows, B·K, rows]`` when omitted.
    expand_cache_seqlens : torch.Tensor, optional
        ``[≥ rows, ≥ B·K]`` int32 or int64: ``lpl_b + s + 1`` (``s + 1`` when ``ps == 1``).
        Allocated int32 when omitted.
    expand_cu_seqlens_k : torch.Tensor, optional
        ``[≥ rows, ≥ B·K + 1]``: ``Σ_{r'<r} expand_cache_seqlens[s, r']`` for ``r ∈ [0, B·K]``.
    status : torch.Tensor, optional
        ``int32 [1]``, ORed by both passes: ``ROW_OOB``, ``POS_OOB``, ``OUT_OF_CAPACITY``,
        ``POOL_OOB`` (normal pass, as :func:`~specmeta.kernels.prefix_page_table`);
        ``BAD_KV_ID`` (normal pass, an id of a row in another id space that does not map);
        ``BAD_PAGE``, ``POOL_OOB``, ``POS_OOB`` (expand pass, as
        :func:`~specmeta.kernels.expand_page_table`).
    entry_page_size, v2p
        The rows' id space for the normal pass (design §2.10), as in
        :func:`~specmeta.kernels.prefix_page_table`; ``v2p`` maps pages of ``page_size``.
        ``out_cache_loc`` is read as it is (physical draft slots).
    sliding_window_size, full_to_swa
        A window layer's normal pass (design §2.10), as in
        :func:`~specmeta.kernels.prefix_page_table`: pages wholly below ``max(0, L_b − w + 1)``
        are the sink page 0, the others window-pool pages through the map. The expand pass
        reads ``out_cache_loc`` as it is: a window layer's draft slots come from
        ``assign_draft_cache_locs(full_to_swa=...)`` in window-pool ids already.
    tree_depth : int, optional
        ``D ≥ S − 1`` with ``sliding_window_size``: a window layer's tree cascade
        (design §2.10). The normal pass lists only ``[P0, L − lpl)`` (``prefix_page_table(...,
        tree_depth=D)``): at most ``G = max(k, 0)·ps`` positions, ``k = ⌊(w − D − ps) /
        ps⌋``, every step's rows read. Each expand row of step ``s`` first lists the row pages
        from the one holding ``max(0, L + s − w + 1)`` up to that start (window-pool pages read
        from the step's floor), then its branch's pages, ``cache_seqlens`` counting both; the
        consumer runs it with FlashAttention's window ``(w − 1 − G, 0)``, which hides exactly
        what the row does not read (the normal pass's ``G`` positions are the only gap, so
        its last ``w − G`` keys are the row's window). ``expand_page_table`` needs ``rows +
        ⌊(w − G + ps − 2) / ps⌋`` columns.

    Returns
    -------
    Stage
        Its result is ``(page_table, cache_seqlens, expand_page_table, expand_cache_seqlens)``
        (tuple of torch.Tensor), what the eager :func:`draft_decode_page_tables` returns. The
        buffers passed (whole), or new ones.

    Examples
    --------
    ``ps=4``, ``K=2``, ``S=2``, ``seq_lens=[7]`` (``lpl=3``), row ``[40, 41, 42, 43, 12, 13,
    14, …]``, branch 0's slots ``[15, 20]`` (pages 3, 5), branch 1's ``[63, 36]`` (pages 15,
    9), ``exclude_last_partial=True``, ``W=2`` → normal: ``page_table=[[10, 0]]``,
    ``cache_seqlens=[4]``; expand step 0: ``[[3, 0], [15, 0]]``, ``[4, 4]``; step 1:
    ``[[3, 5], [15, 9]]``, ``[5, 5]``.

    Grid ``(B + 1, chunk_programs + 1)``: columns ``c < chunk_programs`` are the normal
    pass's programs (request ``b``, column chunks ``c, c + chunk_programs, …``; program
    ``(B, 0)`` its ``cu_seqlens_k``), the last column is the expand pass's program of request
    ``b`` (all steps of its ``K`` branches). No host sync; ``B``, widths and strides are
    runtime arguments, ``K``, ``S`` and ``ps`` constexpr.
    """
    (topk, num_steps, page_size, rows, B, page_table, cache_seqlens, expand_page_table,
     expand_cache_seqlens, status, rail, (depth, pre)) = _prepare(
        req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_steps, page_size,
        exclude_last_partial, num_rows, page_table, cache_seqlens, cu_seqlens_k,
        expand_page_table, expand_cache_seqlens, expand_cu_seqlens_k, status,
        "draft_decode_page_tables", entry_page_size, v2p, sliding_window_size, full_to_swa,
        tree_depth,
    )  # fmt: skip
    W = page_table.shape[1]
    normal_programs = chunk_programs(req_to_token.device, B, W, _BLOCK)
    # One more column of programs for the expand pass, none when it has no row to build; one
    # more row for the normal pass's cu_seqlens_k.
    grid = (B + 1, normal_programs + (1 if rows > 0 else 0))
    # The cascade's normal pass has one row, no extra tokens and fill 0: the kernel's literals.
    normal = normal_pass(
        req_pool_indices, req_to_token, page_table, cache_seqlens, cu_seqlens_k,
        page_size=page_size, exclude_last_partial=exclude_last_partial, extra_tokens=None,
        fill_value=None, num_rows=None, stride_cs=None, stride_cu=None,
        chunk_programs=normal_programs, block=min(max(next_power_of_2(W), _MIN_BLOCK), _BLOCK),
        entry_page_size=entry_page_size, v2p=v2p, rail=rail, full_to_swa=full_to_swa,
        tree_depth=depth,
    )  # fmt: skip
    expand = expand_pass(out_cache_loc, expand_page_table, expand_cache_seqlens,
                         expand_cu_seqlens_k, topk=topk, num_steps=num_steps, rows=rows,
                         prefix_pages=pre)  # fmt: skip
    launch = bind_page_tables(grid, seq_lens, status, page_size=page_size, block_b=_BLOCK_B,
                              num_warps=_NUM_WARPS, normal=normal, expand=expand)  # fmt: skip
    return Stage(
        [launch], result=(page_table, cache_seqlens, expand_page_table, expand_cache_seqlens)
    )


draft_decode_page_tables = launcher(bind_draft_decode_page_tables)
draft_decode_page_tables.kernels = (page_tables_kernel,)  # for specmeta.registry


def draft_decode_page_tables_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    exclude_last_partial: bool,
    num_rows: int | None = None,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    expand_page_table: torch.Tensor | None = None,
    expand_cache_seqlens: torch.Tensor | None = None,
    expand_cu_seqlens_k: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`draft_decode_page_tables`: the two passes' references in turn (syncs);
    a window layer's tree then puts each expand row's row pages before its branch's."""
    (topk, num_steps, page_size, rows, B, page_table, cache_seqlens, expand_page_table,
     expand_cache_seqlens, status, rail, (depth, pre)) = _prepare(
        req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_steps, page_size,
        exclude_last_partial, num_rows, page_table, cache_seqlens, cu_seqlens_k,
        expand_page_table, expand_cache_seqlens, expand_cu_seqlens_k, status,
        "draft_decode_page_tables_ref", entry_page_size, v2p, sliding_window_size, full_to_swa,
        tree_depth,
    )  # fmt: skip
    prefix_page_table_ref(req_pool_indices, req_to_token, seq_lens, page_size=page_size,
                          exclude_last_partial=exclude_last_partial, page_table=page_table,
                          cache_seqlens=cache_seqlens, cu_seqlens_k=cu_seqlens_k, status=status,
                          entry_page_size=entry_page_size, v2p=v2p, sliding_window_size=rail,
                          full_to_swa=full_to_swa, tree_depth=depth)  # fmt: skip
    expand_page_table_ref(out_cache_loc, seq_lens, topk=topk, num_steps=num_steps,
                          page_size=page_size, num_rows=rows, page_table=expand_page_table,
                          cache_seqlens=expand_cache_seqlens, cu_seqlens_k=expand_cu_seqlens_k,
                          status=status)  # fmt: skip
    if depth is not None:
        _prepend_row_pages(req_pool_indices, req_to_token, seq_lens, topk, page_size, rows, B,
                           expand_page_table, expand_cache_seqlens, expand_cu_seqlens_k, status,
                           entry_page_size, v2p, rail, full_to_swa, depth)  # fmt: skip
    return page_table, cache_seqlens, expand_page_table, expand_cache_seqlens


def _prepend_row_pages(req_pool_indices, req_to_token, seq_lens, topk, ps, rows, B,
                       expand_page_table, expand_cache_seqlens, expand_cu_seqlens_k, status,
                       entry_page_size, v2p, rail, full_to_swa, depth):  # fmt: skip
    """A window layer's tree (design §2.10), request by request and step by step: the row
    pages from the one holding the step's floor ``f = max(0, L + s − w + 1)`` up to the normal
    pass's start ``min(P0, L − lpl)`` before each branch's pages, each the window-pool page of
    the id at ``max(c·ps, f)`` (the sink page 0 where it does not map)."""
    L = seq_lens.to(torch.int64).clamp_min(0)
    start = torch.minimum(tree_prefix_start_ref(L, rail, depth, ps), L - L % ps).tolist()
    W = expand_page_table.shape[2]
    bits = 0
    for s in range(rows):
        for b in range(B):
            Lb = int(L[b])
            floor = max(0, Lb + s - rail + 1)
            first = min(start[b] // ps, floor // ps)
            cols = list(range(first, start[b] // ps))
            pos = torch.tensor([[max(c * ps, floor) for c in cols]], dtype=torch.int64,
                               device=seq_lens.device).view(1, -1)  # fmt: skip
            ids, bad, _ = load_window_ids_ref(req_to_token, req_pool_indices[b : b + 1], pos,
                                              torch.ones_like(pos, dtype=torch.bool),
                                              entry_page_size=entry_page_size, v2p=v2p,
                                              page_size=ps, full_to_swa=full_to_swa)  # fmt: skip
            negative = ~bad & (ids < 0)
            bits |= (int(Status.BAD_KV_ID) if bool(bad.any()) else 0) | (
                int(Status.POOL_OOB) if bool(negative.any()) else 0)  # fmt: skip
            pages = torch.div(torch.where(negative, 0, ids), ps, rounding_mode="floor")[0]
            n = len(cols)
            for r in range(b * topk, (b + 1) * topk):
                own = expand_page_table[s, r, : W - n].clone()
                expand_page_table[s, r, :n] = pages.to(expand_page_table.dtype)
                expand_page_table[s, r, n:] = own
                expand_cache_seqlens[s, r] += n * ps
    if expand_cu_seqlens_k is not None:
        BK = B * topk
        expand_cu_seqlens_k[:rows, 0] = 0
        expand_cu_seqlens_k[:rows, 1 : BK + 1] = torch.cumsum(
            expand_cache_seqlens[:rows, :BK].to(torch.int64), dim=1).to(expand_cu_seqlens_k.dtype)  # fmt: skip
    if bits:
        status |= bits
