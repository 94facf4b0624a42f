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

from collections.abc import Iterable
from typing import Any

import torch

from ..config import SpecConfig
from ..kernels._common import check_id_spaces
from ..kernels.draft_decode_page_tables import (
    bind_draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from ..kernels.prefix_page_table import bind_prefix_page_table, prefix_page_table_ref
from ..kernels.verify_expand_page_table import (
    bind_verify_expand_page_table,
    verify_expand_page_table_ref,
)
from ..kernels.verify_expand_ragged import bind_verify_expand_ragged, verify_expand_ragged_ref
from ..stage import Stage
from .capabilities import CAPABILITIES
from .contract import MetadataBuilder
from .fa3_results import FA3Cascade, FA3DraftDecode, FA3Metadata
from .layout import UniformQueryLayout

__all__ = ["FA3Metadata", "FA3Cascade", "FA3DraftDecode", "FA3MetadataBuilder"]

_PREFIX = "fa3."
def _set_max(meta: FA3Metadata, value: int) -> None:
    """Rewrite ``meta.max_seqlen_k``, the one host scalar of a result that a stage's host part
    writes on every call (design §3.2). A result is frozen for its readers; the builder that
    owns it rewrites it, as its kernels rewrite its views."""
    object.__setattr__(meta, "max_seqlen_k", value)


class FA3MetadataBuilder(MetadataBuilder):
    """Builds FA3 metadata into persistent buffers planned for ``cfg``.

    Parameters
    ----------
    cfg : SpecConfig
        ``K``, ``S``, ``N``, ``ps``, ``max_bs``, ``W_row``: fixes every buffer's shape.
    device : torch.device or str
        Where the buffers live; the inputs of every build must be there too.
    modes : iterable of str, optional
        The modes served (``draft_decode``, ``target_verify``, ``draft_extend``; default all):
        only their buffers are allocated.
    reference : bool
        Build with the pure-torch references instead of the kernels (a test and benchmark
        baseline; it syncs).
    host_ops : bool
        Check ``seq_lens_cpu`` and read its ``max L`` and ``ΣL`` in one compiled call where
        :func:`specmeta.warmup` built it (default; :mod:`specmeta.metadata.host_ops`), else
        with torch ops.
    check_host_lengths : bool
        Check on the device that ``seq_lens_cpu`` agrees with ``seq_lens`` (default; see
        :class:`~specmeta.metadata.contract.MetadataBuilder`).

    Attributes
    ----------
    buffers : dict[str, torch.Tensor]
        The ``"fa3.*"`` buffers of the served modes, allocated zero-filled, keyed without the
        ``fa3.`` prefix (``"draft_decode.page_table"``), as in every builder.
    status : torch.Tensor
        ``int32 [1]``: the status word every method reports into unless given another (read it
        with :func:`specmeta.check_status`, which syncs).

    Examples
    --------
    >>> fa3 = FA3MetadataBuilder(cfg, "cuda")                     # once
    >>> steps = fa3.draft_decode(rpi, req_to_token, seq_lens, out_cache_loc)
    >>> o, lse = flash_attn_with_kvcache(q, k, v, **steps[0].normal.kwargs())
    >>> stage = fa3.bind_draft_decode(rpi, req_to_token, seq_lens, out_cache_loc)  # once
    >>> steps = stage.host(seq_lens_cpu); stage.launch()          # every step, or in a graph
    """

    plan_prefix = _PREFIX
    capabilities = CAPABILITIES["fa3"]
    #: FlashAttention's own window of every chain result, ``(w − 1, 0)`` for a window layer.
    window_size: tuple[int, int] | None = None

    def __new__(cls, *args: Any, sliding_window_size: int | None = None, **kwargs: Any):
        """A window layer's builder (``sliding_window_size = w``, design §2.10) is an
        :class:`~.fa3_window.FA3WindowBuilder`."""
        if sliding_window_size and cls is FA3MetadataBuilder:
            from .fa3_window import FA3WindowBuilder

            cls = FA3WindowBuilder
        return super().__new__(cls)

    def __init__(
        self,
        cfg: SpecConfig,
        device: torch.device | str,
        *,
        modes: Iterable[str] | None = None,
        reference: bool = False,
        host_ops: bool = True,
        check_host_lengths: bool = True,
        sliding_window_size: int | None = None,
    ):
        del sliding_window_size  # a full layer's builder (see __new__)
        super().__init__(cfg, device, modes=modes, reference=reference, host_ops=host_ops,
                         check_host_lengths=check_host_lengths)  # fmt: skip
        self.buffers = self.allocate_planned()
        k, n, bs = cfg.topk, cfg.num_draft_tokens, cfg.max_bs
        self._q: dict[str, UniformQueryLayout] = {}
        widths = {"draft_decode": (k, 1, k), "target_verify": (n, 1, n), "draft_extend": (n,)}
        for mode in self.modes:
            # The normal pass: Q rows a request; K > 1 also the expand pass: one row a sequence.
            self._q[mode] = UniformQueryLayout.create(
                widths[mode][0], bs, self.device, out=self.buffers[f"{mode}.cu_seqlens_q"]
            )
            expand = f"{mode}.expand_cu_seqlens_q"  # a window builder plans none (chains)
            if (k > 1 or mode == "target_verify") and expand in self.buffers:
                self._q[f"{mode}.expand"] = UniformQueryLayout.create(
                    1, bs * widths[mode][2], self.device,
                    out=self.buffers[expand],
                )  # fmt: skip

    def _id_spaces(self, mode: str, v2p: Any, entry_page_size: int,
                   full_to_swa: Any = None) -> dict:  # fmt: skip
        """The kernels' id-space keywords of a build (design §2.10), ``v2p`` checked on the
        host first: the rows' page ids of ``entry_page_size`` positions, ids through the page
        map ``v2p`` at the config's page size (``check`` has counted the rows in pages), and
        a window layer's rail and map (:meth:`_window_tables`)."""
        check_id_spaces(self.require(mode), 0, 0, entry_page_size, v2p, self.device)
        return dict(entry_page_size=entry_page_size, v2p=v2p,
                    **self._window_tables(mode, full_to_swa))  # fmt: skip

    def _window_tables(self, mode: str, full_to_swa: Any) -> dict:
        """A window layer's page-table keywords (design §2.10): none for a full layer's
        builder, whose tables hold full-pool pages and which so refuses a window map."""
        if full_to_swa is not None:
            raise ValueError(f"{self.require(mode)}: full_to_swa was given, but this builder "
                             "serves full layers; build a window layer's tables with "
                             "FA3MetadataBuilder(cfg, device, sliding_window_size=w) "
                             "(design §2.10)")  # fmt: skip
        return {}

    def _tables(self, mode: str, prefix: str = "") -> tuple[torch.Tensor, ...]:
        """``(page_table, cache_seqlens, cu_seqlens_k)`` buffers of ``<mode>.<prefix>*``."""
        return tuple(
            self.buffers[f"{mode}.{prefix}{field}"]
            for field in ("page_table", "cache_seqlens", "cu_seqlens_k")
        )

    def _stage(self, mode: str, B: int, launches: list, result: Any, maxima: list,
               *, whole_pages: bool = False, verify: Any = None) -> Stage:  # fmt: skip
        """The stage of ``mode``: ``launches``, and the host part that checks ``seq_lens_cpu``
        and writes the normal passes' ``max_seqlen_k``: ``top + extra`` for each
        ``(meta, extra)`` of ``maxima``, ``top`` the exact ``max L`` (rounded down to whole pages
        with ``whole_pages``: ``max L − lpl``, as rounding keeps the order of lengths), or the
        planned ``max_context_len`` without ``seq_lens_cpu``. An expand pass's maximum is its
        bound (``ps − 1 + s + 1`` in draft decode, ``N`` in target verify): it reads at most a
        page and the steps, so an exact one would change no tile count. A ragged verify passes
        ``verify``, the check of the optional ``verify_lens_cpu`` (FA3 reads its query offsets
        on the device: the host copy is only checked, and published for the stale check)."""
        ps, bound = self.cfg.page_size, self.cfg.max_context_len
        self.require(mode)

        def host(seq_lens_cpu: torch.Tensor | None, verify_lens_cpu: Any = None) -> Any:
            found = self.lengths(mode, B, seq_lens_cpu)
            self.verify_host(mode, verify, verify_lens_cpu)
            if found is None:
                top = bound
            else:
                top = found[0] - found[0] % ps if whole_pages else found[0]
            for meta, extra in maxima:
                _set_max(meta, top + extra)
            return result

        return Stage(launches, host=host)

    # ----------------------------------------------------------------------------------------
    def bind_draft_decode(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor | None = None,
        *,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> Stage:
        """:meth:`draft_decode` bound once to these tensors (arguments as there): the stage
        launches with ``launch()`` and returns the :class:`FA3DraftDecode` from
        ``host(seq_lens_cpu)``, which writes its ``max_seqlen_k``."""
        cfg = self.cfg
        K, S, ps = cfg.topk, cfg.num_steps, cfg.page_size
        rows = self.draft_rows("draft_decode", num_rows)  # also checks the mode is served
        if K > 1 and out_cache_loc is None:
            raise ValueError(
                f"{type(self).__name__}.draft_decode: out_cache_loc is required with "
                f"topk={K} > 1 (the expand pass reads each branch's draft slots); pass the "
                "out_cache_loc of assign_draft_cache_locs"
            )
        B = self.check("draft_decode", req_pool_indices, req_to_token, seq_lens,
                       out_cache_loc=out_cache_loc, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._id_spaces("draft_decode", v2p, entry_page_size, full_to_swa)
        status = self.status_word(status)
        check = self.host_check("draft_decode", seq_lens, status)
        if rows == 0:
            return self._stage("draft_decode", B, [check], FA3DraftDecode(()), [])
        out, result = self.views(("draft_decode", B, rows), self._draft_views, B, rows)
        args = (req_pool_indices, req_to_token, seq_lens)
        if K == 1:
            # One table over L + rows tokens serves every step; lengths L + s + 1 per step.
            kw = dict(page_size=ps, extra_tokens=1, num_rows=rows, status=status, **spaces, **out)
            launch = self._launch(bind_prefix_page_table, prefix_page_table_ref, *args, **kw)
            maxima = [(step.normal, s + 1) for s, step in enumerate(result.steps)]
            return self._stage("draft_decode", B, [launch, check], result, maxima)
        # Both passes in one launch. Normal pass: the shared prefix, whole pages only in layout
        # B (the last partial page is the start of every branch's region, read by the expand
        # pass). Expand pass: every step's own chain of every branch.
        kw = dict(topk=K, num_steps=S, page_size=ps, exclude_last_partial=cfg.layout_b,
                  num_rows=rows, status=status, **spaces, **out)  # fmt: skip
        launch = self._launch(bind_draft_decode_page_tables, draft_decode_page_tables_ref, *args,
                              out_cache_loc, **kw)  # fmt: skip
        return self._stage("draft_decode", B, [launch, check], result,
                           [(result.steps[0].normal, 0)],
                           whole_pages=cfg.layout_b)  # fmt: skip

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
        launch: bool = True,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> FA3DraftDecode:
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
            ``[B]`` CPU mirror of ``seq_lens``: makes the normal pass's ``max_seqlen_k``
            exact (an expand pass's is its bound).
        num_rows : int, optional
            Steps to build, ``0 ≤ rows ≤ S``; default ``S − 1``, the draft forwards.
        status : torch.Tensor, optional
            ``int32 [1]`` status word of every launch; default :attr:`status`.
        launch : bool
            ``False``: launch nothing (the kernels run inside a captured graph); the host
            scalars (``max_seqlen_k``) still follow ``seq_lens_cpu``.
        v2p : torch.Tensor, optional
            ``[P]`` int32 or int64 virtual → physical page map at the config's page size
            (design §2.10): ``req_to_token`` holds virtual ids, and the page tables the
            physical pages (an id that does not map: the sink page 0 and ``BAD_KV_ID``). The
            expand pass reads ``out_cache_loc`` as it is: physical draft slots, as
            ``assign_draft_cache_locs(v2p=...)`` emits them.
        entry_page_size : int
            ``E ≥ 1``: with ``E > 1`` the rows hold page ids of ``E`` positions each
            (design §2.10), and a row needs ``ceil(row_width_need / E)`` entries.
        full_to_swa : torch.Tensor, optional
            A window layer's ``[P_full]`` full → window pool map (design §2.10), taken only by
            a window builder (``FA3MetadataBuilder(cfg, device, sliding_window_size=w)``): its
            page tables hold window-pool pages (:mod:`~specmeta.metadata.fa3_window`).

        Returns
        -------
        FA3DraftDecode
            ``steps[s]``, an :class:`FA3Cascade`: ``K == 1`` → ``normal`` only,
            ``cache_seqlens = L + s + 1``, ``max_seqlen_q = 1``; ``K > 1`` → ``normal`` (stride
            ``K``, non-causal, ``cache_seqlens = L`` or ``L − lpl`` in layout B; the same object
            every step) and ``expand`` (stride 1, ``cache_seqlens = lpl + s + 1``). A view of
            the builder's buffers: the next call of the mode for the same batch size rewrites
            it, ``max_seqlen_k`` included.
        """
        stage = self.bind_draft_decode(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                       num_rows=num_rows, status=status, v2p=v2p,
                                       entry_page_size=entry_page_size,
                                       full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _draft_views(self, B: int, rows: int) -> tuple[dict, FA3DraftDecode]:
        """The launch's output views of ``draft_decode`` for ``B`` requests and ``rows``
        steps, and the :class:`FA3DraftDecode` that reads them."""
        K, ps = self.cfg.topk, self.cfg.page_size
        pt, cs, cu = self._tables("draft_decode")
        cu_q = self._q["draft_decode"].cu_seqlens_q(B)
        if K == 1:
            out = dict(page_table=pt[:B], cache_seqlens=cs[:rows, :B],
                       cu_seqlens_k=cu[:rows, : B + 1])  # fmt: skip
            return out, FA3DraftDecode(tuple(
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
                        max_seqlen_k=0,  # written by the stage's host part
                        window_size=self.window_size,
                    ),
                    expand=None,
                )
                for s in range(rows)
            ))  # fmt: skip
        BK = B * K
        ept, ecs, ecu = self._tables("draft_decode", "expand_")
        out = dict(page_table=pt[:B], cache_seqlens=cs[0, :B], cu_seqlens_k=cu[0, : B + 1],
                   expand_page_table=ept[:rows, :BK], expand_cache_seqlens=ecs[:rows, :BK],
                   expand_cu_seqlens_k=ecu[:rows, : BK + 1])  # fmt: skip
        normal = FA3Metadata(
            cache_seqlens=out["cache_seqlens"],
            page_table=out["page_table"],
            cu_seqlens_q=cu_q,
            cu_seqlens_k_new=out["cu_seqlens_k"],
            max_seqlen_q=K,
            causal=False,
            return_softmax_lse=True,
            page_size=ps,
            max_seqlen_k=0,  # written by the stage's host part
        )
        cu_e = self._q["draft_decode.expand"].cu_seqlens_q(BK)
        return out, FA3DraftDecode(tuple(
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
                    max_seqlen_k=ps - 1 + s + 1,
                ),
            )
            for s in range(rows)
        ))  # fmt: skip

    def bind_target_verify(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        *,
        status: torch.Tensor | None = None,
        verify_lens: torch.Tensor | None = None,
        num_tokens: int | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> Stage:
        """:meth:`target_verify` bound once to these tensors (arguments as there): the stage
        launches with ``launch()`` and returns the :class:`FA3Cascade` from
        ``host(seq_lens_cpu)`` (``host(seq_lens_cpu, verify_lens_cpu=...)``, the copy
        optional, for a ragged verify)."""
        cfg = self.cfg
        K, N, ps = cfg.topk, cfg.num_draft_tokens, cfg.page_size
        where = self.require("target_verify")
        if K > 1 and tree_mask is None:
            raise ValueError(
                f"{where}: tree_mask is required with topk={K} > 1; "
                f"pass the [B, N, N] bool ancestor mask of the draft tree (N = {N})"
            )
        B = self.check("target_verify", req_pool_indices, req_to_token, seq_lens,
                       tree_mask=tree_mask if K > 1 else None, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._id_spaces("target_verify", v2p, entry_page_size, full_to_swa)
        if verify_lens is not None or num_tokens is not None:
            return self._bind_ragged_verify(B, (req_pool_indices, req_to_token, seq_lens),
                                            tree_mask if K > 1 else None, verify_lens,
                                            num_tokens, status, spaces)  # fmt: skip
        status = self.status_word(status)
        out, result = self.views(("target_verify", B), self._verify_views, B)
        args = (req_pool_indices, req_to_token, seq_lens)
        extra = N if K == 1 else 0
        kw = dict(page_size=ps, extra_tokens=extra, status=status, **spaces, **out["normal"])
        launches = [self._launch(bind_prefix_page_table, prefix_page_table_ref, *args, **kw)]
        if K > 1:
            # The expand pass lists token slots: each the id emitted at its window position.
            kw = dict(status=status, page_size=ps, **spaces, **out["expand"])
            launches.append(self._launch(bind_verify_expand_page_table,
                                         verify_expand_page_table_ref, *args, tree_mask, **kw))  # fmt: skip
        launches.append(self.host_check("target_verify", seq_lens, status))
        return self._stage("target_verify", B, launches, result, [(result.normal, extra)])

    def _bind_ragged_verify(self, B: int, args: tuple, tree_mask: torch.Tensor | None,
                            verify_lens: Any, num_tokens: Any, status: torch.Tensor | None,
                            spaces: dict) -> Stage:  # fmt: skip
        """A ragged target verify (design §2.9): a cascade for every ``K``. The padding of
        ``verify_lens`` to the bucket, the normal pass (each request's prefix, ``L`` keys, for
        its ``v_i`` query rows at ``qo_indptr[i]``) and the expand pass (one row a query token:
        :func:`~specmeta.kernels.verify_expand_ragged.verify_expand_ragged`)."""
        N, ps = self.cfg.num_draft_tokens, self.cfg.page_size
        pad, _, T, verify = self.bind_bucket("target_verify", B, verify_lens, num_tokens, status)
        status = self.status_word(status)
        out, result = self.views(("target_verify.ragged", B, T), self._ragged_views, B, T)
        qo = self.buffers["target_verify.ragged_qo_indptr"][: B + 1]
        pages = dict(page_size=ps, **spaces)  # the rows' id space (design §2.10)
        launches = [
            pad,
            self._launch(bind_prefix_page_table, prefix_page_table_ref, *args, **pages,
                         extra_tokens=0, status=status, **out["normal"]),
            self._launch(bind_verify_expand_ragged, verify_expand_ragged_ref, *args, tree_mask,
                         qo, num_rows=T, num_draft_tokens=N, status=status, **pages,
                         **out["expand"]),
            self.host_check("target_verify", args[2], status),
            self.verify_check(verify_lens, status),
        ]  # fmt: skip
        return self._stage("target_verify", B, launches, result, [(result.normal, 0)],
                           verify=verify)  # fmt: skip

    def _ragged_views(self, B: int, T: int) -> tuple[dict, FA3Cascade]:
        """The output views of a ragged target verify over a bucket of ``B`` requests and
        ``T`` tokens, and the :class:`FA3Cascade` that reads them."""
        N, ps = self.cfg.num_draft_tokens, self.cfg.page_size
        pt, cs, cu = self._tables("target_verify")
        ept, ecs, ecu = self._tables("target_verify", "expand_")
        out = {"normal": dict(page_table=pt[:B], cache_seqlens=cs[:B], cu_seqlens_k=cu[: B + 1]),
               "expand": dict(page_table=ept[:T], cache_seqlens=ecs[:T],
                              cu_seqlens_k=ecu[: T + 1])}  # fmt: skip
        normal = FA3Metadata(
            cache_seqlens=cs[:B], page_table=pt[:B],
            cu_seqlens_q=self.buffers["target_verify.ragged_qo_indptr"][: B + 1],
            cu_seqlens_k_new=cu[: B + 1], max_seqlen_q=T, causal=False, return_softmax_lse=True,
            page_size=ps, max_seqlen_k=0,  # written by the stage's host part
        )  # fmt: skip
        expand = FA3Metadata(
            cache_seqlens=ecs[:T], page_table=ept[:T],
            cu_seqlens_q=self._q["target_verify.expand"].cu_seqlens_q(T),
            cu_seqlens_k_new=ecu[: T + 1], max_seqlen_q=1, causal=False, return_softmax_lse=True,
            page_size=1, max_seqlen_k=N,  # a row lists at most the window's N nodes
        )  # fmt: skip
        return out, FA3Cascade(normal=normal, expand=expand)

    def target_verify(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
        verify_lens: torch.Tensor | None = None,
        verify_lens_cpu: torch.Tensor | None = None,
        num_tokens: int | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> FA3Cascade:
        """Metadata of target verify over the ``N``-token window ``row_i[L_i : L_i + N]``.

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            As in :meth:`draft_decode`.
        tree_mask : torch.Tensor, optional
            ``[B, N, N]`` bool ancestor mask; required when ``K > 1`` (not read when ``K == 1``:
            the chain is the causal mask).
        seq_lens_cpu, status, launch
            As in :meth:`draft_decode`.
        verify_lens : torch.Tensor, optional
            A ragged verify (design §2.9): ``[B' ≤ B]`` int32 or int64 on the device, real
            request ``b`` verifies its first ``v_b ≤ N`` nodes; the batch is the captured
            bucket's ``B`` requests, and the lengths are padded on the device to the bucket of
            ``num_tokens`` (:func:`specmeta.pad_verify_lens_to_bucket`).
        verify_lens_cpu : torch.Tensor, optional
            ``[B']`` on the CPU, equal to ``verify_lens``: optional (FA3 reads the query
            offsets on the device); when given it is checked on the host (each in ``[0, N]``,
            the sum at most ``num_tokens``) and on the device against ``verify_lens``.
        num_tokens : int, optional
            ``T``, the bucket's query tokens (``0 ≤ T ≤ B·N``); required with ``verify_lens``.
        v2p, entry_page_size, full_to_swa
            The rows' id space, as in :meth:`draft_decode`: the normal pass's pages and the
            expand pass's token slots are those of the ids emitted.

        Returns
        -------
        FA3Cascade
            ``K == 1``: ``normal`` only, ``cache_seqlens = L + N``, stride ``N``, causal.
            ``K > 1``: ``normal`` (``cache_seqlens = L``, stride ``N``, non-causal) and
            ``expand`` (one row per node ``i·N + j`` listing its ancestors' slots,
            ``page_size = 1``, stride 1). Ragged, every ``K``: ``normal`` over the prefix
            (``cu_seqlens_q`` the padded lengths' offsets, ``max_seqlen_q = T``) and ``expand``
            (one row a query token, ``T`` rows).
        """
        stage = self.bind_target_verify(req_pool_indices, req_to_token, seq_lens, tree_mask,
                                        status=status, verify_lens=verify_lens,
                                        num_tokens=num_tokens, v2p=v2p,
                                        entry_page_size=entry_page_size,
                                        full_to_swa=full_to_swa)  # fmt: skip
        if launch:
            return stage(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)
        return stage.host(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)

    def _verify_views(self, B: int) -> tuple[dict, FA3Cascade]:
        """The launches' output views of target verify for ``B`` requests (``normal``,
        ``expand``) and the :class:`FA3Cascade` that reads them."""
        K, N, ps = self.cfg.topk, self.cfg.num_draft_tokens, self.cfg.page_size
        pt, cs, cu = self._tables("target_verify")
        out = {"normal": dict(page_table=pt[:B], cache_seqlens=cs[:B], cu_seqlens_k=cu[: B + 1])}
        normal = FA3Metadata(
            cache_seqlens=out["normal"]["cache_seqlens"],
            page_table=out["normal"]["page_table"],
            cu_seqlens_q=self._q["target_verify"].cu_seqlens_q(B),
            cu_seqlens_k_new=out["normal"]["cu_seqlens_k"],
            max_seqlen_q=N,
            causal=K == 1,
            return_softmax_lse=K > 1,
            page_size=ps,
            max_seqlen_k=0,  # written by the stage's host part
            window_size=self.window_size,
        )
        if K == 1:
            return out, FA3Cascade(normal=normal, expand=None)
        BN = B * N
        ept, ecs, ecu = self._tables("target_verify", "expand_")
        out["expand"] = dict(
            page_table=ept[:BN], cache_seqlens=ecs[:BN], cu_seqlens_k=ecu[: BN + 1]
        )
        expand = FA3Metadata(
            cache_seqlens=out["expand"]["cache_seqlens"],
            page_table=out["expand"]["page_table"],
            cu_seqlens_q=self._q["target_verify.expand"].cu_seqlens_q(BN),
            cu_seqlens_k_new=out["expand"]["cu_seqlens_k"],
            max_seqlen_q=1,
            causal=False,
            return_softmax_lse=True,
            page_size=1,  # the table lists token slots
            max_seqlen_k=N,  # upper bound: a node has at most N ancestors (itself included)
        )
        return out, FA3Cascade(normal=normal, expand=expand)

    def bind_draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        status: torch.Tensor | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> Stage:
        """:meth:`draft_extend` bound once to these tensors (arguments as there)."""
        N, ps = self.cfg.num_draft_tokens, self.cfg.page_size
        B = self.check("draft_extend", req_pool_indices, req_to_token, seq_lens, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._id_spaces("draft_extend", v2p, entry_page_size, full_to_swa)
        out, result = self.views(("draft_extend", B), self._extend_views, B)
        args = (req_pool_indices, req_to_token, seq_lens)
        status = self.status_word(status)
        kw = dict(page_size=ps, extra_tokens=N, status=status, **spaces, **out)
        launch = self._launch(bind_prefix_page_table, prefix_page_table_ref, *args, **kw)
        check = self.host_check("draft_extend", seq_lens, status)
        return self._stage("draft_extend", B, [launch, check], result, [(result, N)])

    def draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
        full_to_swa: torch.Tensor | None = None,
    ) -> FA3Metadata:
        """Metadata of draft extend: ``N`` query rows per request (design §3.1),
        ``cache_seqlens = L + N``, causal bottom-right, row pages over ``L + N`` tokens.

        Parameters are those of :meth:`draft_decode` (``v2p``, ``entry_page_size``: the rows'
        id space; ``full_to_swa``: a window layer's map).
        """
        stage = self.bind_draft_extend(req_pool_indices, req_to_token, seq_lens, status=status,
                                       v2p=v2p, entry_page_size=entry_page_size,
                                       full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _extend_views(self, B: int) -> tuple[dict, FA3Metadata]:
        """The launch's output views of draft extend for ``B`` requests, and its result."""
        N, ps = self.cfg.num_draft_tokens, self.cfg.page_size
        pt, cs, cu = self._tables("draft_extend")
        out = dict(page_table=pt[:B], cache_seqlens=cs[:B], cu_seqlens_k=cu[: B + 1])
        return out, FA3Metadata(
            cache_seqlens=out["cache_seqlens"],
            page_table=out["page_table"],
            cu_seqlens_q=self._q["draft_extend"].cu_seqlens_q(B),
            cu_seqlens_k_new=out["cu_seqlens_k"],
            max_seqlen_q=N,
            causal=True,
            return_softmax_lse=False,
            page_size=ps,
            max_seqlen_k=0,  # written by the stage's host part
            window_size=self.window_size,
        )
