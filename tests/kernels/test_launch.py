"""The launch path of every kernel, bound once (``specmeta.launch``, design §2.7). Compiles are
counted through ``triton.knobs.runtime.jit_post_compile_hook`` (a documented knob since Triton
3.4: 3.6 and 3.9 alike), not through the JIT function's undocumented ``device_caches``."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import triton
import triton.language as tl

import specmeta.launch as launch_module
from specmeta import new_status
from specmeta.kernels.verify_expand_page_table import (
    bind_verify_expand_page_table,
    verify_expand_page_table_ref,
)
from specmeta.kernels.verify_kv_indices import bind_verify_kv_indices
from specmeta.launch import Launcher, cdiv, check_device
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import POISON, assert_equal


@triton.jit(do_not_specialize=["plain"])
def _axpy_kernel(x_ptr, out_ptr, n, plain, scale, BLOCK: tl.constexpr, ACC: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(x_ptr + offs, mask=m, other=0) * scale + plain
    if ACC:  # out += x·scale + plain: every launch shows in the result
        y += tl.load(out_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, y, mask=m)


_axpy = Launcher(_axpy_kernel)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def test_bind_writes_nothing_until_called_then_launches_once_per_call(device, gen):
    n = int(torch.randint(1, 200, (1,), generator=gen))
    x = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int64).to(device)
    out = torch.full((n + 5,), -7, dtype=torch.int64, device=device)  # 5 past n stay -7
    kw = dict(x_ptr=x, out_ptr=out, n=n, plain=3, scale=2, BLOCK=32, ACC=True)
    launch, eager = _axpy.bind((cdiv(n, 32),), **kw), []
    # The bind alone, the launch twice, an eager call, the launch it returned: one launch a step.
    steps = [lambda: None, launch, launch, lambda: eager.append(_axpy((cdiv(n, 32),), **kw))]
    for launches, step in enumerate([*steps, lambda: eager[0]()]):
        step()
        _sync(device)
        want = torch.full_like(out, -7)
        want[:n] += launches * (2 * x + 3)
        assert_equal(out, want, f"after {launches} launches")


def test_bind_names_the_kernel_and_the_missing_and_unexpected_arguments(device):
    x = torch.arange(8, dtype=torch.int64, device=device)
    out = torch.zeros_like(x)
    kw = dict(x_ptr=x, out_ptr=out, n=8, plain=0, scale=2, BLOCK=8, ACC=False)
    without = lambda name: {k: v for k, v in kw.items() if k != name}
    cases = [({**without("scale"), "scal": 2}, r"\['scale'\], unexpected \['scal'\]"),
             (without("ACC"), r"\['ACC'\], unexpected \[\]")]  # fmt: skip
    for call in (_axpy.bind, _axpy):
        for args, names in cases:
            with pytest.raises(TypeError, match=r"^_axpy_kernel: missing arguments " + names):
                call((1,), **args)
    _sync(device)
    assert not out.any(), "nothing was launched"


def test_check_device_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^here: device cuda was asked for, but this torch sees"):
        check_device("here", torch.device("cuda"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for off in (None, "0", ""):
        if off is not None:
            monkeypatch.setenv("TRITON_INTERPRET", off)
        with pytest.raises(ValueError, match=r"^there: device cpu needs Triton's interpreter"):
            check_device("there", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The interpreter is on: the CPU is served where the interpreter can run the kernels, and
    # refused, naming why, where it cannot (Triton < 3.7 with NumPy 2.4, the GPU host's).
    monkeypatch.setattr(launch_module, "interpreter_problem", lambda: None)
    check_device("there", torch.device("cpu"))
    monkeypatch.setattr(launch_module, "interpreter_problem", lambda: "Triton 3.6.0 cannot")
    with pytest.raises(ValueError, match=r"^there: device cpu: Triton 3.6.0 cannot$"):
        check_device("there", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^elsewhere: device meta is not supported"):
        check_device("elsewhere", torch.device("meta"))


def _verify_inputs(gen, device, B, n=6):
    batch = make_batch("random", batch_size=B, topk=2, num_steps=3, page_size=4, row_width=96,
                       generator=gen, device=device, extra_tokens=n)  # fmt: skip
    mask = random_tree_mask(B, 2, 3, n, gen).to(device)
    return [batch.req_pool_indices, batch.req_to_token, batch.seq_lens, mask]


def test_bound_stage_launched_twice_equals_the_reference_both_times(device, gen):
    """A stage of two launches bound once; before each call new device values go into the same
    inputs and the outputs are poisoned: each call writes the reference's result."""
    B, N = 5, 6
    inputs = _verify_inputs(gen, device, B)
    shapes = {"page_table": (B * N, N), "cache_seqlens": (B * N,), "cu_seqlens_k": (B * N + 1,)}
    outs = {k: torch.full(s, POISON, dtype=torch.int32, device=device) for k, s in shapes.items()}
    status = new_status(device)
    stage = bind_verify_expand_page_table(*inputs, **outs, status=status)
    assert len(stage.launches) == 2
    for call in range(2):
        for t, new in zip(inputs, _verify_inputs(gen, device, B), strict=True):
            t.copy_(new)
        for t in outs.values():
            t.fill_(POISON)
        got = stage()
        assert got[0] is outs["page_table"] and got[1] is outs["cache_seqlens"]
        want, ref_status = {k: torch.empty_like(t) for k, t in outs.items()}, new_status(device)
        verify_expand_page_table_ref(*inputs, **want, status=ref_status)
        for name, t in outs.items():
            assert_equal(t, want[name], f"{name}, call {call}")
        assert_equal(status, ref_status, f"status, call {call}")


