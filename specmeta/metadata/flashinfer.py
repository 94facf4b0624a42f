"""FlashInfer metadata builders (design §3.3): draft decode (per-branch, shared-prefix cascade,
per-branch pages), target verify with a tree mask, draft extend.

A :class:`FlashInferBuilder` is constructed once from a :class:`~specmeta.SpecConfig` and a
device; it allocates every buffer it writes from :func:`~specmeta.plan_buffers` (keys
``flashinfer.<mode>.<field>``) and writes the batch-independent values (``qo_indptr`` strides,
``kv_last_page_len`` ones) once. Each method then runs the sync-free kernels into those buffers
and returns a frozen dataclass of views whose field names are FlashInfer ``plan()``'s keywords,
so the eager path and a CUDA-graph capture use the same code on the same layout.

Host mirrors (``*_host``) are what ``plan()`` needs on the CPU. They are computed from the
``seq_lens_cpu`` the engine already holds, never copied back from the device (the reference
engine synchronises there every iteration). Without ``seq_lens_cpu`` they are ``None``.

Which draft-decode form to use:

* :meth:`FlashInferBuilder.draft_decode`: per-branch token lists, planned with page size 1
  (design §3.3); ``S·K·ΣL`` prefix entries written per iteration.
* :meth:`FlashInferBuilder.draft_decode_shared_prefix`: a two-level cascade
  (``MultiLevelCascadeAttentionWrapper``): each prefix once (query stride ``K``), each branch's
  chain as a second level; ``ΣL + B·K·S(S+1)/2`` entries.
* :meth:`FlashInferBuilder.draft_decode_paged`: per-branch page lists with the pool's own page
  size (slot layout B; the prefix-tail copies of ``prefix_tail_copy_pairs`` must be in place).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from .. import validate
from ..config import SpecConfig, plan_buffers
from ..kernels.branch_kv_indices import branch_kv_indices, branch_kv_indices_ref
from ..kernels.draft_decode_kv_indices import (
    DraftDecodeIndptr,
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from ..kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from ..kernels.tree_custom_mask import tree_custom_mask, tree_custom_mask_ref
from ..kernels.verify_kv_indices import verify_kv_indices, verify_kv_indices_ref
from . import host_ops
from .contract import Capabilities, DraftSteps, MetadataBuilder
from .host_mirrors import HostMirrorRing
from .host_ops import LengthTable
from .inputs import BuildInputs
from .layout import UniformQueryLayout

__all__ = [
    "FlashInferBuilder",
    "FlashInferDecodeStep",
    "FlashInferDraftDecode",
    "FlashInferCascadeStep",
    "FlashInferCascadeDecode",
    "FlashInferPrefill",
]

_PREFIX = "flashinfer."
# Host mirrors that change with the batch, by plan group; they come from a ring (see
# host_mirrors). The other ``*_host`` buffers hold values fixed at construction (strides, ones).
_PER_BATCH_MIRRORS = {
    "draft_decode": ("kv_indptr_host",),
    "draft_decode_shared": ("prefix_kv_indptr_host",),
    "draft_decode_paged": ("kv_indptr_host", "kv_last_page_len_host"),
    "target_verify": ("kv_indptr_host", "mask_indptr_host", "packed_mask_indptr_host"),
    "draft_extend": ("kv_indptr_host",),
}


@dataclasses.dataclass(frozen=True)
class FlashInferDecodeStep:
    """One draft-decode forward for ``BatchDecodeWithPagedKVCacheWrapper.plan()``."""

    kv_indptr: torch.Tensor
    """``[B·K + 1]`` int32, device; exact."""
    kv_indices: torch.Tensor
    """``[W]`` int32, device; an upper bound: entries ``[0, kv_indptr[-1])`` are this step's."""
    kv_last_page_len: torch.Tensor
    """``[B·K]`` int32, device; exact (all 1 with page size 1)."""
    kv_indptr_host: torch.Tensor | None
    """``[B·K + 1]`` int32 on the CPU, equal to ``kv_indptr``; ``None`` without ``seq_lens_cpu``."""
    kv_last_page_len_host: torch.Tensor | None
    """``[B·K]`` int32 on the CPU, equal to ``kv_last_page_len``; ``None`` without
    ``seq_lens_cpu``."""
    page_size: int
    """The page size to plan with: 1 for token lists, the pool's for page lists."""


@dataclasses.dataclass(frozen=True)
class FlashInferDraftDecode(DraftSteps):
    """Every draft-decode forward of one draft iteration, step ``s`` at ``steps[s]``."""

    steps: tuple[FlashInferDecodeStep, ...]


