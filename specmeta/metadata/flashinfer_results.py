"""What FlashInfer's builder modes return (design §3.3): frozen dataclasses of views, each field
named as the ``plan()`` keyword of the wrapper it is for, the ``*_host`` fields the CPU mirrors
``plan()`` reads (:mod:`specmeta.metadata.flashinfer`)."""

from __future__ import annotations

import dataclasses

import torch

from . import host_ops
from .contract import DraftSteps

__all__ = ["FlashInferDecodeStep", "FlashInferDraftDecode", "FlashInferCascadeStep",
           "FlashInferCascadeDecode", "FlashInferPrefill", "ragged_prefill"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FlashInferDecodeStep:
    """One draft-decode forward for ``BatchDecodeWithPagedKVCacheWrapper.plan()``."""

    kv_indptr: torch.Tensor
    """``[B·K + 1]`` int32, device; exact."""
    kv_indices: torch.Tensor
    """``[W]`` int32, device; an upper bound: entries ``[0, kv_indptr[-1])`` are this step's."""
    kv_last_page_len: torch.Tensor
    """``[B·K]`` int32, device; exact (all 1 with page size 1)."""
    kv_indptr_host: torch.Tensor
    """``[B·K + 1]`` int32 on the CPU, equal to ``kv_indptr``, written from ``seq_lens_cpu``
    by the host part."""
    kv_last_page_len_host: torch.Tensor
    """``[B·K]`` int32 on the CPU, equal to ``kv_last_page_len`` (ones with page size 1,
    written from ``seq_lens_cpu`` by the host part for page lists)."""
    page_size: int
    """The page size to plan with: 1 for token lists, the pool's for page lists."""


@dataclasses.dataclass(frozen=True)
class FlashInferDraftDecode(DraftSteps):
    """Every draft-decode forward of one draft iteration, step ``s`` at ``steps[s]``."""

    steps: tuple[FlashInferDecodeStep, ...]


@dataclasses.dataclass(frozen=True)
class FlashInferCascadeStep:
    """One draft-decode forward for ``MultiLevelCascadeAttentionWrapper.plan()`` (two levels).

    Level 0 is the shared prefix: request ``b``'s ``K`` branch rows (query stride ``K``) read
    ``row_b[0:L_b]``. Level 1 is the chains: branch row ``z`` (stride 1) reads its ``s + 1``
    draft slots. Query rows are ordered ``[b, t]`` in both levels.
    """

    qo_indptr_arr: tuple[torch.Tensor, torch.Tensor]
    """``([B + 1], [B·K + 1])`` int32, device: ``K·arange`` and ``arange``; exact."""
    paged_kv_indptr_arr: tuple[torch.Tensor, torch.Tensor]
    """``([B + 1], [B·K + 1])`` int32, device: ``[0, cumsum(L)]`` and ``z·(s + 1)``; exact."""
    paged_kv_indices_arr: tuple[torch.Tensor, torch.Tensor]
    """``([W0], [W1])`` int32, device; upper bounds (``ΣL`` and ``B·K·(s+1)`` entries used)."""
    paged_kv_last_page_len: tuple[torch.Tensor, torch.Tensor]
    """``([B], [B·K])`` int32 ones, device; exact."""
    qo_indptr_host_arr: tuple[torch.Tensor, torch.Tensor]
    """CPU mirrors of ``qo_indptr_arr`` (batch independent, always present)."""
    paged_kv_indptr_host_arr: tuple[torch.Tensor, torch.Tensor]
    """CPU mirrors of ``paged_kv_indptr_arr`` (the prefix level's written from
    ``seq_lens_cpu`` by the host part, the chain level's batch independent)."""
    paged_kv_last_page_len_host_arr: tuple[torch.Tensor, torch.Tensor]
    """CPU mirrors of ``paged_kv_last_page_len`` (ones, always present)."""
    page_size: int = 1


@dataclasses.dataclass(frozen=True)
class FlashInferCascadeDecode(DraftSteps):
    """Every cascade draft-decode forward of one draft iteration, step ``s`` at ``steps[s]``."""

    steps: tuple[FlashInferCascadeStep, ...]


@dataclasses.dataclass(frozen=True)
class FlashInferPrefill:
    """Target verify or draft extend for ``BatchPrefillWithPagedKVCacheWrapper.plan()``."""

    qo_indptr: torch.Tensor
    """``[B + 1]`` int32, device: ``N·arange`` (uniform stride, design §3.1), or the padded
    lengths' exclusive sum for a ragged verify; exact."""
    kv_indptr: torch.Tensor
    """``[B + 1]`` int32, device: ``[0, cumsum(L + N)]``; exact."""
    kv_indices: torch.Tensor
    """``[W]`` int32, device; upper bound: ``ΣL + B·N`` entries used."""
    kv_last_page_len: torch.Tensor
    """``[B]`` int32 ones, device; exact."""
    custom_mask: torch.Tensor | None
    """Flat bool, device, request ``i`` an ``N × (L_i + N)`` block; upper bound (``None`` for
    draft extend or when ``packed_custom_mask`` is given)."""
    packed_custom_mask: torch.Tensor | None
    """uint8, device: ``custom_mask`` packed little-endian, each request's segment padded to a
    byte and starting at byte ``mask_indptr[i]`` (the layout FlashInfer 0.7's ``plan()`` reads;
    see :mod:`specmeta.kernels.tree_custom_mask`)."""
    mask_indptr: torch.Tensor | None
    """``[B + 1]`` int32, device: segment starts, in elements (read as bytes for the packed
    form). ``plan()`` computes the same offsets itself; it is not passed."""
    causal: bool
    """``False`` for target verify (the mask decides), ``True`` for draft extend."""
    qo_indptr_host: torch.Tensor
    """``[B + 1]`` int32 on the CPU, equal to ``qo_indptr`` (written from
    ``verify_lens_cpu`` for a ragged verify)."""
    kv_indptr_host: torch.Tensor
    """``[B + 1]`` int32 on the CPU, equal to ``kv_indptr``, written from ``seq_lens_cpu``
    by the host part."""
    kv_last_page_len_host: torch.Tensor
    """``[B]`` int32 ones on the CPU (always present)."""
    mask_indptr_host: torch.Tensor | None
    """``[B + 1]`` int32 on the CPU, equal to ``mask_indptr``; ``None`` without a mask
    (draft extend)."""
    max_q_len: int
    """``N``, the same at capture and at replay; ``T`` for a ragged verify (the bucket)."""
    page_size: int = 1
    verify_lens: torch.Tensor | None = None
    """Ragged verify: ``[Bp]`` int32, device, the lengths padded to the bucket (design §2.9);
    request ``i``'s query rows are ``qo_indptr[i] : qo_indptr[i + 1]``. ``None`` otherwise."""
    verify_lens_host: torch.Tensor | None = None
    """Ragged verify: ``[Bp]`` int32 on the CPU, equal to ``verify_lens``."""


def ragged_prefill(builder, form: str, B: int, T: int, count: int, mirrors: dict,
                   kv_host: torch.Tensor, mask: torch.Tensor, mask_host: torch.Tensor,
                   compiled: bool) -> tuple[FlashInferPrefill, host_ops.Writer]:  # fmt: skip
    """A ragged target verify's result over a bucket of ``B`` requests (``count`` of them
    real) and ``T`` tokens, views of a :class:`~.flashinfer.FlashInferBuilder`'s buffers and of
    the ring's set ``mirrors``, and the writer of its host mirrors from ``seq_lens_cpu`` and
    ``verify_lens_cpu`` (design §2.9)."""
    buf, mode = builder.buffers, "target_verify"
    verify_host = mirrors["verify_lens_host"][:B]
    qo_host = mirrors["ragged_qo_indptr_host"][: B + 1]
    result = FlashInferPrefill(
        qo_indptr=buf[f"{mode}.ragged_qo_indptr"][: B + 1],
        kv_indptr=buf[f"{mode}.kv_indptr"][: B + 1],
        kv_indices=buf[f"{mode}.kv_indices"],
        kv_last_page_len=buf[f"{mode}.kv_last_page_len"][:B],
        custom_mask=mask if form == "" else None,
        packed_custom_mask=mask if form else None,
        mask_indptr=buf[f"{mode}.{form}mask_indptr"][: B + 1],
        causal=False,
        qo_indptr_host=qo_host,
        kv_indptr_host=kv_host,
        kv_last_page_len_host=buf[f"{mode}.kv_last_page_len_host"][:B],
        mask_indptr_host=mask_host,
        max_q_len=T,
        verify_lens=buf[f"{mode}.verify_lens"][:B],
        verify_lens_host=verify_host,
    )
    write = host_ops.ragged_verify_writer(builder._length_rules[mode], B, count, T,
                                          builder.cfg.num_draft_tokens, verify_host, qo_host,
                                          kv_host, mask_host, use_compiled=compiled)  # fmt: skip
    return result, write
