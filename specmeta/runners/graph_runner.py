"""A CUDA-graph runner whose every static input declares its pad value (design §4).

The runner owns a set of persistent input buffers (from :func:`specmeta.plan_buffers`), each
registered **with its pad value** — there is no way to register one without — and a build
function that turns the padded inputs into metadata with specmeta's sync-free kernels. It
captures one CUDA graph per bucket ``Bp`` (all sharing one memory pool) and, for a batch of
``B`` requests:

1. picks the smallest captured ``Bp ≥ B`` (``B = 0``, an idle data-parallel rank, takes the
   smallest bucket);
2. checks on the host, from shapes and dtypes only, that every raw input matches the layout the
   graphs were captured with;
3. runs the input probes when :mod:`specmeta.probes` are enabled;
4. pads the CPU mirrors (``[:B]`` copied, ``[B:Bp]`` = pad) and calls the host function on
   them, so derived host scalars (``seq_lens_sum``) are those of the padded batch and capacity
   is checked before anything is launched;
5. writes every static buffer with one copy-pad launch (up to four buffers a launch): raw input
   into ``[:B]``, pad value into ``[B:Bp]`` — **every** buffer, every call;
6. replays the graph of ``Bp`` (or, without graphs, calls the build function on the same padded
   buffers — the CPU/CI path is this one, step for step);
7. returns every output sliced to ``[:B]``, as views into the runner's buffers (overwritten by
   the next call) or as copies: the caller chooses, ``copy=`` has no default.

Examples
--------
>>> plan = specmeta.plan_buffers(cfg)
>>> bufs = {n: s.allocate(device) for n, s in plan.items()}
>>> def build(inp):                      # inp: static views [:Bp·per_request]
...     assign_draft_cache_locs(inp["req_pool_indices"], req_to_token, inp["seq_lens"],
...                             topk=K, num_steps=S, out_cache_loc=bufs["draft.out_cache_loc"])
...     return {"out_cache_loc": bufs["draft.out_cache_loc"]}
>>> runner = GraphRunner(build, batch_sizes=[1, 8, 32], device=device)
>>> runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
>>> runner.add_input("seq_lens", bufs["runner.seq_lens"], pad=padding.seq_lens_fill(K))
>>> runner.add_output("out_cache_loc", per_request=K * S)
>>> runner.capture()
>>> res = runner.run(3, {"req_pool_indices": rpi, "seq_lens": sl}, copy=True)
>>> res.outputs["out_cache_loc"].shape, res.padded_batch_size
(torch.Size([3·K·S]), 8)
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import operator
import types
from collections.abc import Callable, Mapping, Sequence

import torch

from .. import probes, validate
from ..launch import LaunchPlans, recording
from ..metadata.contract import HostStep, describing
from .padding import check_pad, copy_pad_many

_copy_pad_checked = validate.trusting(copy_pad_many)

__all__ = ["GraphRunner", "StageBatch", "StaticInput", "StaticOutput", "RunResult",
           "collector_off"]

BuildFn = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
HostFn = Callable[[Mapping[str, torch.Tensor]], Mapping[str, object]]
Probe = Callable[..., None]


@contextlib.contextmanager
def collector_off():
    """Python's cyclic garbage collector off in the block, back as it was after.

    :meth:`GraphRunner.capture` captures under it; so should code that captures graphs of its
    own around specmeta's builders: a collection in the middle of a capture may destroy a dead
    object's CUDA graph (an old runner's, in a reference cycle), a call the capture forbids,
    which invalidates the capture.

    >>> with collector_off(), torch.cuda.graph(graph):
    ...     meta = builder.draft_decode(req_pool_indices, req_to_token, seq_lens)
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """A registered static input buffer and its padding policy.

    Attributes
    ----------
    name : str
        Key of the raw input in :meth:`GraphRunner.run` and of the view given to ``build``.
    buffer : torch.Tensor
        ``[≥ max_bucket·per_request, *row]`` contiguous, on the runner's device.
    pad : int | float
        Written into rows ``[B·per_request, Bp·per_request)`` before every replay.
    per_request : int
        Rows of ``buffer`` one request owns (``K·S`` for draft slots, ``N`` for a verify window).
    mirror : torch.Tensor or None
        The padded CPU mirror (same shape and dtype) when the input has one.
    probe : callable or None
        ``probe(raw, label=...)``, run on the raw input when probes are enabled.
    """

    name: str
    buffer: torch.Tensor
    pad: int | float
    per_request: int
    mirror: torch.Tensor | None
    probe: Probe | None

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.buffer.shape[1:])

    def signature(self) -> tuple:
        """What a captured graph depends on: shape, dtype, storage and padding."""
        b = self.buffer
        return (self.name, tuple(b.shape), b.stride(), b.dtype, b.data_ptr(), self.per_request,
                self.pad)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StaticOutput:
    """How an output of ``build`` is cut to the batch: ``narrow(dim, 0, B·per_request + extra)``,
    or returned whole when ``per_request`` is ``None`` (e.g. ``kv_indices``, whose rows are read
    only up to their ``kv_indptr``)."""

    name: str
    per_request: int | None
    extra: int
    dim: int

    def length(self, batch: int) -> int | None:
        return None if self.per_request is None else batch * self.per_request + self.extra


