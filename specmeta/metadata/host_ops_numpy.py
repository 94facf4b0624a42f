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
checks both bounds and is ``max L``), then makes a few numpy ops over the whole batch, each
under a microsecond or two on small arrays where a torch CPU op costs several. ``ΣL`` is read
back from the offsets written where they hold the uncapped lengths and cannot have wrapped;
else it is one more reduction. Offsets are int32 that wrap modulo 2**32, as the kernels' int32
stores and the compiled writers do. The rules are the torch ones that
:mod:`.host_ops` names beside each writer; the tests compare the three exactly.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["lengths", "stats", "DraftDecode", "Prefix", "Paged", "Ragged", "draft_decode",
           "prefix", "paged", "ragged"]  # fmt: skip

_UNSIGNED = {np.dtype(np.int32): np.dtype(np.uint32), np.dtype(np.int64): np.dtype(np.uint64)}
_INT32_SUMS = 2**31  # offsets below this cannot have wrapped
# The ufuncs' reductions called directly: ``ndarray.max``/``sum`` add a Python wrapper a call.
_MAX, _SUM = np.maximum.reduce, np.add.reduce
#: Up to this many lengths :func:`stats` reads them as Python ints (one ``tolist``): cheaper
#: than the numpy view and two reductions on a few values, dearer past about 32.
_AS_INTS = 32


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
    if not a.shape[0]:
        return 0
    high = int(_MAX(a.view(_UNSIGNED[a.dtype])))  # a negative length reads as over 2**31
    if high > max_len:
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


def _capped(max_len: int, cap: int) -> np.int64 | None:
    """The cap a rule applies to lengths already in ``[0, max_len]``: none when it cannot
    bind."""
    _at_least("cap", cap, 0)
    return np.int64(cap) if cap < max_len else None


class DraftDecode:
    """Draft decode's ``kv_indptr`` mirror (design §2.2), the rule of
    :class:`~specmeta.kernels.draft_decode_kv_indices.DraftDecodeIndptr`, into ``out``
    (``[rows, batch·topk + 1]`` int32): ``out[s, z] = base[z] + z·(s + 1)``,
    ``base`` the cumulative sum of every branch's prefix length ``min(L, cap)``. Per call:
    the lengths repeated per branch (and capped) into a buffer made here, its cumulative sum,
    and one add of the ramp ``z·(s + 1)`` made here."""

    def __init__(self, max_len: int, topk: int, batch: int, cap: int, out: np.ndarray):
        _at_least("topk", topk, 1)
        self._max_len, self._batch, self._topk = _at_least("max_len", max_len, 0), batch, topk
        self._cap, self._out = _capped(max_len, cap), out
        rows, n = out.shape[0], batch * topk
        self._base = np.zeros(n + 1, dtype=np.int32)  # entry 0 stays 0
        self._lists = self._base[1:].reshape(batch, topk)
        ramp = np.arange(1, rows + 1, dtype=np.int64).reshape(-1, 1) * np.arange(n + 1)
        self._ramp = ramp.astype(np.int32)  # wraps as the kernel's int32 stores do
        # base[n] = K·ΣL exactly where nothing is capped and the sum cannot wrap
        self._sum_read = self._cap is None and topk * max_len * batch < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, base = top(a, self._max_len), self._base
        column = a.reshape(-1, 1)
        if self._cap is None:
            np.copyto(self._lists, column, casting="unsafe")
        else:
            np.minimum(column, self._cap, out=self._lists, casting="unsafe")
        np.add.accumulate(base, out=base)
        np.add(base, self._ramp, out=self._out)
        total = int(base[-1]) // self._topk if self._sum_read else int(_SUM(a))
        return high, total


class Prefix:
    """The prefix rule into ``out`` (``[batch + 1]`` int32): ``[0, cumsum(min(L, cap) +
    shift)]``, and ``scaled ← scale·out`` when ``scaled`` is not None (the cascade's prefix
    offsets, the prefill modes' ``kv_indptr``, target verify's mask offsets)."""

    def __init__(self, max_len: int, shift: int, scale: int, cap: int, batch: int,
                 out: np.ndarray, scaled: np.ndarray | None):  # fmt: skip
        self._max_len, self._batch = _at_least("max_len", max_len, 0), batch
        self._cap, self._out, self._tail, self._scaled = _capped(max_len, cap), out, out[1:], scaled
        self._scale = np.int64(scale)
        # (i + 1)·shift, added to the sum of the lengths alone (one op, not one per length)
        ramp = np.arange(1, batch + 1, dtype=np.int64) * shift
        self._ramp = ramp.astype(np.int32) if shift else None
        self._lengths = np.empty(batch, dtype=np.int32)
        # out[batch] = ΣL + batch·shift exactly where nothing is capped and it cannot wrap
        self._shift = batch * shift
        self._sum_read = self._cap is None and (max_len + shift) * batch < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, out, tail, kept = top(a, self._max_len), self._out, self._tail, a
        if self._cap is not None:
            kept = np.minimum(a, self._cap, out=self._lengths, casting="unsafe")
        np.add.accumulate(kept, out=tail, dtype=np.int32)
        if self._ramp is not None:
            np.add(tail, self._ramp, out=tail)
        out[0] = 0
        if self._scaled is not None:
            np.multiply(out, self._scale, out=self._scaled, casting="unsafe")
        total = int(out[-1]) - self._shift if self._sum_read else int(_SUM(a))
        return high, total


