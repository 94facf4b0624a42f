"""The native tensor-layout check (specmeta/tensor_layout.py): built here, and telling two
tensors apart exactly when their Python signatures (address, shape, strides, dtype, device)
differ, on random views drawn fresh each run."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from specmeta import tensor_layout, validate


def _module():
    found = tensor_layout.module()
    if found is None:
        pytest.fail(f"the native layout check is missing here: {tensor_layout.unavailable()}")
    return found


def _views(base: torch.Tensor, rng: random.Random) -> list[torch.Tensor]:
    """Views of one buffer that share or differ in address, shape, strides and dtype."""
    a = base.view(6, 8)
    i, j = rng.randrange(0, 5), rng.randrange(1, 8)
    return [
        a, a[:], a[i:], a[:, :j], a[i:, :j], a.t(), a[:, ::2], a.reshape(48), a.view(8, 6),
        a.view(torch.float32), a[i], a[:, j - 1], a.unsqueeze(0), a.clone(),
    ]  # fmt: skip


def test_same_agrees_with_the_signature_on_random_views(device):
    layout = _module()
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(4):
        base = torch.zeros(48, dtype=torch.int32, device=device)
        views = _views(base, rng)
        for a in views:
            recorded = layout.record(a)
            for b in views:
                want = validate.signature(a) == validate.signature(b)
                got = layout.same(recorded, b)
                assert got is want, (
                    f"seed {seed}: {tuple(a.shape)}/{a.stride()}/{a.dtype} at "
                    f"{a.data_ptr()} against {tuple(b.shape)}/{b.stride()}/{b.dtype} at "
                    f"{b.data_ptr()}: native {got}, signature {want}"
                )


def test_several_tensors_in_order_and_the_wrong_arguments():
    layout = _module()
    x, y = torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)
    both = layout.record(x, y)
    assert layout.same(both, x, y) is True
    assert layout.same(both, y, x) is False, "another order"
    assert layout.same(both, x) is False, "one tensor fewer"
    assert layout.same(both, x, y, y) is False, "one tensor more"
    assert layout.same(both, x, 5) is False, "not a tensor"
    assert layout.same(layout.record(), ) is True, "no tensors at all"
    with pytest.raises(TypeError, match="record: argument 1 is not a tensor"):
        layout.record(x, "y")
    with pytest.raises(TypeError, match="layouts must be record"):
        layout.same("not bytes", x)
    with pytest.raises(ValueError, match="not record"):
        layout.same(b"abc", x)


def test_many_tensors_past_the_inline_buffer(device):
    """A call of more tensors than record() packs without a heap allocation (128 entries:
    here up to 60 tensors of rank 3, 11 entries each) records and compares them all: one
    changed tensor anywhere in the list, drawn fresh each run, makes it differ."""
    layout = _module()
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    base = torch.zeros(2, 3, 4, device=device)
    for count in (11, 12, 60):
        many = [base[:, :, : rng.randrange(1, 5)] for _ in range(count)]
        recorded = layout.record(*many)
        assert len(recorded) == 8 * (1 + 11 * count), f"seed {seed}"
        assert layout.same(recorded, *many) is True, f"seed {seed}"
        assert layout.same(recorded, *[t[:] for t in many]) is True, f"seed {seed}"
        i = rng.randrange(count)
        changed = [*many[:i], many[i].transpose(0, 1), *many[i + 1 :]]
        assert layout.same(recorded, *changed) is False, f"seed {seed}: tensor {i}"
        assert layout.record(*changed) != recorded, f"seed {seed}: tensor {i}"


def test_turned_off_by_the_environment_the_python_check_remains():
    """SPECMETA_NATIVE=0: no native module, and pinned still sees a change."""
    code = (
        "import torch; from specmeta import tensor_layout, validate\n"
        "assert tensor_layout.module() is None, 'built'\n"
        "assert tensor_layout.unavailable() == 'SPECMETA_NATIVE=0', tensor_layout.unavailable()\n"
        "x = torch.zeros(4); u = validate.pinned([x])\n"
        "assert u(); x.resize_(2); assert not u()\n"
    )
    env = {**os.environ, "SPECMETA_NATIVE": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