class StageBatch:
    """What a typed build (``GraphRunner(..., typed=True)``) is called with.

    Attributes
    ----------
    inputs : mapping of str to torch.Tensor
        Every registered input's static view: ``[:Bp·per_request]`` when the build launches
        (capture, or every call without graphs), ``[:B·per_request]`` when it only describes.
    host : mapping of str to torch.Tensor
        The CPU values of the inputs registered with ``host_mirror=True``, cut like ``inputs``
        (empty while capturing: nothing is known of a batch then).
    launch : bool
        Pass it on as every builder mode's ``launch=``, and launch free kernels only when it is
        True: the runner calls the build with ``launch=False`` to get the builders' results
        for ``B`` (and their host mirrors) without launching.

    With host inputs, the runner calls a ``launch=False`` build once or twice per ``B``: where
    it returns one builder result, or a tuple, list or dict of them and of static buffers cut
    to ``B``, and hands the builders the host values as given, later calls of ``B`` run only
    the builders' host steps on the new values (design §4). So, as the captured graph already assumes, the builder calls must not
    depend on the host values, and a ``launch=False`` build must have no effect beyond them.
    """

    __slots__ = ("inputs", "host", "launch")

    def __init__(self, inputs: Mapping[str, torch.Tensor], host: Mapping[str, torch.Tensor],
                 launch: bool):  # fmt: skip
        self.inputs = inputs
        self.host = host
        self.launch = launch

    @property
    def batch_size(self) -> int:
        """Requests in this call's views."""
        spec = next(iter(self.inputs.values()))
        return spec.shape[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one :meth:`GraphRunner.run` returns (frozen: a typed runner hands the same object
    to every call of the same ``B`` and result).

    Attributes
    ----------
    batch_size : int
        ``B``, the raw batch.
    padded_batch_size : int
        ``Bp``, the bucket that ran.
    outputs : mapping of str to torch.Tensor
        Each declared output cut to ``B``: views into the runner's (graph's) buffers, **overwritten
        by the next run**, unless ``copied`` (empty, read-only, for a typed runner).
    host : mapping of str to object
        What the host function returned for the padded batch (e.g. ``seq_lens_sum``).
    copied : bool
        Whether ``outputs`` are private copies.
    results : object
        A typed runner's build result for ``B`` (the builders' own result objects, cut to
        ``B`` by the builders); ``None`` for a runner of named outputs.
    """

    batch_size: int
    padded_batch_size: int
    outputs: Mapping[str, torch.Tensor]
    host: Mapping[str, object]
    copied: bool
    results: object = None


_NONE: Mapping = types.MappingProxyType({})  # a typed result's outputs (and host, without one)


_AGAIN = object()  # _HostPlan.make: decide on the next describe of the same B


class _HostPlan:
    """A typed stage's describe of ``B``, made again from its builder calls' host steps
    (:class:`~specmeta.metadata.contract.HostStep`, design §4): ``plan.run(host)`` runs every
    step, in call order, on the values of the host input it read, and returns the results in
    the shape the build returned them.

    The shapes: one builder call's result, or a tuple, list or dict whose every item is one or
    a tensor that two describes of ``B`` returned as the same view (the same address, shape,
    strides and dtype, the first one kept alive meanwhile, so the two view the same memory):
    a static buffer cut to ``B``, which the plan returns as it is.

    Attributes
    ----------
    run : callable
        ``run(host) -> results``.
    names : frozenset of str
        The host inputs the steps read.
    single : tuple or None
        ``(step run, input name)`` of a plan that is one step's result.
    """

    __slots__ = ("run", "names", "single")

    def __init__(self, run: Callable[[Mapping[str, torch.Tensor]], object], names,
                 single: tuple | None = None) -> None:  # fmt: skip
        self.run = run
        self.names = frozenset(names)
        self.single = single

    @staticmethod
    def make(results: object, steps: list[HostStep], host: Mapping[str, torch.Tensor],
             earlier: object = None) -> _HostPlan | object | None:  # fmt: skip
        """The plan of a describe that returned ``results`` after recording ``steps``, each
        of which read a tensor of ``host`` as given (or none); ``None`` for a describe no plan
        makes, ``_AGAIN`` when its tensor items need ``earlier``, the results of the next
        describe of the same ``B``, to compare with (then ``results`` is that ``earlier``)."""
        names = {id(t): n for n, t in host.items()}
        calls = []
        for step in steps:
            name = None if step.source is None else names.get(id(step.source))
            if step.source is not None and name is None:
                return None  # the step read a tensor made from a host input, not the input
            calls.append((step.run, name))
        read = [n for _, n in calls if n is not None]
        index = {id(step.result): i for i, step in enumerate(steps)}
        if len(index) != len(steps):
            return None  # two calls returned one object: which one the build used is unknown
        if len(calls) == 1 and results is steps[0].result:
            run, name = calls[0]
            if name is None:
                return _HostPlan(lambda values: run(None), read)
            return _HostPlan(lambda values: run(values[name]), read, (run, name))
        items, keys = _HostPlan._items(results)
        if items is None:
            return None
        where = [index.get(id(item)) for item in items]
        views = [i for i, w in enumerate(where) if w is None]
        if any(not isinstance(items[i], torch.Tensor) for i in views):
            return None  # the build returned something no builder call made
        if views:
            if earlier is None:
                return _AGAIN
            before, before_keys = _HostPlan._items(earlier)
            if (before is None or type(earlier) is not type(results) or before_keys != keys
                    or len(before) != len(items)):  # fmt: skip
                return None
            for i in views:
                if not isinstance(before[i], torch.Tensor) or (
                    validate.signature(before[i]) != validate.signature(items[i])
                ):
                    return None  # a new tensor, or another view: made from this call's values
        kind = type(results)

        def plan(values: Mapping[str, torch.Tensor]) -> object:
            given = [None if n is None else values[n] for _, n in calls]  # all before any step
            made = [run(v) for (run, _), v in zip(calls, given, strict=True)]
            out = [items[j] if i is None else made[i] for j, i in enumerate(where)]
            return kind(out) if keys is None else dict(zip(keys, out, strict=True))

        return _HostPlan(plan, read)

    @staticmethod
    def _items(results: object) -> tuple[list | None, tuple | None]:
        """The items of a tuple, list or dict result and the dict's keys; ``(None, None)``
        for another type."""
        if type(results) in (tuple, list):
            return list(results), None
        if type(results) is dict:
            return list(results.values()), tuple(results)
        return None, None


def _picker(names: tuple[str, ...]) -> Callable[[Mapping[str, object]], tuple]:
    """``pick(mapping) -> (mapping[name] for name in names)`` as a tuple, in one C call where
    there are two names or more."""
    if len(names) >= 2:
        return operator.itemgetter(*names)
    if len(names) == 1:
        only = names[0]
        return lambda mapping: (mapping[only],)
    return lambda mapping: ()


class GraphRunner:
    """Captures ``build`` once per bucket and replays it on padded static inputs.

    Parameters
    ----------
    build : callable
        ``build(inputs) -> {name: tensor}``. ``inputs`` maps every registered input to its static
        view ``buffer[:Bp·per_request]``; ``build`` must read batch data only from these views and
        write with specmeta's sync-free launchers (it is captured: Python runs it once per bucket).
    batch_sizes : sequence of int
        The buckets ``Bp`` (≥ 1) to capture.
    device : torch.device or str
        Where the static buffers live.
    host : callable, optional
        ``host(mirrors) -> {name: value}``, run on every call, before any device work, on the
        padded CPU mirrors ``[:Bp·per_request]``: derive host scalars of the padded batch and
        raise ``ValueError`` when a planned buffer is too small for it.
    graphs : bool, optional
        Capture CUDA graphs (default: when ``device`` is CUDA). ``False`` runs the same path with
        ``build`` called on every run — that is the CPU path.
    typed : bool
        ``build(batch: StageBatch) -> result`` returns the builders' own typed results and
        declares no outputs: it passes ``batch.launch`` to every builder mode, and the runner,
        before each replay, describes ``B`` (``launch=False`` on the inputs cut to ``B``, or
        the host plan of its builder calls: :class:`StageBatch`), so
        :attr:`RunResult.results` holds each builder's result for ``B`` — no output named by
        string, no cut to declare (design §4).
    """

    def __init__(
        self,
        build: BuildFn,
        *,
        batch_sizes: Sequence[int],
        device: torch.device | str,
        host: HostFn | None = None,
        graphs: bool | None = None,
        typed: bool = False,
    ) -> None:
        if not callable(build):
            raise TypeError(f"build must be callable, got {type(build).__name__}")
        if host is not None and not callable(host):
            raise TypeError(f"host must be callable, got {type(host).__name__}")
        sizes = sorted(
            {validate.positive(f"batch_sizes[{i}]", b) for i, b in enumerate(batch_sizes)}
        )
        if not sizes:
            raise ValueError("batch_sizes must name at least one bucket")
        self.device = validate.canonical_device(device)
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a CUDA device, got {self.device}")
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self._build = build
        self._host = host
        self.typed = bool(typed)
        self._cut_views: dict[int, dict[str, torch.Tensor]] = {}  # B -> input views [:B]
        self._inputs: dict[str, StaticInput] = {}
        self._outputs: dict[str, StaticOutput] = {}
        self._guards: dict[str, Callable[[], torch.Tensor]] = {}
        self._layout: tuple | None = None
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._cuts: dict[int, dict[str, torch.Tensor]] = {}  # B -> outputs cut to B (graphs)
        self.pool = None  # the memory pool every bucket's graph shares (CUDA graphs only)
        # The fast path (design §4): calls whose arguments the host sees as an earlier checked
        # call's (validate.Signer) skip the checks and replay that call's pad launch.
        self._sign = validate.Signer()
        self._seen: set = set()
        self._pad_plans = LaunchPlans()
        self._described: dict[int, object] = {}  # B -> a typed result with no host inputs
        # B -> the host plan of B's describe (_HostPlan); False where the build's result has
        # a shape no plan makes (then the build is called on every call); the first
        # describe's results while a second one is to show its tensor items are static views
        self._host_plans: dict[int, object] = {}
        # B -> (graph replay, RunResult): a persistent replay with nothing to check but the
        # captured tensors (typed, graphed, no host inputs, no host function).
        self._lean: dict[int, tuple] = {}
        # B -> (graph replay, a one-step plan's step and input name, the plan, Bp, [the last
        # results, their RunResult]): the same with host inputs, whose host plan (_HostPlan)
        # reads every one of them.
        self._lean_host: dict[int, tuple] = {}
        # A run() key seen (_sign) -> (graph replay, step, input name, plan, Bp, [results,
        # RunResult]): run() with the engine's tensors, as the persistent entries above plus
        # the key's pad launch (step and plan None: no host inputs, the results fixed).
        self._lean_run: dict[object, tuple] = {}
        self._host_count = 0  # inputs with a CPU mirror (set by capture)
        self._typed_runs: dict[int, RunResult] = {}  # id(results) -> its typed RunResult
        # Requests whose rows may hold something other than their pad: every row from here on
        # holds its pad (capture pads them all). A persistent batch pads only past this mark.
        self._dirty = 0

    # ----------------------------------------------------------------------------------------
    # Registration
    # ----------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def inputs(self) -> Mapping[str, StaticInput]:
        return types.MappingProxyType(self._inputs)

    @property
    def outputs(self) -> Mapping[str, StaticOutput]:
        return types.MappingProxyType(self._outputs)

    def _open(self, what: str) -> None:
        if self._layout is not None:
            raise ValueError(f"{what}: the runner is captured; build a new runner to change it")

    def add_input(
        self,
        name: str,
        buffer: torch.Tensor,
        *,
        pad: int | float | bool,
        per_request: int = 1,
        host_mirror: bool = False,
        probe: Probe | None = None,
    ) -> torch.Tensor:
        """Register a static input buffer with its **required** pad value.

        Parameters
        ----------
        name : str
            The raw input's key in :meth:`run`.
        buffer : torch.Tensor
            A planned buffer (:func:`specmeta.plan_buffers`), ``[≥ max_bucket·per_request, *row]``,
            contiguous, on the runner's device. The runner writes it on every call.
        pad : int, float or bool
            The value of padded rows (design §4; see :mod:`specmeta.runners.padding`). Keyword
            only, no default: a buffer without a pad policy cannot be registered.
        per_request : int
            Rows of ``buffer`` per request.
        host_mirror : bool
            Keep a padded CPU mirror; :meth:`run` then also takes the raw CPU values in
            ``host_inputs[name]`` and the host function sees the padded mirror.
        probe : callable, optional
            ``probe(raw, label=...)`` (e.g. ``functools.partial(probes.detect_oob, lo=0, hi=R)``),
            run on the raw input when probes are enabled.

        Returns
        -------
        torch.Tensor
            ``buffer``.
        """
        self._open(f"add_input({name!r})")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if name in self._inputs:
            raise ValueError(f"input {name!r} is already registered")
        validate.tensor(name, buffer, dtypes=_DTYPES, device=self.device, contiguous_last=False)
        per_request = validate.positive(f"{name}: per_request", per_request)
        value = check_pad(name, pad, buffer.dtype)
        if buffer.dim() == 0 or not buffer.is_contiguous():
            raise ValueError(f"{name}: buffer must be contiguous with a batch dimension, got "
                             f"shape {tuple(buffer.shape)} strides {buffer.stride()}")  # fmt: skip
        validate.at_least(name, buffer.shape[0], self.max_batch_size * per_request,
                          f"rows ({self.max_batch_size} requests x {per_request})")  # fmt: skip
        if probe is not None and not callable(probe):
            raise TypeError(f"{name}: probe must be callable, got {type(probe).__name__}")
        mirror = torch.empty_like(buffer, device="cpu") if host_mirror else None
        self._inputs[name] = StaticInput(name, buffer, value, per_request, mirror, probe)
        return buffer

    def add_output(
        self, name: str, *, per_request: int | None, extra: int = 0, dim: int = 0
    ) -> None:
        """Declare an output of ``build`` and how it is cut to ``B`` requests.

        ``per_request=None`` returns the tensor whole; otherwise ``narrow(dim, 0,
        B·per_request + extra)`` (``kv_indptr [S, Bp·K + 1]`` is ``per_request=K, extra=1,
        dim=1``).
        """
        self._open(f"add_output({name!r})")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if name in self._outputs:
            raise ValueError(f"output {name!r} is already declared")
        if per_request is not None:  # 0: an output that is empty in this config
            validate.positive(f"{name}: per_request", per_request, minimum=0)
        validate.positive(f"{name}: extra", extra, minimum=0)
        validate.positive(f"{name}: dim", dim, minimum=0)
        self._outputs[name] = StaticOutput(name, per_request, extra, dim)

    def add_guard(self, name: str, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Guard a tensor the graphs read or write beyond the runner's inputs (``req_to_token``,
        a KV pool, a builder's buffers): a run after it was reallocated or reshaped raises
        instead of replaying on memory the graphs no longer own.

        Parameters
        ----------
        name : str
            For the message.
        tensor : torch.Tensor or callable
            The tensor itself (catches an in-place ``resize_`` or ``set_``), or a function
            returning the engine's current one (``lambda: engine.req_to_token``; also catches a
            reallocation). Its storage address, shape, strides, dtype and device are recorded at
            :meth:`capture` and compared, on the host, at every :meth:`run`.
        """
        self._open(f"add_guard({name!r})")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if name in self._guards:
            raise ValueError(f"guard {name!r} is already registered")
        if isinstance(tensor, torch.Tensor):
            fixed = tensor
            current = lambda: fixed  # noqa: E731
        elif callable(tensor):
            current = tensor
        else:
            raise TypeError(
                f"{name}: pass the tensor or a function returning it, got {type(tensor).__name__}"
            )
        if not isinstance(current(), torch.Tensor):
            raise TypeError(f"{name}: the guard function must return a torch.Tensor")
        self._guards[name] = current

    def _guard_signature(self) -> tuple:
        out = []
        for name, current in self._guards.items():
            t = current()
            out.append((name, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device))
        return tuple(out)

    def _signature(self) -> tuple:
        return (self.batch_sizes, tuple(s.signature() for s in self._inputs.values()),
                tuple(self._outputs.values()), self._guard_signature())  # fmt: skip


    def _check_layout(self) -> None:
        """Raise when a static buffer or a guarded tensor changed since :meth:`capture`: the
        quick check of them all first, the full comparison (and its message) on a miss."""
        if self._layout_unchanged():
            return
        if self._signature() != self._layout:
            changed = [name for name, (now, then) in self._changed_guards()]
            what = f"guarded tensor {', '.join(changed)}" if changed else "a static buffer"
            raise ValueError(f"{what} changed shape, dtype or storage since capture(); the "
                             "captured graphs no longer match it: build a new runner")  # fmt: skip

    # ----------------------------------------------------------------------------------------
    # Capture
    # ----------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Freeze the layout and capture one graph per bucket, all in one memory pool.

        Each bucket is captured on all-padding inputs (a valid batch of padded requests), largest
        first, after a warm-up run that compiles the kernels outside the capture. Python's
        cyclic garbage collector is off while the graphs are captured (:func:`collector_off`):
        an old graph destroyed by a collection in the middle of a capture would invalidate it.
        Without graphs this only freezes the layout: the build runs on every call.
        """
        if self._layout is not None:
            raise ValueError("capture() was already called")
        if not self._inputs:
            raise ValueError("register at least one input (add_input) before capture()")
        if not self._outputs and not self.typed:
            raise ValueError("declare at least one output (add_output) before capture()")
        if self._outputs and self.typed:
            raise ValueError("a typed runner returns its build's results; declare no outputs")
        for bp in self.batch_sizes:
            self._views[bp] = {n: s.buffer[: bp * s.per_request] for n, s in self._inputs.items()}
        # Host mirrors are copied on the CPU and may come in any dtype; device inputs must match
        # the captured buffer exactly.
        self._expected = {
            mirrors: [
                (n, f"{what}[{n!r}]", _DTYPES if mirrors else (s.buffer.dtype,), s.per_request,
                 s.buffer.shape[1:])
                for n, s in self._inputs.items()
                if not mirrors or s.mirror is not None
            ]
            for mirrors, what in ((False, "inputs"), (True, "host_inputs"))
        }  # fmt: skip
        self._layout = self._signature()
        # Whether every tensor the graphs hold an address of, the static buffers and the
        # guarded tensors as they are now, is as it was at capture: one generated check.
        self._layout_unchanged = validate.pinned(
            [s.buffer for s in self._inputs.values()], list(self._guards.values())
        )
        self._names = tuple(self._inputs)
        self._mirror_names = tuple(n for n, s in self._inputs.items() if s.mirror is not None)
        self._host_count = len(self._mirror_names)
        self._pick_inputs, self._pick_host = _picker(self._names), _picker(self._mirror_names)
        self._steps = [self.bucket(b) for b in range(self.max_batch_size + 1)]
        # A typed runner's replays read no padded mirror (its builders describe B from the raw
        # host values), so only a host function or the uncaptured path needs them.
        self._needs_mirrors = not (self.typed and self.graphs) or self._host is not None
        if not self.graphs:
            return
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # A dead object collected during a capture may own another CUDA graph; destroying a
        # graph is a call the capture forbids, and it invalidates the capture. So the cyclic
        # collector is off while the graphs are captured; garbage waits until after.
        with collector_off():
            self._capture_buckets(stream)
        torch.cuda.synchronize(self.device)  # set-up, not a build path

    def _capture_buckets(self, stream: torch.cuda.Stream) -> None:
        """One graph per bucket, largest first, each after a warm-up outside the capture."""
        for bp in reversed(self.batch_sizes):
            self._pad_host(0, bp, {})
            self._pad_device(0, bp, {})
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._checked_build(bp, with_host=False)  # warm-up: compiles outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._checked_build(bp, with_host=False)
            self._graphs[bp] = graph
            self._graph_outputs[bp] = out

    @property
    def captured(self) -> bool:
        return self._layout is not None

    def bucket(self, batch_size: int) -> int:
        """The smallest captured ``Bp ≥ batch_size``."""
        B = validate.positive("batch_size", batch_size, minimum=0)
        i = bisect.bisect_left(self.batch_sizes, B)
        if i == len(self.batch_sizes):
            raise ValueError(
                f"batch_size={B} exceeds the largest captured bucket {self.max_batch_size}"
            )
        return self.batch_sizes[i]

    # ----------------------------------------------------------------------------------------
    # Run
    # ----------------------------------------------------------------------------------------
    def run(
        self,
        batch_size: int,
        inputs: Mapping[str, torch.Tensor],
        *,
        host_inputs: Mapping[str, torch.Tensor] | None = None,
        copy: bool,
    ) -> RunResult:
        """Pad, replay (or build) and cut the outputs to ``batch_size``.

        Parameters
        ----------
        batch_size : int
            ``B`` ≥ 0.
        inputs : mapping of str to torch.Tensor
            Every registered input, ``[B·per_request, *row]`` with the buffer's dtype, on the
            runner's device (non-contiguous inputs are made contiguous first).
        host_inputs : mapping of str to torch.Tensor, optional
            The CPU values ``[B·per_request, *row]`` of every input registered with a mirror.
        copy : bool
            ``False``: outputs are views into the runner's buffers, valid until the next run.
            ``True``: outputs are private copies. Required: there is no silent default.

        Raises
        ------
        ValueError, TypeError
            Before any device work, when an input is missing, unknown, or mismatches the
            captured layout (shape, dtype, device), when ``batch_size`` exceeds the largest
            bucket, or when the host function finds a buffer too small.

        A call whose arguments the host sees exactly as an earlier call's (the same
        ``batch_size`` and ``copy``, and tensors of the same addresses, shapes, strides and
        dtypes: :class:`specmeta.validate.Signer`) passed the same checks, so it skips them
        and replays that call's pad launch (:class:`specmeta.launch.LaunchPlans`) before the
        graph (design §4); from the second such call on, a typed, graphed stage whose host
        plan reads every host input runs only that plan, the pad launch and the graph.
        The guarded tensors are compared on every call.
        """
        if self._layout is None:
            raise ValueError("call capture() before run()")
        host_inputs = host_inputs or {}
        try:
            key = self._sign(None, batch_size, copy, *self._pick_inputs(inputs),
                             *self._pick_host(host_inputs))  # fmt: skip
            lean = self._lean_run.get(key)
            pad_key = LaunchPlans.key(key) if lean is None and key in self._seen else None
            fast = pad_key in self._pad_plans and len(inputs) == len(self._names)
        except (KeyError, TypeError):  # a missing input, an unhashable value: checked below
            key, lean, fast = None, None, False
        if (
            lean is not None
            and len(inputs) == len(self._names)
            and len(host_inputs) == self._host_count
            and self._layout_unchanged()
            and not probes.enabled()
        ):
            # A key run before, typed and graphed: the host plan (its steps check the values,
            # before any launch), the key's pad launch, the graph.
            replay, step, name, plan, bp, runs, last = lean
            if step is not None:
                results = step(host_inputs[name])
            else:
                results = plan(host_inputs) if plan is not None else last[0]
            if not self._pad_plans.replay_key(key):
                self._pad_device(batch_size, bp, inputs)  # a launch hook: Triton's launch
            self._dirty = batch_size if self._dirty <= bp else self._dirty
            replay()
            if results is last[0]:  # the same host values: the same results object
                return last[1]
            run = runs.get(id(results))
            if run is None or run.results is not results:
                run = self._lean_result(runs, last, batch_size, bp, results)
            return run
        if not fast:
            return self._run_checked(batch_size, inputs, host_inputs, copy, key)
        B = batch_size
        bp = self._steps[B]
        self._check_layout()
        if probes.enabled():
            self._probe(inputs)
        host = self._pad_host(B, bp, host_inputs) if self._needs_mirrors else {}
        results = self._describe(B, host_inputs) if self.typed else None
        self._pad_plans.replay(pad_key)
        self._dirty = B if self._dirty <= bp else self._dirty
        run = self._replay(B, bp, host, copy, results)
        lean = self._lean_entry(B, bp, results, run)
        if lean is not None:
            if len(self._lean_run) >= 4096:
                self._lean_run.clear()
            self._lean_run[key] = lean
        return run

    def _run_checked(self, batch_size, inputs, host_inputs, copy, key) -> RunResult:
        """:meth:`run` with every check, recording the pad launch as the plan of ``key``."""
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
        bp = self.bucket(batch_size)
        B = batch_size
        self._check_layout()
        raw = self._check_inputs("inputs", B, inputs, self.device, mirrors=False)
        host_raw = self._check_inputs("host_inputs", B, host_inputs, torch.device("cpu"),
                                      mirrors=True)  # fmt: skip
        if probes.enabled():
            self._probe(raw)
        host = self._pad_host(B, bp, host_raw) if self._needs_mirrors else {}
        results = None
        if self.typed:
            if copy:
                raise ValueError("copy=True: a typed runner returns the builders' results, "
                                 "views of their buffers; pass copy=False")  # fmt: skip
            results = self._describe(B, host_raw)
        # A call whose inputs were used as given (no contiguous copy) replays its pad launch
        # on the next call of the same key.
        as_given = all(raw[n] is inputs[n] for n in self._names) and all(
            host_raw[n] is host_inputs[n] for n in self._mirror_names
        )
        pad_key = LaunchPlans.key(key) if key is not None and as_given else None
        with recording() as launches:
            self._pad_device(B, bp, raw)
        self._pad_plans.store(pad_key, *launches)
        if pad_key is not None and pad_key in self._pad_plans:
            self._remember(key)
        self._dirty = B if self._dirty <= bp else self._dirty
        return self._replay(B, bp, host, copy, results)

    def static_inputs(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The static buffers' rows of ``batch_size`` requests, ``[:B·per_request]``, for an
        engine that keeps its batch in the runner's own buffers (a persistent batch): it
        writes rows ``[:B·per_request]`` of these views, and only those, then calls
        :meth:`replay`. Views made once per ``B``."""
        if self._layout is None:
            raise ValueError("call capture() before static_inputs()")
        self.bucket(batch_size)
        return dict(self._views_of(batch_size))

    def _views_of(self, B: int) -> dict[str, torch.Tensor]:
        """Every static buffer cut to ``B`` requests (made once per ``B``; not to be changed)."""
        views = self._cut_views.get(B)
        if views is None:
            views = self._cut_views[B] = {
                n: s.buffer[: B * s.per_request] for n, s in self._inputs.items()
            }
        return views

    def replay(
        self, batch_size: int, *, host_inputs: Mapping[str, torch.Tensor] | None = None
    ) -> RunResult:
        """Replay on the batch the engine wrote into :meth:`static_inputs` (a persistent batch):
        no input copy. Rows past the batch must hold their pads; they do unless an earlier call
        had more requests, so only after the batch shrank does this launch one pad (of the
        rows past ``B`` that the larger batch wrote) before the graph. Outputs are views
        (``copy=False``).

        Parameters
        ----------
        batch_size : int
            ``B`` ≥ 0, the requests written into :meth:`static_inputs`.
        host_inputs : mapping of str to torch.Tensor, optional
            As in :meth:`run`.
        """
        if host_inputs is None:
            lean = self._lean.get(batch_size)
        elif host_inputs.__class__ is dict and len(host_inputs) == self._host_count:
            lean = self._lean_host.get(batch_size)
        else:
            lean = None
        if (
            lean is not None
            and batch_size.__class__ is int
            and self._dirty <= batch_size  # every row past B holds its pad
            and self._layout_unchanged()
            and not probes.enabled()
        ):
            if host_inputs is None:
                # A typed stage with no host inputs, B replayed before: the graph, B's result.
                self._dirty = batch_size
                lean[0]()
                return lean[1]
            # Host inputs, B replayed before: the host plan (its steps check the values, before
            # any launch), the graph, the results' RunResult.
            replay, step, name, plan, bp, runs, last = lean
            try:
                # One builder call: its step on its input; else every step, in call order.
                results = step(host_inputs[name]) if step is not None else plan(host_inputs)
            except KeyError:  # a host input missing (read before any step): named below
                pass
            else:
                self._dirty = batch_size
                replay()
                if results is last[0]:  # the same host values: the same results object
                    return last[1]
                run = runs.get(id(results))
                if run is None or run.results is not results:
                    run = self._lean_result(runs, last, batch_size, bp, results)
                return run
        if self._layout is None:
            raise ValueError("call capture() before replay()")
        if host_inputs is None and not self._mirror_names:
            # Nothing to key but B: an int B checked before is a key seen.
            key = batch_size if batch_size.__class__ is int else None
            fast = key in self._seen
            host_inputs = {}
        else:
            host_inputs = host_inputs or {}
            try:
                key = self._sign("replay", batch_size,
                                 *[host_inputs[n] for n in self._mirror_names])  # fmt: skip
                fast = key in self._seen
            except (KeyError, TypeError):
                key, fast = None, False
        B = batch_size
        if fast:
            bp = self._steps[B]
            host_raw = host_inputs
        else:
            bp = self.bucket(B)
            host_raw = self._check_inputs("host_inputs", B, host_inputs, torch.device("cpu"),
                                          mirrors=True)  # fmt: skip
        self._check_layout()
        if probes.enabled():
            self._probe(self._views_of(B))
        host = self._pad_host(B, bp, host_raw) if self._needs_mirrors else {}
        results = self._describe(B, host_raw) if self.typed else None
        if self._dirty > B:
            # Rows [B, dirty) were a larger batch's: back to their pads, in one launch.
            pad_key = LaunchPlans.key("pad", B, self._dirty)
            if not self._pad_plans.replay(pad_key):
                with recording() as launches:
                    self._pad_device(B, self._dirty, self._views_of(B))
                self._pad_plans.store(pad_key, *launches)
        self._dirty = B
        if not fast and key is not None and all(
            host_raw[n] is host_inputs[n] for n in self._mirror_names
        ):
            self._remember(key)
        run = self._replay(B, bp, host, False, results)
        lean = self._lean_entry(B, bp, results, run) if fast else None
        if lean is not None:
            if not self._mirror_names:
                self._lean[B] = (lean[0], run)
            else:
                self._lean_host[B] = lean
        return run

    def _lean_entry(self, B: int, bp: int, results: object, run: RunResult) -> tuple | None:
        """``(graph replay, step, input name, plan, Bp, runs, [results, run])`` for the lean
        paths of :meth:`replay` and :meth:`run` after a checked call of ``B`` that returned
        ``run``: typed and graphed, no host function, and a host plan (:class:`_HostPlan`) that
        reads every host input (``step``: its single step and that step's input; ``plan``
        None: no host inputs, ``results`` fixed); ``None`` otherwise. The last results made
        and their RunResult answer a repeat at once; ``runs`` maps ``id`` of every results
        object met to its RunResult (a builder's results cycle through its host-mirror sets,
        or follow ``max L``; :meth:`_lean_result`)."""
        if not (self.typed and self.graphs and self._host is None):
            return None
        runs, last = {id(results): run}, [results, run]
        if not self._mirror_names:
            return (self._graphs[bp].replay, None, None, None, bp, runs, last)
        plan = self._host_plans.get(B)
        if plan.__class__ is not _HostPlan or plan.names != frozenset(self._mirror_names):
            return None
        step, name = plan.single or (None, None)
        return (self._graphs[bp].replay, step, name, plan.run, bp, runs, last)

    def _lean_result(self, runs: dict, last: list, B: int, bp: int, results: object) -> RunResult:
        """The RunResult of ``results``, new to a lean entry's ``runs``: kept with the object,
        so its id names no other while it is kept; bounded (``max L`` may take many values)."""
        if len(runs) >= 64:
            runs.clear()
        run = runs[id(results)] = self._typed_run(B, bp, results)
        last[:] = results, run
        return run

    def _remember(self, key: object) -> None:
        """Keep ``key`` as a checked call's; bounded (an engine that passes new tensors every
        call makes a new key every call)."""
        if len(self._seen) >= 4096:
            self._seen.clear()
        self._seen.add(key)

    def _describe(self, B: int, host_raw: Mapping[str, torch.Tensor]) -> object:
        """A typed build's result for ``B`` (``launch=False``): before any launch, the builders
        check the batch on the host, refresh their host mirrors and describe their buffers for
        ``B`` (no device value is read). With no host inputs the result depends on ``B`` only
        and is made once. With host inputs, the first describe of ``B`` records its builder
        calls' host steps (:func:`~specmeta.metadata.contract.describing`); later ones run
        those steps on the new values (:class:`_HostPlan`), without calling the build."""
        if not self._mirror_names:
            found = self._described.get(B)
            if found is not None:
                return found
        else:
            plan = self._host_plans.get(B)
            if plan.__class__ is _HostPlan:
                return plan.run(host_raw)
            if plan is False:  # a result no plan makes: the build, with nothing to record
                return self._build(StageBatch(self._views_of(B), host_raw, False))
        with describing() as steps:
            results = self._build(StageBatch(self._views_of(B), host_raw, False))
        if not self._mirror_names:
            self._described[B] = results
        else:
            # plan: missing (the first describe of B), or the results of the first describe,
            # whose tensor items this one's must view again (_AGAIN).
            made = _HostPlan.make(results, steps, host_raw, earlier=plan)
            if made is _AGAIN:
                self._host_plans[B] = results if plan is None else False
            else:
                self._host_plans[B] = made or False
        return results

    def _replay(self, B, bp, host, copy, results) -> RunResult:
        """Replay the graph of ``bp`` (or build on its padded buffers) and cut the outputs."""
        if self.graphs:
            self._graphs[bp].replay()
            out = self._graph_outputs[bp]
        else:
            out = self._checked_build(bp)
        if self.typed:
            if host:  # the host function's values: this call's own
                return RunResult(B, bp, _NONE, host, False, results)
            return self._typed_run(B, bp, results)
        if copy:
            sliced = {name: t.clone() for name, t in self._cut(out, B).items()}
        elif self.graphs:
            # The graph's outputs never move: their views for B are made once.
            sliced = self._cuts.get(B)
            if sliced is None:
                sliced = self._cuts[B] = self._cut(out, B)
            sliced = dict(sliced)
        else:
            sliced = self._cut(out, B)
        return RunResult(B, bp, sliced, host, copy)

    def _typed_run(self, B: int, bp: int, results: object) -> RunResult:
        """The typed RunResult of ``results``, made once per results object (a builder's
        results cycle through its host-mirror sets, or follow ``max L``); kept with the object,
        so its id names no other while it is kept."""
        runs, key = self._typed_runs, id(results)
        run = runs.get(key)
        if (run is None or run.results is not results or run.batch_size != B
                or run.padded_batch_size != bp):  # fmt: skip
            if len(runs) >= 256:
                runs.clear()
            run = runs[key] = RunResult(B, bp, _NONE, _NONE, False, results)
        return run

    def _probe(self, raw: Mapping[str, torch.Tensor]) -> None:
        for name, spec in self._inputs.items():
            if spec.probe is not None:
                spec.probe(raw[name], label=f"runner input {name!r}")

    def _cut(self, out: Mapping[str, torch.Tensor], B: int) -> dict[str, torch.Tensor]:
        """Each output cut to ``B`` (views)."""
        sliced = {}
        for name, spec in self._outputs.items():
            n = spec.length(B)
            sliced[name] = out[name] if n is None else out[name].narrow(spec.dim, 0, n)
        return sliced

    def _changed_guards(self) -> list[tuple[str, tuple[tuple, tuple]]]:
        then = {g[0]: g for g in self._layout[-1]}
        return [(g[0], (g, then[g[0]])) for g in self._guard_signature() if g != then[g[0]]]

    # ----------------------------------------------------------------------------------------
    # Steps
    # ----------------------------------------------------------------------------------------
    def _check_inputs(self, what, B, given, device, *, mirrors):
        # (name, label, dtypes, per_request, row shape) of each expected input, made at capture.
        expected = self._expected[mirrors]
        if not isinstance(given, Mapping):
            raise TypeError(f"{what} must be a mapping of name to tensor")
        if len(given) != len(expected) or any(e[0] not in given for e in expected):
            names = [e[0] for e in expected]
            missing = [n for n in names if n not in given]
            unknown = [n for n in given if n not in names]
            raise ValueError(f"{what}: missing {missing}, unexpected {unknown}; expected exactly "
                             f"{names}")  # fmt: skip
        out = {}
        for name, label, dtypes, per_request, row_shape in expected:
            t = given[name]
            validate.tensor(label, t, dtypes=dtypes, device=device, contiguous_last=False)
            if t.shape[0] != B * per_request or t.shape[1:] != row_shape:
                shape = (B * per_request, *row_shape)
                raise ValueError(f"{label} must have shape {shape} (batch_size={B} x per_request="
                                 f"{per_request}), got {tuple(t.shape)}")  # fmt: skip
            out[name] = t if t.is_contiguous() else t.contiguous()
        return out

    def _pad_host(self, B: int, bp: int, host_raw: Mapping[str, torch.Tensor]) -> dict:
        mirrors = {}
        for name, spec in self._inputs.items():
            if spec.mirror is None:
                continue
            n, npad = B * spec.per_request, bp * spec.per_request
            if n:
                spec.mirror[:n].copy_(host_raw[name])
            spec.mirror[n:npad].fill_(spec.pad)
            mirrors[name] = spec.mirror[:npad]
        return dict(self._host(mirrors)) if self._host is not None else {}

    def _pad_device(self, B: int, upto: int, raw: Mapping[str, torch.Tensor]) -> None:
        """Every static input: ``[:B]`` from the raw input, ``[B:upto]`` its pad (requests),
        in one launch for up to four inputs. The inputs were checked against the layout
        (_check_inputs), so the copy skips its own second pass over them."""
        pairs = []
        for name, spec in self._inputs.items():
            src = raw.get(name)
            if src is None:  # capture: every row is padding
                src = spec.buffer[:0]
            dst = self._views.get(upto, {}).get(name)
            if dst is None:
                dst = spec.buffer[: upto * spec.per_request]
            pairs.append((src, dst, spec.pad))
        _copy_pad_checked(pairs)

    def _checked_build(self, bp: int, *, with_host: bool = True) -> dict[str, torch.Tensor]:
        if self.typed:
            # Captured builds see no host values: what a graph holds cannot depend on them.
            host = {n: s.mirror[: bp * s.per_request] for n, s in self._inputs.items()
                    if with_host and s.mirror is not None}  # fmt: skip
            self._build(StageBatch(types.MappingProxyType(self._views[bp]), host, True))
            return {}
        out = self._build(types.MappingProxyType(self._views[bp]))
        if not isinstance(out, Mapping):
            raise TypeError(
                f"build must return a mapping of name to tensor, got {type(out).__name__}"
            )
        if set(out) != set(self._outputs):
            raise ValueError(f"build returned {sorted(out)}, but the declared outputs are "
                             f"{sorted(self._outputs)}")  # fmt: skip
        for name, spec in self._outputs.items():
            t = out[name]
            validate.tensor(f"build output {name!r}", t, dtypes=_DTYPES, contiguous_last=False)
            n = spec.length(bp)
            if n is not None:
                if t.dim() <= spec.dim:
                    raise ValueError(f"build output {name!r} has no dimension {spec.dim}")
                validate.at_least(f"build output {name!r}", t.shape[spec.dim], n,
                                  f"entries in dimension {spec.dim} for Bp={bp}")  # fmt: skip
        return dict(out)


_DTYPES = (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip
