"""Host mirrors that an engine running ahead of the device can hand to ``plan()`` safely.

FlashInfer's ``plan()`` reads its index pointers on the host and, for pinned host tensors, also
queues ``copy(non_blocking=True)`` of them to the device. That copy reads the host memory when
the stream reaches it, not when ``plan()`` returns. An engine whose CPU runs an iteration ahead
(an overlap scheduler) builds iteration ``i + 1`` before the device has run iteration ``i``'s
copies; had the builder rewritten the same host buffer, the copy would read ``i + 1``'s values.

:class:`HostMirrorRing` holds ``depth`` sets of the mirrors and hands them out in turn: build
``j`` gets set ``j % depth``. A set is handed out again only once the stream has passed every
call queued after its last use. To prove that, the ring records an event on the current stream,
behind whatever was queued since (the ``plan()`` of the sets just used), at the start of every
``E = max(1, depth // 2)``-th build; event ``m``, recorded at build ``m·E``, covers builds
``(m − 1)·E … m·E − 1``. Build ``j ≥ depth`` reuses the set of build ``j − depth``, so the first
build of each covered group waits for its event (a build later is covered by the same event).
The schedule is fixed by ``j``, so a build that neither records nor waits costs a counter and a
modulo. The wait is on the host and returns at once unless the host is about ``depth / 2``
builds ahead of the device; a CUDA-graph replay or an engine in step with its device never
waits. An event a build, waited for a build later, would cost a call or two into the driver
on every build for a wait that almost never happens.

The turn runs in Python on torch's public event API: ``torch.cuda.Event.record`` on
``torch.cuda.current_stream()`` for a build that records, and for a build that waits
``Event.query()``, then ``Event.synchronize()`` only while the device has not passed the event.
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

    Attributes
    ----------
    sets : tuple of dict of str to torch.Tensor
        The ``depth`` sets, in the order they are handed out.
    builds : int
        Sets handed out so far.
    """

    def __init__(self, specs: dict[str, BufferSpec], depth: int, device: torch.device):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mirror_depth must be an int >= 1, got {depth!r}")
        cuda = device.type == "cuda"
        self.sets = tuple(
            {
                name: spec.allocate("cpu").pin_memory() if cuda else spec.allocate("cpu")
                for name, spec in specs.items()
            }
            for _ in range(depth)
        )
        self.builds = 0
        self._depth = depth
        self._every = max(1, depth // 2)  # builds between two events
        # Event m lives in events[m % len(events)]: it is waited for at build (m − 1)·E + depth,
        # before event m + len(events) is recorded at build (m + len(events))·E.
        count = depth // self._every + 2
        self._events = [torch.cuda.Event() for _ in range(count)] if cuda else []
        self._device = device if not cuda or device.index is not None else torch.device(
            "cuda", torch.cuda.current_device())  # fmt: skip

    @property
    def slot(self) -> int | None:
        """Index of the set handed out last (``None`` before the first build)."""
        return (self.builds - 1) % self._depth if self.builds else None

    def next(self) -> dict[str, torch.Tensor]:
        """The set for this build: ``sets[take()]``."""
        return self.sets[self.take()]

    def take(self) -> int:
        """This build's turn: :meth:`claim`, then :meth:`advance`."""
        slot = self.claim()
        self.builds += 1
        return slot

    def advance(self) -> None:
        """End the turn :meth:`claim` began: the next build takes the next set."""
        self.builds += 1

    def claim(self) -> int:
        """The set of build ``j`` (``builds``), ``j % depth``, its index in :attr:`sets`, safe
        to write once this returns; the turn ends with :meth:`advance` (a build refused before
        it takes no turn, and claiming again is the same claim). Every ``E``-th build first
        records the event that covers the ``E`` builds before it (their ``plan()`` copies; a
        second record of it covers them too), and a build whose set was last used by the first
        build of a covered group waits for that group's event."""
        j = self.builds
        events = self._events
        if events:
            every = self._every
            if j % every == 0 and j:
                events[(j // every) % len(events)].record(self._current_stream())
            if j >= self._depth and (j - self._depth) % every == 0:
                event = events[((j - self._depth) // every + 1) % len(events)]
                if not event.query():  # the host is half a ring ahead of the device
                    event.synchronize()
        return j % self._depth

    def _current_stream(self):
        """The stream a build's ``plan()`` copies are queued on: the current one of the
        ring's device."""
        return torch.cuda.current_stream(self._device)
