"""Check a build's ``seq_lens_cpu`` against the device's ``seq_lens`` (design §3, §7).

A builder's host part reads ``seq_lens_cpu``, the engine's own CPU copy of ``seq_lens``, for
what the host computes (exact maxima, FlashInfer's ``plan()`` mirrors). A copy one iteration
behind gives host results that disagree with the device lists, and nothing downstream would
notice. So the host part sends what it read to a small device slot, in stream order,

    slot = [n, ΣL, max L]         n = the batch the host read (−1: no seq_lens_cpu)

and the build's launches include this check of the first ``n`` device lengths::

    STALE_HOST_LENGTHS   if n ≥ 0 and (n > B or Σ_{b<n} seq_lens[b] ≠ ΣL
                                       or max_{b<n} seq_lens[b] ≠ max L)
    slot[0] = −1         afterwards: the slot is consumed, a build without seq_lens_cpu
                         checks nothing

Only the first ``n`` are read because a graph bound for a padded batch ``Bp`` checks the ``B``
real requests its host part read (the pads carry the pad length). The check reads and writes
the slot and ORs the status word; it writes nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher
from ..stage import Stage, launcher
from ._common import STALE_HOST_LENGTHS, or_status

__all__ = ["bind_check_host_lengths", "check_host_lengths", "check_host_lengths_ref"]

# seq_lens entries read per iteration of the one program.
_BLOCK = 1024


@triton.jit(do_not_specialize=["B"])
def _check_host_lengths_kernel(
    seq_lens_ptr,  # [≥ B] int32/int64, the device lengths
    slot_ptr,  # [3] int64: n, ΣL, max L as the host read them (n = −1: nothing to check)
    status_ptr,  # [1] int32
    B,  # entries of seq_lens the build owns
    BLOCK: tl.constexpr,
):
    n = tl.load(slot_ptr)
    want_sum = tl.load(slot_ptr + 1)
    want_max = tl.load(slot_ptr + 2)
    count = tl.minimum(n, B)  # the host's batch, within the build's
    total = want_sum * 0
    top = want_sum * 0
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < count, other=0).to(tl.int64)
        total += tl.sum(lens, axis=0)
        top = tl.maximum(top, tl.max(lens, axis=0))
    stale = (n >= 0) & ((n > B) | (total != want_sum) | (top != want_max))
    tl.atomic_or(status_ptr, STALE_HOST_LENGTHS, mask=stale)
    tl.store(slot_ptr, -1)


_LAUNCHER = Launcher(_check_host_lengths_kernel)


def _check(seq_lens: torch.Tensor, slot: torch.Tensor, status: torch.Tensor | None):
    validate.tensor("seq_lens", seq_lens, ndim=1)
    device = seq_lens.device
    validate.tensor("slot", slot, dtypes=(torch.int64,), ndim=1, device=device)
    validate.at_least("slot", slot.shape[0], 3)
    return validate.status(status, device)


def bind_check_host_lengths(
    seq_lens: torch.Tensor, slot: torch.Tensor, *, status: torch.Tensor | None = None
) -> Stage:
    """Bind once: the check of the host's ``[n, ΣL, max L]`` in ``slot`` against ``seq_lens``.

    Parameters
    ----------
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, the device lengths of the build.
    slot : torch.Tensor
        ``[≥ 3]`` int64 on the same device: what a host part sent (``n``, ``ΣL``, ``max L`` of
        ``seq_lens_cpu[:n]``), or ``n = −1``. Set to ``n = −1`` by the check.
    status : torch.Tensor, optional
        ``int32 [1]``: ``STALE_HOST_LENGTHS`` when the slot disagrees with ``seq_lens``.

    Returns
    -------
    Stage
        No result (``None``). One program; no host sync.

    Examples
    --------
    ``seq_lens=[5, 7, 9]`` (a graph padded to 3 for 2 requests), ``slot=[2, 12, 7]``: fine;
    ``slot=[2, 10, 6]`` (the copy of the iteration before): ``STALE_HOST_LENGTHS``.
    """
    status = _check(seq_lens, slot, status)
    launch = _LAUNCHER.bind((1,), seq_lens_ptr=seq_lens, slot_ptr=slot, status_ptr=status,
                            B=seq_lens.shape[0], BLOCK=_BLOCK, num_warps=4)  # fmt: skip
    return Stage([launch])


check_host_lengths = launcher(bind_check_host_lengths)
check_host_lengths.kernels = (_check_host_lengths_kernel,)  # for specmeta.registry


def check_host_lengths_ref(
    seq_lens: torch.Tensor, slot: torch.Tensor, *, status: torch.Tensor | None = None
) -> None:
    """Pure-torch :func:`check_host_lengths` (syncs)."""
    status = _check(seq_lens, slot, status)
    n, want_sum, want_max = (int(v) for v in slot[:3].tolist())
    if n < 0:
        return
    B = seq_lens.shape[0]
    lens = seq_lens[: min(n, B)].to(torch.int64)
    total = int(lens.sum()) if lens.numel() else 0
    top = int(lens.max()) if lens.numel() else 0
    if n > B or total != want_sum or top != want_max:
        or_status(status, int(STALE_HOST_LENGTHS))
    slot[0] = -1
