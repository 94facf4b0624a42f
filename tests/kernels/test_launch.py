"""The launch path of every kernel (``specmeta.launch.Launcher``, design §2.7).

On CUDA a launcher reuses a compiled handle per specialization; these tests hold it to the rule
that makes that safe: two calls share a handle only if Triton would compile the same kernel for
both. The key is checked against Triton's rules as stated in the module docstring (pointer
dtype and 16-byte alignment, integer width, value 1 and divisibility by 16 unless
``do_not_specialize``, constexpr values), and on the GPU the launches themselves are compared
with Triton's ordinary launch on views and integers that flip each specialization.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from specmeta.launch import Launcher
from specmeta.runners import collector_off


@triton.jit(do_not_specialize=["plain"])
def _affine_kernel(x_ptr, out_ptr, n, plain, scale, BLOCK: tl.constexpr, ADD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    y = x * scale + plain
    if ADD:
        y = y + 1
    tl.store(out_ptr + offs, y, mask=m)


_affine = Launcher(_affine_kernel)


def _expected(x, n, plain, scale, add):
    y = x[:n] * scale + plain + (1 if add else 0)
    return y


def test_launcher_by_keyword_matches_torch(device, gen):
    n = int(torch.randint(1, 100, (1,), generator=gen))
    x = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int64).to(device)
    out = torch.zeros_like(x)
    _affine(
        (triton.cdiv(n, 32),), x_ptr=x, out_ptr=out, n=n, plain=3, scale=2, BLOCK=32, ADD=True
    )
    assert torch.equal(out, _expected(x, n, 3, 2, True)), f"n={n}"


def test_launcher_rejects_missing_and_misspelt_arguments(device):
    x = torch.arange(8, dtype=torch.int64, device=device)
    out = torch.zeros_like(x)
    kw = dict(x_ptr=x, out_ptr=out, n=8, plain=0, scale=2, BLOCK=8, ADD=False)
    with pytest.raises(TypeError, match=r"missing arguments \['scale'\], unexpected \['scal'\]"):
        _affine((1,), **{**{k: v for k, v in kw.items() if k != "scale"}, "scal": 2})
    with pytest.raises(TypeError, match=r"missing arguments \['ADD'\], unexpected \[\]"):
        _affine((1,), **{k: v for k, v in kw.items() if k != "ADD"})
    assert not out.any(), "nothing was launched"


def _fake(*params):
    """A stand-in JIT function with the given (name, constexpr, do_not_specialize, no-align)."""
    return types.SimpleNamespace(
        params=[
            types.SimpleNamespace(
                name=n, is_constexpr=c, do_not_specialize=d, do_not_specialize_on_alignment=a
            )
            for n, c, d, a in params
        ]
    )


def _key(launcher, **args):
    return launcher._key([args[n] for n in launcher.names], ())


def test_key_separates_every_triton_specialization():
    base = torch.zeros(64, dtype=torch.int32)
    lau = Launcher(_fake(("p", False, False, False), ("i", False, False, False),
                         ("c", True, False, False)))  # fmt: skip
    ref = _key(lau, p=base, i=32, c=4)
    # Each of these flips one thing Triton specializes on.
    flips = {
        "misaligned pointer": dict(p=base[1:], i=32, c=4),
        "pointer dtype": dict(p=base.to(torch.int64), i=32, c=4),
        "int equal to 1": dict(p=base, i=1, c=4),
        "int not divisible by 16": dict(p=base, i=33, c=4),
        "int past 32 bits": dict(p=base, i=2**31 + 32, c=4),
        "int past 63 bits": dict(p=base, i=2**63 + 32, c=4),
        "constexpr": dict(p=base, i=32, c=5),
    }
    for what, args in flips.items():
        assert _key(lau, **args) != ref, what
    # 1 is its own specialization (a constant), apart from any other value that is not /16.
    assert _key(lau, p=base, i=1, c=4) != _key(lau, p=base, i=3, c=4)
    # Same specialization: another aligned view, another multiple of 16 that is not 1.
    assert _key(lau, p=base[4:], i=48, c=4) == ref
    assert _key(lau, p=base, i=5, c=4) == _key(lau, p=base, i=7, c=4)


def test_key_keeps_argument_patterns_apart():
    """A fused kernel's launchers switch a pass off with None: each pattern of None, tensor and
    int slots has its own key, and a pointer's key still follows its dtype and alignment."""
    base = torch.zeros(64, dtype=torch.int32)
    lau = Launcher(_fake(("p", False, False, False), ("q", False, False, False),
                         ("i", False, False, False)))  # fmt: skip
    keys = {
        "q None": _key(lau, p=base, q=None, i=32),
        "p None": _key(lau, p=None, q=base, i=32),
        "both": _key(lau, p=base, q=base, i=32),
        "i None": _key(lau, p=base, q=base, i=None),
        "q misaligned": _key(lau, p=base, q=base[1:], i=32),
        "p None, q int64": _key(lau, p=None, q=base.to(torch.int64), i=32),
    }
    assert len(set(keys.values())) == len(keys), keys
    # Past the fast patterns a launcher keeps, the generic key still tells them apart.
    assert _key(lau, p=None, q=None, i=3) != _key(lau, p=None, q=None, i=1)
    assert _key(lau, p=None, q=None, i=3) == _key(lau, p=None, q=None, i=5)
    assert _key(lau, p=None, q=base, i=32) == keys["p None"]


