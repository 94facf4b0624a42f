"""FlashInfer's host-mirror writers (design §3.3): the compiled writers write exactly what the
torch rules write, wrap int32 offsets as the kernels do, take int32 and int64 lengths, and
write nothing when a length is out of range.

Every writer fills a view of a buffer poisoned outside it, so a write past its extent shows.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specmeta.kernels.branch_kv_indices import branch_kv_indptr
from specmeta.kernels.draft_decode_kv_indices import DraftDecodeIndptr, draft_decode_kv_indptr
from specmeta.metadata import host_ops
from specmeta.metadata.host_ops import LengthTable

POISON = -7
MAX_LEN, MAX_BS, TOPK, ROWS, PS, SHIFT = 50, 9, 3, 4, 4, 5


def test_the_compiled_writers_are_built_where_triton_launches():
    """Triton needs a C compiler and Python's headers to launch on a GPU, so the writers build
    wherever a GPU runs, and in CI (whose image has both). Elsewhere the torch writers serve,
    and this says why."""
    why = host_ops.unavailable()
    if why is not None and not torch.cuda.is_available() and not os.environ.get("CI"):
        pytest.skip(f"no compiled host writers on this CPU machine: {why}")
    assert why is None, f"the compiled host writers did not build: {why}"


needs_compiled = pytest.mark.skipif(
    host_ops.compiled() is None, reason=f"compiled host writers unavailable: {host_ops.unavailable()}"
)


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
    if kind == "draft_decode":
        out = _poisoned(ROWS, MAX_BS * TOPK + 1)
        rule = DraftDecodeIndptr(TOPK, ROWS, MAX_BS, torch.int32)
        table = LengthTable(MAX_LEN, MAX_BS)
        write = host_ops.draft_decode_writer(table, rule, TOPK, batch,
                                             out[:, : batch * TOPK + 1],
                                             use_compiled=use_compiled)  # fmt: skip
        return write, (out,)
    if kind == "paged":
        out, last = _poisoned(ROWS, MAX_BS * TOPK + 1), _poisoned(ROWS, MAX_BS * TOPK)
        table = LengthTable(MAX_LEN, MAX_BS)
        write = host_ops.paged_writer(table, TOPK, PS, batch, out[:, : batch * TOPK + 1],
                                      last[:, : batch * TOPK], use_compiled=use_compiled)
        return write, (out, last)
    out, scaled = _poisoned(MAX_BS + 1), _poisoned(MAX_BS + 1)
    out[0] = scaled[0] = 0  # the ring's buffers are allocated zeroed
    shift = SHIFT if kind == "prefill" else 0
    table = LengthTable(MAX_LEN, MAX_BS, shift)
    if kind == "prefill":
        write = host_ops.prefix_writer(table, batch, out[: batch + 1], scaled[: batch + 1],
                                       3, use_compiled=use_compiled)  # fmt: skip
        return write, (out, scaled)
    write = host_ops.prefix_writer(table, batch, out[: batch + 1], use_compiled=use_compiled)
    return write, (out,)


KINDS = ["draft_decode", "paged", "prefill", "cascade"]


def _expected(kind, lens):
    """What each rule writes, from the library's torch rules on the same lengths."""
    B = lens.shape[0]
    if kind == "draft_decode":
        out = _poisoned(ROWS, MAX_BS * TOPK + 1)
        draft_decode_kv_indptr(lens, TOPK, ROWS, out=out)
        return (out,)
    if kind == "paged":
        out, last = _poisoned(ROWS, MAX_BS * TOPK + 1), _poisoned(ROWS, MAX_BS * TOPK)
        branch_kv_indptr(lens, TOPK, ROWS, PS, out, last)
        return out, last
    out = _poisoned(MAX_BS + 1)
    shift = SHIFT if kind == "prefill" else 0
    out[: B + 1] = torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.cumsum(lens.to(torch.int64) + shift, 0)])  # fmt: skip
    if kind == "cascade":
        return (out,)
    scaled = _poisoned(MAX_BS + 1)
    scaled[: B + 1] = out[: B + 1] * 3
    return out, scaled


@needs_compiled
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_and_torch_writers_write_what_the_rules_write(kind, gen):
    """Both writers, at every batch size from 0 to max_bs, int32 and int64 lengths drawn fresh,
    return ΣL (the torch writer leaves it to the caller) and write exactly the rule's values
    inside their views and nothing outside them."""
    for B in range(MAX_BS + 1):
        for dtype in (torch.int32, torch.int64):
            lens = _lengths(gen, B, dtype)
            want = _expected(kind, lens)
            for use_compiled in (True, False):
                write, bufs = _writers(kind, B, use_compiled)
                total = write(lens)
                assert total == (int(lens.sum()) if use_compiled else None)
                for got, exp in zip(bufs, want, strict=True):
                    mismatch = (got != exp).nonzero()
                    assert mismatch.numel() == 0, (
                        f"{kind} compiled={use_compiled} B={B} {dtype} lens={lens.tolist()}: "
                        f"first mismatch at {mismatch[0].tolist()}"
                    )


