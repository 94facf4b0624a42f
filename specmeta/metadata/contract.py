"""The contract every metadata builder follows (design §3).

A builder is created once per (config, device) and serves the **modes** named at construction,
allocating only their share of the capacity plan (design §5). Every mode method takes the same inputs
and keywords:

=================  ===========================================================================
argument           meaning
=================  ===========================================================================
req_pool_indices   ``[B]`` int32/int64 on the builder's device (``B ≤ max_bs``)
req_to_token       ``[R, W_row]`` int32/int64, ``W_row ≥ cfg.row_width_need``
seq_lens           ``[B]`` int32/int64, the committed prefix lengths
seq_lens_cpu=      optional ``[B]`` host copy: exact host scalars, mirrors, capacity checks
num_rows=          draft decode only: forwards to build, ``0 ≤ rows ≤ S``, default ``S − 1``
status=            ``int32 [1]``; default: the builder's own word, :attr:`status`
launch=            ``False``: launch nothing, refresh only what the host computes (mirrors,
                   host scalars) and return the views; the kernels run inside a captured graph
=================  ===========================================================================

and returns a frozen dataclass of views into the builder's buffers; a draft-decode result has
``steps`` (one entry per forward) and is also the sequence of its steps. Every host-visible
input is checked before the first launch (:mod:`specmeta.metadata.inputs`).

What a backend can do is data, :class:`~.capabilities.Capabilities` (with its plan groups, in
the torch-free :mod:`.capabilities` that ``specmeta plan`` reads too), checked when the builder
is constructed: a mode it cannot serve for the config (a tree verify on a causal-only kernel) is
refused there, not at the first call.

Every mode is also a **bound stage** (design §3): ``builder.bind_<mode>(...)`` (or
``builder.bind(mode, ...)``) checks the tensors once and binds the mode's launches to them; the
:class:`~specmeta.stage.Stage` then writes its host side from ``seq_lens_cpu`` with
``stage.host(seq_lens_cpu)``, which returns the result, and launches with ``stage.launch()`` (or
the replay of a graph that captured it), in that order: the launches check, on the device, the
lengths the host part read (``Status.STALE_HOST_LENGTHS``). A mode method is ``bind_<mode>(...)``
called at once: it checks and binds on every call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from .. import validate
from ..config import SpecConfig, check_fits, plan_buffers, plan_sizes
from ..kernels._common import check_verify_lens
from ..kernels.host_lengths import (
    bind_check_host_lengths,
    check_host_lengths_ref,
    publish_host_lengths,
)
from ..kernels.verify_lens import bind_pad_verify_lens_to_bucket, pad_verify_lens_to_bucket_ref
from ..launch import check_device
from ..stage import Stage
from . import capabilities as _capabilities
from . import host_ops as host_ops_module
from .capabilities import MODES, Capabilities
from .inputs import check_build_tensors, check_num_rows, check_verify_lens_cpu, host_lengths

_MODE_INDEX = {mode: i for i, mode in enumerate(MODES)}  # a mode's row of host_lengths

__all__ = ["Capabilities", "MetadataBuilder", "DraftSteps"]


def _int64s(row: torch.Tensor) -> memoryview:
    """A host slot's fields as a flat int64 memoryview of its tensor's memory (it keeps the
    tensor's numpy view, and so the tensor, alive): reading and writing a field is a plain
    index, about a third of a numpy element access, and the host part publishes into one on
    every call."""
    return memoryview(row.numpy()).cast("B").cast("q")


class DraftSteps:
    """A draft-decode result is the sequence of its ``steps``: ``len``, index and iterate."""

    steps: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> Any:
        return self.steps[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.steps)


class MetadataBuilder:
    """The base of every builder: construction, mode selection, host checks, status word.

    Parameters
    ----------
    cfg : SpecConfig
        Fixes every buffer's shape.
    device : torch.device or str
        Where the buffers live; every input of a build must be there too.
    modes : iterable of str, optional
        The modes this builder serves; only their buffers are allocated. Default: every mode of
        :attr:`capabilities` that the config allows.
    reference : bool
        Build with the pure-torch references instead of the kernels (a test and benchmark
        baseline; it syncs).
    host_ops : bool
        Do the per-call work on ``seq_lens_cpu`` (the checks, ``max L``, ``ΣL``, FlashInfer's
        host mirrors) with the compiled calls of :mod:`.host_ops` where
        :func:`specmeta.warmup` built them (default), else with torch ops. Both check every
        value and give the same integers.
    check_host_lengths : bool
        Check on the device, in every stage, that ``seq_lens_cpu`` agrees with ``seq_lens``
        (``Status.STALE_HOST_LENGTHS``; default). ``False`` leaves that launch out of every
        stage, and its device time (a round trip to host memory, about 5 µs on an H200): for an
        engine that proves its copy otherwise.

    Attributes
    ----------
    cfg, device
        As given.
    modes : tuple of str
        The modes served, in :attr:`capabilities` order.
    buffers : dict of str to torch.Tensor
        The planned buffers of those modes, keyed ``"<mode>.<field>"`` (the plan's key without
        the backend prefix).
    status : torch.Tensor
        ``int32 [1]``: the word every call reports into unless given another (read it with
        :func:`specmeta.check_status`, which syncs).
    host_lengths, host_lengths_seen : torch.Tensor
        ``int64 [modes, 5]`` in host memory (pinned for CUDA) and ``int64 [modes]`` on the
        device: per mode, what the last host part read of ``seq_lens_cpu`` and what the mode's
        check last read of it (:mod:`specmeta.kernels.host_lengths`).
    """

    #: The plan's key prefix of this backend, e.g. ``"fa3."``.
    plan_prefix: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: The plan group (``"<prefix><group>.<field>"``) of each mode whose group differs from it:
    #: the backend's :data:`.capabilities.PLAN_GROUPS`, which :meth:`plan_keys` reads.
    plan_groups: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        cfg: SpecConfig,
        device: torch.device | str,
        *,
        modes: Iterable[str] | None = None,
        reference: bool = False,
        host_ops: bool = True,
        check_host_lengths: bool = True,
    ):
        if not isinstance(cfg, SpecConfig):
            raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
        name = type(self).__name__
        self.cfg = cfg
        self.device = validate.canonical_device(device)
        self.reference = bool(reference)
        if not self.reference:
            check_device(name, self.device)
        self.modes = self.check_modes(cfg, modes)
        self._where = {m: f"{name}.{m}" for m in self.modes}  # message prefixes
        plan = plan_buffers(cfg)
        own = ("status", "host_lengths_host", "host_lengths_seen",
               *self.plan_keys(cfg, self.modes))  # fmt: skip
        check_fits({k: plan[k] for k in own}, self.device, name)
        self.status = plan["status"].allocate(self.device)
        # Each mode's slot of the seq_lens_cpu its host part read, published in host memory
        # (pinned for a CUDA device, read there by the mode's check launch) and the device word
        # of what the check last read (kernels.host_lengths).
        slots = plan["host_lengths_host"].allocate("cpu")
        self.host_lengths = slots.pin_memory() if self.device.type == "cuda" else slots
        self.host_lengths_seen = plan["host_lengths_seen"].allocate(self.device)
        rows = {mode: _MODE_INDEX[mode] for mode in self.modes}
        self._host_slots = {m: self.host_lengths[i] for m, i in rows.items()}
        self._host_seen = {m: self.host_lengths_seen[i : i + 1] for m, i in rows.items()}
        self._host_published = {m: _int64s(self.host_lengths[i]) for m, i in rows.items()}
        # The last slot: a ragged target verify's verify_lens_cpu (design §2.9).
        self._verify_slot, self._verify_seen = self.host_lengths[-1], self.host_lengths_seen[-1:]
        self._verify_published = _int64s(self.host_lengths[-1])
        self._views: dict = {}  # (mode, B, ...) -> the views of the builder's own buffers
        self.host_ops = bool(host_ops)
        self.check_host_lengths = bool(check_host_lengths)

    @property
    def _stats(self):
        """``stats`` (``max L`` and ``ΣL`` in one call): the compiled one where
        :func:`specmeta.warmup` built the host ops and this builder uses them, else numpy's."""
        return host_ops_module.stats_for(self.host_ops)

    # -- what the builder allocates -----------------------------------------------------------
    @classmethod
    def check_modes(cls, cfg: SpecConfig, modes: Iterable[str] | None) -> tuple[str, ...]:
        """The modes a builder for ``cfg`` serves: ``modes`` checked against the capabilities,
        or every mode the config allows."""
        caps, name = cls.capabilities, cls.__name__
        if modes is None:
            return caps.served(cfg)
        if isinstance(modes, str):
            modes = (modes,)
        chosen = tuple(modes)
        for mode in chosen:
            if mode not in caps.modes:
                raise ValueError(
                    f"{name}: unknown mode {mode!r}; the modes are {', '.join(caps.modes)}"
                )
            why = caps.why_not(mode, cfg)
            if why is not None:
                raise ValueError(
                    f"{name}: {why}; drop {mode!r} from modes, or use a backend whose "
                    "capabilities have it (specmeta.metadata.capabilities.CAPABILITIES)"
                )
        if not chosen:
            raise ValueError(f"{name}: modes is empty; name at least one of {caps.modes}")
        return tuple(m for m in caps.modes if m in chosen)

    @classmethod
    def plan_keys(cls, cfg: SpecConfig, modes: Iterable[str] | None = None) -> list[str]:
        """The keys of ``plan_buffers(cfg)`` that a builder for ``modes`` allocates (its own
        host mirrors included): what ``specmeta plan`` totals for a backend."""
        keys = _capabilities.plan_keys(cls.plan_prefix[:-1], plan_sizes(cfg),
                                       cls.check_modes(cfg, modes))  # fmt: skip
        return [key for key in keys if cls.allocates(key[len(cls.plan_prefix) :])]

    @classmethod
    def allocates(cls, name: str) -> bool:
        """Whether the builder allocates the buffer ``<mode>.<field>`` of a mode it serves
        (all of them unless a subclass narrows it)."""
        del name
        return True

    def allocate_planned(self, fill: int = 0) -> dict[str, torch.Tensor]:
        """The served modes' planned buffers on the builder's device, filled with ``fill`` and
        keyed ``"<mode>.<field>"`` (for builders with no host mirrors)."""
        plan = plan_buffers(self.cfg)
        return {
            key[len(self.plan_prefix) :]: plan[key].allocate(self.device, fill=fill)
            for key in self.plan_keys(self.cfg, self.modes)
        }

    # -- per call -----------------------------------------------------------------------------
    def require(self, mode: str) -> str:
        """``"<Builder>.<mode>"``, after checking that the builder serves ``mode``."""
        where = self._where.get(mode)
        if where is None:
            where = f"{type(self).__name__}.{mode}"
            raise ValueError(
                f"{where}: this builder was constructed with modes={list(self.modes)}; "
                f"construct it with {mode!r} among its modes"
            )
        return where

    def check(
        self,
        mode: str,
        req_pool_indices: Any,
        req_to_token: Any,
        seq_lens: Any,
        *,
        tree_mask: Any = None,
        out_cache_loc: Any = None,
        status: Any = None,
        entry_page_size: Any = 1,
    ) -> int:
        """Every host check of one bind's tensors, before anything is bound
        (:func:`.inputs.check_build_tensors`); returns ``B``."""
        return check_build_tensors(self.require(mode), self.cfg, self.device, req_pool_indices,
                                   req_to_token, seq_lens, tree_mask=tree_mask,
                                   out_cache_loc=out_cache_loc, status=status,
                                   entry_page_size=entry_page_size)  # fmt: skip

    def lengths(self, mode: str, B: int, seq_lens_cpu: Any,
                found: tuple[int, int] | None = None) -> tuple[int, int] | None:  # fmt: skip
        """The checks of a call's ``seq_lens_cpu`` (``[B]`` integer CPU tensor, every value in
        ``[0, max_context_len]``), made on every call of a stage's host part, and its
        ``(max L, ΣL)``; ``None`` when it is ``None`` (:func:`.inputs.host_lengths`). What it
        read is sent to the device for the mode's check (:meth:`host_check`). ``found``: the
        ``(max L, ΣL)`` a compiled host op returned after making these checks itself."""
        if seq_lens_cpu is None:
            return None
        if found is None:
            found = host_lengths(self._where[mode], self.cfg, B, seq_lens_cpu,
                                 stats=self._stats)  # fmt: skip
        if found is not None and self.check_host_lengths:
            publish_host_lengths(self._host_published[mode], B, found[1], found[0])
        return found

    def host_check(self, mode: str, seq_lens: torch.Tensor, status: torch.Tensor) -> Any:
        """The launch that checks, on the device, what ``mode``'s host part last read of
        ``seq_lens_cpu`` against ``seq_lens`` (``Status.STALE_HOST_LENGTHS``): every mode's
        stage holds it (:mod:`specmeta.kernels.host_lengths`); ``None`` for a builder made with
        ``check_host_lengths=False``."""
        if not self.check_host_lengths:
            return None
        return self._launch(bind_check_host_lengths, check_host_lengths_ref, seq_lens,
                            self._host_slots[mode], self._host_seen[mode],
                            status=status)  # fmt: skip

    def bind_bucket(self, mode: str, B: int, verify_lens: Any, num_tokens: Any,
                    status: torch.Tensor | None, *, cap: int | None = None) -> tuple:  # fmt: skip
        """A ragged target verify's arguments (design §2.9), checked on the host: without
        ``verify_lens`` (and ``num_tokens``) ``(None, None, None, None)``; with them, the
        launch padding ``verify_lens`` (``[B' ≤ B]``) to the bucket of the batch's ``B``
        requests and ``num_tokens`` into the builder's ``target_verify.verify_lens`` and
        ``ragged_qo_indptr``, those padded lengths, ``T``, and the host part's check of
        ``verify_lens_cpu`` (:meth:`verify_lengths`). ``cap``: each padded length clamped to
        it (a dense query layout, :func:`~specmeta.kernels.verify_lens.pad_verify_lens_to_bucket`)."""
        where, n = self.require(mode), self.cfg.num_draft_tokens
        if verify_lens is None:
            if num_tokens is not None:
                raise ValueError(
                    f"{where}: num_tokens={num_tokens!r} was given without verify_lens; pass "
                    "verify_lens= too for a ragged verify, or drop num_tokens"
                )
            return None, None, None, None
        check_verify_lens(where, verify_lens, getattr(verify_lens, "shape", (0,))[0],
                          self.device)  # fmt: skip
        count = verify_lens.shape[0]
        if count > B:
            raise ValueError(
                f"{where}: verify_lens has {count} entries, more than the batch's B = {B} "
                "requests; pass the real requests' lengths (at most B)"
            )
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(
                f"{where}: num_tokens must be a host int, got {type(num_tokens).__name__}; "
                "pass the token count T of the captured bucket with verify_lens"
            )
        if not 0 <= num_tokens <= B * n:
            raise ValueError(
                f"{where}: num_tokens = {num_tokens}, outside [0, B·N = {B * n}] for B = {B} "
                f"requests of N = {n} nodes; a bucket of B requests holds at most B·N tokens"
            )
        padded = self.buffers["target_verify.verify_lens"][:B]
        launch = self._launch(
            bind_pad_verify_lens_to_bucket, pad_verify_lens_to_bucket_ref, verify_lens,
            num_tokens, B, out=padded,
            qo_indptr=self.buffers["target_verify.ragged_qo_indptr"][: B + 1],
            status=self.status_word(status), num_draft_tokens=n, cap=cap,
        )  # fmt: skip
        verify = functools.partial(self.verify_lengths, mode, count, num_tokens)
        return launch, padded, num_tokens, verify

    def verify_lengths(self, mode: str, count: int, num_tokens: int, verify_lens_cpu: Any,
                       found: tuple[int, int] | None = None) -> None:  # fmt: skip
        """The checks of a ragged call's ``verify_lens_cpu`` (:func:`.inputs.check_verify_lens_cpu`),
        made on every call of the stage's host part; what it read is sent to the device for
        :meth:`verify_check`. ``found``: the ``(max v, Σv)`` a compiled host op returned after
        making these checks itself."""
        n = self.cfg.num_draft_tokens
        if found is None and verify_lens_cpu is not None and (stats := self._stats) is not None:
            # Every value in [0, N], max and sum, in one compiled call; what it refuses is
            # named by the checks below.
            with contextlib.suppress(TypeError, ValueError, IndexError):
                found = stats(n, count, verify_lens_cpu)
        if found is None or found[1] > num_tokens:
            found = check_verify_lens_cpu(self._where[mode], verify_lens_cpu, count, num_tokens,
                                          n)  # fmt: skip
        if self.check_host_lengths:
            publish_host_lengths(self._verify_published, count, found[1], found[0])

    def verify_host(self, mode: str, verify: Any, verify_lens_cpu: Any) -> None:
        """A stage's host part given ``verify_lens_cpu`` (optional where the backend reads its
        query offsets on the device): checked by ``verify``, the check :meth:`bind_bucket`
        returned, or refused for a stage bound without ``verify_lens`` (``verify`` None)."""
        if verify_lens_cpu is None:
            return
        if verify is None:
            raise ValueError(
                f"{self.require(mode)}: verify_lens_cpu was given, but this stage was bound "
                "without verify_lens (a uniform layout); bind it with verify_lens= and "
                "num_tokens= for a ragged verify, or drop verify_lens_cpu"
            )
        verify(verify_lens_cpu)

    def verify_check(self, verify_lens: torch.Tensor, status: torch.Tensor) -> Any:
        """The launch that checks what the host part last read of ``verify_lens_cpu`` against
        ``verify_lens`` (``Status.STALE_HOST_LENGTHS``, the check of :meth:`host_check`);
        ``None`` for a builder made with ``check_host_lengths=False``."""
        if not self.check_host_lengths:
            return None
        return self._launch(bind_check_host_lengths, check_host_lengths_ref, verify_lens,
                            self._verify_slot, self._verify_seen, status=status)  # fmt: skip

    def _launch(self, bind: Callable[..., Stage], ref: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Stage | functools.partial:  # fmt: skip
        """One launch of a mode's stage, bound once: the kernel's bound stage (``bind_<op>``),
        or its torch reference on the same arguments for a reference builder."""
        if self.reference:
            return functools.partial(ref, *args, **kwargs)
        return bind(*args, **kwargs)

    def bind(self, mode: str, *args: Any, **kwargs: Any) -> Stage:
        """``bind_<mode>(*args, **kwargs)``: the mode bound once to the tensors given."""
        self.require(mode)
        return getattr(self, f"bind_{mode}")(*args, **kwargs)

    def draft_rows(self, mode: str, num_rows: int | None) -> int:
        """``num_rows`` of a draft-decode mode; default ``S − 1``, the draft forwards."""
        s = self.cfg.num_steps
        if num_rows is None and mode in self._where:
            return s - 1
        return check_num_rows(self.require(mode), num_rows, s, default=s - 1)

    def views(self, key: tuple, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)``, made once per ``key``: what a mode's stages for one batch size (and
        rows) read of the builder's own buffers (the output views its launches write, its
        result objects). Slicing a tensor costs a microsecond or more on a host; a builder's
        buffers never move, so the views of one ``key`` are made once. Bounded by the keys a
        config has (``B ≤ max_bs``, rows ≤ S)."""
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = make(*args)
        return found

    def status_word(self, status: torch.Tensor | None) -> torch.Tensor:
        """The word a call reports into: ``status``, or the builder's own."""
        return self.status if status is None else status
