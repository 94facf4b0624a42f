"""SpecConfig and the capacity plan: the only place a buffer size is computed (design §5).

Every persistent buffer of every kernel, backend and mode is sized here, from one
:class:`SpecConfig`, and both the eager path and the CUDA-graph path allocate from
:func:`plan_buffers`: with one plan there is no second formula to get wrong (a draft
``kv_indices`` sized without the ``topk`` factor in a graph path only, say).

The ``*_need`` functions give what one batch needs of a buffer, for the launchers' capacity
checks before launch; they use the same formulas as the plan.

The module imports torch only where a torch object is made (a :class:`BufferSpec`'s dtype, an
allocation, a CUDA device's memory): :func:`plan_sizes` and ``specmeta plan`` size a
configuration without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "SpecConfig",
    "BufferSpec",
    "BufferSize",
    "plan_buffers",
    "plan_sizes",
    "allocate_buffers",
    "check_fits",
    "human_bytes",
    "INT32_OFFSET_FIELDS",
    "uses_layout_b",
    "draft_pages_per_branch",
    "draft_row_need",
    "draft_decode_kv_indices_need",
    "page_table_width",
    "expand_page_table_width",
    "verify_kv_indices_need",
    "shared_prefix_chain_need",
    "tree_custom_mask_need",
    "branch_kv_indices_need",
    "trtllm_mla_max_blocks",
    "kv_pool_table_shape",
    "ROW_ALIGN",
    "max_num_draft_tokens",
]

# Row positions a default req_to_token width is a multiple of: 16 int32 slots are 64 bytes, so
# every row starts 16-byte aligned and a page-size-1 page table (a row gather) moves 16-byte
# vectors (the FA3 draft-decode build at B = 256, ps = 1 in bench/RESULTS.md).
ROW_ALIGN = 16


def max_num_draft_tokens(topk: int, num_steps: int) -> int:
    """The most nodes a draft tree can have, root included: ``1 + K + (S−1)·K²`` (the largest
    valid ``num_draft_tokens``; a chain, ``K = 1``, has ``S + 1``)."""
    return 1 + topk + (num_steps - 1) * topk * topk


def uses_layout_b(topk: int, page_size: int) -> bool:
    """Slot layout B (page-aligned branch regions) applies when ``ps > 1`` and ``K > 1``
    (design §1)."""
    return page_size > 1 and topk > 1


def draft_pages_per_branch(prefix_len: int, num_steps: int, page_size: int) -> int:
    """``nnp = ceil((L mod ps + S) / ps)``: pages of one branch's region in layout B."""
    return -(-((prefix_len % page_size) + num_steps) // page_size)


def draft_row_need(prefix_len: int, topk: int, num_steps: int, page_size: int) -> int:
    """Row positions one request needs during draft decode: ``L + K·S`` (A) or ``base + K·nnp·ps`` (B)."""
    if not uses_layout_b(topk, page_size):
        return prefix_len + topk * num_steps
    lpl = prefix_len % page_size
    nnp = draft_pages_per_branch(prefix_len, num_steps, page_size)
    return prefix_len - lpl + topk * nnp * page_size


def page_table_width(row_width: int, page_size: int) -> int:
    """Columns of a page table over a whole ``req_to_token`` row: ``ceil(W_row / ps)``
    (design §2.3)."""
    return -(-row_width // page_size)


def expand_page_table_width(num_rows: int) -> int:
    """Columns of the FA3 expand page table: a step ``s`` branch spans ``u ≤ s + 1 ≤ rows`` pages
    (``ceil((lpl + dl) / ps) ≤ dl`` for ``lpl < ps``), so ``rows`` (design §2.3)."""
    return num_rows


def draft_decode_kv_indices_need(seq_lens_sum: int, batch: int, topk: int, num_rows: int) -> int:
    """Entries of one ``kv_indices`` row for the last step: ``K·ΣL + B·K·rows`` (design §2.2)."""
    return topk * seq_lens_sum + batch * topk * num_rows


def verify_kv_indices_need(seq_lens_sum: int, batch: int, extra_tokens: int) -> int:
    """Entries of the ragged lists ``row_b[0 : L_b + extra]``: ``ΣL + B·extra`` (design §3.3).
    With ``extra = 0`` it is the shared level of the cascade draft decode."""
    return seq_lens_sum + batch * extra_tokens


def shared_prefix_chain_need(batch: int, topk: int, num_rows: int) -> int:
    """Entries of one chain-level row of the cascade draft decode for the last step:
    ``B·K·rows`` (every branch lists its own ``s + 1`` draft slots, nothing of the prefix)."""
    return batch * topk * num_rows


def tree_custom_mask_need(
    seq_lens_sum: int, batch: int, num_draft_tokens: int, packed: bool = False
) -> int:
    """Elements of FlashInfer's flat verify mask: ``N·ΣL + B·N²`` bools, or as many bytes when
    packed (each request's packed segment starts at its element offset, the layout FlashInfer
    0.7's ``plan()`` reads; see :mod:`specmeta.kernels.tree_custom_mask`)."""
    del packed  # both forms span the same offsets
    return num_draft_tokens * seq_lens_sum + batch * num_draft_tokens * num_draft_tokens


def branch_kv_indices_need(
    seq_lens_sum: int, batch: int, topk: int, num_rows: int, page_size: int
) -> int:
    """Page ids of one per-branch CSR row for the last step, ``K·Σ ceil((L_b + rows) / ps)``,
    bounded from ``ΣL`` alone by ``K·(floor((ΣL + B·rows) / ps) + B)`` (exact when ``ps == 1``,
    where it equals :func:`draft_decode_kv_indices_need`)."""
    if page_size == 1:
        return draft_decode_kv_indices_need(seq_lens_sum, batch, topk, num_rows)
    return topk * ((seq_lens_sum + batch * num_rows) // page_size + batch)


# TRT-LLM MLA's kernels read the block table in groups of 128 tokens: the number of columns must
# be a multiple of 128 / page_size pages (1 for pages of 128 tokens or more).
_TRTLLM_BLOCK_TOKENS = 128


def trtllm_mla_max_blocks(max_seq_len: int, page_size: int) -> int:
    """Columns of TRT-LLM MLA's ``block_kv_indices``: ``ceil(max_seq_len / ps)`` rounded up to a
    multiple of ``max(1, 128 // ps)`` (design §3.4)."""
    multiple = max(1, _TRTLLM_BLOCK_TOKENS // page_size)
    blocks = -(-max_seq_len // page_size)
    return max(multiple, -(-blocks // multiple) * multiple)


def kv_pool_table_shape(num_buffers: int) -> tuple[int, int]:
    """``move_kv_cache``'s device pointer table: one ``(base address, row stride, row width,
    rows)`` int64 row per K/V buffer (design §2.4); sized by the buffers, not by the config."""
    return (num_buffers, 4)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """A speculative-decoding configuration; rejects invalid values on construction.

    Attributes
    ----------
    topk : int
        ``K`` ≥ 1, branches per request during draft decode.
    num_steps : int
        ``S`` ≥ 1, draft steps.
    num_draft_tokens : int
        ``N`` ≥ 1, verify-window width (tree nodes, root included); ``N − 1 ≤ K + (S−1)·K²``.
    page_size : int
        ``ps`` ≥ 1, tokens per KV page.
    max_bs : int
        Largest batch (the largest CUDA-graph bucket).
    max_context_len : int
        Largest committed prefix ``L_b`` of any request. Draft and verify slots come on top.
    req_to_token_width : int, optional
        ``W_row``. Defaults to the smallest width that holds a request of ``max_context_len``
        plus its draft region (either layout) or its verify window, rounded up to whole pages
        and to a multiple of ``ROW_ALIGN`` (16) positions, so that rows start 16-byte aligned
        and the page-size-1 row gathers use vector loads; a value below the need is rejected
        (any width at or above it is valid).
    pool_size : int, optional
        ``P``, KV slots in the pool, a multiple of ``page_size``; page 0 is the reserved sink.
        Defaults to ``(max_bs · W_row + page_size)`` rounded up to a page.
    draft_window_size, draft_sink_size : int
        A bounded draft attention (design §2.10): each draft list keeps ``min(L,
        draft_window_size + draft_sink_size)`` prefix tokens, the first ``draft_sink_size``
        and the most recent ones, and the draft-decode lists are sized for that
        (:attr:`draft_prefix_cap`). ``draft_window_size = 0`` (the default) is no window.
    sliding_window_size : int
        A hybrid model's window layers' ``w`` (design §2.10): 0 (the default) is none, else the
        ``flashinfer_swa.*`` buffers of its window builder are planned too (``window_plan``).
    """

    topk: int
    num_steps: int
    num_draft_tokens: int
    page_size: int = 1
    max_bs: int = 1
    max_context_len: int = 1
    req_to_token_width: int | None = None
    pool_size: int | None = None
    draft_window_size: int = 0
    draft_sink_size: int = 0
    sliding_window_size: int = 0

    def __post_init__(self) -> None:
        for name in (
            "topk",
            "num_steps",
            "num_draft_tokens",
            "page_size",
            "max_bs",
            "max_context_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SpecConfig.{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"SpecConfig.{name} must be >= 1, got {value}")
        for name in ("draft_window_size", "draft_sink_size", "sliding_window_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SpecConfig.{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"SpecConfig.{name} must be >= 0 (0: no window), got {value}")
        k, s, n = self.topk, self.num_steps, self.num_draft_tokens
        if n > max_num_draft_tokens(k, s):
            raise ValueError(
                f"SpecConfig: num_draft_tokens={n} is too large for topk={k}, num_steps={s}: a draft "
                f"tree has at most 1 + K + (S-1)·K² = {max_num_draft_tokens(k, s)} nodes"
            )
        need_w = self.row_width_need
        if self.req_to_token_width is None:
            # Rows hold whole pages and whole 16-position (64-byte) lines: every int32 row then
            # starts 16-byte aligned, and a row gather at page size 1 moves 16-byte vectors.
            unit = math.lcm(self.page_size, ROW_ALIGN)
            object.__setattr__(self, "req_to_token_width", -(-need_w // unit) * unit)
        elif self.req_to_token_width < need_w:
            raise ValueError(
                f"SpecConfig.req_to_token_width={self.req_to_token_width} is too small: a request of "
                f"max_context_len={self.max_context_len} needs {need_w} row positions with "
                f"topk={k}, num_steps={s}, num_draft_tokens={n}, page_size={self.page_size}"
            )
        ps = self.page_size
        if self.pool_size is None:
            slots = self.max_bs * self.req_to_token_width + ps
            object.__setattr__(self, "pool_size", -(-slots // ps) * ps)
        elif self.pool_size < ps or self.pool_size % ps:
            raise ValueError(
                f"SpecConfig.pool_size={self.pool_size} must be a positive multiple of "
                f"page_size={ps} (page 0 is the reserved sink)"
            )

    @property
    def draft_prefix_cap(self) -> int:
        """Most prefix tokens a draft list holds: ``min(max_context_len, window + sink)`` with a
        draft window, ``max_context_len`` without."""
        if self.draft_window_size:
            return min(self.max_context_len, self.draft_window_size + self.draft_sink_size)
        return self.max_context_len

    @property
    def layout_b(self) -> bool:
        """Whether draft slots use page-aligned branch regions (design §1, layout B)."""
        return uses_layout_b(self.topk, self.page_size)

    @functools.cached_property
    def row_width_need(self) -> int:
        """Row positions a request of ``max_context_len`` needs, worst case over its last page
        (computed once: builders check it on every call)."""
        ps, top = self.page_size, self.max_context_len
        draft = max(
            draft_row_need(length, self.topk, self.num_steps, ps)
            for length in range(max(0, top - 2 * ps), top + 1)
        )
        return max(draft, top + self.num_draft_tokens)

    @property
    def max_pages_per_request(self) -> int:
        """Pages a full ``req_to_token`` row covers."""
        return math.ceil(self.req_to_token_width / self.page_size)


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """Shape and dtype of one persistent buffer, with what it holds."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    doc: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def allocate(self, device: torch.device | str, fill: int = 0) -> torch.Tensor:
        """A new tensor of this shape and dtype on ``device``, filled with ``fill``."""
        import torch

        return torch.full(self.shape, fill, dtype=self.dtype, device=device)


# Bytes per element of the dtypes the plan uses, by torch's name for them: the plan is computed
# with names (no torch import), and plan_buffers turns each name into the torch dtype.
_ITEMSIZE = {"int32": 4, "int64": 8, "bool": 1, "uint8": 1}


@dataclasses.dataclass(frozen=True)
class BufferSize:
    """A :class:`BufferSpec` without torch: the same shape and doc, the dtype by its name
    (``"int32"``, ``"int64"``, ``"bool"``, ``"uint8"``, as ``torch.<name>``)."""

    shape: tuple[int, ...]
    dtype: str
    doc: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]


def _plan_flashinfer(cfg: SpecConfig, add) -> None:
    """FlashInfer builders (design §3.3), keys ``flashinfer.<mode>.<field>``; ``*_host`` buffers
    are CPU mirrors for ``plan()`` (pinned when the builder's device is CUDA)."""
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


def _plan_trtllm_mla(cfg: SpecConfig, add) -> None:
    """TRT-LLM MLA builders (design §3.4), keys ``trtllm_mla.<mode>.<field>``. One block-table
    width serves every mode: branch rows cover ``L + S`` tokens, verify/extend rows ``L + N``."""
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
    from .metadata.trtllm_mla_plan import plan_trtllm_mla_tree_verify  # torch-free, like this

    plan_trtllm_mla_tree_verify(cfg, add)  # a tree's verify: the cascade's two passes


def plan_buffers(cfg: SpecConfig) -> dict[str, BufferSpec]:
    """Every persistent buffer's shape and dtype, keyed ``"<mode>.<field>"``.

    Sizes are for ``cfg.max_bs`` requests of at most ``cfg.max_context_len`` committed tokens.
    """
    import torch

    return {
        name: BufferSpec(size.shape, getattr(torch, size.dtype), size.doc)
        for name, size in plan_sizes(cfg).items()
    }


def plan_sizes(cfg: SpecConfig) -> dict[str, BufferSize]:
    """:func:`plan_buffers` without torch: the same keys in the same order, shapes and docs,
    each dtype by its name (``"int32"`` for ``torch.int32``); what ``specmeta plan`` reads."""
    k, s, ps, bs = cfg.topk, cfg.num_steps, cfg.page_size, cfg.max_bs
    plan: dict[str, BufferSize] = {}

    def add(name: str, shape: tuple[int, ...], dtype: str, doc: str) -> None:
        plan[name] = BufferSize(tuple(int(x) for x in shape), dtype, doc)

    from .metadata.capabilities import MODES  # torch-free, like this module

    add("status", (1,), "int32", "status word (specmeta.Status bits)")
    # A builder's seq_lens_cpu check (design §3): its host slots and the device's last read.
    # One slot a mode, and one more for a ragged target verify's verify_lens_cpu.
    slots = len(MODES) + 1
    add(
        "host_lengths_host",
        (slots, 8),
        "int64",
        "per mode, then verify_lens: seq, n, ΣL, max L, consumed (64 bytes: one load)",
    )
    add("host_lengths_seen", (slots,), "int64", "per slot: the last seq the device checked")
    # Draft slots (design §1, §2.1).
    add("draft.out_cache_loc", (bs * k * s,), "int64", "[B, K, S] draft KV slots")
    add("draft.positions", (bs * k,), "int64", "[B*K] position of each branch's first token")
    tail_pairs = bs * (k - 1) * (ps - 1) if cfg.layout_b else 0
    add("draft.prefix_tail_tgt", (tail_pairs,), "int64", "layout-B prefix-tail copy targets")
    add("draft.prefix_tail_src", (tail_pairs,), "int64", "layout-B prefix-tail copy sources")
    # Draft-decode CSR lists for page-size-1 consumers (design §2.2): every step row holds K copies
    # of every prefix (the topk factor) plus the chains.
    add(
        "draft_decode.kv_indices",
        (s, draft_decode_kv_indices_need(bs * cfg.draft_prefix_cap, bs, k, s)),
        "int32",
        "[S, K*ΣLw + B*K*S] per-branch KV slot lists (ΣLw: prefixes or their draft windows)",
    )
    add("draft_decode.kv_indptr", (s, bs * k + 1), "int32", "[S, B*K+1] CSR offsets")
    # Static inputs of the CUDA-graph runners (design §4): the engine's per-batch tensors, copied
    # into [:B] and padded in [B:Bp] before every replay.
    nd = cfg.num_draft_tokens
    add("runner.req_pool_indices", (bs,), "int64", "[B] req_to_token row of each request")
    add("runner.seq_lens", (bs,), "int64", "[B] committed prefix lengths L_b")
    add("runner.verify_out_cache_loc", (bs * nd,), "int64", "[B*N] verify-window KV slots")
    add("runner.tree_mask", (bs, nd, nd), "bool", "[B, N, N] draft-tree ancestor mask")
    add("runner.verify_lens", (bs,), "int32", "[B] verify tokens of each request (ragged)")
    add("runner.accept_index", (bs, s + 1), "int32", "[B, S+1] accepted node ids, -1 after")
    add("runner.accept_lens", (bs,), "int32", "[B] accepted nodes per request")
    # Relocation after verify (design §2.4): accepted (tgt, src) slot pairs, B·(S+1) long, tail 0.
    add("verify.tgt_cache_loc", (bs * (s + 1),), "int64", "[B*(S+1)] KV move targets")
    add("verify.src_cache_loc", (bs * (s + 1),), "int64", "[B*(S+1)] KV move sources")
    # FlashAttention-3 metadata (design §2.3, §3.2), one set per mode so the metadata of every mode
    # can live at once (e.g. captured in different graphs); int32, as flash_attn_with_kvcache
    # wants. Cascade ("expand_*") buffers exist only for K > 1.
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
    _plan_flashinfer(cfg, add)
    _plan_trtllm_mla(cfg, add)
    from .metadata.flashinfer_mla_plan import plan_flashinfer_mla  # torch-free, like this one

    plan_flashinfer_mla(cfg, add)
    if cfg.sliding_window_size:  # a hybrid model's window layers, in their own id space
        from .metadata.window_plan import plan_window_layers  # torch-free, like this one
        plan_window_layers(cfg, add)
    return plan


# A buffer whose entries are found through int32 offsets in a sibling buffer, by its field (the
# key's last part) -> the field of those offsets (design §2.2, §3.3). Every such list is ragged
# (CSR): row ``r`` of ``*_indptr`` gives offsets into row ``r`` of the list (a 1-D list is one
# row), so no row may be longer than an int32 holds. The other buffers are dense tables whose
# element offsets the kernels compute in 64 bits (design §2.5).
INT32_OFFSET_FIELDS: dict[str, str] = {
    "kv_indices": "kv_indptr",
    "prefix_kv_indices": "prefix_kv_indptr",
    "chain_kv_indices": "chain_kv_indptr",
    "ancestor_kv_indices": "ancestor_kv_indptr",
    "custom_mask": "mask_indptr",
    "packed_custom_mask": "packed_mask_indptr",
}
# The largest offset an int32 holds.
_INT32_MAX = 2**31 - 1
_FIX = (
    "shrink SpecConfig's max_bs or max_context_len, or allocate fewer buffers (a builder's "
    "modes=, allocate_buffers' names=)"
)


def human_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit below it, one decimal: ``"381.5 GiB"``
    (``"512 B"`` below a KiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # the loop returns at PiB


def _capacity(device: Any) -> tuple[int, str] | None:
    """Bytes ``device`` can hold at most, with what they are, or ``None`` where that is not
    known (a device that is neither CPU nor a visible CUDA device, or no ``sysconf``)."""
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf, or no such name here
            return None
        return total, "physical memory"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None  # the allocation says why it cannot be made
        _free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, "memory (torch.cuda.mem_get_info)"
    return None


def check_fits(specs: Mapping[str, Any], device: Any, where: str) -> None:
    """Raise ``ValueError`` before any allocation if ``specs`` cannot be allocated on ``device``.

    Two checks, on shapes only (nothing is allocated or read):

    1. **Int32 offsets.** A ragged list whose entries are found through int32 offsets in a
       sibling buffer cannot have a row longer than ``2**31 - 1`` elements: the offsets could
       not address its end. This applies to the buffers whose field (the key's last part) is
       in :data:`INT32_OFFSET_FIELDS`: every ``kv_indices`` (``draft_decode.kv_indices`` and
       FlashInfer's, indexed by their ``kv_indptr``), FlashInfer's ``prefix_kv_indices`` and
       ``chain_kv_indices`` (their ``*_kv_indptr``), and its ``custom_mask`` and
       ``packed_custom_mask`` (``mask_indptr`` and ``packed_mask_indptr``, in elements and
       bytes). A row is the last dimension (``[S, W]`` lists hold one row a draft step).
       Dense tables (FA3 page tables, TRT-LLM MLA's ``block_kv_indices``, the draft slots)
       are not limited here: the kernels address them with 64-bit offsets (design §2.5).
       Int32 *sums* stored in a buffer (FA3's ``cu_seqlens_k``, up to ``ΣL + B·N``) do not
       show in a shape and are not checked here.
    2. **Memory.** The bytes of all ``specs`` together must not exceed what ``device`` has in
       all: on CUDA the total of ``torch.cuda.mem_get_info``, on the CPU the machine's
       physical memory (``SC_PAGE_SIZE · SC_PHYS_PAGES``). Other devices are not checked.
       Every spec counts against ``device``: a caller that puts some buffers elsewhere (the
       ``*_host`` mirrors on the CPU) checks those with a second call.

    Parameters
    ----------
    specs : mapping of str to BufferSpec
        Plan key -> spec (anything with ``shape`` and ``nbytes``: a :class:`BufferSize` too).
    device : torch.device or str
        Where they would be allocated.
    where : str
        The caller, first in the message (``"allocate_buffers"``, ``"FA3MetadataBuilder"``).

    Raises
    ------
    ValueError
        Naming ``where``, the largest offending buffer's key, shape and bytes, the total bytes
        and the fix.
    """
    if not specs:
        return
    total = sum(spec.nbytes for spec in specs.values())
    total_text = f"{total:,} bytes ({human_bytes(total)})"
    wide = [
        key
        for key, spec in specs.items()
        if key.rsplit(".", 1)[-1] in INT32_OFFSET_FIELDS
        and spec.shape
        and spec.shape[-1] > _INT32_MAX
    ]
    if wide:
        key = max(wide, key=lambda k: specs[k].nbytes)  # the first of equals, in plan order
        spec = specs[key]
        offsets = INT32_OFFSET_FIELDS[key.rsplit(".", 1)[-1]]
        others = len(wide) - 1
        also = (
            f"; {others} other buffer{'s have' if others > 1 else ' has'} such rows"
            if others
            else ""
        )
        raise ValueError(
            f"{where}: {key} of shape {list(spec.shape)} has rows of {spec.shape[-1]:,} "
            f"elements, more than the {_INT32_MAX:,} (2**31 - 1) its int32 {offsets} can "
            f"address; it alone is {spec.nbytes:,} bytes ({human_bytes(spec.nbytes)}) of "
            f"{total_text} planned{also}; {_FIX}"
        )
    capacity = _capacity(device)
    if capacity is not None and total > capacity[0]:
        have, what = capacity
        key = max(specs, key=lambda k: specs[k].nbytes)
        spec = specs[key]
        raise ValueError(
            f"{where}: the {len(specs)} planned "
            f"{'buffers need' if len(specs) > 1 else 'buffer needs'} {total_text} on {device}, more "
            f"than its {have:,} bytes ({human_bytes(have)}) of {what}; the largest is {key} "
            f"of shape {list(spec.shape)}, {spec.nbytes:,} bytes ({human_bytes(spec.nbytes)}); "
            f"{_FIX}"
        )


def _check_names(plan: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """``names`` as a list, or a ``ValueError`` naming each unknown name with close matches."""
    if isinstance(names, str):
        raise TypeError(
            f"allocate_buffers: names must be a list of plan keys, got the str {names!r}; "
            f"pass [{names!r}]"
        )
    names = list(names)
    unknown = [name for name in names if name not in plan]
    if unknown:
        parts = []
        for name in unknown:
            close = difflib.get_close_matches(str(name), list(plan), n=3)
            quoted = [repr(c) for c in close]
            hint = (
                f"did you mean {', '.join(quoted[:-1])} or {quoted[-1]}?"
                if len(quoted) > 1
                else f"did you mean {quoted[0]}?"
                if quoted
                else "no close name"
            )
            parts.append(f"{name!r} ({hint})")
        raise ValueError(
            f"allocate_buffers: names has {', '.join(parts)}, not "
            f"{'a key' if len(unknown) == 1 else 'keys'} of the plan; every name is a key of "
            "specmeta.plan_buffers(cfg), and `specmeta plan` lists them (the engine groups with --with)"
        )
    return names


def allocate_buffers(
    cfg: SpecConfig, device: torch.device | str, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Allocate (zero-filled) the planned buffers ``names`` (default: all) on ``device``.

    Raises
    ------
    ValueError
        If a name is not a key of :func:`plan_buffers` (the message gives the close ones), or
        if the buffers cannot be allocated (:func:`check_fits`, before anything is allocated).
    TypeError
        If ``names`` is a single ``str``.
    """
    plan = plan_buffers(cfg)
    chosen = plan if names is None else {n: plan[n] for n in _check_names(plan, names)}
    check_fits(chosen, device, "allocate_buffers")
    return {name: spec.allocate(device) for name, spec in chosen.items()}
