"""Pad values of design §4 and the one op that applies them: copy ``[:B]``, pad ``[B:Bp]``.

A padded request must be a complete, consistent request whose every derived index lands on the
sink (row 0 of ``req_to_token``, slot 0 / page 0 of the pool):

==========================  ====================================================================
input                       pad value
==========================  ====================================================================
``req_pool_indices``        :data:`SINK_ROW` (0, the reserved all-zero row)
``out_cache_loc``           :data:`SINK_SLOT` (0)
``positions``               :data:`POSITION` (0)
``topk_index``              :data:`TOPK_INDEX` (0)
float inputs                :data:`FLOAT` (0.0)
``seq_lens``                :func:`seq_lens_fill` (≥ the mode's query width, so every derived
                            length is valid and every gather reads row 0, i.e. the sink)
``accept_index``            :data:`NO_ACCEPT` (−1: nothing accepted, a −1 run that is a suffix)
``accept_lens``             :data:`NOTHING_ACCEPTED` (0)
``verify_lens``             :data:`NOT_VERIFIED` (0: a pad request verifies no token of its own)
tree mask (bool)            :data:`TREE_MASK` (True: a padded node sees its whole window, all
                            on the sink, so no attention row is empty)
==========================  ====================================================================

:func:`copy_pad` writes ``dst[:n] = src`` and ``dst[n:] = pad`` in **one** launch per buffer
(``n = src.shape[0]``), so a runner pads every buffer for the price of the copy it makes anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, cdiv
from ..stage import Stage, launcher

__all__ = [
    "SINK_ROW",
    "SINK_SLOT",
    "POSITION",
    "TOPK_INDEX",
    "FLOAT",
    "NO_ACCEPT",
    "NOTHING_ACCEPTED",
    "NOT_VERIFIED",
    "TREE_MASK",
    "seq_lens_fill",
    "check_pad",
    "copy_pad",
    "copy_pad_many",
    "copy_pad_ref",
    "bind_copy_pad",
    "bind_copy_pad_many",
]

SINK_ROW = 0
"""``req_pool_indices`` pad: row 0 of ``req_to_token`` is reserved and all zeros."""
SINK_SLOT = 0
"""``out_cache_loc`` pad: slot 0 (page 0) of the pool is the reserved sink."""
POSITION = 0
"""``positions`` pad."""
TOPK_INDEX = 0
"""``topk_index`` pad."""
FLOAT = 0.0
"""Pad of float inputs (probabilities, hidden states)."""
NO_ACCEPT = -1
"""``accept_index`` pad: a row of −1, i.e. no accepted node (design §2.4)."""
NOTHING_ACCEPTED = 0
"""``accept_lens`` pad."""
NOT_VERIFIED = 0
"""``verify_lens`` pad of a ragged verify (design §2.9): a pad request verifies no token of its
own; the bucket's leftover goes to its last request."""
TREE_MASK = True
"""Tree-mask pad: every padded node attends to its whole (sink) window, never to nothing."""


def seq_lens_fill(*query_widths: int) -> int:
    """The ``seq_lens`` pad: ``max(1, *query_widths)``, at least every query width the padded
    batch serves (``K`` for draft decode, ``N`` for target verify and draft extend), so a padded
    request's lengths (``L + s + 1``, ``L + N``, ``L − lpl``) are valid and reach the sink only.

    Examples
    --------
    ``seq_lens_fill(4, 8) → 8`` for a runner that serves draft decode (``K = 4``) and verify
    (``N = 8``).
    """
    for i, q in enumerate(query_widths):
        validate.positive(f"query_widths[{i}]", q)
    return max(1, *query_widths)


