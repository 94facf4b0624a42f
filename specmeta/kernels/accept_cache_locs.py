"""Accept compaction after verify: accepted verify slots → ``(tgt, src)`` move pairs (design §2.4).

After the target model verifies the draft tree, the KV of each request's accepted nodes moves to
the front of its verify window. :func:`accept_cache_locs` writes the pairs of that move, one
fixed-length list for the whole batch, without a host sync; :func:`move_kv_cache` (in
:mod:`specmeta.kernels.cache_loc_move`) moves them.

The rule. Request ``i`` accepted ``acc_i = accept_lens[i]`` nodes, listed as rows of the
verify (``accept_index[i, :acc_i]``, then ``-1``). Its window starts at row ``s_i`` and holds
``w_i`` tree nodes: ``s_i = i·N``, ``w_i = N`` in the uniform layout; in a ragged verify
(``qo_indptr``, design §2.9) ``s_i = qo_indptr[i]`` and ``w_i = min(qo_indptr[i+1] − s_i, N)``
(rows past ``N`` are the bucket's filler rows, never tree nodes). For ``k < acc_i``::

    tgt[Σ_{i'<i} acc_i' + k] = out_cache_loc[s_i + k]
    src[Σ_{i'<i} acc_i' + k] = out_cache_loc[accept_index[i, k]]

and ``[Σacc, B·C)`` of both is 0 (self-moves of the sink). An accepted entry outside
``[s_i, s_i + w_i)``, at ``k ≥ w_i``, or whose row lies outside ``out_cache_loc``, sets
``BAD_ACCEPT`` and its pair is ``(0, 0)``; the other pairs keep their positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import BAD_ACCEPT, BAD_KV_ID, check_id_spaces, translate_ids, translate_ids_ref

__all__ = ["bind_accept_cache_locs", "accept_cache_locs", "accept_cache_locs_ref"]


# Requests per iteration of the single program's scan (a [128, next_pow2(S+1)] tile, 2048
# entries at S + 1 = 16, is 16 per thread at 4 warps), and tail entries zeroed per iteration.
_BLOCK_B = 128
_BLOCK_TAIL = 1024


@triton.jit(
    do_not_specialize=["B", "N", "C", "stride_acc", "n_out", "n_slots", "num_pages", "page_size"]
)  # fmt: skip
def _accept_cache_locs_kernel(
    accept_index_ptr,  # [B, C] int32|int64, row stride stride_acc
    accept_lens_ptr,  # [B] int32|int64
    out_cache_loc_ptr,  # [≥ B*N] int32|int64 (uniform), [n_slots] (RAGGED)
    qo_indptr_ptr,  # [≥ B+1] int32|int64 (read only with RAGGED; None in the uniform launch)
    tgt_ptr,  # [≥ B*C] int32|int64
    src_ptr,  # [≥ B*C] int32|int64
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE)
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    B,
    N,
    C,
    stride_acc,
    n_out,
    n_slots,  # out_cache_loc.shape[0] (RAGGED; None in the uniform launch)
    num_pages,
    page_size,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next power of two ≥ C
    BLOCK_TAIL: tl.constexpr,
    RAGGED: tl.constexpr,  # windows at qo_indptr[i], else at i·N
    TRANSLATE: tl.constexpr,
    HAS_STATUS: tl.constexpr,
):
    """One program. It walks the requests in blocks of ``BLOCK_B``: one ``tl.cumsum`` per block
    plus a running carry is the whole O(B) prefix sum; then it zeroes ``[Σacc, B·C)``."""
    carry = tl.full([], 0, tl.int64)
    bad = tl.full([], 0, tl.int32)
    unmapped = tl.full([], 0, tl.int32)
    k = tl.arange(0, BLOCK_C)
    col_live = k < C
    for start in range(0, B, BLOCK_B):
        i = start + tl.arange(0, BLOCK_B).to(tl.int64)
        row_live = i < B
        acc_in = tl.load(accept_lens_ptr + i, mask=row_live, other=0).to(tl.int64)
        acc = tl.minimum(tl.maximum(acc_in, 0), C)  # lengths outside [0, C] are clamped
        bad |= tl.max(((acc != acc_in) & row_live).to(tl.int32), axis=0)
        first = tl.cumsum(acc, axis=0) - acc + carry  # exclusive prefix Σ_{i'<i} acc_i'
        carry += tl.sum(acc, axis=0)

        live = row_live[:, None] & col_live[None, :]
        # row·stride and i·N: both products are taken in 64 bits (i is int64).
        idx = tl.load(
            accept_index_ptr + i[:, None] * stride_acc + k[None, :], mask=live, other=-1
        ).to(tl.int64)
        want = k[None, :] < acc[:, None]  # the first acc_i entries are accepted nodes
        if RAGGED:
            # Request i's rows start at qo_indptr[i]; its tree nodes are the first
            # w_i = min(qo_indptr[i+1] - qo_indptr[i], N) of them (later rows are filler). A
            # decreasing entry gives w_i < 0: no entry lies in the window. Both rows a pair
            # reads must lie in out_cache_loc, whatever qo_indptr holds.
            lo = tl.load(qo_indptr_ptr + i, mask=row_live, other=0).to(tl.int64)[:, None]
            hi = tl.load(qo_indptr_ptr + i + 1, mask=row_live, other=0).to(tl.int64)[:, None]
            w = tl.minimum(hi - lo, N)
            ok = want & (idx >= lo) & (idx < lo + w) & (k[None, :] < w)
            row = lo + k[None, :]
            ok = ok & (row >= 0) & (row < n_slots) & (idx >= 0) & (idx < n_slots)
        else:
            lo = i[:, None] * N
            ok = want & (idx >= lo) & (idx < lo + N) & (k[None, :] < N)
        # Invalid: an accepted entry outside the request's own window, or an entry after the
        # run that is not -1 (the -1 run is not a suffix, or accept_lens disagrees).
        wrong = (want & ~ok) | (live & ~want & (idx != -1))
        bad |= tl.max(tl.max(wrong.to(tl.int32), axis=1), axis=0)
        tgt = tl.load(out_cache_loc_ptr + lo + k[None, :], mask=ok, other=0).to(tl.int64)
        src = tl.load(out_cache_loc_ptr + idx, mask=ok, other=0).to(tl.int64)
        if TRANSLATE:  # virtual slots leave as physical ones; a pair with one unmapped is (0, 0)
            tgt, tgt_bad = translate_ids(tgt, ok, v2p_ptr, num_pages, page_size)
            src, src_bad = translate_ids(src, ok, v2p_ptr, num_pages, page_size)
            lost = tgt_bad | src_bad
            unmapped |= tl.max(tl.max(lost.to(tl.int32), axis=1), axis=0)
            tgt = tl.where(lost, 0, tgt)
            src = tl.where(lost, 0, src)
        dst = first[:, None] + k[None, :]  # < Σacc ≤ B·C ≤ n_out
        tl.store(tgt_ptr + dst, tgt, mask=want)
        tl.store(src_ptr + dst, src, mask=want)

    # The tail [Σacc, B·C) is (0, 0): self-moves of the sink, never stale memory.
    for start in range(carry, n_out.to(tl.int64), BLOCK_TAIL):
        e = start + tl.arange(0, BLOCK_TAIL)
        zero = tl.zeros((BLOCK_TAIL,), dtype=tl.int32)
        tl.store(tgt_ptr + e, zero, mask=e < n_out)
        tl.store(src_ptr + e, zero, mask=e < n_out)

    if HAS_STATUS:
        bits = tl.where(bad != 0, BAD_ACCEPT, 0) | tl.where(unmapped != 0, BAD_KV_ID, 0)
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_accept_cache_locs_launch = Launcher(_accept_cache_locs_kernel)


def _check_qo_indptr(where: str, qo_indptr: object, batch: int, device: torch.device) -> None:
    """``qo_indptr`` of a ragged verify: a 1-D int32 or int64 tensor on ``device`` with at least
    ``batch + 1`` entries. Host metadata only: its values are the kernel's to mask and report."""
    fix = ("pass the exclusive prefix sum of the padded verify lengths, [Bp + 1] int32 or int64 "
           "on the call's device (pad_verify_lens_to_bucket's qo_indptr; design §2.9)")  # fmt: skip
    try:
        validate.tensor("qo_indptr", qo_indptr, ndim=1, device=device)
    except TypeError as err:
        raise TypeError(f"{where}: {err}; {fix}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}; {fix}") from None
    if qo_indptr.shape[0] < batch + 1:
        raise ValueError(f"{where}: qo_indptr must have at least B + 1 = {batch + 1} entries "
                         f"(accept_index has B = {batch} rows), got shape "
                         f"{tuple(qo_indptr.shape)}; {fix}")  # fmt: skip


