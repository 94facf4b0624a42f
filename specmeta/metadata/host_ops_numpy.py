"""The host ops in numpy: what serves a build's host work without the compiled module (design §3).

Before :func:`specmeta.warmup`, without a C compiler, under ``SPECMETA_HOST_OPS=0`` or for a
builder made with ``host_ops=False``, these do the work of ``host_ops.c``, with its arguments,
its results and its errors: :func:`stats`, and a writer class per mirror rule
(:class:`DraftDecode`, :class:`Prefix`, :class:`Paged`, :class:`Ragged`), made once for a set
of mirror views (their numpy views, each keeping its tensor alive) with the constants of its
rule, whose ``writer(seq_lens_cpu)`` checks the tensor and every length before it writes
anything and returns what ``stats`` returns. The functions of the compiled entry points' names
and signatures (:func:`draft_decode`, :func:`prefix`, :func:`paged`, :func:`ragged`) make a
writer and call it once, so a test calls either module alike.

A call reads ``seq_lens_cpu.numpy()`` (the tensor's own memory, nothing copied), checks every
length with one unsigned ``max`` (a negative length reads as a huge one, so the one reduction
checks both bounds and is ``max L``; up to ``_AS_LIST`` lengths, one ``tolist``), then makes a
few numpy ops over the whole batch, each under a microsecond or two on small arrays where a
torch CPU op costs several: a ufunc call costs about half a microsecond when its operands share
the output's dtype and are given positionally, twice that with a scalar to convert or a cast,
so constants are 0-d int32 arrays made at bind. ``ΣL`` is read back from the offsets written
where they hold the uncapped lengths and cannot have wrapped; else it is one more reduction.
Offsets are int32 that wrap modulo 2**32, as the kernels' int32 stores and the compiled writers
do. The rules are the torch ones that :mod:`.host_ops` names beside each writer; the tests
compare the three exactly.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["lengths", "stats", "DraftDecode", "Prefix", "Paged", "Ragged", "draft_decode",
           "prefix", "paged", "ragged"]  # fmt: skip

#: each lengths dtype's unsigned twin and largest value: a negative length reads as over it
_UNSIGNED = {np.dtype(np.int32): (np.dtype(np.uint32), 2**31 - 1),
             np.dtype(np.int64): (np.dtype(np.uint64), 2**63 - 1)}  # fmt: skip
_INT32_SUMS = 2**31  # offsets below this cannot have wrapped
# The ufuncs' reductions called directly: ``ndarray.max``/``sum`` add a Python wrapper a call.
_MAX, _SUM = np.maximum.reduce, np.add.reduce
#: Up to this many lengths :func:`stats` reads them as Python ints (one ``tolist``): cheaper
#: than the numpy view and two reductions on a few values, dearer past about 32.
_AS_INTS = 32
#: Up to this many lengths :func:`top` reads them as Python ints (the writers hold the numpy
#: view already, so the crossing is lower).
_AS_LIST = 8
#: From this many branches × steps :class:`Paged` sums the pages over the requests, not over
#: every branch (the serial sum costs about 3 ns an element; the other, four vector ops).
_SPREAD = 1536


def lengths(seq_lens_cpu: object, batch: int) -> np.ndarray:
    """The numpy view of ``seq_lens_cpu`` after the compiled module's checks, in its order and
    with its exceptions: an int32 or int64 tensor (``TypeError``), of shape ``[batch]``, then
    contiguous on the CPU (``ValueError``)."""
    try:
        a = seq_lens_cpu.numpy()  # type: ignore[attr-defined]
    except Exception:  # not a tensor, not on the CPU: named below
        a = None
    if (a is not None and a.shape == (batch,) and a.dtype in _UNSIGNED
            and (batch < 2 or a.strides[0] == a.itemsize)):  # fmt: skip
        return a
    _check(seq_lens_cpu, batch)
    return seq_lens_cpu.numpy()  # type: ignore[attr-defined]  # what refused it, if anything


def _check(seq_lens_cpu: object, batch: int) -> None:
    """The compiled module's checks of a lengths tensor, in its order, with its exceptions."""
    dtype = getattr(seq_lens_cpu, "dtype", None)
    if dtype is not torch.int32 and dtype is not torch.int64:
        raise TypeError("seq_lens_cpu must be an int32 or int64 tensor")
    if tuple(seq_lens_cpu.shape) != (batch,):  # type: ignore[attr-defined]
        raise ValueError(f"seq_lens_cpu must have shape [{batch}] (one length a request)")
    if not seq_lens_cpu.is_cpu or not seq_lens_cpu.is_contiguous():  # type: ignore[attr-defined]
        raise ValueError("seq_lens_cpu must be a contiguous CPU tensor")


