"""TRT-LLM MLA metadata builders (design §3.4): draft decode (chains and, through per-branch page
tables, trees), target verify (chains, and trees through a cascade) and draft extend.

TRT-LLM MLA takes one page row per query sequence (``block_kv_indices [rows, maxblk]``, int32
page ids, −1 beyond use, ``maxblk`` a multiple of ``max(1, 128 / ps)``) and its KV length
(``seq_lens_k``); it has no cascade and no custom mask. So:

* draft decode with ``K == 1``: the request's own pages, ``seq_lens_k = L_b + s + 1`` at step
  ``s`` (each forward attends to the chain tokens drafted so far);
* draft decode with ``K > 1``: **per-branch page tables** over slot layout B, one row per branch
  ``r = b·K + t``: the request's full prefix pages, then the pages of the branch's own region,
  whose first ``lpl_b`` slots hold the copied prefix tail (run ``prefix_tail_copy_pairs``
  through ``move_kv_cache`` first). Both cases are one kernel, :func:`branch_page_table`;
* target verify and draft extend (chains): ``seq_lens_k = L_b + N``, ``cu_seqlens_q = N·arange``,
  ``max_seq_len_q = N``, ``sum_seq_lens_q = Bp·N``: the same values at capture and at replay
  (a layout built from ``accept_length`` at replay would not match the captured one);
* target verify with ``K > 1`` (a tree): a cascade over ``B·N`` query rows, one a node, merged
  by log-sum-exp: a **prefix pass** in TRT-LLM's kernel (each node's row the request's prefix
  pages, ``seq_lens_k = L_b``) and an **ancestor pass** in FlashInfer MLA's, token lists of
  each node's ancestors (:mod:`.trtllm_mla_tree`);
* a ragged target verify (design §2.9, chains) keeps that dense kernel layout, ``[Bp, N]``
  query rows over ``L_b + N`` keys: the bucket's lengths are padded and capped at ``N`` (``seq_lens_q``),
  and ``cu_seqlens_q`` says where each request's rows lie among the bucket's ``T`` tokens, for
  the engine's scatter of the query into the dense rows (real rows first) and the gather of the
  output (tokens no request covers read 0).

Every mode reads its rows in the id space a call names (design §2.10): ``entry_page_size=`` (rows
of page ids) and ``v2p=`` (virtual ids through the pool's page map); the block tables hold the
physical pages.

A :class:`TrtllmMlaBuilder` allocates every buffer from :func:`~specmeta.plan_buffers` (keys
``trtllm_mla.<mode>.<field>``) once; its methods write into them without allocating or
synchronising and return frozen dataclasses of views named as the consumer's arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ..config import SpecConfig, plan_buffers
from ..kernels._common import check_id_spaces
from ..kernels.branch_page_table import bind_branch_page_table, branch_page_table_ref
from ..kernels.prefix_page_table import bind_prefix_page_table, prefix_page_table_ref
from ..stage import Stage
from .capabilities import CAPABILITIES
from .contract import DraftSteps, MetadataBuilder
from .layout import UniformQueryLayout
from .trtllm_mla_tree import RING_MIRRORS, TreeVerify, TrtllmMlaPrefixPass, TrtllmMlaTreeVerify

__all__ = ["TrtllmMlaBuilder", "TrtllmMlaDecodeStep", "TrtllmMlaDraftDecode", "TrtllmMlaPrefill",
           "TrtllmMlaPrefixPass", "TrtllmMlaTreeVerify"]  # fmt: skip

_PREFIX = "trtllm_mla."
# TRT-LLM MLA marks unused block-table entries with -1.
_UNUSED_BLOCK = -1


@dataclasses.dataclass(frozen=True)
class TrtllmMlaDecodeStep:
    """One draft-decode forward: one query row per branch (``B·K`` rows, one token each)."""

    block_kv_indices: torch.Tensor
    """``[B·K, maxblk]`` int32, device: page ids of each branch row, −1 past
    ``ceil((L_b + S) / ps)``; shared by every step (the longer rows cost nothing: the kernel
    reads ``seq_lens_k`` tokens)."""
    seq_lens_k: torch.Tensor
    """``[B·K]`` int32, device: ``L_b + s + 1``; exact."""
    max_seq_len_k: int
    """Host upper bound of ``seq_lens_k``: ``max_context_len + S``, the same at every replay."""


@dataclasses.dataclass(frozen=True)
class TrtllmMlaDraftDecode(DraftSteps):
    """Every draft-decode forward of one draft iteration, step ``s`` at ``steps[s]``."""

    steps: tuple[TrtllmMlaDecodeStep, ...]


@dataclasses.dataclass(frozen=True)
class TrtllmMlaPrefill:
    """Target verify or draft extend: ``N`` query rows a request, causal (bottom-right)."""

    block_kv_indices: torch.Tensor
    """``[B, maxblk]`` int32, device: the request's pages over ``L_b + N`` tokens, −1 beyond."""
    seq_lens_k: torch.Tensor
    """``[B]`` int32, device: ``L_b + N``; exact."""
    cu_seqlens_q: torch.Tensor
    """``[B + 1]`` int32, device: ``N·arange(B + 1)`` (design §3.1); exact."""
    max_seq_len_q: int
    """``N``."""
    sum_seq_lens_q: int
    """``B·N`` (padded rows keep their full width)."""
    max_seq_len_k: int
    """Host upper bound of ``seq_lens_k``: ``max_context_len + N``."""
    seq_lens_q: torch.Tensor | None = None
    """A ragged verify only: ``[B]`` int32, device, the query rows of each request, its padded
    verify length capped at ``N``; the kernel reads request ``b``'s dense rows ``0 … N − 1``
    (causal over ``L_b + N`` keys), of which the first ``seq_lens_q[b]`` are tokens
    ``cu_seqlens_q[b] …`` of the bucket. ``None``: every request has ``N`` rows."""


