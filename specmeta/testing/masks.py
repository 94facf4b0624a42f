"""Comparing FlashInfer verify masks: the part of a mask a build writes."""

from __future__ import annotations

import torch

__all__ = ["written_part"]


def written_part(
    custom_mask: torch.Tensor, mask_indptr: torch.Tensor, packed: bool
) -> torch.Tensor:
    """The elements (bytes when ``packed``) a build writes, segment after segment, as uint8:
    what two builds of one batch must agree on. A packed segment is the ``ceil(n / 8)`` bytes
    at its element offset (:mod:`specmeta.kernels.tree_custom_mask`); the bytes between
    segments are never written. Reads ``mask_indptr`` on the host: a checking aid, it syncs."""
    ptr = mask_indptr.cpu().long().tolist()
    flat = custom_mask.view(torch.uint8)
    if not packed:
        return flat[: ptr[-1]]
    parts = [flat[lo : lo + (hi - lo + 7) // 8] for lo, hi in zip(ptr[:-1], ptr[1:], strict=True)]
    return torch.cat(parts) if parts else flat[:0]