def top(a: np.ndarray, max_len: int) -> int:
    """``max L`` of lengths all in ``[0, max_len]`` (0 for none), or the compiled module's
    ``IndexError`` naming the first length outside the range."""
    if a.shape[0] > _AS_LIST:
        unsigned, largest = _UNSIGNED[a.dtype]
        high = int(_MAX(a.view(unsigned)))  # a negative length reads as over `largest`
        high = high if high <= largest else -1  # (refused as the compiled check does)
    else:  # a few lengths as Python ints: one tolist, under half a view and a reduction
        values = a.tolist()
        high = max(values, default=0) if min(values, default=0) >= 0 else -1
    if high > max_len or high < 0:
        bad = int(np.flatnonzero((a < 0) | (a > max_len))[0])
        raise IndexError(f"seq_lens_cpu[{bad}] = {int(a[bad])} is outside [0, {max_len}]")
    return high


def _at_least(name: str, value: int, low: int) -> int:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def stats(max_len: int, batch: int, seq_lens_cpu: object) -> tuple[int, int]:
    """``(max L, ΣL)`` after checking the tensor and every length in ``[0, max_len]``: the
    check of every builder whose host scalars read ``max L`` (FA3, TRT-LLM MLA)."""
    if batch > _AS_INTS:
        a = lengths(seq_lens_cpu, batch)
        _at_least("max_len", max_len, 0)
        return top(a, max_len), int(_SUM(a))
    _check(seq_lens_cpu, batch)
    _at_least("max_len", max_len, 0)
    values = seq_lens_cpu.tolist()  # type: ignore[attr-defined]
    high = max(values, default=0)
    if high > max_len or min(values, default=0) < 0:
        top(np.array(values), max_len)  # names the first length outside the range
    return high, sum(values)


def _capped(max_len: int, cap: int) -> np.ndarray | None:
    """The cap a rule applies to lengths already in ``[0, max_len]``: none when it cannot
    bind."""
    _at_least("cap", cap, 0)
    return np.array(cap, dtype=np.int64) if cap < max_len else None  # 0-d: no conversion a call


def _const(value: int) -> np.ndarray:
    """``value`` as a 0-d int32 array, modulo 2**32 as the int32 stores keep it: an operand of
    the mirrors' own dtype costs a ufunc no scalar conversion and no cast (half its call)."""
    return np.array(value, dtype=np.int64).astype(np.int32)


class DraftDecode:
    """Draft decode's ``kv_indptr`` mirror (design §2.2), the rule of
    :class:`~specmeta.kernels.draft_decode_kv_indices.DraftDecodeIndptr`, into ``out``
    (``[rows, batch·topk + 1]`` int32): ``out[s, z] = base[z] + z·(s + 1)``,
    ``base`` the cumulative sum of every branch's prefix length ``min(L, cap)``. Per call:
    the lengths (capped) repeated per branch into a buffer made here, its cumulative sum,
    and one add of the ramp ``z·(s + 1)`` made here. (A sum over the requests spread to the
    branches, ``base[1 + b·K + k] = K·Σ_{b'<b} L_{b'} + (k + 1)·L_b``, as :class:`Paged`
    makes from ``_SPREAD``, takes three more ops and measured no faster up to ``B·K = 2048``:
    one row is summed here, not one a step.)"""

    def __init__(self, max_len: int, topk: int, batch: int, cap: int, out: np.ndarray):
        _at_least("topk", topk, 1)
        self._max_len, self._batch, self._topk = _at_least("max_len", max_len, 0), batch, topk
        self._cap, self._out = _capped(max_len, cap), out
        rows, n = out.shape[0], batch * topk
        self._base = np.zeros(n + 1, dtype=np.int32)  # entry 0 stays 0
        # base[1 + b·K + k] for every k of request b, as [topk, batch]: a length broadcast
        # down its column, with no reshape of the lengths a call
        self._by_branch = self._base[1:].reshape(batch, topk).T
        self._kept = np.empty(batch, dtype=np.int64)  # min(L, cap)
        ramp = np.arange(1, rows + 1, dtype=np.int64).reshape(-1, 1) * np.arange(n + 1)
        self._ramp = ramp.astype(np.int32)  # wraps as the kernel's int32 stores do
        # base[n] = K·ΣL exactly where nothing is capped and the sum cannot wrap
        self._sum_read = self._cap is None and topk * max_len * batch < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, base = top(a, self._max_len), self._base
        kept = a
        if self._cap is not None:
            kept = np.minimum(a, self._cap, out=self._kept)  # min(L, cap)
        np.copyto(self._by_branch, kept, "unsafe")  # each length to its request's branches
        np.add.accumulate(base, out=base)  # base[z]: the branches before z
        np.add(base, self._ramp, self._out)  # + z·(s + 1)
        total = int(base[-1]) // self._topk if self._sum_read else int(_SUM(a))
        return high, total


