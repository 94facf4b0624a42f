"""How every specmeta kernel is launched: the compiled handle on CUDA, Triton's launch elsewhere.

``kernel[grid](**args)`` costs Triton tens of µs of host time per call: it binds the arguments,
builds a specialization key as strings, looks the kernel up, fetches the stream and packs the
launch metadata, every time. A specmeta launcher runs on every draft step, for a few µs of
device work, so that cost is the whole cost (design §2.7).

:class:`Launcher` keeps Triton's own launch for the first call of each specialization (which
compiles, or loads from Triton's cache, exactly as ``kernel[grid]`` does) and launches every
later call through the compiled kernel's own launcher, ``CompiledKernel.run``, with the raw
stream fetched in one C call. That is the handle Triton itself calls at the end of
``kernel[grid]``; nothing below it is re-implemented here.

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

import torch
import triton

__all__ = ["Launcher", "cdiv", "next_power_of_2"]

_I32_LOW, _I32_HIGH, _U64_LOW = -(2**31), 2**31, 2**63


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host grid sizes (``triton.cdiv`` is a constexpr function in recent
    Triton, and costs µs per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` (``n >= 1``; 0 for 0, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _active(hook) -> bool:
    """Whether a Triton launch hook would call anything (Triton 3.6 keeps an empty
    ``HookChain`` installed by default)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_installed() -> bool:
    """A launch hook (a profiler's) needs Triton's own launch path, which calls it."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return _active(getattr(runtime, "launch_enter_hook", None)) or _active(
        getattr(runtime, "launch_exit_hook", None)
    )


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

    def _key(self, values: list, options: tuple) -> tuple:
        """Triton's specialization of ``values`` (see the module docstring), as a tuple."""
        key = [options]
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

    def __call__(self, grid, /, *, num_warps: int | None = None, num_stages: int | None = None,
                 **args) -> None:  # fmt: skip
        """Launch on ``grid`` (a tuple of 1–3 ints) with every kernel argument by keyword."""
        options = {}
        if num_warps is not None:
            options["num_warps"] = num_warps
        if num_stages is not None:
            options["num_stages"] = num_stages
        if len(args) != len(self.names):
            self._bad_arguments(args)
        if not self._direct or _hooks_installed():
            if not all(n in args for n in self.names):
                self._bad_arguments(args)
            self.kernel[grid](**args, **options)
            return
        try:  # as many arguments as names: a missing name means a misspelt one
            values = [args[n] for n in self.names]
        except KeyError:
            self._bad_arguments(args)
        device = torch._C._cuda_getDevice()
        key = self._key(values, (device, num_warps, num_stages))
        handle = self._handles.get(key)
        if handle is None:
            # Triton's own launch compiles (or loads) this specialization and launches it.
            compiled = self.kernel[grid](**args, **options)
            self._handles[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = handle
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(grid[0], g1, g2, stream, function, metadata, None, None, None, *values)
