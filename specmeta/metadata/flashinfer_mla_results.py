"""The results of :class:`~specmeta.metadata.flashinfer_mla.FlashInferMLABuilder` (design §3.5):
frozen dataclasses of views into the builder's buffers, named as the keywords of
``flashinfer.mla.BatchMLAPagedAttentionWrapper.plan()``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .contract import DraftSteps

__all__ = ["FlashInferMLAPass", "FlashInferMLAAttention", "FlashInferMLADraftDecode"]


@dataclasses.dataclass(frozen=True)
class FlashInferMLAPass:
    """One ``plan()``/``run()`` of ``BatchMLAPagedAttentionWrapper``.

    Query row ``r`` of request ``i`` (rows ``qo_indptr[i] … qo_indptr[i+1] − 1``) attends to
    the first ``kv_len_arr[i]`` tokens of the pages ``kv_indices[kv_indptr[i] :
    kv_indptr[i+1]]``, ``ceil(kv_len_arr[i] / page_size)`` of them (exact: FlashInfer's
    ``plan()`` refuses any other count); with ``causal`` the last ``q_len`` keys are aligned
    with the ``q_len`` rows (bottom-right), else a row sees every key.

    Attributes
    ----------
    qo_indptr, kv_indptr : torch.Tensor
        ``[B' + 1]`` int32 on the device (``B'`` the pass's KV lists); exact.
    kv_indices : torch.Tensor
        ``[W]`` int32 on the device, contiguous: page ids (token slots when ``page_size`` is
        1); the first ``kv_indptr_host[-1]`` entries are written, the rest never read.
    qo_indptr_host, kv_indptr_host, kv_len_arr_host : torch.Tensor
        ``[B' + 1]``, ``[B' + 1]``, ``[B']`` int32 CPU mirrors (pinned for a CUDA builder),
        written by the stage's host part from ``seq_lens_cpu``; exact. ``plan()`` reads them on
        the host: pass these, never device tensors (a device tensor there is a sync).
    page_size : int
        The pass's page size: the pool's for a request's own pages, 1 for token slots (view the
        cache ``[P, 1, D]``).
    causal : bool
        ``plan(causal=...)``.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_len_arr_host: torch.Tensor
    page_size: int
    causal: bool

    def plan_kwargs(self) -> dict[str, Any]:
        """``plan()``'s metadata keywords: the host mirrors, the device ``kv_indices``, the
        page size and ``causal`` (add ``num_heads``, head dims, ``sm_scale`` and dtypes; the
        four lists also make ``flashinfer.mla.MLAPlanMetadata.csr(...)``)."""
        return dict(qo_indptr=self.qo_indptr_host, kv_indptr=self.kv_indptr_host,
                    kv_indices=self.kv_indices, kv_len_arr=self.kv_len_arr_host,
                    page_size=self.page_size, causal=self.causal)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FlashInferMLAAttention:
    """The passes of one attention over the same query rows.

    ``ancestors`` is ``None`` when ``prefix`` alone is the attention (``topk == 1``: the prefix
    and the chain, or the verify window, in one pass). Otherwise the two passes run with
    ``return_lse=True`` and ``return_lse_base_on_e=True`` (FlashInfer's LSE is base 2 unless
    asked; :func:`specmeta.merge_state` takes natural logs) and are merged:
    ``merge_state(o_prefix, lse_prefix, o_ancestors, lse_ancestors)``. A pass with no keys for
    a row (an empty prefix) gives it LSE ``−inf``, which the merge weighs 0.

    Attributes
    ----------
    prefix : FlashInferMLAPass
        Each request's prefix once (``K > 1``: non-causal, for all the request's rows), or its
        whole sequence (``topk == 1``).
    ancestors : FlashInferMLAPass or None
        One list a query row, page size 1: its own chain (draft decode), or its ancestors' and
        its own slots in the verify window (target verify).
    """

    prefix: FlashInferMLAPass
    ancestors: FlashInferMLAPass | None = None

    @property
    def passes(self) -> tuple[FlashInferMLAPass, ...]:
        """The passes to run, prefix first."""
        return (self.prefix,) if self.ancestors is None else (self.prefix, self.ancestors)


@dataclasses.dataclass(frozen=True)
class FlashInferMLADraftDecode(DraftSteps):
    """Every draft-decode forward: ``steps[s]`` is step ``s``'s :class:`FlashInferMLAAttention`
    (``K > 1``: the same prefix pass every step)."""

    steps: tuple[FlashInferMLAAttention, ...]
