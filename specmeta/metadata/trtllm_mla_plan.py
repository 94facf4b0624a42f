"""The capacity plan of TRT-LLM MLA's builder (design §3.4, §5), keys
``trtllm_mla.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. Every table is int32, dense (addressed with 64-bit offsets, design §2.5).

A tree's target verify (``topk > 1``) is a cascade of two passes over the same ``B·N`` query
rows, one a tree node: the **prefix pass** in TRT-LLM's MLA kernel (each node's row of block
table over its request's prefix, ``seq_lens_k = L``) and the **ancestor pass** in FlashInfer
MLA's (one list of token slots a node, its ancestors' and its own window slots). The chain
verify's ``[B, maxblk]`` table and ``[B]`` lengths hold each request's prefix table once, which
a copy repeats into the prefix pass's ``N`` rows a request (:func:`plan_trtllm_mla_tree_verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import trtllm_mla_max_blocks
from .flashinfer_mla_plan import plan_ancestor_pass

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..config import SpecConfig

__all__ = ["plan_trtllm_mla", "plan_trtllm_mla_tree_verify"]


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
    plan_trtllm_mla_tree_verify(cfg, add)  # a tree's verify: the cascade's two passes


def plan_trtllm_mla_tree_verify(cfg: SpecConfig, add: Callable[..., None]) -> None:
    """``trtllm_mla.target_verify.*`` keys of a tree (``topk > 1``; nothing for a chain).

    The block tables keep the one width of every TRT-LLM mode (design §3.4); the ancestor
    pass's buffers are FlashInfer MLA's tree verify's (:func:`.flashinfer_mla_plan.
    plan_ancestor_pass`: ``B·N·N`` list entries, any ``[B, N, N]`` mask's worst case, and the
    ancestor counts' host slot of a header of 8 and ``B·N`` counts, design §3.5).
    """
    if cfg.topk == 1:
        return
    s, n, ps, bs = cfg.num_steps, cfg.num_draft_tokens, cfg.page_size, cfg.max_bs
    maxblk = trtllm_mla_max_blocks(cfg.max_context_len + max(s, n), ps)
    bn, i32, mode = bs * n, "int32", "trtllm_mla.target_verify"
    # The chain verify's table and lengths, planned above, hold each request's prefix once in
    # a tree's verify: their meaning is rewritten here (the same shapes).
    add(f"{mode}.block_kv_indices", (bs, maxblk), i32,
        "[B, maxblk] a tree: each request's prefix pages over L, -1 beyond (repeated N times)")  # fmt: skip
    add(f"{mode}.seq_lens_k", (bs,), i32, "[B] a tree: L_b (repeated N times)")
    add(f"{mode}.prefix_block_kv_indices", (bn, maxblk), i32,
        "[B*N, maxblk] the prefix pass: request b's prefix pages in rows b*N … b*N + N-1")  # fmt: skip
    add(f"{mode}.prefix_seq_lens_k", (bn,), i32, "[B*N] L_b, one row a tree node")
    plan_ancestor_pass(mode, bs, n, add)  # FlashInfer MLA's pass, the same buffers