def test_key_follows_do_not_specialize():
    base = torch.zeros(64, dtype=torch.int32)
    lau = Launcher(_fake(("p", False, False, True), ("i", False, True, False)))
    ref = _key(lau, p=base, i=32)
    # Neither alignment nor value is specialized: one handle serves them all...
    assert _key(lau, p=base[1:], i=1) == ref
    assert _key(lau, p=base, i=33) == ref
    # ...but the integer's width and the pointer's dtype are still part of the signature.
    assert _key(lau, p=base, i=2**31) != ref
    assert _key(lau, p=base.to(torch.int64), i=32) != ref


@pytest.mark.gpu
def test_gpu_direct_launches_equal_triton_launches(gen):
    """Views and integers that flip each specialization, in an order that reuses handles: every
    result equals torch's and Triton's own launch, and each specialization gets its handle."""
    x = torch.randint(-50, 50, (4096,), generator=gen, dtype=torch.int64).cuda()
    launcher = Launcher(_affine_kernel)
    cases = []
    for offset in (0, 1, 2, 0, 1):  # misaligned views, then back to aligned
        for n in (1, 16, 17, 32, 1, 17):  # 1 and multiples of 16 are specialized
            for plain in (1, 5, 2**31 + 7):  # do_not_specialize, but the last is 64-bit
                for add in (False, True):
                    cases.append((offset, n, plain, add))
    for offset, n, plain, add in cases:
        src = x[offset:]
        out = torch.zeros(n + 3, dtype=torch.int64, device="cuda")[: n + offset][offset:]
        kw = dict(x_ptr=src, out_ptr=out, n=n, plain=plain, scale=3, BLOCK=64, ADD=add)
        launcher((triton.cdiv(n, 64),), **kw)
        want = torch.zeros_like(out)
        _affine_kernel[(triton.cdiv(n, 64),)](**{**kw, "out_ptr": want})
        assert torch.equal(out, want), (offset, n, plain, add)
        assert torch.equal(out[:n], _expected(src, n, plain, 3, add)), (offset, n, plain, add)
    assert len(launcher._handles) >= 2 * 2 * 3 * 2, "each specialization has its own handle"


@pytest.mark.gpu
def test_gpu_handle_is_tritons_c_launcher_on_triton_3_6():
    """On Triton 3.6 a handle launches through the C function that ``CompiledKernel.run``
    wraps (``run.launch``), and its launches equal Triton's (the test above); on any other
    Triton it is ``run`` itself."""
    x = torch.arange(64, dtype=torch.int64, device="cuda")
    out = torch.zeros_like(x)
    kw = dict(x_ptr=x, out_ptr=out, n=64, plain=0, scale=2, BLOCK=64, ADD=False)
    launcher = Launcher(_affine_kernel)
    launcher((1,), **kw)
    (fn, head), = launcher._handles.values()
    compiled = _affine_kernel[(1,)](**kw)
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) == (3, 6):
        assert fn is compiled.run.launch and head[0] == compiled.function
    else:
        assert fn is compiled.run
    launcher((1,), **{**kw, "scale": 5})
    torch.cuda.synchronize()
    assert torch.equal(out, 5 * x), "a launch through the handle"


