"""How every specmeta kernel is launched: bound once through Triton's own handle (design §2.7).

:meth:`Launcher.bind` asks Triton for the compiled kernel of one call's arguments with
``JITFunction.warmup`` (Triton's own specialization and cache; it launches nothing). The
:class:`Launch` it returns holds that ``CompiledKernel``, the grid and the argument tensors
themselves, and launches with ``CompiledKernel.run``, the call Triton makes at the end of
``kernel[grid](...)``, on the stream Triton's driver names current. Under the CPU interpreter
a launch is ``kernel[grid](...)``; while a launch hook is installed (a profiler's), a bound
launch goes through ``CompiledKernel[grid]``, which calls the hooks.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.runtime import driver

__all__ = ["Launch", "Launcher", "cdiv", "check_device", "interpreted", "interpreter_problem",
           "next_power_of_2"]  # fmt: skip


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host grid sizes (``triton.cdiv`` is a constexpr function in recent
    Triton, and costs µs per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` (``n >= 1``; 0 for 0, as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was decorated under Triton's CPU interpreter (it has no compiled
    handle then: every launch is ``kernel[grid](...)`` on CPU tensors)."""
    return not hasattr(kernel, "warmup") or not hasattr(kernel, "device_caches")


# Where Triton keeps its launch hooks (``triton.knobs.runtime``, Triton 3.4+).
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooked() -> bool:
    """Whether a launch hook is installed: Triton 3.6+ keeps empty hook chains by default,
    which call nothing."""
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(_RUNTIME, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Launch:
    """One kernel launch bound to its arguments: ``launch()`` makes it again.

    Made by :meth:`Launcher.bind`. It holds Triton's ``CompiledKernel`` for the arguments, the
    grid, and the arguments in the kernel's parameter order (tensors, not their addresses: what
    the launch points at lives as long as the launch).
    """

    __slots__ = ("compiled", "grid", "args", "device", "_run", "_tail")

    def __init__(self, compiled, grid: tuple[int, int, int], args: tuple, device: int) -> None:
        self.compiled, self.grid, self.args, self.device = compiled, grid, args, device
        self._run = compiled.run  # loads the module on the first use
        # CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
        # enter_hook, exit_hook, *args): what Triton's own launch passes (no metadata and no
        # hooks when none is installed).
        self._tail = (compiled.function, compiled.packed_metadata, None, None, None, *args)

    def __call__(self) -> None:
        if _hooked():
            self.compiled[self.grid](*self.args)  # Triton's path, which calls the hooks
            return
        gx, gy, gz = self.grid
        self._run(gx, gy, gz, driver.active.get_current_stream(self.device), *self._tail)


class Launcher:
    """Binds launches of one ``@triton.jit`` kernel, by keyword.

    Parameters
    ----------
    kernel
        The ``@triton.jit`` function (a ``JITFunction``, or the interpreter's stand-in).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.names = tuple(p.name for p in params) if params is not None else kernel.arg_names
        self._name_set = frozenset(self.names)

    def bind(self, grid, /, *, num_warps: int | None = None, num_stages: int | None = None,
             **args) -> Launch | functools.partial:  # fmt: skip
        """The launch of ``grid`` (1–3 ints) with every kernel argument by keyword, bound:
        calling it launches. Triton compiles (or loads) the kernel for these arguments here,
        if it has not already; nothing is launched."""
        if args.keys() != self._name_set:
            name = getattr(self.kernel, "__name__", "kernel")
            missing = [n for n in self.names if n not in args]
            unknown = [n for n in args if n not in self.names]
            raise TypeError(
                f"{name}: missing arguments {missing}, unexpected {unknown}; pass "
                f"every parameter of the kernel by keyword: {', '.join(self.names)}"
            )
        options = {}
        if num_warps is not None:
            options["num_warps"] = num_warps
        if num_stages is not None:
            options["num_stages"] = num_stages
        if interpreted(self.kernel):
            problem = _interpreter_problem_here()
            if problem is not None:
                raise RuntimeError(f"{getattr(self.kernel, '__name__', 'kernel')}: {problem}")
            return functools.partial(self.kernel[grid], **args, **options)
        full = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        compiled = self.kernel.warmup(grid=full, **args, **options)
        device = driver.active.get_current_device()
        return Launch(compiled, full, tuple(map(args.__getitem__, self.names)), device)

    def __call__(self, grid, /, **kwargs) -> Launch | functools.partial:
        """Bind and launch at once (an eager call); returns the launch."""
        launch = self.bind(grid, **kwargs)
        launch()
        return launch


def _interpreting() -> bool:
    """Whether Triton decorates kernels for its CPU interpreter, as Triton itself reads it."""
    knob = getattr(_RUNTIME, "interpret", None)
    if knob is not None:
        return bool(knob)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(where: str, device: torch.device) -> None:
    """Raise, naming ``where``, when kernels cannot run on ``device`` in this process: a CUDA
    device without CUDA, or the CPU while Triton's interpreter is off."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{where}: device {device} was asked for, but this torch sees no CUDA GPU "
            f"(torch {torch.__version__}, cuda {torch.version.cuda}); pass device='cpu' with "
            "TRITON_INTERPRET=1 set before importing specmeta, or run on a machine with a GPU"
        )
    if device.type == "cpu" and not _interpreting():
        raise ValueError(
            f"{where}: device cpu needs Triton's interpreter, which is off; set "
            "TRITON_INTERPRET=1 in the environment before importing specmeta (kernels are "
            "compiled for a GPU otherwise)"
        )
    if device.type == "cpu" and (problem := interpreter_problem()) is not None:
        raise ValueError(f"{where}: device cpu: {problem}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device {device} is not supported; pass 'cuda' or 'cpu'")


def _release(version: str) -> tuple[int, ...]:
    """``"3.6.0"`` → ``(3, 6)``: the major and minor numbers of a version string."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


@functools.cache
def _interpreter_problem_here() -> str | None:
    """:func:`interpreter_problem` of this process, read once (a bind under the interpreter
    asks on every call)."""
    return interpreter_problem()


def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run specmeta's kernels in this environment, or
    ``None``. Triton before 3.7 turns a loop bound derived from ``tl.program_id`` into an int
    through a one-element array, which NumPy 2.4 refuses."""
    import numpy

    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s CPU interpreter cannot run specmeta's kernels with "
            f"NumPy {numpy.__version__} (it turns one-element arrays into loop bounds, which "
            "NumPy 2.4 refuses); install triton>=3.7, or numpy<2.4"
        )
    return None
