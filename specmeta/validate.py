"""Host-side argument checks shared by every launcher (style §9).

They read shapes, dtypes, strides and devices only — never device values — so they cost no sync.
Each raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong device, rank, shape or
capacity) naming the argument, with what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .status import default_status

INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] = INDEX_DTYPES,
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous_last: bool = True,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of one of ``dtypes``, rank ``ndim``, on ``device``."""
    try:  # the common case, every condition at once; any miss takes the checks below
        if (
            t.dtype in dtypes
            and (ndim is None or t.dim() == ndim)
            and (device is None or t.device == device)
            and (not contiguous_last or t.stride()[-1] == 1 or t.shape[-1] <= 1)
            and isinstance(t, torch.Tensor)
        ):
            return t
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        first = str(dtypes[0]).replace("torch.", "")
        raise TypeError(
            f"{name} must be {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}; "
            f"convert it with {name}.to(torch.{first})"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name} must have rank {ndim}, got shape {tuple(t.shape)}; see the launcher's "
            "docstring for its shape"
        )
    if device is not None and t.device != device and not same_device(t.device, device):
        raise ValueError(
            f"{name} must be on {device}, got {t.device}; pass every tensor of this call on "
            "one device"
        )
    if contiguous_last and t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension, got {t.stride()}; pass "
            f"{name}.contiguous()"
        )
    return t


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` → ``cuda:<current>``), so that tensors
    created on it compare equal to it."""
    d = torch.device(device)
    if d.index is None and d.type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """``cuda`` and ``cuda:<current>`` name the same device; so do ``cpu`` and ``cpu:0``."""

    def norm(d: torch.device | str) -> tuple[str, int]:
        d = torch.device(d)
        if d.index is not None:
            return d.type, d.index
        if d.type == "cuda" and torch.cuda.is_available():
            return d.type, torch.cuda.current_device()
        return d.type, 0

    return norm(a) == norm(b)


def length(name: str, t: torch.Tensor, expected: int) -> None:
    """Check that a rank-1 ``t`` has exactly ``expected`` elements."""
    if t.shape[0] != expected:
        raise ValueError(
            f"{name} must have {expected} elements, got shape {tuple(t.shape)}; its length "
            "must match the other inputs of this call"
        )


def at_least(name: str, have: int, need: int, what: str = "elements") -> None:
    """Capacity check before launch: ``need`` must not exceed ``have``."""
    if need > have:
        raise ValueError(
            f"{name} is too small: need {need} {what}, have {have}; allocate it from "
            "specmeta.plan_buffers(cfg) with a config that covers this batch"
        )


def positive(name: str, value: object, minimum: int = 1) -> int:
    """A Python int ≥ ``minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def status(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The status word a launch reports into: ``t`` (checked: ``int32 [1]`` on the launch
    device), or the device's :func:`specmeta.status.default_status` word when ``t`` is None.
    The one place of the rule "every launcher reports, with or without ``status=``"."""
    if t is None:
        return default_status(device)
    tensor("status", t, dtypes=(torch.int32,), ndim=1, device=device)
    length("status", t, 1)
    return t
