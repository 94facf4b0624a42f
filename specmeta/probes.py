"""Async probes: device-side NaN / Inf / out-of-range / page-alignment assertions (design §6).

A probe checks an input handed in from outside — token ids against the vocabulary, indices
against the pool, probabilities for NaN — without a host sync, so it can sit on a build path and
inside a captured CUDA graph. The kernels' own masks and status word (design §2.5) guard what
specmeta writes; probes guard what it is given.

* **Off by default**, and then a call returns before touching its arguments (well under 1 µs of
  host time; nothing is launched, nothing is validated). Turn them on with the environment
  variable ``SPECMETA_ASYNC_ASSERT=1`` (read at import) or :func:`enable`.
* **On a CUDA tensor** a probe launches a few small reductions and ``torch._assert_async``: the
  failure is a device-side assertion, reported at a later synchronisation, which leaves the
  CUDA context unusable (that is what a device assert is: stop before corrupted indices reach a
  kernel). The probe's ``label`` is passed as the assertion message; whether the device-side
  report shows it depends on the torch build, so give each probe a distinct label and rerun
  with ``CUDA_LAUNCH_BLOCKING=1`` to find it from the traceback.
* **On a CPU tensor** the check runs at once and raises :class:`ValueError` naming the label,
  the cause, how many elements failed and the first one.

A probe enabled while a graph is captured stays in that graph: enabling or disabling later does
not change captured graphs.

Examples
--------
>>> import specmeta.probes as probes
>>> probes.enable(True)
False
>>> probes.detect_oob(torch.tensor([3, 9]), 0, 8, label="token ids")
Traceback (most recent call last):
...
ValueError: probe 'token ids': 1 of 2 values outside [0, 8) (first: 9 at index 1)
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "enable",
    "enabled",
    "detect_nan",
    "detect_inf",
    "detect_oob",
    "detect_page_aligned",
]

_ENV = "SPECMETA_ASYNC_ASSERT"
_OFF = ("", "0", "false", "no", "off")

# Read on every call of every probe: a module global is the cheapest switch Python has.
_ENABLED: bool = os.environ.get(_ENV, "0").strip().lower() not in _OFF


def enable(flag: bool = True) -> bool:
    """Turn the probes on (``True``) or off (``False``); returns the previous setting.

    Graphs captured before the call keep the probes they were captured with.
    """
    global _ENABLED
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {type(flag).__name__}")
    previous, _ENABLED = _ENABLED, flag
    return previous


def enabled() -> bool:
    """Whether probes are on (``SPECMETA_ASYNC_ASSERT=1`` at import, or :func:`enable`)."""
    return _ENABLED


# --------------------------------------------------------------------------------------------
# The checks (only reached when enabled)
# --------------------------------------------------------------------------------------------
def _tensor(name: str, t: object, label: str, *, floating: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"probe {label!r}: {name} must be a torch.Tensor, got {type(t).__name__}")
    is_float = t.is_floating_point() or t.is_complex()
    if floating and not is_float:
        raise TypeError(f"probe {label!r}: {name} must be a floating tensor, got {t.dtype}")
    if not floating and (is_float or t.dtype == torch.bool):
        raise TypeError(f"probe {label!r}: {name} must be an integer tensor, got {t.dtype}")
    return t


def _int(name: str, value: object, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"probe {label!r}: {name} must be a host int, got {type(value).__name__}")
    return value


def _require(ok: torch.Tensor, values: torch.Tensor, label: str, cause: str) -> None:
    """Assert that every element of the bool tensor ``ok`` holds.

    On CUDA: ``torch._assert_async`` on ``ok.all()`` (no sync; capturable). On the CPU: raise
    ``ValueError`` now, naming the label, the cause and the first failing element.
    """
    if ok.device.type != "cpu":
        torch._assert_async(ok.all(), f"specmeta probe {label!r}: {cause}")
        return
    bad = (~ok).reshape(-1).nonzero()
    if bad.numel():
        first = int(bad[0])
        raise ValueError(
            f"probe {label!r}: {bad.numel()} of {ok.numel()} values {cause} "
            f"(first: {values.reshape(-1)[first].item()} at index {first})"
        )


def detect_nan(x: torch.Tensor, *, label: str = "detect_nan") -> None:
    """Assert that the floating tensor ``x`` (any shape) holds no NaN.

    Parameters
    ----------
    x : torch.Tensor
        Floating or complex, any shape (e.g. draft probabilities ``[B·K, V]``).
    label : str
        Names the probe in the failure message.

    Examples
    --------
    ``detect_nan(torch.tensor([0.5, nan]), label="draft probs")`` raises on the CPU:
    ``probe 'draft probs': 1 of 2 values are NaN (first: nan at index 1)``.
    """
    if not _ENABLED:
        return
    x = _tensor("x", x, label, floating=True)
    _require(~torch.isnan(x), x, label, "are NaN")


def detect_inf(x: torch.Tensor, *, label: str = "detect_inf") -> None:
    """Assert that the floating tensor ``x`` (any shape) holds no ±Inf (NaN is not Inf).

    Parameters
    ----------
    x : torch.Tensor
        Floating or complex, any shape.
    label : str
        Names the probe in the failure message.

    Examples
    --------
    ``detect_inf(torch.tensor([1.0, -inf]))`` raises on the CPU:
    ``probe 'detect_inf': 1 of 2 values are infinite (first: -inf at index 1)``.
    """
    if not _ENABLED:
        return
    x = _tensor("x", x, label, floating=True)
    _require(~torch.isinf(x), x, label, "are infinite")


def detect_oob(idx: torch.Tensor, lo: int, hi: int, *, label: str = "detect_oob") -> None:
    """Assert ``lo <= idx < hi`` for every element of the integer tensor ``idx``.

    Parameters
    ----------
    idx : torch.Tensor
        int8 … int64, any shape (token ids, ``req_pool_indices``, cache locations).
    lo, hi : int
        The half-open range ``[lo, hi)``, host ints (e.g. ``0, vocab_size`` or ``0, pool_size``).
    label : str
        Names the probe in the failure message.

    Examples
    --------
    ``detect_oob(torch.tensor([3, 9]), 0, 8)`` raises on the CPU:
    ``probe 'detect_oob': 1 of 2 values outside [0, 8) (first: 9 at index 1)``.
    """
    if not _ENABLED:
        return
    idx = _tensor("idx", idx, label, floating=False)
    lo, hi = _int("lo", lo, label), _int("hi", hi, label)
    if lo > hi:
        raise ValueError(f"probe {label!r}: lo={lo} must be <= hi={hi}")
    _require((idx >= lo) & (idx < hi), idx, label, f"outside [{lo}, {hi})")


def detect_page_aligned(idx: torch.Tensor, ps: int, *, label: str = "detect_page_aligned") -> None:
    """Assert that every element of the integer tensor ``idx`` is a multiple of ``ps``.

    Use it on slots that must start a page (a request's first slot, a branch region's start in
    layout B, allocator output in page units · ``ps``).

    Parameters
    ----------
    idx : torch.Tensor
        int8 … int64, any shape.
    ps : int
        Page size ≥ 1 (any positive integer).
    label : str
        Names the probe in the failure message.

    Examples
    --------
    ``detect_page_aligned(torch.tensor([32, 40]), 16)`` raises on the CPU:
    ``probe 'detect_page_aligned': 1 of 2 values not a multiple of 16 (first: 40 at index 1)``.
    """
    if not _ENABLED:
        return
    idx = _tensor("idx", idx, label, floating=False)
    ps = _int("ps", ps, label)
    if ps < 1:
        raise ValueError(f"probe {label!r}: ps must be >= 1, got {ps}")
    _require(torch.remainder(idx, ps) == 0, idx, label, f"not a multiple of {ps}")
