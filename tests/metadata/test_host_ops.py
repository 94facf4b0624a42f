"""The compiled host ops (design §3, §3.3): built once a process by ``warmup()``, never by a
call; their writers write exactly what the torch rules write, wrap int32 offsets as the kernels
do, take int32 and int64 lengths, check their views on every call, and write nothing when a
length is out of range.

Every writer fills a view of a buffer poisoned outside it, so a write past its extent shows.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from specmeta.kernels.branch_kv_indices import branch_kv_indptr
from specmeta.kernels.draft_decode_kv_indices import DraftDecodeIndptr, draft_decode_kv_indptr
from specmeta.kernels.verify_lens import fill_bucket
from specmeta.metadata import host_ops, host_ops_numpy
from specmeta.metadata.host_ops import LengthRule

POISON = -7
MAX_LEN, MAX_BS, TOPK, ROWS, PS, SHIFT = 50, 9, 3, 4, 4, 5
CAP = 17  # a draft window's window + sink (design §2.10)


def test_warmup_builds_the_compiled_host_ops_once(compiled_host_ops):
    """Triton needs a C compiler and Python's headers to launch on a GPU, so the host ops build
    wherever a GPU runs, and here (this image has both): ``warmup()`` built them (the
    fixture), a second call builds nothing and says so, and every later call gets the same
    module."""
    assert host_ops.unavailable() is None
    assert host_ops.warmup() == {"host_ops": "built earlier in this process"}
    assert host_ops.compiled() is compiled_host_ops


def _lengths(gen, batch, dtype, high=MAX_LEN):
    """Random lengths in ``[0, high]`` with both ends present once the batch has room."""
    lens = torch.randint(0, high + 1, (batch,), generator=gen, dtype=torch.int64)
    if batch >= 2:
        lens[torch.randint(0, batch, (1,), generator=gen)] = 0
        lens[torch.randint(0, batch, (1,), generator=gen)] = high
    return lens.to(dtype)


def _poisoned(*shape):
    return torch.full(shape, POISON, dtype=torch.int32)


def _writers(kind, batch, use_compiled):
    """(writer, buffers it writes into) for one mode's rule, the views cut from poisoned
    buffers of the plan's size."""
    if kind in ("draft_decode", "draft_window"):
        out = _poisoned(ROWS, MAX_BS * TOPK + 1)
        rule = DraftDecodeIndptr(TOPK, ROWS, MAX_BS, torch.int32)
        lengths = LengthRule(MAX_LEN, cap=CAP if kind == "draft_window" else None)
        write = host_ops.draft_decode_writer(lengths, rule, TOPK, batch,
                                             out[:, : batch * TOPK + 1],
                                             use_compiled=use_compiled)  # fmt: skip
        return write, (out,)
    if kind == "paged":
        out, last = _poisoned(ROWS, MAX_BS * TOPK + 1), _poisoned(ROWS, MAX_BS * TOPK)
        lengths = LengthRule(MAX_LEN)
        write = host_ops.paged_writer(
            lengths,
            TOPK,
            PS,
            batch,
            out[:, : batch * TOPK + 1],
            last[:, : batch * TOPK],
            use_compiled=use_compiled,
        )
        return write, (out, last)
    out, scaled = _poisoned(MAX_BS + 1), _poisoned(MAX_BS + 1)
    out[0] = scaled[0] = 0  # the ring's buffers are allocated zeroed
    shift = SHIFT if kind == "prefill" else 0
    lengths = LengthRule(MAX_LEN, shift, cap=CAP if kind == "cascade_window" else None)
    if kind == "prefill":
        write = host_ops.prefix_writer(lengths, batch, out[: batch + 1], scaled[: batch + 1],
                                       3, use_compiled=use_compiled)  # fmt: skip
        return write, (out, scaled)
    write = host_ops.prefix_writer(lengths, batch, out[: batch + 1], use_compiled=use_compiled)
    return write, (out,)


KINDS = ["draft_decode", "draft_window", "paged", "prefill", "cascade", "cascade_window"]
OPS = ["compiled", "numpy"]


def _op(which, compiled_host_ops):
    """The module of the host ops' entry points: compiled, or numpy's twin (same calls)."""
    return compiled_host_ops if which == "compiled" else host_ops_numpy


