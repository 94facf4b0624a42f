"""FlashAttention-3 metadata for draft decode, target verify and draft extend (design §3.2).

:class:`FA3MetadataBuilder` is constructed once per (config, device): it allocates its
persistent buffers from :func:`specmeta.plan_buffers` (keys ``"fa3.<mode>.<field>"``) and writes
the uniform-stride ``cu_seqlens_q`` of every pass once (design §3.1). Each build then launches
the sync-free kernels into those buffers — no allocation, no host sync, the same addresses at
capture and at replay — and returns small frozen dataclasses whose fields are views into them:

=====================  ===========================================================  ==========
mode                   passes (``flash_attn_with_kvcache`` calls)                    launches
=====================  ===========================================================  ==========
draft decode, K == 1   per step ``s``: row pages, ``cache_seqlens = L + s + 1``       1
draft decode, K > 1    normal (prefix, ``Q = K``) + per step expand (own chain)      1
target verify, K == 1  row pages over ``L + N``, ``Q = N``, causal                   1
target verify, K > 1   normal (``L``, ``Q = N``) + expand (tree ancestors, ``Q = 1``)  3
draft extend           row pages over ``L + N``, ``Q = N``, causal                   1
=====================  ===========================================================  ==========

A cascade's two passes run with ``return_softmax_lse=True`` on the same query rows and are
merged by log-sum-exp. Every ``cu_seqlens_k_new`` equals ``[0, cumsum(cache_seqlens)]`` (FA3
ignores it without new keys, but it is never inconsistent). The results are views of the
builder's buffers: the next build of the same mode overwrites them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import validate
from ..config import SpecConfig, plan_buffers
from ..kernels.draft_decode_page_tables import (
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from ..kernels.prefix_page_table import prefix_page_table, prefix_page_table_ref
from ..kernels.verify_expand_page_table import (
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from .inputs import BuildInputs, check_build_inputs, check_num_rows
from .layout import UniformQueryLayout

__all__ = ["FA3Metadata", "FA3Cascade", "FA3MetadataBuilder"]

_PREFIX = "fa3."
_KEYWORDS = (
    "cache_seqlens",
    "page_table",
    "cu_seqlens_q",
    "cu_seqlens_k_new",
    "max_seqlen_q",
    "causal",
    "return_softmax_lse",
)


@dataclasses.dataclass(frozen=True)
class FA3Metadata:
    """The metadata keywords of one ``flash_attn_with_kvcache`` call; ``B'`` is its batch of
    sequences (requests, branches or tree nodes).

    Attributes
    ----------
    cache_seqlens : torch.Tensor
        ``[B']`` int32, exact KV length of each sequence.
    page_table : torch.Tensor
        ``[B', W]`` int32 page ids of pages of ``page_size`` tokens; only the first
        ``ceil(cache_seqlens / page_size)`` columns are meaningful, the rest are 0 (the sink).
    cu_seqlens_q : torch.Tensor
        ``[B' + 1]`` int32, ``max_seqlen_q · arange(B' + 1)``: uniform stride, the same at
        capture and replay (design §3.1).
    cu_seqlens_k_new : torch.Tensor
        ``[B' + 1]`` int32, ``[0, cumsum(cache_seqlens)]``, exact.
    max_seqlen_q : int
        Query rows of every sequence (exact; padded sequences keep the full width).
    causal : bool
        Bottom-right causal mask (verify and extend with ``K == 1``) or none.
    return_softmax_lse : bool
        True for both passes of a cascade, whose outputs are merged by log-sum-exp.
    page_size : int
        Not a keyword: the page size ``page_table`` indexes. View the KV cache as
        ``[-1, page_size, H_kv, D]`` (1 for the verify expand pass, which lists token slots).
    max_seqlen_k : int
        Not a keyword of ``flash_attn_with_kvcache`` (it is one of ``get_scheduler_metadata``):
        ``max(cache_seqlens)``, exact when the build was given ``seq_lens_cpu``, otherwise an
        upper bound from the config (``max_context_len``, ``page_size``, ``N``).
    """

    cache_seqlens: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k_new: torch.Tensor
    max_seqlen_q: int
    causal: bool
    return_softmax_lse: bool
    page_size: int
    max_seqlen_k: int

    def kwargs(self) -> dict[str, Any]:
        """Keywords of FA3's ``flash_attn_with_kvcache`` (``flash_attn_interface``, sgl-kernel):
        ``flash_attn_with_kvcache(q, k_cache, v_cache, **meta.kwargs(), softmax_scale=…)``."""
        return {name: getattr(self, name) for name in _KEYWORDS}

    def varlen_kwargs(self) -> dict[str, Any]:
        """Keywords of FlashAttention's CuTe ``flash_attn.cute.flash_attn_varlen_func``:
        ``out, lse = flash_attn_varlen_func(q, k_cache, v_cache, **meta.varlen_kwargs(),
        softmax_scale=…)``.

        The KV lengths go in as ``seqused_k`` (with a page table that kernel takes no
        ``cu_seqlens_k``, so ``cu_seqlens_k_new`` is left out) and ``return_lse`` replaces
        ``return_softmax_lse``. Its LSE is ``[H, total_q]`` float32, natural log, and ``−inf``
        for a sequence with no keys (a layout-B normal pass whose prefix is shorter than a
        page): :func:`specmeta.merge_state` takes ``lse.t()`` and handles it.
        """
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "seqused_k": self.cache_seqlens,
            "page_table": self.page_table,
            "max_seqlen_q": self.max_seqlen_q,
            "causal": self.causal,
            "return_lse": self.return_softmax_lse,
        }


@dataclasses.dataclass(frozen=True)
class FA3Cascade:
    """One attention of a mode: ``normal`` alone, or ``normal`` + ``expand`` merged by LSE.

    Attributes
    ----------
    normal : FA3Metadata
        The shared prefix of each request (its whole sequence when there is no cascade).
    expand : FA3Metadata or None
        ``K > 1`` only: each branch's (draft decode) or tree node's (target verify) own keys,
        one query row per sequence, over the same query rows as ``normal``.
    """

    normal: FA3Metadata
    expand: FA3Metadata | None

    @property
    def is_cascade(self) -> bool:
        return self.expand is not None


class FA3MetadataBuilder:
    """Builds FA3 metadata into persistent buffers planned for ``cfg``.

    Parameters
    ----------
    cfg : SpecConfig
        ``K``, ``S``, ``N``, ``ps``, ``max_bs``, ``W_row``: fixes every buffer's shape.
    device : torch.device or str
        Where the buffers live; the inputs of every build must be there too.
    reference : bool
        Build with the pure-torch references instead of the kernels (a test and benchmark
        baseline; it syncs).

    Attributes
    ----------
    buffers : dict[str, torch.Tensor]
        The ``"fa3.*"`` buffers of ``plan_buffers(cfg)``, allocated zero-filled, keyed without
        the ``fa3.`` prefix (``"draft_decode.page_table"``), as in every builder.
    status : torch.Tensor
        ``int32 [1]``: the status word every method reports into unless given another (read it
        with :func:`specmeta.check_status`, which syncs).

    Examples
    --------
    >>> fa3 = FA3MetadataBuilder(cfg, "cuda")                     # once
    >>> steps = fa3.draft_decode(rpi, req_to_token, seq_lens, out_cache_loc)
    >>> o, lse = flash_attn_with_kvcache(q, k, v, **steps[0].normal.kwargs())
    """

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *, reference: bool = False):
        if not isinstance(cfg, SpecConfig):
            raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = validate.canonical_device(device)
        plan = plan_buffers(cfg)
        self.buffers = {
            name[len(_PREFIX) :]: spec.allocate(self.device)
            for name, spec in plan.items()
            if name.startswith(_PREFIX)
        }
        self.status = plan["status"].allocate(self.device)
        self._prefix = prefix_page_table_ref if reference else prefix_page_table
        self._draft_tables = draft_decode_page_tables_ref if reference else draft_decode_page_tables
        self._verify_expand = (
            verify_expand_page_table_ref if reference else verify_expand_page_table
        )
        k, n, bs = cfg.topk, cfg.num_draft_tokens, cfg.max_bs

        def layout(width: int, rows: int, key: str) -> UniformQueryLayout:
            return UniformQueryLayout.create(width, rows, self.device, out=self.buffers[key])

        self._q_draft = layout(k, bs, "draft_decode.cu_seqlens_q")
        self._q_verify = layout(n, bs, "target_verify.cu_seqlens_q")
        self._q_extend = layout(n, bs, "draft_extend.cu_seqlens_q")
        if k > 1:
            self._q_draft_expand = layout(1, bs * k, "draft_decode.expand_cu_seqlens_q")
            self._q_verify_expand = layout(1, bs * n, "target_verify.expand_cu_seqlens_q")

    # ----------------------------------------------------------------------------------------
    def _check(self, mode: str, *args, **kwargs) -> BuildInputs:
        """Every host check of one build (:func:`~specmeta.metadata.inputs.check_build_inputs`),
        before its first launch."""
        return check_build_inputs(
            f"FA3MetadataBuilder.{mode}", self.cfg, self.device, *args, **kwargs
        )

    def _status(self, status: torch.Tensor | None) -> torch.Tensor:
        return self.status if status is None else status

    def _max_len(self, inputs: BuildInputs, whole_pages: bool = False) -> int:
        """``max L`` (or ``max L − lpl``) from the CPU mirror, else the planned bound."""
        lens_cpu = inputs.seq_lens_cpu
        if lens_cpu is None:
            return self.cfg.max_context_len
        if whole_pages:
            lens_cpu = lens_cpu - lens_cpu % self.cfg.page_size
        return int(lens_cpu.max()) if lens_cpu.numel() else 0

    def _max_lpl(self, inputs: BuildInputs) -> int:
        """``max(L mod ps)`` from the CPU mirror, else ``ps − 1`` (0 when ``ps == 1``)."""
        ps, lens_cpu = self.cfg.page_size, inputs.seq_lens_cpu
        if lens_cpu is None:
            return ps - 1
        return int((lens_cpu % ps).max()) if lens_cpu.numel() else 0

    # ----------------------------------------------------------------------------------------
    def _tables(self, mode: str, prefix: str = "") -> tuple[torch.Tensor, ...]:
        """``(page_table, cache_seqlens, cu_seqlens_k)`` buffers of ``<mode>.<prefix>*``."""
        return tuple(
            self.buffers[f"{mode}.{prefix}{field}"]
            for field in ("page_table", "cache_seqlens", "cu_seqlens_k")
        )

    def draft_decode(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor | None = None,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
    ) -> tuple[FA3Cascade, ...]:
        """Metadata of every draft-decode step (design §3.2), one :class:`FA3Cascade` per step.

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            ``[B]``, ``[R, W_row]``, ``[B]`` int32 or int64 (``B ≤ max_bs``; pass the padded
            batch in a graph).
        out_cache_loc : torch.Tensor, optional
            ``[≥ B·K·S]`` draft slots laid out ``[B, K, S]``; required when ``K > 1``. In slot
            layout B the prefix-tail copies (``prefix_tail_copy_pairs``) must have been moved
            before the expand pass is *read*.
        seq_lens_cpu : torch.Tensor, optional
            ``[B]`` CPU mirror of ``seq_lens``: makes ``max_seqlen_k`` exact.
        num_rows : int, optional
            Steps to build, ``0 ≤ rows ≤ S`` (default ``S``; the engine runs ``S − 1``
            forwards).
        status : torch.Tensor, optional
            ``int32 [1]`` status word of every launch; default :attr:`status`.

        Returns
        -------
        tuple of FA3Cascade
            Step ``s``: ``K == 1`` → ``normal`` only, ``cache_seqlens = L + s + 1``,
            ``max_seqlen_q = 1``; ``K > 1`` → ``normal`` (stride ``K``, non-causal,
            ``cache_seqlens = L`` or ``L − lpl`` in layout B; the same object every step) and
            ``expand`` (stride 1, ``cache_seqlens = lpl + s + 1``).
        """
        cfg = self.cfg
        K, S, ps = cfg.topk, cfg.num_steps, cfg.page_size
        where = "FA3MetadataBuilder.draft_decode"
        rows = check_num_rows(where, num_rows, S, default=S)
        if K > 1 and out_cache_loc is None:
            raise ValueError(
                f"{where}: out_cache_loc is required with topk={K} > 1 (the expand pass reads "
                "each branch's draft slots); pass the out_cache_loc of assign_draft_cache_locs"
            )
        inputs = self._check("draft_decode", req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, out_cache_loc=out_cache_loc,
                             status=status)  # fmt: skip
        B, status = inputs.batch, self._status(status)
        if rows == 0:
            return ()
        args = (req_pool_indices, req_to_token, seq_lens)
        pt, cs, cu = self._tables("draft_decode")
        cu_q = self._q_draft.cu_seqlens_q(B)
        if K == 1:
            # One table over L + rows tokens serves every step; lengths L + s + 1 per step.
            self._prefix(*args, page_size=ps, extra_tokens=1, num_rows=rows, page_table=pt[:B],
                         cache_seqlens=cs[:rows, :B], cu_seqlens_k=cu[:rows, : B + 1],
                         status=status)  # fmt: skip
            top = self._max_len(inputs)
            return tuple(
                FA3Cascade(
                    normal=FA3Metadata(
                        cache_seqlens=cs[s, :B],
                        page_table=pt[:B],
                        cu_seqlens_q=cu_q,
                        cu_seqlens_k_new=cu[s, : B + 1],
                        max_seqlen_q=1,
                        causal=False,  # one query row: nothing to mask
                        return_softmax_lse=False,
                        page_size=ps,
                        max_seqlen_k=top + s + 1,
                    ),
                    expand=None,
                )
                for s in range(rows)
            )
        # Both passes in one launch. Normal pass: the shared prefix, whole pages only in layout
        # B (the last partial page is the start of every branch's region, read by the expand
        # pass). Expand pass: every step's own chain of every branch.
        BK = B * K
        ept, ecs, ecu = self._tables("draft_decode", "expand_")
        self._draft_tables(*args, out_cache_loc, topk=K, num_steps=S, page_size=ps,
                           exclude_last_partial=cfg.layout_b, num_rows=rows, page_table=pt[:B],
                           cache_seqlens=cs[0, :B], cu_seqlens_k=cu[0, : B + 1],
                           expand_page_table=ept[:rows, :BK], expand_cache_seqlens=ecs[:rows, :BK],
                           expand_cu_seqlens_k=ecu[:rows, : BK + 1], status=status)  # fmt: skip
        normal = FA3Metadata(
            cache_seqlens=cs[0, :B],
            page_table=pt[:B],
            cu_seqlens_q=cu_q,
            cu_seqlens_k_new=cu[0, : B + 1],
            max_seqlen_q=K,
            causal=False,
            return_softmax_lse=True,
            page_size=ps,
            max_seqlen_k=self._max_len(inputs, whole_pages=cfg.layout_b),
        )
        cu_e = self._q_draft_expand.cu_seqlens_q(BK)
        lpl_max = self._max_lpl(inputs)
        return tuple(
            FA3Cascade(
                normal=normal,
                expand=FA3Metadata(
                    cache_seqlens=ecs[s, :BK],
                    page_table=ept[s, :BK],
                    cu_seqlens_q=cu_e,
                    cu_seqlens_k_new=ecu[s, : BK + 1],
                    max_seqlen_q=1,
                    causal=False,
                    return_softmax_lse=True,
                    page_size=ps,
                    max_seqlen_k=lpl_max + s + 1,
                ),
            )
            for s in range(rows)
        )

    def target_verify(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        status: torch.Tensor | None = None,
    ) -> FA3Cascade:
        """Metadata of target verify over the ``N``-token window ``row_i[L_i : L_i + N]``.

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            As in :meth:`draft_decode`.
        tree_mask : torch.Tensor, optional
            ``[B, N, N]`` bool ancestor mask; required when ``K > 1`` (not read when ``K == 1``:
            the chain is the causal mask).
        seq_lens_cpu, status
            As in :meth:`draft_decode`.

        Returns
        -------
        FA3Cascade
            ``K == 1``: ``normal`` only, ``cache_seqlens = L + N``, stride ``N``, causal.
            ``K > 1``: ``normal`` (``cache_seqlens = L``, stride ``N``, non-causal) and
            ``expand`` (one row per node ``i·N + j`` listing its ancestors' slots,
            ``page_size = 1``, stride 1).
        """
        cfg = self.cfg
        K, N, ps = cfg.topk, cfg.num_draft_tokens, cfg.page_size
        if K > 1 and tree_mask is None:
            raise ValueError(
                f"FA3MetadataBuilder.target_verify: tree_mask is required with topk={K} > 1; "
                f"pass the [B, N, N] bool ancestor mask of the draft tree (N = {N})"
            )
        inputs = self._check("target_verify", req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, tree_mask=tree_mask,
                             status=status)  # fmt: skip
        B, status = inputs.batch, self._status(status)
        args = (req_pool_indices, req_to_token, seq_lens)
        pt, cs, cu = self._tables("target_verify")
        extra = N if K == 1 else 0
        self._prefix(*args, page_size=ps, extra_tokens=extra, page_table=pt[:B],
                     cache_seqlens=cs[:B], cu_seqlens_k=cu[: B + 1], status=status)  # fmt: skip
        normal = FA3Metadata(
            cache_seqlens=cs[:B],
            page_table=pt[:B],
            cu_seqlens_q=self._q_verify.cu_seqlens_q(B),
            cu_seqlens_k_new=cu[: B + 1],
            max_seqlen_q=N,
            causal=K == 1,
            return_softmax_lse=K > 1,
            page_size=ps,
            max_seqlen_k=self._max_len(inputs) + extra,
        )
        if K == 1:
            return FA3Cascade(normal=normal, expand=None)
        BN = B * N
        ept, ecs, ecu = self._tables("target_verify", "expand_")
        self._verify_expand(*args, tree_mask, page_table=ept[:BN], cache_seqlens=ecs[:BN],
                            cu_seqlens_k=ecu[: BN + 1], status=status)  # fmt: skip
        expand = FA3Metadata(
            cache_seqlens=ecs[:BN],
            page_table=ept[:BN],
            cu_seqlens_q=self._q_verify_expand.cu_seqlens_q(BN),
            cu_seqlens_k_new=ecu[: BN + 1],
            max_seqlen_q=1,
            causal=False,
            return_softmax_lse=True,
            page_size=1,  # the table lists token slots
            max_seqlen_k=N,  # upper bound: a node has at most N ancestors (itself included)
        )
        return FA3Cascade(normal=normal, expand=expand)

    def draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        status: torch.Tensor | None = None,
    ) -> FA3Metadata:
        """Metadata of draft extend: ``N`` query rows per request (design §3.1),
        ``cache_seqlens = L + N``, causal bottom-right, row pages over ``L + N`` tokens.

        Parameters are those of :meth:`draft_decode`.
        """
        N, ps = self.cfg.num_draft_tokens, self.cfg.page_size
        inputs = self._check("draft_extend", req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, status=status)  # fmt: skip
        B, status = inputs.batch, self._status(status)
        pt, cs, cu = self._tables("draft_extend")
        self._prefix(req_pool_indices, req_to_token, seq_lens, page_size=ps, extra_tokens=N,
                     page_table=pt[:B], cache_seqlens=cs[:B], cu_seqlens_k=cu[: B + 1],
                     status=status)  # fmt: skip
        return FA3Metadata(
            cache_seqlens=cs[:B],
            page_table=pt[:B],
            cu_seqlens_q=self._q_extend.cu_seqlens_q(B),
            cu_seqlens_k_new=cu[: B + 1],
            max_seqlen_q=N,
            causal=True,
            return_softmax_lse=False,
            page_size=ps,
            max_seqlen_k=self._max_len(inputs) + N,
        )
