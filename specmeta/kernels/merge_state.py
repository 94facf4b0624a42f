"""Merge two attention passes over disjoint key sets by their log-sum-exp (the cascade merge).

A cascade splits one attention into passes over disjoint key sets (FA3: the ``normal`` pass over
the shared prefix, the ``expand`` pass over a branch's own chain or a tree node's ancestors).
Each pass returns its output ``o_i`` (normalised over its own keys) and ``lse_i``, the natural
log of the sum of ``exp(score)`` over its keys. The attention over the union of the keys is::

    lse = log(e^lse1 + e^lse2)
    o   = (e^(lse1 − lse)·o1 + e^(lse2 − lse)·o2)

A pass with no keys has ``lse = −inf`` and contributes nothing, whatever its ``o`` holds (a
kernel may leave it 0 or NaN): its weight is 0 and its output is never multiplied in. Both
passes empty gives ``o = 0`` and ``lse = −inf``. Example: ``lse1 = lse2 = log 2`` gives weights
``½, ½`` and ``lse = log 4``.

FA3's and FlashAttention (CuTe)'s varlen kernels return the LSE as ``[H, total_q]``; pass
``lse.t()`` (a strided view, no copy): every LSE argument is read through its strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, cdiv, next_power_of_2
from ..stage import Stage, launcher

__all__ = ["bind_merge_state", "merge_state", "merge_state_ref"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements of one program's [BLOCK_H, BLOCK_D] tile: 4096 keeps 32 fp32 values a thread at
# 4 warps, enough loads in flight for a memory-bound elementwise op.
_TILE = 4096


@triton.jit(do_not_specialize=["T", "H", "D"])
def _merge_state_kernel(
    o1_ptr,  # [T, H, D] float
    lse1_ptr,  # [T, H] float32 (any strides)
    o2_ptr,  # [T, H, D] float
    lse2_ptr,  # [T, H] float32 (any strides)
    out_ptr,  # [T, H, D] float
    out_lse_ptr,  # [T, H] float32, or a dummy when HAS_LSE_OUT is False
    T, H, D,
    s_o1_t, s_o1_h, s_o2_t, s_o2_h, s_out_t, s_out_h,
    s_l1_t, s_l1_h, s_l2_t, s_l2_h, s_lo_t, s_lo_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LSE_OUT: tl.constexpr,
):  # fmt: skip
    """One program per (query row ``t``, block of ``BLOCK_H`` heads); the last block pads."""
    t = tl.program_id(0).to(tl.int64)  # t · stride passes 2^31 for long batches of wide heads
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    lse1 = tl.load(lse1_ptr + t * s_l1_t + h * s_l1_h, mask=h_ok, other=float("-inf"))
    lse2 = tl.load(lse2_ptr + t * s_l2_t + h * s_l2_h, mask=h_ok, other=float("-inf"))
    lse1 = lse1.to(tl.float32)
    lse2 = lse2.to(tl.float32)
    top = tl.maximum(lse1, lse2)
    empty = top == float("-inf")
    safe = tl.where(empty, 0.0, top)
    w1 = tl.where(lse1 == float("-inf"), 0.0, tl.exp(lse1 - safe))
    w2 = tl.where(lse2 == float("-inf"), 0.0, tl.exp(lse2 - safe))
    total = w1 + w2
    lse = tl.where(empty, float("-inf"), safe + tl.log(tl.where(empty, 1.0, total)))
    w1 = tl.where(empty, 0.0, w1 / tl.where(empty, 1.0, total))
    w2 = tl.where(empty, 0.0, w2 / tl.where(empty, 1.0, total))
    m = h_ok[:, None] & (d < D)[None, :]
    # A pass of weight 0 (an empty pass, LSE -inf) is not read at all: an attention kernel may
    # leave its output rows unwritten or NaN, and it contributes 0 either way.
    m1 = m & (w1 > 0.0)[:, None]
    m2 = m & (w2 > 0.0)[:, None]
    o1 = tl.load(o1_ptr + t * s_o1_t + h[:, None] * s_o1_h + d[None, :], mask=m1, other=0.0)
    o2 = tl.load(o2_ptr + t * s_o2_t + h[:, None] * s_o2_h + d[None, :], mask=m2, other=0.0)
    part1 = tl.where(m1, w1[:, None] * o1.to(tl.float32), 0.0)
    part2 = tl.where(m2, w2[:, None] * o2.to(tl.float32), 0.0)
    o = part1 + part2
    tl.store(
        out_ptr + t * s_out_t + h[:, None] * s_out_h + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m,
    )
    if HAS_LSE_OUT:
        tl.store(out_lse_ptr + t * s_lo_t + h * s_lo_h, lse, mask=h_ok)


_merge_state_launch = Launcher(_merge_state_kernel)


def _check(o1, lse1, o2, lse2):
    validate.tensor("o1", o1, dtypes=_FLOATS, ndim=3)
    T, H, D = o1.shape
    device = o1.device
    validate.tensor("o2", o2, dtypes=_FLOATS, ndim=3, device=device)
    if o2.shape != o1.shape:
        raise ValueError(f"o2 must have o1's shape {tuple(o1.shape)}, got {tuple(o2.shape)}")
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        validate.tensor(name, lse, dtypes=_FLOATS, ndim=2, device=device, contiguous_last=False)
        if tuple(lse.shape) != (T, H):
            raise ValueError(
                f"{name} must be [T, H] = {(T, H)}, got {tuple(lse.shape)} (a varlen kernel's "
                f"[H, total_q] LSE goes in as lse.t())"
            )
    return T, H, D


def bind_merge_state(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> Stage:
    """Bind once: merge two passes by log-sum-exp, in one launch, computing in float32.

    Parameters
    ----------
    o1, o2 : torch.Tensor
        ``[T, H, D]`` outputs of the two passes, each normalised over its own keys (float16,
        bfloat16 or float32; unit stride in ``D``).
    lse1, lse2 : torch.Tensor
        ``[T, H]`` natural-log LSEs (any strides: a kernel's ``[H, T]`` LSE goes in as
        ``lse.t()``); ``−inf`` marks a pass with no keys.
    out : torch.Tensor, optional
        ``[T, H, D]`` destination (may be ``o1`` or ``o2``: each element is read before it is
        written by the same thread). Default: a new tensor of ``o1``'s dtype.
    out_lse : torch.Tensor, optional
        ``[T, H]`` float32 destination of the merged LSE; not written when omitted.

    Returns
    -------
    Stage
        Its result is ``(out, out_lse)`` (tuple), what the eager :func:`merge_state` returns. The
        merged output, and the merged LSE (``None`` unless ``out_lse`` was given).
    """
    T, H, D = _check(o1, lse1, o2, lse2)
    if out is None:
        out = torch.empty_like(o1)
    validate.tensor("out", out, dtypes=_FLOATS, ndim=3, device=o1.device)
    if out.shape != o1.shape:
        raise ValueError(f"out must have o1's shape {tuple(o1.shape)}, got {tuple(out.shape)}")
    if out_lse is not None:
        validate.tensor(
            "out_lse", out_lse, dtypes=(torch.float32,), ndim=2, device=o1.device,
            contiguous_last=False,
        )  # fmt: skip
        if tuple(out_lse.shape) != (T, H):
            raise ValueError(f"out_lse must be [T, H] = {(T, H)}, got {tuple(out_lse.shape)}")
    if T == 0 or H == 0 or D == 0:
        return Stage([], result=(out, out_lse))
    block_d = next_power_of_2(D)
    block_h = min(next_power_of_2(H), max(1, _TILE // block_d))
    lse_out = out_lse if out_lse is not None else lse1
    grid = (T, cdiv(H, block_h))
    launch = _merge_state_launch.bind(
        grid,
        o1_ptr=o1,
        lse1_ptr=lse1,
        o2_ptr=o2,
        lse2_ptr=lse2,
        out_ptr=out,
        out_lse_ptr=lse_out,
        T=T,
        H=H,
        D=D,
        s_o1_t=o1.stride(0),
        s_o1_h=o1.stride(1),
        s_o2_t=o2.stride(0),
        s_o2_h=o2.stride(1),
        s_out_t=out.stride(0),
        s_out_h=out.stride(1),
        s_l1_t=lse1.stride(0),
        s_l1_h=lse1.stride(1),
        s_l2_t=lse2.stride(0),
        s_l2_h=lse2.stride(1),
        s_lo_t=lse_out.stride(0),
        s_lo_h=lse_out.stride(1),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        HAS_LSE_OUT=out_lse is not None,
        num_warps=4,
    )  # fmt: skip
    return Stage([launch], result=(out, out_lse))


merge_state = launcher(bind_merge_state)


def merge_state_ref(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_state` in plain torch. Computes in float64 when any input is float64,
    else float32; returns ``(o, lse)`` in that precision unless ``out``/``out_lse`` are given
    (then they are filled and returned)."""
    _check(o1, lse1, o2, lse2)
    wide = torch.float64 in (o1.dtype, o2.dtype, lse1.dtype, lse2.dtype)
    acc = torch.float64 if wide else torch.float32
    lse1, lse2 = lse1.to(acc), lse2.to(acc)
    top = torch.maximum(lse1, lse2)
    empty = torch.isneginf(top)
    safe = torch.where(empty, torch.zeros_like(top), top)
    w1 = torch.where(torch.isneginf(lse1), torch.zeros_like(lse1), torch.exp(lse1 - safe))
    w2 = torch.where(torch.isneginf(lse2), torch.zeros_like(lse2), torch.exp(lse2 - safe))
    total = torch.where(empty, torch.ones_like(top), w1 + w2)
    lse = torch.where(empty, torch.full_like(top, float("-inf")), safe + torch.log(total))
    w1, w2 = (w / total for w in (w1, w2))
    zero = torch.zeros((), dtype=acc, device=o1.device)
    part1 = torch.where(w1.unsqueeze(-1) > 0, w1.unsqueeze(-1) * o1.to(acc), zero)
    part2 = torch.where(w2.unsqueeze(-1) > 0, w2.unsqueeze(-1) * o2.to(acc), zero)
    o = part1 + part2
    if out is not None:
        out.copy_(o)
        o = out
    if out_lse is not None:
        out_lse.copy_(lse)
        lse = out_lse
    return o, lse