@pytest.mark.gpu
def test_gpu_direct_launch_under_a_graph_replays():
    x = torch.arange(100, dtype=torch.int64, device="cuda")
    out = torch.zeros_like(x)
    kw = dict(x_ptr=x, out_ptr=out, n=100, plain=0, scale=2, BLOCK=128, ADD=False)
    _affine((1,), **kw)  # compiles
    _affine((1,), **kw)  # takes the handle
    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with collector_off(), torch.cuda.graph(graph):
        _affine((1,), **kw)
    assert int(out.sum()) == 0, "capture runs nothing"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, 2 * x)


# ------------------------------------------------------------------------------------------------
# LaunchPlans: a call's launches, replayed for a later call with the same host-visible arguments
# ------------------------------------------------------------------------------------------------
class _Recorder:
    """A stand-in handle ``(run, head)`` whose ``run`` records what it was launched with."""

    def __init__(self):
        self.calls = []

    def run(self, g0, g1, g2, stream, function, metadata, *rest):
        self.calls.append(((g0, g1, g2), stream, function, metadata, rest[3:]))

    def handle(self, function="fn", metadata="meta"):
        """The handle of a kernel launched through ``CompiledKernel.run``."""
        return self.run, (function, metadata, None, None, None)


@pytest.fixture
def plans_on(monkeypatch):
    """LaunchPlans as on CUDA (device 0, stream 7), on CPU tensors."""
    import specmeta.launch as launch

    monkeypatch.setattr(launch, "_INTERPRETED", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    return launch


def test_plan_replays_the_stored_launch_with_addresses(plans_on):
    rec = _Recorder()
    plans = plans_on.LaunchPlans()
    x, out = torch.arange(8), torch.zeros(8, dtype=torch.int64)
    sig = plans.signature(x, out, 3, None)
    assert not plans.replay(sig), "nothing stored yet"
    launch = plans_on.Launch(rec.handle(), (2, 1, 1), 0, [x, out, 3, None])
    plans.store(sig, launch)
    assert plans.replay(plans.signature(x, out, 3, None))
    assert rec.calls == [((2, 1, 1), 7, "fn", "meta", (x.data_ptr(), out.data_ptr(), 3, None))]


def test_plan_replay_runs_its_host_check_first(plans_on):
    """A launcher's host total (``seq_lens_sum``) is checked on a replay too: the check runs
    only when a plan exists, before its launches, and a failing check launches nothing."""
    rec, calls = _Recorder(), []
    plans = plans_on.LaunchPlans()
    x = torch.arange(8)
    sig = plans.signature(x, 3)

    def check():
        calls.append("check")

    assert not plans.replay(sig, check) and calls == [], "no plan: no check, no launch"
    plans.store(sig, plans_on.Launch(rec.handle(), (1, 1, 1), 0, [x, 3]))
    assert plans.replay(sig, check) and calls == ["check"] and len(rec.calls) == 1

    def too_small():
        raise ValueError("kv_indices is too small")

    with pytest.raises(ValueError, match="too small"):
        plans.replay(sig, too_small)
    assert len(rec.calls) == 1, "a failing check launches nothing"


def test_plan_signature_separates_everything_the_checks_read(plans_on):
    from specmeta import validate

    plans = plans_on.LaunchPlans()
    storage = torch.zeros(9, 8, dtype=torch.int32)
    base = storage[:8]
    ref = plans.signature(base, 4, 1)
    differ = {
        "address (same shape and strides)": (storage[1:], 4, 1),
        "shape": (base[:4], 4, 1),
        "strides (same address and shape)": (base.t(), 4, 1),
        "dtype": (base.view(torch.float32), 4, 1),
        "another storage, same shape": (base.clone(), 4, 1),
        "an int": (base, 5, 1),
        "a bool for an int": (base, 4, True),
        "None for an int": (base, 4, None),
    }
    for what, args in differ.items():
        assert plans.signature(*args) != ref, what
    assert plans.signature(base, 4, 1) == ref
    assert validate.trusting(plans.signature)(base, 4, 1) != ref, "a builder's call is apart"
    with plans_on.recording():
        assert plans.signature(base, 4, 1) is None, "a builder records: no plan of the op's own"


def test_plan_not_stored_without_a_handle_launch(plans_on):
    rec = _Recorder()
    plans = plans_on.LaunchPlans()
    x = torch.arange(4)
    sig = plans.signature(x)
    plans.store(sig, plans_on.Launch(rec.handle("f", "m"), (1, 1, 1), 0, [x]), None)
    assert not plans.replay(sig), "one launch of the op took Triton's path: no plan"
    plans.store(sig, plans_on.Launch(rec.handle("f", "m"), (1, 1, 1), 1, [x]))
    assert not plans.replay(sig), "a launch on another device than the call's: no plan"
    assert rec.calls == []


def test_plans_off_under_a_launch_hook(plans_on, monkeypatch):
    monkeypatch.setattr(plans_on, "_hooks_installed", lambda: True)
    assert plans_on.LaunchPlans().signature(torch.arange(3)) is None


@pytest.mark.gpu
def test_gpu_planned_launches_equal_the_reference(gen):
    """Calls that replay a plan (same buffers, new device values), and calls that must not
    (another view, another output, an allocated output), against the torch reference."""
    from specmeta.kernels.draft_cache_locs import (
        assign_draft_cache_locs,
        assign_draft_cache_locs_ref,
    )
    from specmeta.workloads import make_batch

    kw = dict(topk=2, num_steps=3, page_size=4)
    batch = make_batch("random", batch_size=6, row_width=256, generator=gen, device="cuda",
                       extra_tokens=8, max_len=200, **kw)  # fmt: skip
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    big = torch.full((2 * 6 * 2 * 3 + 4,), -7, dtype=torch.int64, device="cuda")
    for round_ in range(4):
        lens = torch.randint(0, 200, (6,), generator=gen).to(batch.seq_lens)
        batch.seq_lens.copy_(lens)  # same tensor, new values: the plan's launch reads them
        for out in (big[:36], big[36:72], big[4:40]):  # each view its own plan
            assign_draft_cache_locs(*a, out_cache_loc=out, **kw)
            want = assign_draft_cache_locs_ref(*a, out_cache_loc=torch.empty_like(out), **kw)
            assert torch.equal(out, want), (round_, out.data_ptr() - big.data_ptr())
        fresh = assign_draft_cache_locs(*a, **kw)  # allocated: never a plan's old buffer
        assert torch.equal(fresh, assign_draft_cache_locs_ref(*a, **kw)), round_


def test_builder_checks_again_a_tensor_changed_in_place(gen):
    """A builder checks a call's tensors once per signature: a tensor resized in place after a
    checked call has another signature, and is checked (and refused) again."""
    from specmeta import SpecConfig
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.workloads import make_batch

    cfg = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=1, max_bs=4,
                     max_context_len=64)  # fmt: skip
    batch = make_batch("random", batch_size=4, topk=1, num_steps=3, page_size=1,
                       row_width=cfg.req_to_token_width, generator=gen, max_len=64)  # fmt: skip
    fa3 = FA3MetadataBuilder(cfg, "cpu", modes=("draft_decode",))
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    fa3.draft_decode(*a, launch=False)
    fa3.draft_decode(*a, launch=False)  # the same signature: checked once
    batch.seq_lens.resize_(5)
    with pytest.raises(ValueError, match="seq_lens has 5 entries but req_pool_indices has 4"):
        fa3.draft_decode(*a, launch=False)
    batch.seq_lens.resize_(4)
    narrow = batch.req_to_token[:, : cfg.row_width_need - 1]
    with pytest.raises(ValueError, match="positions wide"):
        fa3.draft_decode(a[0], narrow, a[2], launch=False)