class Paged:
    """:func:`~specmeta.kernels.branch_kv_indices.branch_kv_indptr`'s rule into ``out``
    (``[rows, batch·topk + 1]``) and ``last`` (``[rows, batch·topk]``), int32: branch ``z``
    (request ``z // topk``) at step ``s`` holds ``ceil((L + s + 1) / page_size)`` pages, its
    last one ``(L + s) mod page_size + 1`` tokens. Per call: ``L + s + page_size`` for every
    request and step, one ``divmod`` (the pages and the last page's tokens less one), each
    repeated per branch into the mirrors, and the pages' cumulative sum in place."""

    def __init__(self, max_len: int, topk: int, page_size: int, batch: int, out: np.ndarray,
                 last: np.ndarray):  # fmt: skip
        _at_least("topk", topk, 1)
        _at_least("page_size", page_size, 1)
        self._max_len, self._batch, self._ps = _at_least("max_len", max_len, 0), batch, page_size
        rows = out.shape[0]
        self._steps = np.arange(rows, dtype=np.int64).reshape(-1, 1) + page_size
        self._tokens = np.empty((rows, batch), dtype=np.int64)
        self._pages = np.empty((rows, batch), dtype=np.int32)
        self._in_page = np.empty((rows, batch), dtype=np.int32)
        self._first, self._offsets = out[:, :1], out[:, 1:]
        # the mirrors as [rows, batch, topk]: views, rows apart as in the buffers
        self._page_view = self._offsets.reshape(rows, batch, topk)
        self._last_view = last.reshape(rows, batch, topk)
        for view, of in ((self._page_view, out), (self._last_view, last)):
            if view.size and not np.shares_memory(view, of):
                raise ValueError("Paged: the mirrors' rows must be unit-stride views")
        if topk == 1:  # one branch a request: the pages and last pages go straight in
            self._pages, self._in_page = self._offsets, last

    def __call__(self, seq_lens_cpu: object) -> tuple[int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high, tokens = top(a, self._max_len), self._tokens
        np.add(a, self._steps, out=tokens)  # L + s + ps
        pages, in_page = self._pages, self._in_page
        np.divmod(tokens, self._ps, out=(pages, in_page), casting="unsafe")  # int32 wraps
        np.add(in_page, 1, out=in_page)
        if pages is not self._offsets:  # each request's counts to its topk branches
            np.copyto(self._page_view, pages.reshape(*tokens.shape, 1))
            np.copyto(self._last_view, in_page.reshape(*tokens.shape, 1))
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
    before it writes anything and returns ``(max L, ΣL, max v, Σv)``."""

    def __init__(self, max_len: int, n: int, T: int, batch: int, count: int, cap: int,
                 verify_out: np.ndarray, qo_out: np.ndarray, kv_out: np.ndarray,
                 mask_out: np.ndarray):  # fmt: skip
        if count < 0 or count > batch or n < 1 or T < 0 or cap < 0:
            raise ValueError(f"ragged: need 0 <= count <= batch, N >= 1, T >= 0, cap >= 0; got "
                             f"count {count}, batch {batch}, N {n}, T {T}, cap {cap}")  # fmt: skip
        self._max_len, self._n, self._T = _at_least("max_len", max_len, 0), n, T
        self._batch, self._count, self._cap = batch, count, _capped(max_len, cap)
        self._verify, self._outs = verify_out, (qo_out, kv_out, mask_out)
        self._cols = np.empty(batch, dtype=np.int64)
        self._rows = np.empty(batch, dtype=np.int64)
        self._sum_read = (max_len + T) * max(batch, 1) < _INT32_SUMS

    def __call__(self, seq_lens_cpu: object, verify_lens_cpu: object) -> tuple[int, int, int, int]:
        a = lengths(seq_lens_cpu, self._batch)
        high = top(a, self._max_len)
        v = lengths(verify_lens_cpu, self._count)
        v_high, total = top(v, self._n), int(_SUM(v))
        if total > self._T:
            raise ValueError(f"verify_lens_cpu sums to {total}, over T = {self._T}")
        count, padded, left = self._count, self._verify, self._T - total
        pads, widest = self._batch - count, v_high  # widest: the largest padded length
        padded[:count] = v
        if pads:
            share, spare = divmod(left, pads)
            padded[count:] = share
            if spare:
                padded[count : count + spare] += 1
            widest = max(widest, share + (spare > 0))
        elif count:
            padded[count - 1] += left
            widest = max(widest, int(padded[count - 1]))
        qo, kv, mask = self._outs
        cols, rows = self._cols, padded
        if widest > self._n:  # a pad or the last request past N reads N tree columns
            rows = np.minimum(padded, self._n, out=self._rows)
        if self._cap is None:
            np.add(a, rows, out=cols)  # L + min(v, N)
        else:
            np.minimum(a, self._cap, out=cols)
            np.add(cols, rows, out=cols)  # min(L, cap) + min(v, N)
        np.add.accumulate(padded, out=qo[1:])
        np.add.accumulate(cols, out=kv[1:], dtype=np.int32)
        np.multiply(cols, padded, out=cols)
        np.add.accumulate(cols, out=mask[1:], dtype=np.int32)
        qo[0] = kv[0] = mask[0] = 0
        # kv[batch] = ΣL + T exactly where nothing is capped, clipped or wrapped
        read = rows is padded and self._cap is None and self._sum_read and self._batch
        return high, int(kv[-1]) - self._T if read else int(_SUM(a)), v_high, total


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
