"""FlashAttention-3 metadata of a hybrid model's sliding-window layers (design §2.10, §3.2).

A hybrid model reads its window layers (window ``w``) from a second KV pool, and each of their
queries reads only the positions ``(p − w, p]``. An engine makes one builder per id space from
one :class:`~specmeta.SpecConfig`: ``FA3MetadataBuilder(cfg, device)`` for the full layers and
``FA3MetadataBuilder(cfg, device, sliding_window_size=w)``, an :class:`FA3WindowBuilder`, for
the window layers. Its buffers are its own (plan keys ``fa3_swa.<mode>.<field>``), and its
modes take the engine's full → window pool map, ``full_to_swa=``, on every call.

A page table cannot be clipped inside a page, so a window layer's tables keep their full
length (``cache_seqlens`` as a full layer's) and FlashAttention's own window,
``window_size = (w − 1, 0)`` on every result (query ``p`` reads keys ``[p − (w − 1), p]``),
excludes what a row does not read. The tables hold window-pool pages: column ``c`` is
``full_to_swa[id] // ps`` for the id at the first position of its page that a query reads
(the window pool pages like the full pool: a page's slots map to one window page at the same
offsets), and a page wholly below the read floor ``max(0, L − w + 1)`` is the sink page 0, never
read and no fault whatever the map holds there.

It serves chains (``topk = 1``): draft decode (one table, every step), target verify (one
causal pass over ``L + N``) and draft extend, bound and eager. A tree (``topk > 1``) is
refused: FA3 verifies a tree as a cascade whose normal pass has a request's ``N`` query rows,
non-causal, over the shared prefix, and each row (a node at its own depth) has its own window
there, which one page table and one kernel window per pass cannot express. FlashInfer's window
builder serves a window layer's trees (its lists and masks are clipped row by row).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import SpecConfig
from ..kernels._window import check_window, window_layer_config
from .capabilities import Capabilities
from .fa3 import FA3MetadataBuilder
from .window_plan import FA3_WINDOW_PREFIX, WINDOW_MODES

__all__ = ["FA3WindowBuilder", "FA3_WINDOW_CAPABILITIES"]

#: What FA3's window builder serves: the chain modes, no tree.
FA3_WINDOW_CAPABILITIES = Capabilities(
    modes=WINDOW_MODES,
    tree_draft=False,
    tree_verify=False,
    page_sizes="any",
    graph_safe=frozenset(WINDOW_MODES),
)


class FA3WindowBuilder(FA3MetadataBuilder):
    """FA3 metadata of a hybrid model's window layers: ``FA3MetadataBuilder(cfg, device,
    sliding_window_size=w)`` makes one (see the module's text). Its buffers are the
    ``fa3_swa.*`` keys of the config's plan with that ``w`` (a config that names another window
    is refused, and so is ``topk > 1``); the other arguments are
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

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 sliding_window_size: int | None = None, **kwargs: Any):  # fmt: skip
        where = type(self).__name__
        w, window_cfg = window_layer_config(where, cfg, sliding_window_size)
        if cfg.topk > 1:
            raise ValueError(
                f"{where}: topk={cfg.topk}: FA3 serves a window layer's chains only (topk=1): "
                "a tree's cascade reads the shared prefix in one pass whose rows each have "
                "their own window, which a page table and one kernel window cannot express "
                "(design §2.10); build a window layer's trees with FlashInferBuilder(cfg, "
                f"device, sliding_window_size={w})"
            )
        self.sliding_window_size = w
        self.window_size = (w - 1, 0)
        super().__init__(window_cfg, device, **kwargs)

    def _window_tables(self, mode: str, full_to_swa: Any) -> dict:
        """The rail and the map for ``mode``'s page tables (design §2.10), the map checked."""
        check_window(self.require(mode), self.sliding_window_size, full_to_swa, self.device)
        return dict(sliding_window_size=self.sliding_window_size, full_to_swa=full_to_swa)

    def bind_bucket(self, mode: str, B: int, verify_lens: Any, num_tokens: Any,
                    status: torch.Tensor | None, **kwargs: Any) -> tuple:  # fmt: skip
        if verify_lens is not None or num_tokens is not None:
            raise ValueError(
                f"{self.require(mode)}: verify_lens (a ragged verify) is not built for a window "
                "layer yet (design §2.10); verify its window layers with the uniform layout "
                "(verify_lens=None)"
            )
        return super().bind_bucket(mode, B, verify_lens, num_tokens, status, **kwargs)