def _tensors(obj):
    """Every tensor field of a builder's result (dataclasses and tuples of them)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, tuple | list):
        for x in obj:
            yield from _tensors(x)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mode", [("fa3", "draft_decode"), ("flashinfer", "draft_decode"),
                                          ("flashinfer", "draft_decode_shared_prefix")])  # fmt: skip
@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16)])
def test_gpu_builder_plans_follow_new_device_values(gen, backend, mode, k, ps):
    """A builder's second and later calls on the same tensors replay its first call's launches
    (new lengths in the same buffers); every result equals the reference builder's."""
    from specmeta import SpecConfig
    from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder
    from specmeta.workloads import make_batch

    cfg = SpecConfig(topk=k, num_steps=4, num_draft_tokens=5, page_size=ps, max_bs=6,
                     max_context_len=300)  # fmt: skip
    batch = make_batch("random", batch_size=6, topk=k, num_steps=4, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                       extra_tokens=8, max_len=300)  # fmt: skip
    cls = FA3MetadataBuilder if backend == "fa3" else FlashInferBuilder
    real, ref = cls(cfg, "cuda", modes=(mode,)), cls(cfg, "cuda", modes=(mode,), reference=True)
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = torch.empty(6 * k * 4, dtype=torch.int64, device="cuda")
    for round_ in range(4):
        batch.seq_lens.copy_(torch.randint(1, 300, (6,), generator=gen))
        assign_draft_cache_locs(*a, out_cache_loc=slots, topk=k, num_steps=4, page_size=ps)
        extra = (slots,) if backend == "fa3" else ()
        got = list(_tensors(getattr(real, mode)(*a, *extra)))
        want = list(_tensors(getattr(ref, mode)(*a, *extra)))
        assert len(got) == len(want) > 0
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), (round_, i)
    assert int(real.status) == 0


