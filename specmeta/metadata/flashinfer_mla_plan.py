"""The capacity plan of FlashInfer MLA's builder (design §3.5, §5), keys
``flashinfer_mla.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. ``*_host`` buffers are the CPU mirrors ``plan()`` reads (pinned when the
builder's device is CUDA); every list is int32, as ``BatchMLAPagedAttentionWrapper`` wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["plan_flashinfer_mla", "plan_ancestor_pass"]


def plan_flashinfer_mla(cfg: SpecConfig, add) -> None:
    """Add the ``flashinfer_mla.*`` buffers of ``cfg`` through ``add(name, shape, dtype, doc)``.

    Draft decode with ``K == 1`` lists each request's prefix and chain as pages of the pool's
    page size (one row per step); with ``K > 1`` it is a cascade: the prefix pass lists each
    prefix once (``ΣL`` token slots, ``K`` query rows a request) and the ancestor pass each
    branch's own chain (``B·K·S`` slots a step row: the ``topk`` factor is here). Draft extend,
    and target verify of a chain, list ``row_b[0 : L_b + N]`` as token slots, ``N`` causal rows
    a request; target verify of a tree is a cascade too: each prefix once, then each node's
    window slots (``B·N·N``).
    """
    from ..config import branch_kv_indices_need, shared_prefix_chain_need, verify_kv_indices_need

    k, s, n, ps, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.page_size, cfg.max_bs
    total = bs * cfg.max_context_len  # ΣL at full capacity
    i32 = "int32"
    mode = "flashinfer_mla.draft_decode"
    if k == 1:
        add(f"{mode}.kv_indices", (s, branch_kv_indices_need(total, bs, 1, s, ps)), i32,
            "[S, (ΣL + B*S)/ps + B] each request's pages over L + s + 1 tokens, per step")  # fmt: skip
        add(f"{mode}.kv_indptr", (s, bs + 1), i32, "[S, B+1] CSR offsets, in pages")
        add(f"{mode}.kv_last_page_len", (s, bs), i32, "[S, B] tokens on each last page")
        add(f"{mode}.qo_indptr", (bs + 1,), i32, "[B+1] arange: one query row a request")
        add(f"{mode}.qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indptr_host", (s, bs + 1), i32, "[S, B+1] CPU mirror, in pages")
        add(f"{mode}.kv_len_arr_host", (s, bs), i32, "[S, B] L + s + 1 tokens, CPU")
        add(f"{mode}.kv_last_page_len_host", (s, bs), i32, "[S, B] CPU mirror")
    else:
        add(f"{mode}.prefix_kv_indices", (verify_kv_indices_need(total, bs, 0),), i32,
            "[ΣL] every prefix once, for the request's K query rows")  # fmt: skip
        add(f"{mode}.prefix_kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(L)]")
        add(f"{mode}.prefix_qo_indptr", (bs + 1,), i32, "[B+1] K·arange: K query rows a request")
        add(f"{mode}.prefix_qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_len_arr_host", (bs,), i32, "[B] L, CPU")
        add(f"{mode}.ancestor_kv_indices", (s, shared_prefix_chain_need(bs, k, s)), i32,
            "[S, B*K*S] each branch's own draft slots, one row per step")  # fmt: skip
        add(f"{mode}.ancestor_kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] z·(s + 1)")
        add(f"{mode}.ancestor_qo_indptr", (bs * k + 1,), i32, "[B*K+1] arange: a row a branch")
        add(f"{mode}.ancestor_qo_indptr_host", (bs * k + 1,), i32, "[B*K+1] CPU mirror")
        add(f"{mode}.ancestor_kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror")
        add(f"{mode}.ancestor_kv_len_arr_host", (s, bs * k), i32, "[S, B*K] s + 1, CPU")
    mode = "flashinfer_mla.target_verify"
    if k > 1:
        # A tree: the prefix pass (each prefix once, N rows a request) and the ancestor pass
        # (one list a node: its ancestors' window slots, tree_ancestor_kv_indices), whose host
        # lengths come from the engine's node depths and are checked on the device entry by
        # entry (check_host_list_lengths: a slot of 8 + B·N in host memory, a device word).
        add(f"{mode}.prefix_kv_indices", (verify_kv_indices_need(total, bs, 0),), i32,
            "[ΣL] every prefix once, for the request's N query rows")  # fmt: skip
        add(f"{mode}.prefix_kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(L)]")
        add(f"{mode}.prefix_qo_indptr", (bs + 1,), i32, "[B+1] N·arange: N query rows a request")
        add(f"{mode}.prefix_qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_len_arr_host", (bs,), i32, "[B] L, CPU")
        plan_ancestor_pass(mode, bs, n, add)
    for mode in ("flashinfer_mla.target_verify", "flashinfer_mla.draft_extend"):
        if k > 1 and mode.endswith("target_verify"):
            continue
        add(f"{mode}.kv_indices", (verify_kv_indices_need(total, bs, n),), i32,
            "[ΣL + B*N] row_b[0 : L_b + N], token slots")  # fmt: skip
        add(f"{mode}.kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(L + N)]")
        add(f"{mode}.qo_indptr", (bs + 1,), i32, "[B+1] N·arange (design §3.1)")
        add(f"{mode}.qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_len_arr_host", (bs,), i32, "[B] L + N tokens, CPU")


def tree_ancestor_kv_indices_need(batch: int, num_draft_tokens: int) -> int:
    """Every node's ancestor list at its worst: ``B·N·N`` (the kernel module's rule, not
    imported: this module stays torch-free)."""
    return batch * num_draft_tokens * num_draft_tokens


def plan_ancestor_pass(mode: str, batch: int, num_draft_tokens: int, add) -> None:
    """The ``<mode>.ancestor_*`` buffers of a tree verify's ancestor pass (design §3.5; TRT-LLM
    MLA's cascade takes the same pass, design §3.4): one list a node, its ancestors' window slots
    (``tree_ancestor_kv_indices``), whose host lengths come from the engine's node depths and
    are checked on the device entry by entry (``check_host_list_lengths``: a slot of
    ``8 + B·N`` in host memory, a device word)."""
    bn, i32 = batch * num_draft_tokens, "int32"
    add(f"{mode}.ancestor_kv_indices", (tree_ancestor_kv_indices_need(batch, num_draft_tokens),),
        i32, "[B*N*N] each node's ancestors' window slots (any mask's worst case)")  # fmt: skip
    add(f"{mode}.ancestor_kv_indptr", (bn + 1,), i32, "[B*N+1] exclusive sums of kv_len")
    add(f"{mode}.ancestor_kv_len", (bn,), i32, "[B*N] ancestors of each node, itself included")
    add(f"{mode}.ancestor_qo_indptr", (bn + 1,), i32, "[B*N+1] arange: a row a node")
    add(f"{mode}.ancestor_qo_indptr_host", (bn + 1,), i32, "[B*N+1] CPU mirror")
    add(f"{mode}.ancestor_kv_indptr_host", (bn + 1,), i32,
        "[B*N+1] CPU, from the engine's node depths")  # fmt: skip
    add(f"{mode}.ancestor_kv_len_arr_host", (bn,), i32, "[B*N] depth + 1, CPU")
    add(f"{mode}.ancestor_lengths_slot_host", (8 + bn,), "int64",
        "the host's ancestor counts published for the device's check (header, then B*N)")  # fmt: skip
    add(f"{mode}.ancestor_lengths_seen", (1,), "int64", "the last published counts checked")
