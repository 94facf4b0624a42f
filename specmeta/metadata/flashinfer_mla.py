"""FlashInfer MLA metadata (design §3.5): ``flashinfer.mla.BatchMLAPagedAttentionWrapper``'s
CSR lists for draft decode, target verify and draft extend, chains and draft trees.

A :class:`FlashInferMLABuilder` allocates its buffers from :func:`~specmeta.plan_buffers` (keys
``flashinfer_mla.<mode>.<field>``) and writes the query offsets once (design §3.1). A mode's
stage (``bind_<mode>``) launches the sync-free kernels with ``stage.launch()``;
``stage.host(seq_lens_cpu)`` writes the host mirrors ``plan()`` reads (``qo_indptr``,
``kv_indptr``, ``kv_len_arr``: FlashInfer's MLA planner reads all three on the host) into the
ring's next set and returns the result.

=====================  ==============================================================  =========
mode                   passes (``plan()``/``run()`` calls)                               page size
=====================  ==============================================================  =========
draft decode, K == 1   per step: a row a request, its pages over ``L + s + 1`` tokens    ``ps``
draft decode, K > 1    prefix (each prefix once, ``K`` rows, non-causal) + per step      1
                       ancestors (a row a branch, its ``s + 1`` own slots)
target verify, K == 1  ``N`` causal rows over ``row[0 : L + N]``                          1
target verify, K > 1   prefix (each prefix once, ``N`` rows, non-causal) + ancestors     1
                       (a row a node, its ancestors' and its own window slots)
draft extend           ``N`` causal rows over ``row[0 : L + N]`` (any ``K``: a chain)     1
=====================  ==============================================================  =========

``plan()`` reads every list's length on the host: a tree verify's ancestor counts come from
``node_depths_cpu``, the engine's host copy of its tree's node depths, checked on the device
against the mask's (design §3.5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy
import torch

from ..config import SpecConfig, plan_buffers
from ..kernels._common import check_id_spaces
from ..kernels.branch_kv_indices import bind_branch_kv_indices, branch_kv_indices_ref
from ..kernels.host_list_lengths import (
    bind_check_host_list_lengths,
    check_host_list_lengths_ref,
    publish_host_list_lengths,
)
from ..kernels.shared_prefix_kv_indices import (
    bind_shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from ..kernels.tree_ancestor_kv_indices import (
    bind_tree_ancestor_kv_indices,
    tree_ancestor_host_mirrors_torch,
    tree_ancestor_kv_indices_ref,
)
from ..kernels.verify_kv_indices import bind_verify_kv_indices, verify_kv_indices_ref
from ..stage import Stage
from . import host_ops
from .capabilities import CAPABILITIES
from .contract import MetadataBuilder
from .flashinfer_mla_results import (
    FlashInferMLAAttention,
    FlashInferMLADraftDecode,
    FlashInferMLAPass,
)
from .host_mirrors import HostMirrorRing
from .host_ops import LengthRule
from .inputs import check_node_depths_cpu
from .layout import UniformQueryLayout

__all__ = ["FlashInferMLABuilder", "FlashInferMLAPass", "FlashInferMLAAttention",
           "FlashInferMLADraftDecode"]  # fmt: skip

_PREFIX = "flashinfer_mla."
# Host mirrors that change with the batch, by mode: they come from a ring (design §3.3). The
# other *_host buffers hold values fixed at construction (query offsets, the chains' offsets).
_PER_BATCH_MIRRORS = {
    "draft_decode": ("kv_indptr_host", "kv_len_arr_host", "kv_last_page_len_host",
                     "prefix_kv_indptr_host", "prefix_kv_len_arr_host"),
    "target_verify": ("kv_indptr_host", "kv_len_arr_host", "prefix_kv_indptr_host",
                      "prefix_kv_len_arr_host", "ancestor_kv_indptr_host",
                      "ancestor_kv_len_arr_host"),
    "draft_extend": ("kv_indptr_host", "kv_len_arr_host"),
}  # fmt: skip


class FlashInferMLABuilder(MetadataBuilder):
    """FlashInfer MLA metadata for one :class:`~specmeta.SpecConfig`, in planned buffers.

    Parameters
    ----------
    cfg : SpecConfig
        ``K``, ``S``, ``N``, ``ps`` and the capacity (``max_bs``, ``max_context_len``). A config
        with a draft window is refused for draft decode (no window is built here).
    device : torch.device or str
        Where the lists live; the ``*_host`` mirrors live on the CPU, pinned for CUDA.
    modes : iterable of str, optional
        ``draft_decode``, ``target_verify``, ``draft_extend``; default all. Only their buffers
        are allocated.
    reference : bool
        Build with the pure-torch references (a test baseline; it syncs).
    mirror_depth : int
        Sets of per-batch host mirrors used in turn (default 16; :mod:`.host_mirrors`): an
        engine may build ``mirror_depth // 2`` iterations ahead of the device.
    host_ops, check_host_lengths
        As in :class:`~specmeta.metadata.contract.MetadataBuilder`.

    Examples
    --------
    >>> mla = FlashInferMLABuilder(cfg, "cuda")
    >>> stage = mla.bind_draft_decode(rpi, req_to_token, seq_lens, num_rows=1)     # once
    >>> step = stage.host(seq_lens_cpu)[0]; stage.launch()                        # every step
    >>> for p in step.passes:
    ...     wrapper.plan(**p.plan_kwargs(), num_heads=16, head_dim_ckv=512, ...)
    """

    plan_prefix = _PREFIX
    capabilities = CAPABILITIES["flashinfer_mla"]

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 modes: Iterable[str] | None = None, reference: bool = False,
                 mirror_depth: int = 16, host_ops: bool = True,
                 check_host_lengths: bool = True):  # fmt: skip
        super().__init__(cfg, device, modes=modes, reference=reference, host_ops=host_ops,
                         check_host_lengths=check_host_lengths)  # fmt: skip
        plan, pin = plan_buffers(cfg), self.device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}
        ring_specs: dict[str, dict] = {mode: {} for mode in self.modes}
        for key in self.plan_keys(cfg, self.modes):
            name = key[len(_PREFIX) :]
            mode, field = name.split(".", 1)
            if field in _PER_BATCH_MIRRORS[mode]:
                ring_specs[mode][field] = plan[key]
            elif field.endswith("_host"):
                buf = plan[key].allocate("cpu")
                self.buffers[name] = buf.pin_memory() if pin else buf
            else:
                self.buffers[name] = plan[key].allocate(self.device)
        self._mirrors = {mode: HostMirrorRing(specs, mirror_depth, self.device)
                         for mode, specs in ring_specs.items()}  # fmt: skip
        k, s, n, bs, buf = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.max_bs, self.buffers
        # Query offsets, written once for the largest batch on the device and on the host.
        self._layouts: dict[str, UniformQueryLayout] = {}
        for name, key, width, rows in (
            ("draft_decode", "draft_decode.qo_indptr", 1, bs),
            ("prefix", "draft_decode.prefix_qo_indptr", k, bs),
            ("ancestors", "draft_decode.ancestor_qo_indptr", 1, bs * k),
            ("target_verify", "target_verify.qo_indptr", n, bs),
            ("verify_prefix", "target_verify.prefix_qo_indptr", n, bs),
            ("verify_ancestors", "target_verify.ancestor_qo_indptr", 1, bs * n),
            ("draft_extend", "draft_extend.qo_indptr", n, bs),
        ):
            if key in buf:
                self._layouts[name] = UniformQueryLayout.create(width, rows, self.device,
                                                                out=buf[key])  # fmt: skip
                UniformQueryLayout.create(width, rows, "cpu", out=buf[f"{key}_host"])
        if "draft_decode.ancestor_kv_indptr_host" in buf:
            # The chains' lists do not depend on the batch: branch z of step s holds s + 1
            # slots at z·(s + 1).
            z = torch.arange(bs * k + 1, dtype=torch.int32)
            for row in range(s):
                buf["draft_decode.ancestor_kv_indptr_host"][row] = z * (row + 1)
                buf["draft_decode.ancestor_kv_len_arr_host"][row] = row + 1
        # The mirror writers (host_ops) check every length against the plan's range and write
        # the offsets: of L for draft decode, of L + N for verify and extend.
        rules = {n: LengthRule(cfg.max_context_len, n), 0: LengthRule(cfg.max_context_len)}
        self._length_rules = {mode: rules[0 if mode == "draft_decode" else n]
                              for mode in self.modes}  # fmt: skip
        self._length_rules["prefix"] = rules[0]  # a cascade's prefix pass: L keys a request

    # -- the stages -----------------------------------------------------------------------------
    def _spaces(self, mode: str, v2p: Any, entry_page_size: Any) -> dict:
        """The kernels' id-space keywords of a build (design §2.10), ``v2p`` checked on the
        host first (``check`` has counted the rows' width in pages of ``entry_page_size``)."""
        check_id_spaces(self.require(mode), 0, 0, entry_page_size, v2p, self.device)
        return dict(entry_page_size=entry_page_size, v2p=v2p)

    def _stage(self, mode: str, B: int, key: tuple, launches: list, make: Callable,
               seq_lens: torch.Tensor, status: torch.Tensor, *,
               tree: bool = False) -> Stage:  # fmt: skip
        """The stage of ``mode`` for ``B`` requests: ``launches``, then the check of the host's
        lengths; its host part checks ``seq_lens_cpu`` (every value, named, before anything is
        written) and publishes it for that check, takes the ring's turn, writes the set's
        mirrors and returns the set's result. ``make(B, *key, mirrors, compiled)`` makes a set's
        result and writer once; the writer is the compiled one where :func:`specmeta.warmup`
        built the host ops and :attr:`host_ops` asks for them, else numpy's: it checks the
        lengths itself and returns what it read (one call), and a refusal is then named by the
        checks. A tree
        verify (``tree``) also takes ``node_depths_cpu``, which its writer checks before it
        writes anything."""
        ring = self._mirrors[mode]
        made = tuple(self.views((mode, B, *key, c), _slots, len(ring.sets)) for c in (0, 1))
        where = self._where[mode]

        def host(seq_lens_cpu: torch.Tensor | None, node_depths_cpu: Any = None) -> Any:
            if seq_lens_cpu is None:
                raise ValueError(
                    f"{where}: seq_lens_cpu is None, but FlashInfer MLA's plan() reads the host "
                    "mirrors (qo_indptr_host, kv_indptr_host, kv_len_arr_host) that are written "
                    "from it; pass seq_lens_cpu=, the CPU copy of seq_lens the engine already "
                    "holds (a copy of seq_lens made here would sync with the device)")  # fmt: skip
            if tree:
                check_node_depths_cpu(where, node_depths_cpu, B, self.cfg.num_draft_tokens)
            elif node_depths_cpu is not None:
                raise ValueError(f"{where}: node_depths_cpu was given, but this stage builds "
                                 "no tree verify; drop node_depths_cpu")  # fmt: skip
            compiled = self.host_ops and host_ops.compiled() is not None
            slot = ring.claim()
            results = made[compiled]
            entry = results[slot]
            if entry is None:
                entry = results[slot] = make(B, *key, ring.sets[slot], compiled)
            try:  # one call, compiled or numpy, checks every length, writes, returns what it read
                found = entry[1](seq_lens_cpu, node_depths_cpu) if tree else entry[1](seq_lens_cpu)
            except (TypeError, ValueError, IndexError, OverflowError):
                self.lengths(mode, B, seq_lens_cpu)  # nothing was written: name the fault
                raise
            self.lengths(mode, B, seq_lens_cpu, found)  # published for the device's check
            ring.advance()
            return entry[0]

        check = self.host_check(mode, seq_lens, status)
        return Stage([*launches, check], host=host)

    def _pass(self, qo: tuple, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              kv_indptr_host: torch.Tensor, kv_len_host: torch.Tensor, page_size: int,
              causal: bool) -> FlashInferMLAPass:  # fmt: skip
        return FlashInferMLAPass(qo_indptr=qo[0], kv_indptr=kv_indptr, kv_indices=kv_indices,
                                 qo_indptr_host=qo[1], kv_indptr_host=kv_indptr_host,
                                 kv_len_arr_host=kv_len_host, page_size=page_size,
                                 causal=causal)  # fmt: skip

    def _qo(self, name: str, key: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device query offsets of ``count`` lists and their host mirror."""
        return (self._layouts[name].cu_seqlens_q(count),
                self.buffers[f"{key}_host"][: count + 1])  # fmt: skip

    # -- draft decode ---------------------------------------------------------------------------
    def bind_draft_decode(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                          seq_lens: torch.Tensor, *, num_rows: int | None = None,
                          status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                          entry_page_size: int = 1) -> Stage:  # fmt: skip
        """:meth:`draft_decode` bound once to these tensors (arguments as there): one launch;
        ``host(seq_lens_cpu)`` writes the mirrors of the ring's next set and returns the
        :class:`FlashInferMLADraftDecode`."""
        cfg, mode = self.cfg, "draft_decode"
        K, S, ps = cfg.topk, cfg.num_steps, cfg.page_size
        rows = self.draft_rows(mode, num_rows)
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._spaces(mode, v2p, entry_page_size)
        status = self.status_word(status)
        args, buf = (req_pool_indices, req_to_token, seq_lens), self.buffers
        if rows == 0:
            launches = []
        elif K == 1:
            # Each request's own pages over L + s + 1 tokens, every step in one launch.
            launches = [self._launch(
                bind_branch_kv_indices, branch_kv_indices_ref, *args, topk=1, num_steps=S,
                page_size=ps, num_rows=rows, status=status, **spaces,
                kv_indices=buf[f"{mode}.kv_indices"], kv_indptr=buf[f"{mode}.kv_indptr"],
                kv_last_page_len=buf[f"{mode}.kv_last_page_len"],
            )]  # fmt: skip
        else:
            # The cascade's two passes in one launch: each prefix once, each branch's chain.
            launches = [self._launch(
                bind_shared_prefix_kv_indices, shared_prefix_kv_indices_ref, *args, topk=K,
                num_steps=S, page_size=ps, num_rows=rows, status=status, **spaces,
                prefix_kv_indices=buf[f"{mode}.prefix_kv_indices"],
                prefix_kv_indptr=buf[f"{mode}.prefix_kv_indptr"],
                chain_kv_indices=buf[f"{mode}.ancestor_kv_indices"],
                chain_kv_indptr=buf[f"{mode}.ancestor_kv_indptr"],
            )]  # fmt: skip
        return self._stage(mode, B, (rows,), launches, self._draft_result, seq_lens, status)

    def draft_decode(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                     num_rows: int | None = None, status: torch.Tensor | None = None,
                     launch: bool = True, v2p: torch.Tensor | None = None,
                     entry_page_size: int = 1) -> FlashInferMLADraftDecode:  # fmt: skip
        """Every draft-decode forward's passes (design §3.5).

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            ``[B]``, ``[R, W_row]``, ``[B]`` on the builder's device (``B ≤ max_bs``).
        seq_lens_cpu : torch.Tensor
            ``[B]`` CPU copy of ``seq_lens``; required: the mirrors ``plan()`` reads are
            written from it (every value checked first).
        num_rows : int, optional
            Forwards to build, ``0 ≤ rows ≤ S``; default ``S − 1``.
        status : torch.Tensor, optional
            Status word; default :attr:`status`.
        launch : bool
            ``False``: only the host part (the kernels run inside a captured graph).
        v2p, entry_page_size
            The rows' id space (design §2.10): a virtual → physical page map at the pool's
            page size, rows of page ids of ``E`` positions each; the lists hold physical ids.

        Returns
        -------
        FlashInferMLADraftDecode
            ``K == 1``: step ``s``'s ``prefix`` lists request ``b``'s pages (pool page size)
            over ``L_b + s + 1`` tokens, one query row a request, non-causal, no ``ancestors``.
            ``K > 1``: ``prefix`` lists each prefix once as token slots (``L_b`` keys for the
            request's ``K`` rows, non-causal; the same pass every step) and ``ancestors`` the
            ``s + 1`` own draft slots of each branch (a row a branch), merged by LSE.
        """
        stage = self.bind_draft_decode(req_pool_indices, req_to_token, seq_lens,
                                       num_rows=num_rows, status=status, v2p=v2p,
                                       entry_page_size=entry_page_size)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _draft_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """Draft decode's result over the ring's set ``mirrors``, and its writer."""
        cfg, buf, mode = self.cfg, self.buffers, "draft_decode"
        K, ps = cfg.topk, cfg.page_size
        if K == 1:
            ptr_host, len_host = mirrors["kv_indptr_host"], mirrors["kv_len_arr_host"]
            last_host = mirrors["kv_last_page_len_host"]
            qo = self._qo("draft_decode", f"{mode}.qo_indptr", B)
            steps = tuple(
                FlashInferMLAAttention(self._pass(
                    qo, buf[f"{mode}.kv_indptr"][s, : B + 1], buf[f"{mode}.kv_indices"][s],
                    ptr_host[s, : B + 1], len_host[s, :B], ps, False,
                ))  # fmt: skip
                for s in range(rows)
            )
            steps_col = numpy.arange(1, rows + 1, dtype=numpy.int32).reshape(-1, 1)
            lens_out = len_host[:rows, :B].numpy()  # numpy: a microsecond where torch takes 5
            # Request b of step s reads ceil((L_b + s + 1) / ps) pages: the page offsets of
            # the kernel's own rule (branch_kv_indptr, K = 1), checked and written in one call.
            pages = host_ops.paged_writer(self._length_rules["draft_decode"], 1, ps, B,
                                          ptr_host[:rows, : B + 1], last_host[:rows, :B],
                                          use_compiled=compiled)  # fmt: skip

            def write(seq_lens_cpu: torch.Tensor) -> Any:
                found = pages(seq_lens_cpu)
                # L_b + s + 1 tokens, once the writer has checked every length
                numpy.add(seq_lens_cpu.numpy().reshape(1, -1), steps_col, out=lens_out)
                return found

            return FlashInferMLADraftDecode(steps), write
        prefix_host, prefix_len = mirrors["prefix_kv_indptr_host"], mirrors["prefix_kv_len_arr_host"]
        prefix = self._pass(
            self._qo("prefix", f"{mode}.prefix_qo_indptr", B),
            buf[f"{mode}.prefix_kv_indptr"][: B + 1], buf[f"{mode}.prefix_kv_indices"],
            prefix_host[: B + 1], prefix_len[:B], 1, False,
        )  # fmt: skip
        BK, qo = B * K, self._qo("ancestors", f"{mode}.ancestor_qo_indptr", B * K)
        steps = tuple(
            FlashInferMLAAttention(prefix, self._pass(
                qo, buf[f"{mode}.ancestor_kv_indptr"][s, : BK + 1],
                buf[f"{mode}.ancestor_kv_indices"][s],
                buf[f"{mode}.ancestor_kv_indptr_host"][s, : BK + 1],
                buf[f"{mode}.ancestor_kv_len_arr_host"][s, :BK], 1, False,
            ))  # fmt: skip
            for s in range(rows)
        )

        # The prefix pass: L_b keys a request at [0, cumsum(L)], checked and written in one call.
        offsets = host_ops.prefix_writer(self._length_rules["prefix"], B, prefix_host[: B + 1],
                                         use_compiled=compiled)  # fmt: skip

        write = _lengths_from_offsets(offsets, prefix_host[: B + 1], prefix_len[:B])

        return FlashInferMLADraftDecode(steps), write

    # -- target verify and draft extend ---------------------------------------------------------
    def _bind_window(self, mode: str, req_pool_indices: torch.Tensor,
                     req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                     status: torch.Tensor | None, v2p: Any, entry_page_size: Any) -> Stage:  # fmt: skip
        """A verify or extend stage: one launch of the token lists ``row_b[0 : L_b + N]``."""
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._spaces(mode, v2p, entry_page_size)
        status = self.status_word(status)
        launch = self._launch(
            bind_verify_kv_indices, verify_kv_indices_ref, req_pool_indices, req_to_token,
            seq_lens, extra_tokens=self.cfg.num_draft_tokens,
            kv_indices=self.buffers[f"{mode}.kv_indices"],
            kv_indptr=self.buffers[f"{mode}.kv_indptr"], status=status,
            page_size=self.cfg.page_size, **spaces,
        )  # fmt: skip
        return self._stage(mode, B, (), [launch], self._window_result(mode), seq_lens, status)

    def _window_result(self, mode: str) -> Callable:
        def make(B: int, mirrors: dict, compiled: bool):
            """The single causal pass of ``mode`` over the ring's set ``mirrors``, its writer."""
            buf = self.buffers
            ptr_host, len_host = mirrors["kv_indptr_host"], mirrors["kv_len_arr_host"]
            result = FlashInferMLAAttention(self._pass(
                self._qo(mode, f"{mode}.qo_indptr", B), buf[f"{mode}.kv_indptr"][: B + 1],
                buf[f"{mode}.kv_indices"], ptr_host[: B + 1], len_host[:B], 1, True,
            ))  # fmt: skip

            # L_b + N keys a request at [0, cumsum(L + N)], checked and written in one call.
            offsets = host_ops.prefix_writer(self._length_rules[mode], B, ptr_host[: B + 1],
                                             use_compiled=compiled)  # fmt: skip

            return result, _lengths_from_offsets(offsets, ptr_host[: B + 1], len_host[:B])

        return make

    def bind_target_verify(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                           seq_lens: torch.Tensor, tree_mask: torch.Tensor | None = None, *,
                           status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                           entry_page_size: int = 1) -> Stage:  # fmt: skip
        """:meth:`target_verify` bound once to these tensors (arguments as there)."""
        where = self.require("target_verify")
        if self.cfg.topk > 1:
            return self._bind_tree_verify(req_pool_indices, req_to_token, seq_lens, tree_mask,
                                          status, v2p, entry_page_size)  # fmt: skip
        if tree_mask is not None:
            raise ValueError(
                f"{where}: tree_mask was given, but with topk=1 the verify window is a chain, "
                "built as causal rows; drop tree_mask"
            )
        return self._bind_window("target_verify", req_pool_indices, req_to_token, seq_lens,
                                 status, v2p, entry_page_size)  # fmt: skip

    def _bind_tree_verify(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                          seq_lens: torch.Tensor, tree_mask: Any, status: Any, v2p: Any,
                          entry_page_size: Any) -> Stage:  # fmt: skip
        """A tree's target verify (design §3.5): the prefix pass (each prefix once, ``N``
        non-causal rows a request) and the ancestor pass (one list a node, its ancestors' and
        its own window slots: ``tree_ancestor_kv_indices``), then the device's check of the
        ancestor counts the host part read from ``node_depths_cpu``."""
        mode, n, ps = "target_verify", self.cfg.num_draft_tokens, self.cfg.page_size
        where = self.require(mode)
        if tree_mask is None:
            raise ValueError(
                f"{where}: tree_mask is required with topk={self.cfg.topk} > 1; pass the "
                f"[B, N, N] bool ancestor mask of the draft tree (N = {n})"
            )
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, tree_mask=tree_mask,
                       status=status, entry_page_size=entry_page_size)  # fmt: skip
        spaces = self._spaces(mode, v2p, entry_page_size)
        status, buf = self.status_word(status), self.buffers
        args, BN = (req_pool_indices, req_to_token, seq_lens), B * n
        launches = [
            self._launch(bind_verify_kv_indices, verify_kv_indices_ref, *args, extra_tokens=0,
                         kv_indices=buf[f"{mode}.prefix_kv_indices"],
                         kv_indptr=buf[f"{mode}.prefix_kv_indptr"], status=status,
                         page_size=ps, **spaces),
            self._launch(bind_tree_ancestor_kv_indices, tree_ancestor_kv_indices_ref, *args,
                         tree_mask, kv_len=buf[f"{mode}.ancestor_kv_len"][:BN],
                         kv_indptr=buf[f"{mode}.ancestor_kv_indptr"][: BN + 1],
                         kv_indices=buf[f"{mode}.ancestor_kv_indices"], status=status,
                         page_size=ps, **spaces),
        ]  # fmt: skip
        if self.check_host_lengths:  # the host's counts against the mask's, entry by entry
            launches.append(self._launch(
                bind_check_host_list_lengths, check_host_list_lengths_ref,
                buf[f"{mode}.ancestor_kv_len"][:BN], buf[f"{mode}.ancestor_lengths_slot_host"],
                buf[f"{mode}.ancestor_lengths_seen"], status=status,
            ))  # fmt: skip
        return self._stage(mode, B, ("tree",), launches, self._tree_result, seq_lens, status,
                           tree=True)  # fmt: skip

    def _tree_result(self, B: int, _tree: str, mirrors: dict, compiled: bool):
        """A tree verify's passes over the ring's set ``mirrors``, and their writer."""
        mode, n, buf = "target_verify", self.cfg.num_draft_tokens, self.buffers
        BN, where = B * n, self._where["target_verify"]
        prefix_host, prefix_len = mirrors["prefix_kv_indptr_host"], mirrors["prefix_kv_len_arr_host"]
        ptr_host = mirrors["ancestor_kv_indptr_host"][: BN + 1]
        len_host = mirrors["ancestor_kv_len_arr_host"][:BN]
        qo_host = buf[f"{mode}.ancestor_qo_indptr_host"][: BN + 1]
        prefix = self._pass(
            self._qo("verify_prefix", f"{mode}.prefix_qo_indptr", B),
            buf[f"{mode}.prefix_kv_indptr"][: B + 1], buf[f"{mode}.prefix_kv_indices"],
            prefix_host[: B + 1], prefix_len[:B], 1, False,
        )  # fmt: skip
        ancestors = self._pass(
            self._qo("verify_ancestors", f"{mode}.ancestor_qo_indptr", BN),
            buf[f"{mode}.ancestor_kv_indptr"][: BN + 1], buf[f"{mode}.ancestor_kv_indices"],
            ptr_host, len_host, 1, False,
        )  # fmt: skip
        offsets = host_ops.prefix_writer(self._length_rules["prefix"], B, prefix_host[: B + 1],
                                         use_compiled=compiled)  # fmt: skip
        prefix_write = _lengths_from_offsets(offsets, prefix_host[: B + 1], prefix_len[:B])
        slot, check = buf[f"{mode}.ancestor_lengths_slot_host"], self.check_host_lengths

        def write(seq_lens_cpu: torch.Tensor, node_depths_cpu: torch.Tensor) -> Any:
            found = prefix_write(seq_lens_cpu)
            # kv_len = depth + 1 and its offsets; one query row a node (arange, rewritten as is)
            try:
                tree_ancestor_host_mirrors_torch(node_depths_cpu, qo_indptr_host=qo_host,
                                                 kv_indptr_host=ptr_host, kv_len_host=len_host)  # fmt: skip
            except (TypeError, ValueError) as err:
                raise type(err)(f"{where}: {err}") from None
            if check:  # for the device's check, once it consumed the last counts
                publish_host_list_lengths(slot, len_host)
            return found

        return FlashInferMLAAttention(prefix, ancestors), write

    def target_verify(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                      seq_lens: torch.Tensor, tree_mask: torch.Tensor | None = None, *,
                      seq_lens_cpu: torch.Tensor | None = None,
                      node_depths_cpu: torch.Tensor | None = None,
                      status: torch.Tensor | None = None, launch: bool = True,
                      v2p: torch.Tensor | None = None,
                      entry_page_size: int = 1) -> FlashInferMLAAttention:  # fmt: skip
        """Target verify over the ``N``-token window ``row_b[L_b : L_b + N]`` (design §3.5).

        ``topk == 1`` (a chain): one pass, ``N`` causal query rows a request over
        ``row_b[0 : L_b + N]``, token slots; ``tree_mask`` is refused. ``topk > 1`` (a tree):
        ``tree_mask`` (``[B, N, N]`` bool on the device, ``m[i, j, c]`` iff ``c == j`` or ``c``
        is an ancestor of ``j``) and ``node_depths_cpu`` (``[B, N]`` integers on the CPU, the
        engine's copy of each node's depth, the root 0) are required: ``prefix`` lists each
        prefix once for the request's ``N`` rows (non-causal), ``ancestors`` one list a node,
        its ancestors' and its own window slots, ``depth + 1`` of them (the device checks the
        host's counts against the mask's: ``STALE_HOST_LENGTHS``). Other arguments as in
        :meth:`draft_decode`.
        """
        stage = self.bind_target_verify(req_pool_indices, req_to_token, seq_lens, tree_mask,
                                        status=status, v2p=v2p,
                                        entry_page_size=entry_page_size)  # fmt: skip
        extra = {} if node_depths_cpu is None else dict(node_depths_cpu=node_depths_cpu)
        return stage(seq_lens_cpu, **extra) if launch else stage.host(seq_lens_cpu, **extra)

    def bind_draft_extend(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                          seq_lens: torch.Tensor, *, status: torch.Tensor | None = None,
                          v2p: torch.Tensor | None = None,
                          entry_page_size: int = 1) -> Stage:  # fmt: skip
        """:meth:`draft_extend` bound once to these tensors (arguments as there)."""
        return self._bind_window("draft_extend", req_pool_indices, req_to_token, seq_lens,
                                 status, v2p, entry_page_size)  # fmt: skip

    def draft_extend(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                     status: torch.Tensor | None = None, launch: bool = True,
                     v2p: torch.Tensor | None = None,
                     entry_page_size: int = 1) -> FlashInferMLAAttention:  # fmt: skip
        """Draft extend: ``N`` causal query rows a request over ``row_b[0 : L_b + N]``, token
        slots, one pass for every ``topk`` (the extended tokens are a chain, so a causal pass
        is exact). Arguments as in :meth:`draft_decode`."""
        stage = self.bind_draft_extend(req_pool_indices, req_to_token, seq_lens, status=status,
                                       v2p=v2p, entry_page_size=entry_page_size)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)


def _lengths_from_offsets(offsets: Callable, ptr: torch.Tensor, lengths: torch.Tensor) -> Callable:
    """A writer: ``offsets`` (it checks every length and writes ``ptr``), then the lists'
    lengths, ``lengths = ptr[1:] − ptr[:-1]`` (token lists: a list's entries are its keys), in
    numpy on views made once (a microsecond where a torch op on the CPU takes several)."""
    ptr_np, out = ptr.numpy(), lengths.numpy()
    starts, ends = ptr_np[:-1], ptr_np[1:]

    def write(seq_lens_cpu: torch.Tensor) -> Any:
        found = offsets(seq_lens_cpu)
        numpy.subtract(ends, starts, out=out)
        return found

    return write


def _slots(count: int) -> list:
    """A key's results, one slot per ring set (``None`` until made)."""
    return [None] * count