class Prefix:
    """The prefix rule into ``out`` (``[batch + 1]`` int32): ``[0, cumsum(min(L, cap) +
    shift)]``, and ``scaled ← scale·out`` when ``scaled`` is not None (the cascade's prefix
    offsets, the prefill modes' ``kv_indptr``, target verify's mask offsets). Per call: the
    cumulative sum of the (capped) lengths into int32 (the one cast of int64 lengths), an add
    of the ramp ``(i + 1)·shift`` and a multiply by an int32 ``scale``, both made here."""

    def __init__(self, max_len: int, shift: int, scale: int, cap: int, batch: int,
                 out: np.ndarray, scaled: np.ndarray | None):  # fmt: skip
        self._max_len, self._batch = _at_least("max_len", max_len, 0), batch
        self._cap, self._out, self._tail, self._scaled = _capped(max_len, cap), out, out[1:], scaled
        self._scale = _const(scale)
        # (i + 1)·shift, added to the sum of the lengths alone (one op, not one per length)
        ramp = np.arange(1, batch + 1, dtype=np.int64) * shift
        self._ramp = ramp.astype(np.int32) if shift else None
        self._lengths = np.empty(batch, dtype=np.int64)
        # out[batch] = ΣL + batch·shift exactly where nothing is capped and it cannot wrap
        self._shift = batch * shift
        self._sum_read = self._cap is None and (max_len + shift) * batch < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, out, tail, kept = top(a, self._max_len), self._out, self._tail, a
        if self._cap is not None:
            kept = np.minimum(a, self._cap, out=self._lengths)
        np.add.accumulate(kept, out=tail, dtype=np.int32)  # the one cast, int32 sums that wrap
        if self._ramp is not None:
            np.add(tail, self._ramp, tail)
        out[0] = 0
        if self._scaled is not None:
            np.multiply(out, self._scale, self._scaled)
        total = int(out[-1]) - self._shift if self._sum_read else int(_SUM(a))
        return high, total


