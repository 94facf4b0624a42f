"""What the kernels share: status bits, batch checks, grid sizing, device and torch helpers.

Each op module (``kernels/<op>.py``) holds one op's kernel, launcher and reference. What more
than one op needs lives here, once, and op modules import it from here, never from each other's
private names (``tests/kernels/test_structure.py`` checks the imports).

* **Status bits** as ``tl.constexpr`` globals (kernels read only constexpr globals), equal to
  :class:`specmeta.status.Status` by construction.
* **Host checks, launch keywords and grid sizing**: :func:`check_batch`, :func:`check_steps`,
  :func:`host_int`, :func:`sizing_total`, :func:`batch_arguments`, :func:`target_programs`,
  :func:`chunk_programs`, :func:`vector_widths`, :func:`check_verify_lens`,
  :func:`check_id_spaces`, :func:`id_space_arguments`.
* **Device helpers**: one ``@triton.jit`` function per rule several kernels apply
  (:func:`load_request`, :func:`draft_slot_position`, :func:`exclusive_length_sum`,
  :func:`copy_row_prefix`, :func:`copy_list_at`, :func:`copy_ragged_list`, :func:`branch_page`,
  :func:`branch_position`,
  :func:`load_verify_len`, :func:`load_verify_rows`, and the id spaces of design §2.10:
  :func:`windowed_length`, :func:`window_position`, :func:`load_kv_ids`, :func:`translate_ids`).
* **Torch helpers** the references share (:func:`gather_rows_ref`, :func:`draft_positions_ref`,
  :func:`ragged_prefix_ref`, :func:`branch_pages_ref`, :func:`branch_positions_ref`,
  :func:`or_status`,
  :func:`verify_lens_ref`, :func:`verify_rows_ref`, :func:`windowed_length_ref`,
  :func:`load_kv_ids_ref`, :func:`translate_ids_ref`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import uses_layout_b
from ..launch import cdiv
from ..status import Status

# --------------------------------------------------------------------------------------------
# Status bits (design §2.5), as the kernels read them.
# --------------------------------------------------------------------------------------------
ROW_OOB = tl.constexpr(int(Status.ROW_OOB))
POS_OOB = tl.constexpr(int(Status.POS_OOB))
OUT_OF_CAPACITY = tl.constexpr(int(Status.OUT_OF_CAPACITY))
POOL_OOB = tl.constexpr(int(Status.POOL_OOB))
BAD_ACCEPT = tl.constexpr(int(Status.BAD_ACCEPT))
BAD_PAGE = tl.constexpr(int(Status.BAD_PAGE))
STALE_HOST_LENGTHS = tl.constexpr(int(Status.STALE_HOST_LENGTHS))
BAD_KV_ID = tl.constexpr(int(Status.BAD_KV_ID))


# --------------------------------------------------------------------------------------------
# Host side: argument checks and grid sizing (host-known sizes only, never a device value).
# --------------------------------------------------------------------------------------------
def check_batch(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[int, torch.device]:
    """Check the batch triple every row-reading op takes; returns ``(B, device)``."""
    validate.tensor("req_to_token", req_to_token, ndim=2)
    device = req_to_token.device
    validate.tensor("req_pool_indices", req_pool_indices, ndim=1, device=device)
    validate.tensor("seq_lens", seq_lens, ndim=1, device=device)
    validate.length("seq_lens", seq_lens, req_pool_indices.shape[0])
    return req_pool_indices.shape[0], device


def check_steps(
    topk: object, num_steps: object, page_size: object, num_rows: object
) -> tuple[int, int, int, int]:
    """Check the draft shape every step-row op takes, ``K``, ``S``, ``ps`` ≥ 1 and ``num_rows``
    in ``[0, S]`` (``None``: ``S``); returns ``(topk, num_steps, page_size, rows)``."""
    topk = validate.positive("topk", topk)
    num_steps = validate.positive("num_steps", num_steps)
    page_size = validate.positive("page_size", page_size)
    rows = num_steps if num_rows is None else validate.positive("num_rows", num_rows, minimum=0)
    if rows > num_steps:
        raise ValueError(f"num_rows must be <= num_steps={num_steps}, got {rows}")
    return topk, num_steps, page_size, rows


def host_int(name: str, value: object) -> int:
    """``value``, a Python int the caller holds on the host (``seq_lens_sum``, ``max_seq_len``:
    read before launch, never from the device); bools rejected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a host int, got {type(value).__name__}")
    return value