@needs_compiled
@pytest.mark.parametrize("kind", KINDS)
def test_a_length_out_of_range_raises_and_writes_nothing(kind, gen):
    """One length planted out of range (−1 or max_len + 1, at a random index, int32 or int64):
    IndexError from either writer, every buffer as it was."""
    B = MAX_BS
    for bad in (-1, MAX_LEN + 1):
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


@needs_compiled
def test_stats_gives_max_and_sum_as_the_torch_check_does(gen):
    """``stats`` (FA3's and TRT-LLM MLA's check) against :func:`check_length_values` and
    ``sum``: every batch size to max_bs, int32 and int64, fresh lengths; and IndexError for
    one length planted out of range."""
    from specmeta import SpecConfig
    from specmeta.metadata.inputs import check_length_values

    cfg = SpecConfig(topk=1, num_steps=2, num_draft_tokens=2, page_size=1, max_bs=MAX_BS,
                     max_context_len=MAX_LEN)  # fmt: skip
    stats = host_ops.compiled().stats
    for B in range(MAX_BS + 1):
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


@needs_compiled
def test_int32_offsets_wrap_as_the_kernels_stores_do(gen):
    """Lengths near 2**30: the sums pass 2**32, and every offset is the exact sum modulo
    2**32, as the torch rules' int32 sums and the kernels' int32 stores are. The compiled
    module is called directly (a length table of 2**31 positions would take 8 GB)."""
    op = host_ops.compiled()
    big = 2**31 - 1
    lens = torch.randint(2**30, 2**31 - 1, (5,), generator=gen, dtype=torch.int64)
    B, K, rows, n = 5, 4, 3, 7
    out = _poisoned(rows, B * K + 1)
    assert op.draft_decode(big, K, rows, out.data_ptr(), out.stride(0), B, lens) == lens.sum()
    want = draft_decode_kv_indptr(lens, K, rows)  # int64, exact
    assert out.tolist() == [_wrapped(r) for r in want.tolist()]
    out, last = _poisoned(rows, B * K + 1), _poisoned(rows, B * K)
    op.paged(big, K, rows, PS, out.data_ptr(), out.stride(0), last.data_ptr(), last.stride(0),
             B, lens)  # fmt: skip
    want_last = torch.empty(rows, B * K, dtype=torch.int64)
    want = branch_kv_indptr(lens, K, rows, PS, None, want_last)
    assert out.tolist() == [_wrapped(r) for r in want.tolist()]
    assert torch.equal(last, want_last.to(torch.int32))
    out, scaled = _poisoned(B + 1), _poisoned(B + 1)
    op.prefix(big, n, 6, out.data_ptr(), scaled.data_ptr(), B, lens)
    sums = [0] + torch.cumsum(lens + n, 0).tolist()
    assert out.tolist() == _wrapped(sums)
    assert scaled.tolist() == _wrapped([6 * v for v in sums])


# (topk, page_size): the widths the compiled writers unroll (1, 2, 4, 8) and others, page sizes
# that are powers of two (a shift and a mask) and others (a division).
WIDTHS = [(1, 1), (2, 16), (3, 4), (4, 3), (5, 2), (8, 1), (8, 6)]


@functools.cache
def _baseline():
    """The compiled module built for the baseline CPU alone (``VECTOR`` defined empty: no AVX2
    clone), so that the loops the CPU running the tests does not pick are checked too. It
    reads its lengths tensors through Python attribute calls (no ``lengths_view``), the way
    the module takes where the native layout module is not built."""
    from triton.runtime.build import compile_module_from_src

    source = "#define VECTOR\n" + Path(host_ops.__file__).with_name("host_ops.c").read_text()
    module = compile_module_from_src(source, "specmeta_host_ops")
    module.init(torch.int64, torch.int32, None)
    return module


