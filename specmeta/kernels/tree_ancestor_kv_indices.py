"""Per-node ancestor lists of a verify tree in CSR form: FlashInfer MLA's ancestor pass (design §3.5).

Node ``i`` of request ``b`` is list ``r = b·N + i``; it holds the verify slots of the nodes the
tree mask marks for it (its ancestors and itself, ``m[b, i, j] = 1``), in increasing ``j``::

    kv_len[r]                       = Σ_j m[b, i, j]                   for r < B·N
    kv_indptr[r]                    = Σ_{r'<r} kv_len[r']              for r in [0, B·N]
    kv_indices[kv_indptr[r] + k]    = id(row_b, L_b + j_k)             j_0 < j_1 < … the set j

ids read in the row's id space (design §2.10: token or page entries, virtual ids through
``v2p``). One query row a list, page size 1: the cascade's ancestor pass, merged with the prefix
pass by LSE. ``kv_indptr`` is built on the device from the mask; FlashInfer's ``plan()`` reads
its host copy, which the host part writes from the engine's node depths
(:func:`tree_ancestor_host_mirrors_torch`, ``kv_len = depth + 1``), and the build's launches
check that copy (design §3.5).

A mask is device data: a row with more ones than a valid tree has (every column, say) is still
listed, and the lists are planned for ``B·N·N`` entries (:func:`tree_ancestor_kv_indices_need`),
every mask's worst case; a smaller ``kv_indices`` drops what falls past it (``OUT_OF_CAPACITY``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import validate
from ..launch import Launcher, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import (
    BAD_KV_ID,
    OUT_OF_CAPACITY,
    POS_OOB,
    ROW_OOB,
    ancestor_order,
    batch_arguments,
    check_batch,
    check_id_spaces,
    host_int,
    id_space_arguments,
    load_kv_ids,
    load_kv_ids_ref,
    load_request,
)

__all__ = [
    "bind_tree_ancestor_kv_indices",
    "tree_ancestor_kv_indices",
    "tree_ancestor_kv_indices_ref",
    "tree_ancestor_kv_indices_need",
    "tree_ancestor_host_mirrors_torch",
    "AncestorMirrors",
]

# kv_len entries summed per iteration of a program's offset loop (B·N up to 1024 in one load).
_BLOCK_S = 1024


def tree_ancestor_kv_indices_need(batch: int, num_draft_tokens: int) -> int:
    """Entries of the ancestor lists planned for a batch: ``B·N·N``, the most any ``[B, N, N]``
    mask lists (a valid tree lists ``Σ (depth + 1) ≤ B·N·(N + 1)/2``; the mask is device data,
    so the plan covers every mask and a wrong one is never written past the buffer)."""
    return batch * num_draft_tokens * num_draft_tokens


@triton.jit(do_not_specialize=["B", "N", "stride_mb", "stride_mj"])
def _tree_ancestor_counts_kernel(
    tree_mask_ptr,  # [B, N, N] uint8 (bool viewed as bytes), strides (stride_mb, stride_mj, 1)
    kv_len_ptr,  # [≥B*N] int32|int64
    B,
    N,
    stride_mb,
    stride_mj,
    BLOCK_N: tl.constexpr,  # next power of two ≥ N
):
    """Grid ``(max(B, 1),)``: program ``b`` counts the ones of request ``b``'s ``N`` mask rows."""
    b = tl.program_id(0).to(tl.int64)
    live = b < B
    jj = tl.arange(0, BLOCK_N)[:, None]
    cc = tl.arange(0, BLOCK_N)[None, :]
    in_tile = tl.where(live, (jj < N) & (cc < N), False)
    m = tl.load(tree_mask_ptr + b * stride_mb + jj * stride_mj + cc, mask=in_tile, other=0)
    cnt = tl.sum((in_tile & (m != 0)).to(tl.int32), axis=1)
    j = tl.arange(0, BLOCK_N)
    tl.store(kv_len_ptr + b * N + j, cnt, mask=tl.where(live, j < N, False))