def _expected(kind, lens):
    """What each rule writes, from the library's torch rules on the same lengths."""
    B = lens.shape[0]
    if kind in ("draft_decode", "draft_window"):
        out = _poisoned(ROWS, MAX_BS * TOPK + 1)
        # A window's lists hold min(L, window + sink) prefix tokens: its lengths capped.
        capped = lens.clamp_max(CAP) if kind == "draft_window" else lens
        draft_decode_kv_indptr(capped, TOPK, ROWS, out=out)
        return (out,)
    if kind == "paged":
        out, last = _poisoned(ROWS, MAX_BS * TOPK + 1), _poisoned(ROWS, MAX_BS * TOPK)
        branch_kv_indptr(lens, TOPK, ROWS, PS, out, last)
        return out, last
    out = _poisoned(MAX_BS + 1)
    shift = SHIFT if kind == "prefill" else 0
    # A window's prefix level lists min(L, window + sink) tokens: its lengths capped.
    capped = lens.clamp_max(CAP) if kind == "cascade_window" else lens
    out[: B + 1] = torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.cumsum(capped.to(torch.int64) + shift, 0)])  # fmt: skip
    if kind in ("cascade", "cascade_window"):
        return (out,)
    scaled = _poisoned(MAX_BS + 1)
    scaled[: B + 1] = out[: B + 1] * 3
    return out, scaled


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_and_numpy_writers_write_what_the_rules_write(kind, gen, compiled_host_ops):
    """Both writers (compiled, and numpy's where the module is not used), at every batch size
    from 0 to max_bs (the lengths 0 and max_len among them), int32 and int64 lengths drawn
    fresh, return (max L, ΣL) and write exactly the torch rule's values inside their views and
    nothing outside them."""
    for B in range(MAX_BS + 1):
        for dtype in (torch.int32, torch.int64):
            lens = _lengths(gen, B, dtype)
            want = _expected(kind, lens)
            for use_compiled in (True, False):
                write, bufs = _writers(kind, B, use_compiled)
                total = write(lens)
                want_stats = (int(lens.max()) if B else 0, int(lens.sum()))
                assert total == want_stats, (kind, use_compiled, B, dtype)
                for got, exp in zip(bufs, want, strict=True):
                    mismatch = (got != exp).nonzero()
                    assert mismatch.numel() == 0, (
                        f"{kind} compiled={use_compiled} B={B} {dtype} lens={lens.tolist()}: "
                        f"first mismatch at {mismatch[0].tolist()}"
                    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_length_out_of_range_raises_and_writes_nothing(kind, gen, compiled_host_ops):
    """One length planted out of range (−1 or max_len + 1, at a random index, int32 or int64),
    in a batch of 2 and of max_bs (numpy reads up to 8 lengths as Python ints): IndexError
    from either writer (compiled, numpy), every buffer as it was."""
    for B, bad in itertools.product((2, MAX_BS), (-1, MAX_LEN + 1)):
        for dtype in (torch.int32, torch.int64):
            lens = _lengths(gen, B, dtype)
            at = int(torch.randint(0, B, (1,), generator=gen))
            lens[at] = bad
            for use_compiled in (True, False):
                write, bufs = _writers(kind, B, use_compiled)
                before = [b.clone() for b in bufs]
                with pytest.raises(IndexError):
                    write(lens)
                for got, was in zip(bufs, before, strict=True):
                    assert torch.equal(got, was), (
                        f"{kind} compiled={use_compiled}: written before the refusal of "
                        f"lens[{at}] = {bad}"
                    )


@pytest.mark.parametrize("which", OPS)
def test_stats_gives_max_and_sum_as_the_torch_check_does(which, gen, compiled_host_ops):
    """``stats`` (FA3's and TRT-LLM MLA's check), compiled and numpy, against
    :func:`check_length_values` and ``sum``: every batch size to max_bs, int32 and int64,
    fresh lengths; and IndexError for one length planted out of range."""
    from specmeta import SpecConfig
    from specmeta.metadata.inputs import check_length_values

    cfg = SpecConfig(topk=1, num_steps=2, num_draft_tokens=2, page_size=1, max_bs=MAX_BS,
                     max_context_len=MAX_LEN)  # fmt: skip
    stats = _op(which, compiled_host_ops).stats
    for B in [*range(MAX_BS + 1), 37]:  # numpy's reads up to 32 lengths as Python ints
        for dtype in (torch.int32, torch.int64):
            lens = _lengths(gen, B, dtype)
            high, _ = check_length_values("x", cfg, lens)
            assert stats(MAX_LEN, B, lens) == (high, int(lens.sum())), (B, dtype, lens.tolist())
            if B:
                for bad in (-1, MAX_LEN + 1):
                    planted = lens.clone()
                    planted[int(torch.randint(0, B, (1,), generator=gen))] = bad
                    with pytest.raises(IndexError):
                        stats(MAX_LEN, B, planted)
    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        stats(-1, 1, torch.zeros(1, dtype=torch.int64))


def _wrapped(values):
    """Python ints as the int32 a kernel's store keeps: modulo 2**32, signed."""
    return [(v + 2**31) % 2**32 - 2**31 for v in values]


@pytest.mark.parametrize("which", OPS)
def test_int32_offsets_wrap_as_the_kernels_stores_do(which, gen, compiled_host_ops):
    """Lengths near 2**30: the sums pass 2**32, and every offset is the exact sum modulo
    2**32, as the torch rules' int32 sums and the kernels' int32 stores are. The compiled
    module and numpy's are called directly."""
    op = _op(which, compiled_host_ops)
    big = 2**31 - 1
    lens = torch.randint(2**30, 2**31 - 1, (5,), generator=gen, dtype=torch.int64)
    B, K, rows, n = 5, 4, 3, 7
    out = _poisoned(rows, B * K + 1)
    assert op.draft_decode(big, K, B, big, out.numpy(), lens) == (lens.max(), lens.sum())
    want = draft_decode_kv_indptr(lens, K, rows)  # int64, exact
    assert out.tolist() == [_wrapped(r) for r in want.tolist()]
    out, last = _poisoned(rows, B * K + 1), _poisoned(rows, B * K)
    op.paged(big, K, PS, B, out.numpy(), last.numpy(), lens)
    want_last = torch.empty(rows, B * K, dtype=torch.int64)
    want = branch_kv_indptr(lens, K, rows, PS, None, want_last)
    assert out.tolist() == [_wrapped(r) for r in want.tolist()]
    assert torch.equal(last, want_last.to(torch.int32))
    out, scaled = _poisoned(B + 1), _poisoned(B + 1)
    op.prefix(big, n, 6, big, B, out.numpy(), scaled.numpy(), lens)
    sums = [0] + torch.cumsum(lens + n, 0).tolist()
    assert out.tolist() == _wrapped(sums)
    assert scaled.tolist() == _wrapped([6 * v for v in sums])


@pytest.mark.parametrize("which", OPS)
def test_a_negative_int32_length_is_refused_under_any_max_len(which, compiled_host_ops):
    """max_len past 2**31, so past every int32 length: a negative int32 length is still
    refused (IndexError naming it) and nothing is written, from a few lengths (numpy reads
    them as ints) and from many (numpy reads them through their unsigned view)."""
    op, big = _op(which, compiled_host_ops), 2**31 + 5
    for B in (2, 12):
        lens = torch.full((B,), 7, dtype=torch.int32)
        lens[B // 2] = -(2**31)
        out = _poisoned(ROWS, B * TOPK + 1)
        with pytest.raises(IndexError, match=rf"seq_lens_cpu\[{B // 2}\] = -2147483648"):
            op.draft_decode(big, TOPK, B, big, out.numpy(), lens)
        assert out.eq(POISON).all(), f"B={B}: written before the refusal"


# (topk, page_size): the widths the draft-decode writer unrolls (1, 2, 4, 8) and others, page
# sizes that are powers of two (a shift and a mask) and others (a division).
WIDTHS = [(1, 1), (2, 16), (3, 4), (4, 3), (5, 2), (8, 1), (8, 6)]


@pytest.mark.parametrize("which", OPS)
def test_every_width_and_page_size(which, gen, compiled_host_ops):
    """The draft-decode and paged writers (compiled, numpy) at every width and page size of
    ``WIDTHS``, batch sizes 0 to ``MAX_BS`` and 37 (vector loops and their remainders), int32
    and int64 lengths drawn fresh: exactly the torch rules' values, nothing written outside
    the views."""
    op = _op(which, compiled_host_ops)
    for K, ps in WIDTHS:
        for B in [*range(MAX_BS + 1), 37]:
            for dtype in (torch.int32, torch.int64):
                lens = _lengths(gen, B, dtype)
                width = 37 * K + 1
                out, want = _poisoned(ROWS, width), _poisoned(ROWS, width)
                view = out[:, : B * K + 1]  # rows of the full width apart, as a mirror's
                stats = (int(lens.max()) if B else 0, int(lens.sum()))
                assert op.draft_decode(MAX_LEN, K, B, MAX_LEN, view.numpy(), lens) == stats
                draft_decode_kv_indptr(lens, K, ROWS, out=want[:, : B * K + 1])
                where = f"K={K} B={B} {dtype} lens={lens.tolist()}"
                assert torch.equal(out, want), f"draft_decode {where}"
                out, last = _poisoned(ROWS, width), _poisoned(ROWS, width - 1)
                want, want_last = _poisoned(ROWS, width), _poisoned(ROWS, width - 1)
                views = out[:, : B * K + 1].numpy(), last[:, : B * K].numpy()
                assert op.paged(MAX_LEN, K, ps, B, *views, lens) == stats
                branch_kv_indptr(lens, K, ROWS, ps, want[:, : B * K + 1], want_last)
                assert torch.equal(out, want), f"paged offsets ps={ps} {where}"
                assert torch.equal(last, want_last), f"paged last pages ps={ps} {where}"


@pytest.mark.parametrize("spread", [False, True])
def test_the_numpy_paged_writer_sums_over_branches_or_requests_alike(spread, gen, monkeypatch):
    """numpy's paged writer sums the pages over every branch, or, from ``_SPREAD`` branches
    × steps, over the requests, and spreads each request's sums to its branches: either way
    exactly the torch rule's offsets and last pages (offsets near 2**31 wrap as int32), at
    several widths and page sizes, int32 and int64 lengths, nothing written outside the
    views."""
    monkeypatch.setattr(host_ops_numpy, "_SPREAD", 1 if spread else 2**62)
    big = 2**31 - 1
    for K, ps in ((2, 16), (3, 4), (8, 6), (5, 1)):
        for B in (1, 5, 37):
            for dtype, high in ((torch.int32, MAX_LEN), (torch.int64, MAX_LEN), (torch.int64, big)):
                lens = _lengths(gen, B, dtype, high)
                out, last = _poisoned(ROWS, B * K + 3), _poisoned(ROWS, B * K + 2)
                write = host_ops_numpy.Paged(high, K, ps, B, out[:, : B * K + 1].numpy(),
                                             last[:, : B * K].numpy())  # fmt: skip
                assert write._spread is spread  # the path this case is for
                assert write(lens) == (int(lens.max()), int(lens.sum()))
                want_last = torch.full((ROWS, B * K + 2), POISON, dtype=torch.int64)
                want = branch_kv_indptr(lens, K, ROWS, ps, None, want_last).tolist()  # int64
                where = f"K={K} ps={ps} B={B} {dtype} lens={lens.tolist()}"
                assert out[:, : B * K + 1].tolist() == [_wrapped(r) for r in want], where
                assert torch.equal(last, want_last.to(torch.int32)), where
                assert out[:, B * K + 1 :].eq(POISON).all(), f"written past the view: {where}"


def test_a_writer_refuses_a_view_it_cannot_fill():
    """The views are checked when a writer is bound, never on a call: a wrong dtype or shape
    raises there, naming the view."""
    lengths = LengthRule(MAX_LEN)
    with pytest.raises(ValueError, match=r"out must be an int32 CPU view of shape \[4\]"):
        host_ops.prefix_writer(lengths, 3, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"last must be an int32 CPU view of shape \[2, 6\]"):
        host_ops.paged_writer(lengths, 3, PS, 2, torch.zeros(2, 7, dtype=torch.int32),
                              torch.zeros(2, 5, dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_reads_only_a_tensor_of_its_batch(kind, compiled_host_ops):
    """Called on its own, a writer refuses lengths it cannot read safely before reading them,
    compiled and numpy alike, with the same exception and message: another dtype, another
    length, a second dimension, a non-contiguous view (an expanded one would read past its
    storage), another device."""
    B = 4
    good = torch.arange(B, dtype=torch.int64)
    bad = [
        (TypeError, "int32 or int64", good.to(torch.float32)),
        (ValueError, r"shape \[4\]", good[:3]),
        (ValueError, r"shape \[4\]", good.view(2, 2)),
        (ValueError, "contiguous CPU", torch.arange(2 * B, dtype=torch.int64)[::2]),
        (ValueError, "contiguous CPU", torch.zeros(1, dtype=torch.int64).expand(B)),
        (ValueError, "contiguous CPU", torch.empty(B, dtype=torch.int64, device="meta")),
    ]
    said: dict = {}  # each refusal's messages, compiled and numpy
    for use_compiled in (True, False):
        write, bufs = _writers(kind, B, use_compiled)
        before = [b.clone() for b in bufs]
        for kind_of_error, message, lens in bad:
            with pytest.raises(kind_of_error, match=message) as raised:
                write(lens)
            said.setdefault(id(lens), set()).add(str(raised.value))
        for got, was in zip(bufs, before, strict=True):
            assert torch.equal(got, was), f"{kind} compiled={use_compiled}: written"
    assert all(len(messages) == 1 for messages in said.values()), said
    for op in (compiled_host_ops, host_ops_numpy):
        _refusals_of_stats(op, good, bad)


def _refusals_of_stats(op, good, bad):
    B = good.shape[0]
    assert op.stats(MAX_LEN, B, good) == (B - 1, sum(range(B)))
    assert op.stats(MAX_LEN, B, good.to(torch.int32)) == (B - 1, sum(range(B)))
    with pytest.raises(TypeError, match="int32 or int64"):
        op.stats(MAX_LEN, B, good.to(torch.int16))
    for kind_of_error, message, lens in [*bad, (TypeError, "int32 or int64", [0, 1, 2, 3])]:
        with pytest.raises(kind_of_error, match=message):
            op.stats(MAX_LEN, B, lens)


def test_a_writer_refuses_bad_bind_arguments():
    """topk and page_size of at least 1, scale of at least 0, tensors for views: checked when
    a writer is bound, each named."""
    lengths = LengthRule(MAX_LEN)
    out, last = torch.zeros(2, 7, dtype=torch.int32), torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size"):
        host_ops.paged_writer(lengths, 3, 0, 2, out, last)
    with pytest.raises(ValueError, match="topk"):
        host_ops.paged_writer(lengths, 0, PS, 2, out, last)
    with pytest.raises(ValueError, match="scale"):
        host_ops.prefix_writer(lengths, 3, torch.zeros(4, dtype=torch.int32), scale=-1)
    with pytest.raises(TypeError, match="out must be an int32 CPU tensor view, got list"):
        host_ops.prefix_writer(lengths, 3, [0, 0, 0, 0])
    rule = DraftDecodeIndptr(TOPK, ROWS, MAX_BS, torch.int32)
    with pytest.raises(ValueError, match="out must be a 2-D int32 CPU view"):
        host_ops.draft_decode_writer(lengths, rule, TOPK, 2, torch.zeros(7, dtype=torch.int32))


def test_without_the_compiled_module_the_numpy_writers_serve():
    """``SPECMETA_HOST_OPS=0`` (as on a machine without a C compiler): ``warmup()`` builds
    nothing and says why, and a FlashInfer build's host mirrors are still written (by hand:
    lengths 3 and 16 with N = 4 give [0, 7, 27]). ``launch=False``: the subprocess may run on
    a GPU machine."""
    code = (
        "import torch\n"
        "from specmeta import SpecConfig, FlashInferBuilder, warmup\n"
        "from specmeta.metadata import host_ops\n"
        "done = warmup()\n"
        "assert done == {'host_ops': 'not built: SPECMETA_HOST_OPS=0 (the numpy implementation "
        "serves)'}, done\n"
        "assert host_ops.compiled() is None\n"
        "assert host_ops.unavailable() == 'SPECMETA_HOST_OPS=0', host_ops.unavailable()\n"
        "cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=4, page_size=1, max_bs=2,\n"
        "                 max_context_len=16)\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "fi = FlashInferBuilder(cfg, dev, modes=('draft_extend',))\n"
        "r2t = torch.arange(3 * cfg.req_to_token_width, dtype=torch.int32).view(3, -1).to(dev)\n"
        "lens = torch.tensor([3, 16], dtype=torch.int32)\n"
        "m = fi.draft_extend(torch.tensor([1, 2]).to(dev), r2t, lens.to(dev), seq_lens_cpu=lens,\n"
        "                    launch=False)\n"
        "assert m.kv_indptr_host.tolist() == [0, 7, 27], m.kv_indptr_host\n"
        "print('ok')\n"
    )
    env = dict(os.environ, SPECMETA_HOST_OPS="0")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _compiled_call(op, kind, batch, view, second, lens):
    """The compiled writer of ``kind`` on ``view`` (its ``out``), ``second`` (``last`` or
    ``scaled``; none for the others) and ``lens``."""
    if kind in ("draft_decode", "draft_window"):
        return op.draft_decode(MAX_LEN, TOPK, batch, CAP if kind == "draft_window" else MAX_LEN,
                               view, lens)  # fmt: skip
    if kind == "paged":
        return op.paged(MAX_LEN, TOPK, PS, batch, view, second, lens)
    if kind == "prefill":
        return op.prefix(MAX_LEN, SHIFT, 3, MAX_LEN, batch, view, second, lens)
    cap = CAP if kind == "cascade_window" else MAX_LEN
    return op.prefix(MAX_LEN, 0, 0, cap, batch, view, None, lens)


@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_writer_checks_its_views_on_every_call(kind, gen, compiled_host_ops):
    """The compiled module keeps no address: each call takes its views through the buffer
    protocol and checks them before the lengths are read: another dtype, another shape, a
    read-only or non-buffer object, rows that overlap, a gap inside a row. Each is refused
    naming the view, and nothing is written (the other view included); then lengths it
    refuses write nothing either."""
    op, B = compiled_host_ops, 4
    lens = _lengths(gen, B, torch.int64)
    rows_of = kind in ("draft_decode", "draft_window", "paged")
    width = B * TOPK + 1
    good = _poisoned(ROWS, width) if rows_of else _poisoned(B + 1)
    second = {"paged": _poisoned(ROWS, width - 1), "prefill": _poisoned(B + 1)}.get(kind)
    second = second.numpy() if second is not None else None
    shape = tuple(good.shape)
    read_only = good.clone().numpy()
    read_only.setflags(write=False)
    writable = r"out must be a writable int32 buffer \(the numpy view of a host mirror\)"
    bad = [
        (ValueError, "out must be an int32 buffer", np.zeros(shape, dtype=np.int64)),
        (ValueError, "out must be an int32 buffer",
         np.zeros((*shape[:-1], shape[-1] + 1), dtype=np.int32)),
        (ValueError, "out must be an int32 buffer", np.zeros((2, *shape), dtype=np.int32)),
        (TypeError, "out must be a writable int32 buffer", read_only),
        (ValueError, "out must be an int32 buffer", bytearray(4 * good.numel())),  # bytes
        (TypeError, "out must be a writable int32 buffer", bytes(4 * good.numel())),
        (TypeError, f"{writable}, got list", [0] * good.numel()),
        (TypeError, f"{writable}, got Tensor", good),
    ]  # fmt: skip
    if rows_of:  # rows that overlap (a zero row stride), and a gap inside a row
        bad.append((ValueError, "rows in order", np.lib.stride_tricks.as_strided(
            np.zeros(width, dtype=np.int32), shape=shape, strides=(0, 4))))  # fmt: skip
        bad.append((ValueError, "unit stride within a row",
                    np.zeros((ROWS, 2 * width), dtype=np.int32)[:, ::2]))  # fmt: skip
    for error, message, view in bad:
        kept = second.copy() if second is not None else None
        with pytest.raises(error, match=message):
            _compiled_call(op, kind, B, view, second, lens)
        if second is not None:
            assert (second == kept).all(), f"{kind}: the second view was written"
    if second is not None:  # the second view refused: the first is not written
        name = "last" if kind == "paged" else "scaled"
        view = good.numpy()
        with pytest.raises(ValueError, match=f"{name} must be an int32 buffer"):
            _compiled_call(op, kind, B, view, second[..., :-1], lens)
        assert (view == POISON).all(), f"{kind}: out written before {name} was refused"
    view = good.numpy()
    assert _compiled_call(op, kind, B, view, second, lens) == (int(lens.max()), int(lens.sum()))
    before = view.copy()
    with pytest.raises(IndexError):
        _compiled_call(op, kind, B, view, second, torch.tensor([1, 2, MAX_LEN + 1, 0]))
    assert (view == before).all()


def test_a_compiled_writer_keeps_its_mirror_alive():
    """A writer holds the numpy views of its mirrors, which hold the tensors: a writer whose
    mirror tensor has no other reference left still writes into live memory, and the values
    read back through its view are the rule's."""
    host_ops.warmup()
    assert host_ops.compiled() is not None, host_ops.unavailable()
    lengths = LengthRule(MAX_LEN, SHIFT)
    write = host_ops.prefix_writer(lengths, 3, torch.zeros(MAX_BS + 1, dtype=torch.int32)[:4])
    gc.collect()
    for _ in range(3):
        gc.collect()
        assert write(torch.tensor([1, 0, 7])) == (7, 8)
    view = write.args[5]
    assert view.tolist() == [0, 1 + SHIFT, 1 + 2 * SHIFT, 8 + 3 * SHIFT]
    assert isinstance(view.base, torch.Tensor)  # the mirror tensor, kept alive by its view


@pytest.fixture
def unbuilt(monkeypatch):
    """The host ops as in a fresh process: not built, not tried; ``calls`` counts the builds
    of a fake build (0.3 s each, an object for the module), restored after the test."""
    calls = []

    def build():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return object()

    monkeypatch.setattr(host_ops, "_module", None)
    monkeypatch.setattr(host_ops, "_failure", None)
    monkeypatch.setattr(host_ops, "_build", build)
    monkeypatch.delenv("SPECMETA_HOST_OPS", raising=False)
    return calls


def test_warmup_from_two_threads_builds_once_and_gives_both_the_module(unbuilt):
    """Two threads call ``warmup()`` at once: one builds, the other waits for that build
    (it does not fall back to torch for the life of the process) and both see the one
    module. Before it, ``compiled()`` builds nothing."""
    assert host_ops.compiled() is None and unbuilt == []
    assert host_ops.unavailable().startswith("not built in this process: call specmeta.warmup()")
    start, seen, done = threading.Barrier(2), [], []

    def worker():
        start.wait()
        done.append(host_ops.warmup()["host_ops"])
        seen.append(host_ops.compiled())

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(unbuilt) == 1, f"built {len(unbuilt)} times"
    assert len(seen) == 2 and seen[0] is seen[1] is host_ops.compiled() is not None
    first, second = sorted(done)
    assert first == "built earlier in this process" and second.startswith("built in "), done
    assert float(second.split()[2]) >= 0.3, done  # the build this thread waited for
    assert host_ops.unavailable() is None


def test_warmup_honours_the_switch_and_keeps_a_failure(unbuilt, monkeypatch):
    """``SPECMETA_HOST_OPS=0`` builds nothing (read on every call); a build that fails is
    tried once, its reason kept by ``unavailable()`` and returned by every later call."""
    monkeypatch.setenv("SPECMETA_HOST_OPS", "0")
    assert host_ops.warmup() == {"host_ops": "not built: SPECMETA_HOST_OPS=0 (the numpy "
                                 "implementation serves)"}  # fmt: skip
    assert host_ops.unavailable() == "SPECMETA_HOST_OPS=0" and unbuilt == []

    def broken():
        unbuilt.append("broken")
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(host_ops, "_build", broken)
    monkeypatch.delenv("SPECMETA_HOST_OPS")
    want = {"host_ops": "not available: RuntimeError: no compiler here (the numpy "
            "implementation serves)"}  # fmt: skip
    assert host_ops.warmup() == want and host_ops.warmup() == want
    assert unbuilt == ["broken"] and host_ops.compiled() is None
    assert host_ops.unavailable() == "RuntimeError: no compiler here"


def _ragged_expected(lens, real, T, n):
    """The ragged mirrors read from the rule (issue 40): padded lengths, then the three
    cumulative sums, as Python ints."""
    from tests._support import padded_lengths

    v = padded_lengths(real, T, lens.shape[0])
    cols = [int(L) + min(x, n) for L, x in zip(lens.tolist(), v, strict=True)]
    acc = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
    return v, acc(v), acc(cols), acc([x * c for x, c in zip(v, cols, strict=True)])


def test_ragged_writers_write_what_the_rule_writes(gen, compiled_host_ops):
    """A ragged verify's mirrors (design §2.9), compiled and numpy, at every bucket size and
    real count, with T from Σv (no leftover) to B·N: exactly the rule's values, nothing
    outside the views; a real length over N or a sum over T raises and writes nothing
    (compiled: the builder names the value first)."""
    n = SHIFT
    lengths = LengthRule(MAX_LEN, n)
    # (B, count, T) drawn, then fixed: the last request or one pad past N (their columns
    # clipped to N), T = Σv (no leftover), an empty bucket
    cases = [(B, None, None) for B in range(1, MAX_BS + 1)]
    cases += [(4, 4, 4 * n), (4, 3, 4 * n), (3, 2, None), (0, 0, 0)]
    for B, count, T in cases:
        lens = _lengths(gen, B, torch.int64)
        if count is None:
            count = int(torch.randint(0, B + 1, (1,), generator=gen))
        real = torch.randint(0, n + 1, (count,), generator=gen, dtype=torch.int32)
        if B == 4:
            real.zero_()  # every token of T is leftover
        low = int(real.sum())
        if T is None:
            T = low if B == 3 else low + int(torch.randint(0, B * n - low + 1, (1,), generator=gen))
        want = _ragged_expected(lens, real.tolist(), T, n)
        # the torch rule of the padding (the reference's) reads the same lengths
        ref = torch.cat([real, torch.zeros(B - count, dtype=torch.int32)])
        assert fill_bucket(ref, count, T - low).tolist() == want[0], (real, T, B)
        for use_compiled in (True, False):
            bufs = [_poisoned(MAX_BS + (i > 0)) for i in range(4)]
            for buf in bufs[1:]:
                buf[0] = 0  # the ring's buffers are allocated zeroed
            views = [bufs[0][:B], *(b[: B + 1] for b in bufs[1:])]
            write = host_ops.ragged_verify_writer(lengths, B, count, T, n, *views,
                                                  use_compiled=use_compiled)  # fmt: skip
            found = write(lens, real)
            # what it checked: (max L, ΣL, max v, Σv)
            assert found == (int(lens.max()) if B else 0, int(lens.sum()),
                             int(real.max()) if count else 0, low), (lens, real)  # fmt: skip
            for name, buf, exp in zip(("verify", "qo", "kv", "mask"), bufs, want, strict=True):
                size = len(exp)
                assert buf[:size].tolist() == exp, (name, use_compiled, lens, real, T)
                assert buf[size:].eq(POISON).all(), (name, use_compiled, "written past")
    for bad in ("over_n", "over_t", "length"):
        real = torch.tensor([n + 1 if bad == "over_n" else n, n], dtype=torch.int32)
        lens = torch.tensor([1, MAX_LEN + 1 if bad == "length" else 2, 3])
        said = set()
        for use_compiled in (True, False):
            bufs = [_poisoned(3), _poisoned(4), _poisoned(4), _poisoned(4)]
            write = host_ops.ragged_verify_writer(lengths, 3, 2, 2 * n - 1, n, *bufs,
                                                  use_compiled=use_compiled)  # fmt: skip
            with pytest.raises((IndexError, ValueError)) as raised:
                write(lens, real)
            said.add(f"{type(raised.value).__name__}: {raised.value}")
            assert all(b.eq(POISON).all() for b in bufs), (bad, use_compiled)
        assert len(said) == 1, said  # the same refusal, compiled and numpy
