"""A CUDA-graph runner of bound stages, whose every static input declares its pad (design §4).

The runner owns a set of persistent input buffers (from :func:`specmeta.plan_buffers`), each
registered **with its pad value** — there is no way to register one without — and a function
``stage(inputs) -> Stage`` that binds the work of one stage (builder modes, launchers) to the
static views it is given (:class:`specmeta.stage.Stage`). :meth:`GraphRunner.capture` binds it
once per bucket ``Bp`` on the views ``[:Bp]`` and captures the stage's launches in one CUDA
graph per bucket (all sharing one memory pool). It binds it once more per batch size ``B`` on
the views ``[:B]``, the first time ``B`` is met, for the stage's host part: the builders'
results for ``B`` requests (every builder's layout for ``B`` requests is a prefix of its
layout for ``Bp ≥ B`` padded ones) and their host side from ``seq_lens_cpu``.

Two ways to run a batch of ``B`` requests:

* :meth:`GraphRunner.run` takes the engine's own tensors: it checks them against the captured
  layout (shapes and dtypes, on the host), runs the input probes when enabled, runs the host
  part (which checks ``seq_lens_cpu`` before anything is launched), copies every input into
  its static buffer ``[:B]`` and pads ``[B:Bp]`` (one launch for up to four buffers), replays
  the graph of ``Bp`` (without graphs: the bucket's stage launches on the same padded buffers,
  step for step), and returns a :class:`RunResult`;
* :meth:`GraphRunner.replay` serves a persistent batch, kept by the engine in the runner's
  own buffers (:meth:`GraphRunner.static_inputs`): the host part, a pad launch only where a
  larger batch left rows behind, the graph; it returns the host part's result.

Both first check, on the host, that no static buffer and no guarded tensor changed address,
shape or strides since capture: a replay on memory the graph no longer owns is refused.

Examples
--------
>>> fa3 = specmeta.FA3MetadataBuilder(cfg, device)
>>> bufs = specmeta.allocate_buffers(cfg, device, ["runner.req_pool_indices", "runner.seq_lens"])
>>> def stage(inp):                     # inp: static views [:Bp] (capture) or [:B] (host part)
...     return fa3.bind_draft_extend(inp["req_pool_indices"], req_to_token, inp["seq_lens"])
>>> runner = GraphRunner(stage, batch_sizes=[1, 8, 32], device=device)
>>> runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
>>> runner.add_input("seq_lens", bufs["runner.seq_lens"], pad=padding.seq_lens_fill(N),
...                  host_mirror=True)
>>> runner.add_guard("req_to_token", lambda: req_to_token)
>>> runner.capture()
>>> res = runner.run(3, {"req_pool_indices": rpi, "seq_lens": sl}, host_inputs={"seq_lens": cpu})
>>> res.results.cache_seqlens.shape, res.padded_batch_size
(torch.Size([3]), 8)
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import types
from collections.abc import Callable, Mapping, Sequence

import torch

from .. import probes, validate
from ..stage import Stage
from .padding import bind_copy_pad_many, check_pad

__all__ = ["GraphRunner", "RunResult", "StaticInput", "collector_off"]

StageFn = Callable[[Mapping[str, torch.Tensor]], Stage]
Probe = Callable[..., None]


@contextlib.contextmanager
def collector_off():
    """Python's cyclic garbage collector off in the block, back as it was after.

    :meth:`GraphRunner.capture` captures under it; so should code that captures graphs of its
    own around specmeta's stages: a collection in the middle of a capture may destroy a dead
    object's CUDA graph (an old runner's, in a reference cycle), a call the capture forbids,
    which invalidates the capture.

    >>> with collector_off(), torch.cuda.graph(graph):
    ...     stage.launch()
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
        Key of the raw input in :meth:`GraphRunner.run` and of the view given to the stage.
    buffer : torch.Tensor
        ``[≥ max_bucket·per_request, *row]`` contiguous, on the runner's device.
    pad : int | float
        Written into rows ``[B·per_request, Bp·per_request)`` before every replay.
    per_request : int
        Rows of ``buffer`` one request owns (``K·S`` for draft slots, ``N`` for a verify window).
    host_mirror : str or None
        The keyword of the stage's host part that the input's CPU values go to
        (``"seq_lens_cpu"``, its first argument; ``"verify_lens_cpu"`` of a ragged verify), or
        ``None``: :meth:`GraphRunner.run` takes them as ``host_inputs[name]``.
    probe : callable or None
        ``probe(raw, label=...)``, run on the raw input when probes are enabled.
    """

    name: str
    buffer: torch.Tensor
    pad: int | float
    per_request: int
    host_mirror: str | None
    probe: Probe | None


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one :meth:`GraphRunner.run` returns.

    Attributes
    ----------
    batch_size : int
        ``B``, the raw batch.
    padded_batch_size : int
        ``Bp``, the bucket that ran.
    results : object
        The stage's result for ``B`` requests (the builders' own result objects, views of their
        buffers, overwritten by the next run).
    """

    batch_size: int
    padded_batch_size: int
    results: object


