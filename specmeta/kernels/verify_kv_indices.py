"""Ragged page-size-1 KV lists of target verify and draft extend (SPEC §3.3).

Request ``b`` reads its prefix and the ``extra_tokens`` (``N``) slots that follow it::

    kv_indptr[b]                  = Σ_{b'<b} (L_b' + extra)      for b in [0, B], entry 0 included
    kv_indices[kv_indptr[b] + k]  = row_b[k]                     for k < L_b + extra

For target verify the extra slots are the verify window (node ``j`` at ``row_b[L_b + j]``); for
draft extend they are the extend tokens. With ``extra_tokens=0`` the same lists are the shared
level of the cascade draft decode (see :mod:`specmeta.kernels.shared_prefix_kv_indices`, which
reuses this module's device helpers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import verify_kv_indices_need
from ..status import Status
from .draft_cache_locs import _check_batch, gather_rows_ref, load_request
from .draft_decode_kv_indices import _target_programs

__all__ = ["verify_kv_indices", "verify_kv_indices_ref", "exclusive_length_sum"]

_ROW_OOB = tl.constexpr(int(Status.ROW_OOB))  # kernels read only constexpr globals
_POS_OOB = tl.constexpr(int(Status.POS_OOB))  # kernels read only constexpr globals
_OUT_OF_CAPACITY = tl.constexpr(int(Status.OUT_OF_CAPACITY))  # kernels read only constexpr globals

# Entries one program copies per iteration: 1024 int32 keep 8 elements a thread in flight at
# 4 warps, enough to saturate the store path (as in draft_decode_kv_indices).
_BLOCK = 1024
# seq_lens entries summed per iteration of the exclusive-prefix loop (one load up to B = 1024).
_BLOCK_B = 1024


def _chunk_programs(device: torch.device, batch: int, width: int) -> int:
    """Programs per request: enough for the grid to fill the device even when a few long
    requests carry all the work, never more than a ``width``-entry list has chunks."""
    per_request = triton.cdiv(_target_programs(device), max(batch, 1))
    return max(1, min(per_request, triton.cdiv(width, _BLOCK)))


@triton.jit
def exclusive_length_sum(seq_lens_ptr, b, extra, BLOCK_B: tl.constexpr):
    """``Σ_{b'<b} (max(L_b', 0) + extra)`` in int64, from whole-vector loads of ``seq_lens``."""
    cum = b * 0
    for start in range(0, b, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        before = offs < b
        prev = tl.load(seq_lens_ptr + offs, mask=before, other=0).to(tl.int64)
        cum += tl.sum(tl.where(before, tl.maximum(prev, 0) + extra, 0), axis=0)
    return cum


@triton.jit
def copy_row_prefix(
    req_to_token_ptr, row_base, row_ok, n, W_row, dst_ptr, dst_start, W_dst, first_chunk,
    chunk_step, BLOCK: tl.constexpr,
):  # fmt: skip
    """Copy ``row[0:n]`` to ``dst[dst_start : dst_start + n]``, chunks ``first_chunk,
    first_chunk + chunk_step, …``; gathers past ``W_row`` read 0, stores past ``W_dst`` drop."""
    k0 = tl.arange(0, BLOCK).to(tl.int64)
    for chunk in range(first_chunk, tl.cdiv(n, BLOCK), chunk_step):
        k = k0 + chunk * BLOCK
        m = k < n
        # A scalar condition joins a vector mask through tl.where (Triton 3.9 interpreter).
        v = tl.load(
            req_to_token_ptr + row_base + k, mask=tl.where(row_ok, m & (k < W_row), False), other=0
        )
        dst = dst_start + k
        tl.store(dst_ptr + dst, v, mask=m & (dst < W_dst))


@triton.jit(
    do_not_specialize=["B", "R", "W_row", "stride_row", "extra_tokens", "W_idx", "chunk_programs"]
)
def _verify_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64
    seq_lens_ptr,  # [B] int32|int64
    kv_indices_ptr,  # [W_idx] int32|int64
    kv_indptr_ptr,  # [≥B+1] int32|int64
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    R,
    W_row,
    stride_row,
    extra_tokens,
    W_idx,
    chunk_programs,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(max(B, 1), chunk_programs)``: program ``(b, c)`` copies chunks ``c, c +
    chunk_programs, …`` of request ``b``'s list; ``(b, 0)`` also writes ``kv_indptr[b + 1]``
    (and entry 0 from ``b = 0``) and the status."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    n = tl.where(b < B, L + extra_tokens, 0)
    start = exclusive_length_sum(seq_lens_ptr, b, extra_tokens, BLOCK_B)  # int64: ΣL passes 2**31
    copy_row_prefix(
        req_to_token_ptr, row_base, row_ok, n, W_row, kv_indices_ptr, start, W_idx, c,
        chunk_programs, BLOCK,
    )  # fmt: skip
    if c == 0:
        tl.store(kv_indptr_ptr + b + 1, start + n, mask=b < B)
        tl.store(kv_indptr_ptr + b, start * 0, mask=b == 0)
        if HAS_STATUS:
            bits = (
                tl.where(row_ok, 0, _ROW_OOB)
                | tl.where((n > W_row) | ~L_ok, _POS_OOB, 0)
                | tl.where(start + n > W_idx, _OUT_OF_CAPACITY, 0)
            )
            tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


def _prepare(req_pool_indices, req_to_token, seq_lens, extra_tokens, kv_indices, kv_indptr,
             seq_lens_sum, status):  # fmt: skip
    extra_tokens = validate.positive("extra_tokens", extra_tokens, minimum=0)
    B, device = _check_batch(req_pool_indices, req_to_token, seq_lens)
    if kv_indices is None:
        # Without a host total, size for full rows: no device read, no sync.
        total = seq_lens_sum if seq_lens_sum is not None else B * req_to_token.shape[1]
        width = max(1, verify_kv_indices_need(total, B, extra_tokens))
        kv_indices = torch.empty(width, dtype=req_to_token.dtype, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty(B + 1, dtype=torch.int32, device=device)
    validate.tensor("kv_indices", kv_indices, ndim=1, device=device)
    validate.tensor("kv_indptr", kv_indptr, ndim=1, device=device)
    validate.at_least("kv_indptr", kv_indptr.shape[0], B + 1, "entries (B + 1)")
    if seq_lens_sum is not None:
        if isinstance(seq_lens_sum, bool) or not isinstance(seq_lens_sum, int):
            raise TypeError(f"seq_lens_sum must be a host int, got {type(seq_lens_sum).__name__}")
        need = verify_kv_indices_need(seq_lens_sum, B, extra_tokens)
        validate.at_least("kv_indices", kv_indices.shape[0], need, "entries (ΣL + B*extra)")
    validate.status(status, device)
    return extra_tokens, B, kv_indices, kv_indptr


def verify_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    extra_tokens: int,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build every request's list ``row_b[0 : L_b + extra]`` and its CSR offsets, in one launch.

    Parameters
    ----------
    req_pool_indices : torch.Tensor
        ``[B]`` int32 or int64.
    req_to_token : torch.Tensor
        ``[R, W_row]`` int32 or int64.
    seq_lens : torch.Tensor
        ``[B]`` int32 or int64, committed prefix lengths ``L_b``.
    extra_tokens : int
        Slots after the prefix each request reads: ``N`` for target verify and draft extend,
        0 for the shared prefix of a cascade.
    kv_indices : torch.Tensor, optional
        ``[W_idx]`` int32 or int64; ``ΣL + B·extra`` entries are written, stores past ``W_idx``
        are dropped and reported. Allocated (``req_to_token``'s dtype) when omitted.
    kv_indptr : torch.Tensor, optional
        ``[≥ B + 1]`` int32 or int64; entries ``0 … B`` are written, entry 0 included.
    seq_lens_sum : int, optional
        Host-side ``ΣL``; when given, ``kv_indices`` is checked before launch.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (a list runs past ``W_row`` or ``L < 0``),
        ``OUT_OF_CAPACITY``.

    Returns
    -------
    (kv_indices, kv_indptr) : tuple of torch.Tensor

    Examples
    --------
    ``seq_lens=[3, 1]``, ``extra_tokens=2`` → ``kv_indptr=[0, 5, 8]``,
    ``kv_indices=[r0[0], …, r0[4], r1[0], r1[1], r1[2]]``.

    Grid ``(max(B, 1), chunk_programs)``; every program finds its offset by summing
    ``seq_lens`` with vector loads. No host sync; ``B``, lengths and strides are runtime
    arguments.
    """
    extra_tokens, B, kv_indices, kv_indptr = _prepare(
        req_pool_indices, req_to_token, seq_lens, extra_tokens, kv_indices, kv_indptr,
        seq_lens_sum, status,
    )  # fmt: skip
    device = req_to_token.device
    grid = (max(B, 1), _chunk_programs(device, B, req_to_token.shape[1]))
    _verify_kv_indices_kernel[grid](
        req_pool_indices,
        req_to_token,
        seq_lens,
        kv_indices,
        kv_indptr,
        status if status is not None else kv_indptr,
        # sizes
        B,
        req_to_token.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0),
        extra_tokens,
        kv_indices.shape[0],
        grid[1],
        # code shape
        BLOCK=_BLOCK,
        BLOCK_B=_BLOCK_B,
        HAS_STATUS=status is not None,
        num_warps=4,
    )
    return kv_indices, kv_indptr