_SIGNERS = {"native": {}, "torch-guard": {"native": False}, "python-reads": {"guarded": False}}


def _signer(how):
    """A Signer of the way ``how``, asserted to be that way (a way that is not available
    here fails, it is not skipped)."""
    from specmeta import validate

    sign = validate.Signer(**_SIGNERS[how])
    assert sign.way == {"native": "native", "torch-guard": "torch's guard",
                        "python-reads": "python reads"}[how]  # fmt: skip
    return sign


@pytest.mark.parametrize("how", list(_SIGNERS))
def test_signer_keys_separate_types_patterns_and_arity(how):
    """A Signer's keys are as selective as validate.signature: per argument-type pattern (a
    tensor, an int, None, a bool in a slot), past its fourth pattern too, and for another
    number of arguments."""
    sign = _signer(how)
    x = torch.arange(6)
    calls = [
        (x, 3, None),
        (x, True, None),  # a bool where an int was
        (x, 3, x),  # a tensor where None was
        (x, None, None),
        (3, 3, None),  # an int where a tensor was: past the fourth pattern
        (x, 3),
        (x[:5], 3, None),
        (x.view(2, 3), 3, None),
        (x.view(2, 3).t(), 3, None),
    ]
    keys = [sign("head", *c) for c in calls]
    assert len(set(keys)) == len(calls), keys
    assert [sign("head", *c) for c in calls] == keys, "the same call, the same key"
    assert sign("other", *calls[0]) != keys[0], "the head leads the key"
    assert sign("head", x.clone(), 3, None) != keys[0], "another address"


def test_torch_tensor_guard_is_available():
    """The signers' fast path: torch's C++ tensor guard answers the known cases
    (validate._tensor_guards) on the torch this runs on; without it every key reads each
    tensor's shape, strides and dtype in Python."""
    from specmeta import validate

    assert validate._GUARD is not None, f"torch {torch.__version__}: TensorGuards unusable"


