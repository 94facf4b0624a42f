"""Dense attention over explicit KV slot lists: the oracle every backend's consumer is checked
against.

A query row attends to exactly the slots listed for it — the logical sequence of its branch or
tree node (its prefix, then its own chain or its ancestors) — in float64, so a consumer that
reads the metadata correctly agrees to ~1e-12 whatever the split of the work (pages, cascade
passes, merges).

Examples
--------
>>> k = v = torch.eye(3).view(3, 1, 3)               # P = 3 slots, one KV head, D = 3
>>> q = torch.zeros(2, 1, 3)                          # all scores equal
>>> out, lse = dense_attention(q, k, v, [[0, 1], [2]])
>>> out[0, 0].tolist(), out[1, 0].tolist()
([0.5, 0.5, 0.0], [0.0, 0.0, 1.0])
>>> round(float(lse[0, 0]), 6) == round(math.log(2), 6)
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["dense_attention"]


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: Sequence[Sequence[int] | torch.Tensor],
    *,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q·kᵀ·scale)·v`` of every query row over its own slot list, in float64.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` queries, any float dtype.
    k_cache, v_cache : torch.Tensor
        ``[P, H_kv, D]`` and ``[P, H_kv, D_v]``: the KV pool, one row per slot. ``H`` must be a
        multiple of ``H_kv`` (grouped-query attention: query head ``h`` reads KV head
        ``h // (H / H_kv)``).
    kv_slots : sequence of T slot lists
        Row ``i`` attends to slots ``kv_slots[i]`` (a list or 1-D integer tensor, each in
        ``[0, P)``); the order does not matter, duplicates count twice.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    (out, lse) : tuple of torch.Tensor
        ``out [T, H, D_v]`` float64 and ``lse [T, H]`` float64, the natural-log sum of
        ``exp(scores)``. A row with no slots gives ``out = 0``, ``lse = −inf`` (it merges as an
        empty pass).
    """
    T, H, D = q.shape
    P, H_kv, _ = k_cache.shape
    if len(kv_slots) != T:
        raise ValueError(f"kv_slots must have one list per query row ({T}), got {len(kv_slots)}")
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({H_kv})")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    device = q.device
    lists = [torch.as_tensor(s, dtype=torch.int64, device=device).reshape(-1) for s in kv_slots]
    width = max((x.numel() for x in lists), default=0)
    slots = torch.zeros(T, width, dtype=torch.int64, device=device)
    valid = torch.zeros(T, width, dtype=torch.bool, device=device)
    for i, x in enumerate(lists):
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= P):
            raise ValueError(f"kv_slots[{i}] has a slot outside [0, {P})")
        slots[i, : x.numel()] = x
        valid[i, : x.numel()] = True
    group = H // H_kv
    k = k_cache.to(torch.float64)[slots].repeat_interleave(group, dim=2)  # [T, n, H, D]
    v = v_cache.to(torch.float64)[slots].repeat_interleave(group, dim=2)  # [T, n, H, Dv]
    scores = torch.einsum("thd,tnhd->thn", q.to(torch.float64), k) * scale
    scores = scores.masked_fill(~valid.view(T, 1, width), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]; −inf for empty rows
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float64).min))
    weights = torch.nan_to_num(weights, nan=0.0)
    out = torch.einsum("thn,tnhd->thd", weights, v)
    return out, lse