def test_bind_with_bad_arguments_raises_before_anything_is_written(device, gen):
    args = _verify_inputs(gen, device, 4)[:3]
    idx = torch.full((64,), POISON, dtype=torch.int32, device=device)
    ptr = torch.full((5,), POISON, dtype=torch.int32, device=device)
    kw = dict(extra_tokens=6, kv_indices=idx, status=new_status(device))
    with pytest.raises(ValueError, match=r"kv_indices is too small: need 65 entries .*, have 64"):
        bind_verify_kv_indices(*args, kv_indptr=ptr, seq_lens_sum=65 - 4 * 6, **kw)
    with pytest.raises(ValueError, match=r"kv_indptr is too small: need 5 entries"):
        bind_verify_kv_indices(*args, kv_indptr=ptr[:4], **kw)
    bind_verify_kv_indices(*args, kv_indptr=ptr, seq_lens_sum=64 - 4 * 6, **kw)  # fits
    _sync(device)
    assert (idx == POISON).all() and (ptr == POISON).all(), "a bind launched"
    assert not kw["status"].any(), "a bind launched"


@contextlib.contextmanager
def _compiles():
    """The kernels Triton compiles (or loads from its disk cache) in the block, by their repr."""
    runtime, seen = triton.knobs.runtime, []
    before = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    try:
        yield seen
    finally:
        runtime.jit_post_compile_hook = before


@pytest.mark.gpu
def test_gpu_bound_launch_of_a_misaligned_view_is_correct(gen):
    """Triton specializes pointers on 16-byte alignment: the bind of a misaligned view gets the
    kernel compiled for it, not the aligned view's, and its launch is correct."""
    x, out = torch.randint(-50, 50, (300,), generator=gen).cuda(), torch.full((300,), -7).cuda()
    n, kw = 255, dict(plain=5, scale=3, BLOCK=64, ACC=False)
    aligned = _axpy.bind((cdiv(n, 64),), x_ptr=x[:n], out_ptr=out[:n], n=n, **kw)
    shifted = _axpy.bind((cdiv(n, 64),), x_ptr=x[1 : n + 1], out_ptr=out[1 : n + 1], n=n, **kw)
    assert shifted.compiled is not aligned.compiled
    want = torch.full_like(out, -7)
    for launch, start in ((shifted, 1), (aligned, 0)):
        launch()
        torch.cuda.synchronize()
        want[start : start + n] = 3 * x[start : start + n] + 5
        assert_equal(out, want, f"view at element {start}")


@pytest.mark.gpu
def test_gpu_second_batch_size_compiles_nothing(gen):
    def bound(B, n):
        cu = torch.empty(B * n + 1, dtype=torch.int32, device="cuda")
        return bind_verify_expand_page_table(*_verify_inputs(gen, "cuda", B, n), cu_seqlens_k=cu)

    bound(7, 6)()  # compiles both kernels
    with _compiles() as seen:
        for B in (13, 1, 64, 200):
            bound(B, 6)()
        torch.cuda.synchronize()
    assert seen == [], f"a new batch size compiled {seen}"
    with _compiles() as seen:
        bound(7, 12)  # a wider tree: BLOCK_N, a constexpr, doubles; the bind compiles
    assert seen, "the hook sees a compile (so the count above can fail)"


def _bound_on_temporaries(gen, n):
    x = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int64)
    out = torch.full((n,), -7, dtype=torch.int64, device="cuda")
    kw = dict(x_ptr=x.cuda(), out_ptr=out, n=n, plain=1, scale=2, BLOCK=128, ACC=False)
    return _axpy.bind((cdiv(n, 128),), **kw), 2 * x + 1


@pytest.mark.gpu
def test_gpu_launch_keeps_the_tensors_it_was_bound_to_alive(gen):
    n = 1 << 16
    launch, want = _bound_on_temporaries(gen, n)  # the caller holds neither tensor
    gc.collect()
    junk = [torch.full((n,), 99, dtype=torch.int64, device="cuda") for _ in range(8)]
    launch()
    torch.cuda.synchronize()
    assert_equal(launch.args[_axpy.names.index("out_ptr")].cpu(), want, "out")
    assert all(bool((j == 99).all()) for j in junk), "the launch wrote memory it does not own"


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch):
    """Triton before 3.7 with NumPy 2.4: the problem names both versions and the fix, and a
    builder on the CPU (under the interpreter) refuses at construction with it, instead of
    failing inside the first kernel."""
    import numpy

    from specmeta import SpecConfig
    from specmeta.launch import _interpreting, interpreter_problem
    from specmeta.metadata.fa3 import FA3MetadataBuilder

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    problem = (
        "Triton 3.6.0's CPU interpreter cannot run specmeta's kernels with NumPy 2.4.6 (it "
        "turns one-element arrays into loop bounds, which NumPy 2.4 refuses); install "
        "triton>=3.7, or numpy<2.4"
    )
    assert interpreter_problem() == problem
    if _interpreting():
        cfg = SpecConfig(topk=2, num_steps=2, num_draft_tokens=3, page_size=4, max_bs=2,
                         max_context_len=16)  # fmt: skip
        with pytest.raises(ValueError) as info:
            FA3MetadataBuilder(cfg, "cpu")
        assert str(info.value) == f"FA3MetadataBuilder: device cpu: {problem}"
    for triton_v, numpy_v in (("3.7.0", "2.4.6"), ("3.6.0", "2.3.5"), ("3.10.0", "2.5.0")):
        monkeypatch.setattr(triton, "__version__", triton_v)
        monkeypatch.setattr(numpy, "__version__", numpy_v)
        assert interpreter_problem() is None, (triton_v, numpy_v)
