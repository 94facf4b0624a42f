"""The reference consumers themselves: the dense oracle against torch's
scaled_dot_product_attention row by row, the log-sum-exp merge against attention over the union
of the two key sets, and the FA3 model against explicit slot lists."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specmeta.kernels.merge_state import merge_state_ref
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import flash_attn_with_kvcache as fa3_model


def _draw(gen, device, T=6, H=4, H_kv=2, D=8, P=40):
    q = torch.randn(T, H, D, generator=gen).to(device)
    k = torch.randn(P, H_kv, D, generator=gen).to(device)
    v = torch.randn(P, H_kv, D + 2, generator=gen).to(device)
    lists = [torch.randperm(P, generator=gen)[: 1 + i * 3].to(device) for i in range(T)]
    return q, k, v, lists


@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_matches_sdpa_row_by_row(device, gen, h_kv):
    q, k, v, lists = _draw(gen, device, H_kv=h_kv)
    out, lse = dense_attention(q, k, v, lists, softmax_scale=0.3)
    group = q.shape[1] // h_kv
    for i, slots in enumerate(lists):
        kk = k[slots].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, n, D]
        vv = v[slots].double().repeat_interleave(group, 1).transpose(0, 1)
        qq = q[i].double().unsqueeze(1)  # [H, 1, D]
        want = F.scaled_dot_product_attention(qq, kk, vv, scale=0.3).squeeze(1)
        torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        scores = (qq @ kk.transpose(1, 2)).squeeze(1) * 0.3
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_default_scale_and_empty_rows(device, gen):
    q, k, v, lists = _draw(gen, device, T=2)
    out, lse = dense_attention(q, k, v, [lists[0], []])
    ref, _ = dense_attention(q, k, v, [lists[0], []], softmax_scale=1 / math.sqrt(q.shape[-1]))
    assert torch.equal(out, ref)
    assert not out[1].any() and torch.isneginf(lse[1]).all()
    with pytest.raises(ValueError, match="outside"):
        dense_attention(q, k, v, [[0], [k.shape[0]]])


def test_merge_of_disjoint_passes_is_attention_over_their_union(device, gen):
    q, k, v, lists = _draw(gen, device)
    first = [s[: len(s) // 2] for s in lists]  # row 0 has one slot: its first pass is empty
    second = [s[len(s) // 2 :] for s in lists]
    o1, l1 = dense_attention(q, k, v, first)
    o2, l2 = dense_attention(q, k, v, second)
    o, lse = merge_state_ref(o1, l1, o2, l2)
    want, want_lse = dense_attention(q, k, v, lists)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    empty = torch.full_like(l1, float("-inf"))
    o, lse = merge_state_ref(o1, empty, torch.zeros_like(o2), empty)
    assert not o.any() and torch.isneginf(lse).all()


def test_fa3_model_reads_pages_and_aligns_causal_bottom_right(device, gen):
    """The FA3 model against explicit slot lists: pages of 2 tokens in a shuffled order, two
    query rows over five keys (FA3's own example: row 0 sees keys 0–3, row 1 all five)."""
    ps, h_kv = 2, 1
    k_pool = torch.randn(12, h_kv, 4, generator=gen, dtype=torch.float64).to(device)
    v_pool = torch.randn(12, h_kv, 4, generator=gen, dtype=torch.float64).to(device)
    q = torch.randn(2, 2, 4, generator=gen, dtype=torch.float64).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=torch.tensor([5], **i32), page_table=torch.tensor([[4, 1, 3, 0]], **i32),
              cu_seqlens_q=torch.tensor([0, 2], **i32), max_seqlen_q=2,
              cu_seqlens_k_new=torch.tensor([0, 5], **i32))  # fmt: skip
    kc, vc = k_pool.view(6, ps, h_kv, 4), v_pool.view(6, ps, h_kv, 4)
    keys = [8, 9, 2, 3, 6]  # key k is row k % 2 of page page_table[k // 2]
    out = fa3_model(q, kc, vc, causal=True, **kw)
    want, _ = dense_attention(q, k_pool, v_pool, [keys[:4], keys])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out, lse = fa3_model(q, kc, vc, causal=False, return_softmax_lse=True, **kw)
    want, want_lse = dense_attention(q, k_pool, v_pool, [keys, keys])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.t(), rtol=1e-12, atol=1e-12)


def test_fa3_model_rejects_what_fa3_would_misread(device):
    i32 = dict(dtype=torch.int32, device=device)
    pool = torch.zeros(3, 2, 1, 4, dtype=torch.float64, device=device)
    q = torch.zeros(1, 1, 4, dtype=torch.float64, device=device)
    base = dict(cache_seqlens=torch.tensor([3], **i32), page_table=torch.tensor([[1, 2]], **i32),
                cu_seqlens_q=torch.tensor([0, 1], **i32), max_seqlen_q=1)  # fmt: skip
    fa3_model(q, pool, pool, **base)
    bad = [
        dict(cu_seqlens_k_new=torch.tensor([0, 2], **i32)),  # inconsistent with cache_seqlens
        dict(cache_seqlens=torch.tensor([5], **i32)),  # reads past the table's two columns
        dict(page_table=torch.tensor([[1, 3]], **i32)),  # page 3 is outside the cache
        dict(max_seqlen_q=0),
        dict(page_table=torch.tensor([[1, 2]], dtype=torch.int64, device=device)),
    ]
    for change in bad:
        with pytest.raises(AssertionError):
            fa3_model(q, pool, pool, **{**base, **change})
