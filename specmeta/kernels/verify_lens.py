"""Per-request verify lengths padded to a captured token bucket (design §2, §2.5, §4).

A captured graph for target verify holds a bucket of ``T`` query tokens shared by ``Bp ≥ B``
requests. The ``B`` real requests verify ``v_b`` tokens each (``0 ≤ v_b ≤ N``); the bucket's
other ``T − Σv`` tokens go to the ``Bp − B`` pad requests, so that every backend sees a
complete batch whose query lengths sum to exactly ``T``::

    out[b]           = v_b                                       for b < B
    out[B + j]       = ⌊(T − Σv) / (Bp − B)⌋ + [j < (T − Σv) mod (Bp − B)]    for j < Bp − B
    out[B − 1]       = v_{B−1} + (T − Σv)                        when B == Bp ≥ 1 (no pad)
    qo_indptr[b]     = Σ_{b'<b} out[b']                          for b in [0, Bp], entry 0 included

Request ``b``'s query rows are ``qo_indptr[b] … qo_indptr[b + 1]``; ``qo_indptr[Bp] = T``.
With ``cap = C`` (a consumer that scatters each request's rows into a dense ``[Bp, C]`` query)
every ``out[b]`` is ``min(·, C)`` and ``qo_indptr`` their sum, ending at ``≤ T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import OUT_OF_CAPACITY, POS_OOB, host_int

__all__ = [
    "bind_pad_verify_lens_to_bucket",
    "pad_verify_lens_to_bucket",
    "pad_verify_lens_to_bucket_ref",
]


# Requests per iteration of the single program's loops: next_pow2(Bp + 1), at least 256 (one
# variant serves every bucket up to 255 requests, so a new batch size compiles nothing) and at
# most 1024 (8 entries a thread at 4 warps; larger buckets loop).
_MIN_BLOCK = 256
_MAX_BLOCK = 1024
# Largest bucket: the lengths and offsets are int32 (as every backend reads qo_indptr).
_MAX_TOKENS = 2**31 - 1


def _block(padded_batch: int) -> int:
    """The loops' block size for ``Bp`` requests (``Bp + 1`` offsets)."""
    return min(max(next_power_of_2(padded_batch + 1), _MIN_BLOCK), _MAX_BLOCK)


