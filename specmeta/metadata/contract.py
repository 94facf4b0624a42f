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

What a backend can do is data, :class:`Capabilities`, checked when the builder is constructed:
a mode it cannot serve for the config (a tree verify on a causal-only kernel) is refused there,
not at the first call.

A call with ``seq_lens_cpu`` splits into what its device tensors decide (checked once per
signature, the launches) and what the host values decide: their checks, the host scalars, the
host mirrors and so the result object. Under :func:`describing` every call records that second
part as a :class:`HostStep`, which a graph runner runs again on the next batch's values instead
of calling the whole build (design §4).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from .. import validate
from ..config import SpecConfig, plan_buffers
from ..launch import LaunchPlans, recording
from . import host_ops as host_ops_module
from .host_ops import LengthTable
from .inputs import (
    BuildInputs,
    check_build_tensors,
    check_length_values,
    check_num_rows,
    host_lengths,
)  # fmt: skip

__all__ = ["Capabilities", "MetadataBuilder", "DraftSteps", "HostStep", "describing"]


class HostStep:
    """What one build call's result took from ``seq_lens_cpu``, as a function of new values.

    Attributes
    ----------
    run : callable
        ``run(seq_lens_cpu) -> result``: the call's per-call host work on new values of the
        same batch size (every check of the values, the host scalars, the host mirrors) and
        its result, as the whole call with the same device tensors would return it.
    source : torch.Tensor or None
        The ``seq_lens_cpu`` the call was given (``None``: none; ``run(None)`` then returns
        the same result as the call).
    result : object
        What the call returned.
    """

    __slots__ = ("run", "source", "result")

    def __init__(self, run: Callable[[Any], Any], source: torch.Tensor | None,
                 result: Any) -> None:  # fmt: skip
        self.run, self.source, self.result = run, source, result


class _Describing(threading.local):
    steps: list[HostStep] | None = None


_describing = _Describing()


