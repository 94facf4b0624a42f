"""How every specmeta kernel is launched: the compiled handle on CUDA, Triton's launch elsewhere.

``kernel[grid](**args)`` costs Triton tens of µs of host time per call: it binds the arguments,
builds a specialization key as strings, looks the kernel up, fetches the stream and packs the
launch metadata, every time. A specmeta launcher runs on every draft step, for a few µs of
device work, so that cost is the whole cost (design §2.7).

:class:`Launcher` keeps Triton's own launch for the first call of each specialization (which
compiles, or loads from Triton's cache, exactly as ``kernel[grid]`` does) and launches every
later call through the compiled kernel's own launcher, with the raw stream fetched in one C
call. That launcher is ``CompiledKernel.run``, the handle Triton itself calls at the end of
``kernel[grid]``; on Triton 3.6, for a kernel that needs no scratch memory, it is the C
function that ``run`` wraps (:func:`_launch_handle`). Nothing below Triton's C launcher is
re-implemented here.

**Correct for every argument.** Triton specializes a compiled kernel on its arguments: the
dtype of each pointer and whether it is 16-byte aligned; the width of each integer (32 or 64
bits) and, unless the kernel says ``do_not_specialize``, whether it equals 1 or divides by 16;
and the value of every ``constexpr``. :meth:`Launcher.__call__` computes exactly that key from
the arguments of each call and launches the handle compiled for it, so a misaligned view or an
integer that flips a specialization gets its own compiled kernel, never a wrong one
(``tests/kernels/test_launch.py``).

**Where the fast path is off.** Under the CPU interpreter (``TRITON_INTERPRET=1``) and
whenever a launch hook is installed (a profiler's ``launch_enter_hook``), every call takes
Triton's ordinary path.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch
import triton

from . import validate

__all__ = ["Launch", "LaunchPlans", "Launcher", "cdiv", "next_power_of_2"]

_I32_LOW, _I32_HIGH, _U64_LOW = -(2**31), 2**31, 2**63
# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the package is imported.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host grid sizes (``triton.cdiv`` is a constexpr function in recent
    Triton, and costs µs per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` (``n >= 1``; 0 for 0, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# Where Triton keeps its launch hooks: ``triton.knobs.runtime`` (3.4+), read on every call.
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)
# Triton 3.6+ keeps an empty ``HookChain`` installed by default: no hook.
_HOOK_CHAIN = getattr(getattr(triton, "knobs", None), "HookChain", None)


def _active(hook) -> bool:
    """Whether a Triton launch hook would call anything."""
    if hook is None or (hook.__class__ is _HOOK_CHAIN and not hook.calls):
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_installed() -> bool:
    """A launch hook (a profiler's) needs Triton's own launch path, which calls it. (Read on
    every launch: the usual case, two empty chains, is tested inline.)"""
    enter = getattr(_RUNTIME, "launch_enter_hook", None)
    leave = getattr(_RUNTIME, "launch_exit_hook", None)
    if enter.__class__ is _HOOK_CHAIN and leave.__class__ is _HOOK_CHAIN:
        return bool(enter.calls or leave.calls)
    return _active(enter) or _active(leave)


def _triton_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:  # a development build's version string
        return ()


# The Triton whose launcher layout _launch_handle reads, verified by the GPU tier.
_C_LAUNCH = _triton_version() == (3, 6)


def _launch_handle(compiled) -> tuple:
    """``(launch, head)`` of a compiled kernel: ``launch(gx, gy, gz, stream, *head, *args)``
    launches it on ``args`` (tensors or addresses, constexprs left out) with no launch hooks.

    ``CompiledKernel.run`` is a Python method that allocates the kernel's scratch memory (none
    for specmeta's kernels) and calls the launcher's C function. On Triton 3.6, whose launcher
    keeps that function as ``run.launch`` with the arguments ``(gx, gy, gz, stream, function,
    cooperative, pdl, global_scratch, profile_scratch, metadata, launch_metadata, enter_hook,
    exit_hook, *args)``, a kernel with no scratch memory is launched by that C function
    directly, a µs or two less per launch on the host. Every other case calls ``run``."""
    run = compiled.run
    if (
        _C_LAUNCH
        and callable(getattr(run, "launch", None))
        and getattr(run, "global_scratch_size", None) == 0
        and getattr(run, "profile_scratch_size", None) == 0
        and not getattr(run, "gsan_enabled", False)
    ):
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None)  # fmt: skip
        return run.launch, head
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


def _options(num_warps: int | None, num_stages: int | None) -> dict:
    """The launch options given (Triton's defaults for the rest)."""
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options


def _wide(v: int) -> str:
    return "u64" if v >= _U64_LOW else "i64"


def _key_function(kinds: tuple, values: list, pattern: int):
    """A function ``key(options, *values)`` returning the specialization key of ``values`` as
    one flat tuple, written out for the types of ``values`` (the first call's): per tensor its
    dtype and (unless ``do_not_specialize_on_alignment``) 16-byte alignment; per int its width
    and (unless ``do_not_specialize``) whether it is 1 and whether 16 divides it; per
    constexpr its value; a None slot has no entry (Triton compiles it as a constant); any other
    slot (bool, float) keeps its generic entry. ``pattern`` heads the key, so keys of different
    patterns never meet. It raises :class:`specmeta.validate.OtherTypes` when a call passes
    another type in a tensor, int or None slot."""
    args = [f"a{i}" for i in range(len(values))]
    guards, parts = [], [f"'fast{pattern}'", "options"]
    for a, v, (const, spec, align) in zip(args, values, kinds, strict=True):
        if const:
            parts.append(a)
        elif isinstance(v, torch.Tensor):
            guards.append(f"not isinstance({a}, _Tensor)")
            parts.append(f"{a}.dtype")
            if align:
                parts.append(f"{a}.data_ptr() & 15 == 0")
        elif v.__class__ is int:
            guards.append(f"{a}.__class__ is not int")
            parts.append(f"-2147483648 <= {a} < 2147483648 or _wide({a})")
            if spec:
                parts.extend((f"{a} == 1", f"{a} & 15 == 0"))
        elif v is None:
            guards.append(f"{a} is not None")
        else:
            parts.append(f"_other({a}, {spec}, {align})")
    body = f"    if {' or '.join(guards)}:\n        raise _OtherTypes\n" if guards else ""
    src = f"def key(options, {', '.join(args)}):\n{body}    return ({', '.join(parts)},)\n"
    scope = {"_Tensor": torch.Tensor, "_wide": _wide, "_other": _other,
             "_OtherTypes": validate.OtherTypes}  # fmt: skip
    exec(src, scope)  # noqa: S102 - code written above from the kernel's parameter kinds
    return scope["key"]


def _other(v, spec: bool, align: bool):
    """The generic key entry of one value whose slot is neither a tensor nor an int."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, align and v.data_ptr() & 15 == 0)
    if v.__class__ is int:
        wide = 0 if _I32_LOW <= v < _I32_HIGH else (2 if v >= _U64_LOW else 1)
        return (wide, v == 1, v & 15 == 0) if spec else wide
    return v if v is None or v.__class__ is bool else v.__class__


class Launcher:
    """Launch one ``@triton.jit`` kernel, by keyword: ``launcher(grid, name=value, ...)``.

    Parameters
    ----------
    kernel
        The ``@triton.jit`` function (a ``JITFunction``, or the interpreter's stand-in).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        # Under the interpreter the kernel is Triton's stand-in, with no parameters to bind and
        # no compiled handle: every call takes kernel[grid].
        params = getattr(kernel, "params", None)
        self._direct = params is not None
        names = [p.name for p in params] if params is not None else kernel.arg_names
        self.names = tuple(names)
        # (constexpr, specialized on value, specialized on alignment) of each parameter
        kinds = [
            (
                p.is_constexpr,
                not getattr(p, "do_not_specialize", False),
                not getattr(p, "do_not_specialize_on_alignment", False),
            )
            for p in params or ()
        ]
        self._kinds = tuple(kinds)
        self._handles: dict = {}
        # The key of a call: straight-line code per pattern of argument types (a launcher's
        # callers pass a few: a fused kernel's passes switched off with None), else generic.
        self._keys = validate.TypePatterns(
            lambda args, pattern: _key_function(self._kinds, args[1:], pattern),
            lambda options, *values: self._generic_key(list(values), options),
        )

    def _bad_arguments(self, args: dict) -> None:
        """Raise for arguments that are not exactly the kernel's (a launch path that only reads
        the names it knows would ignore a misspelt one)."""
        name = getattr(self.kernel, "__name__", "kernel")
        missing = [n for n in self.names if n not in args]
        unknown = [n for n in args if n not in self.names]
        raise TypeError(
            f"{name}: missing arguments {missing}, unexpected {unknown}; pass every parameter of "
            f"the kernel by keyword: {', '.join(self.names)}"
        )

    def _generic_key(self, values: list, options: tuple) -> tuple:
        """Triton's specialization of ``values`` (see the module docstring), for any values."""
        key = ["generic", options]
        for v, (const, spec, align) in zip(values, self._kinds, strict=True):
            if const:
                key.append(v)
            elif isinstance(v, torch.Tensor):
                key.append(v.dtype)
                key.append(align and v.data_ptr() & 15 == 0)
            elif v.__class__ is int:
                # Triton's integer types: i32, i64, or u64 for [2**63, 2**64).
                wide = 0 if _I32_LOW <= v < _I32_HIGH else (2 if v >= _U64_LOW else 1)
                key.append((wide, v == 1, v & 15 == 0) if spec else wide)
            else:  # bool, float, None: Triton's type of these depends on the Python type only
                key.append(v if v is None or v.__class__ is bool else v.__class__)
        return tuple(key)

    def _key(self, values: list, options: tuple) -> tuple:
        """The same specialization as :meth:`_generic_key`, computed by straight-line code
        written for the argument types of a call (which slots hold a tensor, an int or None)."""
        return self._keys(options, *values)

    def __call__(self, grid, /, *, num_warps: int | None = None, num_stages: int | None = None,
                 **args) -> Launch | None:  # fmt: skip
        """Launch on ``grid`` (a tuple of 1–3 ints) with every kernel argument by keyword.
        Returns the :class:`Launch` made through a compiled handle (for :class:`LaunchPlans`),
        or None where Triton's own path launched (the interpreter, a launch hook)."""
        if len(args) != len(self.names):
            self._bad_arguments(args)
        if not self._direct or _hooks_installed():
            if not all(n in args for n in self.names):
                self._bad_arguments(args)
            self.kernel[grid](**args, **_options(num_warps, num_stages))
            if _recording.launches is not None:
                _recording.launches.append(None)  # not replayable: no plan of this block
            return None
        try:  # as many arguments as names: a missing name means a misspelt one
            values = [args[n] for n in self.names]
        except KeyError:
            self._bad_arguments(args)
        device = torch._C._cuda_getDevice()
        key = self._key(values, (device, num_warps, num_stages))
        handle = self._handles.get(key)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if handle is None:
            # Triton's own launch compiles (or loads) this specialization and launches it.
            compiled = self.kernel[grid](**args, **_options(num_warps, num_stages))
            handle = self._handles[key] = _launch_handle(compiled)
        else:
            fn, head = handle
            stream = torch._C._cuda_getCurrentRawStream(device)
            fn(grid[0], g1, g2, stream, *head, *values)
        launch = Launch(handle, (grid[0], g1, g2), device, values)
        if _recording.launches is not None:
            _recording.launches.append(launch)
        return launch


class _Recording(threading.local):
    launches: list | None = None  # the class attribute is every new thread's starting value


_recording = _Recording()


@contextlib.contextmanager
def recording():
    """Collect the :class:`Launch` of every launch made in the block, on this thread (None for
    one that took Triton's own path): what a builder stores as the plan of a mode."""
    outer, _recording.launches = _recording.launches, []
    try:
        yield _recording.launches
    finally:
        _recording.launches = outer


class Launch:
    """One launch through a compiled handle: what :class:`LaunchPlans` replays."""

    __slots__ = ("handle", "grid", "device", "values")

    def __init__(self, handle: tuple, grid: tuple, device: int, values: list) -> None:
        self.handle, self.grid, self.device, self.values = handle, grid, device, values


class LaunchPlans:
    """The launches an op made for a call, replayed for every later call whose host-visible
    arguments are the same (design §2.7).

    An op's checks and grid sizing read only what the host sees of its arguments: each
    tensor's address, shape, strides, dtype and device, and each scalar. :meth:`signature`
    is exactly that tuple (with the current CUDA device, and whether a builder vouches for the
    tensors, see :func:`specmeta.validate.trusting`). Two calls with equal signatures pass the
    same checks and make the same launches, so a plan stores those launches with each tensor
    replaced by its address, and :meth:`replay` makes them again: no checks, no keywords, no
    specialization key, no tensor kept alive by the plan. Device values (lengths, indices) are
    read by the kernels on every launch, as they are without a plan.

    An op uses a plan only where the call's launches are all it does: every output is a
    buffer the caller passed (a call that allocates an output must not replay into the first
    call's allocation), and no argument is a host value the op reads (``seq_lens_cpu``). Off
    (None signatures) under the CPU interpreter; a launch hook (a profiler's) makes every call
    take the ordinary path again.
    """

    def __init__(self, size: int = 256) -> None:
        self._plans: dict = {}
        self._size = size
        self._sign = validate.Signer()
        self._found: tuple = (None, None)  # (signature, plan) of the last membership test

    def signature(self, *args) -> tuple | None:
        """The plan key of an op called with ``args``: the current CUDA device, whether a
        builder vouches for the tensors (:func:`specmeta.validate.trusting`) and a
        :class:`specmeta.validate.Signer` key of ``args``. None where plans are off, and while
        a builder records a plan of its own (:func:`recording`): that plan replays this call."""
        if _INTERPRETED or _recording.launches is not None or _hooks_installed():
            return None
        return self._sign((torch._C._cuda_getDevice(), validate.is_trusted()), *args)

    @staticmethod
    def key(*parts) -> tuple | None:
        """The plan key of hashable ``parts`` that already say everything the launches depend
        on (a builder's checked-input key and its mode's host integers); None where plans are
        off."""
        if _INTERPRETED or _hooks_installed():
            return None
        return (torch._C._cuda_getDevice(), *parts)

    def __contains__(self, sig: tuple | None) -> bool:
        plan = self._plans.get(sig) if sig is not None else None
        self._found = (sig, plan)  # the replay that follows looks it up no second time
        return plan is not None

    def replay(self, sig: tuple | None, check: Callable[[], None] | None = None) -> bool:
        """Make the launches stored for ``sig``; False (nothing done) when there are none.
        ``check``: a host check of a value the signature leaves out (a launcher's
        ``seq_lens_sum``), run before the launches when there are some; it raises to stop them."""
        found, plan = self._found
        if found is not sig:
            plan = self._plans.get(sig) if sig is not None else None
        self._found = (None, None)
        if plan is None:
            return False
        if check is not None:
            check()
        device, launches = plan
        stream = torch._C._cuda_getCurrentRawStream(device)
        for launch, g0, g1, g2, args in launches:
            launch(g0, g1, g2, stream, *args)
        return True

    def replay_key(self, *parts) -> bool:
        """:meth:`replay` of :meth:`key` ``(*parts)``, with no check: False (nothing done)
        where plans are off or none was stored for it."""
        if _INTERPRETED or _hooks_installed():
            return False
        return self.replay((torch._C._cuda_getDevice(), *parts))

    def store(self, sig: tuple | None, *launches: Launch | None) -> None:
        """Keep ``launches`` (the op's, in order) as the plan of ``sig``."""
        if not launches or sig is None:
            return
        device = torch._C._cuda_getDevice()  # the call's: every key holds it
        if any(x is None or x.device != device for x in launches):
            return
        if len(self._plans) >= self._size:
            self._plans.clear()
        self._plans[sig] = (device, tuple(
            (x.handle[0], *x.grid, (*x.handle[1], *(v.data_ptr() if isinstance(v, torch.Tensor)
                                                    else v for v in x.values)))
            for x in launches
        ))  # fmt: skip
