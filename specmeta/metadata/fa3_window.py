"""FlashAttention-3 metadata of a hybrid model's sliding-window layers (design §2.10, §3.2).

A hybrid model reads its window layers (window ``w``) from a second KV pool, and each of their
queries reads only the positions ``(p − w, p]``. An engine makes one builder per id space from
one :class:`~specmeta.SpecConfig`: ``FA3MetadataBuilder(cfg, device)`` for the full layers and
``FA3MetadataBuilder(cfg, device, sliding_window_size=w)``, an :class:`FA3WindowBuilder`, for
the window layers. Its buffers are its own (plan keys ``fa3_swa.<mode>.<field>``), and its
modes take the engine's full → window pool map, ``full_to_swa=``, on every call.

A page table cannot be clipped inside a page, so a chain's tables keep their full length
(``cache_seqlens`` as a full layer's) and FlashAttention's own window, ``window_size = (w − 1,
0)`` on each of its results (query ``p`` reads keys ``[p − (w − 1), p]``), excludes what a row
does not read. The tables hold window-pool pages: column ``c`` is
``full_to_swa[id] // ps`` for the id at the first position of its page that a query reads
(the window pool pages like the full pool: a page's slots map to one window page at the same
offsets), and a page wholly below the read floor ``max(0, L − w + 1)`` is the sink page 0, never
read and no fault whatever the map holds there.

It serves chains (``topk = 1``): draft decode (one table, every step), target verify (one
causal pass over ``L + N``) and draft extend, bound and eager. A tree's target verify
(``topk > 1``) and a ragged verify (every ``topk``) are FA3's cascade, split so that each pass
is exact without a kernel window: a node at depth ``d`` (position ``L + d``) reads the prefix
from ``L + d − w + 1`` on, so the **normal pass** (non-causal, every row of the request) lists
only ``[P0, L)``, ``P0`` a page boundary at or past what the deepest row reads
(``prefix_page_table(..., tree_depth=N − 1)``), and each row's **expand pass** lists, token by
token, its band ``[max(0, L + d − w + 1), P0)`` of the prefix and then its ancestors within
the window (``verify_expand_page_table`` / ``verify_expand_ragged`` with the rail), all in
window-pool ids. FlashAttention cannot start a page table's sequence inside a page (the CuTe
kernel takes no left padding), hence the page boundary and the band.

A tree's draft decode (``topk > 1``) is the same cascade in whole pages: every branch of a
step sits at the same position ``L + s``, the normal pass keeps at most ``G`` positions (the
whole pages before ``L − lpl`` that every step reads; ``draft_decode_page_tables(...,
tree_depth=S − 1)``), and each expand row lists the row pages from its floor up to the normal
pass's start, then its branch's own pages; FlashAttention's window ``(w − 1 − G, 0)`` on the
expand pass hides exactly what the row does not read (the normal pass's ``G`` positions are
the only gap in its sequence). The normal passes run no kernel window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import SpecConfig
from ..kernels._window import check_window, window_layer_config
from ..stage import Stage
from .capabilities import FA3_WINDOW_CAPABILITIES  # torch-free: specmeta plan reads it too
from .fa3 import FA3MetadataBuilder
from .fa3_results import FA3Cascade, FA3DraftDecode
from .window_plan import (
    FA3_WINDOW_PREFIX,
    fa3_window_verify_width,
    window_tree_gap,
    window_tree_prefix_pages,
)

__all__ = ["FA3WindowBuilder", "FA3_WINDOW_CAPABILITIES"]


class FA3WindowBuilder(FA3MetadataBuilder):
    """FA3 metadata of a hybrid model's window layers: ``FA3MetadataBuilder(cfg, device,
    sliding_window_size=w)`` makes one (see the module's text). Its buffers are the
    ``fa3_swa.*`` keys of the config's plan with that ``w`` (a config that names another window
    is refused); the other arguments are
    :class:`~.fa3.FA3MetadataBuilder`'s.

    Attributes
    ----------
    sliding_window_size : int
        ``w``: each query at position ``p`` reads the positions ``(p − w, p]``.
    window_size : tuple of int
        ``(w − 1, 0)``, FlashAttention's window on every result.
    """

    plan_prefix = FA3_WINDOW_PREFIX
    capabilities = FA3_WINDOW_CAPABILITIES
    #: The depth bound ``D`` of the tree cascade being bound (design §2.10), ``None`` for a
    #: chain's causal pass: set by :meth:`bind_target_verify` around the base class's bind.
    _tree_depth: int | None = None

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 sliding_window_size: int | None = None, **kwargs: Any):  # fmt: skip
        where = type(self).__name__
        w, window_cfg = window_layer_config(where, cfg, sliding_window_size)
        self.sliding_window_size = w
        self.window_size = (w - 1, 0)
        super().__init__(window_cfg, device, **kwargs)

    def _window_tables(self, mode: str, full_to_swa: Any) -> dict:
        """The rail and the map for ``mode``'s page tables (design §2.10), the map checked; a
        tree cascade's depth bound too (both passes are built with it)."""
        check_window(self.require(mode), self.sliding_window_size, full_to_swa, self.device)
        out = self._rail_and_map(full_to_swa)
        if mode == "draft_decode" and self.cfg.topk > 1:
            out["tree_depth"] = self.cfg.num_steps - 1  # every step's rows at L + s
        elif self._tree_depth is not None:
            out["tree_depth"] = self._tree_depth
        return out

    def _rail_and_map(self, full_to_swa: Any) -> dict:
        """The keywords every window table takes: the rail ``w`` and the map."""
        return dict(sliding_window_size=self.sliding_window_size, full_to_swa=full_to_swa)

    def bind_target_verify(self, *args: Any, **kwargs: Any) -> Stage:
        """:meth:`~.fa3.FA3MetadataBuilder.bind_target_verify` of a window layer: a tree
        (``topk > 1``) or a ragged verify is a cascade whose normal pass lists the prefix
        from ``P0`` and whose expand rows list their bands below it (design §2.10), both
        built with the depth bound ``D = N − 1``; a chain's uniform verify is one causal pass
        under the kernel's window."""
        ragged = kwargs.get("verify_lens") is not None or kwargs.get("num_tokens") is not None
        cascade = self.cfg.topk > 1 or ragged
        self._tree_depth = self.cfg.num_draft_tokens - 1 if cascade else None
        try:
            return super().bind_target_verify(*args, **kwargs)
        finally:
            self._tree_depth = None

    def _draft_views(self, B: int, rows: int) -> tuple[dict, FA3DraftDecode]:
        """The base class's views; a tree's expand pass runs FlashAttention's window ``(w − 1
        − G, 0)`` and lists up to ``n·ps`` more keys, ``n`` its most row pages
        (design §2.10)."""
        out, result = super()._draft_views(B, rows)
        if self.cfg.topk == 1:
            return out, result
        w, S, ps = self.sliding_window_size, self.cfg.num_steps, self.cfg.page_size
        gap = window_tree_gap(w, S - 1, ps)
        more = window_tree_prefix_pages(w, S - 1, ps) * ps
        return out, FA3DraftDecode(tuple(
            FA3Cascade(normal=step.normal,
                       expand=dataclasses.replace(step.expand, window_size=(w - 1 - gap, 0),
                                                  max_seqlen_k=step.expand.max_seqlen_k + more))
            for step in result.steps
        ))  # fmt: skip

    def _verify_views(self, B: int) -> tuple[dict, FA3Cascade]:
        """The base class's views; a tree's cascade runs no kernel window (each pass lists
        exactly what its rows read) and its expand rows hold up to ``N + 2·ps − 2`` keys."""
        out, result = super()._verify_views(B)
        if result.expand is None:
            return out, result
        return out, self._cascade(result)

    def _ragged_views(self, B: int, T: int) -> tuple[dict, FA3Cascade]:
        """The base class's views, the expand rows' bound widened as in :meth:`_verify_views`."""
        out, result = super()._ragged_views(B, T)
        return out, self._cascade(result)

    def _cascade(self, result: FA3Cascade) -> FA3Cascade:
        """``result`` as a window layer's tree cascade: no kernel window on either pass, the
        expand pass's ``max_seqlen_k`` its row width bound."""
        width = fa3_window_verify_width(self.cfg.num_draft_tokens, self.cfg.page_size)
        return FA3Cascade(
            normal=dataclasses.replace(result.normal, window_size=None),
            expand=dataclasses.replace(result.expand, window_size=None, max_seqlen_k=width),
        )
