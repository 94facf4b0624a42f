"""Sliding-window layers (design §2.10): the window read rail and the full → window pool map.

A hybrid model's window layers read a second, smaller KV pool. Their metadata differs from the
full layers' in two rules, each one device helper here and its torch twin:

* **The window read rail** (``sliding_window_size = w ≥ 1``; ``None`` or 0: a full layer): a
  query at position ``p`` reads the positions ``(p − w, p]`` it may see, and the lists are
  clipped to that range. Draft decode: step ``s`` of branch ``(b, t)`` lists the last
  ``min(L + s + 1, w)`` entries of its prefix and its own chain (:func:`rail_draft_lengths`);
  target verify and draft extend: request ``b``'s list starts at ``f = max(0, L − w + 1)``,
  the earliest position its first query row (at ``L``) reads, so it holds ``min(L, w − 1)``
  prefix positions and its ``N`` window slots (:func:`rail_verify_prefix`).
* **The full → window pool map** (``full_to_swa``, ``[P_full]`` int32 or int64): entry ``i`` is
  the window-pool slot of the full pool's slot ``i``, ``−1`` where the window pool evicted it.
  It applies to each id after the row's own translation (``entry_page_size``, ``v2p``): the
  emitted id is ``full_to_swa[id]``. An id read whose entry is negative, or an id outside
  ``[0, P_full)``, is emitted as the sink slot 0 and sets ``BAD_KV_ID``
  (:func:`window_pool_ids`). Positions the rail does not read are never listed, so their
  ``−1`` is no fault. The map keeps the sink in place (``full_to_swa[0] = 0``), as a pool
  never hands its sink out: a padded request reads slot 0 in both pools.

The two keywords are independent on the device; a launcher refuses a draft window
(``window_size > 0``) together with the rail (:func:`check_window`): they bound different
models' attention.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import SpecConfig
from ..metadata.window_plan import (  # torch-free: the capacity plan's formulas, re-exported
    rail_draft_need,
    rail_mask_need,
    rail_prefix_total,
    rail_verify_need,
)
from ..status import Status
from ._common import load_kv_ids, load_kv_ids_ref

__all__ = [
    "check_window",
    "window_arguments",
    "rail_draft_need",
    "rail_verify_need",
    "rail_mask_need",
    "rail_prefix_total",
    "window_pool_ids",
    "load_window_ids",
    "rail_draft_lengths",
    "rail_verify_prefix",
    "window_pool_ids_ref",
    "load_window_ids_ref",
    "rail_draft_lengths_ref",
    "rail_verify_prefix_ref",
    "exclusive_rail_sum",
    "copy_window_list",
    "window_lists_ref",
    "page_window_arguments",
    "rail_floor",
    "window_page_ids",
    "rail_floor_ref",
    "window_page_ids_ref",
]

_FIX = ("(design §2.10: sliding_window_size is a window layer's w >= 1 tokens, None or 0 a full "
        "layer; full_to_swa the engine's [P_full] int32 or int64 full -> window pool slot map on "
        "the call's device, -1 where the window pool evicted a slot)")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side.
# --------------------------------------------------------------------------------------------
def window_layer_config(where: str, cfg, sliding_window_size: object):
    """A window layer's builder's ``(w, cfg)``: ``w`` an int ≥ 1, and the config with
    ``sliding_window_size = w`` (its plan names the window builders' buffers); a config that
    plans another window is refused. One rule for FA3's and FlashInfer's window builders."""
    if not isinstance(cfg, SpecConfig):
        raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
    w = validate.positive("sliding_window_size", sliding_window_size)
    if cfg.sliding_window_size not in (0, w):
        raise ValueError(
            f"{where}: sliding_window_size={w}, but the config plans window layers of "
            f"sliding_window_size={cfg.sliding_window_size}; pass the config's window, or "
            f"build the SpecConfig with sliding_window_size={w}"
        )
    return w, dataclasses.replace(cfg, sliding_window_size=w)


def check_window(where: str, sliding_window_size: object, full_to_swa: object,
                 device: torch.device, window_size: int = 0) -> int:  # fmt: skip
    """Check a window layer's inputs: ``sliding_window_size`` None or an int ≥ 0 (0 and None:
    a full layer), ``full_to_swa`` None or a 1-D int32 or int64 tensor on ``device``, and no
    draft window (``window_size``, already checked) beside the rail. Returns ``w`` (0 for a
    full layer). Host metadata only; an id that does not map is the kernels' to report."""
    try:
        rail = 0 if sliding_window_size is None else validate.positive(
            "sliding_window_size", sliding_window_size, 0)  # fmt: skip
        if full_to_swa is not None:
            validate.tensor("full_to_swa", full_to_swa, ndim=1, device=device,
                            contiguous_last=False)  # fmt: skip
    except TypeError as err:
        raise TypeError(f"{where}: {err} {_FIX}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err} {_FIX}") from None
    if rail and window_size:
        raise ValueError(
            f"{where}: window_size={window_size} (a draft window) and sliding_window_size={rail} "
            "(a window layer's read rail) were both given; they bound different models' "
            "attention: pass window_size for the draft model's lists, sliding_window_size for a "
            "target window layer's, never both (design §2.10)"
        )
    return rail


def window_arguments(full_to_swa: torch.Tensor | None) -> dict:
    """The launch keywords of the window pool map for a kernel reading ids with
    :func:`load_window_ids`: the map, its size and the ``TO_WINDOW`` switch. Without a map the
    two are ``None`` (constants to Triton): a full layer's launch passes no argument it does not
    read."""
    to_window = full_to_swa is not None
    return dict(full_to_swa_ptr=full_to_swa, full_size=full_to_swa.shape[0] if to_window else None,
                TO_WINDOW=to_window)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Device helpers.
# --------------------------------------------------------------------------------------------
@triton.jit
def window_pool_ids(ids, read, full_to_swa_ptr, full_size, TO_WINDOW: tl.constexpr):
    """``(ids, bad)``: full-pool ids (int64) on the lanes of ``read`` as window-pool ids,
    ``full_to_swa[id]`` (design §2.10); ``bad`` where an id lies outside ``[0, full_size)`` or
    its entry is negative, given as the sink slot 0. Without ``TO_WINDOW`` the ids pass as they
    are and nothing is bad. Lanes off ``read`` give 0 with the map, their id without it."""
    if TO_WINDOW:
        inside = read & (ids >= 0) & (ids < full_size)
        swa = tl.load(full_to_swa_ptr + ids, mask=inside, other=-1).to(tl.int64)
        bad = read & (swa < 0)
        return tl.where(read & ~bad, swa, 0), bad
    else:
        return ids, read & False


