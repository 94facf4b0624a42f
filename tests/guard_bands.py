"""Guard bands and poisoned outputs (style §13).

An output is carved out of a larger buffer whose margins hold a canary; tests assert the canary
survives (nothing was written outside the output) and the output is poisoned first (an unwritten
element shows).
"""

from __future__ import annotations

import torch

CANARY = -0x5A5A5A5  # no valid slot, page, offset or length
POISON = -0x3C3C3C3  # distinct from the canary: tells "unwritten" from "overran"


class Guarded:
    """A tensor of ``shape`` inside a buffer with ``margin`` canary elements on every side of
    its flattened storage (rows keep their stride, so a row overrun hits the canary too)."""

    def __init__(self, shape, dtype, device, margin: int = 64, poison: int = POISON):
        self.shape = tuple(int(s) for s in shape)
        numel = 1
        for s in self.shape:
            numel *= s
        self.margin = margin
        self.storage = torch.full((numel + 2 * margin,), CANARY, dtype=dtype, device=device)
        self.view = self.storage[margin : margin + numel].view(self.shape)
        self.view.fill_(poison)

    def assert_intact(self, name: str = "output") -> None:
        m = self.margin
        for part, label in (
            (self.storage[:m], "before"),
            (self.storage[self.storage.numel() - m :], "after"),
        ):
            bad = (part != CANARY).nonzero()
            if bad.numel():
                raise AssertionError(
                    f"{name}: canary overwritten {label} the buffer at margin offsets {bad.flatten()[:8].tolist()}"
                )


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Exact equality (style §10); the message names the first mismatching coordinates."""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a, e = actual.cpu(), expected.cpu().to(actual.dtype)
    if torch.equal(a, e):
        return
    diff = (a != e).nonzero()
    first = [tuple(x) for x in diff[:5].tolist()]
    shown = ", ".join(f"{c}: got {a[c].item()} want {e[c].item()}" for c in first)
    raise AssertionError(f"{name}: {diff.shape[0]} mismatches; first {shown}")