@needs_compiled
@pytest.mark.parametrize("build", ["dispatched", "baseline"])
def test_every_width_and_page_size_on_both_builds(build, gen):
    """The draft-decode and paged writers at every width and page size of ``WIDTHS``, batch
    sizes 0 to ``MAX_BS`` and 37 (vector loops and their remainders), int32 and int64 lengths
    drawn fresh: exactly the torch rules' values, nothing written outside the views. Both
    builds: the one the module loads with (AVX2 where the CPU has it) and the baseline."""
    op = host_ops.compiled() if build == "dispatched" else _baseline()
    for K, ps in WIDTHS:
        for B in [*range(MAX_BS + 1), 37]:
            for dtype in (torch.int32, torch.int64):
                lens = _lengths(gen, B, dtype)
                width = 37 * K + 1
                out, want = _poisoned(ROWS, width), _poisoned(ROWS, width)
                assert op.draft_decode(MAX_LEN, K, ROWS, out.data_ptr(), out.stride(0), B,
                                       lens) == int(lens.sum())  # fmt: skip
                draft_decode_kv_indptr(lens, K, ROWS, out=want)
                where = f"{build} K={K} B={B} {dtype} lens={lens.tolist()}"
                assert torch.equal(out, want), f"draft_decode {where}"
                out, last = _poisoned(ROWS, width), _poisoned(ROWS, width - 1)
                want, want_last = _poisoned(ROWS, width), _poisoned(ROWS, width - 1)
                assert op.paged(MAX_LEN, K, ROWS, ps, out.data_ptr(), out.stride(0),
                                last.data_ptr(), last.stride(0), B, lens) == int(lens.sum())
                branch_kv_indptr(lens, K, ROWS, ps, want, want_last)
                assert torch.equal(out, want), f"paged offsets ps={ps} {where}"
                assert torch.equal(last, want_last), f"paged last pages ps={ps} {where}"


def test_a_writer_refuses_a_view_it_cannot_fill():
    """The views are checked when a writer is bound, never on a call: a wrong dtype or shape
    raises there, naming the view."""
    table = LengthTable(MAX_LEN, MAX_BS)
    with pytest.raises(ValueError, match=r"out must be an int32 CPU view of shape \[4\]"):
        host_ops.prefix_writer(table, 3, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"last must be an int32 CPU view of shape \[2, 6\]"):
        host_ops.paged_writer(table, 3, PS, 2, torch.zeros(2, 7, dtype=torch.int32),
                              torch.zeros(2, 5, dtype=torch.int32))  # fmt: skip


@needs_compiled
@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_reads_only_a_tensor_of_its_batch(kind):
    """Called on its own, a writer refuses lengths it cannot read safely before reading them,
    compiled and torch alike: another dtype, another length, a second dimension, a
    non-contiguous view (an expanded one would read past its storage), another device."""
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
    for use_compiled in (True, False):
        write, bufs = _writers(kind, B, use_compiled)
        before = [b.clone() for b in bufs]
        for kind_of_error, message, lens in bad:
            with pytest.raises(kind_of_error, match=message):
                write(lens)
        for got, was in zip(bufs, before, strict=True):
            assert torch.equal(got, was), f"{kind} compiled={use_compiled}: written"
    for op in (host_ops.compiled(), _baseline()):  # the native read and the Python one
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
    table = LengthTable(MAX_LEN, MAX_BS)
    out, last = torch.zeros(2, 7, dtype=torch.int32), torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size"):
        host_ops.paged_writer(table, 3, 0, 2, out, last)
    with pytest.raises(ValueError, match="topk"):
        host_ops.paged_writer(table, 0, PS, 2, out, last)
    with pytest.raises(ValueError, match="scale"):
        host_ops.prefix_writer(table, 3, torch.zeros(4, dtype=torch.int32), scale=-1)
    with pytest.raises(TypeError, match="out must be an int32 CPU tensor view, got list"):
        host_ops.prefix_writer(table, 3, [0, 0, 0, 0])
    rule = DraftDecodeIndptr(TOPK, ROWS, MAX_BS, torch.int32)
    with pytest.raises(ValueError, match="out must be a 2-D int32 CPU view"):
        host_ops.draft_decode_writer(table, rule, TOPK, 2, torch.zeros(7, dtype=torch.int32))


def test_without_the_compiled_module_the_torch_writers_serve():
    """``SPECMETA_HOST_OPS=0`` (as on a machine without a C compiler): no compiled module, the
    reason given, and a FlashInfer build's host mirrors still written (by hand: lengths 3 and 16
    with N = 4 give [0, 7, 27]). ``launch=False``: the subprocess may run on a GPU machine."""
    code = (
        "import torch\n"
        "from specmeta import SpecConfig, FlashInferBuilder\n"
        "from specmeta.metadata import host_ops\n"
        "assert host_ops.compiled() is None\n"
        "assert host_ops.unavailable() == 'SPECMETA_HOST_OPS=0', host_ops.unavailable()\n"
        "cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=4, page_size=1, max_bs=2,\n"
        "                 max_context_len=16)\n"
        "fi = FlashInferBuilder(cfg, 'cpu', modes=('draft_extend',))\n"
        "r2t = torch.arange(3 * cfg.req_to_token_width, dtype=torch.int32).view(3, -1)\n"
        "lens = torch.tensor([3, 16], dtype=torch.int32)\n"
        "m = fi.draft_extend(torch.tensor([1, 2]), r2t, lens, seq_lens_cpu=lens, launch=False)\n"
        "assert m.kv_indptr_host.tolist() == [0, 7, 27], m.kv_indptr_host\n"
        "print('ok')\n"
    )
    env = dict(os.environ, SPECMETA_HOST_OPS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
