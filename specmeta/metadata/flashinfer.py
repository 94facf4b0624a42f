"""FlashInfer metadata builders (design §3.3): draft decode (per-branch token lists, a
shared-prefix cascade, or per-branch page lists), target verify with a tree mask, draft extend.

A :class:`FlashInferBuilder` allocates its buffers from :func:`~specmeta.plan_buffers` (keys
``flashinfer.<group>.<field>``) and writes the batch-independent values (``qo_indptr`` strides,
``kv_last_page_len`` ones) once. A mode runs the sync-free kernels into those buffers and returns
a frozen dataclass of views named as FlashInfer ``plan()``'s keywords, eager or in a CUDA graph.
``plan()`` reads index pointers on the host: these host mirrors (``*_host``) are written from the
``seq_lens_cpu`` the engine already holds (never copied back from the device), so every host
call needs it. A mode's stage (``bind_<mode>``) launches with ``stage.launch()``;
``stage.host(seq_lens_cpu)`` writes the mirrors of the ring's next set and returns the result.

The draft-decode forms differ in what they list: :meth:`~FlashInferBuilder.draft_decode`
per-branch token lists, planned with page size 1 (``S·K·ΣL`` prefix entries an iteration);
:meth:`~FlashInferBuilder.draft_decode_shared_prefix` a two-level cascade
(``MultiLevelCascadeAttentionWrapper``) with each prefix once (``ΣL + B·K·S(S+1)/2`` entries);
:meth:`~FlashInferBuilder.draft_decode_paged` per-branch page lists with the pool's page size
(slot layout B: the copies of ``prefix_tail_copy_pairs`` must be in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..config import SpecConfig, plan_buffers
from ..kernels.branch_kv_indices import bind_branch_kv_indices, branch_kv_indices_ref
from ..kernels.draft_decode_kv_indices import (
    DraftDecodeIndptr,
    bind_draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from ..kernels.host_lengths import publish_host_lengths
from ..kernels.shared_prefix_kv_indices import (
    bind_shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from ..kernels.tree_custom_mask import bind_tree_custom_mask, tree_custom_mask_ref
from ..kernels.verify_kv_indices import bind_verify_kv_indices, verify_kv_indices_ref
from ..stage import Stage
from . import host_ops
from .capabilities import CAPABILITIES, PLAN_GROUPS, VERIFY_MASKS, verify_mask_keys
from .contract import MetadataBuilder
from .flashinfer_results import (
    FlashInferCascadeDecode,
    FlashInferCascadeStep,
    FlashInferDecodeStep,
    FlashInferDraftDecode,
    FlashInferPrefill,
    ragged_prefill,
)
from .host_mirrors import HostMirrorRing
from .host_ops import LengthRule
from .layout import UniformQueryLayout

__all__ = ["FlashInferBuilder", "FlashInferDecodeStep", "FlashInferDraftDecode",
           "FlashInferCascadeStep", "FlashInferCascadeDecode", "FlashInferPrefill"]  # fmt: skip

_PREFIX = "flashinfer."
# Host mirrors that change with the batch, by plan group; they come from a ring (see
# host_mirrors). The other ``*_host`` buffers hold values fixed at construction (strides, ones).
_PER_BATCH_MIRRORS = {
    "draft_decode": ("kv_indptr_host",),
    "draft_decode_shared": ("prefix_kv_indptr_host",),
    "draft_decode_paged": ("kv_indptr_host", "kv_last_page_len_host"),
    "target_verify": ("kv_indptr_host", "mask_indptr_host", "packed_mask_indptr_host",
                      "verify_lens_host", "ragged_qo_indptr_host"),  # fmt: skip
    "draft_extend": ("kv_indptr_host",),
}
# The result fields a host call writes from seq_lens_cpu, by mode (named by its refusal).
_HOST_FIELDS = {
    "draft_decode": "kv_indptr_host",
    "draft_decode_shared_prefix": "paged_kv_indptr_host_arr",
    "draft_decode_paged": "kv_indptr_host, kv_last_page_len_host",
    "target_verify": "kv_indptr_host, mask_indptr_host",
    "draft_extend": "kv_indptr_host",
}


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
        Sets of per-batch host mirrors, used in turn (default 16; :mod:`.host_mirrors`): a set
        is reused only once the stream has passed the ``plan()`` that read it, so an engine may
        build up to ``mirror_depth // 2`` iterations ahead of the device before a build waits.
        A result's mirrors stay valid for ``mirror_depth`` more builds of the same mode.
    host_ops : bool
        Write the per-batch host mirrors with the compiled writers where
        :func:`specmeta.warmup` built them (default; :mod:`.host_ops`), else with the torch
        rules; both check every ``seq_lens_cpu`` value first and write the same integers.
    check_host_lengths : bool
        Check on the device that ``seq_lens_cpu`` agrees with ``seq_lens`` (default; see
        :class:`~specmeta.metadata.contract.MetadataBuilder`).

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
    >>> stage = fi.bind_draft_decode(req_pool_indices, req_to_token, seq_lens)  # once
    >>> meta = stage.host(lens); stage.launch()  # every step (the launch: or in a graph)
    """

    plan_prefix = _PREFIX
    capabilities = CAPABILITIES["flashinfer"]
    plan_groups = PLAN_GROUPS["flashinfer"]
    #: The target-verify mask forms: the bool ``custom_mask``, the packed-bit one, or both.
    VERIFY_MASKS = VERIFY_MASKS

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
        dropped = verify_mask_keys(verify_mask)
        return [key for key in super().plan_keys(cfg, modes) if key not in dropped]

    def __new__(cls, *args: Any, sliding_window_size: int | None = None, **kwargs: Any):
        """A window layer's builder (``sliding_window_size = w``, design §2.10) is a
        :class:`~.flashinfer_window.FlashInferWindowBuilder`."""
        if sliding_window_size and cls is FlashInferBuilder:
            from .flashinfer_window import FlashInferWindowBuilder

            cls = FlashInferWindowBuilder
        return super().__new__(cls)

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 modes: Iterable[str] | None = None, reference: bool = False,
                 mirror_depth: int = 16, verify_mask: str = "both", host_ops: bool = True,
                 check_host_lengths: bool = True, sliding_window_size: int | None = None):  # fmt: skip
        del sliding_window_size  # a full layer's builder (see __new__)
        super().__init__(cfg, device, modes=modes, reference=reference, host_ops=host_ops,
                         check_host_lengths=check_host_lengths)  # fmt: skip
        self.verify_mask = verify_mask
        plan, pin = plan_buffers(cfg), self.device.type == "cuda"
        groups = {self.plan_groups.get(m, m) for m in self.modes}
        # Each served group's planned buffers: its per-batch host mirrors go to a ring, the
        # other host buffers to (pinned) CPU memory, the rest to the device.
        self.buffers: dict[str, torch.Tensor] = {}
        ring_specs: dict[str, dict] = {group: {} for group in groups}
        for key in self.plan_keys(cfg, self.modes, verify_mask):
            name = key[len(self.plan_prefix) :]
            group, field = name.split(".", 1)
            if field in _PER_BATCH_MIRRORS[group]:
                ring_specs[group][field] = plan[key]
            elif field.endswith("_host"):
                buf = plan[key].allocate("cpu")
                self.buffers[name] = buf.pin_memory() if pin else buf
            else:
                self.buffers[name] = plan[key].allocate(self.device)
        self._mirrors = {group: HostMirrorRing(specs, mirror_depth, self.device)
                         for group, specs in ring_specs.items()}  # fmt: skip
        k, s, n, bs = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.max_bs
        buf = self.buffers
        for group in ("draft_decode", "draft_decode_shared", "target_verify", "draft_extend"):
            if group in groups:  # page size 1: every last page holds one token
                buf[f"{group}.kv_last_page_len"].fill_(1)
                buf[f"{group}.kv_last_page_len_host"].fill_(1)
        # Uniform query strides, written once for the largest batch (design §3.1), and their
        # host mirrors, written on the host by the same helper (no device-to-host copy).
        self._layouts, create = {}, UniformQueryLayout.create
        for name, key, width, rows in (
            ("target_verify", "target_verify.qo_indptr", n, bs),
            ("draft_extend", "draft_extend.qo_indptr", n, bs),
            ("prefix", "draft_decode_shared.prefix_qo_indptr", k, bs),
            ("chain", "draft_decode_shared.chain_qo_indptr", 1, bs * k),
        ):
            if key.split(".")[0] in groups:
                self._layouts[name] = create(width, rows, self.device, out=buf[key])
                create(width, rows, "cpu", out=buf[f"{key}_host"])
        if "draft_decode" in groups:  # the torch rule of its host mirror, constants made once
            self._draft_indptr = DraftDecodeIndptr(k, s, bs, torch.int32)
        # Every mode's seq_lens_cpu is checked by its mirror writer (host_ops), which reads the
        # range and the shift from its length rule: L for the draft modes, L + N for the
        # prefill modes, whose lists hold L + N.
        rules = {n: LengthRule(cfg.max_context_len, n), 0: LengthRule(cfg.max_context_len)}
        self._length_rules = {
            mode: rules[n if mode in ("target_verify", "draft_extend") else 0]
            for mode in self.modes
        }
        for mode in ("draft_decode", "draft_decode_shared_prefix"):
            if mode in self.modes and cfg.draft_window_size:
                # A window's prefix lists hold min(L, window + sink) tokens (design §2.10).
                self._length_rules[mode] = LengthRule(cfg.max_context_len,
                                                      cap=cfg.draft_prefix_cap)  # fmt: skip
        if "draft_decode_shared" in groups:
            # The chain level's offsets do not depend on the batch: z·(s + 1).
            z = torch.arange(bs * k + 1, dtype=torch.int32)
            for row in range(s):
                buf["draft_decode_shared.chain_kv_indptr_host"][row] = z * (row + 1)

    def _window_lists(self, mode: str, full_to_swa: Any) -> dict:
        """The window rules' keywords of ``mode``'s list kernels (design §2.10): none for a full
        layer's builder, whose lists hold full-pool ids and which so refuses a window map."""
        if full_to_swa is not None:
            raise ValueError(f"{self.require(mode)}: full_to_swa was given, but this builder "
                             "serves full layers; build a window layer's lists with "
                             "FlashInferBuilder(cfg, device, sliding_window_size=w) "
                             "(design §2.10)")  # fmt: skip
        return {}

    # -- the stages -----------------------------------------------------------------------------
    def _stage(self, mode: str, B: int, key: tuple, launches: list, make: Callable,
               seq_lens: torch.Tensor, status: torch.Tensor | None,
               verify: Callable | None = None) -> Stage:  # fmt: skip
        """The stage of ``mode`` for ``B`` requests and the host integers of ``key``:
        ``launches`` and the check of the host's lengths, and a host part that checks
        ``seq_lens_cpu`` (its writer, compiled or numpy, checks every value in its one call
        before it writes; a refusal is then named) and publishes what it read for that check,
        takes the ring's turn,
        runs its set's writer and returns the set's result. ``make(B, *key, mirrors, compiled)``
        makes a set's result and writer once, a slot per set in :meth:`views`. A ragged verify
        passes ``verify(verify_lens_cpu)``, its checks; any other stage refuses the lengths."""
        ring = self._mirrors[self.plan_groups.get(mode, mode)]
        made = tuple(self.views((mode, B, *key, c), _slots, len(ring.sets)) for c in (0, 1))
        sets, claim, advance, where = ring.sets, ring.claim, ring.advance, self._where[mode]
        compiled_module, builder, lengths = host_ops.compiled, self, self.lengths
        # What the writer read, published for the device's checks without the checks it made
        # already: the lengths' slot, and a ragged verify's (its count bound in verify).
        lengths_slot = self._host_published[mode] if self.check_host_lengths else None
        verify_slot = (self._verify_published if verify is not None and lengths_slot is not None
                       else None)  # fmt: skip
        verify_count = verify.args[1] if verify_slot is not None else 0

        def checks(seq_lens_cpu: torch.Tensor, verify_lens_cpu: Any) -> None:
            """Every check of the host inputs, each fault named, and their publication."""
            lengths(mode, B, seq_lens_cpu)
            if verify is not None:
                verify(verify_lens_cpu)

        def host(seq_lens_cpu: torch.Tensor | None, verify_lens_cpu: Any = None) -> Any:
            if seq_lens_cpu is None:
                raise ValueError(
                    f"{where}: seq_lens_cpu is None, but FlashInfer's plan() reads the host "
                    f"mirrors ({_HOST_FIELDS[mode]}) that are written from it; pass "
                    "seq_lens_cpu=, the CPU copy of seq_lens the engine already holds (a copy "
                    "of seq_lens made here would sync with the device)")  # fmt: skip
            if verify is None and verify_lens_cpu is not None:
                raise ValueError(
                    f"{where}: verify_lens_cpu was given, but this stage was bound without "
                    "verify_lens (a uniform layout); bind it with verify_lens= and num_tokens= "
                    "for a ragged verify, or drop verify_lens_cpu")  # fmt: skip
            compiled = builder.host_ops and compiled_module() is not None
            slot = claim()
            results = made[compiled]
            entry = results[slot]
            if entry is None:
                entry = results[slot] = make(B, *key, sets[slot], compiled)
            inputs = (seq_lens_cpu,) if verify is None else (seq_lens_cpu, verify_lens_cpu)
            try:  # one call, compiled or numpy, makes every check, writes, returns what it read
                found = entry[1](*inputs)
            except (TypeError, ValueError, IndexError, OverflowError):
                checks(seq_lens_cpu, verify_lens_cpu)  # nothing was written: name the fault
                raise
            if lengths_slot is not None:  # what the writer read
                publish_host_lengths(lengths_slot, B, found[1], found[0])
                if verify_slot is not None:
                    publish_host_lengths(verify_slot, verify_count, found[3], found[2])
            advance()
            return entry[0]

        check = self.host_check(mode, seq_lens, self.status_word(status))
        return Stage([*launches, check], host=host)

    def _bind_draft(self, mode: str, bind: Callable, ref: Callable, tensors: tuple,
                    num_rows: int | None, status: torch.Tensor | None, outputs: tuple,
                    make: Callable, **spaces: Any) -> Stage:  # fmt: skip
        """A draft-decode mode's stage: one launch of ``bind`` (``ref`` for a reference build)
        on ``tensors`` over ``num_rows`` steps into the mode's buffers ``outputs``, with the
        id-space keywords ``spaces`` (design §2.10) of the modes that take them."""
        cfg, group = self.cfg, self.plan_groups.get(mode, mode)
        rows = self.draft_rows(mode, num_rows)
        B = self.check(mode, *tensors, status=status,
                       entry_page_size=spaces.get("entry_page_size", 1))  # fmt: skip
        launch = self._launch(
            bind, ref, *tensors, topk=cfg.topk, num_steps=cfg.num_steps, page_size=cfg.page_size,
            num_rows=rows, status=self.status_word(status), **spaces,
            **{field: self.buffers[f"{group}.{field}"] for field in outputs},
        )  # fmt: skip
        return self._stage(mode, B, (rows,), [launch], make, tensors[2], status)

    def _decode_steps(self, mode: str, B: int, rows: int, ptr_host: torch.Tensor, last: Any,
                      last_host: Any, page_size: int) -> FlashInferDraftDecode:  # fmt: skip
        """Steps ``0 … rows − 1`` of a per-branch draft decode of ``mode``: step ``s`` reads row
        ``s`` of the lists, of ``ptr_host``, and ``last[s]``, ``last_host[s]``."""
        buf, width = self.buffers, B * self.cfg.topk + 1
        return FlashInferDraftDecode(tuple(
            FlashInferDecodeStep(
                kv_indptr=buf[f"{mode}.kv_indptr"][s, :width],
                kv_indices=buf[f"{mode}.kv_indices"][s],
                kv_last_page_len=last[s],
                kv_indptr_host=ptr_host[s, :width],
                kv_last_page_len_host=last_host[s],
                page_size=page_size,
            )
            for s in range(rows)
        ))  # fmt: skip

    # -- draft decode: per-branch token lists ---------------------------------------------------
    def bind_draft_decode(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                          seq_lens: torch.Tensor, *, num_rows: int | None = None,
                          status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                          entry_page_size: int = 1,
                          full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`draft_decode` bound once to these tensors (arguments as there): the stage
        launches with ``launch()``; ``host(seq_lens_cpu)`` writes the host mirrors of the
        ring's next set and returns the :class:`FlashInferDraftDecode` that reads them."""
        cfg = self.cfg
        return self._bind_draft(
            "draft_decode", bind_draft_decode_kv_indices, draft_decode_kv_indices_ref,
            (req_pool_indices, req_to_token, seq_lens), num_rows, status,
            ("kv_indices", "kv_indptr"), self._draft_decode_result,
            window_size=cfg.draft_window_size, sink_size=cfg.draft_sink_size, v2p=v2p,
            entry_page_size=entry_page_size, **self._window_lists("draft_decode", full_to_swa),
        )  # fmt: skip

    def draft_decode(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                     num_rows: int | None = None, status: torch.Tensor | None = None,
                     launch: bool = True, v2p: torch.Tensor | None = None,
                     entry_page_size: int = 1,
                     full_to_swa: torch.Tensor | None = None) -> FlashInferDraftDecode:  # fmt: skip
        """Per-branch token lists of every draft-decode forward (page size 1, design §3.3).

        Parameters
        ----------
        req_pool_indices, req_to_token, seq_lens : torch.Tensor
            ``[B]``, ``[R, W_row]``, ``[B]`` on the builder's device (``B ≤ max_bs``; a padded
            batch is a batch).
        seq_lens_cpu : torch.Tensor
            ``[B]`` on the CPU, equal to ``seq_lens``: the host mirrors ``plan()`` reads are
            written from it (every value checked first). Required: ``None`` is refused, naming
            the fix (FlashInfer's ``plan()`` would fail on a missing mirror later).
        num_rows : int, optional
            Forwards to build; default ``S − 1`` (draft decode runs ``S − 1`` forwards).
        status : torch.Tensor, optional
            Status word; default :attr:`status`.
        launch : bool
            ``False``: launch nothing, only refresh the host mirrors from ``seq_lens_cpu`` and
            return the views. For CUDA graphs: the kernels run inside the captured graph, the
            host mirrors for ``plan()`` are computed outside it, before each replay.
        v2p : torch.Tensor, optional
            ``[P]`` virtual → physical page map of a pool that hands out virtual KV ids
            (design §2.10): the lists hold physical ids. A config's draft window
            (``draft_window_size``, ``draft_sink_size``) bounds every list, mirrors included.
        entry_page_size : int
            ``E``: ``req_to_token`` rows hold page ids of ``E`` positions each (position ``p``
            is ``row[p // E]·E + p mod E``, design §2.10), so a row needs only
            ``ceil(row_width_need / E)`` entries; 1 (the default): rows of token ids.
        full_to_swa : torch.Tensor, optional
            A window builder's ``[P_full]`` full → window pool slot map (design §2.10): the
            lists hold window-pool ids. A full layer's builder refuses it.
        """
        stage = self.bind_draft_decode(req_pool_indices, req_to_token, seq_lens,
                                       num_rows=num_rows, status=status, v2p=v2p,
                                       entry_page_size=entry_page_size, full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _draft_decode_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """The result of ``B`` requests and ``rows`` steps over the ring's set ``mirrors``,
        and the writer of its host mirror (every step reads the same ones)."""
        buf, K = self.buffers, self.cfg.topk
        host = mirrors["kv_indptr_host"]
        ones = [buf["draft_decode.kv_last_page_len"][: B * K]] * rows
        ones_host = [buf["draft_decode.kv_last_page_len_host"][: B * K]] * rows
        write = host_ops.draft_decode_writer(
            self._length_rules["draft_decode"], self._draft_indptr, K, B,
            host[:rows, : B * K + 1], use_compiled=compiled,
        )  # fmt: skip
        return self._decode_steps("draft_decode", B, rows, host, ones, ones_host, 1), write

    # -- draft decode: the shared-prefix cascade ------------------------------------------------
    def bind_draft_decode_shared_prefix(self, req_pool_indices: torch.Tensor,
                                        req_to_token: torch.Tensor, seq_lens: torch.Tensor, *,
                                        num_rows: int | None = None,
                                        status: torch.Tensor | None = None,
                                        v2p: torch.Tensor | None = None, entry_page_size: int = 1,
                                        full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`draft_decode_shared_prefix` bound once to these tensors (arguments as
        there); ``host(seq_lens_cpu)`` returns the :class:`FlashInferCascadeDecode`."""
        cfg, mode = self.cfg, "draft_decode_shared_prefix"
        return self._bind_draft(
            mode, bind_shared_prefix_kv_indices,
            shared_prefix_kv_indices_ref, (req_pool_indices, req_to_token, seq_lens), num_rows,
            status, ("prefix_kv_indices", "prefix_kv_indptr", "chain_kv_indices",
                     "chain_kv_indptr"), self._shared_result, v2p=v2p,
            entry_page_size=entry_page_size, window_size=cfg.draft_window_size,
            sink_size=cfg.draft_sink_size, **self._window_lists(mode, full_to_swa),
        )  # fmt: skip

    def draft_decode_shared_prefix(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                   seq_lens: torch.Tensor, *,
                                   seq_lens_cpu: torch.Tensor | None = None,
                                   num_rows: int | None = None, status: torch.Tensor | None = None,
                                   launch: bool = True, v2p: torch.Tensor | None = None,
                                   entry_page_size: int = 1, full_to_swa: torch.Tensor | None = None,
                                   ) -> FlashInferCascadeDecode:  # fmt: skip
        """Cascade draft decode: each prefix once, each branch's chain a second level; one
        launch builds both levels of every step, the consumer merges the two levels' outputs by
        log-sum-exp. Arguments as in :meth:`draft_decode` (``v2p``, ``entry_page_size``: the
        id space of the rows; a config's draft window bounds the prefix level, mirrors
        included, to ``min(L, W + Sk)`` tokens a request)."""
        stage = self.bind_draft_decode_shared_prefix(
            req_pool_indices, req_to_token, seq_lens, num_rows=num_rows, status=status, v2p=v2p,
            entry_page_size=entry_page_size, full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _shared_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """The cascade result over the ring's set ``mirrors``, and the writer of its prefix
        level's host offsets."""
        buf, K, mode = self.buffers, self.cfg.topk, "draft_decode_shared"
        prefix_host = mirrors["prefix_kv_indptr_host"][: B + 1]
        ones, ones_host = buf[f"{mode}.kv_last_page_len"], buf[f"{mode}.kv_last_page_len_host"]
        qo = (self._layouts["prefix"].cu_seqlens_q(B), self._layouts["chain"].cu_seqlens_q(B * K))
        qo_host = (buf[f"{mode}.prefix_qo_indptr_host"][: B + 1],
                   buf[f"{mode}.chain_qo_indptr_host"][: B * K + 1])  # fmt: skip
        chain_host = buf[f"{mode}.chain_kv_indptr_host"]
        steps = tuple(
            FlashInferCascadeStep(
                qo_indptr_arr=qo,
                paged_kv_indptr_arr=(buf[f"{mode}.prefix_kv_indptr"][: B + 1],
                                     buf[f"{mode}.chain_kv_indptr"][s, : B * K + 1]),
                paged_kv_indices_arr=(buf[f"{mode}.prefix_kv_indices"],
                                      buf[f"{mode}.chain_kv_indices"][s]),
                paged_kv_last_page_len=(ones[:B], ones[: B * K]),
                qo_indptr_host_arr=qo_host,
                paged_kv_indptr_host_arr=(prefix_host, chain_host[s, : B * K + 1]),
                paged_kv_last_page_len_host_arr=(ones_host[:B], ones_host[: B * K]),
            )
            for s in range(rows)
        )  # fmt: skip
        write = host_ops.prefix_writer(self._length_rules["draft_decode_shared_prefix"], B,
                                       prefix_host, use_compiled=compiled)  # fmt: skip
        return FlashInferCascadeDecode(steps), write

    # -- draft decode: per-branch page lists ----------------------------------------------------
    def bind_draft_decode_paged(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                seq_lens: torch.Tensor, *, num_rows: int | None = None,
                                status: torch.Tensor | None = None,
                                v2p: torch.Tensor | None = None, entry_page_size: int = 1,
                                full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`draft_decode_paged` bound once to these tensors (arguments as there);
        ``host(seq_lens_cpu)`` returns the :class:`FlashInferDraftDecode`."""
        return self._bind_draft(
            "draft_decode_paged", bind_branch_kv_indices, branch_kv_indices_ref,
            (req_pool_indices, req_to_token, seq_lens), num_rows, status,
            ("kv_indices", "kv_indptr", "kv_last_page_len"), self._paged_result, v2p=v2p,
            entry_page_size=entry_page_size,
            **self._window_lists("draft_decode_paged", full_to_swa),
        )  # fmt: skip

    def draft_decode_paged(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                           seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                           num_rows: int | None = None, status: torch.Tensor | None = None,
                           launch: bool = True, v2p: torch.Tensor | None = None,
                           entry_page_size: int = 1,
                           full_to_swa: torch.Tensor | None = None) -> FlashInferDraftDecode:  # fmt: skip
        """Per-branch page lists with the pool's page size (plan with ``cfg.page_size``).

        Branch ``b·K + t`` at step ``s`` reads the request's full prefix pages, then its own
        region's pages, ``L_b + s + 1`` tokens. In slot layout B the regions of branches
        ``t ≥ 1`` start with a copy of the prefix tail: run the pairs of
        ``prefix_tail_copy_pairs`` through ``move_kv_cache`` before the forward. Arguments as
        in :meth:`draft_decode` (the lists hold physical pages). No draft window (design §2.10).
        """
        stage = self.bind_draft_decode_paged(req_pool_indices, req_to_token, seq_lens,
                                             num_rows=num_rows, status=status, v2p=v2p,
                                             entry_page_size=entry_page_size,
                                             full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _paged_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """The result over the ring's set ``mirrors``, and the writer of its host mirrors."""
        buf, K, ps, mode = self.buffers, self.cfg.topk, self.cfg.page_size, "draft_decode_paged"
        ptr_host, last_host = mirrors["kv_indptr_host"], mirrors["kv_last_page_len_host"]
        last = buf[f"{mode}.kv_last_page_len"]
        write = host_ops.paged_writer(
            self._length_rules[mode], K, ps, B, ptr_host[:rows, : B * K + 1],
            last_host[:rows, : B * K], use_compiled=compiled,
        )  # fmt: skip
        steps = self._decode_steps(mode, B, rows, ptr_host, last[:, : B * K],
                                   last_host[:, : B * K], ps)  # fmt: skip
        return steps, write

    # -- target verify and draft extend ---------------------------------------------------------
    def _bind_prefill_kv(self, mode: str, req_pool_indices, req_to_token, seq_lens, status,
                         v2p, verify_lens=None, entry_page_size=1, window=None):  # fmt: skip
        """The launch of a prefill mode's KV lists (``kv_indptr = [0, cumsum(L + N)]``, or
        ``L + min(v, N)`` with ``verify_lens``), ids through the page map ``v2p`` when given
        (design §2.10)."""
        buf = self.buffers
        return self._launch(
            bind_verify_kv_indices, verify_kv_indices_ref, req_pool_indices, req_to_token,
            seq_lens, extra_tokens=self.cfg.num_draft_tokens, kv_indices=buf[f"{mode}.kv_indices"],
            kv_indptr=buf[f"{mode}.kv_indptr"], status=self.status_word(status), v2p=v2p,
            page_size=self.cfg.page_size, verify_lens=verify_lens,
            entry_page_size=entry_page_size, **(window or {}),
        )  # fmt: skip

    def bind_target_verify(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                           seq_lens: torch.Tensor, tree_mask: torch.Tensor, *, packed: bool = False,
                           status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                           verify_lens: torch.Tensor | None = None,
                           num_tokens: int | None = None, entry_page_size: int = 1,
                           full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`target_verify` bound once to these tensors (arguments as there): two
        launches, the KV lists and the mask (three for a ragged verify: the padding first);
        ``host(seq_lens_cpu)`` returns the :class:`FlashInferPrefill`
        (``host(seq_lens_cpu, verify_lens_cpu=...)`` for a ragged verify)."""
        n, mode = self.cfg.num_draft_tokens, "target_verify"
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
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, tree_mask=tree_mask,
                       status=status, entry_page_size=entry_page_size)  # fmt: skip
        form, window = "packed_" if packed else "", self._window_lists(mode, full_to_swa)
        pad, padded, T, verify = self.bind_bucket(mode, B, verify_lens, num_tokens, status)
        launches = [
            pad,
            self._bind_prefill_kv(mode, req_pool_indices, req_to_token, seq_lens, status, v2p,
                                  padded, entry_page_size, window),  # fmt: skip
            self._launch(
                bind_tree_custom_mask, tree_custom_mask_ref, seq_lens, tree_mask, packed=packed,
                custom_mask=self.buffers[f"{mode}.{form}custom_mask"],
                mask_indptr=self.buffers[f"{mode}.{form}mask_indptr"],
                status=self.status_word(status), verify_lens=padded,
                sliding_window_size=window.get("sliding_window_size"),
            ),
        ]  # fmt: skip
        if verify is not None:
            launches.append(self.verify_check(verify_lens, self.status_word(status)))
        count = None if verify is None else verify_lens.shape[0]
        return self._stage(mode, B, (form, T, count), launches, self._prefill_result, seq_lens,
                           status, verify)  # fmt: skip

    def target_verify(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                      seq_lens: torch.Tensor, tree_mask: torch.Tensor, *,
                      seq_lens_cpu: torch.Tensor | None = None, packed: bool = False,
                      status: torch.Tensor | None = None, launch: bool = True,
                      v2p: torch.Tensor | None = None, verify_lens: torch.Tensor | None = None,
                      verify_lens_cpu: torch.Tensor | None = None,
                      num_tokens: int | None = None, entry_page_size: int = 1,
                      full_to_swa: torch.Tensor | None = None) -> FlashInferPrefill:  # fmt: skip
        """Target verify of an ``N``-node tree: node ``j`` of request ``i`` at ``row_i[L_i + j]``.

        Parameters
        ----------
        tree_mask : torch.Tensor
            ``[B, N, N]`` bool ancestor mask (``m[i, j, c]`` iff ``c == j`` or ``c`` is an
            ancestor of ``j``); a chain is the lower triangle.
        packed : bool
            Build ``packed_custom_mask`` (FlashInfer's packed-bit form) instead of the bool
            ``custom_mask``.
        verify_lens : torch.Tensor, optional
            A ragged verify (design §2.9): ``[B' ≤ B]`` int32 or int64 on the device, real
            request ``b`` verifies its first ``v_b ≤ N`` nodes. The batch (``B``, every other
            tensor's) is the captured bucket's ``Bp`` requests; the lengths are padded to the
            bucket of ``num_tokens`` on the device (:func:`specmeta.pad_verify_lens_to_bucket`,
            leftover tokens to the pad requests ``B' … B − 1``) and request ``i`` gets ``v_i``
            query rows over ``row_i[0 : L_i + min(v_i, N)]``, its mask ``v_i × (L_i +
            min(v_i, N))`` (rows past ``N`` are filler rows, 1 in every column). A length
            outside ``[0, N]``, or a sum over ``num_tokens``, sets a status bit.
        verify_lens_cpu : torch.Tensor, optional
            ``[B']`` on the CPU, equal to ``verify_lens``; required with it (``plan()`` reads
            ``qo_indptr_host``, which is written from it). Checked on the host: each in
            ``[0, N]``, the sum at most ``num_tokens``.
        num_tokens : int, optional
            ``T``, the bucket's query tokens (``0 ≤ T ≤ B·N``); required with ``verify_lens``.

        Other arguments as in :meth:`draft_decode` (``v2p``: the lists hold physical ids;
        ``entry_page_size``: rows of page ids; ``full_to_swa``: window-pool ids). Two
        launches: the KV lists and the mask; a ragged verify pads the lengths first.
        """
        stage = self.bind_target_verify(req_pool_indices, req_to_token, seq_lens, tree_mask,
                                        packed=packed, status=status, v2p=v2p,
                                        verify_lens=verify_lens, num_tokens=num_tokens,
                                        entry_page_size=entry_page_size,
                                        full_to_swa=full_to_swa)  # fmt: skip
        if launch:
            return stage(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)
        return stage.host(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)

    def bind_draft_extend(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                          seq_lens: torch.Tensor, *, status: torch.Tensor | None = None,
                          v2p: torch.Tensor | None = None, entry_page_size: int = 1,
                          full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`draft_extend` bound once to these tensors (arguments as there);
        ``host(seq_lens_cpu)`` returns the :class:`FlashInferPrefill`."""
        mode = "draft_extend"
        B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status,
                       entry_page_size=entry_page_size)  # fmt: skip
        launch = self._bind_prefill_kv(mode, req_pool_indices, req_to_token, seq_lens, status,
                                       v2p, entry_page_size=entry_page_size,
                                       window=self._window_lists(mode, full_to_swa))  # fmt: skip
        return self._stage(mode, B, (None, None, None), [launch], self._prefill_result,
                           seq_lens, status)  # fmt: skip

    def draft_extend(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                     status: torch.Tensor | None = None, launch: bool = True,
                     v2p: torch.Tensor | None = None, entry_page_size: int = 1,
                     full_to_swa: torch.Tensor | None = None) -> FlashInferPrefill:  # fmt: skip
        """Draft extend: ``N`` query rows a request (uniform stride, padded rows full width),
        ``kv_indptr = [0, cumsum(L + N)]``, causal (bottom-right). Arguments as in
        :meth:`draft_decode`."""
        stage = self.bind_draft_extend(req_pool_indices, req_to_token, seq_lens, status=status,
                                       v2p=v2p, entry_page_size=entry_page_size,
                                       full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _prefill_result(self, B: int, form: str | None, T: int | None, count: int | None,
                        mirrors: dict, compiled: bool):  # fmt: skip
        """The result of target verify (mask ``form`` ``""``, bool, or ``"packed_"``; ragged
        over a bucket of ``T`` tokens, or uniform for ``T`` None) or draft extend (``form``
        None) over the ring's set ``mirrors``, and the writer of its host offsets. Uniform:
        ``kv_indptr = [0, cumsum(L + N)]`` and the mask's element offsets in both forms (the
        packed segments start there, read as bytes): request ``i``'s mask is ``N × (L_i + N)``
        elements, so ``mask_indptr = N · kv_indptr``. Ragged: the offsets of the padded
        lengths (:func:`.host_ops.ragged_verify_writer`)."""
        buf, n, masked = self.buffers, self.cfg.num_draft_tokens, form is not None
        mode = "target_verify" if masked else "draft_extend"
        kv_host = mirrors["kv_indptr_host"][: B + 1]
        mask = buf[f"{mode}.{form}custom_mask"] if masked else None
        mask_host = mirrors[f"{form}mask_indptr_host"][: B + 1] if masked else None
        if T is not None:
            return ragged_prefill(self, form, B, T, count, mirrors, kv_host, mask, mask_host,
                                  compiled)  # fmt: skip
        result = FlashInferPrefill(
            qo_indptr=self._layouts[mode].cu_seqlens_q(B),
            kv_indptr=buf[f"{mode}.kv_indptr"][: B + 1],
            kv_indices=buf[f"{mode}.kv_indices"],
            kv_last_page_len=buf[f"{mode}.kv_last_page_len"][:B],
            custom_mask=mask if form == "" else None,
            packed_custom_mask=mask if form else None,
            mask_indptr=buf[f"{mode}.{form}mask_indptr"][: B + 1] if masked else None,
            causal=not masked,
            qo_indptr_host=buf[f"{mode}.qo_indptr_host"][: B + 1],
            kv_indptr_host=kv_host,
            kv_last_page_len_host=buf[f"{mode}.kv_last_page_len_host"][:B],
            mask_indptr_host=mask_host,
            max_q_len=n,
        )
        write = host_ops.prefix_writer(self._length_rules[mode], B, kv_host, mask_host,
                                       n if masked else 0, use_compiled=compiled)  # fmt: skip
        return result, write


def _slots(count: int) -> list:
    """A key's results, one slot per ring set (``None`` until made)."""
    return [None] * count
