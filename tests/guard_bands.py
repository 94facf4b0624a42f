"""Guard bands and poisoned outputs (style §13).

An output is carved out of a larger buffer whose margins hold a canary; tests assert the canary
survives (nothing was written outside the output) and the output is poisoned first (an unwritten
element shows).
"""

from __future__ import annotations

import math

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


class GuardedPool:
    """A ``[P, *row_shape]`` buffer carved from a byte storage of random bytes: ``margin`` rows
    before and after and ``pad`` elements after every row are canaries that must survive."""

    def __init__(self, P, row_shape, dtype, device, gen, *, margin=2, pad=0):
        elsize = torch.empty((), dtype=dtype).element_size()
        row = math.prod(row_shape)
        stride = row + pad
        total = (P + 2 * margin) * stride
        self.bytes = torch.randint(0, 256, (total * elsize,), generator=gen, dtype=torch.uint8)
        self.bytes = self.bytes.to(device)
        self.before = self.bytes.clone()
        inner = [math.prod(row_shape[i + 1 :]) for i in range(len(row_shape))]
        self.view = self.bytes.view(dtype).as_strided((P, *row_shape), (stride, *inner),
                                                      margin * stride)  # fmt: skip
        keep = torch.ones((P + 2 * margin, stride * elsize), dtype=torch.bool)
        keep[margin : margin + P, : row * elsize] = False  # the rows themselves may change
        self.canary = keep.flatten().to(device)

    def assert_intact(self, name):
        bad = (self.bytes != self.before) & self.canary
        assert not bool(bad.any()), (
            f"{name}: guard bytes overwritten at {bad.nonzero()[:8].flatten().tolist()}"
        )

    def rows(self):
        """``[P, row bytes]`` uint8 view of the rows."""
        t = self.view
        return t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1)).view(torch.uint8)