def check_pad(name: str, pad: object, dtype: torch.dtype) -> int | float:
    """``pad`` as the Python number the copy-pad kernel stores into a ``dtype`` buffer.

    Raises ``TypeError`` for ``None``, a non-number, or a float pad of an integer buffer, and
    ``ValueError`` for a pad the dtype cannot hold.
    """
    if pad is None or not isinstance(pad, (bool, int, float)):
        raise TypeError(f"{name}: a pad value (int, float or bool) is required, got {pad!r}")
    if dtype == torch.bool:
        if pad not in (0, 1):
            raise ValueError(f"{name}: a bool buffer's pad must be True/False/0/1, got {pad!r}")
        return int(pad)
    if dtype.is_floating_point:
        return float(pad)
    if isinstance(pad, float) or dtype.is_complex:
        raise TypeError(f"{name}: pad {pad!r} does not fit a {dtype} buffer")
    info = torch.iinfo(dtype)
    if not info.min <= int(pad) <= info.max:
        raise ValueError(f"{name}: pad {pad} is outside the range of {dtype}")
    return int(pad)


# 1024 elements a program: 8 per thread at 4 warps, enough in flight for a bandwidth-bound copy.
_BLOCK = 1024


@triton.jit
def _copy_pad_block(src_ptr, dst_ptr, n_src, n_dst, pad, block, BLOCK: tl.constexpr):
    """Block ``block`` of ``dst[:n_src] = src``, ``dst[n_src:n_dst] = pad`` (masked)."""
    # block·BLOCK in 64 bits: a [Bp·K, vocab] probability buffer passes 2**31 elements.
    i = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    from_src = i < n_src
    v = tl.load(src_ptr + i, mask=from_src, other=0)
    v = tl.where(from_src, v, pad)
    tl.store(dst_ptr + i, v.to(dst_ptr.dtype.element_ty), mask=i < n_dst)


@triton.jit(do_not_specialize=["n_src", "n_dst", "pad"])
def _copy_pad_kernel(
    src_ptr,  # [n_src] any dtype (the flattened raw input)
    dst_ptr,  # [n_dst] src's dtype (the flattened padded buffer)
    n_src,
    n_dst,
    pad,
    BLOCK: tl.constexpr,
):
    """One program per ``BLOCK`` elements of ``dst``; the last block is masked."""
    _copy_pad_block(src_ptr, dst_ptr, n_src, n_dst, pad, tl.program_id(0), BLOCK)