@triton.jit(do_not_specialize=["B", "B_pad", "T", "N", "CAP"])
def _pad_verify_lens_to_bucket_kernel(
    verify_lens_ptr,  # [B] int32|int64
    out_ptr,  # [≥ B_pad] int32|int64
    qo_indptr_ptr,  # [≥ B_pad + 1] int32|int64
    status_ptr,  # [1] int32
    B,
    B_pad,
    T,
    N,  # the tree's nodes, each real v_b's bound; 0: not checked
    CAP,  # each padded length's bound (a dense consumer's N); 0: none
    BLOCK: tl.constexpr,  # next_pow2(B_pad + 1), clamped to [256, 1024]
):
    """One program, two passes over ``verify_lens`` in blocks of ``BLOCK``: the first sums the
    lengths (each clamped to ``[0, T + 1]``: a garbage length cannot overflow the int64 sum and
    still overflows the bucket), the second writes ``out`` (the pads' lengths closed forms of
    their index, every length clamped to ``CAP`` when given) and ``qo_indptr``, the carried
    prefix sum of what it wrote."""
    T64 = T.to(tl.int64)
    top = tl.where(N > 0, N.to(tl.int64), T64 + 1)  # a real length's bound
    total = tl.full([], 0, tl.int64)
    negative = tl.full([], 0, tl.int32)
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        v = tl.load(verify_lens_ptr + i, mask=i < B, other=0).to(tl.int64)
        negative |= tl.max(((v < 0) | ((N > 0) & (v > N))).to(tl.int32), axis=0)
        total += tl.sum(tl.minimum(tl.maximum(v, 0), top), axis=0)

    filled = tl.minimum(total, T64)  # tokens the real requests keep
    leftover = T64 - filled  # tokens the pad requests (or, without one, the last request) take
    pads = (B_pad - B).to(tl.int64)
    has_pads = pads > 0
    share = tl.where(has_pads, leftover // tl.maximum(pads, 1), 0)
    spare = tl.where(has_pads, leftover % tl.maximum(pads, 1), 0)  # pads 0 … spare−1 take one more
    absorb = tl.where(has_pads, 0, leftover)  # B == B_pad: request B − 1 takes the leftover

    carry = tl.full([], 0, tl.int64)  # Σ of the clamped lengths before the block
    start_row = tl.full([], 0, tl.int64)  # Σ of the written lengths before the block
    for start in range(0, B_pad + 1, BLOCK):
        i = start + tl.arange(0, BLOCK)
        real = i < B
        v = tl.load(verify_lens_ptr + i, mask=real, other=0).to(tl.int64)
        v = tl.minimum(tl.maximum(v, 0), top)
        before = carry + tl.cumsum(v, axis=0) - v  # Σ_{b'<b} v_b'
        carry += tl.sum(v, axis=0)
        # A real request keeps what still fits the bucket (all of it unless Σv > T).
        kept = tl.minimum(v, tl.maximum(T64 - before, 0)) + tl.where(i == B - 1, absorb, 0)
        j = (i - B).to(tl.int64)  # pad index (i ≥ B)
        pad_len = share + (j < spare).to(tl.int64)
        length = tl.where(real, kept, tl.where(i < B_pad, pad_len, 0))
        length = tl.where(CAP > 0, tl.minimum(length, CAP), length)
        row = start_row + tl.cumsum(length, axis=0) - length
        start_row += tl.sum(length, axis=0)
        tl.store(out_ptr + i, length.to(out_ptr.dtype.element_ty), mask=i < B_pad)
        tl.store(qo_indptr_ptr + i, row.to(qo_indptr_ptr.dtype.element_ty), mask=i <= B_pad)

    bits = tl.where(negative != 0, POS_OOB, 0) | tl.where(total > T64, OUT_OF_CAPACITY, 0)
    tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_pad_verify_lens_to_bucket_launch = Launcher(_pad_verify_lens_to_bucket_kernel)


def _prepare(where, verify_lens, num_tokens, padded_batch, out, qo_indptr, status,
             num_draft_tokens, cap):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. Returns ``B``, ``T``,
    ``Bp``, ``out``, ``qo_indptr``, the status word, ``N`` and the cap (0 when not given).
    Every message names ``where``."""
    try:
        N = cap_ = 0
        if num_draft_tokens is not None:
            N = validate.positive("num_draft_tokens", num_draft_tokens)
        if cap is not None:
            cap_ = validate.positive("cap", cap)
        T = host_int("num_tokens", num_tokens)
        Bp = host_int("padded_batch", padded_batch)
        validate.tensor("verify_lens", verify_lens, ndim=1)
        device = verify_lens.device
        B = verify_lens.shape[0]
        if out is not None:
            validate.tensor("out", out, ndim=1, device=device)
        if qo_indptr is not None:
            validate.tensor("qo_indptr", qo_indptr, ndim=1, device=device)
        status = validate.status(status, device)
    except TypeError as err:
        raise TypeError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if not 0 <= T <= _MAX_TOKENS:
        raise ValueError(
            f"{where}: num_tokens must be in [0, 2**31 - 1], got {T}; pass the token count T "
            "of the captured bucket"
        )
    if Bp < B:
        raise ValueError(
            f"{where}: padded_batch must be >= the batch size B = {B} (verify_lens has {B} "
            f"entries), got {Bp}; pass the captured bucket's batch size Bp >= B"
        )
    if Bp == 0 and T > 0:
        raise ValueError(
            f"{where}: padded_batch must be >= 1 when num_tokens > 0, got padded_batch=0 with "
            f"num_tokens={T}; a bucket of tokens needs a request to hold them"
        )
    if out is None:
        out = torch.empty(Bp, dtype=torch.int32, device=device)
    if qo_indptr is None:
        qo_indptr = torch.empty(Bp + 1, dtype=torch.int32, device=device)
    for name, buf, need, what in (
        ("out", out, Bp, "entries (padded_batch)"),
        ("qo_indptr", qo_indptr, Bp + 1, "entries (padded_batch + 1)"),
    ):
        try:
            validate.at_least(name, buf.shape[0], need, what)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return B, T, Bp, out, qo_indptr, status, N, cap_


def bind_pad_verify_lens_to_bucket(
    verify_lens: torch.Tensor,
    num_tokens: int,
    padded_batch: int,
    *,
    out: torch.Tensor | None = None,
    qo_indptr: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_draft_tokens: int | None = None,
    cap: int | None = None,
) -> Stage:
    """Bind once: pad ``B`` verify lengths to a bucket of ``Bp`` requests and ``T`` tokens, with
    the query offsets, in one launch.

    Parameters
    ----------
    verify_lens : torch.Tensor
        ``[B]`` int32 or int64 on the device, ``v_b`` tokens verified by request ``b``, each in
        ``[0, N]`` (``N`` is not checked: only ``v_b ≥ 0`` can be, on the device).
    num_tokens : int
        ``T`` ≥ 0, the query tokens of the captured bucket (a host int, at most 2**31 − 1).
    padded_batch : int
        ``Bp ≥ B``, the requests of the captured bucket (a host int); ``Bp ≥ 1`` when ``T > 0``.
    out : torch.Tensor, optional
        ``[≥ Bp]`` int32 or int64; entries ``[:Bp]`` are written, nothing past them. Allocated
        int32 ``[Bp]`` when omitted.
    qo_indptr : torch.Tensor, optional
        ``[≥ Bp + 1]`` int32 or int64; entries ``[:Bp + 1]`` are written: the exclusive prefix
        sum of ``out``, ``qo_indptr[0] = 0``, ``qo_indptr[Bp] = T``. Allocated int32
        ``[Bp + 1]`` when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``: ``OUT_OF_CAPACITY`` when ``Σv > T`` (the lengths do not fit the
        bucket), ``POS_OOB`` when some ``v_b < 0`` (read as 0) or, with ``num_draft_tokens``,
        ``v_b > N`` (read as ``N``).
    num_draft_tokens : int, optional
        ``N``, the tree's nodes: a real request verifies at most ``N``, so a longer ``v_b`` is
        a fault, read as ``N`` and reported. Only the padding may give a request more than
        ``N`` rows (filler rows, design §2.9). Not given: the lengths are not bounded above.
    cap : int, optional
        ``≥ 1``: every padded length is clamped to ``cap`` and ``qo_indptr`` is the prefix sum
        of the clamped lengths, so it may end short of ``T``: the layout of a consumer that
        scatters each request's rows into a dense ``[Bp, cap]`` query (TRT-LLM MLA, ``cap =
        N``); the tokens past ``qo_indptr[Bp]`` are filler no request reads. Not given: no
        clamp, ``qo_indptr[Bp] = T``.

    Returns
    -------
    Stage
        Its result is ``(out, qo_indptr)`` (tuple of torch.Tensor), what the eager
        :func:`pad_verify_lens_to_bucket` returns: the buffers passed (whole), or new ones.

    Notes
    -----
    Real requests keep ``v_b``; the leftover ``T − Σv`` goes to the ``Bp − B`` pad requests,
    ``⌊leftover / pads⌋`` each and one more for the first ``leftover mod pads`` of them. Without
    a pad request (``B == Bp``) the last real request takes the leftover; ``B == Bp == 0``
    writes ``qo_indptr[0] = 0`` only.

    Faults keep the output a valid bucket (lengths ≥ 0 summing to exactly ``T``, or at most
    ``T`` with ``cap``, offsets non-decreasing from 0), and nothing is written past ``out[Bp − 1]`` or
    ``qo_indptr[Bp]``:

    * ``Σv > T`` (``OUT_OF_CAPACITY``): the real lengths are taken in order until the bucket is
      full, ``out[b] = min(v_b, max(T − Σ_{b'<b} v_b', 0))`` (the request that crosses ``T`` is
      cut, later ones get 0), and the pads get 0.
    * ``v_b < 0`` (``POS_OOB``): ``v_b`` reads as 0, everywhere (the leftover included); with
      ``num_draft_tokens``, ``v_b > N`` (``POS_OOB``) reads as ``N`` alike.

    Examples
    --------
    ``verify_lens=[3, 1]``, ``T=8``, ``Bp=4`` → ``out=[3, 1, 2, 2]``,
    ``qo_indptr=[0, 3, 4, 6, 8]``; ``T=9`` → ``[3, 1, 3, 2]``, ``[0, 3, 4, 7, 9]``; ``T=8``,
    ``Bp=2`` → ``[3, 5]``, ``[0, 3, 8]``, with ``cap=4`` ``[3, 4]``, ``[0, 3, 7]``; ``verify_lens=[3, 4, 2]``, ``T=5``, ``Bp=4`` →
    ``[3, 2, 0, 0]``, ``[0, 3, 5, 5, 5]`` and ``OUT_OF_CAPACITY``.

    Grid ``(1,)``: one program loops over the requests in blocks of ``next_pow2(Bp + 1)``
    (clamped to [256, 1024]), twice (the total first). No host sync; ``B``, ``Bp`` and ``T``
    are runtime arguments.
    """
    B, T, Bp, out, qo_indptr, status, N, cap = _prepare(
        "pad_verify_lens_to_bucket", verify_lens, num_tokens, padded_batch, out, qo_indptr, status,
        num_draft_tokens, cap,
    )  # fmt: skip
    launch = _pad_verify_lens_to_bucket_launch.bind(
        (1,),
        verify_lens_ptr=verify_lens,
        out_ptr=out,
        qo_indptr_ptr=qo_indptr,
        status_ptr=status,
        B=B,
        B_pad=Bp,
        T=T,
        N=N,
        CAP=cap,
        BLOCK=_block(Bp),
        num_warps=4,
    )
    return Stage([launch], result=(out, qo_indptr))


pad_verify_lens_to_bucket = launcher(bind_pad_verify_lens_to_bucket)
pad_verify_lens_to_bucket.kernels = (_pad_verify_lens_to_bucket_kernel,)  # for specmeta.registry


def fill_bucket(lengths: torch.Tensor, count: int, leftover: int) -> torch.Tensor:
    """The padding rule on ``lengths`` (``[Bp]``, its first ``count`` the real lengths, in
    place): the ``leftover`` tokens go to the pad requests ``count … Bp − 1``,
    ``⌊leftover / pads⌋`` each and one more for the first ``leftover mod pads``, or, without a
    pad, to the last request. Returns ``lengths``."""
    pads = lengths.shape[0] - count
    if pads:
        share, spare = divmod(leftover, pads)
        lengths[count:] = share
        lengths[count : count + spare] += 1
    elif count:
        lengths[count - 1] += leftover
    return lengths


def pad_verify_lens_to_bucket_ref(
    verify_lens: torch.Tensor,
    num_tokens: int,
    padded_batch: int,
    *,
    out: torch.Tensor | None = None,
    qo_indptr: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    num_draft_tokens: int | None = None,
    cap: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`pad_verify_lens_to_bucket` (vectorised; syncs)."""
    B, T, Bp, out, qo_indptr, status, N, cap = _prepare(
        "pad_verify_lens_to_bucket_ref", verify_lens, num_tokens, padded_batch, out, qo_indptr,
        status, num_draft_tokens, cap,
    )  # fmt: skip
    device = verify_lens.device
    v_in = verify_lens.to(torch.int64)
    v = v_in.clamp(0, N if N else T + 1)  # as the kernel: the int64 sum cannot overflow
    before = torch.cumsum(v, 0) - v
    lengths = torch.zeros(Bp, dtype=torch.int64, device=device)
    lengths[:B] = torch.minimum(v, (T - before).clamp_min(0))
    total = int(v.sum())
    fill_bucket(lengths, B, T - min(total, T))
    if cap:
        lengths.clamp_(max=cap)
    out[:Bp] = lengths.to(out.dtype)
    qo_indptr[0] = 0
    qo_indptr[1 : Bp + 1] = torch.cumsum(lengths, 0).to(qo_indptr.dtype)
    bits = 0
    if bool((v_in < 0).any()) or (N and bool((v_in > N).any())):
        bits |= int(Status.POS_OOB)
    if total > T:
        bits |= int(Status.OUT_OF_CAPACITY)
    if bits:
        status |= bits
    return out, qo_indptr
