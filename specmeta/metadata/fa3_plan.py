"""The capacity plan of FlashAttention-3's builder (design §2.3, §3.2, §5), keys
``fa3.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. One set per mode, so the metadata of every mode can live at once (e.g.
captured in different graphs); int32, as ``flash_attn_with_kvcache`` wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import expand_page_table_width, page_table_width

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["plan_fa3"]


def plan_fa3(cfg: SpecConfig, add) -> None:
    """Add the ``fa3.*`` buffers of ``cfg`` through ``add(name, shape, dtype, doc)``: a page table
    over a whole row per mode, the cascade's expand tables (``K > 1``; target verify's for a
    ragged verify too) and a ragged verify's lengths."""
    k, s, ps, bs = cfg.topk, cfg.num_steps, cfg.page_size, cfg.max_bs
    # Draft decode's cascade ("expand_*") buffers exist only for K > 1.
    i32, n_draft = "int32", cfg.num_draft_tokens
    pages = page_table_width(cfg.req_to_token_width, ps)
    dd_rows = s if k == 1 else 1  # K == 1: one length row per step; K > 1: the shared prefix
    add("fa3.draft_decode.page_table", (bs, pages), i32, "[B, W] row pages (K == 1: every step)")
    add("fa3.draft_decode.cache_seqlens", (dd_rows, bs), i32, "[S or 1, B] KV lengths")
    add("fa3.draft_decode.cu_seqlens_k", (dd_rows, bs + 1), i32, "[S or 1, B+1] Σ cache_seqlens")
    add("fa3.draft_decode.cu_seqlens_q", (bs + 1,), i32, "[B+1] K·arange(B+1)")
    if k > 1:
        ew = expand_page_table_width(s)
        add("fa3.draft_decode.expand_page_table", (s, bs * k, ew), i32, "[S, B*K, S] branch pages")
        add("fa3.draft_decode.expand_cache_seqlens", (s, bs * k), i32, "[S, B*K] lpl + s + 1")
        add("fa3.draft_decode.expand_cu_seqlens_k", (s, bs * k + 1), i32, "[S, B*K+1] Σ lengths")
        add("fa3.draft_decode.expand_cu_seqlens_q", (bs * k + 1,), i32, "[B*K+1] arange(B*K+1)")
    for mode in ("target_verify", "draft_extend"):
        add(
            f"fa3.{mode}.page_table",
            (bs, pages),
            i32,
            "[B, W] row pages over L + N (verify K > 1: L)",
        )
        add(f"fa3.{mode}.cache_seqlens", (bs,), i32, "[B] KV lengths")
        add(f"fa3.{mode}.cu_seqlens_k", (bs + 1,), i32, "[B+1] Σ cache_seqlens")
        add(f"fa3.{mode}.cu_seqlens_q", (bs + 1,), i32, "[B+1] N·arange(B+1)")
    # The verify cascade's expand pass: K > 1, and a ragged verify for every K (design §2.9),
    # one row a node or, ragged, a query token (T ≤ B·N).
    bn = bs * n_draft
    add("fa3.target_verify.expand_page_table", (bn, n_draft), i32, "[B*N, N] ancestor slots")
    add("fa3.target_verify.expand_cache_seqlens", (bn,), i32, "[B*N] ancestors per node")
    add("fa3.target_verify.expand_cu_seqlens_k", (bn + 1,), i32, "[B*N+1] Σ lengths")
    add("fa3.target_verify.expand_cu_seqlens_q", (bn + 1,), i32, "[B*N+1] arange(B*N+1)")
    add("fa3.target_verify.verify_lens", (bs,), i32, "[Bp] ragged verify lengths, padded")
    add("fa3.target_verify.ragged_qo_indptr", (bs + 1,), i32, "[Bp+1] exclusive sum of them")