@triton.jit
def load_window_ids(row_ptr, pos, mask, W_row, v2p_ptr, num_pages, page_size, full_to_swa_ptr,
                    full_size, ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
                    TO_WINDOW: tl.constexpr):  # fmt: skip
    """:func:`~specmeta.kernels._common.load_kv_ids` followed by the window pool map:
    ``(ids, in_row, bad)``, ``bad`` where either step did not map (the sink slot 0). An id the
    row's own space could not map stays 0 and is not looked up; a lane outside the row reads
    nothing and gives 0."""
    ids, in_row, bad = load_kv_ids(row_ptr, pos, mask, W_row, v2p_ptr, num_pages, page_size,
                                   ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
    ids, lost = window_pool_ids(ids, mask & in_row & ~bad, full_to_swa_ptr, full_size, TO_WINDOW)
    return ids, in_row, bad | lost


@triton.jit
def rail_draft_lengths(L, s, rail):
    """``(prefix, chain)``: how many prefix positions and own-chain steps draft step ``s``
    lists under the rail ``w`` (design §2.10): the last ``min(L + s + 1, w)`` entries of
    ``[prefix, chain]``, so ``chain = min(s + 1, w)`` steps (the last ones, ``s + 1 − chain …
    s``) and ``prefix = min(L, w − chain)`` positions (the last ones, ``L − prefix … L − 1``).
    ``w = 0``: ``(L, s + 1)``."""
    chain = tl.where(rail > 0, tl.minimum(s + 1, rail), s + 1)
    prefix = tl.where(rail > 0, tl.minimum(L, tl.maximum(rail - chain, 0)), L)
    return prefix, chain


@triton.jit
def rail_verify_prefix(L, rail):
    """Prefix positions a verify or extend list keeps under the rail ``w`` (design §2.10):
    ``L − f = min(L, w − 1)``, ``f = max(0, L − w + 1)`` the earliest position the request's
    first query row (at ``L``) reads; ``L`` without a rail."""
    return tl.where(rail > 0, tl.minimum(L, rail - 1), L)


# --------------------------------------------------------------------------------------------
# Torch twins (plain torch; they may sync).
# --------------------------------------------------------------------------------------------
def window_pool_ids_ref(ids: torch.Tensor, read: torch.Tensor,
                        full_to_swa: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`window_pool_ids`: ``(ids, bad)`` (int64; with the map, 0 off ``read`` and where
    ``bad``)."""
    ids = ids.to(torch.int64)
    if full_to_swa is None:
        return ids, torch.zeros_like(read)
    inside = read & (ids >= 0) & (ids < full_to_swa.shape[0])
    swa = torch.where(inside, full_to_swa[torch.where(inside, ids, 0)].to(torch.int64), -1)
    bad = read & (swa < 0)
    return torch.where(read & ~bad, swa, 0), bad


def load_window_ids_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        positions: torch.Tensor, mask: torch.Tensor, *, entry_page_size: int = 1,
                        v2p: torch.Tensor | None = None, page_size: int = 1,
                        full_to_swa: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """:func:`load_window_ids` for request ``b``'s positions ``positions[b, ...]`` where ``mask``:
    ``(ids, bad, bits)`` as :func:`~specmeta.kernels._common.load_kv_ids_ref` gives them, the
    ids then through the window pool map."""
    ids, bad, bits = load_kv_ids_ref(req_to_token, req_pool_indices, positions, mask,
                                     entry_page_size=entry_page_size, v2p=v2p,
                                     page_size=page_size)  # fmt: skip
    R, W = req_to_token.shape
    rows = req_pool_indices.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    read = mask & (rows >= 0) & (rows < R) & (positions // entry_page_size < W)
    ids, lost = window_pool_ids_ref(ids, read & ~bad, full_to_swa)
    return ids, bad | lost, bits


def rail_draft_lengths_ref(L: torch.Tensor, s: int, rail: int) -> tuple[torch.Tensor, int]:
    """:func:`rail_draft_lengths` of every request (``L`` int64, ≥ 0): ``(prefix, chain)``."""
    if not rail:
        return L, s + 1
    chain = min(s + 1, rail)
    return L.clamp_max(max(rail - chain, 0)), chain


def rail_verify_prefix_ref(L: torch.Tensor, rail: int) -> torch.Tensor:
    """:func:`rail_verify_prefix` of every request (``L`` int64, ≥ 0)."""
    return L.clamp_max(rail - 1) if rail else L



# --------------------------------------------------------------------------------------------
# The lists of target verify and draft extend under the rail.
# --------------------------------------------------------------------------------------------
@triton.jit
def exclusive_rail_sum(seq_lens_ptr, b, extra, rail, BLOCK_B: tl.constexpr):
    """``Σ_{b'<b} (rail_verify_prefix(max(L_b', 0), w) + extra)`` in int64, from whole-vector
    loads of ``seq_lens``: where request ``b``'s clipped list starts."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        prev = tl.maximum(tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64), 0)
        cum += tl.sum(tl.where(before, rail_verify_prefix(prev, rail) + extra, 0), axis=0)
    return cum


