"""Check a host copy of per-list lengths against the device's, entry by entry (design §3, §3.5).

:mod:`~specmeta.kernels.host_lengths` compares what a host part read with the device lengths
through ``(n, Σ, max)``: enough for ``seq_lens_cpu``, whose stale copies differ in the sum. A
verify tree's ancestor counts are another matter: the host's ``kv_len = depth + 1`` comes from
the engine's copy of its node depths, the device's from the tree mask, and two nodes of
different depths swapped in the copy keep the sum and the maximum while both lists' host
lengths, and every offset between them, are wrong (FlashInfer's ``plan()`` would read the wrong
keys for both). So this check compares every length. It is ``B·N`` ints::

    slot = [seq, n, Σ, max, consumed, 0, 0, 0, len_0, …, len_{n−1}]   host memory (int64)
    seen = [seq read last, ticket]                                       device memory (int64)

    fresh              = slot.seq ≠ seen[0]
    STALE_HOST_LENGTHS   if fresh and (n > B or n > capacity
                                       or lengths[r] ≠ slot.len_r for some r < n)
    seen[0] = slot.consumed = slot.seq         by the last program, once every program read

with :func:`~specmeta.kernels.host_lengths.publish_host_lengths`' handshake: the host part
writes the lengths, ``n``, ``Σ``, ``max`` and then ``seq + 1`` only once the device consumed
what was there (:func:`publish_host_list_lengths`), so no check reads a slot half rewritten;
a host part that runs ahead of the device publishes nothing and its build goes unchecked.
Each program compares ``BLOCK`` lengths (one vector load from host memory, a round trip
each, run side by side rather than one after another); the last program to finish (a ticket
counted in ``seen[1]``, reset by that program) marks the slot consumed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, cdiv
from ..stage import Stage, launcher
from ._common import STALE_HOST_LENGTHS, or_status

__all__ = ["bind_check_host_list_lengths", "check_host_list_lengths",
           "check_host_list_lengths_ref", "publish_host_list_lengths", "host_list_slot"]  # fmt: skip

# Lengths one program compares: one 8 KB load of int64 from host memory.
_BLOCK = 1024
# The header's fields (those of host_lengths' slot), then the lengths from entry _HEAD.
SEQ, N, TOTAL, TOP, CONSUMED = range(5)
_HEAD = 8


def host_list_slot(capacity: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed slot for ``capacity`` lengths: ``[8 + capacity]`` int64, pinned for a CUDA
    ``device`` (its check reads it through unified addressing)."""
    slot = torch.zeros(_HEAD + validate.positive("capacity", capacity, 0), dtype=torch.int64)
    return slot.pin_memory() if torch.device(device).type == "cuda" else slot


def publish_host_list_lengths(slot: torch.Tensor, lengths: torch.Tensor) -> bool:
    """The host part's side: write ``lengths`` (a 1-D integer CPU tensor: the host mirror it
    hands ``plan()``), ``n``, ``Σ`` and ``max``, then ``seq + 1``, into ``slot`` when the
    device consumed what was there; returns whether it published. ``ValueError`` before any
    write when the slot has no room for them."""
    n = lengths.shape[0]
    if n > slot.shape[0] - _HEAD:
        raise ValueError(f"publish_host_list_lengths: {n} lengths, but the slot holds "
                         f"{slot.shape[0] - _HEAD}; make it with host_list_slot(capacity) for "
                         "the largest batch's B*N lists")  # fmt: skip
    seq = int(slot[SEQ])
    if int(slot[CONSUMED]) != seq:
        return False  # the check of the last lengths has not run yet: leave them
    slot[_HEAD : _HEAD + n].copy_(lengths)
    slot[N] = n
    slot[TOTAL] = int(lengths.sum()) if n else 0
    slot[TOP] = int(lengths.max()) if n else 0
    slot[SEQ] = seq + 1
    return True


@triton.jit(do_not_specialize=["B", "capacity", "programs"])
def _check_host_list_lengths_kernel(
    lengths_ptr,  # [≥ B] int32|int64 on the device: the lists' lengths
    slot_ptr,  # [8 + capacity] int64 in host memory: header, then the host's lengths
    seen_ptr,  # [2] int64 on the device: the last seq read, the ticket of this launch
    status_ptr,  # [1] int32
    B,  # lists the build owns
    capacity,  # lengths the slot holds
    programs,  # the grid's size
    BLOCK: tl.constexpr,
):
    """Grid ``(programs,)``: program ``p`` compares lengths ``p·BLOCK, … + BLOCK − 1``."""
    pid = tl.program_id(0)
    # Host memory, written between launches: read past any cache, the header in one load.
    field = tl.arange(0, 8)
    head = tl.load(slot_ptr + field, volatile=True)
    seq = tl.sum(tl.where(field == 0, head, 0), axis=0)
    n = tl.sum(tl.where(field == 1, head, 0), axis=0)
    fresh = seq != tl.load(seen_ptr, volatile=True)
    count = tl.where(fresh, tl.minimum(tl.minimum(n, B), capacity), 0)
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    read = r < count
    want = tl.load(slot_ptr + 8 + r, mask=read, other=0, volatile=True)
    got = tl.load(lengths_ptr + r, mask=read, other=0).to(tl.int64)
    differ = tl.max((read & (got != want)).to(tl.int32), axis=0) != 0
    stale = fresh & (n >= 0) & ((n > B) | (n > capacity) | differ)
    tl.atomic_or(status_ptr, STALE_HOST_LENGTHS, mask=stale)
    # Every program has read seen[0] before it takes its ticket; the last one marks the slot
    # consumed and resets the ticket for the next launch.
    ticket = tl.atomic_add(seen_ptr + 1, 1, sem="acq_rel")
    last = ticket == programs - 1
    tl.store(seen_ptr, seq, mask=last)
    tl.store(seen_ptr + 1, ticket * 0, mask=last)
    tl.store(slot_ptr + 4, seq, mask=last)  # consumed: the host may publish again