def _prepare_accept(where, accept_index, accept_lens, out_cache_loc, num_draft_tokens, tgt, src,
                    status, v2p, page_size, qo_indptr):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference. Returns ``N``, ``B``,
    ``C``, the pair count ``B·C``, ``tgt``, ``src`` and the status word."""
    n_draft = validate.positive("num_draft_tokens", num_draft_tokens)
    validate.tensor("accept_index", accept_index, ndim=2)
    device = accept_index.device
    validate.positive("page_size", page_size)
    check_id_spaces(where, 0, 0, 1, v2p, device)
    B, C = accept_index.shape
    validate.tensor("accept_lens", accept_lens, ndim=1, device=device)
    validate.length("accept_lens", accept_lens, B)
    validate.tensor("out_cache_loc", out_cache_loc, ndim=1, device=device)
    if qo_indptr is None:
        validate.at_least("out_cache_loc", out_cache_loc.shape[0], B * n_draft, "slots (B*N)")
    else:  # the bucket's token count is a device value: the kernel masks rows past the end
        _check_qo_indptr(where, qo_indptr, B, device)
    pairs = [torch.empty(B * C, dtype=torch.int64, device=device) if buf is None else buf
             for buf in (tgt, src)]  # fmt: skip
    for name, buf in zip(("tgt", "src"), pairs, strict=True):
        validate.tensor(name, buf, ndim=1, device=device)
        validate.at_least(name, buf.shape[0], B * C, "pairs (accept_index.numel())")
    return n_draft, B, C, B * C, *pairs, validate.status(status, device)


def bind_accept_cache_locs(accept_index: torch.Tensor, accept_lens: torch.Tensor,
                           out_cache_loc: torch.Tensor, *, num_draft_tokens: int,
                           tgt: torch.Tensor | None = None, src: torch.Tensor | None = None,
                           status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                           page_size: int = 1,
                           qo_indptr: torch.Tensor | None = None) -> Stage:  # fmt: skip
    """Bind once: compact the accepted verify slots into ``(tgt, src)`` move pairs (design §2.4).

    Request ``i``'s window starts at row ``s_i`` and holds ``w_i`` tree nodes: ``s_i = i·N``,
    ``w_i = N``, or with ``qo_indptr`` (a ragged verify, design §2.9) ``s_i = qo_indptr[i]``,
    ``w_i = min(qo_indptr[i+1] − qo_indptr[i], N)``. For ``acc_i = accept_lens[i]`` and
    ``k < acc_i``::

        tgt[Σ_{i'<i} acc_i' + k] = out_cache_loc[s_i + k]
        src[Σ_{i'<i} acc_i' + k] = out_cache_loc[accept_index[i, k]]

    and ``[Σacc, B·C)`` of both is 0 (self-moves of the sink).

    Parameters
    ----------
    accept_index : torch.Tensor
        ``[B, C]`` int32 or int64, ``C = S + 1``: verify rows ``s_i + node`` (``i·N + node``
        uniform), each row a run of ``acc_i`` accepted nodes followed by ``-1``.
    accept_lens : torch.Tensor
        ``[B]`` int32 or int64, ``acc_i`` = the number of valid entries of row ``i`` (the
        bonus token included: SGLang's ``accept_length + 1``), in ``[0, C]``.
    out_cache_loc : torch.Tensor
        The verify's KV slots, one per query row: ``[≥ B·N]`` int32 or int64, node ``j`` of
        request ``i`` at ``i·N + j``; with ``qo_indptr``, ``[T]`` (any length: a row past it
        is reported), row ``qo_indptr[i] + j``.
    num_draft_tokens : int
        ``N``, the verify-window width (the most tree nodes a request holds).
    tgt, src : torch.Tensor, optional
        ``[≥ B·C]`` int32 or int64 each (``plan_buffers``: ``verify.tgt_cache_loc``,
        ``verify.src_cache_loc``); allocated as int64 when omitted.
    status : torch.Tensor, optional
        ``int32 [1]``; ``BAD_ACCEPT`` is ORed in when an accepted entry lies outside
        ``[s_i, s_i + w_i)``, at ``k ≥ w_i`` or on a row outside ``out_cache_loc``, an entry
        after the run is not ``-1``, or ``accept_lens`` is outside ``[0, C]`` (it is clamped).
        Such a pair is written ``(0, 0)``; the others keep their positions. ``BAD_KV_ID`` when
        a slot did not map through ``v2p`` (its pair is written ``(0, 0)``).
    v2p, page_size : torch.Tensor, int, optional
        A virtual → physical page map at page size ``page_size`` (design §2.10): the verify
        slots are virtual, the pairs physical, ready for :func:`move_kv_cache`.
    qo_indptr : torch.Tensor, optional
        ``[≥ B + 1]`` int32 or int64 on the device: the exclusive prefix sum of the padded
        verify lengths (``pad_verify_lens_to_bucket``'s ``qo_indptr``). Request ``i``'s rows
        are ``qo_indptr[i] … qo_indptr[i+1] − 1``; rows past its first ``N`` are filler, never
        tree nodes. A decreasing entry is an empty window. ``None`` (the default): the uniform
        layout, compiled as without ragged verify.

    Returns
    -------
    Stage
        Its result is ``(tgt, src)`` (tuple of torch.Tensor), what the eager
        :func:`accept_cache_locs` returns. Views ``tgt[:B·C]`` and ``src[:B·C]``, ready for
        :func:`move_kv_cache`.

    Examples
    --------
    ``N=4``, ``accept_index=[[0, 2, -1], [4, -1, -1]]``, ``accept_lens=[2, 1]``,
    ``out_cache_loc=[10, 11, 12, 13, 20, 21, 22, 23]`` →
    ``tgt=[10, 11, 20, 0, 0, 0]``, ``src=[10, 12, 20, 0, 0, 0]``.

    Ragged, ``N=4``, ``qo_indptr=[0, 3, 9]`` (request 1's rows 7 and 8 are filler),
    ``accept_index=[[0, 2, -1], [3, 5, 6]]``, ``accept_lens=[2, 3]``,
    ``out_cache_loc=[10, 11, 12, 20, 21, 22, 23, 24, 25]`` →
    ``tgt=[10, 11, 20, 21, 22, 0]``, ``src=[10, 12, 20, 22, 23, 0]``.

    One program: a ``tl.cumsum`` per block of 128 requests and a carried total, then the tail.
    No host sync; ``B`` is a runtime argument.
    """
    ragged = qo_indptr is not None
    N, B, C, n, tgt, src, status = _prepare_accept("accept_cache_locs", accept_index, accept_lens,
                                                   out_cache_loc, num_draft_tokens, tgt, src,
                                                   status, v2p, page_size, qo_indptr)  # fmt: skip
    if n == 0:
        return Stage([], result=(tgt[:0], src[:0]))
    launch = _accept_cache_locs_launch.bind(
        (1,), accept_index_ptr=accept_index, accept_lens_ptr=accept_lens,
        out_cache_loc_ptr=out_cache_loc, qo_indptr_ptr=qo_indptr, tgt_ptr=tgt, src_ptr=src,
        v2p_ptr=v2p if v2p is not None else tgt, status_ptr=status,
        B=B, N=N, C=C, stride_acc=accept_index.stride(0), n_out=n,
        n_slots=out_cache_loc.shape[0] if ragged else None,
        num_pages=v2p.shape[0] if v2p is not None else 0, page_size=page_size,
        BLOCK_B=_BLOCK_B, BLOCK_C=next_power_of_2(C), BLOCK_TAIL=_BLOCK_TAIL,
        RAGGED=ragged, TRANSLATE=v2p is not None, HAS_STATUS=True, num_warps=4,
    )  # fmt: skip
    return Stage([launch], result=(tgt[:n], src[:n]))


accept_cache_locs = launcher(bind_accept_cache_locs)
accept_cache_locs.kernels = (_accept_cache_locs_kernel,)  # for specmeta.registry


def accept_cache_locs_ref(accept_index: torch.Tensor, accept_lens: torch.Tensor,
                          out_cache_loc: torch.Tensor, *, num_draft_tokens: int,
                          tgt: torch.Tensor | None = None, src: torch.Tensor | None = None,
                          status: torch.Tensor | None = None, v2p: torch.Tensor | None = None,
                          page_size: int = 1, qo_indptr: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Pure-torch :func:`accept_cache_locs` (vectorised over the batch; syncs)."""
    N, B, C, n, tgt, src, status = _prepare_accept("accept_cache_locs_ref", accept_index,
                                                   accept_lens, out_cache_loc, num_draft_tokens,
                                                   tgt, src, status, v2p, page_size,
                                                   qo_indptr)  # fmt: skip
    if n == 0:
        return tgt[:0], src[:0]
    device = accept_index.device
    acc_in = accept_lens.to(torch.int64)
    acc = acc_in.clamp(0, C)
    idx = accept_index.to(torch.int64)
    k = torch.arange(C, device=device).view(1, -1)
    want = k < acc.view(-1, 1)
    if qo_indptr is None:
        lo = torch.arange(B, device=device).view(-1, 1) * N
        ok = want & (idx >= lo) & (idx < lo + N) & (k < N)
    else:  # ragged windows (design §2.9): the first min(length, N) rows of each are tree nodes
        q = qo_indptr[: B + 1].to(torch.int64)
        lo, w = q[:-1].view(-1, 1), (q[1:] - q[:-1]).clamp_max(N).view(-1, 1)
        rows = out_cache_loc.shape[0]
        ok = want & (idx >= lo) & (idx < lo + w) & (k < w)
        ok &= (lo + k >= 0) & (lo + k < rows) & (idx >= 0) & (idx < rows)
    wrong = (want & ~ok) | (~want & (idx != -1))
    slots = F.pad(out_cache_loc.to(torch.int64), (0, 1))  # one more entry: row 0 always exists
    dst = (torch.cumsum(acc, 0) - acc).view(-1, 1) + k
    pairs = torch.zeros(2, n, dtype=torch.int64, device=device)
    ends = [torch.where(ok, slots[torch.where(ok, pick, 0)], 0) for pick in (lo + k, idx)]
    if v2p is not None:  # a pair with an unmapped slot is (0, 0)
        (t, t_bad), (s, s_bad) = (translate_ids_ref(e, ok, v2p, page_size) for e in ends)
        lost = t_bad | s_bad
        ends = [torch.where(lost, 0, t), torch.where(lost, 0, s)]
        if bool(lost.any()):
            status |= int(Status.BAD_KV_ID)
    for row, end in zip(pairs, ends, strict=True):
        row[dst[want]] = end[want]
    tgt[:n], src[:n] = pairs
    if bool(wrong.any()) or bool((acc != acc_in).any()):
        status |= int(Status.BAD_ACCEPT)
    return tgt[:n], src[:n]
