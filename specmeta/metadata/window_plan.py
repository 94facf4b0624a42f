"""The capacity plan of a hybrid model's window layers (design §2.10, §5), keys
``flashinfer_swa.<mode>.<field>``, and the list lengths of the window read rail; torch-free, so
``specmeta plan`` reads it as it reads :mod:`specmeta.config`.

A window layer with window ``w`` reads, at draft step ``s``, the last ``min(L + s + 1, w)``
entries of each branch's prefix and chain, and in target verify and draft extend a list that
starts at ``max(0, L − w + 1)``: ``min(L, w − 1) + N`` entries. The window builder's buffers
(``FlashInferBuilder(cfg, device, sliding_window_size=w)``) are planned for those clipped
lengths, so a plan gives the window pool's lists their own totals beside the full layers'
``flashinfer.*`` ones. The kernels' host checks use the same formulas
(:mod:`specmeta.kernels._window` imports them from here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["WINDOW_PREFIX", "WINDOW_MODES", "FLASHINFER_WINDOW_MODES", "FA3_WINDOW_PREFIX",
           "shared_prefix_served", "plan_flashinfer_swa", "plan_fa3_swa",
           "fa3_window_verify_width", "plan_window_layers", "rail_prefix_total",
           "rail_draft_need", "rail_verify_need", "rail_mask_need", "window_tree_keep",
           "window_tree_gap", "window_tree_prefix_pages"]  # fmt: skip

#: The plan prefix of the window builder's buffers.
WINDOW_PREFIX = "flashinfer_swa."
#: The modes a window builder serves: the page-size-1 draft lists and the prefill lists.
WINDOW_MODES = ("draft_decode", "target_verify", "draft_extend")
#: The modes FlashInfer's window builder serves: those, the shared-prefix cascade (for a
#: window wider than the draft steps, :func:`shared_prefix_served`) and the paged form
#: (full-length page lists, read with the kernel's own window).
FLASHINFER_WINDOW_MODES = ("draft_decode", "draft_decode_shared_prefix", "draft_decode_paged",
                           "target_verify", "draft_extend")  # fmt: skip
#: The plan prefix of FA3's window builder (``FA3MetadataBuilder(cfg, device,
#: sliding_window_size=w)``): the chain modes' and a tree's buffers (design §2.10).
FA3_WINDOW_PREFIX = "fa3_swa."


def shared_prefix_served(cfg: SpecConfig) -> bool:
    """Whether a window layer's shared-prefix cascade is built for ``cfg`` (design §2.10):
    step ``s`` keeps ``min(L, w − s − 1)`` prefix positions, so with ``w ≤ S`` a step keeps
    none, and FlashInfer's cascade wrapper is not fed an empty prefix level (design §8): the
    form needs ``w > S`` (per-branch lists, ``draft_decode``, serve any ``w``)."""
    return cfg.sliding_window_size > cfg.num_steps


def rail_prefix_total(seq_lens_sum: int, batch: int, rail: int) -> int:
    """The most prefix positions a batch's verify / extend lists keep under the rail:
    ``Σ min(L_b, w − 1) ≤ min(ΣL, B·(w − 1))``; ``ΣL`` without one (``w = 0``)."""
    return min(seq_lens_sum, batch * (rail - 1)) if rail else seq_lens_sum


def rail_draft_need(seq_lens_sum: int, batch: int, topk: int, num_rows: int, rail: int) -> int:
    """Entries of one draft-decode ``kv_indices`` row for the last step under the rail:
    ``K·Σ min(L_b + rows, w) ≤ min(K·ΣL + B·K·rows, B·K·w)``; the plain ``K·ΣL + B·K·rows``
    without one (design §2.2)."""
    from ..config import draft_decode_kv_indices_need

    plain = draft_decode_kv_indices_need(seq_lens_sum, batch, topk, num_rows)
    return min(plain, batch * topk * rail) if rail else plain


def rail_verify_need(seq_lens_sum: int, batch: int, extra_tokens: int, rail: int) -> int:
    """Entries of the verify / extend lists under the rail: ``Σ (min(L_b, w − 1) + extra) ≤
    min(ΣL, B·(w − 1)) + B·extra``; ``ΣL + B·extra`` without one."""
    from ..config import verify_kv_indices_need

    return verify_kv_indices_need(rail_prefix_total(seq_lens_sum, batch, rail), batch,
                                  extra_tokens)  # fmt: skip


def rail_mask_need(seq_lens_sum: int, batch: int, num_draft_tokens: int, rail: int) -> int:
    """Elements (or bytes, packed) of the verify mask under the rail: each request's block is
    ``N × (min(L, w − 1) + N)``."""
    from ..config import tree_custom_mask_need

    return tree_custom_mask_need(rail_prefix_total(seq_lens_sum, batch, rail), batch,
                                 num_draft_tokens)  # fmt: skip


def plan_flashinfer_swa(cfg: SpecConfig, add) -> None:
    """Add the ``flashinfer_swa.*`` buffers of ``cfg`` (its ``sliding_window_size = w ≥ 1``)
    through ``add(name, shape, dtype, doc)``: the fields of ``flashinfer.<mode>`` for the modes
    a window builder serves, the lists and masks sized for the rail's clipped lengths."""
    k, s, n, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.max_bs
    w = cfg.sliding_window_size
    total = bs * cfg.max_context_len  # ΣL at full capacity
    i32 = "int32"
    mode = "flashinfer_swa.draft_decode"
    add(f"{mode}.kv_indices", (s, rail_draft_need(total, bs, k, s, w)), i32,
        "[S, K*Σmin(L + S, w)] per-branch window-pool lists, one row per draft step")  # fmt: skip
    add(f"{mode}.kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] CSR offsets")
    add(f"{mode}.kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror of kv_indptr")
    add(f"{mode}.kv_last_page_len", (bs * k,), i32, "[B*K] ones (page size 1)")
    add(f"{mode}.kv_last_page_len_host", (bs * k,), i32, "[B*K] CPU mirror (ones)")
    for mode in ("flashinfer_swa.target_verify", "flashinfer_swa.draft_extend"):
        add(f"{mode}.qo_indptr", (bs + 1,), i32, "[B+1] N·arange (design §3.1)")
        add(f"{mode}.qo_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indptr", (bs + 1,), i32, "[B+1] [0, cumsum(min(L, w - 1) + N)]")
        add(f"{mode}.kv_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
        add(f"{mode}.kv_indices", (rail_verify_need(total, bs, n, w),), i32,
            "[Σmin(L, w - 1) + B*N] window-pool ids of positions max(0, L - w + 1) … L + N - 1")  # fmt: skip
        add(f"{mode}.kv_last_page_len", (bs,), i32, "[B] ones (page size 1)")
        add(f"{mode}.kv_last_page_len_host", (bs,), i32, "[B] CPU mirror (ones)")
    if shared_prefix_served(cfg):
        # The shared-prefix cascade: a prefix row a step (step s keeps min(L, w - s - 1),
        # step 0 the most), the chains as a full layer's (w > S: every step's whole chain).
        from .flashinfer_plan import plan_cascade_rows_and_chains

        mode = "flashinfer_swa.draft_decode_shared"
        add(f"{mode}.prefix_kv_indices", (s, rail_prefix_total(total, bs, w)), i32,
            "[S, Σmin(L, w - 1)] each prefix's window part once a step, in window-pool ids")  # fmt: skip
        add(f"{mode}.prefix_kv_indptr", (s, bs + 1), i32, "[S, B+1] prefix-level CSR offsets")
        add(f"{mode}.prefix_kv_indptr_host", (s, bs + 1), i32, "[S, B+1] CPU mirror")
        plan_cascade_rows_and_chains(mode, bs, k, s, add)  # the full layers' rule
    # The paged form: full-length page lists (a page cannot be cut), window-pool pages, the
    # pages below the read floor the sink; the consumer plans window_left = w - 1.
    from ..config import branch_kv_indices_need

    mode, ps = "flashinfer_swa.draft_decode_paged", cfg.page_size
    add(f"{mode}.kv_indices", (s, branch_kv_indices_need(total, bs, k, s, ps)), i32,
        "[S, K*(ΣL + B*S)/ps + B*K] per-branch window-pool page lists, one row per step")  # fmt: skip
    add(f"{mode}.kv_indptr", (s, bs * k + 1), i32, "[S, B*K+1] CSR offsets, in pages")
    add(f"{mode}.kv_indptr_host", (s, bs * k + 1), i32, "[S, B*K+1] CPU mirror")
    add(f"{mode}.kv_last_page_len", (s, bs * k), i32, "[S, B*K] tokens on each last page")
    add(f"{mode}.kv_last_page_len_host", (s, bs * k), i32, "[S, B*K] CPU mirror")
    mode = "flashinfer_swa.target_verify"
    mask = rail_mask_need(total, bs, n, w)
    add(f"{mode}.custom_mask", (mask,), "bool",
        "[N*Σmin(L, w - 1) + B*N²] flat bool mask over the clipped lists")  # fmt: skip
    add(f"{mode}.mask_indptr", (bs + 1,), i32, "[B+1] mask segment starts (elements)")
    add(f"{mode}.mask_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    add(f"{mode}.packed_custom_mask", (mask,), "uint8",
        "packed-bit mask over the clipped lists, segment i at byte mask_indptr[i]")  # fmt: skip
    add(f"{mode}.packed_mask_indptr", (bs + 1,), i32, "[B+1] packed segment starts (bytes)")
    add(f"{mode}.packed_mask_indptr_host", (bs + 1,), i32, "[B+1] CPU mirror")
    # A ragged verify (design §2.9): its lists and masks fit the uniform ones (each list at
    # most min(L, w - 1) + N entries, each block v·(min(L, w - 1) + min(v, N)) with Σv ≤ B·N).
    add(f"{mode}.verify_lens", (bs,), i32, "[Bp] verify lengths padded to the bucket")
    add(f"{mode}.verify_lens_host", (bs,), i32, "[Bp] CPU mirror")
    add(f"{mode}.ragged_qo_indptr", (bs + 1,), i32, "[Bp+1] exclusive sum of verify_lens")
    add(f"{mode}.ragged_qo_indptr_host", (bs + 1,), i32, "[Bp+1] CPU mirror")


def window_tree_keep(rail: int, depth: int, page_size: int) -> int:
    """``k``: the whole pages a window layer's tree cascade keeps in its normal pass before the
    request's last page boundary (design §2.10), ``⌊(w − D − ps) / ps⌋`` with ``D`` the
    deepest query row's offset past ``L`` (``S − 1`` in draft decode, ``N − 1`` in verify);
    negative when ``w < D + ps`` (then no page is read by every row: no normal pass)."""
    return (rail - depth - page_size) // page_size


def window_tree_gap(rail: int, depth: int, page_size: int) -> int:
    """``G = max(k, 0)·ps`` (:func:`window_tree_keep`): the most prefix positions a draft-decode
    tree's normal pass holds; its expand pass runs FlashAttention's window ``(w − 1 − G, 0)``
    (design §2.10)."""
    return max(window_tree_keep(rail, depth, page_size), 0) * page_size


def window_tree_prefix_pages(rail: int, depth: int, page_size: int) -> int:
    """The most prefix pages a draft-decode expand row of a window layer's tree lists before
    its branch's own pages (design §2.10): the pages from the one holding its read floor
    ``max(0, L + s − w + 1)`` up to the normal pass's start, at most ``⌊(w − G + ps − 2) /
    ps⌋`` (``G``: :func:`window_tree_gap`)."""
    return (rail - window_tree_gap(rail, depth, page_size) + page_size - 2) // page_size


def fa3_window_verify_width(num_draft_tokens: int, page_size: int) -> int:
    """Columns of a window layer's verify expand row (design §2.10): its band of prefix
    positions below the tree cascade's normal pass, then its ancestors within the window, at
    most ``D + 2·ps − 1`` with the depth bound ``D = N − 1``."""
    return num_draft_tokens + 2 * page_size - 2


def plan_fa3_swa(cfg: SpecConfig, add) -> None:
    """Add the ``fa3_swa.*`` buffers of ``cfg`` (``sliding_window_size = w ≥ 1``) through
    ``add``: the fields of ``fa3.<mode>``. The chains' tables keep their full width (a page
    table cannot be clipped inside a page: FlashAttention's own window excludes what a row does
    not read), so they are sized as the full layers' are, in window-pool pages; a tree's
    cascade (and a ragged verify's, every ``topk``) has a normal pass no wider and a verify
    expand pass of :func:`fa3_window_verify_width` columns a row (design §2.10)."""
    from ..config import expand_page_table_width, page_table_width

    k, s, n, bs, i32 = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.max_bs, "int32"
    pages = page_table_width(cfg.req_to_token_width, cfg.page_size)
    mode = "fa3_swa.draft_decode"
    rows = s if k == 1 else 1  # K == 1: one length row per step; K > 1: the shared prefix
    add(f"{mode}.page_table", (bs, pages), i32, "[B, W] window-pool pages (K == 1: every step)")
    add(f"{mode}.cache_seqlens", (rows, bs), i32, "[S or 1, B] KV lengths")
    add(f"{mode}.cu_seqlens_k", (rows, bs + 1), i32, "[S or 1, B+1] Σ cache_seqlens")
    add(f"{mode}.cu_seqlens_q", (bs + 1,), i32, "[B+1] K·arange(B+1)")
    if k > 1:  # each row's pages from its floor up to the normal pass, then its branch's
        ew = expand_page_table_width(s) + window_tree_prefix_pages(
            cfg.sliding_window_size, s - 1, cfg.page_size)  # fmt: skip
        add(f"{mode}.expand_page_table", (s, bs * k, ew), i32,
            "[S, B*K, S + row pages] window-pool pages")  # fmt: skip
        add(f"{mode}.expand_cache_seqlens", (s, bs * k), i32, "[S, B*K] keys per row")
        add(f"{mode}.expand_cu_seqlens_k", (s, bs * k + 1), i32, "[S, B*K+1] Σ lengths")
        add(f"{mode}.expand_cu_seqlens_q", (bs * k + 1,), i32, "[B*K+1] arange(B*K+1)")
    for mode in ("fa3_swa.target_verify", "fa3_swa.draft_extend"):
        add(f"{mode}.page_table", (bs, pages), i32,
            "[B, W] window-pool pages over L + N (a cascade: from P0 to L)")  # fmt: skip
        add(f"{mode}.cache_seqlens", (bs,), i32, "[B] KV lengths")
        add(f"{mode}.cu_seqlens_k", (bs + 1,), i32, "[B+1] Σ cache_seqlens")
        add(f"{mode}.cu_seqlens_q", (bs + 1,), i32, "[B+1] N·arange(B+1)")
    # The verify cascade's expand pass: K > 1, and a ragged verify for every K (design §2.9),
    # one row a node or, ragged, a query token (T ≤ B·N).
    mode, bn = "fa3_swa.target_verify", bs * n
    add(f"{mode}.expand_page_table", (bn, fa3_window_verify_width(n, cfg.page_size)), i32,
        "[B*N, N + 2ps - 2] band and ancestor window-pool slots")  # fmt: skip
    add(f"{mode}.expand_cache_seqlens", (bn,), i32, "[B*N] keys per row")
    add(f"{mode}.expand_cu_seqlens_k", (bn + 1,), i32, "[B*N+1] Σ lengths")
    add(f"{mode}.expand_cu_seqlens_q", (bn + 1,), i32, "[B*N+1] arange(B*N+1)")
    add(f"{mode}.verify_lens", (bs,), i32, "[Bp] ragged verify lengths, padded")
    add(f"{mode}.ragged_qo_indptr", (bs + 1,), i32, "[Bp+1] exclusive sum of them")


def plan_window_layers(cfg: SpecConfig, add) -> None:
    """Every window builder's buffers of ``cfg`` (``sliding_window_size ≥ 1``): FlashInfer's
    (:func:`plan_flashinfer_swa`) and FA3's (:func:`plan_fa3_swa`)."""
    plan_flashinfer_swa(cfg, add)
    plan_fa3_swa(cfg, add)
