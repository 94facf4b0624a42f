"""What FA3's builder modes return (design §3.2): frozen dataclasses of views whose fields are
``flash_attn_with_kvcache``'s keywords (:mod:`specmeta.metadata.fa3`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .contract import DraftSteps

__all__ = ["FA3Metadata", "FA3Cascade", "FA3DraftDecode"]

_KEYWORDS = (
    "cache_seqlens",
    "page_table",
    "cu_seqlens_q",
    "cu_seqlens_k_new",
    "max_seqlen_q",
    "causal",
    "return_softmax_lse",
)


@dataclasses.dataclass(frozen=True)
class FA3Metadata:
    """The metadata keywords of one ``flash_attn_with_kvcache`` call; ``B'`` is its batch of
    sequences (requests, branches or tree nodes).

    Attributes
    ----------
    cache_seqlens : torch.Tensor
        ``[B']`` int32, exact KV length of each sequence.
    page_table : torch.Tensor
        ``[B', W]`` int32 page ids of pages of ``page_size`` tokens; only the first
        ``ceil(cache_seqlens / page_size)`` columns are meaningful, the rest are 0 (the sink).
    cu_seqlens_q : torch.Tensor
        ``[B' + 1]`` int32, ``max_seqlen_q · arange(B' + 1)``: uniform stride, the same at
        capture and replay (design §3.1).
    cu_seqlens_k_new : torch.Tensor
        ``[B' + 1]`` int32, ``[0, cumsum(cache_seqlens)]``, exact.
    max_seqlen_q : int
        Query rows of every sequence (exact; padded sequences keep the full width).
    causal : bool
        Bottom-right causal mask (verify and extend with ``K == 1``) or none.
    return_softmax_lse : bool
        True for both passes of a cascade, whose outputs are merged by log-sum-exp.
    page_size : int
        Not a keyword: the page size ``page_table`` indexes. View the KV cache as
        ``[-1, page_size, H_kv, D]`` (1 for the verify expand pass, which lists token slots).
    max_seqlen_k : int
        Not a keyword of ``flash_attn_with_kvcache`` (it is one of ``get_scheduler_metadata``):
        ``max(cache_seqlens)``, exact when the build was given ``seq_lens_cpu``, otherwise an
        upper bound from the config (``max_context_len``, ``page_size``, ``N``).
    window_size : tuple of int, or None
        FlashAttention's own sliding window ``(left, right)``: query position ``p`` reads the
        keys ``[p − left, p + right]``, so a window layer of window ``w`` (reading ``(p − w,
        p]``, design §2.10) has ``(w − 1, 0)``; ``None`` for a full layer, and then not a
        keyword at all. A window layer's page tables keep their full length: the kernel's
        window excludes what a row does not read.
    """

    cache_seqlens: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k_new: torch.Tensor
    max_seqlen_q: int
    causal: bool
    return_softmax_lse: bool
    page_size: int
    max_seqlen_k: int
    window_size: tuple[int, int] | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keywords of FA3's ``flash_attn_with_kvcache`` (``flash_attn_interface``, sgl-kernel):
        ``flash_attn_with_kvcache(q, k_cache, v_cache, **meta.kwargs(), softmax_scale=…)``;
        ``window_size`` too for a window layer."""
        out = {name: getattr(self, name) for name in _KEYWORDS}
        if self.window_size is not None:
            out["window_size"] = self.window_size
        return out

    def varlen_kwargs(self) -> dict[str, Any]:
        """Keywords of FlashAttention's CuTe ``flash_attn.cute.flash_attn_varlen_func``:
        ``out, lse = flash_attn_varlen_func(q, k_cache, v_cache, **meta.varlen_kwargs(),
        softmax_scale=…)``.

        The KV lengths go in as ``seqused_k`` (with a page table that kernel takes no
        ``cu_seqlens_k``, so ``cu_seqlens_k_new`` is left out) and ``return_lse`` replaces
        ``return_softmax_lse``. Its LSE is ``[H, total_q]`` float32, natural log, and ``−inf``
        for a sequence with no keys (a layout-B normal pass whose prefix is shorter than a
        page): :func:`specmeta.merge_state` takes ``lse.t()`` and handles it. A window
        layer's ``window_size`` is the CuTe kernel's keyword of the same name and meaning.
        """
        out = {
            "cu_seqlens_q": self.cu_seqlens_q,
            "seqused_k": self.cache_seqlens,
            "page_table": self.page_table,
            "max_seqlen_q": self.max_seqlen_q,
            "causal": self.causal,
            "return_lse": self.return_softmax_lse,
        }
        if self.window_size is not None:  # (left, right), the left one excluding the query
            out["window_size"] = self.window_size
        return out


@dataclasses.dataclass(frozen=True)
class FA3Cascade:
    """One attention of a mode: ``normal`` alone, or ``normal`` + ``expand`` merged by LSE.

    Attributes
    ----------
    normal : FA3Metadata
        The shared prefix of each request (its whole sequence when there is no cascade).
    expand : FA3Metadata or None
        ``K > 1`` only: each branch's (draft decode) or tree node's (target verify) own keys,
        one query row per sequence, over the same query rows as ``normal``.
    """

    normal: FA3Metadata
    expand: FA3Metadata | None

    @property
    def is_cascade(self) -> bool:
        return self.expand is not None


@dataclasses.dataclass(frozen=True)
class FA3DraftDecode(DraftSteps):
    """Every draft-decode forward of one draft iteration, step ``s`` at ``steps[s]`` (the
    result is also the sequence of its steps)."""

    steps: tuple[FA3Cascade, ...]
