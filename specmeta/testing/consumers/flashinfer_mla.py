"""A torch reference consumer of FlashInfer MLA's metadata, read the way
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` reads it (design §3.5).

``plan()`` takes ``qo_indptr``, ``kv_indptr``, ``kv_len_arr`` (read on the host) and
``kv_indices`` (the page ids, copied to the device), a page size and ``causal``; it refuses
lists that are not int32, 1-D and contiguous, offsets that do not start at 0 or decrease, batch
dimensions that disagree, ``kv_indptr[-1]`` past ``kv_indices``, a negative length, and any
list whose page count is not ``ceil(kv_len / page_size)``: :func:`pass_slots` makes the same
checks, then turns each list into its KV slots (``page·page_size + offset``, the first
``kv_len`` tokens). ``run()`` then gives query row ``r`` of request ``i`` the attention of its
latent query (``q_nope`` over ``ckv``, ``q_pe`` over ``kpe``, one scale) over those slots, values
``ckv`` (all heads share the one latent KV head); with ``causal`` the rows are aligned with the
last keys (bottom-right). :func:`attention` runs every pass of a result and merges them by
log-sum-exp. Everything is float64, through the dense oracle
(:mod:`specmeta.testing.consumers.dense`); it never looks at how specmeta built the lists.
"""

from __future__ import annotations

import torch

from specmeta.kernels.merge_state import merge_state_ref
from specmeta.testing.consumers.dense import dense_attention

__all__ = ["pass_slots", "run_pass", "attention"]


def _check_list(name: str, t: torch.Tensor, host: bool) -> None:
    if t.dtype != torch.int32 or t.ndim != 1 or not t.is_contiguous():
        raise AssertionError(f"{name}: plan() takes a contiguous 1-D int32 tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    if host and t.device.type != "cpu":
        raise AssertionError(f"{name}: plan() reads it on the host; a device tensor is a sync")


def pass_slots(p) -> tuple[list[int], list[torch.Tensor]]:
    """``(q_lens, slots)`` of a :class:`~specmeta.metadata.flashinfer_mla.FlashInferMLAPass`:
    each request's query rows and KV slots, after ``plan()``'s own checks."""
    for name, host in (("qo_indptr_host", True), ("kv_indptr_host", True),
                       ("kv_len_arr_host", True), ("kv_indices", False)):  # fmt: skip
        _check_list(name, getattr(p, name), host)
    qo = p.qo_indptr_host.long().tolist()
    ptr = p.kv_indptr_host.long().tolist()
    lens = p.kv_len_arr_host.long().tolist()
    if not (len(qo) == len(ptr) == len(lens) + 1):
        raise AssertionError(f"batch dimensions disagree: {len(qo)}, {len(ptr)}, {len(lens)}")
    for name, off in (("qo_indptr", qo), ("kv_indptr", ptr)):
        if off[0] != 0 or any(b < a for a, b in zip(off[:-1], off[1:], strict=True)):
            raise AssertionError(f"{name} must start at 0 and not decrease: {off}")
    if ptr[-1] > p.kv_indices.numel():
        raise AssertionError(f"kv_indptr[-1] = {ptr[-1]} past kv_indices' {p.kv_indices.numel()}")
    ps, idx = p.page_size, p.kv_indices.cpu().long()
    slots = []
    for i, n in enumerate(lens):
        if n < 0 or ptr[i + 1] - ptr[i] != -(-n // ps):
            raise AssertionError(f"list {i}: {ptr[i + 1] - ptr[i]} pages for kv_len {n}, "
                                 f"page size {ps}")  # fmt: skip
        pages = idx[ptr[i] : ptr[i + 1]]
        slots.append((pages.view(-1, 1) * ps + torch.arange(ps)).view(-1)[:n])
    return [qo[i + 1] - qo[i] for i in range(len(lens))], slots


def run_pass(p, q_nope, q_pe, ckv, kpe, sm_scale: float):
    """``run()`` of one pass: ``(out [T, H, 512], lse [T, H])`` float64, natural-log LSE
    (``return_lse_base_on_e=True``; ``−inf`` for a row with no keys). ``q_nope [T, H, Dc]``,
    ``q_pe [T, H, Dr]``; ``ckv [P, Dc]``, ``kpe [P, Dr]`` by slot (the cache in pages of 1)."""
    q_lens, slots = pass_slots(p)
    rows = []
    for q_len, kv in zip(q_lens, slots, strict=True):
        for j in range(q_len):
            # causal: row j sees keys up to kv_len − q_len + j (bottom-right alignment)
            rows.append(kv[: max(0, kv.numel() - q_len + j + 1)] if p.causal else kv)
    if len(rows) != q_nope.shape[0]:
        raise AssertionError(f"{len(rows)} query rows planned, {q_nope.shape[0]} given")
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([ckv, kpe], dim=-1).unsqueeze(1)
    return dense_attention(q, k, ckv.unsqueeze(1), rows, softmax_scale=sm_scale)


def attention(result, q_nope, q_pe, ckv, kpe, sm_scale: float):
    """Every pass of a :class:`~specmeta.metadata.flashinfer_mla.FlashInferMLAAttention` on
    the same query rows, merged by log-sum-exp (``merge_state``)."""
    out = lse = None
    for p in result.passes:
        o, s = run_pass(p, q_nope, q_pe, ckv, kpe, sm_scale)
        out, lse = (o, s) if out is None else merge_state_ref(out, lse, o, s)
    return out, lse