class Paged:
    """:func:`~specmeta.kernels.branch_kv_indices.branch_kv_indptr`'s rule into ``out``
    (``[rows, batch·topk + 1]``) and ``last`` (``[rows, batch·topk]``), int32: branch ``z``
    (request ``z // topk``) at step ``s`` holds ``ceil((L + s + 1) / page_size)`` pages, its
    last one ``(L + s) mod page_size + 1`` tokens.

    Per call, over ``[rows, batch]``: ``L + s + page_size``, its quotient by the page size
    (the pages ``P``) and remainder (the last page's tokens less one; a shift and a mask for a
    power of two), and the last pages repeated per branch into ``last``. With one branch a
    request the pages go straight into ``out`` and are summed in place; with ``K`` they are
    repeated per branch and summed in place, a serial op of about 3 ns a branch and step.
    From ``_SPREAD`` branches × steps the sum is made over the requests instead: branch ``k``
    of request ``b`` starts at ``K·Σ_{b'<b} P_{b'} + (k + 1)·P_b``, made as ``[rows, topk,
    batch]`` (vector ops along the batch) and copied once, transposed, into ``out``."""

    def __init__(self, max_len: int, topk: int, page_size: int, batch: int, out: np.ndarray,
                 last: np.ndarray):  # fmt: skip
        _at_least("topk", topk, 1)
        _at_least("page_size", page_size, 1)
        self._max_len, self._batch = _at_least("max_len", max_len, 0), batch
        rows = out.shape[0]
        # L + s + ps in int32 where it cannot pass 2**31, else int64 (the pages then wrap)
        wide = max_len + rows + page_size >= _INT32_SUMS
        dtype = np.int64 if wide else np.int32
        self._steps = (np.arange(rows, dtype=np.int64).reshape(-1, 1) + page_size).astype(dtype)
        self._tokens = np.empty((rows, batch), dtype=dtype)
        pow2 = page_size & (page_size - 1) == 0
        self._shift = np.array(page_size.bit_length() - 1, dtype=dtype) if pow2 else None
        self._divisor = np.array(page_size, dtype=dtype)
        self._mask = np.array(page_size - 1, dtype=dtype)
        self._one = _const(1)
        self._pages = np.empty((rows, batch), dtype=np.int32)
        self._in_page = np.empty((rows, batch), dtype=np.int32)
        self._first, self._offsets = out[:, :1], out[:, 1:]
        # the mirrors as [rows, batch, topk]: views, rows apart as in the buffers
        page_view = self._offsets.reshape(rows, batch, topk)
        self._last_view = last.reshape(rows, batch, topk)
        for view, of in ((page_view, out), (self._last_view, last)):
            if view.size and not np.shares_memory(view, of):
                raise ValueError("Paged: the mirrors' rows must be unit-stride views")
        self._topk, self._page_view = topk, page_view
        self._spread = topk > 1 and rows * batch * topk >= _SPREAD
        if topk == 1:  # one branch a request: the pages and last pages go straight in
            self._pages, self._in_page = self._offsets, last
        # each request's values as [rows, batch, 1], to copy to its topk branches
        self._pages_col, self._in_page_col = self._pages[:, :, None], self._in_page[:, :, None]
        if self._spread:
            # (k + 1)·P_b, then + K·Σ_{b'<b} P_{b'}, as [rows, topk, batch]; its transpose is
            # the offsets' [rows, batch, topk]
            self._starts = np.empty((rows, topk, batch), dtype=np.int32)
            self._branch = np.arange(1, topk + 1, dtype=np.int32).reshape(1, topk, 1)
            self._before = np.zeros((rows, batch + 1), dtype=np.int32)  # column 0 stays 0
            self._by_row, self._last_branch = self._pages[:, None, :], self._starts[:, -1]
            self._sums, self._before_b = self._before[:, 1:], self._before[:, None, :-1]
            self._in_order = self._starts.transpose(0, 2, 1)

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, tokens = top(a, self._max_len), self._tokens
        np.add(a, self._steps, tokens)  # L + s + ps
        pages, in_page = self._pages, self._in_page
        if self._shift is None:  # the pages and the remainder (int64 ones wrap into int32)
            np.divmod(tokens, self._divisor, out=(pages, in_page))
        else:
            np.right_shift(tokens, self._shift, pages)
            np.bitwise_and(tokens, self._mask, in_page)
        np.add(in_page, self._one, in_page)  # the last page's tokens
        if self._topk > 1:
            np.copyto(self._last_view, self._in_page_col)  # each request's to its branches
        if self._spread:
            starts = np.multiply(self._branch, self._by_row, self._starts)  # (k + 1)·P_b
            # K·P_b is starts' last branch: its sums over the requests, from column 1
            np.add.accumulate(self._last_branch, axis=1, out=self._sums)
            np.add(starts, self._before_b, starts)  # + K·Σ_{b'<b} P_{b'}
            np.copyto(self._page_view, self._in_order)  # [rows, topk, batch] → branch order
        else:  # the pages to their branches (K > 1), summed in place
            if self._topk > 1:
                np.copyto(self._page_view, self._pages_col)
            np.add.accumulate(self._offsets, axis=1, out=self._offsets)
        self._first[...] = 0
        return high, int(_SUM(a))