@dataclasses.dataclass(frozen=True)
class FlashInferCascadeStep:
    """One draft-decode forward for ``MultiLevelCascadeAttentionWrapper.plan()`` (two levels).

    Level 0 is the shared prefix: request ``b``'s ``K`` branch rows (query stride ``K``) read
    ``row_b[0:L_b]``. Level 1 is the chains: branch row ``z`` (stride 1) reads its ``s + 1``
    draft slots. Query rows are ordered ``[b, t]`` in both levels.
    """

    qo_indptr_arr: tuple[torch.Tensor, torch.Tensor]
    """``([B + 1], [B·K + 1])`` int32, device: ``K·arange`` and ``arange``; exact."""
    paged_kv_indptr_arr: tuple[torch.Tensor, torch.Tensor]
    """``([B + 1], [B·K + 1])`` int32, device: ``[0, cumsum(L)]`` and ``z·(s + 1)``; exact."""
    paged_kv_indices_arr: tuple[torch.Tensor, torch.Tensor]
    """``([W0], [W1])`` int32, device; upper bounds (``ΣL`` and ``B·K·(s+1)`` entries used)."""
    paged_kv_last_page_len: tuple[torch.Tensor, torch.Tensor]
    """``([B], [B·K])`` int32 ones, device; exact."""
    qo_indptr_host_arr: tuple[torch.Tensor, torch.Tensor]
    """CPU mirrors of ``qo_indptr_arr`` (batch independent, always present)."""
    paged_kv_indptr_host_arr: tuple[torch.Tensor, torch.Tensor] | None
    """CPU mirrors of ``paged_kv_indptr_arr``; ``None`` without ``seq_lens_cpu``."""
    paged_kv_last_page_len_host_arr: tuple[torch.Tensor, torch.Tensor]
    """CPU mirrors of ``paged_kv_last_page_len`` (ones, always present)."""
    page_size: int = 1


@dataclasses.dataclass(frozen=True)
class FlashInferCascadeDecode(DraftSteps):
    """Every cascade draft-decode forward of one draft iteration, step ``s`` at ``steps[s]``."""

    steps: tuple[FlashInferCascadeStep, ...]


@dataclasses.dataclass(frozen=True)
class FlashInferPrefill:
    """Target verify or draft extend for ``BatchPrefillWithPagedKVCacheWrapper.plan()``."""

    qo_indptr: torch.Tensor
    """``[B + 1]`` int32, device: ``N·arange`` (uniform stride, design §3.1); exact."""
    kv_indptr: torch.Tensor
    """``[B + 1]`` int32, device: ``[0, cumsum(L + N)]``; exact."""
    kv_indices: torch.Tensor
    """``[W]`` int32, device; upper bound: ``ΣL + B·N`` entries used."""
    kv_last_page_len: torch.Tensor
    """``[B]`` int32 ones, device; exact."""
    custom_mask: torch.Tensor | None
    """Flat bool, device, request ``i`` an ``N × (L_i + N)`` block; upper bound (``None`` for
    draft extend or when ``packed_custom_mask`` is given)."""
    packed_custom_mask: torch.Tensor | None
    """uint8, device: ``custom_mask`` packed little-endian, each request's segment padded to a
    byte and starting at byte ``mask_indptr[i]`` (the layout FlashInfer 0.7's ``plan()`` reads;
    see :mod:`specmeta.kernels.tree_custom_mask`)."""
    mask_indptr: torch.Tensor | None
    """``[B + 1]`` int32, device: segment starts, in elements (read as bytes for the packed
    form). ``plan()`` computes the same offsets itself; it is not passed."""
    causal: bool
    """``False`` for target verify (the mask decides), ``True`` for draft extend."""
    qo_indptr_host: torch.Tensor
    """``[B + 1]`` int32 on the CPU (batch independent, always present)."""
    kv_indptr_host: torch.Tensor | None
    """``[B + 1]`` int32 on the CPU; ``None`` without ``seq_lens_cpu``."""
    kv_last_page_len_host: torch.Tensor
    """``[B]`` int32 ones on the CPU (always present)."""
    mask_indptr_host: torch.Tensor | None
    """``[B + 1]`` int32 on the CPU; ``None`` without ``seq_lens_cpu`` or a mask."""
    max_q_len: int
    """``N``, the same at capture and at replay."""
    page_size: int = 1


