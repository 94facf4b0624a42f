"""A torch reference consumer of FlashInfer's paged metadata, read the way FlashInfer reads it.

It turns each query row's CSR metadata into the KV slots it covers and attends over them with the
float64 dense oracle (:mod:`specmeta.testing.consumers.dense`): pages ``kv_indices[kv_indptr[i] :
kv_indptr[i+1]]`` of size ``page_size``, the last one holding ``kv_last_page_len[i]`` tokens; a
prefill request's query rows ``qo_indptr[i] : qo_indptr[i+1]`` see the columns its mask allows
(flat ``custom_mask``, the packed-bit form, or causal bottom-right), and a
:class:`WindowedPrefill` (``window_left = wl ≥ 0``, FlashInfer's own sliding window: a window
layer's causal prefill) only the columns ``c ≥ kv_len − q_len + j − wl`` of query row ``j``
(queries sit bottom-right: row ``j`` at column ``kv_len − q_len + j``); a cascade runs each level and merges them by log-sum-exp. It
never looks at how specmeta built the metadata, so a test that compares it with attention over
each branch's or node's logical sequence checks the metadata's meaning, not its bytes.
"""

from __future__ import annotations

import dataclasses

import torch

from specmeta.kernels.merge_state import merge_state_ref
from specmeta.metadata.flashinfer_results import FlashInferPrefill
from specmeta.testing.consumers.dense import dense_attention

__all__ = ["csr_slots", "decode", "prefill", "cascade", "WindowedPrefill", "windowed"]


@dataclasses.dataclass(frozen=True)
class WindowedPrefill(FlashInferPrefill):
    """A prefill the consumer plans with FlashInfer's own sliding window,
    ``plan(window_left=...)``: a hybrid model's window layer runs its causal prefill (draft
    extend) over the clipped list that way (design §2.10: the list starts where the first query
    row's window does, and ``window_left = w − 1`` hides from each later row what its window
    dropped)."""

    window_left: int = -1


def windowed(meta: FlashInferPrefill, window_left: int) -> WindowedPrefill:
    """``meta`` (the same views) to be planned with ``window_left``."""
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(FlashInferPrefill)}
    return WindowedPrefill(**fields, window_left=window_left)


def csr_slots(kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> list[torch.Tensor]:
    """Slot list of every CSR row: whole pages, then ``kv_last_page_len`` tokens of the last."""
    ptr = kv_indptr.cpu().long().tolist()
    idx = kv_indices.cpu().long()
    last = kv_last_page_len.cpu().long().tolist()
    out = []
    for i in range(len(ptr) - 1):
        pages = idx[ptr[i] : ptr[i + 1]]
        if pages.numel() == 0:
            out.append(torch.zeros(0, dtype=torch.int64))
            continue
        if not 1 <= last[i] <= page_size:
            raise AssertionError(f"row {i}: kv_last_page_len {last[i]} not in [1, {page_size}]")
        slots = (pages.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)
        out.append(slots[: (pages.numel() - 1) * page_size + last[i]])
    return out


def decode(q, k_cache, v_cache, step):
    """``BatchDecodeWithPagedKVCacheWrapper``: query row ``i`` (one token) over CSR row ``i``."""
    lists = csr_slots(step.kv_indptr, step.kv_indices, step.kv_last_page_len, step.page_size)
    return dense_attention(q, k_cache, v_cache, lists)


def _unpack(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` bits from byte ``start``, little-endian within each byte."""
    nbytes = -(-count // 8)
    byte = packed.cpu()[start : start + nbytes].to(torch.int64)
    bits = (byte.view(-1, 1) >> torch.arange(8)) & 1
    return bits.view(-1)[:count].bool()


def prefill(q, k_cache, v_cache, meta):
    """``BatchPrefillWithPagedKVCacheWrapper`` (page size 1 lists): every query row of request
    ``i`` sees the KV columns its mask allows."""
    qo = meta.qo_indptr.cpu().long().tolist()
    lists = csr_slots(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, meta.page_size)
    mask_ptr = meta.mask_indptr.cpu().long().tolist() if meta.mask_indptr is not None else None
    rows = []
    for i, kv in enumerate(lists):
        qlen, kvlen = qo[i + 1] - qo[i], kv.numel()
        if meta.custom_mask is not None:
            block = meta.custom_mask.cpu()[mask_ptr[i] : mask_ptr[i] + qlen * kvlen]
            allowed = block.view(qlen, kvlen)
        elif meta.packed_custom_mask is not None:
            allowed = _unpack(meta.packed_custom_mask, mask_ptr[i], qlen * kvlen).view(qlen, kvlen)
        else:
            if not meta.causal:
                raise AssertionError("a prefill without a mask must be causal")
            j = torch.arange(qlen).view(-1, 1)
            allowed = torch.arange(kvlen).view(1, -1) <= kvlen - qlen + j
        window_left = meta.window_left if isinstance(meta, WindowedPrefill) else -1
        if window_left >= 0:
            j = torch.arange(qlen).view(-1, 1)
            allowed = allowed & (torch.arange(kvlen).view(1, -1) >= kvlen - qlen + j - window_left)
        rows.extend(kv[allowed[j]] for j in range(qlen))
    return dense_attention(q, k_cache, v_cache, rows)


def cascade(q, k_cache, v_cache, step):
    """``MultiLevelCascadeAttentionWrapper``: every level's query groups over its CSR lists,
    the levels merged by log-sum-exp."""
    out = lse = None
    for qo_indptr, kv_indptr, kv_indices, last in zip(
        step.qo_indptr_arr, step.paged_kv_indptr_arr, step.paged_kv_indices_arr,
        step.paged_kv_last_page_len, strict=True,
    ):  # fmt: skip
        lists = csr_slots(kv_indptr, kv_indices, last, step.page_size)
        qo = qo_indptr.cpu().long().tolist()
        rows = [lists[i] for i in range(len(lists)) for _ in range(qo[i + 1] - qo[i])]
        o, s = dense_attention(q, k_cache, v_cache, rows)
        out, lse = (o, s) if out is None else merge_state_ref(out, lse, o, s)
    return out, lse
