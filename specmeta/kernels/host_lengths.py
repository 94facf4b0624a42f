"""Check a build's ``seq_lens_cpu`` against the device's ``seq_lens`` (design §3, §7).

A builder's host part reads ``seq_lens_cpu``, the engine's own CPU copy of ``seq_lens``, for
what the host computes (exact maxima, FlashInfer's ``plan()`` mirrors). A copy one iteration
behind gives host results that disagree with the device lists, and nothing downstream would
notice. So the host part publishes what it read in a small **host** slot (pinned on a CUDA
device, read by the kernel through unified addressing, so publishing costs the host a few
stores and no copy), and the build's launches include this check::

    slot = [seq, n, ΣL, max L, consumed]      host memory: the host part writes seq last
    seen                                       device memory: the last seq this check read

    fresh              = slot.seq ≠ seen
    STALE_HOST_LENGTHS   if fresh and (n > B or Σ_{b<n} seq_lens[b] ≠ ΣL
                                       or max_{b<n} seq_lens[b] ≠ max L)
    seen = slot.consumed = slot.seq            afterwards

The handshake: a host part publishes (values, then ``seq + 1``) only once the device has
consumed the values before (``consumed == seq``), so the slot is never rewritten under a
check that has not read it yet. A host part that runs ahead of the device (before the last
build's launches ran) publishes nothing, and its build goes unchecked: a stale copy can be
missed then, never reported wrongly. A launch with nothing new (``seq == seen``: no
``seq_lens_cpu``, or a warm-up) checks nothing. A host part whose launches never run is
checked by the next launches of the mode.

Only the first ``n`` lengths are read because a graph bound for a padded batch ``Bp`` checks
the ``B`` real requests its host part read (the pads carry the pad length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher
from ..stage import Stage, launcher
from ._common import STALE_HOST_LENGTHS, or_status

__all__ = ["bind_check_host_lengths", "check_host_lengths", "check_host_lengths_ref",
           "publish_host_lengths"]  # fmt: skip

# seq_lens entries read per iteration of the one program.
_BLOCK = 1024
# The fields of a slot.
SEQ, N, TOTAL, TOP, CONSUMED = range(5)


def publish_host_lengths(slot, n: int, total: int, top: int) -> bool:
    """The host part's side: write ``n``, ``ΣL``, ``max L`` and then ``seq + 1`` into
    ``slot`` (a numpy view of the host slot, or any indexable of 5 ints) when the device
    consumed what was there; returns whether it published."""
    seq = slot[SEQ]
    if slot[CONSUMED] != seq:
        return False  # the check of the last values has not run yet: leave them
    slot[N], slot[TOTAL], slot[TOP] = n, total, top
    slot[SEQ] = seq + 1
    return True


@triton.jit(do_not_specialize=["B"])
def _check_host_lengths_kernel(
    seq_lens_ptr,  # [≥ B] int32/int64, the device lengths
    slot_ptr,  # [8] int64 in host memory: seq, n, ΣL, max L, consumed, 3 unused
    seen_ptr,  # [1] int64 on the device: the last seq read
    status_ptr,  # [1] int32
    B,  # entries of seq_lens the build owns
    BLOCK: tl.constexpr,
):
    # Host memory, written between launches: read it every time, past any cache, in one
    # 64-byte vector load (one round trip to the host, not one per field).
    field = tl.arange(0, 8)
    slot = tl.load(slot_ptr + field, volatile=True)
    seq = tl.sum(tl.where(field == 0, slot, 0), axis=0)
    n = tl.sum(tl.where(field == 1, slot, 0), axis=0)
    want_sum = tl.sum(tl.where(field == 2, slot, 0), axis=0)
    want_max = tl.sum(tl.where(field == 3, slot, 0), axis=0)
    fresh = seq != tl.load(seen_ptr)
    count = tl.where(fresh, tl.minimum(n, B), 0)  # the host's batch, within the build's
    total = want_sum * 0
    top = want_sum * 0
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < count, other=0).to(tl.int64)
        total += tl.sum(lens, axis=0)
        top = tl.maximum(top, tl.max(lens, axis=0))
    stale = fresh & (n >= 0) & ((n > B) | (total != want_sum) | (top != want_max))
    tl.atomic_or(status_ptr, STALE_HOST_LENGTHS, mask=stale)
    tl.store(seen_ptr, seq)
    tl.store(slot_ptr + 4, seq)  # consumed: the host may publish again


_LAUNCHER = Launcher(_check_host_lengths_kernel)


def _check(seq_lens: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor,
           status: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    validate.tensor("seq_lens", seq_lens, ndim=1)
    device = seq_lens.device
    validate.tensor("slot", slot, dtypes=(torch.int64,), ndim=1)
    validate.at_least("slot", slot.shape[0], 8)
    if device.type == "cuda" and not (slot.is_cuda or slot.is_pinned()):
        raise ValueError("slot must be pinned host memory (or device memory) for a CUDA "
                         "launch, got pageable CPU memory; pass slot.pin_memory()")  # fmt: skip
    validate.tensor("seen", seen, dtypes=(torch.int64,), ndim=1, device=device)
    validate.at_least("seen", seen.shape[0], 1)
    return validate.status(status, device)


def bind_check_host_lengths(seq_lens: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor, *,
                            status: torch.Tensor | None = None) -> Stage:  # fmt: skip
    """Bind once: the check of what a host part published in ``slot`` against ``seq_lens``.

    Parameters
    ----------
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, the device lengths of the build.
    slot : torch.Tensor
        ``[≥ 8]`` int64: ``seq, n, ΣL, max L, consumed`` and 3 unused (one 64-byte load),
        :func:`publish_host_lengths` writing the first four; pinned host memory for a CUDA
        launch.
    seen : torch.Tensor
        ``[≥ 1]`` int64 on the launch device: the last ``seq`` checked.
    status : torch.Tensor, optional
        ``int32 [1]``: ``STALE_HOST_LENGTHS`` when fresh values disagree with ``seq_lens``.

    Returns
    -------
    Stage
        No result (``None``). One program; no host sync.

    Examples
    --------
    ``seq_lens=[5, 7, 9]`` (a graph padded to 3 for 2 requests), ``slot=[1, 2, 12, 7, 0, …]``,
    ``seen=[0]``: fine, and ``slot[4] = seen[0] = 1``; ``slot=[1, 2, 10, 6, 0, …]`` (the copy
    of the iteration before): ``STALE_HOST_LENGTHS``; ``seen=[1]``: nothing new, nothing
    checked.
    """
    status = _check(seq_lens, slot, seen, status)
    launch = _LAUNCHER.bind((1,), seq_lens_ptr=seq_lens, slot_ptr=slot, seen_ptr=seen,
                            status_ptr=status, B=seq_lens.shape[0], BLOCK=_BLOCK,
                            num_warps=4)  # fmt: skip
    return Stage([launch])


check_host_lengths = launcher(bind_check_host_lengths)
check_host_lengths.kernels = (_check_host_lengths_kernel,)  # for specmeta.registry


def check_host_lengths_ref(seq_lens: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor, *,
                           status: torch.Tensor | None = None) -> None:  # fmt: skip
    """Pure-torch :func:`check_host_lengths` (syncs)."""
    status = _check(seq_lens, slot, seen, status)
    seq, n, want_sum, want_max = (int(v) for v in slot[:4].tolist())
    if seq != int(seen[0]):
        B = seq_lens.shape[0]
        lens = seq_lens[: max(min(n, B), 0)].to(torch.int64)
        total = int(lens.sum()) if lens.numel() else 0
        top = int(lens.max()) if lens.numel() else 0
        if n >= 0 and (n > B or total != want_sum or top != want_max):
            or_status(status, int(STALE_HOST_LENGTHS))
    seen[0] = seq
    slot[CONSUMED] = seq
