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
waits. An event a build, waited for a build later, would cost a driver call or two on every
build for a wait that almost never happens.

The turn itself is one compiled call where the host ops are built (:mod:`.host_ops`,
``ring_take``): the count, and on the builds that record or wait, the driver's own
``cuEventRecord``, ``cuEventQuery`` and ``cuEventSynchronize`` on torch's events, without the
microsecond each of torch's Python and C++ layers around them. A wait queries first and blocks
(with the GIL released) only while the device has not passed the event. Without the compiled
module the same schedule runs in Python on ``torch.cuda.Event``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..config import BufferSpec
from . import host_ops

__all__ = ["HostMirrorRing"]

_DRIVER_CALLS = ("cuEventRecord", "cuEventQuery", "cuEventSynchronize")


@functools.cache
def _driver() -> tuple[int, int, int] | None:
    """The addresses of the driver's event calls the compiled turn makes, or ``None`` where
    the driver library cannot be loaded by name (the ring then waits through torch)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in _DRIVER_CALLS)  # fmt: skip
    except (OSError, AttributeError):
        return None


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
    use_compiled : bool
        Take turns with the compiled ``ring_take`` where it can be built (default), else in
        Python; both follow the same schedule.

    Attributes
    ----------
    sets : tuple of dict of str to torch.Tensor
        The ``depth`` sets, in the order they are handed out.
    take : callable
        ``take() -> int``: the index in :attr:`sets` of this build's set, after the ring's
        record and wait (the call a builder makes on every build).
    turn : tuple or None
        ``(state, current_stream, device)``, the compiled turn's arguments, for a compiled
        call that takes the turn and goes on with the build's host work in the same call
        (``host_ops.c``, ``mirror_step``); ``None`` for the Python turn.
    """

    def __init__(self, specs: dict[str, BufferSpec], depth: int, device: torch.device, *,
                 use_compiled: bool = True):  # fmt: skip
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
        self._depth = depth
        self._every = max(1, depth // 2)  # builds between two events
        # Event m lives in events[m % len(events)]: it is waited for at build (m − 1)·E + depth,
        # before event m + len(events) is recorded at build (m + len(events))·E.
        count = depth // self._every + 2
        self._events = [torch.cuda.Event() for _ in range(count)] if cuda else []
        self._builds = 0  # sets handed out so far, by the Python turn
        self._index = (device.index if device.index is not None else torch.cuda.current_device()
                       ) if cuda else None  # fmt: skip
        self._stream: tuple = (None, None)  # (raw handle, torch.cuda.Stream) of the last record
        op = host_ops.compiled() if use_compiled else None
        driver = _driver() if cuda and op is not None else None
        self._state = None
        self.turn = None
        if op is not None and (driver is not None or not cuda):
            # [builds, depth, E, count, record, query, synchronize, event 0, ...] (host_ops.c)
            state = [0, depth, self._every, count, *(driver or (0, 0, 0))]
            for event in self._events:
                event.record(torch.cuda.current_stream(device))  # creates the CUDA event
                state.append(event.cuda_event)
            self._state = torch.tensor(state, dtype=torch.int64)
            raw = torch._C._cuda_getCurrentRawStream if cuda else None
            self.turn = (self._state.data_ptr(), raw, self._index)
            self.take = functools.partial(op.ring_take, *self.turn)
        else:
            self.take = self._take

    @property
    def compiled(self) -> bool:
        """Whether turns are taken by the compiled ``ring_take``."""
        return self._state is not None

    @property
    def slot(self) -> int | None:
        """Index of the set handed out last (``None`` before the first build)."""
        builds = int(self._state[0]) if self._state is not None else self._builds
        return (builds - 1) % self._depth if builds else None

    def next(self) -> dict[str, torch.Tensor]:
        """The set for this build: ``sets[take()]``."""
        return self.sets[self.take()]

    def _take(self) -> int:
        """The Python turn: build ``j`` takes set ``j % depth``. Every ``E``-th build first
        records the event that covers the ``E`` builds before it (their ``plan()`` copies), and
        a build whose set was last used by the first build of a covered group waits for that
        group's event."""
        j = self._builds
        if self._events:
            every, events = self._every, self._events
            if j % every == 0 and j:
                events[(j // every) % len(events)].record(self._current_stream())
            if j >= self._depth and (j - self._depth) % every == 0:
                # Returns at once unless the host is half a ring ahead of the device.
                events[((j - self._depth) // every + 1) % len(events)].synchronize()
        self._builds = j + 1
        return j % self._depth

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, its Python object made again only when the raw handle changes
        (``torch.cuda.current_stream()`` costs µs on every call)."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        handle, stream = self._stream
        if raw != handle:
            stream = torch.cuda.current_stream(self._index)
            self._stream = (raw, stream)
        return stream
