"""Per-request page tables over a request's own row (design §2.3 normal pass, §3.2, §3.4).

Request ``b`` covers ``len_b`` tokens of its ``req_to_token`` row::

    len_b               = L_b + extra_tokens            (or L_b − lpl_b + extra_tokens
                                                          with exclude_last_partial)
    page_table[b, c]    = id(row_b, c·ps) // ps         for c < ceil(len_b / ps)
    page_table[b, c]    = fill_value                    for ceil(len_b / ps) ≤ c < W
    cache_seqlens[b]    = len_b
    cu_seqlens_k[b]     = Σ_{b'<b} cache_seqlens[b']    for b in [0, B], entry 0 included

One op serves every page-table consumer that reads a request's own row: the FA3 normal pass
(``extra_tokens=0``, ``exclude_last_partial`` in slot layout B), draft decode with ``K == 1``
(``extra_tokens=1, num_rows=rows``: one table, ``cache_seqlens[s] = L + s + 1``), target verify
and draft extend (``extra_tokens=N``), and TRT-LLM MLA's ``block_kv_indices``
(``fill_value=-1``).

``id(row_b, p)`` is the KV id the row names at position ``p`` in its id space (design §2.10):
``row_b[p]`` for a plain row; ``row_b[p // E]·E + p mod E`` for a row of page ids
(``entry_page_size=E``); through the page map, ``v2p[id // ps]·ps + id mod ps``, with ``v2p``.
An id that does not map gives the sink page 0 and ``BAD_KV_ID``.
"""

from __future__ import annotations

import torch

from .. import validate
from ..config import page_table_width
from ..stage import Stage, launcher
from ..status import Status
from ._common import check_batch, check_id_spaces, chunk_programs, load_kv_ids_ref
from ._page_tables import bind_page_tables, normal_pass, page_tables_kernel
from ._window import (
    check_tree_depth,
    check_window,
    load_window_ids_ref,
    tree_prefix_start_ref,
    window_page_ids_ref,
)

__all__ = ["bind_prefix_page_table", "prefix_page_table", "prefix_page_table_ref"]


# Page-table columns one program writes per iteration: 1024 entries keep 8 elements a thread in
# flight at 4 warps (as in the kv_indices kernels).
_BLOCK = 1024
# seq_lens entries per block of the cu_seqlens_k scan (one block up to B = 1024).
_BLOCK_B = 1024


def prepare_prefix_page_table(
    req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
    fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status, where="",
    entry_page_size=1, v2p=None, sliding_window_size=None, full_to_swa=None, tree_depth=None,
):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. ``where`` names the
    call in the id-space checks' messages. The last values returned are the rail ``w`` (0 for
    a full layer) and a window tree's depth bound ``D`` (``None`` for none)."""
    page_size = validate.positive("page_size", page_size)
    extra_tokens = validate.positive("extra_tokens", extra_tokens, minimum=0)
    if not isinstance(exclude_last_partial, bool):
        raise TypeError(
            f"exclude_last_partial must be a bool, got {type(exclude_last_partial).__name__}"
        )
    if isinstance(fill_value, bool) or not isinstance(fill_value, int):
        raise TypeError(f"fill_value must be an int, got {type(fill_value).__name__}")
    rows = 1 if num_rows is None else validate.positive("num_rows", num_rows)
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    rail = check_window(where, sliding_window_size, full_to_swa, device)
    depth = None
    if tree_depth is not None:
        depth = check_tree_depth(where, tree_depth, rail, 0)
        if extra_tokens or num_rows is not None:
            raise ValueError(
                f"{where}: tree_depth={depth} builds a window layer's tree cascade's normal "
                "pass (non-causal, over the prefix; design §2.10), which takes no "
                f"extra_tokens (got {extra_tokens}) and no num_rows (got {num_rows}); leave "
                "them out, or leave tree_depth out for a chain's causal table"
            )
    if page_table is None:
        # A row of W_row entries covers W_row·E positions (design §2.10).
        width = page_table_width(req_to_token.shape[1] * entry_page_size, page_size)
        page_table = torch.empty((B, width), dtype=torch.int32, device=device)
    validate.tensor("page_table", page_table, ndim=2, device=device)
    validate.at_least("page_table", page_table.shape[0], B, "rows")
    if page_table.shape[1] < 1:
        raise ValueError(f"page_table needs at least 1 column, got shape {tuple(page_table.shape)}")
    seq_ndim = 1 if num_rows is None else 2
    if cache_seqlens is None:
        shape = (B,) if num_rows is None else (rows, B)
        cache_seqlens = torch.empty(shape, dtype=torch.int32, device=device)
    for name, buf, cols in (
        ("cache_seqlens", cache_seqlens, B),
        ("cu_seqlens_k", cu_seqlens_k, B + 1),
    ):
        if buf is None:
            continue
        validate.tensor(name, buf, ndim=seq_ndim, device=device)
        validate.at_least(
            name, buf.shape[-1], cols, f"entries per row (B{' + 1' if cols > B else ''})"
        )
        if seq_ndim == 2:
            validate.at_least(name, buf.shape[0], rows, "rows (num_rows)")
    status = validate.status(status, device)
    return page_size, extra_tokens, rows, B, page_table, cache_seqlens, status, rail, depth