@pytest.mark.parametrize("how", list(_SIGNERS))
def test_signer_keys_views_of_one_address_apart(how):
    """Views that share an address (a batch's slices as B changes, a reshaped or
    reinterpreted buffer) get keys as different as their signatures, past the WAYS entries
    an address remembers too; a signature seen before gets the same Key object back."""
    from specmeta import validate

    sign = _signer(how)
    buf = torch.arange(64, dtype=torch.int32)
    other = torch.zeros(8, dtype=torch.int64)
    views = [buf[:n] for n in range(1, validate.Signer.WAYS + 4)]
    views += [buf.view(8, 8), buf.view(8, 8).t(), buf.view(4, 16), buf.view(torch.float32),
              buf.view(torch.int64), buf.view(2, 32)[:, :16]]  # fmt: skip
    expected = [validate.signature(v, other) for v in views]
    assert len(set(expected)) == len(views), "the cases must differ in their signatures"
    keys = [sign("head", v, 3, other) for v in views]
    assert len(set(keys)) == len(views), keys
    again = [sign("head", v, 3, other) for v in reversed(views)]
    assert again == keys[::-1], "the same signature, an equal key"
    fresh = [sign("head", buf[:n], 3, other) for n in (1, 2, 3)]  # new view objects
    assert fresh == keys[:3]
    if how != "python-reads":
        assert all(f is k for f, k in zip(fresh, keys[:3], strict=True)), "one Key each"
    assert sign("head", buf[:3], 3, other.clone()) != keys[2], "another address"
    assert sign("head", buf[:3], 4, other) != keys[2], "another integer"
    assert sign("head", buf[:3], True, other) != sign("head", buf[:3], 1, other), "a bool"


@pytest.mark.parametrize("how", ["native", "torch-guard", "python-reads"])
def test_pinned_sees_every_change_a_captured_graph_cannot_follow(how):
    """validate.pinned (a graph runner's check of what its graphs captured): True while every
    tensor keeps its address, shape, strides, dtype and device; False after an in-place
    resize, a set_ to other storage, a guarded tensor reallocated, reshaped or viewed as
    another dtype. Each change on a fresh check, so one change alone makes it False. Each of
    the three ways it checks: the native layout check, torch's guard, Python reads."""
    from specmeta import tensor_layout, validate

    if how == "native" and tensor_layout.module() is None:
        pytest.fail(f"the native layout check is missing here: {tensor_layout.unavailable()}")
    kw = {"guarded": how != "python-reads", "native": how == "native"}

    def case():
        fixed = [torch.zeros(4, 3, dtype=torch.int32), torch.zeros(6, dtype=torch.int64)]
        box = {"t": torch.zeros(2, 8)}
        return fixed, box, validate.pinned(fixed, [lambda: box["t"]], **kw)

    fixed, box, unchanged = case()
    assert unchanged() and unchanged(), "nothing changed"
    box["t"] = box["t"][:]  # a new view object of the same storage and layout
    assert unchanged(), "the same tensor seen through another view object"
    changes = {
        "resize": lambda f, b: f[1].resize_(2),
        "set_": lambda f, b: f[0].set_(torch.zeros(4, 3, dtype=torch.int32)),
        "reallocated": lambda f, b: b.update(t=torch.zeros(2, 8)),
        "reshaped": lambda f, b: b.update(t=b["t"].view(8, 2)),
        "transposed": lambda f, b: b.update(t=b["t"].t()),
        "dtype": lambda f, b: b.update(t=b["t"].view(torch.int32)),
    }
    for name, change in changes.items():
        fixed, box, unchanged = case()
        change(fixed, box)
        assert not unchanged(), name
    fixed = [torch.zeros(5), torch.zeros(2, 2)]  # no sources: the check of fixed tensors alone
    unchanged = validate.pinned(fixed, **kw)
    assert unchanged(), "fixed tensors alone, unchanged"
    fixed[1].resize_(4)
    assert not unchanged(), "fixed tensors alone, one resized"


def test_pinned_refuses_what_is_not_a_tensor():
    """validate.pinned names the argument that is not a tensor, or not a function."""
    from specmeta import validate

    x = torch.zeros(3)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        validate.pinned([x, 3])
    with pytest.raises(TypeError, match=r"sources\[0\] is a Tensor; pass a function"):
        validate.pinned([x], [x])
    with pytest.raises(TypeError, match=r"sources\[0\]\(\) is a NoneType"):
        validate.pinned([x], [lambda: None])