_DTYPES = (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip


class GraphRunner:
    """Captures a bound stage once per bucket and replays it on padded static inputs.

    Parameters
    ----------
    stage : callable
        ``stage(inputs) -> Stage``: binds the stage's work (builder modes through their
        ``bind_<mode>``, launchers through their ``bind_<op>``) to ``inputs``, the static view
        ``buffer[:n·per_request]`` of every registered input, where ``n`` is a bucket (the
        graph's launches) or a batch size (the host part, never launched). It must read batch
        data only from these views and write only into persistent buffers (a builder's own, or
        planned ones): the launches of ``Bp`` and the results of ``B`` must view the same
        memory.
    batch_sizes : sequence of int
        The buckets ``Bp`` (≥ 1) to capture.
    device : torch.device or str
        Where the static buffers live.
    graphs : bool, optional
        Capture CUDA graphs (default: when ``device`` is CUDA). ``False`` runs the same path,
        the bucket's stage launched on every run: that is the CPU path.
    """

    def __init__(self, stage: StageFn, *, batch_sizes: Sequence[int],
                 device: torch.device | str, graphs: bool | None = None) -> None:  # fmt: skip
        if not callable(stage):
            raise TypeError(f"stage must be callable, got {type(stage).__name__}")
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
        self._stage_fn = stage
        self._inputs: dict[str, StaticInput] = {}
        self._guards: dict[str, Callable[[], torch.Tensor]] = {}
        self._layout: tuple | None = None  # what the graphs hold, frozen by capture()
        self._buckets: dict[int, Stage] = {}  # Bp -> the stage bound on the views [:Bp]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hosts: dict[int, tuple] = {}  # B -> (the stage bound on the views [:B], Bp)
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # n -> every input's [:n] view
        self._pads: dict[tuple[int, int], Stage] = {}  # (B, upto) -> pad launch of rows [B, upto)
        self.pool = None  # the memory pool every bucket's graph shares (CUDA graphs only)
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
    def captured(self) -> bool:
        return self._layout is not None

    def _open(self, what: str) -> None:
        if self._layout is not None:
            raise ValueError(f"{what}: the runner is captured; build a new runner to change it")

    def add_input(self, name: str, buffer: torch.Tensor, *, pad: int | float | bool,
                  per_request: int = 1, host_mirror: bool | str = False,
                  probe: Probe | None = None) -> torch.Tensor:  # fmt: skip
        """Register a static input buffer with its **required** pad value.

        Parameters
        ----------
        name : str
            The raw input's key in :meth:`run` and the view's key given to the stage.
        buffer : torch.Tensor
            A planned buffer (:func:`specmeta.plan_buffers`), ``[≥ max_bucket·per_request,
            *row]``, contiguous, on the runner's device. The runner writes it on every run.
        pad : int, float or bool
            The value of padded rows (design §4; see :mod:`specmeta.runners.padding`). Keyword
            only, no default: a buffer without a pad policy cannot be registered.
        per_request : int
            Rows of ``buffer`` per request.
        host_mirror : bool or str
            :meth:`run` and :meth:`replay` also take the input's CPU values
            (``host_inputs[name]``), passed to the stage's host part: ``True`` as
            ``seq_lens_cpu``, a str as that keyword (``"verify_lens_cpu"``); one input a
            keyword.
        probe : callable, optional
            ``probe(raw, label=...)`` (e.g. ``functools.partial(probes.detect_oob, lo=0,
            hi=R)``), run on the raw input when probes are enabled.

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
        keyword = ("seq_lens_cpu" if host_mirror is True else host_mirror) or None
        if keyword is not None and not isinstance(keyword, str):
            raise TypeError(f"{name}: host_mirror must be a bool or a keyword str, got "
                            f"{type(host_mirror).__name__}")  # fmt: skip
        first = next((n for n, s in self._inputs.items() if s.host_mirror == keyword), None)
        if keyword is not None and first is not None:
            raise ValueError(f"{name}: host_mirror={host_mirror!r}, but {first!r} is the host "
                             f"part's {keyword} already; one input a keyword")  # fmt: skip
        self._inputs[name] = StaticInput(name, buffer, value, per_request, keyword, probe)
        return buffer

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
            reallocation). Its address, shape and strides are recorded at :meth:`capture` and
            compared, on the host, before every run and replay.
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

    # ----------------------------------------------------------------------------------------
    # Capture
    # ----------------------------------------------------------------------------------------
    def _held(self) -> tuple:
        """What the graphs depend on, now: each static buffer's and guarded tensor's address,
        shape and strides (a guard's dtype and device too: a function may return another
        tensor)."""
        held = [(t.data_ptr(), t.shape, t.stride()) for t in self._buffers]
        for current in self._guards.values():
            t = current()
            held.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
        return tuple(held)

    def _moved(self) -> bool:
        """Whether what :meth:`_held` reads differs from :attr:`_layout`: the static buffers
        compared one at a time, stopping at the first change (the check every :meth:`replay`
        makes), then the guarded tensors (the layout's entries after the buffers')."""
        for t, (ptr, shape, stride) in zip(self._buffers, self._layout, strict=False):
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                return True
        return bool(self._guards) and self._held() != self._layout

    def _check_held(self) -> None:
        """Raise when a static buffer or a guarded tensor changed since :meth:`capture`."""
        now = self._held()
        if now == self._layout:
            return
        names = [*self._inputs, *(f"guarded tensor {g}" for g in self._guards)]
        changed = [n for n, a, b in zip(names, now, self._layout, strict=True) if a != b]
        raise ValueError(f"{', '.join(changed)} changed address, shape or strides since "
                         "capture(); the captured graphs no longer match it: bind a new "
                         "runner")  # fmt: skip

    def capture(self) -> None:
        """Freeze the layout, bind the stage once per bucket and capture its launches, one
        graph per bucket, all in one memory pool.

        Each bucket is bound and captured on all-padding inputs (a valid batch of padded
        requests), largest first, after a warm-up launch outside the capture. Python's cyclic
        garbage collector is off while the graphs are captured (:func:`collector_off`): an old
        graph destroyed by a collection in the middle of a capture would invalidate it. Without
        graphs this binds the buckets' stages, which every run launches.
        """
        if self._layout is not None:
            raise ValueError("capture() was already called")
        if not self._inputs:
            raise ValueError("register at least one input (add_input) before capture()")
        mirrors = {n: s.host_mirror for n, s in self._inputs.items() if s.host_mirror}
        self._host_name = next((n for n, k in mirrors.items() if k == "seq_lens_cpu"), None)
        self._host_extra = {n: k for n, k in mirrors.items() if k != "seq_lens_cpu"}
        self._buffers = tuple(s.buffer for s in self._inputs.values())
        self._expected = [
            (n, s.buffer.dtype, s.per_request, tuple(s.buffer.shape[1:]))
            for n, s in self._inputs.items()
        ]
        self._layout = self._held()
        for key in reversed(self._bucket_keys()):
            self._pad(0, self._rows(key), {})
            stage = self._bind_bucket(key)
            if not isinstance(stage, Stage):
                raise TypeError(f"stage must return a specmeta.Stage (bind its work with the "
                                f"builders' bind_<mode>), got {type(stage).__name__}")  # fmt: skip
            self._buckets[key] = stage
        self._dirty = 0
        if not self.graphs:
            return
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        with collector_off():
            for key in reversed(self._bucket_keys()):
                stage = self._buckets[key]
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    stage.launch()  # warm-up: loads the kernels outside the capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    stage.launch()
                self._graphs[key] = graph
        torch.cuda.synchronize(self.device)  # set-up, not a build path

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
    def run(self, batch_size: int, inputs: Mapping[str, torch.Tensor], *,
            host_inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:  # fmt: skip
        """Copy and pad the engine's inputs, run the host part, replay (or launch) ``Bp``.

        Parameters
        ----------
        batch_size : int
            ``B`` ≥ 0.
        inputs : mapping of str to torch.Tensor
            Every registered input, ``[B·per_request, *row]`` with the buffer's dtype, on the
            runner's device (non-contiguous inputs are made contiguous first).
        host_inputs : mapping of str to torch.Tensor, optional
            ``{name: cpu values}`` of the input registered with ``host_mirror=True``
            (``seq_lens_cpu`` of the stage's host part).

        Raises
        ------
        ValueError, TypeError
            Before any device work, when an input is missing, unknown, or mismatches the
            captured layout (shape, dtype, device), when ``batch_size`` exceeds the largest
            bucket, when a captured tensor changed, or when the host part refuses a value.
        """
        if self._layout is None:
            raise ValueError("call capture() before run()")
        bp = self.bucket(batch_size)
        B = batch_size
        self._check_held()
        raw = self._check_inputs(B, inputs)
        values, extra = self._host_values(host_inputs)
        if probes.enabled():
            self._probe(raw)
        results = self._host(B)[0].host(values, **extra)
        self._pad(B, bp, raw)
        self._dirty = B if self._dirty <= bp else self._dirty
        self._launch(bp)
        return RunResult(B, bp, results)

    def static_inputs(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The static buffers' rows of ``batch_size`` requests, ``[:B·per_request]``, for an
        engine that keeps its batch in the runner's own buffers (a persistent batch): it
        writes rows ``[:B·per_request]`` of these views, and only those, then calls
        :meth:`replay`."""
        if self._layout is None:
            raise ValueError("call capture() before static_inputs()")
        self.bucket(batch_size)
        return dict(self._views_of(batch_size))

    def replay(self, batch_size: int, *,
               host_inputs: Mapping[str, torch.Tensor] | None = None) -> object:  # fmt: skip
        """Replay a persistent batch of ``batch_size`` requests, written by the engine into
        :meth:`static_inputs`: the host part on ``host_inputs`` (as in :meth:`run`), one pad
        launch of rows ``[B, mark)`` when a larger batch wrote them (rows past ``B`` must
        otherwise hold their pads: the runner pads what it wrote), and the graph of ``Bp``.
        Returns the stage's result for ``B`` requests."""
        entry = self._hosts.get(batch_size)
        if entry is None:
            if self._layout is None:
                raise ValueError("call capture() before replay()")
            self._check_held()  # before B's stage is bound: a changed tensor is named as such
            entry = self._host(batch_size)
        stage, bp = entry
        if self._moved():
            self._check_held()  # raises, naming what changed
        if probes.enabled():
            self._probe(self._views_of(batch_size))
        name = self._host_name
        if host_inputs is None and name is None and not self._host_extra:
            results = stage.host()  # no host inputs, none registered
        elif (name is not None and type(host_inputs) is dict and len(host_inputs) == 1
              and name in host_inputs and not self._host_extra):  # the usual: seq_lens_cpu
            results = stage.host(host_inputs[name])
        else:
            values, extra = self._host_values(host_inputs)  # raises, naming what is wrong
            results = stage.host(values, **extra)
        if self._dirty > batch_size:
            # Rows [B, dirty) were a larger batch's: back to their pads, in one launch.
            self._pad(batch_size, self._dirty, None)
        self._dirty = batch_size
        self._launch(bp)
        return results

    # ----------------------------------------------------------------------------------------
    # Steps
    # ----------------------------------------------------------------------------------------
    def _views_of(self, n: int) -> dict[str, torch.Tensor]:
        """Every static buffer cut to ``n`` requests (made once per ``n``)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = {
                name: s.buffer[: n * s.per_request] for name, s in self._inputs.items()
            }
        return views

    def _host(self, B: int) -> tuple[Stage, int]:
        """The stage bound on the views ``[:B]``, for its host part, and ``B``'s bucket (bound
        once per ``B``)."""
        entry = self._hosts.get(B)
        if entry is None:
            bp = self.bucket(B)
            stage = self._stage_fn(types.MappingProxyType(self._views_of(B)))
            entry = self._hosts[B] = (stage, bp)
        return entry

    def _host_values(self, host_inputs: Mapping[str, torch.Tensor] | None) -> tuple:
        """The CPU values of the host-mirrored inputs: ``seq_lens_cpu`` (``None`` without one)
        and the host part's other keywords."""
        given = dict(host_inputs or {})
        named = [self._host_name] if self._host_name is not None else []
        expected = sorted([*named, *self._host_extra])
        if sorted(given) != expected:
            missing = [n for n in expected if n not in given]
            unknown = [n for n in given if n not in expected]
            raise ValueError(f"host_inputs: missing {missing}, unexpected {unknown}; expected "
                             f"exactly {expected} (the inputs registered with "
                             "host_mirror)")  # fmt: skip
        extra = {keyword: given[n] for n, keyword in self._host_extra.items()}
        return given.get(self._host_name) if named else None, extra

    # A bucket: its key (Bp here; a ragged runner's (T, Bp)), the requests it holds, and the
    # stage bound on its views.
    def _bucket_keys(self) -> tuple:
        return self.batch_sizes

    def _rows(self, key) -> int:
        return key

    def _bind_bucket(self, key) -> Stage:
        return self._stage_fn(types.MappingProxyType(self._views_of(key)))

    def _launch(self, key) -> None:
        if self.graphs:
            self._graphs[key].replay()
        else:
            self._buckets[key].launch()

    def _probe(self, raw: Mapping[str, torch.Tensor]) -> None:
        for name, spec in self._inputs.items():
            if spec.probe is not None:
                spec.probe(raw[name], label=f"runner input {name!r}")

    def _check_inputs(self, B: int, given: object) -> dict[str, torch.Tensor]:
        if not isinstance(given, Mapping):
            raise TypeError("inputs must be a mapping of name to tensor")
        names = [e[0] for e in self._expected]
        if len(given) != len(names) or any(n not in given for n in names):
            missing = [n for n in names if n not in given]
            unknown = [n for n in given if n not in names]
            raise ValueError(f"inputs: missing {missing}, unexpected {unknown}; expected exactly "
                             f"{names}")  # fmt: skip
        out = {}
        for name, dtype, per_request, row_shape in self._expected:
            t = given[name]
            label = f"inputs[{name!r}]"
            validate.tensor(label, t, dtypes=(dtype,), device=self.device, contiguous_last=False)
            if t.shape[0] != B * per_request or tuple(t.shape[1:]) != row_shape:
                shape = (B * per_request, *row_shape)
                raise ValueError(f"{label} must have shape {shape} (batch_size={B} x per_request="
                                 f"{per_request}), got {tuple(t.shape)}")  # fmt: skip
            out[name] = t if t.is_contiguous() else t.contiguous()
        return out

    def _pad(self, B: int, upto: int, raw: Mapping[str, torch.Tensor] | None) -> None:
        """Every static input: ``[:B]`` from ``raw`` (the engine's tensors, bound for this
        call), or as it is when ``raw`` is None (a persistent batch: the launch of rows
        ``[B, upto)`` is bound once); ``[B:upto]`` its pad. One launch for up to four inputs."""
        if raw is None:
            stage = self._pads.get((B, upto))
            if stage is None:
                stage = self._pads[(B, upto)] = self._bind_pad(B, upto, None)
            stage.launch()
        else:
            self._bind_pad(B, upto, raw).launch()

    def _bind_pad(self, B: int, upto: int, raw: Mapping[str, torch.Tensor] | None) -> Stage:
        pairs = []
        for name, spec in self._inputs.items():
            rows = spec.buffer[: upto * spec.per_request]
            if raw is None:  # keep rows [:B]: pad the tail only
                n = B * spec.per_request
                pairs.append((rows[:0], rows[n:], spec.pad))
            else:
                src = raw.get(name, spec.buffer[:0])  # capture: every row is padding
                pairs.append((src, rows, spec.pad))
        return bind_copy_pad_many(pairs)