@triton.jit
def copy_window_list(
    req_to_token_ptr, row_base, row_ok, first, n, b, B, start, W_row, kv_indices_ptr,
    kv_indptr_ptr, W_idx, first_chunk, chunk_step, v2p_ptr, num_pages, page_size,
    full_to_swa_ptr, full_size, BLOCK: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr,
    TRANSLATE: tl.constexpr, TO_WINDOW: tl.constexpr,
):  # fmt: skip
    """Request ``b``'s list of a CSR, the ids of row positions ``[first, first + n)`` read as
    :func:`load_window_ids` reads them, placed at ``start``: chunks ``first_chunk, first_chunk +
    chunk_step, …``; with ``first_chunk == 0`` also ``kv_indptr[b + 1] = start + n`` (and
    entry 0 from ``b == 0``). Stores past ``W_idx`` drop, and the loop covers only what the
    buffer can hold. Returns whether an id it stored did not map."""
    n_fit = tl.minimum(n, tl.minimum(tl.maximum(W_idx - start, 0), W_idx))
    k0 = tl.arange(0, BLOCK).to(tl.int64)
    bad = first_chunk * 0
    for chunk in range(first_chunk, tl.cdiv(n_fit, BLOCK), chunk_step):
        k = k0 + chunk * BLOCK
        dst = start + k
        m = (k < n) & (dst < W_idx)
        ids, _, wrong = load_window_ids(req_to_token_ptr + row_base, first + k,
                                        tl.where(row_ok, m, False), W_row, v2p_ptr, num_pages,
                                        page_size, full_to_swa_ptr, full_size, ENTRY_PAGE_SIZE,
                                        TRANSLATE, TO_WINDOW)  # fmt: skip
        tl.store(kv_indices_ptr + dst, ids, mask=m)
        bad |= tl.max(wrong.to(tl.int32), axis=0)
    if first_chunk == 0:
        tl.store(kv_indptr_ptr + b + 1, start + n, mask=b < B)
        tl.store(kv_indptr_ptr + b, start * 0, mask=b == 0)
    return bad


def window_lists_ref(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                     first: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                     start: torch.Tensor, *, entry_page_size: int = 1,
                     v2p: torch.Tensor | None = None, page_size: int = 1,
                     full_to_swa: torch.Tensor | None = None) -> int:  # fmt: skip
    """The torch twin of :func:`copy_window_list` over a batch: ``out[start[b] + k] =
    id(row_b, first[b] + k)`` for ``k < lengths[b]`` (stores past ``out`` dropped); returns the
    status bits (``ROW_OOB``, ``POS_OOB`` for a list past its row, ``BAD_KV_ID`` for an id
    stored that did not map)."""
    B = lengths.shape[0]
    if B == 0:
        return 0
    max_len = min(int(lengths.max()), out.shape[0])  # entry k lands at start + k >= k
    k = torch.arange(max_len, device=lengths.device).view(1, -1)
    dst = start.view(-1, 1) + k
    keep = (k < lengths.view(-1, 1)) & (dst < out.shape[0])
    pos = torch.where(keep, first.view(-1, 1) + k, 0)
    ids, bad, bits = load_window_ids_ref(req_to_token, req_pool_indices, pos, keep,
                                         entry_page_size=entry_page_size, v2p=v2p,
                                         page_size=page_size, full_to_swa=full_to_swa)  # fmt: skip
    out[dst[keep]] = ids[keep].to(out.dtype)
    bits = (bits & int(Status.ROW_OOB)) | (int(Status.BAD_KV_ID) if bool(bad.any()) else 0)
    if bool((first + lengths > req_to_token.shape[1] * entry_page_size).any()):  # past its row
        bits |= int(Status.POS_OOB)
    rows = req_pool_indices.to(torch.int64)
    if not bool(((rows >= 0) & (rows < req_to_token.shape[0])).all()):
        bits |= int(Status.ROW_OOB)
    return bits



# --------------------------------------------------------------------------------------------
# Page tables of a window layer (FA3): full-length tables in window-pool pages.
# --------------------------------------------------------------------------------------------
def page_window_arguments(rail: int, full_to_swa: torch.Tensor | None) -> dict:
    """The launch keywords of a page table's window rules (design §2.10): the rail ``w``
    (``None`` for a full layer, whose launch passes none), the map's, and ``WINDOW_LAYER``
    (a rail or a map: the columns are read with :func:`window_page_ids`)."""
    window_layer = bool(rail) or full_to_swa is not None
    return dict(rail=rail if window_layer else None, WINDOW_LAYER=window_layer,
                **window_arguments(full_to_swa))  # fmt: skip


@triton.jit
def rail_floor(L, rail):
    """The read floor of a request with prefix ``L ≥ 0`` under the rail ``w`` (design §2.10):
    ``f = max(0, L − w + 1)``, the first position its earliest query row (at ``L``: a verify's
    or extend's first row, a chain's draft step 0) reads; 0 without a rail."""
    return tl.where(rail > 0, tl.maximum(L - rail + 1, 0), 0)


@triton.jit
def window_page_ids(row_ptr, col, need, floor, W_row, v2p_ptr, num_pages, full_to_swa_ptr,
                    full_size, PAGE_SIZE: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr,
                    TRANSLATE: tl.constexpr, TO_WINDOW: tl.constexpr):  # fmt: skip
    """``(pages, bad, negative)``: page-table columns ``col`` (where ``need``) of one row of a
    window layer (design §2.10). A column whose whole page lies below the read floor
    (``(col + 1)·ps ≤ floor``) is never read by the kernel, whose own window excludes it: the
    sink page 0, nothing loaded, no fault. Any other column holds the page of the id emitted at
    the first position of its page that the kernel reads, ``max(col·ps, floor)``
    (:func:`load_window_ids`: the row's own translation, then the map), ``id // ps``; ``bad``
    where that id did not map (the sink page 0). ``negative``: a plain row's negative slot
    read without a map (the sink page 0; a page table reports it as ``POOL_OOB``)."""
    col = col.to(tl.int64)
    read = need & ((col + 1) * PAGE_SIZE > floor)
    pos = tl.maximum(col * PAGE_SIZE, floor)
    ids, _, bad = load_window_ids(row_ptr, pos, read, W_row, v2p_ptr, num_pages, PAGE_SIZE,
                                  full_to_swa_ptr, full_size, ENTRY_PAGE_SIZE, TRANSLATE,
                                  TO_WINDOW)  # fmt: skip
    negative = read & (ids < 0)
    return tl.where(negative, 0, ids) // PAGE_SIZE, bad, negative


def rail_floor_ref(L: torch.Tensor, rail: int) -> torch.Tensor:
    """:func:`rail_floor` of every request (``L`` int64, ≥ 0)."""
    return (L - rail + 1).clamp_min(0) if rail else torch.zeros_like(L)


def window_page_ids_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor, need: torch.Tensor, *, page_size: int,
                        entry_page_size: int = 1, v2p: torch.Tensor | None = None,
                        rail: int = 0, full_to_swa: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`window_page_ids` over a batch's tables ``[B, W]`` (columns where ``need``; the
    prefixes ``seq_lens`` int64, ≥ 0): ``(pages, bad, negative)``, pages int64, 0 where not
    read, ``bad`` or ``negative``."""
    ps = page_size
    col = torch.arange(need.shape[1], device=need.device).view(1, -1)
    floor = rail_floor_ref(seq_lens.to(torch.int64), rail).view(-1, 1)
    read = need & ((col + 1) * ps > floor)
    pos = torch.where(read, torch.maximum(col * ps, floor), 0)
    ids, bad, _ = load_window_ids_ref(req_to_token, req_pool_indices, pos, read,
                                      entry_page_size=entry_page_size, v2p=v2p, page_size=ps,
                                      full_to_swa=full_to_swa)  # fmt: skip
    negative = read & (ids < 0)
    pages = torch.div(torch.where(negative, 0, ids), ps, rounding_mode="floor")
    return torch.where(read, pages, 0), bad, negative


# --------------------------------------------------------------------------------------------
# A window layer's tree cascade (FA3): the shared prefix every row reads, and each row's band.
# --------------------------------------------------------------------------------------------
from ..metadata.window_plan import (  # noqa: E402  torch-free: the plan's formulas, re-exported
    window_tree_gap,
    window_tree_keep,
    window_tree_prefix_pages,
)


def window_tree_expand_width(depth: int, page_size: int) -> int:
    """Columns a verify expand row of a window layer's tree needs (design §2.10) for the depth
    bound ``D``: its band of prefix positions below the normal pass, at most ``D + 2·ps − 2 −
    d`` with ``d`` its own depth, then at most ``d + 1`` ancestors: ``D + 2·ps − 1``
    (``N + 2·ps − 2`` for ``D = N − 1``)."""
    return depth + 2 * page_size - 1


def check_tree_depth(where: str, tree_depth: object, rail: int, least: int) -> int:
    """``D`` of a window layer's tree cascade (design §2.10): ``tree_depth`` an int ≥ ``least``
    (the deepest query row's offset past ``L``), ``least`` when omitted; refused without a
    rail (a full layer's cascade reads every prefix position from every row)."""
    if tree_depth is None:
        return least
    D = validate.positive("tree_depth", tree_depth, minimum=0)
    if not rail:
        raise ValueError(f"{where}: tree_depth={D} was given without sliding_window_size; it "
                         "bounds a window layer's tree cascade (design §2.10): pass "
                         "sliding_window_size=w with it, or leave it out")  # fmt: skip
    if D < least:
        raise ValueError(f"{where}: tree_depth={D} is below the deepest node's depth {least} "
                         "the tree can hold; pass tree_depth >= that (the normal pass and "
                         "the expand pass must be built with the same one, design §2.10)")  # fmt: skip
    return D


@triton.jit
def tree_prefix_start(L, rail, depth, PAGE_SIZE):
    """``P0``, where a window layer's tree cascade's normal pass starts (design §2.10), for a
    prefix ``L ≥ 0``, the rail ``w`` and the depth bound ``D``: with ``k = ⌊(w − D − ps) /
    ps⌋ ≥ 0`` the page boundary ``max(0, (⌊L / ps⌋ − k)·ps)``, so every query row (the deepest
    at ``L + D`` reads from ``L + D − w + 1 ≤ P0`` on) reads all of ``[P0, L)``; ``L`` (no
    normal pass) when ``k < 0``."""
    keep_ok = rail >= depth + PAGE_SIZE
    keep = tl.maximum(rail - depth - PAGE_SIZE, 0) // PAGE_SIZE
    return tl.where(keep_ok, tl.maximum(L // PAGE_SIZE - keep, 0) * PAGE_SIZE, L)


def tree_prefix_start_ref(L: torch.Tensor, rail: int, depth: int, page_size: int) -> torch.Tensor:
    """:func:`tree_prefix_start` of every request (``L`` int64, ≥ 0)."""
    keep = window_tree_keep(rail, depth, page_size)
    if keep < 0:
        return L.clone()
    return ((torch.div(L, page_size, rounding_mode="floor") - keep).clamp_min(0)) * page_size


@triton.jit
def window_tree_rows(page_table_ptr, rows, live, m, pos, cnt, slot, L, start, rail, band_max,
                     W, stride_pt, row_ptr, row_ok, W_row, v2p_ptr, num_pages, page_size,
                     full_to_swa_ptr, full_size, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                     ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
                     TO_WINDOW: tl.constexpr):  # fmt: skip
    """The verify expand rows of a window layer's tree (design §2.10), one per node ``j`` of a
    tile: ``rows [BN, 1]`` its table rows (where ``live``), ``m [BN, BN]`` its ancestors-or-self
    among the window's nodes ``c``, ``pos``/``cnt`` their order (:func:`ancestor_order`),
    ``slot [BN]`` the window ids of the nodes (already through the map), ``start = P0`` where
    the normal pass starts. With ``d = cnt − 1`` the row's depth (position ``L + d``), it lists
    the band ``[max(0, L + d − w + 1), P0)`` of prefix positions (ids read with
    :func:`load_window_ids`), then its last ``min(cnt, w)`` ancestors (those within the
    window), then 0 to ``W``; a row with no node of its own (``cnt = 0``) is empty. Returns
    ``(counts [BN], past, bad, negative)``: the keys of each row, and whether a band position
    lay past the row, an id did not map (``BAD_KV_ID``) or a plain row's id read negative
    (``POOL_OOB``), each listed as the sink slot 0."""
    cnt2 = cnt[:, None].to(tl.int64)
    vis = tl.minimum(cnt2, rail)
    first = tl.maximum(L + cnt2 - rail, 0)  # L + d − w + 1
    band = tl.where(cnt2 > 0, tl.maximum(start - first, 0), 0)
    past = tl.sum(cnt, axis=0) * 0  # scalar flags (int32), or-ed over the band's chunks
    bad = past
    negative = past
    for k0 in range(0, band_max, BLOCK_P):
        k = k0 + tl.arange(0, BLOCK_P)[None, :]
        want = live & (k < band)
        ids, in_row, lost = load_window_ids(row_ptr, first + k, tl.where(row_ok, want, False),
                                            W_row, v2p_ptr, num_pages, page_size,
                                            full_to_swa_ptr, full_size, ENTRY_PAGE_SIZE,
                                            TRANSLATE, TO_WINDOW)  # fmt: skip
        neg = want & ~lost & (ids < 0)
        tl.store(page_table_ptr + rows * stride_pt + k, tl.where(neg, 0, ids),
                 mask=want & (k < W))  # fmt: skip
        past |= tl.max(tl.max((want & ~in_row).to(tl.int32), axis=1), axis=0)
        bad |= tl.max(tl.max((want & lost).to(tl.int32), axis=1), axis=0)
        negative |= tl.max(tl.max(neg.to(tl.int32), axis=1), axis=0)
    seen = live & m & (pos >= cnt2 - vis)
    col = band + pos - (cnt2 - vis)
    tl.store(page_table_ptr + rows * stride_pt + col, slot[None, :] + 0 * col,
             mask=seen & (col < W))  # fmt: skip
    for c0 in range(0, W, BLOCK_T):
        t = c0 + tl.arange(0, BLOCK_T)[None, :]
        tl.store(page_table_ptr + rows * stride_pt + t, 0 * rows + 0 * t,
                 mask=live & (t >= band + vis) & (t < W))  # fmt: skip
    counts = tl.sum(tl.where(live, band + vis, 0), axis=1)
    return counts, past != 0, bad != 0, negative != 0


def window_tree_row_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, b: int,
                        L: int, nodes: list[int], rail: int, depth: int, page_size: int, *,
                        entry_page_size: int = 1, v2p: torch.Tensor | None = None,
                        full_to_swa: torch.Tensor | None = None) -> tuple[list[int], int]:  # fmt: skip
    """The torch twin of one :func:`window_tree_rows` row, written position by position:
    request ``b`` (prefix ``L``), a node whose ancestors-or-self are the window nodes
    ``nodes`` (increasing). Returns ``(ids, bits)``: the ids of the band ``[max(0, L + d − w +
    1), P0)`` then of the last ``min(len(nodes), w)`` nodes at ``L + c``, each read as
    :func:`load_window_ids_ref` reads it (``BAD_KV_ID`` where it did not map, ``POOL_OOB`` for
    a plain row's negative id, ``POS_OOB`` past the row), and those bits."""
    if not nodes:
        return [], 0
    d = len(nodes) - 1
    p0 = int(tree_prefix_start_ref(torch.tensor([L]), rail, depth, page_size)[0])
    positions = list(range(max(0, L + d - rail + 1), p0))
    positions += [L + c for c in nodes[max(0, len(nodes) - rail) :]]
    pos = torch.tensor([positions], dtype=torch.int64, device=req_to_token.device)
    mask = torch.ones_like(pos, dtype=torch.bool)
    ids, bad, bits = load_window_ids_ref(req_to_token, req_pool_indices[b : b + 1], pos, mask,
                                         entry_page_size=entry_page_size, v2p=v2p,
                                         page_size=page_size, full_to_swa=full_to_swa)  # fmt: skip
    bits &= int(Status.ROW_OOB) | int(Status.POS_OOB)
    if bool(bad.any()):
        bits |= int(Status.BAD_KV_ID)
    neg = ~bad & (ids < 0)
    if bool(neg.any()):
        bits |= int(Status.POOL_OOB)
    return torch.where(neg, 0, ids)[0].tolist(), bits


__all__ += ["window_tree_keep", "window_tree_gap", "window_tree_expand_width",
            "check_tree_depth", "tree_prefix_start", "tree_prefix_start_ref", "window_tree_rows",
            "window_tree_row_ref"]  # fmt: skip


__all__ += ["window_tree_prefix_pages"]