def sizing_total(seq_lens_sum: int | None, batch: int, req_to_token: torch.Tensor) -> int:
    """The ``ΣL`` an omitted output is sized for: the host's ``seq_lens_sum`` when given, else
    full rows (``B·W_row``), so that sizing reads nothing from the device (no sync)."""
    return seq_lens_sum if seq_lens_sum is not None else batch * req_to_token.shape[1]


def batch_arguments(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor
) -> dict:
    """The launch keywords of the batch triple (checked by :func:`check_batch`) that every
    row-reading kernel takes under the same names: its three pointers, ``B``, ``R``, ``W_row``
    and ``stride_row``."""
    return dict(
        req_pool_indices_ptr=req_pool_indices,
        req_to_token_ptr=req_to_token,
        seq_lens_ptr=seq_lens,
        B=req_pool_indices.shape[0],
        R=req_to_token.shape[0],
        W_row=req_to_token.shape[1],
        stride_row=req_to_token.stride(0),
    )


@functools.lru_cache(maxsize=32)
def target_programs(device: torch.device, per_sm: int = 8, cpu: int = 4) -> int:
    """Programs that keep the device busy: ``per_sm`` per multiprocessor on CUDA; ``cpu`` under
    the CPU interpreter, where each program costs host time. Cached: it sits on build paths."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return cpu


def chunk_programs(device: torch.device, batch: int, width: int, block: int) -> int:
    """Programs per request: enough for the grid to fill the device even when a few long
    requests carry all the work, never more than a ``width``-entry row has ``block`` chunks."""
    per_request = cdiv(target_programs(device), max(batch, 1))
    return max(1, min(per_request, cdiv(width, block)))


def entries_per_vector(table: torch.Tensor, width: int) -> int:
    """Entries of ``table`` per 16-byte vector when every row of it starts 16-byte aligned and
    the ``width`` entries a kernel reaches in a row are whole vectors; else 1 (scalar access).
    Host arithmetic on the tensor's address and strides: no sync."""
    size = table.element_size()
    per = 16 // size
    aligned = table.data_ptr() % 16 == 0 and table.stride(0) * size % 16 == 0
    return per if aligned and width % per == 0 else 1


def vector_widths(req_to_token: torch.Tensor, page_table: torch.Tensor, page_size: int) -> dict:
    """``VEC_IN`` and ``VEC_OUT`` of a page-table launch: a row gather at page size 1 loads
    whole vectors, a table's rows are stored in whole vectors (a strided gather, ps > 1, cannot
    be vector loads). Rows of ``SpecConfig.req_to_token_width`` and the planned page tables
    qualify: the width is a whole number of 16 positions."""
    vec_in = entries_per_vector(req_to_token, req_to_token.shape[1]) if page_size == 1 else 1
    return dict(VEC_IN=vec_in, VEC_OUT=entries_per_vector(page_table, page_table.shape[1]))


def check_verify_lens(where: str, verify_lens: object, batch: int,
                      device: torch.device) -> torch.Tensor:  # fmt: skip
    """Check the optional ``verify_lens`` of a ragged target verify (design §3.2, §3.3): a
    ``[batch]`` int32 or int64 tensor on ``device``. Host metadata only: the values (each
    ``v_b`` in ``[0, N]``) are the kernels' to mask and report. Messages name ``where``."""
    try:
        validate.tensor("verify_lens", verify_lens, ndim=1, device=device)
    except TypeError as err:
        raise TypeError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if verify_lens.shape[0] != batch:
        raise ValueError(
            f"{where}: verify_lens must have one entry per request, B = {batch}, got shape "
            f"{tuple(verify_lens.shape)}; pass the [B] verify lengths of this batch (in a "
            "captured bucket, pad_verify_lens_to_bucket's lengths of all Bp requests)"
        )
    return verify_lens