@triton.jit(
    do_not_specialize=["B", "R", "W_row", "stride_row", "N", "stride_mb", "stride_mj", "W_idx",
                       "num_pages", "page_size"]
)  # fmt: skip
def _tree_ancestor_kv_indices_kernel(
    req_pool_indices_ptr,  # [B] int32|int64
    req_to_token_ptr,  # [R, W_row] int32|int64: token ids, or page ids (ENTRY_PAGE_SIZE > 1)
    seq_lens_ptr,  # [B] int32|int64
    tree_mask_ptr,  # [B, N, N] uint8 (bool viewed as bytes), strides (stride_mb, stride_mj, 1)
    kv_len_ptr,  # [≥B*N] int32|int64: the counts of _tree_ancestor_counts_kernel (read)
    kv_indptr_ptr,  # [≥B*N+1] int32|int64
    kv_indices_ptr,  # [W_idx] int32|int64
    v2p_ptr,  # [num_pages] int32|int64 (read only with TRANSLATE), or None
    status_ptr,  # [1] int32
    B,
    R,
    W_row,
    stride_row,
    N,
    stride_mb,
    stride_mj,
    W_idx,
    num_pages,  # v2p's pages (None unless TRANSLATE)
    page_size,  # the pool's page size v2p maps (None unless TRANSLATE)
    BLOCK_N: tl.constexpr,  # next power of two ≥ N
    BLOCK_S: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr,  # E > 1: rows of page ids (design §2.10)
    TRANSLATE: tl.constexpr,  # ids leave through v2p
):
    """Grid ``(max(B, 1),)``: program ``b`` finds where its lists start by summing the counts
    of the ``b·N`` lists before them (vector loads), then writes its ``N`` offsets and scatters
    its verify slots into its nodes' lists; program 0 also writes ``kv_indptr[0]``."""
    b = tl.program_id(0).to(tl.int64)
    live = b < B
    row_base, L, row_ok, L_ok = load_request(
        req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row
    )
    # b·N counts before this request's: each ≤ N, so the sum stays below B·N·N.
    before = b * N
    start = b * 0
    for s0 in range(0, before, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        start += tl.sum(tl.load(kv_len_ptr + offs, mask=offs < before, other=0).to(tl.int64), 0)

    jj = tl.arange(0, BLOCK_N)[:, None]  # node i: the list's query row
    cc = tl.arange(0, BLOCK_N)[None, :]  # column j: a node whose slot the list may hold
    in_tile = tl.where(live, (jj < N) & (cc < N), False)
    m = tl.load(tree_mask_ptr + b * stride_mb + jj * stride_mj + cc, mask=in_tile, other=0)
    m = in_tile & (m != 0)
    rank, cnt = ancestor_order(m, cc)  # rank of column j in row i's list (set columns first)
    cnt = cnt.to(tl.int64)
    end = start + tl.cumsum(cnt, 0)  # kv_indptr[b·N + i + 1]
    first = end - cnt

    n = tl.arange(0, BLOCK_N)
    rows = tl.where(live, n < N, False)
    tl.store(kv_indptr_ptr + b * N + 1 + n, end, mask=rows)
    tl.store(kv_indptr_ptr + b * 0, start * 0, mask=b == 0)

    # The window's ids, read as the row's id space says (design §2.10).
    slot, _, bad = load_kv_ids(req_to_token_ptr + row_base, L + n, tl.where(row_ok, rows, False),
                               W_row, v2p_ptr, num_pages, page_size, ENTRY_PAGE_SIZE,
                               TRANSLATE)  # fmt: skip
    dst = first[:, None] + rank
    keep = m & (dst < W_idx)
    tl.store(kv_indices_ptr + dst, slot[None, :] + 0 * dst, mask=keep)

    stored_bad = tl.max(tl.where(keep, bad[None, :], False).to(tl.int32), axis=1)
    bits = (
        tl.where(row_ok, 0, ROW_OOB)
        | tl.where((live & (L + N > W_row * ENTRY_PAGE_SIZE)) | ~L_ok, POS_OOB, 0)
        | tl.where(start + tl.sum(cnt, 0) > W_idx, OUT_OF_CAPACITY, 0)
        | tl.where(tl.max(stored_bad, axis=0) != 0, BAD_KV_ID, 0)
    )
    tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_COUNTS = Launcher(_tree_ancestor_counts_kernel)
_LISTS = Launcher(_tree_ancestor_kv_indices_kernel)


def _prepare(where, req_pool_indices, req_to_token, seq_lens, tree_mask, kv_len, kv_indptr,
             kv_indices, kv_len_sum, status, entry_page_size, v2p, page_size):  # fmt: skip
    """Validate and allocate; shared by the launcher and the reference."""
    B, device = check_batch(req_pool_indices, req_to_token, seq_lens)
    check_id_spaces(where, 0, 0, entry_page_size, v2p, device)
    validate.positive("page_size", page_size)
    validate.tensor("tree_mask", tree_mask, dtypes=(torch.bool, torch.uint8), ndim=3,
                    device=device)  # fmt: skip
    N = tree_mask.shape[1]
    if tree_mask.shape != (B, N, N) or N < 1:
        raise ValueError(
            f"{where}: tree_mask must have shape [B, N, N] = [{B}, N, N] with N >= 1, got "
            f"{tuple(tree_mask.shape)}; pass the verify tree's ancestor mask of this batch"
        )
    BN = B * N
    if kv_len is None:
        kv_len = torch.empty(BN, dtype=torch.int32, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty(BN + 1, dtype=torch.int32, device=device)
    if kv_indices is None:
        need = max(1, tree_ancestor_kv_indices_need(B, N))
        kv_indices = torch.empty(need, dtype=req_to_token.dtype, device=device)
    validate.tensor("kv_len", kv_len, ndim=1, device=device)
    validate.at_least("kv_len", kv_len.shape[0], BN, "entries (B*N)")
    validate.tensor("kv_indptr", kv_indptr, ndim=1, device=device)
    validate.at_least("kv_indptr", kv_indptr.shape[0], BN + 1, "entries (B*N + 1)")
    validate.tensor("kv_indices", kv_indices, ndim=1, device=device)
    if kv_len_sum is not None:
        host_int("kv_len_sum", kv_len_sum)
        validate.at_least("kv_indices", kv_indices.shape[0], kv_len_sum,
                          "entries (kv_len_sum, the host's total of the lists)")  # fmt: skip
    status = validate.status(status, device)
    return B, N, kv_len, kv_indptr, kv_indices, status


def bind_tree_ancestor_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    kv_len: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_len_sum: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
) -> Stage:
    """Bind once: every tree node's ancestor list (its ancestors' and its own verify slots) in
    CSR form, one list a node, for FlashInfer MLA's tree-verify ancestor pass (design §3.5).

    Parameters
    ----------
    req_pool_indices, req_to_token, seq_lens : torch.Tensor
        ``[B]``, ``[R, W_row]``, ``[B]`` int32 or int64; node ``j``'s KV slot is at row
        position ``L_b + j``.
    tree_mask : torch.Tensor
        ``[B, N, N]`` bool (or uint8), unit stride in the last dimension: ``m[b, i, j]`` is 1
        iff ``j == i`` or ``j`` is an ancestor of ``i`` (design §3.3). Any bit pattern is
        listed as it is.
    kv_len : torch.Tensor, optional
        ``[≥ B·N]`` int32 or int64: list ``r = b·N + i`` has ``Σ_j m[b, i, j]`` entries
        (FlashInfer's ``kv_len_arr``, tokens). Allocated int32 when omitted.
    kv_indptr : torch.Tensor, optional
        ``[≥ B·N + 1]`` int32 or int64: the exclusive sums of ``kv_len``, entry 0 included.
        Allocated int32 when omitted.
    kv_indices : torch.Tensor, optional
        ``[W_idx]`` int32 or int64: list ``r`` at ``kv_indptr[r]``, stores past ``W_idx``
        dropped and reported. Allocated (``req_to_token``'s dtype) with
        :func:`tree_ancestor_kv_indices_need` entries, ``B·N·N``, when omitted.
    kv_len_sum : int, optional
        The host's total of the lists (``Σ (depth + 1)``, what
        :func:`tree_ancestor_host_mirrors_torch` returns): ``kv_indices`` is checked for it
        before launch.
    status : torch.Tensor, optional
        ``int32 [1]``: ``ROW_OOB``, ``POS_OOB`` (``L_b + N`` past the row's ``W_row·E``
        positions, or ``L_b < 0``: those slots read 0), ``OUT_OF_CAPACITY`` (the lists pass
        ``W_idx``), ``BAD_KV_ID`` (an id stored that did not map: the sink slot 0).
    entry_page_size, v2p, page_size
        The rows' id space (design §2.10): page ids of ``entry_page_size`` positions each,
        virtual ids emitted through the page map ``v2p`` at the pool's page size
        ``page_size``. Defaults: rows of token ids, as they are.

    Returns
    -------
    Stage
        Its result is ``(kv_indices, kv_indptr, kv_len)`` (tuple of torch.Tensor), what the
        eager :func:`tree_ancestor_kv_indices` returns.

    Examples
    --------
    ``N=3``, nodes 1 and 2 children of the root, ``L=5``, row ``[…, 50, 51, 52]`` at
    positions 5, 6, 7 → ``kv_len=[1, 2, 2]``, ``kv_indptr=[0, 1, 3, 5]``,
    ``kv_indices=[50, 50, 51, 50, 52]``.

    Two launches, no host sync: grid ``(max(B, 1),)`` counts each request's mask rows into
    ``kv_len``; grid ``(max(B, 1),)`` then sums the counts before each request with vector
    loads (``B·N`` ints, where a sum over the masks of every earlier request would read
    ``O(b·N²)`` bytes a program), writes the offsets and scatters the slots. ``B``, ``N``,
    lengths and strides are runtime arguments.
    """
    B, N, kv_len, kv_indptr, kv_indices, status = _prepare(
        "tree_ancestor_kv_indices", req_pool_indices, req_to_token, seq_lens, tree_mask, kv_len,
        kv_indptr, kv_indices, kv_len_sum, status, entry_page_size, v2p, page_size,
    )  # fmt: skip
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    grid = (max(B, 1),)
    block_n = next_power_of_2(N)
    counts = _COUNTS.bind(grid, tree_mask_ptr=mask, kv_len_ptr=kv_len, B=B, N=N,
                          stride_mb=mask.stride(0), stride_mj=mask.stride(1), BLOCK_N=block_n,
                          num_warps=4)  # fmt: skip
    lists = _LISTS.bind(
        grid,
        **batch_arguments(req_pool_indices, req_to_token, seq_lens),
        tree_mask_ptr=mask,
        kv_len_ptr=kv_len,
        kv_indptr_ptr=kv_indptr,
        kv_indices_ptr=kv_indices,
        status_ptr=status,
        N=N,
        stride_mb=mask.stride(0),
        stride_mj=mask.stride(1),
        W_idx=kv_indices.shape[0],
        page_size=page_size if v2p is not None else None,
        **id_space_arguments(entry_page_size, v2p),
        BLOCK_N=block_n,
        BLOCK_S=_BLOCK_S,
        num_warps=4,
    )
    return Stage([counts, lists], result=(kv_indices, kv_indptr, kv_len))


tree_ancestor_kv_indices = launcher(bind_tree_ancestor_kv_indices)
# for specmeta.registry
tree_ancestor_kv_indices.kernels = (_tree_ancestor_counts_kernel, _tree_ancestor_kv_indices_kernel)


def tree_ancestor_kv_indices_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    kv_len: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_len_sum: int | None = None,
    status: torch.Tensor | None = None,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`tree_ancestor_kv_indices` (vectorised; syncs)."""
    B, N, kv_len, kv_indptr, kv_indices, status = _prepare(
        "tree_ancestor_kv_indices_ref", req_pool_indices, req_to_token, seq_lens, tree_mask,
        kv_len, kv_indptr, kv_indices, kv_len_sum, status, entry_page_size, v2p, page_size,
    )  # fmt: skip
    BN, W_idx = B * N, kv_indices.shape[0]
    m = tree_mask.to(torch.bool)
    counts = m.sum(-1).reshape(BN)
    end = torch.cumsum(counts, 0)
    kv_len[:BN] = counts.to(kv_len.dtype)
    kv_indptr[0] = 0
    kv_indptr[1 : BN + 1] = end.to(kv_indptr.dtype)
    if B == 0:
        return kv_indices, kv_indptr, kv_len
    L = seq_lens.to(torch.int64)
    c = torch.arange(N, device=L.device)
    read = torch.ones(B, N, dtype=torch.bool, device=L.device)
    slots, bad, bits = load_kv_ids_ref(
        req_to_token,
        req_pool_indices,
        L.clamp_min(0).view(-1, 1) + c,
        read,
        entry_page_size=entry_page_size,
        v2p=v2p,
        page_size=page_size,
    )  # [B, N]: the window's ids (design §2.10); POS_OOB where a slot lies past the row
    rank = torch.cumsum(m.to(torch.int64), -1) - 1  # column j's place in row i's list
    dst = (end - counts).view(B, N, 1) + rank
    keep = m & (dst < W_idx)
    kv_indices[dst[keep]] = slots.view(B, 1, N).expand(B, N, N)[keep].to(kv_indices.dtype)
    if bool((keep & bad.view(B, 1, N)).any()):
        bits |= int(Status.BAD_KV_ID)
    if bool((L < 0).any()):
        bits |= int(Status.POS_OOB)
    if int(end[-1]) > W_idx:
        bits |= int(Status.OUT_OF_CAPACITY)
    if bits:
        status |= bits
    return kv_indices, kv_indptr, kv_len


# --------------------------------------------------------------------------------------------
# The host side: the mirrors FlashInfer's plan() reads, from the engine's node depths.
# --------------------------------------------------------------------------------------------
class AncestorMirrors(NamedTuple):
    """What :func:`tree_ancestor_host_mirrors_torch` wrote, and what a host part publishes for
    the device check (``publish_host_lengths(slot, lists, total, longest)``, design §3)."""

    qo_indptr: torch.Tensor  # [B·N + 1] int32: one query row a list
    kv_indptr: torch.Tensor  # [B·N + 1] int32: exclusive sums of kv_len
    kv_len: torch.Tensor  # [B·N] int32: depth + 1
    lists: int  # B·N
    total: int  # Σ kv_len, kv_indptr[B·N]
    longest: int  # max kv_len (0 for an empty batch)


_HOST_WHERE = "tree_ancestor_host_mirrors_torch"


def _host_view(name: str, t: object, need: int) -> torch.Tensor:
    """The first ``need`` entries of a caller's mirror, after checking it is a 1-D int32 CPU
    tensor with unit stride and room for them; a new int32 tensor when ``t`` is None."""
    if t is None:
        return torch.empty(need, dtype=torch.int32)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{_HOST_WHERE}: {name} must be an int32 CPU tensor, got {got}; pass "
                        "the pass's int32 host mirror (plan() reads int32)")  # fmt: skip
    if (
        t.device.type != "cpu"
        or t.dim() != 1
        or t.shape[0] < need
        or (need > 1 and t.stride(0) != 1)
    ):
        raise ValueError(f"{_HOST_WHERE}: {name} must be a 1-D CPU view of at least {need} "
                         f"entries with unit stride, got shape {list(t.shape)}, strides "
                         f"{list(t.stride())} on {t.device}; pass the mirror sized for B*N "
                         "lists")  # fmt: skip
    return t[:need]


def tree_ancestor_host_mirrors_torch(
    node_depths_cpu: torch.Tensor,
    *,
    qo_indptr_host: torch.Tensor | None = None,
    kv_indptr_host: torch.Tensor | None = None,
    kv_len_host: torch.Tensor | None = None,
) -> AncestorMirrors:
    """The host mirrors of the ancestor pass (design §3.5), from the engine's CPU copy of its
    draft tree's node depths, in torch (a compiled host op may take its name without
    ``_torch`` later, as design §3's writers do)::

        kv_len_host[r]     = depth[b, i] + 1                     r = b·N + i
        kv_indptr_host     = [0, cumsum(kv_len_host)]
        qo_indptr_host     = arange(B·N + 1)                     one query row a list

    Every depth is checked in ``[0, N − 1]`` before anything is written; that is all the host
    can know of the tree, and the device check of design §3 compares the copy with the mask.

    Parameters
    ----------
    node_depths_cpu : torch.Tensor
        ``[B, N]`` int32 or int64 on the CPU: node ``i``'s depth in request ``b``'s tree, the
        root 0 (its ancestor count, itself included, is ``depth + 1``).
    qo_indptr_host, kv_indptr_host, kv_len_host : torch.Tensor, optional
        int32 CPU views of at least ``B·N + 1``, ``B·N + 1`` and ``B·N`` entries (pinned for a
        CUDA build); the first that many are written. Allocated when omitted.

    Returns
    -------
    AncestorMirrors
        The written views and ``(lists, total, longest) = (B·N, Σ kv_len, max kv_len)``.

    Examples
    --------
    ``node_depths_cpu=[[0, 1, 1]]`` → ``kv_len_host=[1, 2, 2]``,
    ``kv_indptr_host=[0, 1, 3, 5]``, ``qo_indptr_host=[0, 1, 2, 3]``; total 5, longest 2.
    """
    d = node_depths_cpu
    if not isinstance(d, torch.Tensor) or d.dtype not in (torch.int32, torch.int64):
        got = d.dtype if isinstance(d, torch.Tensor) else type(d).__name__
        raise TypeError(f"{_HOST_WHERE}: node_depths_cpu must be an int32 or int64 tensor, got "
                        f"{got}; pass the draft tree's node depths as integers")  # fmt: skip
    if d.device.type != "cpu" or d.dim() != 2 or d.shape[1] < 1:
        raise ValueError(f"{_HOST_WHERE}: node_depths_cpu must be a [B, N] CPU tensor with N >= "
                         f"1, got shape {list(d.shape)} on {d.device}; pass the engine's host "
                         "copy of the depths (as verify_lens_cpu is copied)")  # fmt: skip
    B, N = d.shape
    BN = B * N
    bad = (d < 0) | (d >= N)
    if BN and bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{_HOST_WHERE}: node_depths_cpu[{b}, {i}] = {int(d[b, i])} is outside [0, N - 1] = "
            f"[0, {N - 1}]; pass each node's depth in its request's tree (the root 0), from "
            "this batch's tree"
        )
    qo = _host_view("qo_indptr_host", qo_indptr_host, BN + 1)
    indptr = _host_view("kv_indptr_host", kv_indptr_host, BN + 1)
    lens = _host_view("kv_len_host", kv_len_host, BN)
    lens.copy_(d.reshape(BN))
    lens += 1
    indptr[0] = 0
    torch.cumsum(lens, 0, dtype=torch.int32, out=indptr[1:])
    torch.arange(BN + 1, dtype=torch.int32, out=qo)
    longest = int(lens.max()) if BN else 0
    return AncestorMirrors(qo, indptr, lens, BN, int(indptr[BN]), longest)
