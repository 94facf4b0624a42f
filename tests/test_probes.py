"""Async probes (design §6): CPU tensors raise at once naming the label, a disabled probe does no
tensor work at all, device probes are sync-free and capturable (GPU tier)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specmeta import probes
from specmeta.runners import collector_off
from tests._support import no_host_sync

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@pytest.fixture
def on():
    previous = probes.enable(True)
    yield
    probes.enable(previous)


@pytest.fixture
def off():
    previous = probes.enable(False)
    yield
    probes.enable(previous)


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class _Untouchable:
    """Fails the test if anything reads it: a disabled probe must not look at its arguments."""

    def __getattribute__(self, name):
        raise AssertionError(f"a disabled probe touched its argument ({name})")


def _all_probes(x, idx):
    probes.detect_nan(x, label="p")
    probes.detect_inf(x, label="p")
    probes.detect_oob(idx, 0, 8, label="p")
    probes.detect_page_aligned(idx, 4, label="p")


# --------------------------------------------------------------------------------------------
# Switch
# --------------------------------------------------------------------------------------------
def test_enable_returns_previous_and_rejects_non_bool(device, off):
    assert probes.enable(True) is False and probes.enabled()
    assert probes.enable(False) is True and not probes.enabled()
    with pytest.raises(TypeError, match="flag"):
        probes.enable(1)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_environment_variable_sets_the_default(device, monkeypatch, value, expected):
    previous = probes.enabled()
    monkeypatch.setenv("SPECMETA_ASYNC_ASSERT", value)
    try:
        assert importlib.reload(probes).enabled() is expected
    finally:
        monkeypatch.delenv("SPECMETA_ASYNC_ASSERT")
        importlib.reload(probes)
        probes.enable(previous)


# --------------------------------------------------------------------------------------------
# Disabled: nothing happens, not even argument checks
# --------------------------------------------------------------------------------------------
def test_disabled_probe_does_no_tensor_work(device, off):
    x = torch.tensor([float("nan"), float("inf")], device=device)
    idx = torch.tensor([-5, 99, 3], device=device)
    with _Recorder() as functions, _DispatchRecorder() as ops:
        _all_probes(x, idx)
    assert functions.calls == [] and ops.calls == []
    # Not even a look at the arguments (no dtype check, no device query).
    bad = _Untouchable()
    probes.detect_nan(bad)
    probes.detect_inf(bad)
    probes.detect_oob(bad, bad, bad)
    probes.detect_page_aligned(bad, bad)


def test_enabled_probe_is_seen_by_the_recorder(device, on):
    """The recorder of the disabled test can see a probe's work (so that test can fail)."""
    x = torch.ones(3, device=device)
    with _Recorder() as functions:
        probes.detect_nan(x)
    assert functions.calls, "an enabled probe launches tensor work"


# --------------------------------------------------------------------------------------------
# Enabled, CPU tensors: raise at once, naming the label
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_raises_on_cpu_naming_the_label(device, on, dtype):
    x = torch.zeros(5, 3, dtype=dtype)
    probes.detect_nan(x, label="draft probs")
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"probe 'draft probs': 1 of 15 values are NaN .*index 10"):
        probes.detect_nan(x, label="draft probs")
    probes.detect_inf(x)  # NaN is not Inf


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sign", [1, -1])
def test_inf_raises_on_cpu(device, on, dtype, sign):
    x = torch.full((4,), 65504.0, dtype=dtype)  # the largest finite float16 is not Inf
    probes.detect_inf(x, label="logits")
    x[2] = sign * float("inf")
    with pytest.raises(ValueError, match=r"probe 'logits': 1 of 4 values are infinite"):
        probes.detect_inf(x, label="logits")
    probes.detect_nan(x)  # Inf is not NaN


@pytest.mark.parametrize("dtype", INTS)
def test_oob_bounds_are_half_open(device, on, dtype):
    lo, hi = 2, 9
    probes.detect_oob(torch.tensor([2, 8, 5], dtype=dtype), lo, hi, label="ids")
    for bad in (1, 9, 120):
        idx = torch.tensor([2, bad, 8], dtype=dtype)
        with pytest.raises(ValueError, match=rf"probe 'ids': 1 of 3 values outside \[2, 9\) \(first: {bad} at index 1\)"):  # fmt: skip
            probes.detect_oob(idx, lo, hi, label="ids")


def test_oob_negative_index_and_empty_tensor(device, on):
    with pytest.raises(ValueError, match="first: -1 at index 0"):
        probes.detect_oob(torch.tensor([-1, 0]), 0, 4)
    probes.detect_oob(torch.empty(0, dtype=torch.int64), 0, 0)  # nothing to check
    probes.detect_nan(torch.empty(0, 7))