def ragged_prefix_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor,
) -> int:
    """``out[start[b] + k] = row_b[k]`` for ``k < lengths[b]`` (stores past ``out`` dropped),
    vectorised; returns the gather status bits (``ROW_OOB``/``POS_OOB``). Shared by the
    references of this module and of the shared-prefix kernel."""
    B = lengths.shape[0]
    if B == 0:
        return 0
    max_len = int(lengths.max())
    k = torch.arange(max_len, device=lengths.device)
    live = k.view(1, -1) < lengths.view(-1, 1)
    vals, _ = gather_rows_ref(req_to_token, req_pool_indices, torch.where(live, k, 0))
    dst = start.view(-1, 1) + k.view(1, -1)
    keep = live & (dst < out.shape[0])
    out[dst[keep]] = vals[keep].to(out.dtype)
    # Only positions inside a list count as gathers (the masked-out tail reads nothing), and a
    # bad row counts even for an empty list, as in the kernel.
    bits = 0
    if bool((live & (k.view(1, -1) >= req_to_token.shape[1])).any()):
        bits |= int(Status.POS_OOB)
    rows = req_pool_indices.to(torch.int64)
    if not bool(((rows >= 0) & (rows < req_to_token.shape[0])).all()):
        bits |= int(Status.ROW_OOB)
    return bits


def verify_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    extra_tokens: int,
    kv_indices: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    seq_lens_sum: int | None = None,
    status: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`verify_kv_indices` (vectorised over the batch; syncs)."""
    extra_tokens, B, kv_indices, kv_indptr = _prepare(
        req_pool_indices, req_to_token, seq_lens, extra_tokens, kv_indices, kv_indptr,
        seq_lens_sum, status,
    )  # fmt: skip
    n = seq_lens.to(torch.int64).clamp_min(0) + extra_tokens
    end = torch.cumsum(n, 0)
    kv_indptr[0] = 0
    kv_indptr[1 : B + 1] = end.to(kv_indptr.dtype)
    bits = ragged_prefix_ref(req_pool_indices, req_to_token, n, kv_indices, end - n)
    if B and bool((seq_lens < 0).any()):
        bits |= int(Status.POS_OOB)
    if B and int(end[-1]) > kv_indices.shape[0]:
        bits |= int(Status.OUT_OF_CAPACITY)
    if status is not None and bits:
        status |= bits
    return kv_indices, kv_indptr