class FlashInferBuilder(MetadataBuilder):
    """FlashInfer metadata for one :class:`~specmeta.SpecConfig`, in planned buffers.

    Parameters
    ----------
    cfg : SpecConfig
        ``K``, ``S``, ``N``, ``ps`` and the capacity (``max_bs``, ``max_context_len``).
    device : torch.device or str
        Where the metadata lives. ``*_host`` mirrors live on the CPU, pinned when ``device``
        is CUDA.
    modes : iterable of str, optional
        The modes served (``draft_decode``, ``draft_decode_shared_prefix``,
        ``draft_decode_paged``, ``target_verify``, ``draft_extend``; default all): only their
        buffers are allocated. The three draft forms differ most in memory: at ``max_bs`` 256,
        ``K`` 8, a 32k context, ``draft_decode`` alone plans 1.3 GB of ``kv_indices``.
    reference : bool
        Build with the pure-torch references instead of the kernels (a test and benchmark
        baseline; it syncs).
    verify_mask : str
        ``"bool"``, ``"packed"`` or ``"both"`` (default): the tree-mask forms target verify
        builds, and so allocates; ``target_verify(packed=...)`` must ask for one of them.
    mirror_depth : int
        Sets of per-batch host mirrors, used in turn (default 16): a build reuses a set only
        once the stream has passed the ``plan()`` that read it, so an engine may build
        iterations ahead of the device's ``plan()`` copies; past ``mirror_depth // 2`` builds
        ahead, a build waits (:mod:`specmeta.metadata.host_mirrors`). The mirrors of a result
        stay valid until ``mirror_depth`` more builds of the same mode.
    host_ops : bool
        Write the per-batch host mirrors with the compiled writers (default, where they can be
        built; :mod:`specmeta.metadata.host_ops`), else with the torch rules. Both check every
        ``seq_lens_cpu`` value before writing, and write the same integers.

    Attributes
    ----------
    buffers : dict of str to torch.Tensor
        The ``flashinfer.*`` buffers of the served modes, keyed without the prefix, except the
        per-batch host mirrors, which live in the ring.
    status : torch.Tensor
        ``int32 [1]``: the status word every method reports into unless given another
        (read it with :func:`specmeta.check_status`, which syncs).

    Examples
    --------
    >>> fi = FlashInferBuilder(cfg, "cuda")
    >>> meta = fi.draft_decode(req_pool_indices, req_to_token, seq_lens, seq_lens_cpu=lens)
    >>> wrapper.plan(meta.steps[0].kv_indptr_host, meta.steps[0].kv_indices, ...)  # no sync
    """

    plan_prefix = _PREFIX
    capabilities = Capabilities(
        modes=("draft_decode", "draft_decode_shared_prefix", "draft_decode_paged",
               "target_verify", "draft_extend"),
        tree_draft=True,
        tree_verify=True,
        page_sizes="any",
        graph_safe=frozenset({"draft_decode", "draft_decode_shared_prefix",
                              "draft_decode_paged", "target_verify", "draft_extend"}),
    )  # fmt: skip
    plan_groups = {"draft_decode_shared_prefix": "draft_decode_shared"}
    #: The target-verify mask forms: the bool ``custom_mask``, the packed-bit one, or both.
    VERIFY_MASKS = ("bool", "packed", "both")
    _MASK_FIELDS = {
        "bool": ("custom_mask", "mask_indptr", "mask_indptr_host"),
        "packed": ("packed_custom_mask", "packed_mask_indptr", "packed_mask_indptr_host"),
    }

    @classmethod
    def plan_keys(cls, cfg: SpecConfig, modes: Iterable[str] | None = None,
                  verify_mask: str = "both") -> list[str]:  # fmt: skip
        """As :meth:`MetadataBuilder.plan_keys`; ``verify_mask`` drops the mask form that
        target verify will not build (each form is ``N·ΣL + B·N²`` bytes at full capacity)."""
        if verify_mask not in cls.VERIFY_MASKS:
            raise ValueError(
                f"FlashInferBuilder: verify_mask={verify_mask!r}; pass one of "
                f"{', '.join(map(repr, cls.VERIFY_MASKS))}"
            )
        dropped = {
            f"{_PREFIX}target_verify.{field}"
            for form, fields in cls._MASK_FIELDS.items()
            if verify_mask not in (form, "both")
            for field in fields
        }
        return [key for key in super().plan_keys(cfg, modes) if key not in dropped]

    def __init__(
        self,
        cfg: SpecConfig,
        device: torch.device | str,
        *,
        modes: Iterable[str] | None = None,
        reference: bool = False,
        mirror_depth: int = 16,
        verify_mask: str = "both",
        host_ops: bool = True,
    ):
        super().__init__(cfg, device, modes=modes, reference=reference, host_ops=host_ops)
        self.verify_mask = verify_mask
        plan = plan_buffers(cfg)
        pin = self.device.type == "cuda"
        groups = {self.plan_groups.get(m, m) for m in self.modes}
        ring_names = {
            f"{_PREFIX}{g}.{f}" for g, fields in _PER_BATCH_MIRRORS.items() for f in fields
        }
        own = set(self.plan_keys(cfg, None, verify_mask))
        mirrors = {
            g: tuple(f for f in fields if f"{_PREFIX}{g}.{f}" in own)
            for g, fields in _PER_BATCH_MIRRORS.items()
        }
        self.buffers: dict[str, torch.Tensor] = {}
        for name in self.plan_keys(cfg, self.modes, verify_mask):
            if name in ring_names:
                continue
            spec = plan[name]
            if name.endswith("_host"):
                buf = spec.allocate("cpu")
                buf = buf.pin_memory() if pin else buf
            else:
                buf = spec.allocate(self.device)
            self.buffers[name[len(_PREFIX) :]] = buf
        self._mirrors = {
            group: HostMirrorRing(
                {f: plan[f"{_PREFIX}{group}.{f}"] for f in fields},
                mirror_depth,
                self.device,
                use_compiled=self.host_ops,
            )
            for group, fields in mirrors.items()
            if group in groups
        }
        # The builder checks every input before launching (inputs.py), so its launchers skip
        # their own second pass over the same tensors (validate.trusting).
        pick = (
            (lambda kernel, ref: ref)
            if reference
            else (lambda kernel, ref: validate.trusting(kernel))
        )
        self._draft_kv = pick(draft_decode_kv_indices, draft_decode_kv_indices_ref)
        self._shared_kv = pick(shared_prefix_kv_indices, shared_prefix_kv_indices_ref)
        self._branch_kv = pick(branch_kv_indices, branch_kv_indices_ref)
        self._verify_kv = pick(verify_kv_indices, verify_kv_indices_ref)
        self._tree_mask = pick(tree_custom_mask, tree_custom_mask_ref)
        k, s, n, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.max_bs
        buf = self.buffers
        for group in ("draft_decode", "draft_decode_shared", "target_verify", "draft_extend"):
            if group in groups:  # page size 1: every last page holds one token
                buf[f"{group}.kv_last_page_len"].fill_(1)
                buf[f"{group}.kv_last_page_len_host"].fill_(1)
        # Uniform query strides, written once for the largest batch (design §3.1), and their
        # host mirrors, written on the host by the same helper (no device-to-host copy).
        self._layouts = {}
        for name, group, key, width, rows in (
            ("target_verify", "target_verify", "target_verify.qo_indptr", n, bs),
            ("draft_extend", "draft_extend", "draft_extend.qo_indptr", n, bs),
            ("prefix", "draft_decode_shared", "draft_decode_shared.prefix_qo_indptr", k, bs),
            ("chain", "draft_decode_shared", "draft_decode_shared.chain_qo_indptr", 1, bs * k),
        ):
            if group in groups:
                self._layouts[name] = UniformQueryLayout.create(
                    width, rows, self.device, out=buf[key]
                )
                UniformQueryLayout.create(width, rows, "cpu", out=buf[f"{key}_host"])
        if "draft_decode" in groups:  # the torch rule of its host mirror, constants made once
            self._draft_indptr = DraftDecodeIndptr(k, s, bs, torch.int32)
        # Every mode's seq_lens_cpu is checked by its mirror writer (host_ops), which reads the
        # range and the shift from its table: L for the draft modes, L + N for the prefill
        # modes, whose lists hold L + N. The torch writers gather the lengths from the table.
        # (the larger table first, so the smaller is a view of the same arange)
        tables = {n: LengthTable(cfg.max_context_len, bs, n)}
        tables[0] = LengthTable(cfg.max_context_len, bs)
        for mode in self.modes:
            self.length_tables[mode] = tables[n if mode in ("target_verify", "draft_extend") else 0]
        if "draft_decode_shared" in groups:
            # The chain level's offsets do not depend on the batch: z·(s + 1).
            z = torch.arange(bs * k + 1, dtype=torch.int32)
            for row in range(s):
                buf["draft_decode_shared.chain_kv_indptr_host"][row] = z * (row + 1)

    # ----------------------------------------------------------------------------------------
    def draft_decode(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
    ) -> FlashInferDraftDecode:
        """Per-branch token lists of every draft-decode forward (page size 1, design §3.3).

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            ``[B]``, ``[R, W_row]``, ``[B]`` on the builder's device (``B ≤ max_bs``; a padded
            batch is a batch).
        seq_lens_cpu : torch.Tensor, optional
            ``[B]`` on the CPU, equal to ``seq_lens``: gives the host mirrors and the capacity
            check before launch.
        num_rows : int, optional
            Forwards to build; default ``S − 1`` (draft decode runs ``S − 1`` forwards).
        status : torch.Tensor, optional
            Status word; default :attr:`status`.
        launch : bool
            ``False``: launch nothing, only refresh the host mirrors from ``seq_lens_cpu`` and
            return the views. For CUDA graphs: the kernels run inside the captured graph, the
            host mirrors for ``plan()`` are computed outside it, before each replay.
        """
        cfg, buf = self.cfg, self.buffers
        rows = self.draft_rows("draft_decode", num_rows)
        inputs = self.check("draft_decode", req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, status=status)  # fmt: skip
        B, K = inputs.batch, cfg.topk
        result = self._mirrored("draft_decode", inputs, (B, rows), self._draft_decode_result)
        if launch:
            self.launch_plan(inputs, (rows,), lambda: self._draft_kv(
                req_pool_indices, req_to_token, seq_lens, topk=K, num_steps=cfg.num_steps,
                page_size=cfg.page_size, num_rows=rows, kv_indices=buf["draft_decode.kv_indices"],
                kv_indptr=buf["draft_decode.kv_indptr"],
                seq_lens_sum=inputs.seq_lens_sum,
                status=self.status_word(status),
            ))  # fmt: skip
        return result

    def _draft_decode_result(self, B: int, rows: int, mirrors: dict | None):
        """The result of ``B`` requests and ``rows`` steps, and the writer of its host mirror
        into ``mirrors``, the ring's set (``None`` without one)."""
        buf, K = self.buffers, self.cfg.topk
        host = mirrors["kv_indptr_host"] if mirrors is not None else None
        ones = buf["draft_decode.kv_last_page_len"][: B * K]
        ones_host = buf["draft_decode.kv_last_page_len_host"][: B * K]
        steps = tuple(
            FlashInferDecodeStep(
                kv_indptr=buf["draft_decode.kv_indptr"][s, : B * K + 1],
                kv_indices=buf["draft_decode.kv_indices"][s],
                kv_last_page_len=ones,
                kv_indptr_host=host[s, : B * K + 1] if host is not None else None,
                kv_last_page_len_host=ones_host,
                page_size=1,
            )
            for s in range(rows)
        )
        if host is None:
            return FlashInferDraftDecode(steps), None
        write = host_ops.draft_decode_writer(
            self.length_tables["draft_decode"], self._draft_indptr, K, B,
            host[:rows, : B * K + 1], use_compiled=self.host_ops,
        )  # fmt: skip
        return FlashInferDraftDecode(steps), write

    def draft_decode_shared_prefix(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
    ) -> FlashInferCascadeDecode:
        """Cascade draft decode: each prefix once, each branch's chain a second level.

        Arguments as in :meth:`draft_decode`. One launch builds both levels for every step;
        the consumer merges the two levels' outputs by log-sum-exp.
        """
        cfg, buf = self.cfg, self.buffers
        rows = self.draft_rows("draft_decode_shared_prefix", num_rows)
        inputs = self.check("draft_decode_shared_prefix", req_pool_indices, req_to_token,
                             seq_lens, seq_lens_cpu=seq_lens_cpu, status=status)  # fmt: skip
        B, K, mode = inputs.batch, cfg.topk, "draft_decode_shared"
        result = self._mirrored("draft_decode_shared_prefix", inputs, (B, rows),
                                self._shared_result)  # fmt: skip
        if launch:
            self.launch_plan(inputs, (rows,), lambda: self._shared_kv(
                req_pool_indices, req_to_token, seq_lens, topk=K, num_steps=cfg.num_steps,
                page_size=cfg.page_size, num_rows=rows,
                prefix_kv_indices=buf[f"{mode}.prefix_kv_indices"],
                prefix_kv_indptr=buf[f"{mode}.prefix_kv_indptr"],
                chain_kv_indices=buf[f"{mode}.chain_kv_indices"],
                chain_kv_indptr=buf[f"{mode}.chain_kv_indptr"],
                seq_lens_sum=inputs.seq_lens_sum,
                status=self.status_word(status),
            ))  # fmt: skip
        return result

    def _shared_result(self, B, rows, mirrors):
        """The result and the writer of its prefix level's host offsets (``None`` without
        them)."""
        buf, K, mode = self.buffers, self.cfg.topk, "draft_decode_shared"
        prefix_host = mirrors["prefix_kv_indptr_host"][: B + 1] if mirrors is not None else None
        ones = buf[f"{mode}.kv_last_page_len"]
        qo = (self._layouts["prefix"].cu_seqlens_q(B), self._layouts["chain"].cu_seqlens_q(B * K))
        qo_host = (
            buf[f"{mode}.prefix_qo_indptr_host"][: B + 1],
            buf[f"{mode}.chain_qo_indptr_host"][: B * K + 1],
        )
        ones_host = buf[f"{mode}.kv_last_page_len_host"]
        chain_host = buf[f"{mode}.chain_kv_indptr_host"]
        steps = tuple(
            FlashInferCascadeStep(
                qo_indptr_arr=qo,
                paged_kv_indptr_arr=(
                    buf[f"{mode}.prefix_kv_indptr"][: B + 1],
                    buf[f"{mode}.chain_kv_indptr"][s, : B * K + 1],
                ),
                paged_kv_indices_arr=(
                    buf[f"{mode}.prefix_kv_indices"],
                    buf[f"{mode}.chain_kv_indices"][s],
                ),
                paged_kv_last_page_len=(ones[:B], ones[: B * K]),
                qo_indptr_host_arr=qo_host,
                paged_kv_indptr_host_arr=(
                    (prefix_host, chain_host[s, : B * K + 1]) if prefix_host is not None else None
                ),
                paged_kv_last_page_len_host_arr=(ones_host[:B], ones_host[: B * K]),
            )
            for s in range(rows)
        )
        if prefix_host is None:
            return FlashInferCascadeDecode(steps), None
        write = host_ops.prefix_writer(self.length_tables["draft_decode_shared_prefix"], B,
                                       prefix_host, use_compiled=self.host_ops)  # fmt: skip
        return FlashInferCascadeDecode(steps), write

    def draft_decode_paged(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        num_rows: int | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
    ) -> FlashInferDraftDecode:
        """Per-branch page lists with the pool's page size (plan with ``cfg.page_size``).

        Branch ``b·K + t`` at step ``s`` reads the request's full prefix pages, then its own
        region's pages, ``L_b + s + 1`` tokens. In slot layout B the regions of branches
        ``t ≥ 1`` start with a copy of the prefix tail: run the pairs of
        ``prefix_tail_copy_pairs`` through ``move_kv_cache`` before the forward. Arguments as
        in :meth:`draft_decode`.
        """
        cfg, buf = self.cfg, self.buffers
        rows = self.draft_rows("draft_decode_paged", num_rows)
        inputs = self.check("draft_decode_paged", req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, status=status)  # fmt: skip
        B, K, ps, mode = inputs.batch, cfg.topk, cfg.page_size, "draft_decode_paged"
        result = self._mirrored(mode, inputs, (B, rows), self._paged_result)
        if launch:
            self._branch_kv(
                req_pool_indices, req_to_token, seq_lens, topk=K, num_steps=cfg.num_steps,
                page_size=ps, num_rows=rows, kv_indices=buf[f"{mode}.kv_indices"],
                kv_indptr=buf[f"{mode}.kv_indptr"], kv_last_page_len=buf[f"{mode}.kv_last_page_len"],
                seq_lens_sum=inputs.seq_lens_sum,
                status=self.status_word(status),
            )  # fmt: skip
        return result

    def _paged_result(self, B, rows, mirrors):
        """The result and the writer of its host mirrors (``None`` without them)."""
        buf, K, ps, mode = self.buffers, self.cfg.topk, self.cfg.page_size, "draft_decode_paged"
        ptr_host = lpl_host = None
        if mirrors is not None:
            ptr_host, lpl_host = mirrors["kv_indptr_host"], mirrors["kv_last_page_len_host"]
        steps = tuple(
            FlashInferDecodeStep(
                kv_indptr=buf[f"{mode}.kv_indptr"][s, : B * K + 1],
                kv_indices=buf[f"{mode}.kv_indices"][s],
                kv_last_page_len=buf[f"{mode}.kv_last_page_len"][s, : B * K],
                kv_indptr_host=ptr_host[s, : B * K + 1] if ptr_host is not None else None,
                kv_last_page_len_host=lpl_host[s, : B * K] if lpl_host is not None else None,
                page_size=ps,
            )
            for s in range(rows)
        )
        if ptr_host is None:
            return FlashInferDraftDecode(steps), None
        write = host_ops.paged_writer(
            self.length_tables["draft_decode_paged"], K, ps, B,
            ptr_host[:rows, : B * K + 1], lpl_host[:rows, : B * K], use_compiled=self.host_ops,
        )  # fmt: skip
        return FlashInferDraftDecode(steps), write

    def _prefill_kv(self, mode, req_pool_indices, req_to_token, seq_lens, inputs, status):
        """Launch the KV lists of a prefill mode (``kv_indptr = [0, cumsum(L + N)]``)."""
        buf = self.buffers
        self._verify_kv(
            req_pool_indices, req_to_token, seq_lens, extra_tokens=self.cfg.num_draft_tokens,
            kv_indices=buf[f"{mode}.kv_indices"], kv_indptr=buf[f"{mode}.kv_indptr"],
            seq_lens_sum=inputs.seq_lens_sum,
            status=self.status_word(status),
        )  # fmt: skip

    def _mirrored(self, mode: str, inputs, key: tuple, make):
        """The result of ``mode`` for ``key`` (``B`` and the host integers it depends on) with
        its host mirrors written, before any launch: ``make(*key, mirrors)`` makes the result
        and its writer once per key and ring set, ``mirrors`` the ring's next set, or
        ``None`` without ``seq_lens_cpu`` (then no writer); through :meth:`described`. A key's
        results are one list, a slot per set (:meth:`result`'s bound counts keys, not sets)."""
        ring = self._mirrors[self.plan_groups.get(mode, mode)]
        made = self.result((mode, *key), _slots, len(ring.sets) + 1)  # the last: no mirrors
        take = ring.take

        def describe(inp):
            if inp.seq_lens_cpu is None:
                if made[-1] is None:
                    made[-1] = make(*key, None)
                return made[-1][0]
            slot = take()
            entry = made[slot] or _make(made, slot, make, key, ring)
            self.write_mirrors(mode, inp, entry[1])
            return entry[0]

        return self.described(mode, inputs, describe, step=lambda: self._host_step(
            mode, inputs.batch, key, make, made, ring))  # fmt: skip

    def _host_step(self, mode, B, key, make, made, ring):
        """``step(seq_lens_cpu) -> result``, :meth:`described`'s ``step``: the ring's turn,
        the set's writer on the lengths, the set's result; lengths the writer refuses get the
        builder's message. With the compiled turn it is one compiled call (``mirror_step``),
        which leaves a set whose result is not made yet, and a refusal, to ``slow``."""

        def slow(slot, seq_lens_cpu):  # holds the ring, whose state the compiled turn writes
            entry = made[slot] or _make(made, slot, make, key, ring)
            self.write_mirrors(mode, BuildInputs(B, seq_lens_cpu), entry[1])  # names a refusal
            return entry[0]

        op = host_ops.compiled() if self.host_ops and ring.turn is not None else None
        if op is not None:
            return functools.partial(op.mirror_step, *ring.turn, made, slow)
        take = ring.take
        return lambda seq_lens_cpu: slow(take(), seq_lens_cpu)

    def target_verify(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        tree_mask: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        packed: bool = False,
        status: torch.Tensor | None = None,
        launch: bool = True,
    ) -> FlashInferPrefill:
        """Target verify of an ``N``-node tree: node ``j`` of request ``i`` at ``row_i[L_i + j]``.

        Parameters
        ----------
        tree_mask : torch.Tensor
            ``[B, N, N]`` bool ancestor mask (``m[i, j, c]`` iff ``c == j`` or ``c`` is an
            ancestor of ``j``); a chain is the lower triangle.
        packed : bool
            Build ``packed_custom_mask`` (FlashInfer's packed-bit form) instead of the bool
            ``custom_mask``.

        Other arguments as in :meth:`draft_decode`. Two launches: the KV lists and the mask.
        """
        cfg, buf = self.cfg, self.buffers
        n, mode = cfg.num_draft_tokens, "target_verify"
        where = self.require(mode)
        if self.verify_mask not in ("packed" if packed else "bool", "both"):
            raise ValueError(
                f"{where}: packed={packed}, but this builder was constructed with "
                f"verify_mask={self.verify_mask!r}; construct it with "
                f"verify_mask={'packed' if packed else 'bool'!r} or 'both'"
            )
        if tree_mask is None:
            raise ValueError(
                f"{where}: tree_mask is required; pass the [B, N, N] "
                f"bool ancestor mask of the draft tree (N = {n}; a chain is the lower triangle)"
            )
        inputs = self.check(mode, req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, tree_mask=tree_mask,
                             status=status)  # fmt: skip
        B = inputs.batch
        form = "packed_" if packed else ""
        result = self._mirrored(mode, inputs, (B, form), self._verify_result)
        mask = buf[f"{mode}.{form}custom_mask"]
        mask_indptr = buf[f"{mode}.{form}mask_indptr"]

        def run():
            self._prefill_kv(mode, req_pool_indices, req_to_token, seq_lens, inputs, status)
            self._tree_mask(
                seq_lens, tree_mask, packed=packed, custom_mask=mask, mask_indptr=mask_indptr,
                seq_lens_sum=inputs.seq_lens_sum, status=self.status_word(status),
            )  # fmt: skip

        if launch:  # both launches, replayed together (contract.launch_plan)
            self.launch_plan(inputs, (packed,), run)
        return result

    def _verify_result(self, B, form, mirrors):
        """The target-verify result, and the writer of its host offsets into the ring's set
        ``mirrors`` (``None`` without them)."""
        buf, mode = self.buffers, "target_verify"
        mask = buf[f"{mode}.{form}custom_mask"]
        kv_host = mask_host = None
        if mirrors is not None:
            kv_host = mirrors["kv_indptr_host"][: B + 1]
            mask_host = mirrors[f"{form}mask_indptr_host"][: B + 1]
        result = FlashInferPrefill(
            qo_indptr=self._layouts[mode].cu_seqlens_q(B),
            kv_indptr=buf[f"{mode}.kv_indptr"][: B + 1],
            kv_indices=buf[f"{mode}.kv_indices"],
            kv_last_page_len=buf[f"{mode}.kv_last_page_len"][:B],
            custom_mask=None if form else mask,
            packed_custom_mask=mask if form else None,
            mask_indptr=buf[f"{mode}.{form}mask_indptr"][: B + 1],
            causal=False,
            qo_indptr_host=buf[f"{mode}.qo_indptr_host"][: B + 1],
            kv_indptr_host=kv_host,
            kv_last_page_len_host=buf[f"{mode}.kv_last_page_len_host"][:B],
            mask_indptr_host=mask_host,
            max_q_len=self.cfg.num_draft_tokens,
        )
        if kv_host is None:
            return result, None
        # kv_indptr = [0, cumsum(L + N)]; element offsets of the mask in both forms (the packed
        # segments start there, read as bytes): request i's mask is N × (L_i + N) elements,
        # so mask_indptr = N · kv_indptr.
        n = self.cfg.num_draft_tokens
        write = host_ops.prefix_writer(self.length_tables[mode], B, kv_host, mask_host, n,
                                       use_compiled=self.host_ops)  # fmt: skip
        return result, write

    def draft_extend(
        self,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        status: torch.Tensor | None = None,
        launch: bool = True,
    ) -> FlashInferPrefill:
        """Draft extend: ``N`` query rows a request (uniform stride, padded rows full width),
        ``kv_indptr = [0, cumsum(L + N)]``, causal (bottom-right). Arguments as in
        :meth:`draft_decode`."""
        mode = "draft_extend"
        inputs = self.check(mode, req_pool_indices, req_to_token, seq_lens,
                             seq_lens_cpu=seq_lens_cpu, status=status)  # fmt: skip
        B = inputs.batch
        result = self._mirrored(mode, inputs, (B,), self._extend_result)
        if launch:
            self._prefill_kv(mode, req_pool_indices, req_to_token, seq_lens, inputs, status)
        return result

    def _extend_result(self, B, mirrors):
        """The draft-extend result, and the writer of its host offsets (``None`` without
        them): ``kv_indptr = [0, cumsum(L + N)]``."""
        buf, mode = self.buffers, "draft_extend"
        kv_host = mirrors["kv_indptr_host"][: B + 1] if mirrors is not None else None
        result = FlashInferPrefill(
            qo_indptr=self._layouts[mode].cu_seqlens_q(B),
            kv_indptr=buf[f"{mode}.kv_indptr"][: B + 1],
            kv_indices=buf[f"{mode}.kv_indices"],
            kv_last_page_len=buf[f"{mode}.kv_last_page_len"][:B],
            custom_mask=None,
            packed_custom_mask=None,
            mask_indptr=None,
            causal=True,
            qo_indptr_host=buf[f"{mode}.qo_indptr_host"][: B + 1],
            kv_indptr_host=kv_host,
            kv_last_page_len_host=buf[f"{mode}.kv_last_page_len_host"][:B],
            mask_indptr_host=None,
            max_q_len=self.cfg.num_draft_tokens,
        )
        if kv_host is None:
            return result, None
        write = host_ops.prefix_writer(self.length_tables[mode], B, kv_host,
                                       use_compiled=self.host_ops)  # fmt: skip
        return result, write


def _slots(count: int) -> list:
    """A key's results, one slot per ring set (``None`` until made)."""
    return [None] * count


def _make(made: list, slot: int, make, key: tuple, ring: HostMirrorRing) -> tuple:
    """``made[slot]``: the result of ``key`` and the writer of its mirrors, in ring set
    ``slot``."""
    entry = made[slot] = make(*key, ring.sets[slot])
    return entry