@contextlib.contextmanager
def describing():
    """Collect the :class:`HostStep` of every builder call in the block, on this thread, in
    call order."""
    outer, _describing.steps = _describing.steps, []
    try:
        yield _describing.steps
    finally:
        _describing.steps = outer


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend's builder serves.

    Attributes
    ----------
    modes : tuple of str
        Every mode method of the builder.
    tree_draft : bool
        ``draft_decode`` with ``topk > 1``.
    tree_verify : bool
        ``target_verify`` with ``topk > 1`` (a tree mask or a cascade over ancestors).
    page_sizes : str
        The page sizes the metadata is built for (``"any"``: every positive size).
    graph_safe : frozenset of str
        Modes whose build may be captured in a CUDA graph (the host mirrors, if any, are
        refreshed outside it with ``launch=False``).
    """

    modes: tuple[str, ...]
    tree_draft: bool
    tree_verify: bool
    page_sizes: str
    graph_safe: frozenset[str]

    def serves(self, mode: str, cfg: SpecConfig) -> bool:
        """Whether ``mode`` can be built for ``cfg``."""
        if mode not in self.modes:
            return False
        if cfg.topk > 1 and mode == "target_verify":
            return self.tree_verify
        if cfg.topk > 1 and mode.startswith("draft_decode"):
            return self.tree_draft
        return True


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
        host mirrors) with the compiled calls of :mod:`.host_ops` (default, where they can be
        built), else with torch ops. Both check every value and give the same integers.

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
    length_tables : dict of str to LengthTable
        The modes whose ``seq_lens_cpu`` values are checked by their host-mirror writer
        (:mod:`.host_ops`; the table is the torch writer's check), which writes the mirrors in
        the same pass; empty unless a subclass fills it. The other modes check the values by
        reduction and read ``max L``.
    """

    #: The plan's key prefix of this backend, e.g. ``"fa3."``.
    plan_prefix: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: The plan group (``"<prefix><group>.<field>"``) of each mode whose group differs from it.
    plan_groups: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        cfg: SpecConfig,
        device: torch.device | str,
        *,
        modes: Iterable[str] | None = None,
        reference: bool = False,
        host_ops: bool = True,
    ):
        if not isinstance(cfg, SpecConfig):
            raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = validate.canonical_device(device)
        self.reference = bool(reference)
        self.modes = self.check_modes(cfg, modes)
        self._where = {m: f"{type(self).__name__}.{m}" for m in self.modes}  # message prefixes
        self.status = plan_buffers(cfg)["status"].allocate(self.device)
        self._results: dict = {}
        self._checked: set = set()  # input keys (self._sign) whose tensor checks passed
        self._sign = validate.Signer()
        self._launch_plans = LaunchPlans()
        self.length_tables: dict[str, LengthTable] = {}
        self.host_ops = bool(host_ops)
        op = host_ops_module.compiled() if self.host_ops else None
        self._stats = op.stats if op is not None else None  # max L and ΣL in one call

    # -- what the builder allocates -----------------------------------------------------------
    @classmethod
    def check_modes(cls, cfg: SpecConfig, modes: Iterable[str] | None) -> tuple[str, ...]:
        """The modes a builder for ``cfg`` serves: ``modes`` checked against the capabilities,
        or every mode the config allows."""
        caps, name = cls.capabilities, cls.__name__
        if modes is None:
            return tuple(m for m in caps.modes if caps.serves(m, cfg))
        if isinstance(modes, str):
            modes = (modes,)
        chosen = tuple(modes)
        for mode in chosen:
            if mode not in caps.modes:
                raise ValueError(
                    f"{name}: unknown mode {mode!r}; the modes are {', '.join(caps.modes)}"
                )
            if not caps.serves(mode, cfg):
                raise ValueError(
                    f"{name}: {mode} with topk={cfg.topk} needs a tree, which this backend "
                    f"cannot build; drop {mode!r} from modes, or use a backend whose "
                    "capabilities have it (FA3MetadataBuilder, FlashInferBuilder)"
                )
        if not chosen:
            raise ValueError(f"{name}: modes is empty; name at least one of {caps.modes}")
        return tuple(m for m in caps.modes if m in chosen)

    @classmethod
    def plan_keys(cls, cfg: SpecConfig, modes: Iterable[str] | None = None) -> list[str]:
        """The keys of ``plan_buffers(cfg)`` that a builder for ``modes`` allocates (its own
        host mirrors included): what ``specmeta plan`` totals for a backend."""
        groups = {cls.plan_groups.get(m, m) for m in cls.check_modes(cfg, modes)}
        keys = []
        for key in plan_buffers(cfg):
            if key.startswith(cls.plan_prefix):
                group = key[len(cls.plan_prefix) :].split(".", 1)[0]
                if group in groups and cls.allocates(key[len(cls.plan_prefix) :]):
                    keys.append(key)
        return keys

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
        seq_lens_cpu: Any = None,
        tree_mask: Any = None,
        out_cache_loc: Any = None,
        status: Any = None,
    ) -> BuildInputs:
        """Every host check of one build, before its first launch (:mod:`.inputs`).

        The tensor checks read only what :func:`specmeta.validate.signature` holds, so they run
        once per signature (per mode); the checks of ``seq_lens_cpu``'s values run on every
        call. The signature is the result's ``key``."""
        where = self.require(mode)
        tensors = (req_pool_indices, req_to_token, seq_lens, tree_mask, out_cache_loc, status)
        try:
            key = self._sign(mode, *tensors)
            seen = key in self._checked
        except TypeError:  # an unhashable argument: the checks below name it
            key, seen = None, False
        if not seen:
            check_build_tensors(where, self.cfg, self.device, req_pool_indices, req_to_token,
                                seq_lens, tree_mask=tree_mask, out_cache_loc=out_cache_loc,
                                status=status)  # fmt: skip
            if key is not None:
                if len(self._checked) >= 4096:
                    self._checked.clear()
                self._checked.add(key)
        inputs = self.host_inputs(mode, req_pool_indices.shape[0], seq_lens_cpu)
        inputs.key = key
        return inputs

    def host_inputs(self, mode: str, B: int, seq_lens_cpu: Any) -> BuildInputs:
        """The checks of a call's host values, made on every call
        (:func:`.inputs.host_lengths`), and their :class:`BuildInputs` for ``B`` requests."""
        inputs = host_lengths(self.require(mode), self.cfg, B, seq_lens_cpu,
                              values_later=mode in self.length_tables,
                              stats=self._stats)  # fmt: skip
        inputs.given = seq_lens_cpu
        return inputs

    def described(self, mode: str, inputs: BuildInputs, describe: Callable[[BuildInputs], Any],
                  direct: Callable[[int], Any] | None = None, *,
                  step: Callable[[], Callable[[Any], Any]] | None = None):  # fmt: skip
        """A call's result, ``describe(inputs)``: everything it takes from the host values
        (host scalars, host mirrors), after the checks of :meth:`check`.

        Under :func:`describing`, the call also records a :class:`HostStep` whose
        ``run(values)`` is :meth:`host_inputs` then ``describe``: the same checks and result
        as the call would make on new values of ``B`` requests (``None`` for a call given no
        ``seq_lens_cpu``), with the same device tensors, whose checks and launches do not read
        the host values.

        Where the compiled host ops are in use, the step takes fewer calls: ``direct(max_l)``
        gives the result of the maximum that the compiled reduction read (every value
        checked); for a mode whose mirror writer checks the tensor and every value
        (:attr:`length_tables`), ``step()`` makes the whole ``run`` of a call given
        ``seq_lens_cpu``, which names what its writer refuses. A refusal of the reduction
        takes :meth:`host_inputs` and ``describe``, for the message."""
        result = describe(inputs)
        steps = _describing.steps
        if steps is not None:
            run = self._step(mode, inputs.batch, describe, direct,
                             step if inputs.given is not None else None)  # fmt: skip
            steps.append(HostStep(run, inputs.given, result))
        return result

    def _step(self, mode: str, B: int, describe: Callable[[BuildInputs], Any],
              direct: Callable[[int], Any] | None, step: Callable[[], Any] | None):  # fmt: skip
        """A :class:`HostStep`'s ``run``: :meth:`host_inputs` then ``describe``. The tensor
        checks were passed once by a tensor of the same host input, so with the compiled
        calls, the one that reads the values (``stats`` here, the mode's writer in
        :meth:`write_mirrors` or ``step()``'s) checks the tensor too, and a refusal takes
        :meth:`host_inputs` for the message that names it."""
        stats, top, later = self._stats, self.cfg.max_context_len, mode in self.length_tables
        if stats is not None and later and step is not None:
            return step()
        if stats is not None and direct is not None and not later:

            def run_reduced(seq_lens_cpu):
                try:
                    high = stats(top, B, seq_lens_cpu)[0]
                except (TypeError, ValueError, IndexError):  # named by the checks below
                    return describe(self.host_inputs(mode, B, seq_lens_cpu))
                return direct(high)

            return run_reduced

        def run(seq_lens_cpu):
            if seq_lens_cpu is None or stats is None:
                return describe(self.host_inputs(mode, B, seq_lens_cpu))
            if later:  # the writer checks the tensor and every value
                inputs = BuildInputs(B, seq_lens_cpu)
            else:
                try:
                    high, total = stats(top, B, seq_lens_cpu)
                except (TypeError, ValueError, IndexError):
                    return describe(self.host_inputs(mode, B, seq_lens_cpu))  # raises
                inputs = BuildInputs(B, seq_lens_cpu, high, total=total)
            return describe(inputs)

        return run

    def write_mirrors(self, mode: str, inputs: BuildInputs, write: Callable[..., Any]) -> None:
        """Run a mode's host-mirror writer (:mod:`.host_ops`) on ``seq_lens_cpu``, before any
        launch: it checks every length, then writes the mirrors and returns ``ΣL``. A refused
        length raises the message :func:`.inputs.check_length_values` gives it."""
        try:
            total = write(inputs.seq_lens_cpu)
        except (TypeError, ValueError):  # the tensor itself, which a host step leaves to it
            self.host_inputs(mode, inputs.batch, inputs.seq_lens_cpu)  # raises, naming it
            raise
        except IndexError:
            where = self._where[mode]
            check_length_values(where, self.cfg, inputs.seq_lens_cpu)  # names the length
            raise RuntimeError(
                f"{where}: the host-mirror writer refused seq_lens_cpu, whose lengths are all "
                f"in [0, max_context_len={self.cfg.max_context_len}]"
            ) from None
        if total is not None:
            inputs.summed(total)

    def launch_plan(self, inputs: BuildInputs, parts: tuple, run: Callable[[], Any]) -> None:
        """``run()`` makes a mode's launches, or the launches it made before for the same
        checked inputs and ``parts`` are made again (:class:`specmeta.launch.LaunchPlans`).

        Only for a ``run`` whose every device write is a kernel launch (no torch op), with
        launch arguments that follow from ``inputs.key`` (the tensors and the status word
        passed), ``parts`` (the host integers it passes, e.g. the rows) and the builder's own
        buffers; never from host values such as ``seq_lens_cpu``. A host total that ``run``
        passes only for a launcher's capacity check (``seq_lens_sum``) may be skipped on a
        replay: the builder's buffers are planned for ``max_bs`` requests of
        ``max_context_len`` tokens, which :func:`.inputs.host_lengths` checks on every call."""
        key = LaunchPlans.key(inputs.key, *parts) if inputs.key is not None else None
        if self._launch_plans.replay(key):
            return
        with recording() as launches:
            run()
        self._launch_plans.store(key, *launches)

    def draft_rows(self, mode: str, num_rows: int | None) -> int:
        """``num_rows`` of a draft-decode mode; default ``S − 1``, the draft forwards."""
        s = self.cfg.num_steps
        if num_rows is None and mode in self._where:
            return s - 1
        return check_num_rows(self.require(mode), num_rows, s, default=s - 1)

    def result(self, key: tuple, make: Callable[..., Any], *args: Any) -> Any:
        """The result object of a call, ``make(*args)`` made once per ``key``: a result is a
        frozen view of the builder's own buffers, so two calls with the same batch size, rows
        and host scalars return equal objects, and the second costs a dictionary lookup. A
        builder with host mirrors keeps, with the result, the views its mirrors are written
        into (``make`` returns both)."""
        found = self._results.get(key)
        if found is None:
            if len(self._results) >= 4096:  # bounded: a key holds B and host maxima
                self._results.clear()
            found = self._results[key] = make(*args)
        return found

    def status_word(self, status: torch.Tensor | None) -> torch.Tensor:
        """The word a call reports into: ``status``, or the builder's own."""
        return self.status if status is None else status
