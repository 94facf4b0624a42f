"""The capacity plan of FlashInfer MLA's builder (design §3.5, §5), keys
``flashinfer_mla.<mode>.<field>``; torch-free, so ``specmeta plan`` reads it as it reads
:mod:`specmeta.config`. ``*_host`` buffers are the CPU mirrors ``plan()`` reads (pinned when the
builder's device is CUDA); every list is int32, as ``BatchMLAPagedAttentionWrapper`` wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["plan_flashinfer_mla"]


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
        # A tree: the prefix pass (each prefix once, N rows a request) and the ancestor pass,
        # node r's list of N window slots cut in two lists, its ancestors' (its one query row)
        # and the other nodes' (no query row).
        bn = bs * n
        add(f"{mode}.prefix_kv_indices", (verify_kv_indices_need(total, bs, 0),), i32,
            "[ΣL] every prefix once, for the request's N query rows")  # fmt: skip
        add(f"{mode}.prefix_kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(L)]")
        add(f"{mode}.prefix_qo_indptr", (bs + 1,), i32, "[B+1] N·arange: N query rows a request")
        add(f"{mode}.prefix_qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.prefix_kv_len_arr_host", (bs,), i32, "[B] L, CPU")
        add(f"{mode}.ancestor_kv_indices", (bn * n,), i32,
            "[B*N*N] node r's window slots at r·N: its ancestors first, then the others")  # fmt: skip
        add(f"{mode}.ancestor_counts", (bn,), i32, "[B*N] ancestors of each node, itself included")
        add(f"{mode}.ancestor_qo_indptr", (2 * bn + 1,), i32, "[2*B*N+1] (z + 1) // 2")
        add(f"{mode}.ancestor_qo_indptr_host", (2 * bn + 1,), i32, "[2*B*N+1] CPU mirror")
        add(f"{mode}.ancestor_kv_indptr_host", (2 * bn + 1,), i32,
            "[2*B*N+1] r·N, r·N + ancestors(r): CPU, from the host's tree mask")  # fmt: skip
        add(f"{mode}.ancestor_kv_len_arr_host", (2 * bn,), i32,
            "[2*B*N] ancestors(r), N − ancestors(r), CPU")  # fmt: skip
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