class TrtllmMlaBuilder(MetadataBuilder):
    """TRT-LLM MLA metadata for one :class:`~specmeta.SpecConfig`, in planned buffers.

    Parameters
    ----------
    cfg : SpecConfig
        ``K``, ``S``, ``N``, ``ps`` and the capacity (``max_bs``, ``max_context_len``).
    device : torch.device or str
        Where the metadata lives.
    modes : iterable of str, optional
        The modes served (``draft_decode``, ``target_verify``, ``draft_extend``): only their
        buffers are allocated. Default: all of them.
    reference : bool
        Build with the pure-torch references instead of the kernels (a test and benchmark
        baseline; it syncs).
    host_ops : bool
        Check ``seq_lens_cpu`` in one compiled call where :func:`specmeta.warmup` built it
        (default; :mod:`specmeta.metadata.host_ops`), else with torch ops.
    check_host_lengths : bool
        Check on the device that ``seq_lens_cpu`` agrees with ``seq_lens`` (default; see
        :class:`~specmeta.metadata.contract.MetadataBuilder`).
    mirror_depth : int
        A tree verify's sets of ancestor-pass host mirrors used in turn (default 16, as
        FlashInfer MLA's, design §3.3); nothing else has host mirrors.

    Attributes
    ----------
    buffers : dict of str to torch.Tensor
        The ``trtllm_mla.*`` buffers of the served modes, keyed without the prefix.
    status : torch.Tensor
        ``int32 [1]``: the status word every method reports into unless given another.

    Examples
    --------
    >>> mla = TrtllmMlaBuilder(cfg, "cuda")
    >>> steps = mla.draft_decode(rpi, req_to_token, seq_lens, seq_lens_cpu=lens)
    >>> stage = mla.bind_draft_decode(rpi, req_to_token, seq_lens)  # once
    >>> steps = stage(lens)  # every step: check the lengths, launch (or stage.launch() in a graph)
    """

    plan_prefix = _PREFIX
    capabilities = CAPABILITIES["trtllm_mla"]

    def __init__(
        self,
        cfg: SpecConfig,
        device: torch.device | str,
        *,
        modes: Iterable[str] | None = None,
        reference: bool = False,
        host_ops: bool = True,
        check_host_lengths: bool = True,
        mirror_depth: int = 16,
    ):
        super().__init__(cfg, device, modes=modes, reference=reference, host_ops=host_ops,
                         check_host_lengths=check_host_lengths)  # fmt: skip
        plan, pin = plan_buffers(cfg), self.device.type == "cuda"
        self.buffers, host, ring = {}, {}, {}
        for key in self.plan_keys(cfg, self.modes):
            name = key[len(_PREFIX) :]
            if name.split(".", 1)[1] in RING_MIRRORS:
                ring[name.split(".", 1)[1]] = plan[key]
            elif name.endswith("_host"):  # a tree verify's: pinned for the device's reads
                buf = plan[key].allocate("cpu")
                self.buffers[name] = host[name] = buf.pin_memory() if pin else buf
            elif name.endswith("_seen"):  # a check's last read: 0, as the host slot's
                self.buffers[name] = plan[key].allocate(self.device)
            else:
                self.buffers[name] = plan[key].allocate(self.device, fill=_UNUSED_BLOCK)
        self._tree = None
        if ring:  # a tree's verify (design §3.4)
            self._tree = TreeVerify(self, host, ring, mirror_depth)
        n, bs = cfg.num_draft_tokens, cfg.max_bs
        self._layouts = {
            mode: UniformQueryLayout.create(
                n, bs, self.device, out=self.buffers[f"{mode}.cu_seqlens_q"]
            )
            for mode in ("target_verify", "draft_extend")
            if mode in self.modes
        }

    @property
    def max_blocks(self) -> int:
        """``maxblk``, the block tables' width (TRT-LLM's rule, design §3.4)."""
        spec = plan_buffers(self.cfg)["trtllm_mla.draft_extend.block_kv_indices"]
        return spec.shape[1]

    # -- the stages -----------------------------------------------------------------------------
    def _stage(self, mode: str, B: int, launches: list, result: Any, seq_lens: torch.Tensor,
               status: torch.Tensor | None, verify: Any = None) -> Stage:  # fmt: skip
        """The stage of ``mode``: ``launches`` and the check of the host's lengths, and the host
        part that checks ``seq_lens_cpu`` when it is given (every value in
        ``[0, max_context_len]``) and, for a ragged verify, the optional ``verify_lens_cpu``
        (``verify``), and returns ``result``. No host scalar of a result reads the lengths:
        ``max_seq_len_k`` is the plan's bound, the same at every replay."""
        lengths, verify_host = self.lengths, self.verify_host

        def host(seq_lens_cpu: torch.Tensor | None, verify_lens_cpu: Any = None) -> Any:
            if seq_lens_cpu is not None:
                lengths(mode, B, seq_lens_cpu)
            verify_host(mode, verify, verify_lens_cpu)
            return result

        check = self.host_check(mode, seq_lens, self.status_word(status))
        return Stage([*launches, check], host=host)

    def _max_seq_len(self, mode: str, max_seq_len: object) -> None:
        """Check the eager methods' ``max_seq_len=`` (a host ``max L_b``) against the plan,
        after the tensors and before anything is launched."""
        if max_seq_len is None:
            return
        where = self.require(mode)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
            raise TypeError(
                f"{where}: max_seq_len must be a host int, got {type(max_seq_len).__name__}; "
                "pass int(...) of a value the host already holds, or seq_lens_cpu="
            )
        if max_seq_len > self.cfg.max_context_len:
            raise ValueError(
                f"{where}: max_seq_len={max_seq_len} exceeds the plan's "
                f"max_context_len={self.cfg.max_context_len}; build the SpecConfig with "
                f"max_context_len >= {max_seq_len}"
            )

    def _spaces(self, mode: str, req_pool_indices: Any, req_to_token: Any, seq_lens: Any,
                status: Any, v2p: Any, entry_page_size: Any) -> tuple[int, dict]:  # fmt: skip
        """The host checks of one bind, before anything is bound: the tensors, the row width
        counted in pages of ``entry_page_size`` positions and the page map ``v2p`` (the id
        spaces of design §2.10). Returns ``B`` and the kernels' id-space keywords."""
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        check_id_spaces(self.require(mode), 0, 0, entry_page_size, v2p, self.device)
        return B, dict(entry_page_size=entry_page_size, v2p=v2p)

    def bind_draft_decode(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
    ) -> Stage:
        """:meth:`draft_decode` bound once to these tensors (arguments as there): the stage
        launches with ``launch()``; ``host(seq_lens_cpu)`` checks the lengths (when given) and
        returns the :class:`TrtllmMlaDraftDecode`."""
        cfg, buf, mode = self.cfg, self.buffers, "draft_decode"
        rows = self.draft_rows(mode, num_rows)
        B, spaces = self._spaces(mode, req_pool_indices, req_to_token, seq_lens, status, v2p,
                                 entry_page_size)  # fmt: skip
        launch = self._launch(
            bind_branch_page_table, branch_page_table_ref, req_pool_indices, req_to_token,
            seq_lens, topk=cfg.topk, num_steps=cfg.num_steps, page_size=cfg.page_size,
            num_rows=rows, fill_value=_UNUSED_BLOCK, page_table=buf[f"{mode}.block_kv_indices"],
            seq_lens_k=buf[f"{mode}.seq_lens_k"], status=self.status_word(status), **spaces,
        )  # fmt: skip
        result = self.views((mode, B, rows), self._draft_result, B, rows)
        return self._stage(mode, B, [launch], result, seq_lens, status)

    def draft_decode(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        num_rows: int | None = None,
        max_seq_len: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
    ) -> TrtllmMlaDraftDecode:
        """Draft decode, ``K == 1`` (chains) or ``K > 1`` (per-branch page tables), one launch.

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            ``[B]``, ``[R, W_row]``, ``[B]`` on the builder's device (``B ≤ max_bs``).
        seq_lens_cpu : torch.Tensor, optional
            ``[B]`` CPU mirror of ``seq_lens``: every length is checked against the plan
            before launch.
        num_rows : int, optional
            Forwards to build; default ``S − 1``.
        max_seq_len : int, optional
            Host ``max L_b`` (an alternative to ``seq_lens_cpu``): checked against the plan
            before launch.
        status : torch.Tensor, optional
            Status word; default :attr:`status`.
        launch : bool
            ``False``: launch nothing, return the views (the kernels run in a captured graph).
        v2p : torch.Tensor, optional
            ``[P]`` int32 or int64 virtual → physical page map at the config's page size, on
            the device: the rows hold virtual ids, every page read through them (the prefix
            and the branch regions' draft slots, design §2.10) is listed physical, a page whose
            id does not map as the sink page 0 with ``BAD_KV_ID``.
        entry_page_size : int
            ``E ≥ 1``: with ``E > 1`` the rows hold page ids of ``E`` positions each (position
            ``p`` at ``row[p // E]·E + p mod E``), and ``req_to_token`` needs
            ``ceil(row_width_need / E)`` entries. Default 1, rows of token ids.
        """
        stage = self.bind_draft_decode(req_pool_indices, req_to_token, seq_lens,
                                       num_rows=num_rows, status=status, v2p=v2p,
                                       entry_page_size=entry_page_size)  # fmt: skip
        self._max_seq_len("draft_decode", max_seq_len)
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _draft_result(self, B: int, rows: int) -> TrtllmMlaDraftDecode:
        """The draft-decode result of ``B`` requests and ``rows`` steps (no host scalar: the
        kernel's ``max_seq_len_k`` is the plan's bound)."""
        cfg, buf, K = self.cfg, self.buffers, self.cfg.topk
        table, lens = buf["draft_decode.block_kv_indices"], buf["draft_decode.seq_lens_k"]
        return TrtllmMlaDraftDecode(tuple(
            TrtllmMlaDecodeStep(
                block_kv_indices=table[: B * K],
                seq_lens_k=lens[s, : B * K],
                max_seq_len_k=cfg.max_context_len + cfg.num_steps,
            )
            for s in range(rows)
        ))  # fmt: skip

    def _bind_prefill(self, mode: str, req_pool_indices, req_to_token, seq_lens, status,
                      verify_lens: Any = None, num_tokens: Any = None, v2p: Any = None,
                      entry_page_size: Any = 1) -> Stage:  # fmt: skip
        """The stage of target verify or draft extend: the request's pages over ``L + N``
        tokens and ``seq_lens_k = L + N``, one launch; a ragged verify (``verify_lens``) adds
        the padding of its lengths to the bucket, capped at ``N`` (and the check of the
        lengths' host copy). ``v2p``, ``entry_page_size``: the rows' id space."""
        cfg, buf = self.cfg, self.buffers
        B, spaces = self._spaces(mode, req_pool_indices, req_to_token, seq_lens, status, v2p,
                                 entry_page_size)  # fmt: skip
        pad, _, T, verify = self.bind_bucket(mode, B, verify_lens, num_tokens, status,
                                             cap=cfg.num_draft_tokens)  # fmt: skip
        launch = self._launch(
            bind_prefix_page_table, prefix_page_table_ref, req_pool_indices, req_to_token,
            seq_lens, page_size=cfg.page_size, extra_tokens=cfg.num_draft_tokens,
            fill_value=_UNUSED_BLOCK, page_table=buf[f"{mode}.block_kv_indices"],
            cache_seqlens=buf[f"{mode}.seq_lens_k"], status=self.status_word(status), **spaces,
        )  # fmt: skip
        result = self.views((mode, B, T), self._prefill_result, mode, B, T)
        if pad is None:
            return self._stage(mode, B, [launch], result, seq_lens, status)
        check = self.verify_check(verify_lens, self.status_word(status))
        return self._stage(mode, B, [pad, launch, check], result, seq_lens, status, verify)

    def _prefill_result(self, mode: str, B: int, T: int | None) -> TrtllmMlaPrefill:
        """The target-verify or draft-extend result of ``B`` requests (a ragged verify's over
        a bucket of ``T`` tokens)."""
        buf, layout, n = self.buffers, self._layouts[mode], self.cfg.num_draft_tokens
        ragged = T is not None
        return TrtllmMlaPrefill(
            block_kv_indices=buf[f"{mode}.block_kv_indices"][:B],
            seq_lens_k=buf[f"{mode}.seq_lens_k"][:B],
            cu_seqlens_q=buf[f"{mode}.ragged_qo_indptr"][: B + 1] if ragged
            else layout.cu_seqlens_q(B),
            max_seq_len_q=layout.max_seqlen_q,
            sum_seq_lens_q=T if ragged else layout.sum_seqlens_q(B),
            max_seq_len_k=self.cfg.max_context_len + n,
            seq_lens_q=buf[f"{mode}.verify_lens"][:B] if ragged else None,
        )  # fmt: skip

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
    ) -> Stage:
        """:meth:`target_verify` bound once to these tensors (arguments as there); the stage's
        ``host(seq_lens_cpu)`` (``host(seq_lens_cpu, verify_lens_cpu=...)``, the copy optional,
        for a ragged verify) returns the :class:`TrtllmMlaPrefill`; a tree's,
        ``host(seq_lens_cpu, node_depths_cpu=...)``, the :class:`TrtllmMlaTreeVerify`."""
        where = self.require("target_verify")
        if self.cfg.topk > 1:
            if verify_lens is not None or num_tokens is not None:
                raise ValueError(
                    f"{where}: verify_lens/num_tokens were given with topk={self.cfg.topk} > 1, "
                    "but a tree's verify is a cascade of N rows a request with no ragged form; "
                    "drop verify_lens and num_tokens (a ragged verify serves chains, topk=1)"
                )
            return self._tree.bind(req_pool_indices, req_to_token, seq_lens, tree_mask, status,
                                   v2p, entry_page_size)  # fmt: skip
        if tree_mask is not None:
            raise ValueError(
                f"{where}: tree_mask was given, but with topk=1 the verify window is a chain, "
                "built as causal rows; drop tree_mask"
            )
        return self._bind_prefill("target_verify", req_pool_indices, req_to_token, seq_lens,
                                  status, verify_lens, num_tokens, v2p,
                                  entry_page_size)  # fmt: skip

    def target_verify(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        node_depths_cpu: torch.Tensor | None = None,
        max_seq_len: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
        verify_lens: torch.Tensor | None = None,
        verify_lens_cpu: torch.Tensor | None = None,
        num_tokens: int | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
    ) -> TrtllmMlaPrefill | TrtllmMlaTreeVerify:
        """Target verify over the ``N``-token window ``row_b[L_b : L_b + N]`` (design §3.4).

        ``topk == 1`` (a chain): ``seq_lens_k = L_b + N``, stride ``N``, causal, a
        :class:`TrtllmMlaPrefill`; ``tree_mask`` is refused. ``topk > 1`` (a tree): TRT-LLM
        MLA has no custom mask, so the verify is a cascade, a :class:`TrtllmMlaTreeVerify`:
        ``prefix`` (TRT-LLM's kernel, ``B·N`` rows of one token, each its request's prefix
        pages, ``seq_lens_k = L_b``) and ``ancestors`` (FlashInfer MLA's wrapper at page size
        1, one list a node: its ancestors' and its own window slots), merged by LSE after
        :meth:`TrtllmMlaTreeVerify.mask_empty_prefix`. It takes ``tree_mask`` (``[B, N, N]``
        bool on the device, ``m[i, j, c]`` iff ``c == j`` or ``c`` is an ancestor of ``j``)
        and ``node_depths_cpu`` (``[B, N]`` integers on the CPU, each node's depth, the root
        0: FlashInfer's ``plan()`` reads the ancestor counts, ``depth + 1``, on the host; the
        device checks them against the mask's, ``STALE_HOST_LENGTHS``); no ragged form.
        Arguments as in :meth:`draft_decode` (``v2p``, ``entry_page_size``: the rows' id
        space), and for a ragged verify (design §2.9, chains):

        verify_lens : torch.Tensor, optional
            ``[B' ≤ B]`` int32 or int64 on the device, real request ``b`` verifies the first
            ``v_b ≤ N`` tokens of its chain; the batch is the captured bucket's ``B``
            requests. The lengths are padded to the bucket of ``num_tokens`` and capped at
            ``N`` (:func:`specmeta.pad_verify_lens_to_bucket` with ``cap=N``) into the
            result's ``seq_lens_q`` and ``cu_seqlens_q``; the kernel's layout stays the dense
            one (``[B, N]`` query rows, ``seq_lens_k = L_b + N``).
        verify_lens_cpu : torch.Tensor, optional
            ``[B']`` CPU copy of ``verify_lens``: optional (nothing on the host reads the
            offsets); when given it is checked on the host (each in ``[0, N]``, the sum at
            most ``num_tokens``) and on the device against ``verify_lens``.
        num_tokens : int, optional
            ``T``, the bucket's query tokens (``0 ≤ T ≤ B·N``); required with ``verify_lens``.
        """
        stage = self.bind_target_verify(req_pool_indices, req_to_token, seq_lens, tree_mask,
                                        status=status, verify_lens=verify_lens,
                                        num_tokens=num_tokens, v2p=v2p,
                                        entry_page_size=entry_page_size)  # fmt: skip
        self._max_seq_len("target_verify", max_seq_len)
        if self.cfg.topk > 1:
            host = dict(node_depths_cpu=node_depths_cpu, verify_lens_cpu=verify_lens_cpu)
            return stage(seq_lens_cpu, **host) if launch else stage.host(seq_lens_cpu, **host)
        if node_depths_cpu is not None:
            raise ValueError(f"{self.require('target_verify')}: node_depths_cpu was given, but "
                             "with topk=1 the verify is a chain; drop node_depths_cpu")  # fmt: skip
        if launch:
            return stage(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)
        return stage.host(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)

    def bind_draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        status: torch.Tensor | None = None,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
    ) -> Stage:
        """:meth:`draft_extend` bound once to these tensors (arguments as there); the stage's
        ``host(seq_lens_cpu)`` returns the :class:`TrtllmMlaPrefill`."""
        return self._bind_prefill("draft_extend", req_pool_indices, req_to_token, seq_lens,
                                  status, v2p=v2p, entry_page_size=entry_page_size)  # fmt: skip

    def draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        max_seq_len: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
        v2p: torch.Tensor | None = None,
        entry_page_size: int = 1,
    ) -> TrtllmMlaPrefill:
        """Draft extend: ``seq_lens_k = L_b + N``, stride ``N``, causal; the same fixed query
        layout at capture and at replay. Arguments as in :meth:`draft_decode` (``v2p``,
        ``entry_page_size``: the rows' id space)."""
        stage = self.bind_draft_extend(req_pool_indices, req_to_token, seq_lens, status=status,
                                       v2p=v2p, entry_page_size=entry_page_size)  # fmt: skip
        self._max_seq_len("draft_extend", max_seq_len)
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)