class Ragged:
    """A ragged target verify's mirrors (design §2.9) over a bucket of ``batch`` requests,
    ``count`` of them real, and ``T`` tokens: ``verify_out ←`` the padded lengths
    (:func:`~specmeta.kernels.verify_lens.fill_bucket`'s rule on checked lengths), ``qo_out``
    their offsets, ``kv_out ← [0, cumsum(min(L, cap) + min(v, N))]`` and ``mask_out ← [0,
    cumsum(v·(min(L, cap) + min(v, N)))]``. ``writer(seq_lens_cpu, verify_lens_cpu)`` checks
    both (``verify_lens_cpu`` of ``count`` lengths in ``[0, N]`` summing to at most ``T``)
    before it writes anything and returns ``(max L, ΣL, max v, Σv)``. The padding and the
    tokens it puts past ``N`` columns are Python arithmetic on the sums (so ``ΣL`` is read
    back from ``kv_out`` clipped or not); the columns and their products int32 (their sums
    wrap as the kernels' int32 stores do)."""

    def __init__(self, max_len: int, n: int, T: int, batch: int, count: int, cap: int,
                 verify_out: np.ndarray, qo_out: np.ndarray, kv_out: np.ndarray,
                 mask_out: np.ndarray):  # fmt: skip
        if count < 0 or count > batch or n < 1 or T < 0 or cap < 0:
            raise ValueError(f"ragged: need 0 <= count <= batch, N >= 1, T >= 0, cap >= 0; got "
                             f"count {count}, batch {batch}, N {n}, T {T}, cap {cap}")  # fmt: skip
        self._max_len, self._n, self._T = _at_least("max_len", max_len, 0), n, T
        self._batch, self._count, self._cap = batch, count, _capped(max_len, cap)
        self._verify, self._outs = verify_out, (qo_out, kv_out, mask_out)
        self._real, self._pads = verify_out[:count], verify_out[count:]
        self._tails = qo_out[1:], kv_out[1:], mask_out[1:]
        self._n32 = _const(n)
        self._cols = np.empty(batch, dtype=np.int32)
        self._rows = np.empty(batch, dtype=np.int32)
        self._kept = np.empty(batch, dtype=np.int64)
        self._sum_read = (max_len + T) * max(batch, 1) < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object, verify_lens_cpu: object) -> tuple[int, int, int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high = top(a, self._max_len)
        v = lengths(verify_lens_cpu, self._count)
        v_high, total = top(v, self._n), int(_SUM(v))
        if total > self._T:
            raise ValueError(f"verify_lens_cpu sums to {total}, over T = {self._T}")
        count, padded, left, n = self._count, self._verify, self._T - total, self._n
        pads = self._batch - count
        self._real[...] = v
        over = 0  # Σ max(v - N, 0) of the padded lengths: only a pad's or the last one's
        if pads:  # the leftover shared by the pads, the first `spare` one more
            share, spare = divmod(left, pads)
            self._pads[...] = share
            if spare:
                padded[count : count + spare] += 1
            over = spare * max(share + 1 - n, 0) + (pads - spare) * max(share - n, 0)
        elif count:  # no pad: the last request takes the leftover
            padded[count - 1] += left
            over = max(int(padded[count - 1]) - n, 0)
        qo, kv, mask = self._tails
        cols, rows = self._cols, padded
        if over:  # a pad or the last request past N reads N tree columns
            rows = np.minimum(padded, self._n32, out=self._rows)
        kept = a if self._cap is None else np.minimum(a, self._cap, out=self._kept)
        np.add(kept, rows, cols)  # min(L, cap) + min(v, N), int32
        np.add.accumulate(padded, out=qo)
        np.add.accumulate(cols, out=kv)
        np.multiply(cols, padded, cols)
        np.add.accumulate(cols, out=mask)
        qo_out, kv_out, mask_out = self._outs
        qo_out[0] = kv_out[0] = mask_out[0] = 0
        # kv[batch] = ΣL + T − over exactly where nothing is capped and nothing wrapped
        read = self._cap is None and self._sum_read and self._batch
        return high, int(kv[-1]) - (self._T - over) if read else int(_SUM(a)), v_high, total


def draft_decode(max_len, topk, batch, cap, out, seq_lens_cpu):
    """The compiled ``draft_decode``'s call: :class:`DraftDecode` made and called once."""
    return DraftDecode(max_len, topk, batch, cap, out)(seq_lens_cpu)


def prefix(max_len, shift, scale, cap, batch, out, scaled, seq_lens_cpu):
    """The compiled ``prefix``'s call: :class:`Prefix` made and called once."""
    return Prefix(max_len, shift, scale, cap, batch, out, scaled)(seq_lens_cpu)


def paged(max_len, topk, page_size, batch, out, last, seq_lens_cpu):
    """The compiled ``paged``'s call: :class:`Paged` made and called once."""
    return Paged(max_len, topk, page_size, batch, out, last)(seq_lens_cpu)


def ragged(max_len, n, T, batch, count, cap, verify_out, qo_out, kv_out, mask_out,
           seq_lens_cpu, verify_lens_cpu):  # fmt: skip
    """The compiled ``ragged``'s call: :class:`Ragged` made and called once."""
    return Ragged(max_len, n, T, batch, count, cap, verify_out, qo_out, kv_out,
                  mask_out)(seq_lens_cpu, verify_lens_cpu)  # fmt: skip
