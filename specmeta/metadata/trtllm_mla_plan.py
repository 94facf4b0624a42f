"""The capacity plan of TRT-LLM MLA's builder (design §3.4, §5), keys
``trtllm_mla.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. Every table is int32, dense (addressed with 64-bit offsets, design §2.5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import trtllm_mla_max_blocks

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["plan_trtllm_mla"]


def plan_trtllm_mla(cfg: SpecConfig, add) -> None:
    """Add the ``trtllm_mla.*`` buffers of ``cfg`` through ``add(name, shape, dtype, doc)``. One
    block-table width serves every mode: branch rows cover ``L + S`` tokens, verify/extend rows
    ``L + N``."""
    k, s, n, ps, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.page_size, cfg.max_bs
    maxblk = trtllm_mla_max_blocks(cfg.max_context_len + max(s, n), ps)
    i32 = "int32"
    mode = "trtllm_mla.draft_decode"
    add(f"{mode}.block_kv_indices", (bs * k, maxblk), i32,
        "[B*K, maxblk] page ids of each branch row (per-branch tables; K == 1: the request's)")  # fmt: skip
    add(f"{mode}.seq_lens_k", (s, bs * k), i32, "[S, B*K] L_b + s + 1")
    for mode in ("trtllm_mla.target_verify", "trtllm_mla.draft_extend"):
        add(f"{mode}.block_kv_indices", (bs, maxblk), i32, "[B, maxblk] page ids, -1 beyond use")
        add(f"{mode}.seq_lens_k", (bs,), i32, "[B] L_b + N")
        add(f"{mode}.cu_seqlens_q", (bs + 1,), i32, "[B+1] N·arange (design §3.1)")
    # A ragged verify (design §2.9) in the dense query layout: lengths padded and capped at N.
    add("trtllm_mla.target_verify.verify_lens", (bs,), i32, "[Bp] ragged lengths, padded, ≤ N")
    add("trtllm_mla.target_verify.ragged_qo_indptr", (bs + 1,), i32, "[Bp+1] exclusive sum")