def check_expand_outputs(page_table: object, cache_seqlens: object, cu_seqlens_k: object,
                         rows: int, N: int, device: torch.device,
                         what: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The outputs of an FA3 verify expand pass of ``rows`` rows (``what`` names the count in
    messages) and ``N`` nodes: ``page_table [≥ rows, ≥ N]``, ``cache_seqlens [≥ rows]``
    (each allocated int32 when ``None``) and the optional ``cu_seqlens_k [≥ rows + 1]``, all
    on ``device``. Returns the first two."""
    if page_table is None:
        page_table = torch.empty((rows, N), dtype=torch.int32, device=device)
    if cache_seqlens is None:
        cache_seqlens = torch.empty(rows, dtype=torch.int32, device=device)
    validate.tensor("page_table", page_table, ndim=2, device=device)
    validate.at_least("page_table", page_table.shape[0], rows, f"rows ({what})")
    validate.at_least("page_table", page_table.shape[1], N, "columns (N)")
    validate.tensor("cache_seqlens", cache_seqlens, ndim=1, device=device)
    validate.at_least("cache_seqlens", cache_seqlens.shape[0], rows)
    if cu_seqlens_k is not None:
        validate.tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, device=device)
        validate.at_least("cu_seqlens_k", cu_seqlens_k.shape[0], rows + 1)
    return page_table, cache_seqlens


def check_id_spaces(where: str, window_size: object, sink_size: object,
                    entry_page_size: object, v2p: object,
                    device: torch.device) -> tuple[int, int, int]:  # fmt: skip
    """Check the id-space inputs of design §2.10: ``window_size ≥ 0``, ``sink_size ≥ 0`` (read
    only with a window), ``entry_page_size ≥ 1`` and ``v2p``, when given, a 1-D int32 or int64
    page map on ``device``. Returns ``(window, sink, entry_page_size)``, ``sink`` 0 without a
    window. Host metadata only: an id that does not map is the kernels' to mask and report.
    Messages name ``where`` and the fix."""
    fix = ("(design §2.10: window_size 0 is no window, entry_page_size 1 rows of token ids, v2p "
           "the pool's [P] int32 or int64 virtual -> physical page map on the call's device)")  # fmt: skip
    try:
        window = validate.positive("window_size", window_size, 0)
        sink = validate.positive("sink_size", sink_size, 0)
        entry = validate.positive("entry_page_size", entry_page_size)
        if v2p is not None:
            validate.tensor("v2p", v2p, ndim=1, device=device, contiguous_last=False)
    except TypeError as err:
        raise TypeError(f"{where}: {err} {fix}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err} {fix}") from None
    return window, sink if window else 0, entry


def id_space_arguments(entry_page_size: int, v2p: torch.Tensor | None) -> dict:
    """The launch keywords of a row's id space (design §2.10) for a kernel reading rows with
    :func:`load_kv_ids`. Without ``v2p`` the map and its size are ``None`` (constants to Triton):
    a plain row's launch passes no argument it does not read."""
    translate = v2p is not None
    return dict(v2p_ptr=v2p, num_pages=v2p.shape[0] if translate else None,
                ENTRY_PAGE_SIZE=entry_page_size, TRANSLATE=translate)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Device helpers.
# --------------------------------------------------------------------------------------------
@triton.jit
def row_offset(row, stride):
    """``row · stride`` in 64 bits: the element offset of row ``row`` of a strided tensor.

    The one rule for row offsets (design §2.5, style §3): a caller's view may have any row
    stride (a row of a larger buffer, a stride past 2**30), so ``(rows − 1) · stride`` can pass
    2**31 whatever the sizes of the batch, and the product is always taken in 64 bits. A stride
    of 2**31 or more already arrives as an int64 argument; below that, Triton passes an int32
    and an int32 row index times it would wrap."""
    return tl.cast(row, tl.int64) * stride  # tl.cast: row may be a plain loop counter


@triton.jit
def draft_slot_position(L, t, j, page_size, NUM_STEPS: tl.constexpr, LAYOUT_B: tl.constexpr):
    """Row position of step ``j`` of branch ``t`` for a request with prefix ``L`` (design §1)."""
    if LAYOUT_B:
        lpl = L % page_size
        nnp = (lpl + NUM_STEPS + page_size - 1) // page_size
        return L - lpl + t * nnp * page_size + lpl + j
    else:
        return L + t * NUM_STEPS + j


@triton.jit
def load_request(req_pool_indices_ptr, seq_lens_ptr, b, B, R, stride_row):
    """``(row_base, L, row_ok, L_ok)`` of request ``b``: the int64 offset of its req_to_token
    row, its prefix length clamped to ≥ 0, and whether each was in range. ``b ≥ B`` gives an
    empty request (L = 0) that is reported as fine."""
    valid = b < B
    rp = tl.load(req_pool_indices_ptr + b, mask=valid, other=0).to(tl.int64)
    L = tl.load(seq_lens_ptr + b, mask=valid, other=0).to(tl.int64)
    row_ok = (rp >= 0) & (rp < R)
    L_ok = L >= 0
    L = tl.maximum(L, 0)
    # row * stride: R·W_row can pass 2**31, so the product is taken in 64 bits.
    row_base = tl.where(row_ok, rp, 0) * stride_row
    return row_base, L, row_ok | (b >= B), L_ok


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
    chunk_step, v2p_ptr, num_pages, page_size, BLOCK: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
):  # fmt: skip
    """Copy the ids of row positions ``[0, n)`` (read as :func:`load_kv_ids` reads them) to
    ``dst[dst_start : dst_start + n]``, chunks ``first_chunk, first_chunk + chunk_step, …``;
    gathers past the row read 0, stores past ``W_dst`` drop. The loop covers only what ``dst``
    can hold: a garbage ``n`` costs no more than a full buffer (the caller reports it).
    Returns whether an id it stored did not map (design §2.10)."""
    n_fit = tl.minimum(n, tl.minimum(tl.maximum(W_dst - dst_start, 0), W_dst))
    k0 = tl.arange(0, BLOCK).to(tl.int64)
    bad = first_chunk * 0
    for chunk in range(first_chunk, tl.cdiv(n_fit, BLOCK), chunk_step):
        k = k0 + chunk * BLOCK
        dst = dst_start + k
        m = (k < n) & (dst < W_dst)
        # A scalar condition joins a vector mask through tl.where (Triton 3.9 interpreter).
        v, _, wrong = load_kv_ids(req_to_token_ptr + row_base, k, tl.where(row_ok, m, False),
                                  W_row, v2p_ptr, num_pages, page_size, ENTRY_PAGE_SIZE,
                                  TRANSLATE)  # fmt: skip
        tl.store(dst_ptr + dst, v, mask=m)
        bad |= tl.max(wrong.to(tl.int32), axis=0)
    return bad


