"""Host mirrors that an engine running ahead of the device can hand to ``plan()`` safely.

FlashInfer's ``plan()`` reads its index pointers on the host and, for pinned host tensors, also
queues ``copy(non_blocking=True)`` of them to the device. That copy reads the host memory when
the stream reaches it, not when ``plan()`` returns. An engine whose CPU runs an iteration ahead
(an overlap scheduler) builds iteration ``i + 1`` before the device has run iteration ``i``'s
copies; had the builder rewritten the same host buffer, the copy would read ``i + 1``'s values.

:class:`HostMirrorRing` holds ``depth`` sets of the mirrors and hands them out in turn. A set is
handed out again only once the stream has passed every call queued after its last use: when
the next set is taken, an event is recorded on the current stream, behind whatever was queued
since (the ``plan()`` of the set just used), and the set is reused only after that event has
completed. The wait is on the host and happens only when the host is ``depth`` builds ahead of
the device; a CUDA-graph replay or an engine in step with its device never waits.
"""

from __future__ import annotations

import torch

from ..config import BufferSpec

__all__ = ["HostMirrorRing"]


class HostMirrorRing:
    """``depth`` sets of host buffers, one set per build, each reused only when safe.

    Parameters
    ----------
    specs : dict of str to BufferSpec
        The host buffers of one set, by name.
    depth : int
        Sets in the ring (≥ 1). With ``depth`` sets the host may run ``depth − 1`` builds ahead
        of the device before a build waits.
    device : torch.device
        The builder's device: buffers are pinned and the ring waits on events only for CUDA.
    """

    def __init__(self, specs: dict[str, BufferSpec], depth: int, device: torch.device):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mirror_depth must be an int >= 1, got {depth!r}")
        self._cuda = device.type == "cuda"
        self._sets = [
            {
                name: spec.allocate("cpu").pin_memory() if self._cuda else spec.allocate("cpu")
                for name, spec in specs.items()
            }
            for _ in range(depth)
        ]
        # One event per set, recorded when the set is released and waited on before reuse.
        self._events = [torch.cuda.Event() for _ in range(depth)] if self._cuda else []
        self._pending = [False] * depth
        self._current: int | None = None
        self._device = device
        self._stream: tuple = (None, None)  # (raw handle, torch.cuda.Stream) of the last record

    @property
    def slot(self) -> int | None:
        """Index of the set handed out last (``None`` before the first build)."""
        return self._current

    def next(self) -> dict[str, torch.Tensor]:
        """The set for this build. The set handed out last is released behind the work queued
        on the current stream since (its ``plan()`` copies)."""
        current = self._current
        if current is not None and self._cuda:
            self._events[current].record(self._current_stream())
            self._pending[current] = True
        slot = 0 if current is None else (current + 1) % len(self._sets)
        if self._pending[slot]:
            # Returns at once unless the host is a whole ring ahead of the device.
            self._events[slot].synchronize()
            self._pending[slot] = False
        self._current = slot
        return self._sets[slot]

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, its Python object made again only when the raw handle changes
        (``torch.cuda.current_stream()`` costs µs on every call)."""
        index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(index)
        handle, stream = self._stream
        if raw != handle:
            stream = torch.cuda.current_stream(self._device)
            self._stream = (raw, stream)
        return stream