def bind_prefix_page_table(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    extra_tokens: int = 0,
    exclude_last_partial: bool = False,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_rows: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> Stage:
    """Bind once: page table and KV lengths of every request over its own ``req_to_token`` row.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64, the row of each request; row 0 reserved.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64, row → position → KV slot (in the id space of
        ``entry_page_size`` and ``v2p``).
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    page_size : int
        ``ps`` ≥ 1; slot ``s`` lives on page ``s // ps``.
    extra_tokens : int
        Tokens past the prefix the table covers (``N`` for target verify and draft extend, the
        step's ``s + 1`` for draft decode). Default 0.
    exclude_last_partial : bool
        Cover ``L_b − (L_b mod ps)`` (whole pages only) before ``extra_tokens``: the normal pass
        of the FA3 cascade in slot layout B, whose last partial page each branch reads itself.
    fill_value : int
        Value of the columns past ``ceil(len_b / ps)`` up to the buffer width: 0 (the sink page,
        FA3) by default, −1 for TRT-LLM MLA's ``block_kv_indices``.
    page_table : torch.Tensor, optional
        ``[≥ B, W]`` int32 or int64 (unit column stride); rows ``[:B]`` are written entirely.
        Pages past column ``W`` are dropped (``OUT_OF_CAPACITY``). Allocated int32
        ``[B, ceil(W_row·E / ps)]`` when omitted.
    cache_seqlens : torch.Tensor, optional
        int32 or int64. ``[≥ B]`` with ``len_b`` when ``num_rows`` is None; ``[≥ rows, ≥ B]``
        with ``cache_seqlens[s, b] = len_b + s`` otherwise. Clamped to ``W·ps`` (a consumer
        never reads past its table). Allocated int32 when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB`` (bad ``req_pool_indices``: the row reads as the sink),
        ``POS_OOB`` (a page start at or past ``W_row``, or a negative ``seq_lens``),
        ``OUT_OF_CAPACITY`` (more pages than ``W``), ``POOL_OOB`` (a negative slot id in a
        plain row; its page reads 0), ``BAD_KV_ID`` (an id of a row in another id space that
        does not map, at a page's first position: the sink page 0).
    num_rows : int, optional
        ``rows ≥ 1``: build ``rows`` consecutive steps at once — ``len_b + s`` for ``s < rows``
        — sharing one table that covers the longest (draft decode with ``K == 1``).
    cu_seqlens_k : torch.Tensor, optional
        Shaped like ``cache_seqlens`` with one more entry per row; when given,
        ``cu_seqlens_k[..., b] = Σ_{b'<b} cache_seqlens[..., b']`` for ``b ∈ [0, B]``.
    entry_page_size : int
        ``E ≥ 1``: with ``E > 1`` the rows hold page ids, position ``p`` at
        ``row[p // E]·E + p mod E``, and a row of ``W_row`` entries covers ``W_row·E``
        positions (design §2.10). Default 1, rows of token ids.
    v2p : torch.Tensor, optional
        ``[P]`` int32 or int64 virtual → physical page map at page size ``ps``: each id read
        is emitted as ``v2p[id // ps]·ps + id mod ps``, so column ``c`` holds
        ``v2p[id(row_b, c·ps) // ps]``. Default ``None``: ids as they are.
    sliding_window_size : int, optional
        A window layer's ``w`` (design §2.10; ``None`` or 0: a full layer): the table keeps its
        full length (the consumer's own window, ``window_size = (w − 1, 0)``, excludes what its
        rows do not read), but a column whose whole page lies below the read floor
        ``f_b = max(0, L_b − w + 1)`` (the first position the request's earliest query row, at
        ``L_b``, reads) is never read: it holds the sink page 0, no fault whatever the map
        holds there. Every other column reads the id at ``max(c·ps, f_b)``.
    full_to_swa : torch.Tensor, optional
        ``[P_full]`` int32 or int64 full → window pool map (design §2.10), ``−1`` where the
        window pool evicted a slot: the columns hold window-pool pages, ``full_to_swa[id] //
        ps`` after the row's own translation (the window pool pages like the full pool: a
        page's slots map to one window page at the same offsets). A column at or past the
        floor whose id maps to ``−1`` (or lies past the map) is the sink page 0 with
        ``BAD_KV_ID``.
    tree_depth : int, optional
        ``D ≥ 0``, with ``sliding_window_size``: the normal pass of a window layer's tree
        cascade (design §2.10), whose query rows lie at ``L … L + D`` and read the prefix
        non-causally. It lists only ``[P0, len_b)``, the positions every row reads, ``P0 =
        max(0, (⌊L_b / ps⌋ − k)·ps)`` with ``k = ⌊(w − D − ps) / ps⌋`` (no page when ``k <
        0``): ``page_table[b, c]`` is the page of column ``P0 / ps + c``, ``cache_seqlens[b] =
        len_b − P0``. The expand pass lists what a row reads below ``P0``. Only with
        ``extra_tokens=0`` and no ``num_rows``.

    Returns
    -------
    Stage
        Its result is ``(page_table, cache_seqlens)`` (tuple of torch.Tensor), what the eager
        :func:`prefix_page_table` returns. The buffers passed (whole), or new ones.

    Examples
    --------
    ``ps=4``, ``seq_lens=[5]``, row ``[40, 41, 42, 43, 12, 13, …]``, ``W=3``:
    ``page_table=[[10, 3, 0]]``, ``cache_seqlens=[5]``; with ``exclude_last_partial``
    ``[[10, 0, 0]]`` and ``[4]``; with ``extra_tokens=2, num_rows=2``: ``[[10, 3, 0]]``,
    ``cache_seqlens=[[7], [8]]``.

    Grid ``(B + 1, chunk_programs)``: programs ``(b, c)`` gather request ``b``'s row, program
    ``(B, 0)`` scans ``seq_lens`` for ``cu_seqlens_k``. No host sync; ``B``, lengths, widths
    and strides are runtime arguments.
    """
    page_size, extra_tokens, rows, B, page_table, cache_seqlens, status, rail, depth = (
        prepare_prefix_page_table(
        req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
        fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status,
        "prefix_page_table", entry_page_size, v2p, sliding_window_size, full_to_swa, tree_depth,
    ))  # fmt: skip
    W = page_table.shape[1]
    # Rows b < B gather request b, row B has the cu_seqlens_k program.
    grid = (B + 1, chunk_programs(req_to_token.device, B, W, _BLOCK))
    two_d = cache_seqlens.dim() == 2
    normal = normal_pass(
        req_pool_indices, req_to_token, page_table, cache_seqlens, cu_seqlens_k,
        page_size=page_size, exclude_last_partial=exclude_last_partial, extra_tokens=extra_tokens,
        fill_value=fill_value, num_rows=rows,
        stride_cs=cache_seqlens.stride(0) if two_d else 0,
        stride_cu=cu_seqlens_k.stride(0) if two_d and cu_seqlens_k is not None else 0,
        chunk_programs=grid[1], block=_BLOCK, entry_page_size=entry_page_size, v2p=v2p,
        rail=rail, full_to_swa=full_to_swa, tree_depth=depth,
    )  # fmt: skip
    launch = bind_page_tables(grid, seq_lens, status, page_size=page_size, block_b=_BLOCK_B,
                              num_warps=4, normal=normal)  # fmt: skip
    return Stage([launch], result=(page_table, cache_seqlens))


prefix_page_table = launcher(bind_prefix_page_table)
prefix_page_table.kernels = (page_tables_kernel,)  # for specmeta.registry


def prefix_page_table_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    extra_tokens: int = 0,
    exclude_last_partial: bool = False,
    fill_value: int = 0,
    page_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_rows: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    sliding_window_size: int | None = None,
    full_to_swa: torch.Tensor | None = None,
    tree_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`prefix_page_table` (vectorised over the batch; syncs)."""
    page_size, extra_tokens, rows, B, page_table, cache_seqlens, status, rail, depth = (
        prepare_prefix_page_table(
        req_pool_indices, req_to_token, seq_lens, page_size, extra_tokens, exclude_last_partial,
        fill_value, num_rows, page_table, cache_seqlens, cu_seqlens_k, status,
        "prefix_page_table_ref", entry_page_size, v2p, sliding_window_size, full_to_swa,
        tree_depth,
    ))  # fmt: skip
    if depth is not None:
        return _tree_normal_ref(req_pool_indices, req_to_token, seq_lens, page_size,
                                exclude_last_partial, fill_value, page_table, cache_seqlens,
                                cu_seqlens_k, status, entry_page_size, v2p, rail, full_to_swa,
                                depth)  # fmt: skip
    device = req_to_token.device
    W = page_table.shape[1]
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    L = L.clamp_min(0)
    length = (L - L % page_size if exclude_last_partial else L) + extra_tokens  # [B]
    wanted = (length + rows - 1 + page_size - 1) // page_size
    pages = wanted.clamp_max(W)
    cap = W * page_size

    col = torch.arange(W, device=device)
    need = col.view(1, -1) < pages.view(-1, 1)  # [B, W]
    pos = torch.where(need, col * page_size, 0)
    # The id at each page's first position, in the rows' id space (design §2.10).
    slots, bad, gather_bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos, need,
                                              entry_page_size=entry_page_size, v2p=v2p,
                                              page_size=page_size)  # fmt: skip
    negative = slots < 0  # a plain row's negative slot
    pages_of = slots.clamp_min(0) // page_size
    if rail or full_to_swa is not None:  # a window layer's table (design §2.10)
        pages_of, bad, negative = window_page_ids_ref(
            req_to_token, req_pool_indices, L, need, page_size=page_size,
            entry_page_size=entry_page_size, v2p=v2p, rail=rail, full_to_swa=full_to_swa,
        )  # fmt: skip
    bits |= gather_bits
    if bool(bad.any()):
        bits |= int(Status.BAD_KV_ID)
    if bool(negative.any()):
        bits |= int(Status.POOL_OOB)
    page_table[:B] = torch.where(need, pages_of, fill_value).to(page_table.dtype)
    if bool((wanted > W).any()):
        bits |= int(Status.OUT_OF_CAPACITY)

    r = torch.arange(rows, device=device).view(-1, 1)
    lens = torch.minimum(length.view(1, -1) + r, torch.tensor(cap, device=device))  # [rows, B]
    csl = cache_seqlens if cache_seqlens.dim() == 2 else cache_seqlens.view(1, -1)
    csl[:rows, :B] = lens.to(csl.dtype)
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k if cu_seqlens_k.dim() == 2 else cu_seqlens_k.view(1, -1)
        cu[:rows, 0] = 0
        cu[:rows, 1 : B + 1] = torch.cumsum(lens, dim=1).to(cu.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens


def _tree_normal_ref(req_pool_indices, req_to_token, seq_lens, page_size, exclude_last_partial,
                     fill_value, page_table, cache_seqlens, cu_seqlens_k, status,
                     entry_page_size, v2p, rail, full_to_swa, depth):  # fmt: skip
    """:func:`prefix_page_table_ref` of a window layer's tree cascade (``tree_depth``,
    design §2.10): request ``b`` covers ``[P0, len_b)``, column ``c`` the page of the id at ``(P0 /
    ps + c)·ps`` (every row reads it: no floor inside), through the row's space and the map."""
    ps, W = page_size, page_table.shape[1]
    B = seq_lens.shape[0]
    L = seq_lens.to(torch.int64)
    bits = int(Status.POS_OOB) if bool((L < 0).any()) else 0
    L = L.clamp_min(0)
    end = L - L % ps if exclude_last_partial else L
    first = torch.minimum(tree_prefix_start_ref(L, rail, depth, ps), end)
    length = end - first
    wanted = (length + ps - 1) // ps
    pages = wanted.clamp_max(W)
    col = torch.arange(W, device=req_to_token.device).view(1, -1)
    need = col < pages.view(-1, 1)
    pos = torch.where(need, (first // ps).view(-1, 1) * ps + col * ps, 0)
    ids, bad, gather_bits = load_window_ids_ref(req_to_token, req_pool_indices, pos, need,
                                                entry_page_size=entry_page_size, v2p=v2p,
                                                page_size=ps, full_to_swa=full_to_swa)  # fmt: skip
    bits |= gather_bits
    negative = need & ~bad & (ids < 0)
    bits |= int(Status.BAD_KV_ID) if bool(bad.any()) else 0
    bits |= int(Status.POOL_OOB) if bool(negative.any()) else 0
    bits |= int(Status.OUT_OF_CAPACITY) if bool((wanted > W).any()) else 0
    table = torch.div(torch.where(negative, 0, ids), ps, rounding_mode="floor")
    page_table[:B] = torch.where(need, table, fill_value).to(page_table.dtype)
    lens = length.clamp_max(W * ps)
    csl = cache_seqlens if cache_seqlens.dim() == 1 else cache_seqlens[0]
    csl[:B] = lens.to(csl.dtype)
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k if cu_seqlens_k.dim() == 1 else cu_seqlens_k[0]
        cu[0] = 0
        cu[1 : B + 1] = torch.cumsum(lens, 0).to(cu.dtype)
    if bits:
        status |= bits
    return page_table, cache_seqlens
