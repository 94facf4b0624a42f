"""SpecConfig validation and the capacity plan (design §5)."""

from __future__ import annotations

import math

import pytest
import torch

from specmeta import SpecConfig, plan_buffers
from specmeta.config import ROW_ALIGN, draft_row_need


def test_rejects_invalid_values():
    with pytest.raises(ValueError, match="topk must be >= 1"):
        SpecConfig(topk=0, num_steps=3, num_draft_tokens=4)
    with pytest.raises(TypeError, match="num_steps must be an int"):
        SpecConfig(topk=1, num_steps=2.0, num_draft_tokens=3)
    # N − 1 ≤ K + (S−1)·K²: K=2, S=2 allows N ≤ 7.
    SpecConfig(topk=2, num_steps=2, num_draft_tokens=7)
    with pytest.raises(ValueError, match="num_draft_tokens=8 is too large"):
        SpecConfig(topk=2, num_steps=2, num_draft_tokens=8)
    with pytest.raises(ValueError, match="req_to_token_width=100 is too small"):
        SpecConfig(
            topk=4, num_steps=3, num_draft_tokens=8, max_context_len=100, req_to_token_width=100
        )
    with pytest.raises(ValueError, match="pool_size"):
        SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=16, pool_size=100)


@pytest.mark.parametrize("k,s,n,ps", [(1, 3, 4, 1), (4, 3, 8, 1), (8, 5, 32, 16), (2, 2, 4, 64)])
def test_row_width_covers_every_prefix(k, s, n, ps):
    cfg = SpecConfig(
        topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=4, max_context_len=300
    )
    for length in range(0, 301):
        assert draft_row_need(length, k, s, ps) <= cfg.req_to_token_width
        assert length + n <= cfg.req_to_token_width


def test_draft_row_need_by_hand():
    """The row positions of design §1, worked out by hand: layout A needs ``L + K·S``;
    layout B ``base + K·nnp·ps`` with ``nnp = ceil((lpl + S) / ps)``."""
    assert draft_row_need(10, 4, 3, 1) == 10 + 4 * 3  # layout A (ps = 1)
    assert draft_row_need(10, 1, 3, 16) == 10 + 3  # layout A (K = 1)
    # L = 30, ps = 16: base 16, lpl 14, nnp = ceil(17 / 16) = 2 pages a branch, 4 branches.
    assert draft_row_need(30, 4, 3, 16) == 16 + 4 * 2 * 16
    # L = 32, ps = 16: base 32, lpl 0, nnp = 1.
    assert draft_row_need(32, 4, 3, 16) == 32 + 4 * 1 * 16
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=6, page_size=4, max_bs=4,
                     max_context_len=32)  # fmt: skip
    assert cfg.row_width_need == 44  # L = 30: base 28 + 2 branches · 2 pages · 4


def test_draft_kv_indices_carry_the_topk_factor():
    """Seed 002: the graph path sized the draft kv_indices without K."""
    cfg = SpecConfig(topk=8, num_steps=5, num_draft_tokens=16, max_bs=256, max_context_len=32768)
    spec = plan_buffers(cfg)["draft_decode.kv_indices"]
    assert spec.shape == (5, 256 * 8 * 32768 + 256 * 8 * 5)
    assert spec.dtype == torch.int32
    assert plan_buffers(cfg)["draft_decode.kv_indptr"].shape == (5, 256 * 8 + 1)
    assert plan_buffers(cfg)["draft.out_cache_loc"].shape == (256 * 8 * 5,)


def test_prefix_tail_pairs_only_in_layout_b():
    a = plan_buffers(SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=1))
    b = plan_buffers(SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=2))
    assert a["draft.prefix_tail_tgt"].shape == (0,)
    assert b["draft.prefix_tail_tgt"].shape == (2 * 3 * 15,)


@pytest.mark.parametrize("ps", [1, 3, 16, 64])
def test_default_row_width_is_whole_pages_and_lines(ps):
    cfg = SpecConfig(topk=1, num_steps=5, num_draft_tokens=6, page_size=ps, max_context_len=1000)
    assert cfg.req_to_token_width % ps == 0
    assert cfg.req_to_token_width % ROW_ALIGN == 0, "int32 rows start 16-byte aligned"
    assert cfg.req_to_token_width >= 1000 + 6
    unit = ps * ROW_ALIGN // math.gcd(ps, ROW_ALIGN)
    assert cfg.req_to_token_width - unit < cfg.row_width_need, "the smallest such width"
