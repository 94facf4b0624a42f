"""A torch model of what FlashAttention-3's ``flash_attn_with_kvcache`` computes from its
metadata, used to prove that specmeta's FA3 metadata means what design §3.2 says.

:func:`flash_attn_with_kvcache` takes the keyword names of the real function (so a builder's
``meta.kwargs()`` is splatted into it unchanged) and defines the semantics the way FA3 does:

* sequence ``b`` has the query rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and the keys
  ``0 … cache_seqlens[b] − 1``; key ``k`` is row ``k % ps`` of page ``page_table[b, k // ps]``;
* ``causal`` aligns the mask bottom-right: query ``i`` of ``n_q`` sees keys
  ``k ≤ cache_seqlens[b] − n_q + i``;
* with ``return_softmax_lse`` it also returns the log-sum-exp, ``[H, total_q]`` as FA3's varlen
  path does.

It is stricter than FA3 where strictness proves a property of the metadata: it rejects a page
id outside the cache, a page-table column past the table's width, more query rows than
``max_seqlen_q``, non-int32 metadata, and a ``cu_seqlens_k_new`` that is not
``[0, cumsum(cache_seqlens)]``. The arithmetic is the float64 oracle of
:mod:`specmeta.testing.consumers.dense`; :func:`run_cascade` merges the two passes of a cascade by LSE.
"""

from __future__ import annotations

import torch

from specmeta.kernels.merge_state import merge_state_ref
from specmeta.testing.consumers.dense import dense_attention

__all__ = ["flash_attn_with_kvcache", "attend", "run_cascade"]


def _require(ok: object, message: str) -> None:
    """Reject metadata that breaks FA3's contract (an explicit raise: it holds under ``-O``)."""
    if not ok:
        raise AssertionError(message)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_k_new: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
):
    """FA3 semantics over a paged cache ``[num_pages, ps, H_kv, D]``; float64 results.

    Returns ``out [total_q, H, D_v]``, or ``(out, lse [H, total_q])`` with
    ``return_softmax_lse``.
    """
    num_pages, ps, h_kv, _ = k_cache.shape
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table),
                    ("cu_seqlens_q", cu_seqlens_q)):  # fmt: skip
        _require(t.dtype == torch.int32, f"FA3 needs int32 {name}, got {t.dtype}")
    batch = cu_seqlens_q.numel() - 1
    cu_q = cu_seqlens_q.cpu().long()
    lens = cache_seqlens.cpu().long()
    table = page_table.cpu().long()
    _require(lens.numel() >= batch and table.shape[0] >= batch, "metadata shorter than the batch")
    _require(int(cu_q[0]) == 0 and int(cu_q[-1]) == q.shape[0], "cu_seqlens_q must cover q")
    if cu_seqlens_k_new is not None:
        want = torch.cat([torch.zeros(1, dtype=torch.long), lens[:batch].cumsum(0)])
        got = cu_seqlens_k_new.cpu().long()
        if not torch.equal(got, want):
            raise AssertionError(f"cu_seqlens_k_new {got.tolist()} != {want.tolist()}")
    rows: list[torch.Tensor] = []
    for b in range(batch):
        n_q, n_k = int(cu_q[b + 1] - cu_q[b]), int(lens[b])
        _require(0 <= n_q <= max_seqlen_q, f"sequence {b}: {n_q} query rows > {max_seqlen_q}")
        n_pages = -(-n_k // ps)
        _require(n_pages <= table.shape[1], f"sequence {b} reads past its page-table row")
        pages = table[b, :n_pages]
        _require(((pages >= 0) & (pages < num_pages)).all(), f"sequence {b}: page id out of cache")
        k = torch.arange(n_k)
        slots = pages[k // ps] * ps + k % ps  # rows of the flattened [num_pages·ps] cache
        for i in range(n_q):
            rows.append(slots[: n_k - n_q + i + 1] if causal else slots)
    flat_k = k_cache.reshape(num_pages * ps, h_kv, -1)
    flat_v = v_cache.reshape(num_pages * ps, h_kv, -1)
    out, lse = dense_attention(q, flat_k, flat_v, rows, softmax_scale=softmax_scale)
    return (out, lse.t()) if return_softmax_lse else out


def attend(q, k_pool, v_pool, meta, softmax_scale=None):
    """One ``flash_attn_with_kvcache`` call on a KV pool ``[P, H_kv, D]`` viewed with the
    metadata's page size. Returns ``(out, lse [total_q, H])``."""
    ps = meta.page_size
    k_cache = k_pool.view(-1, ps, *k_pool.shape[1:])
    v_cache = v_pool.view(-1, ps, *v_pool.shape[1:])
    kwargs = dict(meta.kwargs(), return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, softmax_scale=softmax_scale)
    return out, lse.t()


def run_cascade(q, k_pool, v_pool, cascade, softmax_scale=None) -> torch.Tensor:
    """The attention of a mode: the normal pass, merged by LSE with the expand pass if any.
    Both passes read the same query rows (one per branch or tree node)."""
    out, lse = attend(q, k_pool, v_pool, cascade.normal, softmax_scale)
    if cascade.expand is None:
        return out
    out_e, lse_e = attend(q, k_pool, v_pool, cascade.expand, softmax_scale)
    return merge_state_ref(out, lse, out_e, lse_e)[0]