@triton.jit(
    do_not_specialize=[
        "n_src0", "n_dst0", "pad0", "n_src1", "n_dst1", "pad1",
        "n_src2", "n_dst2", "pad2", "n_src3", "n_dst3", "pad3",
    ]
)  # fmt: skip
def _copy_pad_many_kernel(
    src0, dst0, n_src0, n_dst0, pad0,
    src1, dst1, n_src1, n_dst1, pad1,
    src2, dst2, n_src2, n_dst2, pad2,
    src3, dst3, n_src3, n_dst3, pad3,
    NBUF: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Up to four buffers in one launch: program ``(block, i)`` does block ``block`` of
    buffer ``i`` (blocks past a buffer's end store nothing)."""
    block, i = tl.program_id(0), tl.program_id(1)
    if i == 0:
        _copy_pad_block(src0, dst0, n_src0, n_dst0, pad0, block, BLOCK)
    if NBUF > 1:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if i == 1:
            _copy_pad_block(src1, dst1, n_src1, n_dst1, pad1, block, BLOCK)
    if NBUF > 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if i == 2:
            _copy_pad_block(src2, dst2, n_src2, n_dst2, pad2, block, BLOCK)
    if NBUF > 3:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if i == 3:
            _copy_pad_block(src3, dst3, n_src3, n_dst3, pad3, block, BLOCK)


_copy_pad_many_launch = Launcher(_copy_pad_many_kernel)
# Buffers one launch of copy_pad_many covers.
MANY = 4


_copy_pad_launch = Launcher(_copy_pad_kernel)


_ANY = (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip


def _prepare(src: object, dst: object, pad: object) -> tuple[int | float, int]:
    validate.tensor("dst", dst, dtypes=_ANY, contiguous_last=False)
    validate.tensor("src", src, dtypes=(dst.dtype,), device=dst.device, contiguous_last=False)
    if dst.dim() == 0 or src.dim() != dst.dim() or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"src must have shape [n, *{tuple(dst.shape[1:])}] like dst, got src "
            f"{tuple(src.shape)} and dst {tuple(dst.shape)}"
        )
    validate.at_least("dst", dst.shape[0], src.shape[0], "rows")
    for name, t in (("src", src), ("dst", dst)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return check_pad("pad", pad, dst.dtype), src.numel()


def bind_copy_pad(src: torch.Tensor, dst: torch.Tensor, pad: int | float | bool) -> Stage:
    """Bind once: ``dst[:n] = src``, ``dst[n:] = pad`` with ``n = src.shape[0]``, in one launch.

    Parameters
    ----------
    src : torch.Tensor
        ``[n, *row]``, contiguous, ``dst``'s dtype and device (the raw input of ``n`` rows).
    dst : torch.Tensor
        ``[Np, *row]``, contiguous, ``Np ≥ n`` (a static buffer's ``[:Bp·per_request]``).
    pad : int, float or bool
        Stored into rows ``[n, Np)``; must fit ``dst``'s dtype (see :func:`check_pad`).

    Returns
    -------
    Stage
        Its result is what the eager :func:`copy_pad` returns: torch.Tensor, ``dst``.

    Examples
    --------
    ``copy_pad(tensor([5, 7]), dst=<4 elements>, pad=0)`` → ``dst = [5, 7, 0, 0]``.

    Grid ``cdiv(Np·row, 1024)``; sizes are runtime arguments (a new ``n`` compiles nothing);
    no host sync.
    """
    value, n_src = _prepare(src, dst, pad)
    n_dst = dst.numel()
    if n_dst == 0:
        return Stage([], result=dst)
    launch = _copy_pad_launch.bind(
        (cdiv(n_dst, _BLOCK),),
        src_ptr=src if n_src else dst,
        dst_ptr=dst,
        n_src=n_src,
        n_dst=n_dst,
        pad=value,
        BLOCK=_BLOCK,
    )
    return Stage([launch], result=dst)


copy_pad = launcher(bind_copy_pad)


def bind_copy_pad_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor, int | float | bool]],
) -> Stage:
    """Bind once: :func:`copy_pad` of several buffers, ``MANY`` (4) to a launch: ``(src, dst, pad)``
    each, checked as :func:`copy_pad` checks its arguments, all on one device. The graph runner pads
    every static input of a call with one launch.

    Returns
    -------
    Stage
        Its result is None, what the eager :func:`copy_pad_many` returns.
    """
    prepared = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 3:
            raise TypeError(f"pairs[{i}] must be a (src, dst, pad) tuple, got {pair!r:.80}")
        src, dst, pad = pair
        value, n_src = _prepare(src, dst, pad)
        if prepared and dst.device != prepared[0][1].device:
            raise ValueError(
                f"pairs[{i}]: dst is on {dst.device}, pairs[0]'s on {prepared[0][1].device}; "
                "one launch pads buffers of one device: call copy_pad_many once per device"
            )
        prepared.append((src if n_src else dst, dst, n_src, dst.numel(), value))
    launches = []
    for start in range(0, len(prepared), MANY):
        group = prepared[start : start + MANY]
        blocks = max(cdiv(n_dst, _BLOCK) for _, _, _, n_dst, _ in group)
        if blocks == 0:
            continue
        first = group[0]
        args = {}
        for i in range(MANY):
            src, dst, n_src, n_dst, value = group[i] if i < len(group) else (*first[:2], 0, 0, 0)
            args.update({f"src{i}": src, f"dst{i}": dst, f"n_src{i}": n_src,
                         f"n_dst{i}": n_dst, f"pad{i}": value})  # fmt: skip
        launches.append(
            _copy_pad_many_launch.bind((blocks, len(group)), **args, NBUF=len(group), BLOCK=_BLOCK)
        )
    return Stage(launches)


copy_pad_many = launcher(bind_copy_pad_many)


def copy_pad_ref(src: torch.Tensor, dst: torch.Tensor, pad: int | float | bool) -> torch.Tensor:
    """Pure-torch :func:`copy_pad` (a copy and a fill)."""
    value, _ = _prepare(src, dst, pad)
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].fill_(value)
    return dst
