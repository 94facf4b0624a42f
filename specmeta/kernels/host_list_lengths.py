"""Check a host copy of per-list lengths against the device's, entry by entry (design §3, §3.5).

:mod:`~specmeta.kernels.host_lengths` compares what a host part read with the device lengths
through ``(n, Σ, max)``: enough for ``seq_lens_cpu``, whose stale copies differ in the sum. A
verify tree's ancestor counts are another matter: the host's ``kv_len = depth + 1`` comes from
the engine's copy of its node depths, the device's from the tree mask, and two nodes of
different depths swapped in the copy keep the sum and the maximum while both lists' host
lengths, and every offset between them, are wrong (FlashInfer's ``plan()`` would read the wrong
keys for both). So this check compares every length. It is ``B·N`` ints::

    slot = [seq, n, Σ, max, consumed, 0, 0, 0, len_0, …, len_{n−1}]   host memory (int64)
    seen                                                                 device memory: last seq

    fresh              = slot.seq ≠ seen
    STALE_HOST_LENGTHS   if fresh and (n > B or n > capacity
                                       or lengths[r] ≠ slot.len_r for some r < n)
    seen = slot.consumed = slot.seq            afterwards

with :func:`~specmeta.kernels.host_lengths.publish_host_lengths`' handshake: the host part
writes the lengths, ``n``, ``Σ`` and ``max``, then ``seq + 1``, only once the device consumed
what was there (:func:`publish_host_list_lengths`), so no check reads a slot half rewritten; a
host part that runs ahead of the device publishes nothing and its build goes unchecked.

One program reads the lengths in loads of 4096 (``ld.cv``: host memory the host rewrites
between launches is fetched again, never served from a cache). On an H200 a fresh check of
16384 lengths took about 24 µs of a graph replay, against 17 µs for ``host_lengths``' sum
and maximum of the same lengths, timed the same way; programs side by side were slower
(their header reads and the hand-off of ``seen`` cost more than the loads they split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher
from ..stage import Stage, launcher
from ._common import STALE_HOST_LENGTHS, or_status

__all__ = ["bind_check_host_list_lengths", "check_host_list_lengths",
           "check_host_list_lengths_ref", "publish_host_list_lengths", "host_list_slot"]  # fmt: skip

# Lengths per load from host memory (32 KB of int64): fewer, larger round trips over the bus.
_BLOCK = 4096
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


@triton.jit(do_not_specialize=["B", "capacity"])
def _check_host_list_lengths_kernel(
    lengths_ptr,  # [≥ B] int32|int64 on the device: the lists' lengths
    slot_ptr,  # [8 + capacity] int64 in host memory: header, then the host's lengths
    seen_ptr,  # [1] int64 on the device: the last seq read
    status_ptr,  # [1] int32
    B,  # lists the build owns
    capacity,  # lengths the slot holds
    BLOCK: tl.constexpr,
):
    # Host memory, written between launches: the header in one load past any cache.
    field = tl.arange(0, 8)
    head = tl.load(slot_ptr + field, volatile=True)
    seq = tl.sum(tl.where(field == 0, head, 0), axis=0)
    n = tl.sum(tl.where(field == 1, head, 0), axis=0)
    fresh = seq != tl.load(seen_ptr)
    count = tl.where(fresh, tl.minimum(tl.minimum(n, B), capacity), 0)
    differ = count * 0
    for start in range(0, B, BLOCK):
        r = start + tl.arange(0, BLOCK)
        read = r < count
        want = tl.load(slot_ptr + 8 + r, mask=read, other=0, cache_modifier=".cv")
        got = tl.load(lengths_ptr + r, mask=read, other=0).to(tl.int64)
        differ |= tl.max((read & (got != want)).to(tl.int64), axis=0)
    stale = fresh & (n >= 0) & ((n > B) | (n > capacity) | (differ != 0))
    tl.atomic_or(status_ptr, STALE_HOST_LENGTHS, mask=stale)
    tl.store(seen_ptr, seq)
    tl.store(slot_ptr + 4, seq)  # consumed: the host may publish again


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
    validate.at_least("seen", seen.shape[0], 1)
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
        ``[≥ 1]`` int64 on the launch device: the last ``seq`` checked.
    status : torch.Tensor, optional
        ``int32 [1]``: ``STALE_HOST_LENGTHS`` when fresh lengths differ from ``lengths`` (or
        there are more of them than ``B`` or the slot holds).

    Returns
    -------
    Stage
        No result (``None``). One program; no host sync.

    Examples
    --------
    ``lengths=[1, 2, 3, 2]``, published ``[1, 2, 3, 2]``: fine; published ``[1, 3, 2, 2]``
    (two nodes swapped: the same sum and maximum): ``STALE_HOST_LENGTHS``.
    """
    status = _check(lengths, slot, seen, status)
    launch = _LAUNCHER.bind((1,), lengths_ptr=lengths, slot_ptr=slot, seen_ptr=seen,
                            status_ptr=status, B=lengths.shape[0],
                            capacity=slot.shape[0] - _HEAD, BLOCK=_BLOCK,
                            num_warps=4)  # fmt: skip
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