@triton.jit
def ancestor_order(m, cc):
    """``(pos, cnt)`` of a tree-mask tile ``m`` (row ``j`` a node, column ``c`` a node it may
    see; ``cc`` the column indices ``[1, BLOCK]``): the rank of column ``c`` in row ``j``'s
    list, its ancestor columns first in increasing ``c``, then the other columns, and each
    row's ancestor count (its keys). The FA3 verify expand passes' order (design §3.2)."""
    incl = tl.cumsum(m.to(tl.int32), axis=1)  # ancestor columns up to and including c
    cnt = tl.sum(m.to(tl.int32), axis=1)
    return tl.where(m, incl - 1, cnt[:, None] + cc - incl), cnt


@triton.jit
def window_slots(req_to_token_ptr, row_base, row_ok, L, want, W_row, v2p_ptr, num_pages,
                 page_size, BLOCK: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr,
                 TRANSLATE: tl.constexpr):  # fmt: skip
    """``(slot, past, neg, bad)``: the verify-window ids at row positions ``L + c``, ``c <
    BLOCK``, on the lanes of ``want`` (0 elsewhere), where a position lies past the row, where
    a plain row's slot read negative, and where an id of another id space did not map
    (:func:`load_kv_ids`, design §2.10); the last two are given as 0, the sink."""
    p = L + tl.arange(0, BLOCK)
    if ENTRY_PAGE_SIZE == 1 and not TRANSLATE:
        slot = tl.load(
            req_to_token_ptr + row_base + p,
            mask=tl.where(row_ok, want & (p < W_row), False),
            other=0,
        ).to(tl.int64)
        neg = want & (slot < 0)
        slot, bad, past = tl.where(neg, 0, slot), neg & False, want & (p >= W_row)
    else:
        slot, in_row, bad = load_kv_ids(req_to_token_ptr + row_base, p,
                                        tl.where(row_ok, want, False), W_row, v2p_ptr,
                                        num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
        neg, past = bad & False, want & ~in_row
    return slot, past, neg, bad


@triton.jit
def copy_list_at(
    req_to_token_ptr, row_base, row_ok, n, b, B, start, W_row, kv_indices_ptr, kv_indptr_ptr,
    W_idx, first_chunk, chunk_step, v2p_ptr, num_pages, page_size, BLOCK: tl.constexpr,
    ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr,
):  # fmt: skip
    """Request ``b``'s list ``row_b[0:n]`` of a CSR, placed at ``start``, ids read as
    :func:`copy_row_prefix` reads them: chunks ``first_chunk, first_chunk + chunk_step, …`` of
    it; with ``first_chunk == 0`` also ``kv_indptr[b + 1] = start + n`` (and entry 0 from
    ``b == 0``). Returns whether an id it stored did not map."""
    bad = copy_row_prefix(
        req_to_token_ptr, row_base, row_ok, n, W_row, kv_indices_ptr, start, W_idx, first_chunk,
        chunk_step, v2p_ptr, num_pages, page_size, BLOCK, ENTRY_PAGE_SIZE, TRANSLATE,
    )  # fmt: skip
    if first_chunk == 0:
        tl.store(kv_indptr_ptr + b + 1, start + n, mask=b < B)
        tl.store(kv_indptr_ptr + b, start * 0, mask=b == 0)
    return bad


@triton.jit
def branch_position(L, t, c, page_size, NUM_STEPS: tl.constexpr):
    """``(pos, used)``: the row position of the first token of column ``c`` (any shape) of
    branch ``t``'s page row (design §1 over pages): the request's ``L // ps`` full prefix
    pages, then the ``nnp`` pages of the branch's region; ``used`` is ``c < full + nnp``."""
    lpl = L % page_size
    base = L - lpl
    full = base // page_size
    nnp = (lpl + NUM_STEPS + page_size - 1) // page_size
    pos = tl.where(c < full, c * page_size, base + (t * nnp + (c - full)) * page_size)
    return pos, c < full + nnp


@triton.jit
def branch_page(req_to_token_ptr, row_base, row_ok, L, t, c, W_row, page_size, v2p_ptr, num_pages,
                NUM_STEPS: tl.constexpr, ENTRY_PAGE_SIZE: tl.constexpr,
                TRANSLATE: tl.constexpr):  # fmt: skip
    """Page of column ``c`` (any shape) of branch ``t``'s page row (design §1 over pages):
    ``(page, used, pos_bad, bad)``; ``used`` is ``c < ceil((L + S) / ps)``, ``page`` is 0
    where unused or out of the row. The page is that of the id the row names at the column's
    first position (:func:`branch_position`): the slot itself in a plain row, else the id
    :func:`load_kv_ids` emits in the rows' id space (design §2.10), where ``bad`` marks an id
    that did not map (the sink page 0); a plain row's ``bad`` is all false."""
    pos, used = branch_position(L, t, c, page_size, NUM_STEPS)
    if ENTRY_PAGE_SIZE == 1 and not TRANSLATE:
        in_row = pos < W_row
        slot = tl.load(
            req_to_token_ptr + row_base + pos, mask=tl.where(row_ok, used & in_row, False), other=0
        )
        bad = used & False
    else:
        slot, in_row, bad = load_kv_ids(req_to_token_ptr + row_base, pos,
                                        tl.where(row_ok, used, False), W_row, v2p_ptr,
                                        num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE)  # fmt: skip
    return slot // page_size, used, used & ~in_row, bad


@triton.jit
def load_verify_rows(verify_lens_ptr, b, B, N):
    """``(rows, v, ok)`` of request ``b`` of a ragged target verify as FlashInfer's lists and
    masks read it (design §2.9): its query rows ``max(v_b, 0)`` (a padded length may pass
    ``N``: the rows past ``N`` are filler rows), the tree nodes it verifies ``min(rows, N)``,
    and whether ``v_b ≥ 0``. ``b ≥ B`` gives 0 rows, reported as fine."""
    raw = tl.load(verify_lens_ptr + b, mask=b < B, other=0).to(tl.int64)
    rows = tl.maximum(raw, 0)
    return rows, tl.minimum(rows, N), raw >= 0


@triton.jit
def load_verify_len(verify_lens_ptr, b, B, N):
    """``(v, v_ok)`` of request ``b`` of a ragged target verify (design §3.2, §3.3): its
    verify length ``verify_lens[b]`` clamped to ``[0, N]`` (int64), and whether it was in that
    range. ``b ≥ B`` gives ``v = 0``, reported as fine."""
    raw = tl.load(verify_lens_ptr + b, mask=b < B, other=0).to(tl.int64)
    v_ok = (raw >= 0) & (raw <= N)
    return tl.minimum(tl.maximum(raw, 0), N), v_ok


@triton.jit
def windowed_length(L, window, sink):
    """The prefix entries a draft window keeps (design §2.10): ``min(L, window + sink)``, or
    ``L`` without a window (``window == 0``)."""
    return tl.where(window > 0, tl.minimum(L, window + sink), L)


@triton.jit
def window_position(k, L, Lw, sink):
    """Row position of entry ``k < Lw`` of a prefix of ``L`` tokens that keeps ``Lw`` of them
    (:func:`windowed_length`): the first ``min(sink, L)`` positions, then the most recent ones.
    Without a window ``Lw == L`` and the position is ``k``."""
    return tl.where(k < tl.minimum(sink, L), k, L - Lw + k)


@triton.jit
def load_kv_ids(row_ptr, pos, mask, W_row, v2p_ptr, num_pages, page_size,
                ENTRY_PAGE_SIZE: tl.constexpr, TRANSLATE: tl.constexpr):  # fmt: skip
    """``(ids, in_row, bad)`` at row positions ``pos ≥ 0`` of one ``req_to_token`` row
    (design §2.10), lanes of ``mask`` only (the others give 0). A row holds token ids, or page
    ids with ``ENTRY_PAGE_SIZE = E > 1`` (position ``p`` is ``row[p // E]·E + p mod E``); with
    ``TRANSLATE`` each id is virtual and leaves as ``v2p[id // ps]·ps + id mod ps``. In either
    form an id that does not map (negative, a page at or past ``num_pages``, a negative
    ``v2p`` entry) gives the sink slot 0 and is ``bad``. ``in_row``: the position lies in the
    row (``W_row`` entries); a lane outside it reads nothing."""
    if ENTRY_PAGE_SIZE == 1:
        in_row = pos < W_row
        read = mask & in_row
        ids = tl.load(row_ptr + pos, mask=read, other=0).to(tl.int64)
    else:
        in_row = pos // ENTRY_PAGE_SIZE < W_row
        read = mask & in_row
        page = tl.load(row_ptr + pos // ENTRY_PAGE_SIZE, mask=read, other=0).to(tl.int64)
        ids = page * ENTRY_PAGE_SIZE + pos % ENTRY_PAGE_SIZE
    if TRANSLATE:
        ids, bad = translate_ids(ids, read, v2p_ptr, num_pages, page_size)
    elif ENTRY_PAGE_SIZE > 1:
        bad = read & (ids < 0)
    else:
        bad = tl.zeros_like(ids) != 0  # a plain row's ids pass as they are
    return tl.where(read & ~bad, ids, 0), in_row, bad


@triton.jit
def translate_ids(ids, read, v2p_ptr, num_pages, page_size):
    """``(ids, bad)``: virtual KV ids (int64) on the lanes of ``read`` as physical ones,
    ``v2p[id // ps]·ps + id mod ps`` (design §2.10); ``bad`` where an id does not map (negative,
    a page at or past ``num_pages``, a negative ``v2p`` entry), given as the sink slot 0. The
    other lanes give 0."""
    vpage = ids // page_size
    phys = tl.load(v2p_ptr + vpage, mask=read & (ids >= 0) & (vpage < num_pages), other=-1)
    bad = read & (phys < 0)
    return tl.where(read & ~bad, phys.to(tl.int64) * page_size + ids % page_size, 0), bad


# --------------------------------------------------------------------------------------------
# Torch helpers of the references (plain torch; they may sync).
# --------------------------------------------------------------------------------------------
def or_status(status: torch.Tensor | None, bits: int) -> None:
    """OR host-computed ``bits`` into the status word (a reference's report)."""
    if status is not None and bits:
        status |= bits


def list_offsets(lengths: torch.Tensor, topk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """CSR offsets of per-branch lists: ``[rows, B·K + 1]``, where list ``z = b·K + t`` of row
    ``s`` holds ``lengths[s, b]`` entries (every branch of a request as long as the others),
    so ``offsets[s, z] = K·Σ_{b'<b} lengths[s, b'] + t·lengths[s, b]`` and the last column
    closes the lists. Written into ``out[:rows, :B·K + 1]`` and returned as that view when
    ``out`` is given (any integer dtype; a narrower one wraps as the kernels' stores do; no
    allocation but the repeated lengths), else returned in a new int64 tensor; plain torch on
    the lengths' device."""
    rows, B = lengths.shape
    validate.positive("topk", topk)
    offsets = offsets_out(out, rows, B * topk, lengths.device)
    offsets.select(1, 0).zero_()
    lists = lengths.repeat_interleave(topk, dim=1)
    torch.cumsum(lists, 1, dtype=offsets.dtype, out=offsets.narrow(1, 1, B * topk))
    return offsets


def offsets_out(
    out: torch.Tensor | None, rows: int, lists: int, device: torch.device
) -> torch.Tensor:
    """The ``[rows, lists + 1]`` view of ``out`` that a torch helper writes CSR offsets into,
    ``out`` checked before anything is written (a 2-D integer tensor at least that large); a
    new int64 tensor on ``device`` when ``out`` is None."""
    if out is None:
        return torch.empty(rows, lists + 1, dtype=torch.int64, device=device)
    validate.tensor("out", out, ndim=2, contiguous_last=False)
    validate.at_least("out", out.shape[0], rows, "rows")
    validate.at_least("out", out.shape[1], lists + 1, "columns (B*topk + 1)")
    return out[:rows, : lists + 1]


def draft_positions_ref(
    seq_lens: torch.Tensor, topk: int, num_steps: int, page_size: int
) -> torch.Tensor:
    """``[B, K, S]`` int64 row positions ``p(b, t, j)`` of design §1 (negative lengths read as 0)."""
    L = seq_lens.to(torch.int64).clamp_min(0).view(-1, 1, 1)
    t = torch.arange(topk, device=seq_lens.device).view(1, -1, 1)
    j = torch.arange(num_steps, device=seq_lens.device).view(1, 1, -1)
    if not uses_layout_b(topk, page_size):
        return L + t * num_steps + j
    lpl = L % page_size
    nnp = (lpl + num_steps + page_size - 1) // page_size
    return L - lpl + t * nnp * page_size + lpl + j


def gather_rows_ref(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``row_b[positions[b, ...]]`` with the kernels' masking: 0 where the row or the position is
    out of range. Returns the values and the status bits the kernels would set."""
    R, W = req_to_token.shape
    rows = req_pool_indices.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    row_ok = (rows >= 0) & (rows < R)
    pos_ok = (positions >= 0) & (positions < W)
    ok = row_ok & pos_ok
    safe_rows = torch.where(ok, rows, 0).expand_as(positions)
    safe_pos = torch.where(ok, positions, 0)
    vals = torch.where(ok, req_to_token[safe_rows, safe_pos], 0)
    bits = 0
    if not bool(row_ok.all()):
        bits |= int(Status.ROW_OOB)
    if not bool(pos_ok.all()):
        bits |= int(Status.POS_OOB)
    return vals, bits


def ragged_prefix_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor,
    *,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
    page_size: int = 1,
) -> int:
    """``out[start[b] + k] = id(row_b, k)`` for ``k < lengths[b]`` (stores past ``out``
    dropped; ids read as :func:`load_kv_ids_ref` reads them), vectorised; returns the status
    bits (``ROW_OOB``, ``POS_OOB``, ``BAD_KV_ID`` for an id stored that did not map)."""
    B = lengths.shape[0]
    if B == 0:
        return 0
    # Entry k of a list lands at start + k >= k: none past the output's end is kept, so the
    # work stops there whatever a garbage length says (design §2.5).
    max_len = min(int(lengths.max()), out.shape[0])
    k = torch.arange(max_len, device=lengths.device).view(1, -1)
    dst = start.view(-1, 1) + k
    keep = (k < lengths.view(-1, 1)) & (dst < out.shape[0])
    vals, bad, _ = load_kv_ids_ref(req_to_token, req_pool_indices,
                                   torch.where(keep, k, 0).expand_as(keep), keep,
                                   entry_page_size=entry_page_size, v2p=v2p,
                                   page_size=page_size)  # fmt: skip
    out[dst[keep]] = vals[keep].to(out.dtype)
    # Only positions inside a list count as gathers (the masked-out tail reads nothing), and a
    # bad row counts even for an empty list, as in the kernel.
    bits = int(Status.BAD_KV_ID) if bool(bad.any()) else 0
    if bool((lengths > req_to_token.shape[1] * entry_page_size).any()):  # past its row
        bits |= int(Status.POS_OOB)
    rows = req_pool_indices.to(torch.int64)
    if not bool(((rows >= 0) & (rows < req_to_token.shape[0])).all()):
        bits |= int(Status.ROW_OOB)
    return bits


def branch_positions_ref(seq_lens: torch.Tensor, topk: int, num_steps: int, page_size: int,
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`branch_position` of columns ``[0, width)`` of every branch: ``[B, K, width]``
    int64 positions (0 where unused) and the "used" mask (negative lengths read as 0)."""
    ps = page_size
    L = seq_lens.to(torch.int64).clamp_min(0).view(-1, 1, 1)
    lpl = L % ps
    base = L - lpl
    full = base // ps
    nnp = (lpl + num_steps + ps - 1) // ps
    t = torch.arange(topk, device=seq_lens.device).view(1, -1, 1)
    c = torch.arange(width, device=seq_lens.device).view(1, 1, -1)
    used = (c < full + nnp).expand(L.shape[0], topk, width)
    pos = torch.where(c < full, c * ps, base + (t * nnp + (c - full)) * ps)
    return torch.where(used, pos, 0), used


def branch_pages_ref(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    page_size: int,
    width: int,
    *,
    entry_page_size: int = 1,
    v2p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``[B, K, width]`` pages of every branch row (0 where unused), the ``[B, K, width]``
    "used" mask, the mask of used columns whose position fell past the row (``W_row·E``
    positions), the mask of used columns whose id did not map (design §2.10: page 0 there),
    and the ``ROW_OOB`` bit; vectorised. The torch side of :func:`branch_page`."""
    ps = page_size
    pos, used = branch_positions_ref(seq_lens, topk, num_steps, ps, width)
    slots, bad, bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos, used, v2p=v2p,
                                       entry_page_size=entry_page_size, page_size=ps)  # fmt: skip
    pages = torch.where(used, torch.div(slots, ps, rounding_mode="floor"), 0)
    past = used & (pos >= req_to_token.shape[1] * entry_page_size)
    return pages, used, past, bad, bits & int(Status.ROW_OOB)


def verify_rows_ref(verify_lens: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The torch side of :func:`load_verify_rows`: the ``[B]`` rows ``max(v, 0)`` and nodes
    ``min(rows, N)`` (int64), and ``POS_OOB`` when any ``v_b < 0`` (0 otherwise)."""
    raw = verify_lens.to(torch.int64)
    rows = raw.clamp_min(0)
    bad = bool((raw < 0).any()) if raw.numel() else False
    return rows, rows.clamp_max(N), int(Status.POS_OOB) if bad else 0


def verify_lens_ref(verify_lens: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """The torch side of :func:`load_verify_len`: the ``[B]`` verify lengths clamped to
    ``[0, N]`` (int64) and ``POS_OOB`` when any was outside that range (0 otherwise)."""
    raw = verify_lens.to(torch.int64)
    bad = bool(((raw < 0) | (raw > N)).any()) if raw.numel() else False
    return raw.clamp(0, N), int(Status.POS_OOB) if bad else 0


def windowed_length_ref(seq_lens: torch.Tensor, window: int, sink: int) -> torch.Tensor:
    """:func:`windowed_length` of every request, int64 (negative lengths read as 0)."""
    L = seq_lens.to(torch.int64).clamp_min(0)
    return L.clamp_max(window + sink) if window > 0 else L


def window_positions_ref(L: torch.Tensor, Lw: torch.Tensor, k: torch.Tensor,
                         sink: int) -> torch.Tensor:  # fmt: skip
    """:func:`window_position` of entries ``k`` (broadcast against ``L`` and ``Lw``)."""
    return torch.where(k < L.clamp_max(sink), k, L - Lw + k)


def load_kv_ids_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    positions: torch.Tensor, mask: torch.Tensor, *, entry_page_size: int = 1,
                    v2p: torch.Tensor | None = None,
                    page_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """:func:`load_kv_ids` for request ``b``'s positions ``positions[b, ...]`` (int64, ≥ 0)
    where ``mask``: the ids (int64, 0 elsewhere), where an id did not map (``bad``: a kernel
    reports ``BAD_KV_ID`` for the ids it emits, so the caller decides which count), and the
    ``ROW_OOB`` and ``POS_OOB`` bits as :func:`gather_rows_ref` reads them."""
    E = entry_page_size
    entries = torch.where(mask, positions // E, 0)
    vals, bits = gather_rows_ref(req_to_token, req_pool_indices, entries)
    R, W = req_to_token.shape
    rows = req_pool_indices.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    read = mask & (rows >= 0) & (rows < R) & (entries < W)
    ids = vals.to(torch.int64) * E + positions % E if E > 1 else vals.to(torch.int64)
    if v2p is not None:
        ids, bad = translate_ids_ref(ids, read, v2p, page_size)
    else:
        bad = read & (ids < 0) if E > 1 else torch.zeros_like(read)
    return torch.where(read & ~bad, ids, 0), bad, bits


def translate_ids_ref(ids: torch.Tensor, read: torch.Tensor, v2p: torch.Tensor,
                      page_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`translate_ids`: ``(ids, bad)``, the physical ids (0 off ``read`` and where
    ``bad``)."""
    ids = ids.to(torch.int64)
    vpage = torch.div(ids, page_size, rounding_mode="floor")
    mapped = read & (ids >= 0) & (vpage < v2p.shape[0])
    phys = torch.where(mapped, v2p[torch.where(mapped, vpage, 0)].to(torch.int64), -1)
    bad = read & (phys < 0)
    return torch.where(read & ~bad, phys * page_size + ids % page_size, 0), bad