@pytest.mark.parametrize("ps", [1, 3, 16, 64])
def test_page_aligned_any_page_size(device, on, ps):
    good = torch.tensor([0, ps, 5 * ps, -2 * ps], dtype=torch.int64)
    probes.detect_page_aligned(good, ps, label="branch starts")
    if ps == 1:
        return  # every integer is a multiple of 1
    bad = good.clone()
    bad[2] += 1
    with pytest.raises(ValueError, match=rf"probe 'branch starts': 1 of 4 values not a multiple of {ps}"):  # fmt: skip
        probes.detect_page_aligned(bad, ps, label="branch starts")


def test_bad_arguments_raise_type_or_value_error(device, on):
    x = torch.zeros(3)
    idx = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match="floating"):
        probes.detect_nan(idx)
    with pytest.raises(TypeError, match="torch.Tensor"):
        probes.detect_inf([1.0])
    with pytest.raises(TypeError, match="integer"):
        probes.detect_oob(x, 0, 4)
    with pytest.raises(TypeError, match="integer"):
        probes.detect_page_aligned(torch.zeros(2, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match="hi"):
        probes.detect_oob(idx, 0, torch.tensor(4))
    with pytest.raises(ValueError, match="lo=5"):
        probes.detect_oob(idx, 5, 4)
    with pytest.raises(ValueError, match="ps"):
        probes.detect_page_aligned(idx, 0)


def test_clean_device_tensors_pass(device, on):
    assert probes.enabled(), "the probes must be live, or passing proves nothing"
    _all_probes(torch.randn(64, device=device), torch.arange(0, 8, 4, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    values=st.lists(st.integers(-40, 40), min_size=0, max_size=30),
    lo=st.integers(-10, 10),
    span=st.integers(0, 30),
    ps=st.integers(1, 9),
)
def test_property_raises_exactly_when_some_value_fails(device, values, lo, span, ps):
    previous = probes.enable(True)
    try:
        idx = torch.tensor(values, dtype=torch.int64)
        hi = lo + span
        oob = [v for v in values if not lo <= v < hi]
        if oob:
            with pytest.raises(ValueError, match=f"{len(oob)} of {len(values)} values outside"):
                probes.detect_oob(idx, lo, hi)
        else:
            probes.detect_oob(idx, lo, hi)
        unaligned = [v for v in values if v % ps]
        if unaligned:
            with pytest.raises(ValueError, match=f"first: {unaligned[0]} at"):
                probes.detect_page_aligned(idx, ps)
        else:
            probes.detect_page_aligned(idx, ps)
    finally:
        probes.enable(previous)


# --------------------------------------------------------------------------------------------
# GPU tier: no sync, capturable, and a failed probe is a device-side assertion
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_enabled_probes_do_not_sync_and_capture_in_a_graph(device, on):
    x = torch.randn(4096, device="cuda")
    # Valid for every probe of _all_probes: inside [0, 8) and multiples of 4.
    idx = torch.tensor([0, 4], device="cuda").repeat(2048)
    assert probes.enabled(), "the probes must be live, or passing proves nothing"
    _all_probes(x, idx)  # warm-up outside the capture
    torch.cuda.synchronize()
    with no_host_sync():
        _all_probes(x, idx)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        probes.detect_nan(x, label="x")
        probes.detect_oob(idx, 0, 8, label="idx")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
    torch.cuda.synchronize()


_FAILING_REPLAY = textwrap.dedent(
    """
    import torch
    from specmeta import probes
    probes.enable(True)
    x = torch.zeros(1000, device="cuda")
    probes.detect_nan(x, label="graph input")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a fresh process: no garbage to collect
        probes.detect_nan(x, label="graph input")
    graph.replay()
    torch.cuda.synchronize()
    print("CLEAN_REPLAY_OK", flush=True)
    x[123] = float("nan")
    graph.replay()
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        print("DEVICE_ASSERT", str(e).splitlines()[0], flush=True)
        raise SystemExit(0)
    print("NO_ASSERT", flush=True)
    """
)


@pytest.mark.gpu
def test_nan_in_a_replayed_graph_is_a_device_side_assert(device):
    """A device assert poisons the CUDA context, so it runs in a child process."""
    env = dict(os.environ, SPECMETA_ASYNC_ASSERT="0")
    proc = subprocess.run([sys.executable, "-c", _FAILING_REPLAY], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "CLEAN_REPLAY_OK" in out, out[-3000:]
    assert "DEVICE_ASSERT" in out and "NO_ASSERT" not in out, out[-3000:]
