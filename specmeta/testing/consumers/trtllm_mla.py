"""A torch reference consumer of TRT-LLM MLA's metadata, read the way its kernels read it.

Query sequence ``i`` reads tokens ``0 … seq_lens_k[i] − 1``; token ``q`` lives on page
``block_kv_indices[i, q // ps]`` at offset ``q % ps``. A page the sequence needs must not be −1
(the kernel would read out of bounds). Prefill (target verify, draft extend) gives request ``i``
the query rows ``cu_seqlens_q[i] : cu_seqlens_q[i+1]``, causal bottom-right. A ragged verify
(``seq_lens_q`` given) is read as an engine runs the dense kernel on it: request ``i``'s tokens
``cu_seqlens_q[i] + j`` (``j < seq_lens_q[i]``) are its dense rows ``j`` of ``max_seq_len_q``,
causal bottom-right over ``seq_lens_k[i]`` keys, and a token no request covers reads 0.
Attention over the resulting slots is the float64 dense oracle of
:mod:`specmeta.testing.consumers.dense`.

A tree's verify (:func:`tree_verify`, design §3.4) is MLA attention in two passes merged by
log-sum-exp: the prefix pass read as TRT-LLM's decode kernel reads it (one latent query token a
block-table row, values ``ckv``), whose rows with no keys the kernel leaves undefined (modelled
here as NaN outputs and an LSE that would outweigh any other: a merge that forgets
``mask_empty_prefix`` fails), and the ancestor pass through FlashInfer MLA's torch consumer.
"""

from __future__ import annotations

import torch

from specmeta.kernels.merge_state import merge_state_ref
from specmeta.testing.consumers import flashinfer_mla
from specmeta.testing.consumers.dense import dense_attention

__all__ = ["sequence_slots", "decode", "prefill", "prefix_pass", "tree_verify"]

# What the model of TRT-LLM's kernel leaves in a row with no keys: a stale LSE that would
# outweigh every real one (e^1000 against scores of order 1), and NaN outputs.
STALE_LSE = 1000.0


def sequence_slots(block_kv_indices, seq_lens_k, page_size: int) -> list[torch.Tensor]:
    """Slot list of every block-table row over its ``seq_lens_k`` tokens."""
    table = block_kv_indices.cpu().long()
    out = []
    for i, n in enumerate(seq_lens_k.cpu().long().tolist()):
        q = torch.arange(n)
        pages = table[i, q // page_size]
        if bool((pages < 0).any()):
            raise AssertionError(f"row {i}: a needed page is -1 (seq_lens_k={n})")
        out.append(pages * page_size + q % page_size)
    return out


def decode(q, k_cache, v_cache, step, page_size: int):
    """One query token per block-table row."""
    lists = sequence_slots(step.block_kv_indices, step.seq_lens_k, page_size)
    return dense_attention(q, k_cache, v_cache, lists)


def prefill(q, k_cache, v_cache, meta, page_size: int):
    """``cu_seqlens_q`` query rows a request, causal bottom-right over its ``seq_lens_k``; a
    ragged verify's through its dense rows."""
    cu = meta.cu_seqlens_q.cpu().long().tolist()
    widths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    if meta.seq_lens_q is not None:
        if widths != meta.seq_lens_q.cpu().long().tolist():
            raise AssertionError("cu_seqlens_q is not the exclusive sum of seq_lens_q")
        if cu[-1] > meta.sum_seq_lens_q:
            raise AssertionError("cu_seqlens_q covers more tokens than sum_seq_lens_q")
    elif cu[-1] != meta.sum_seq_lens_q:
        raise AssertionError("cu_seqlens_q disagrees with sum_seq_lens_q")
    if max(widths, default=0) > meta.max_seq_len_q:
        raise AssertionError("a request has more query rows than max_seq_len_q")
    dense = meta.max_seq_len_q if meta.seq_lens_q is not None else None
    rows = [[] for _ in range(meta.sum_seq_lens_q)]
    for i, kv in enumerate(sequence_slots(meta.block_kv_indices, meta.seq_lens_k, page_size)):
        qlen = cu[i + 1] - cu[i]
        width = qlen if dense is None else dense  # the kernel's rows of request i
        for j in range(qlen):
            rows[cu[i] + j] = kv[: kv.numel() - width + j + 1]
    return dense_attention(q, k_cache, v_cache, rows)


def prefix_pass(p, q_nope, q_pe, ckv, kpe, sm_scale: float, page_size: int):
    """TRT-LLM's decode kernel on a :class:`~specmeta.metadata.trtllm_mla.TrtllmMlaPrefixPass`:
    ``(out [T, H, Dc], lse [T, H])`` float64, natural-log LSE, row ``r`` over the first
    ``seq_lens_k[r]`` tokens of its block-table row; ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]``,
    ``ckv [P, Dc]``, ``kpe [P, Dr]`` by slot. A row with no keys gives NaN outputs and
    :data:`STALE_LSE`, as the kernel leaves it undefined."""
    table = p.block_kv_indices
    if table.dtype != torch.int32 or table.dim() != 2 or not table.is_contiguous():
        raise AssertionError(f"block_kv_indices: the kernel takes a contiguous [rows, maxblk] "
                             f"int32 table, got {table.dtype} {tuple(table.shape)}")  # fmt: skip
    if p.seq_lens_k.shape != (table.shape[0],) or p.seq_lens_k.dtype != torch.int32:
        raise AssertionError(f"seq_lens_k: one int32 length a table row, got "
                             f"{p.seq_lens_k.dtype} {tuple(p.seq_lens_k.shape)}")  # fmt: skip
    lens = p.seq_lens_k.cpu().long()
    if lens.numel() and int(lens.max()) > p.max_seq_len_k:
        raise AssertionError(f"seq_lens_k reaches {int(lens.max())}, past max_seq_len_k")
    rows = sequence_slots(table, p.seq_lens_k, page_size)
    if len(rows) != q_nope.shape[0]:
        raise AssertionError(f"{len(rows)} block-table rows, {q_nope.shape[0]} query rows")
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([ckv, kpe], dim=-1).unsqueeze(1)
    out, lse = dense_attention(q, k, ckv.unsqueeze(1), rows, softmax_scale=sm_scale)
    empty = (lens == 0).to(out.device)
    out[empty] = float("nan")
    lse[empty] = STALE_LSE
    return out, lse


def tree_verify(meta, q_nope, q_pe, ckv, kpe, sm_scale: float, page_size: int):
    """A :class:`~specmeta.metadata.trtllm_mla.TrtllmMlaTreeVerify`: the prefix pass
    (:func:`prefix_pass`), its empty rows masked by the result's own ``mask_empty_prefix``, and
    the ancestor pass (:func:`specmeta.testing.consumers.flashinfer_mla.run_pass`, after
    ``plan()``'s checks), merged by LSE: ``(out, lse)`` float64."""
    o_p, lse_p = prefix_pass(meta.prefix, q_nope, q_pe, ckv, kpe, sm_scale, page_size)
    device = meta.prefix.seq_lens_k.device
    lse_p = meta.mask_empty_prefix(lse_p.to(device)).to(lse_p.device)
    o_a, lse_a = flashinfer_mla.run_pass(meta.ancestors, q_nope, q_pe, ckv, kpe, sm_scale)
    return merge_state_ref(o_p, lse_p, o_a, lse_a)
