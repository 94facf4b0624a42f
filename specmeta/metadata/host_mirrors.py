"""Host mirrors that an engine running ahead of the device can hand to ``plan()`` safely.

FlashInfer's ``plan()`` reads its index pointers on the host and, for pinned host tensors, also
queues ``copy(non_blocking=True)`` of them to the device. That copy reads the host memory when
the stream reaches it, not when ``plan()`` returns. An engine whose CPU runs an iteration ahead
(an overlap scheduler) builds iteration ``i + 1`` before the device has run iteration ``i``'s
copies; had the builder rewritten the same host buffer, the copy would read ``i + 1``'s values.

:class:`HostMirrorRing` holds ``depth`` sets of the mirrors and hands them out in turn. A set is
handed out again only once the stream has passed every call queued after its last use. To
prove that, the ring records an event on the current stream, behind whatever was queued since
(the ``plan()`` of the sets just used), once every ``depth // 2`` builds, and a set whose
event has not been seen complete is reused only after waiting for it (once per event, however
many sets it covers). The wait is on the host and
happens only when the host is about ``depth / 2`` builds ahead of the device; a CUDA-graph
replay or an engine in step with its device never waits. An event a build, waited for a build
later, would cost a driver call or two on every build for a wait that almost never happens.
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
        Sets in the ring (≥ 1). The host may run ``depth − max(1, depth // 2)`` builds ahead
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
        self._every = max(1, depth // 2)  # builds between two events
        # Event n is events[n % depth]: records come at most one a build, so an event is
        # recorded again only after every set it covered has been handed out again.
        self._events = [torch.cuda.Event() for _ in range(depth)] if self._cuda else []
        self._recorded = 0  # events recorded so far; event n lives in events[n % depth]
        self._waited = [0] * depth  # per event slot: the last event n seen complete there
        self._covered = [0] * depth  # per set: the event behind its last use (0: none needed)
        self._uncovered: list[int] = []  # sets handed out since the last event
        self._current: int | None = None
        self._device = device
        self._stream: tuple = (None, None)  # (raw handle, torch.cuda.Stream) of the last record

    @property
    def slot(self) -> int | None:
        """Index of the set handed out last (``None`` before the first build)."""
        return self._current

    def next(self) -> dict[str, torch.Tensor]:
        """The set for this build. Every ``depth // 2`` builds, the sets handed out since the
        last event are covered by a new one, recorded behind the work queued on the current
        stream (their ``plan()`` copies)."""
        current = self._current
        slot = 0 if current is None else (current + 1) % len(self._sets)
        if self._cuda:
            if current is not None:
                self._uncovered.append(current)
                if len(self._uncovered) >= self._every or slot in self._uncovered:
                    self._record()
            n, at = self._covered[slot], self._covered[slot] % len(self._events)
            if n and self._waited[at] != n:
                # Returns at once unless the host is half a ring ahead of the device.
                self._events[at].synchronize()
                self._waited[at] = n
        self._current = slot
        return self._sets[slot]

    def _record(self) -> None:
        """Cover every set handed out since the last event with a new one."""
        self._recorded += 1
        self._events[self._recorded % len(self._events)].record(self._current_stream())
        for s in self._uncovered:
            self._covered[s] = self._recorded
        self._uncovered.clear()

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, its Python object made again only when the raw handle changes
        (``torch.cuda.current_stream()`` costs µs on every call)."""
        index = (
            self._device.index if self._device.index is not None else torch.cuda.current_device()
        )
        raw = torch._C._cuda_getCurrentRawStream(index)
        handle, stream = self._stream
        if raw != handle:
            stream = torch.cuda.current_stream(self._device)
            self._stream = (raw, stream)
        return stream
