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
"""

from __future__ import annotations

import torch

from specmeta.testing.consumers.dense import dense_attention

__all__ = ["sequence_slots", "decode", "prefill"]


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
