"""KV relocation after verify: the all-layer KV move (design §2.4).

After the target model verifies the draft tree, the KV of the accepted nodes moves to the front
of each request's verify window. Two ops do it without a host sync:

* :func:`accept_cache_locs` (:mod:`specmeta.kernels.accept_cache_locs`, its names importable
  from here too) turns ``accept_index`` into a fixed-length list of ``(tgt, src)`` slot pairs,
  accepted pairs compacted to the front in request order, the tail ``(0, 0)``;
* :func:`move_kv_cache` copies row ``src[q]`` to row ``tgt[q]`` in every K/V buffer of every
  layer in **one launch**, with the result of "read every source row, then write every target".
  It also moves the layout-B prefix-tail pairs of :func:`prefix_tail_copy_pairs` (design §2.1).

Design of ``move_kv_cache``
---------------------------
*Ordering.* Pairs may overlap: a target can be another pair's source (chains), two pairs can
swap, ``src == tgt``. Bytes of different buffers, and different byte columns of one row, never
alias, so a program that owns a **column slice of one buffer for every pair** can load all its
sources, pass a CTA barrier, then store all its targets: read-before-write holds by construction,
in one launch, without a grid-wide barrier (which would deadlock under the interpreter and on a
shared GPU) and without staging through global memory (which doubles the bytes moved). The
program holds a ``[BLOCK_N, COLS]`` register tile, ``BLOCK_N = next_pow2(n)`` (a bucketed
constexpr) and ``COLS = tile / BLOCK_N`` words (tile sizes below), so slices narrow as ``n``
grows: 512 B of a row at ``n = 64``, 128 B at 1024, 32 B at 4096, 16 B at 8192. Slices of 32 B
or more are whole DRAM sectors; narrower ones cost extra L2 transactions, and below a 128-byte
line each row costs a separate DRAM burst: the price of generality. Past
``MAX_OVERLAPPING_PAIRS`` pairs the tile no longer fits in registers and the launcher raises
``ValueError``. When every base address, row stride and row width is a multiple of 16 B
(``VEC > 1``), the kernel tells the compiler so and every access is a 16-byte vector.

*Ordered and disjoint pairs.* With ``ordered=True`` (no pair reads a slot an earlier pair
writes, as in :func:`accept_cache_locs` pairs) a program still owns a column slice of its
buffers for every pair, but walks the pairs in list order in blocks of ``BLOCK_N``, each loaded,
then stored after a CTA barrier that also orders it after the block before; the slice is the
whole row (a power of two), halved only while the slices of all buffers give too few programs,
down to a 128-byte line, and ``n`` has no bound. With ``disjoint=True`` (no target is another
pair's source, as in the prefix-tail pairs) blocks of ``DISJOINT_BLOCK_N`` pairs with whole-row
slices go to different programs, each block still read before it is written.

*One launch for every layer.* On the GPU the buffers are reached through a device table of
``(base address, row stride, row width, rows)`` per buffer, in words of the widest type (8, 4, 2
or 1 bytes) that divides every row width, row stride and base address, built once per set of
buffers (:class:`KVPool`, or a cache keyed by the buffers' addresses and shapes), never on the
launch path. Programs are ``(pair programs, column slice, buffer group)``; each loads the pair
indices of a block once and loops over its group of buffers. The CPU interpreter runs the same
kernel body with ``TABLE=False``, one launch per buffer passed as a tensor;
``KVPool(..., addressing="table")`` runs the table path on the CPU too, where the interpreter
follows host addresses.

*Masking.* A pair whose ``tgt`` or ``src`` is outside ``[0, P)`` of a buffer is skipped there (no
load, no store) and ``Status.POOL_OOB`` is set. Self-moves (``src == tgt``, including the
``(0, 0)`` pairs that pad every fixed-length pair list) are skipped as well: under read-then-write
semantics they change nothing. If two moved pairs share a target, which one lands is unspecified
(as for any scatter).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import validate
from ..config import kv_pool_table_shape
from ..launch import Launcher, cdiv, next_power_of_2
from ..stage import Stage, launcher
from ..status import Status
from ._common import POOL_OOB, target_programs
from .accept_cache_locs import accept_cache_locs, accept_cache_locs_ref, bind_accept_cache_locs

__all__ = ["bind_accept_cache_locs", "bind_move_kv_cache", "accept_cache_locs",
           "accept_cache_locs_ref", "KVPool", "move_kv_cache", "move_kv_cache_ref",
           "MAX_OVERLAPPING_PAIRS", "DISJOINT_BLOCK_N"]  # fmt: skip


# move_kv_cache: every thread holds _VECTORS_PER_THREAD vectors of 16 B (or of one word when a
# row is not 16-byte aligned). Up to _SMALL_BLOCK_N pairs, 8 vectors (128 B a thread) at 8 warps
# make a 32 KiB tile, two or three programs per SM. Beyond, the slice of each row would narrow
# below a 128-byte line, so the tile grows to 128 KiB: 16 vectors a thread at 16 warps, about
# two programs per SM (_WIDE_PROGRAMS_PER_SM). Swept on an H200 (scripts/tune_move_kv_cache.py,
# 32-64 layers, 2-4 KiB rows): at n = 1024 the wide tile moves 73-77 % of copy bandwidth, the
# 64 KiB one 46 %, at n = 4096 47 % against 30 %.
_VECTORS_PER_THREAD = 8
_WIDE_VECTORS_PER_THREAD = 16
_WIDE_WARPS = 16
_SMALL_BLOCK_N = 512
_WIDE_PROGRAMS_PER_SM = 2
MAX_OVERLAPPING_PAIRS = 8192
"""Most pairs ``move_kv_cache`` orders in one launch when they may overlap: at 8192 the 128 KiB
tile holds 16 bytes of every row."""
# Ordered pairs: 4 vectors a thread at 4 warps, an 8 KiB tile per block of pairs, many programs
# per SM; slices no narrower than a 128-byte line. Swept on an H200 (scripts/
# tune_move_kv_cache.py --ordered): the worst of seven cases (1152-4096 B rows, n = 256-4096)
# went from 76-77 % of copy bandwidth with a 32 KiB tile at 8 warps to 81 %; 16 or 64 KiB tiles
# and 2 or 8 warps did worse.
_ORDERED_WARPS = 4
_ORDERED_VECTORS_PER_THREAD = 4
_ORDERED_MIN_SLICE_BYTES = 128
DISJOINT_BLOCK_N = 32
"""Pairs per program with ``disjoint=True``: 32 rows of 1 KiB fill a 32 KiB tile."""


# --------------------------------------------------------------------------------------------
# move_kv_cache
# --------------------------------------------------------------------------------------------
@triton.jit
def _word_pointer(address, WORD_BYTES: tl.constexpr):
    """An int64 byte address as a pointer to words of ``WORD_BYTES`` bytes."""
    if WORD_BYTES == 8:
        return address.to(tl.pointer_type(tl.int64))
    elif WORD_BYTES == 4:
        return address.to(tl.pointer_type(tl.int32))
    elif WORD_BYTES == 2:
        return address.to(tl.pointer_type(tl.int16))
    else:
        return address.to(tl.pointer_type(tl.uint8))


@triton.jit(
    do_not_specialize=[
        "n", "blocks_per_program", "num_buffers", "buffers_per_program", "min_rows",
        "buf_stride", "buf_width", "buf_rows",
    ]
)  # fmt: skip
def _move_kv_cache_kernel(
    table_ptr,  # [num_buffers, 4] int64: base address, row stride, row width (words), rows P
    buf_ptr,  # [P, width] words of the one buffer (TABLE=False), row stride buf_stride
    tgt_ptr,  # [n] int32|int64
    src_ptr,  # [n] int32|int64
    status_ptr,  # [1] int32 (unused unless HAS_STATUS)
    n,
    blocks_per_program,  # pair blocks a program moves one after the other (ordered pairs)
    num_buffers,
    buffers_per_program,
    min_rows,  # smallest P of all buffers: a self-move below it is a no-op everywhere
    buf_stride,
    buf_width,
    buf_rows,
    BLOCK_N: tl.constexpr,  # pairs a program owns (all of them unless pairs are disjoint)
    COLS: tl.constexpr,  # words of a row per slice
    TABLE: tl.constexpr,  # buffers from the pointer table (else the one buffer buf_ptr)
    WORD_BYTES: tl.constexpr,
    VEC: tl.constexpr,  # words per 16 B when every row start and width is 16-byte aligned, else 1
    HAS_STATUS: tl.constexpr,
):
    """Grid ``(pair programs, column slices, buffer groups)``: program ``(p, c, g)`` moves words
    ``[c·COLS, (c+1)·COLS)`` of the rows of pair blocks ``[p·bpp, (p+1)·bpp)`` (``BLOCK_N``
    pairs each, ``bpp = blocks_per_program``) in buffers ``[g·bpg, (g+1)·bpg)``. For each block
    and buffer, all its sources are loaded, then all its targets stored; blocks go in list
    order."""
    p = tl.program_id(0)  # axis 0: pair blocks can pass the 65535 limit of axes 1 and 2
    c = tl.program_id(1)
    g = tl.program_id(2)
    first_block = p * blocks_per_program
    last_block = tl.minimum(first_block + blocks_per_program, tl.cdiv(n, BLOCK_N))
    col = c * COLS + tl.arange(0, COLS)
    first = g * buffers_per_program
    last = tl.minimum(first + buffers_per_program, num_buffers)
    bad = tl.full([], 0, tl.int32)
    for blk in range(first_block, last_block):
        q = tl.cast(blk, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = q < n
        tgt = tl.load(tgt_ptr + q, mask=live, other=0).to(tl.int64)
        src = tl.load(src_ptr + q, mask=live, other=0).to(tl.int64)
        nonneg = (tgt >= 0) & (src >= 0)
        # Reductions once per block, not per buffer: the largest location and whether any is
        # negative decide every buffer's POOL_OOB with scalar compares.
        top = tl.max(tl.where(live, tl.maximum(tgt, src), 0), axis=0)
        negative = tl.max((live & ~nonneg).to(tl.int32), axis=0) != 0
        # Nothing to do (and nothing to report) when every pair is a self-move inside every
        # buffer: the (0, 0) tail of a fixed-length pair list costs only these index loads.
        idle = ~live | ((tgt == src) & nonneg & (tgt < min_rows))
        busy = tl.max((~idle).to(tl.int32), axis=0) != 0
        if busy:
            moving = (live & nonneg & (tgt != src))[:, None]
            src_row = src[:, None]
            tgt_row = tgt[:, None]
            for b in range(first, last):
                if TABLE:
                    entry = table_ptr + b * 4
                    base = _word_pointer(tl.load(entry), WORD_BYTES)
                    stride = tl.load(entry + 1)
                    width = tl.load(entry + 2)
                    rows = tl.load(entry + 3)
                else:
                    base = buf_ptr
                    stride = buf_stride.to(tl.int64)
                    width = buf_width
                    rows = buf_rows
                bad |= (negative | (top >= rows)).to(tl.int32)
                # (col // VEC) < (width // VEC) equals col < width (width is a multiple of VEC)
                # and tells the compiler the mask is uniform over each 16-byte vector.
                in_row = ((col // VEC) < (width // VEC))[None, :]
                mask = moving & (tgt_row < rows) & (src_row < rows) & in_row
                # row·stride passes 2**31 in large pools: tgt and src are int64.
                src_ptrs = base + src_row * stride + col[None, :]
                tgt_ptrs = base + tgt_row * stride + col[None, :]
                if VEC > 1:
                    src_ptrs = tl.multiple_of(src_ptrs, [1, 16])
                    tgt_ptrs = tl.multiple_of(tgt_ptrs, [1, 16])
                # Rows are touched once: evict-first loads and streaming (.cs) stores. On an
                # H200 they lift 1152-byte rows at n = 1024 by 4-7 points of copy bandwidth.
                vals = tl.load(src_ptrs, mask=mask, eviction_policy="evict_first")
                # Every thread's loads are performed before any thread stores: a target may be
                # another pair's source, held by another thread of this program. The barrier
                # also orders this block's stores after the loads of every earlier block.
                tl.debug_barrier()
                tl.store(tgt_ptrs, vals, mask=mask, cache_modifier=".cs")

    if HAS_STATUS:
        # Every slice sees the same pairs; slice 0 reports for its buffers.
        bits = tl.where((bad != 0) & (c == 0), POOL_OOB, 0)
        tl.atomic_or(status_ptr, bits, mask=bits != 0, sem="relaxed")


_move_kv_cache_launch = Launcher(_move_kv_cache_kernel)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _describe(buffers: object) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Validate the buffers and return them with their layout: ``(device, word bytes, aligned,
    ((address, row stride, row width, rows), …))``, strides and widths in words; ``aligned``
    when every base address, row stride and row width is a multiple of 16 bytes."""
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence):
        raise TypeError("buffers must be a KVPool or a sequence of tensors, got "
                        f"{type(buffers).__name__}")  # fmt: skip
    bufs = tuple(buffers)
    if not bufs:
        raise ValueError("buffers must hold at least one tensor, got an empty sequence")
    device = None
    rows_bytes = []
    for i, t in enumerate(bufs):
        name = f"buffers[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        device = t.device if device is None else device
        if not validate.same_device(t.device, device):
            raise ValueError(f"{name} must be on {device} (like buffers[0]), got {t.device}")
        if t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(f"{name} must be [P, ...] with P >= 1 (slot 0 is the sink), got shape {tuple(t.shape)}")  # fmt: skip
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be a real numeric dtype, got {t.dtype}")
        if t[0].numel() == 0:
            raise ValueError(f"{name} has empty rows, shape {tuple(t.shape)}")
        if not t[0].is_contiguous():
            raise ValueError(f"{name} must have contiguous rows, got strides {t.stride()}")
        row, stride = t[0].numel() * t.element_size(), t.stride(0) * t.element_size()
        if t.shape[0] > 1 and stride < row:
            raise ValueError(f"{name} rows overlap: row stride {stride} B < row width {row} B")
        rows_bytes.append((t.data_ptr(), stride, row, t.shape[0]))
    seen: dict[int, int] = {}
    for i, (ptr, *_rest) in enumerate(rows_bytes):
        if seen.setdefault(ptr, i) != i:
            raise ValueError(f"buffers[{seen[ptr]}] and buffers[{i}] are the same memory")
    word, aligned = next(
        (min(w, 8), w == 16) for w in (16, 8, 4, 2, 1)
        if all(a % w == 0 and s % w == 0 and r % w == 0 for a, s, r, _ in rows_bytes)
    )  # fmt: skip
    rows = tuple((a, s // word, r // word, p) for a, s, r, p in rows_bytes)
    return bufs, (device, word, aligned, rows)


@functools.lru_cache(maxsize=16)
def _pointer_table(layout: tuple) -> torch.Tensor:
    """The device table of a layout. Built once per layout (a host-to-device copy); the key is
    the table's own content, so an entry stays correct for any buffers with that layout."""
    device, _word, _aligned, rows = layout
    table = torch.tensor(rows, dtype=torch.int64).reshape(kv_pool_table_shape(len(rows)))
    return table.to(device)


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    """``t`` as ``[P, row words]`` of the word dtype (same memory)."""
    flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
    return flat.view(torch.uint8).view(_WORD_DTYPES[word])


class KVPool:
    """The K/V buffers of every layer, addressed the way :func:`move_kv_cache` moves them.

    Build it once per set of buffers and pass it instead of the list (whose table is cached,
    but its key rebuilt on every call): a call then costs one launch and no host work that
    grows with the layer count.

    Parameters
    ----------
    buffers : sequence of torch.Tensor
        ``[P, …]`` tensors on one device, any dtype, rows contiguous (the row stride may exceed
        the row width), ``P ≥ 1``; typically K and V of every layer. Pool sizes may differ.
    addressing : {"auto", "table", "direct"}
        ``"table"``: one launch over the device pointer table (the default on CUDA);
        ``"direct"``: one launch per buffer, each passed as a tensor (the default elsewhere:
        an interpreter that cannot follow raw addresses still runs the same kernel body).

    The pool holds references to the buffers, so the table never outlives them.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], *, addressing: str = "auto"):
        self.buffers, layout = _describe(buffers)
        if addressing not in ("auto", "table", "direct"):
            raise ValueError(f"addressing must be 'auto', 'table' or 'direct', got {addressing!r}")
        self.device, self.word_bytes, self.aligned16, rows = layout
        if addressing == "auto":
            addressing = "table" if self.device.type == "cuda" else "direct"
        self.addressing = addressing
        self.rows = tuple(r[3] for r in rows)
        self.min_rows = min(self.rows)
        self.max_row_words = max(r[2] for r in rows)
        self.table = _pointer_table(layout) if addressing == "table" else None
        direct = addressing == "direct"
        self.words = tuple(_word_view(t, self.word_bytes) for t in self.buffers) if direct else ()

    def __len__(self) -> int:
        return len(self.buffers)

    def __repr__(self) -> str:
        return (f"KVPool({len(self)} buffers on {self.device}, {self.word_bytes}-byte words, "
                f"addressing={self.addressing!r})")  # fmt: skip


def _move_programs(device: torch.device, wide: bool) -> int:
    """Programs that keep the device busy: 4 per SM for 32 KiB tiles (one to three resident, so
    two waves or more), _WIDE_PROGRAMS_PER_SM for 128 KiB ones; 2 under the interpreter."""
    return target_programs(device, _WIDE_PROGRAMS_PER_SM if wide else 4, cpu=2)


def _launch_shape(n: int, pool: KVPool, disjoint: bool, ordered: bool) -> dict:
    """The launch for ``n`` pairs over the rows of ``pool``: ``BLOCK_N``, ``COLS``, ``VEC``,
    ``num_warps``, the programs along the pairs and the blocks each moves in list order."""
    vec16 = 16 // pool.word_bytes if pool.aligned16 else 1
    row = next_power_of_2(pool.max_row_words)
    if ordered and not disjoint:  # blocks of pairs, one program walks them in list order
        warps = _ORDERED_WARPS
        tile = warps * 32 * _ORDERED_VECTORS_PER_THREAD * vec16
        target = _move_programs(pool.device, False)
        # Whole rows, halved down to a 128-byte line while there are too few programs.
        cols = min(row, tile // 16)
        line = max(vec16, _ORDERED_MIN_SLICE_BYTES // pool.word_bytes)
        while cols > line and len(pool) * cdiv(pool.max_row_words, cols) < target:
            cols //= 2
        block_n = max(16, min(tile // cols, next_power_of_2(n)))
        pair_programs, blocks_per_program = 1, cdiv(n, block_n)
    else:  # independent blocks of pairs (disjoint), or one block holding every pair
        block_n = DISJOINT_BLOCK_N if disjoint else max(16, next_power_of_2(n))
        wide = block_n > _SMALL_BLOCK_N
        warps = _WIDE_WARPS if wide else 8
        tile = warps * 32 * (_WIDE_VECTORS_PER_THREAD if wide else _VECTORS_PER_THREAD) * vec16
        target = _move_programs(pool.device, wide)
        cols = max(1, min(tile // block_n, row))
        pair_programs, blocks_per_program = cdiv(n, block_n), 1
    vec = vec16 if cols >= vec16 else 1  # narrower slices are not 16-byte aligned
    return dict(BLOCK_N=block_n, COLS=cols, VEC=vec, num_warps=warps, target=target,
                pair_programs=pair_programs, blocks_per_program=blocks_per_program)  # fmt: skip


def _check_pairs(device: torch.device, tgt, src, disjoint, ordered, status):
    validate.tensor("tgt", tgt, ndim=1, device=device)
    validate.tensor("src", src, ndim=1, device=device)
    validate.length("src", src, tgt.shape[0])
    for name, flag in (("disjoint", disjoint), ("ordered", ordered)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    status = validate.status(status, device)
    n = tgt.shape[0]
    if not (disjoint or ordered) and n > MAX_OVERLAPPING_PAIRS:
        raise ValueError(f"tgt is too long to order in one launch: need at most "
                         f"{MAX_OVERLAPPING_PAIRS} pairs, have {n}; pass ordered=True if no pair "
                         "reads a slot an earlier pair writes (accept_cache_locs pairs), "
                         "disjoint=True if no target is another pair's source (prefix-tail "
                         "pairs), or split the list")  # fmt: skip
    return n, status


def bind_move_kv_cache(buffers: KVPool | Sequence[torch.Tensor], tgt: torch.Tensor,
                       src: torch.Tensor, *, ordered: bool = False, disjoint: bool = False,
                       status: torch.Tensor | None = None) -> Stage:  # fmt: skip
    """Bind once: copy row ``src[q]`` to row ``tgt[q]`` in every buffer, as if every source row were
    read before any target is written (design §2.4). In place; one launch on the GPU.

    Parameters
    ----------
    buffers : KVPool or sequence of torch.Tensor
        The K and V buffers of every layer, ``[P, …]`` each (see :class:`KVPool`; build one
        once to keep host work out of the call and the table build out of graph capture).
    tgt, src : torch.Tensor
        ``[n]`` int32 or int64 slot ids, for example from :func:`accept_cache_locs` or
        :func:`prefix_tail_copy_pairs`. ``n ≤ MAX_OVERLAPPING_PAIRS`` unless ``ordered`` or
        ``disjoint``.
    ordered : bool
        The caller guarantees that moving the pairs one at a time in list order gives the same
        result: no pair's source is the target of an earlier pair (``tgt[i] != src[j]`` for
        ``i < j``; self-moves aside). :func:`accept_cache_locs` pairs are ordered whenever every
        accepted path lists its node ids in increasing order (each tree node numbered after its
        parent, as in SGLang's and EAGLE's verify trees): within a request, pair ``k`` writes
        window slot ``k`` and reads slot ``accept_index[i, k] − s_i ≥ k`` (``s_i = i·N``, or
        ``qo_indptr[i]`` in a ragged verify), and requests never share slots. Any ``n``.
    disjoint : bool
        The caller guarantees that no pair's target is another pair's source (which implies
        ``ordered``). Any ``n``.
    status : torch.Tensor, optional
        ``int32 [1]``; ``POOL_OOB`` when a ``tgt`` or ``src`` lies outside ``[0, P)`` of a
        buffer (that pair is skipped there, nothing is dereferenced).

    A broken ``ordered`` or ``disjoint`` promise can move stale rows, but never touches memory
    outside the buffers: every access stays masked to ``[0, P)``.

    Returns
    -------
    Stage
        Its result is None, what the eager :func:`move_kv_cache` returns.

    Examples
    --------
    Rows ``[a, b, c, d]``, ``tgt=[1, 2, 3, 0]``, ``src=[2, 3, 1, 0]`` → ``[a, c, d, b]``
    (a rotation; the ``(0, 0)`` pair is a no-op).

    Grid ``(pair programs, column slices, buffer groups)`` (see the module notes); no host
    sync; ``n`` is bucketed to a power of two, widths and strides are runtime arguments.
    """
    pool = buffers if isinstance(buffers, KVPool) else KVPool(buffers)
    n, status = _check_pairs(pool.device, tgt, src, disjoint, ordered, status)
    if n == 0:
        return Stage([])
    shape = _launch_shape(n, pool, disjoint, ordered)
    programs, target, cols = shape.pop("pair_programs"), shape.pop("target"), shape["COLS"]
    bind = functools.partial(_move_kv_cache_launch.bind, tgt_ptr=tgt, src_ptr=src,
                             status_ptr=status, n=n, min_rows=pool.min_rows,
                             WORD_BYTES=pool.word_bytes, HAS_STATUS=True, **shape)  # fmt: skip
    if pool.addressing == "table":  # one launch: buffer groups over the pointer table
        slices = cdiv(pool.max_row_words, cols)
        per_program = max(1, slices * programs * len(pool) // target)
        return Stage([bind(
            (programs, slices, cdiv(len(pool), per_program)), table_ptr=pool.table,
            buf_ptr=pool.table, num_buffers=len(pool), buffers_per_program=per_program,
            buf_stride=0, buf_width=0, buf_rows=0, TABLE=True,
        )])  # fmt: skip
    launches = []
    for words in pool.words:
        launches.append(bind(
            (programs, cdiv(words.shape[1], cols), 1), table_ptr=words, buf_ptr=words,
            num_buffers=1, buffers_per_program=1, buf_stride=words.stride(0),
            buf_width=words.shape[1], buf_rows=words.shape[0], TABLE=False,
        ))  # fmt: skip
    return Stage(launches)


move_kv_cache = launcher(bind_move_kv_cache)
move_kv_cache.kernels = (_move_kv_cache_kernel,)  # for specmeta.registry


def move_kv_cache_ref(buffers: KVPool | Sequence[torch.Tensor], tgt: torch.Tensor,
                      src: torch.Tensor, *, ordered: bool = False, disjoint: bool = False,
                      status: torch.Tensor | None = None) -> None:  # fmt: skip
    """Pure-torch :func:`move_kv_cache`: per buffer, gather the in-range, non-self source rows,
    then scatter them to their targets (syncs)."""
    pool = buffers if isinstance(buffers, KVPool) else KVPool(buffers, addressing="direct")
    _, status = _check_pairs(pool.device, tgt, src, disjoint, ordered, status)
    t, s = tgt.to(torch.int64), src.to(torch.int64)
    bad = False
    for buf in pool.buffers:
        rows = _word_view(buf, 1)  # [P, row bytes]: bit-exact for every dtype, fp8 included
        in_pool = (t >= 0) & (t < rows.shape[0]) & (s >= 0) & (s < rows.shape[0])
        bad = bad or not bool(in_pool.all())
        keep = in_pool & (t != s)
        rows[t[keep]] = rows[s[keep]]  # the right side is gathered (a copy) before the scatter
    if bad:
        status |= int(Status.POOL_OOB)