_LAUNCHER = Launcher(_check_host_list_lengths_kernel)


def _check(lengths, slot, seen, status):
    validate.tensor("lengths", lengths, ndim=1)
    device = lengths.device
    validate.tensor("slot", slot, dtypes=(torch.int64,), ndim=1)
    validate.at_least("slot", slot.shape[0], _HEAD, "entries (the 8-entry header)")
    if device.type == "cuda" and not (slot.is_cuda or slot.is_pinned()):
        raise ValueError("check_host_list_lengths: slot must be pinned host memory (or device "
                         "memory) for a CUDA launch, got pageable CPU memory; make it with "
                         "host_list_slot(capacity, device)")  # fmt: skip
    validate.tensor("seen", seen, dtypes=(torch.int64,), ndim=1, device=device)
    validate.at_least("seen", seen.shape[0], 2, "entries (the last seq read and a ticket)")
    return validate.status(status, device)


def bind_check_host_list_lengths(lengths: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor,
                                 *, status: torch.Tensor | None = None) -> Stage:  # fmt: skip
    """Bind once: the check of the lengths a host part published in ``slot`` against the
    device's ``lengths``, entry by entry.

    Parameters
    ----------
    lengths : torch.Tensor
        ``[B]`` int32 or int64, the device lengths of the build's lists (a tree verify's
        ``kv_len``, ``B·N`` of them).
    slot : torch.Tensor
        ``[8 + capacity]`` int64 (:func:`host_list_slot`): ``seq, n, Σ, max, consumed``, 3
        unused, then the host's lengths, written by :func:`publish_host_list_lengths`;
        pinned host memory for a CUDA launch.
    seen : torch.Tensor
        ``[≥ 2]`` int64 on the launch device, zeroed once: the last ``seq`` checked and the
        launch's ticket (0 between launches).
    status : torch.Tensor, optional
        ``int32 [1]``: ``STALE_HOST_LENGTHS`` when fresh lengths differ from ``lengths`` (or
        there are more of them than ``B`` or the slot holds).

    Returns
    -------
    Stage
        No result (``None``). Grid ``(max(1, ceil(min(B, capacity) / 1024)),)``; no host
        sync.

    Examples
    --------
    ``lengths=[1, 2, 3, 2]``, published ``[1, 2, 3, 2]``: fine; published ``[1, 3, 2, 2]``
    (two nodes swapped: the same sum and maximum): ``STALE_HOST_LENGTHS``.
    """
    status = _check(lengths, slot, seen, status)
    B, capacity = lengths.shape[0], slot.shape[0] - _HEAD
    programs = max(1, cdiv(min(B, capacity), _BLOCK))
    launch = _LAUNCHER.bind((programs,), lengths_ptr=lengths, slot_ptr=slot, seen_ptr=seen,
                            status_ptr=status, B=B, capacity=capacity, programs=programs,
                            BLOCK=_BLOCK, num_warps=4)  # fmt: skip
    return Stage([launch])


check_host_list_lengths = launcher(bind_check_host_list_lengths)
check_host_list_lengths.kernels = (_check_host_list_lengths_kernel,)  # for specmeta.registry


def check_host_list_lengths_ref(lengths: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor,
                                *, status: torch.Tensor | None = None) -> None:  # fmt: skip
    """Pure-torch :func:`check_host_list_lengths` (syncs)."""
    status = _check(lengths, slot, seen, status)
    seq, n = int(slot[SEQ]), int(slot[N])
    if seq != int(seen[0]):
        B, capacity = lengths.shape[0], slot.shape[0] - _HEAD
        count = max(min(n, B, capacity), 0)
        host = slot[_HEAD : _HEAD + count].to(lengths.device)
        differ = not torch.equal(lengths[:count].to(torch.int64), host)
        if n >= 0 and (n > B or n > capacity or differ):
            or_status(status, int(STALE_HOST_LENGTHS))
    seen[0] = seq
    slot[CONSUMED] = seq
