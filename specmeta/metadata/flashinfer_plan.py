"""The capacity plan of FlashInfer's builder (design §3.3, §5), keys
``flashinfer.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. ``*_host`` buffers are the CPU mirrors ``plan()`` reads (pinned when the
builder's device is CUDA); every list is int32, as FlashInfer's wrappers want.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import (
    branch_kv_indices_need,
    draft_decode_kv_indices_need,
    shared_prefix_chain_need,
    tree_custom_mask_need,
    verify_kv_indices_need,
)

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["plan_flashinfer", "plan_cascade_rows_and_chains"]


def plan_flashinfer(cfg: SpecConfig, add) -> None:
    """Add the ``flashinfer.*`` buffers of ``cfg`` through ``add(name, shape, dtype, doc)``: the
    per-branch, cascade and paged draft-decode lists, the verify and extend lists, both verify
    mask forms and a ragged verify's lengths."""
    k, s, n, ps, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.page_size, cfg.max_bs
    total = bs * cfg.max_context_len  # ΣL at full capacity
    i32 = "int32"
    # Per-branch token lists: every step row holds K copies of every prefix (design §2.2), or
    # of its draft window (design §2.10).
    mode = "flashinfer.draft_decode"
    need = draft_decode_kv_indices_need(bs * cfg.draft_prefix_cap, bs, k, s)
    add(f"{mode}.kv_indices", (s, need), i32,
        "[S, K*ΣLw + B*K*S] per-branch KV slot lists, one row per draft step")  # fmt: skip
    add(f"{mode}.kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] CSR offsets")
    add(f"{mode}.kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror of kv_indptr")
    add(f"{mode}.kv_last_page_len", (bs * k,), i32, "[B*K] ones (page size 1)")
    add(f"{mode}.kv_last_page_len_host", (bs * k,), i32, "[B*K] CPU mirror (ones)")
    # Cascade (shared-prefix) draft decode: each prefix once, each branch's chain per step.
    mode = "flashinfer.draft_decode_shared"
    add(f"{mode}.prefix_kv_indices", (verify_kv_indices_need(total, bs, 0),), i32,
        "[ΣL] every prefix once, shared by the request's K branches")  # fmt: skip
    add(f"{mode}.prefix_kv_indptr", (bs + 1,), i32, "[B+1] prefix-level CSR offsets")
    add(f"{mode}.prefix_kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    plan_cascade_rows_and_chains(mode, bs, k, s, add)
    # Per-branch page lists for page size > 1 (prefix-tail copies in place first).
    mode = "flashinfer.draft_decode_paged"
    add(f"{mode}.kv_indices", (s, branch_kv_indices_need(total, bs, k, s, ps)), i32,
        "[S, K*(ΣL + B*S)/ps + B*K] per-branch page lists, one row per draft step")  # fmt: skip
    add(f"{mode}.kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] CSR offsets, in pages")
    add(f"{mode}.kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror")
    add(f"{mode}.kv_last_page_len", (s, bs * k), i32, "[S, B*K] tokens on each last page")
    add(f"{mode}.kv_last_page_len_host", (s, bs * k), i32, "[S, B*K] CPU mirror")
    # Target verify and draft extend: uniform query stride N, row_b[0 : L_b + N].
    for mode in ("flashinfer.target_verify", "flashinfer.draft_extend"):
        add(f"{mode}.qo_indptr", (bs + 1,), i32, "[B+1] N·arange (design §3.1)")
        add(f"{mode}.qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(L + N)]")
        add(f"{mode}.kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indices", (verify_kv_indices_need(total, bs, n),), i32,
            "[ΣL + B*N] row_b[0 : L_b + N]")  # fmt: skip
        add(f"{mode}.kv_last_page_len", (bs,), i32, "[B] ones (page size 1)")
        add(f"{mode}.kv_last_page_len_host", (bs,), i32, "[B] CPU mirror (ones)")
    mode = "flashinfer.target_verify"
    add(f"{mode}.custom_mask", (tree_custom_mask_need(total, bs, n),), "bool",
        "[N*ΣL + B*N²] flat bool mask, request i an N × (L_i + N) block")  # fmt: skip
    add(f"{mode}.mask_indptr", (bs + 1,), i32, "[B+1] mask segment starts (elements)")
    add(f"{mode}.mask_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    add(f"{mode}.packed_custom_mask", (tree_custom_mask_need(total, bs, n, packed=True),),
        "uint8", "packed-bit mask, little-endian, segment i at byte mask_indptr[i]")  # fmt: skip
    add(f"{mode}.packed_mask_indptr", (bs + 1,), i32, "[B+1] packed segment starts (bytes)")
    add(f"{mode}.packed_mask_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    # Ragged verify (design §2.9): the lengths padded to the bucket and their offsets.
    add(f"{mode}.verify_lens", (bs,), i32, "[Bp] verify lengths padded to the bucket")
    add(f"{mode}.verify_lens_host", (bs,), i32, "[Bp] CPU mirror")
    add(f"{mode}.ragged_qo_indptr", (bs + 1,), i32, "[Bp+1] exclusive sum of verify_lens")
    add(f"{mode}.ragged_qo_indptr_host", (bs + 1,), i32, "[Bp+1] CPU mirror")


def plan_cascade_rows_and_chains(mode: str, bs: int, k: int, s: int, add) -> None:
    """The shared-prefix cascade's buffers past its prefix level's lists (design §3.3; a window
    layer's cascade has the same, design §2.10): the prefix level's query rows (``K`` a
    request), each branch's own draft slots a step (the chain level) and the ones of page
    size 1 that both levels read."""
    i32 = "int32"
    add(f"{mode}.prefix_qo_indptr", (bs + 1,), i32, "[B+1] K·arange: K query rows a request")
    add(f"{mode}.prefix_qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    add(f"{mode}.chain_kv_indices", (s, shared_prefix_chain_need(bs, k, s)), i32,
        "[S, B*K*S] each branch's own draft slots, one row per step")  # fmt: skip
    add(f"{mode}.chain_kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] chain-level CSR offsets")
    add(f"{mode}.chain_kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror")
    add(f"{mode}.chain_qo_indptr", (bs * k + 1,), i32, "[B*K+1] arange: one query row a branch")
    add(f"{mode}.chain_qo_indptr_host", (bs * k + 1,), i32, "[B*K+1] CPU mirror")
    add(f"{mode}.kv_last_page_len", (bs * k,), i32, "[B*K] ones (page size 1), both levels")
    add(f"{mode}.kv_last_page_len_host", (bs * k,), i32, "[B*K] CPU mirror (ones)")
