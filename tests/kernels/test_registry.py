"""Every op of :data:`specmeta.registry.OPS` through one harness: launcher against reference on
the CPU tier, and on the GPU tier no recompilation for a new batch size and no host sync.

The per-op test files check each op against design §1–§2 read directly, its guard bands, its
faults and its argument checks; this file holds what used to be copied into each of them.
"""

from __future__ import annotations

import sys

import pytest
import torch

import specmeta.kernels
import specmeta.kernels.merge_state  # noqa: F401  (the scan below must see every kernel module)
from specmeta import new_status
from specmeta.registry import OPS
from tests._support import compiled_variants, no_host_sync
from tests.guard_bands import assert_equal

ALL_OPS = [pytest.param(op, id=op.name) for op in OPS]
# Kernels outside the registry, each with the reason.
UNREGISTERED = {
    "_merge_state_kernel": "floating point (the cascade merge): tests/kernels/test_merge_state.py",
}


@pytest.mark.parametrize("shape", ["odd", "near_row_end"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_launcher_matches_reference(device, gen, op, shape):
    """Small random batches in slot layout B (K = 2, S = 3, ps = 4): every output the launcher
    writes equals the reference's, and neither reports a fault on valid input."""
    status, ref_status = new_status(device), new_status(device)
    cases = list(op.workloads(device, gen, configs=((2, 3, 4),), shapes=(shape,)))
    assert cases, f"{op.name} has no case at K=2, S=3, ps=4"
    for case in cases:
        got = op.run(op.launcher, case, status)
        want = op.run(op.reference, case, ref_status)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert_equal(got[name], value, f"{name} [{case.describe}]")
    assert int(status) == 0 and int(ref_status) == 0


def test_every_kernel_is_registered():
    """Each launched ``@triton.jit`` kernel of the package belongs to an op of the registry (so
    the GPU compile and sync checks cover it), or is listed above with the reason."""
    registered = {id(kernel) for op in OPS for kernel in op.kernels}
    # JITFunction, or the interpreter's stand-in under TRITON_INTERPRET=1
    kinds = tuple({type(kernel) for op in OPS for kernel in op.kernels})
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(specmeta.kernels.__name__ + "."):
            for attr, obj in vars(module).items():
                if isinstance(obj, kinds) and attr.endswith("_kernel"):
                    found[attr] = obj
    assert len(found) > len(UNREGISTERED)  # the scan sees the kernels at all
    missing = [a for a, k in found.items() if id(k) not in registered and a not in UNREGISTERED]
    assert not missing, f"kernels no registry op lists: {missing}"
    assert len(registered) == len(found) - len(UNREGISTERED)


@pytest.mark.parametrize("op", ALL_OPS)
def test_gpu_workloads_build(gen, op):
    """The GPU tier's workloads, built on the CPU: every batch size gives the op work."""
    for batch_size in op.compile_batch_sizes:
        cases = op.gpu_workloads("cpu", gen, batch_size)
        assert cases, f"{op.name}: no case at B={batch_size}"
        assert all(t.device.type == "cpu" for case in cases for t in case.outputs.values())


@pytest.mark.gpu
@pytest.mark.parametrize("op", ALL_OPS)
def test_gpu_new_batch_size_compiles_nothing(gen, op):
    """Batch size, lengths and widths are runtime arguments: one set of compiled kernels serves
    every batch size (style §4)."""
    status = new_status("cuda")
    counts = []
    for batch_size in op.compile_batch_sizes:
        for case in op.gpu_workloads("cuda", gen, batch_size):
            op.call(op.launcher, case, case.fresh_outputs(), status)
        torch.cuda.synchronize()
        counts.append(tuple(compiled_variants(kernel) for kernel in op.kernels))
    assert min(counts[0]) >= 1, f"nothing compiled: {counts}"
    assert counts == [counts[0]] * len(counts), f"recompiled for a new batch size: {counts}"
    assert int(status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("op", ALL_OPS)
def test_gpu_no_host_sync(gen, op):
    """Once compiled, a launch reads no device value on the host (style §7)."""
    status = new_status("cuda")
    cases = op.gpu_workloads("cuda", gen, 16)
    outputs = [case.fresh_outputs() for case in cases]

    def launch():
        for case, out in zip(cases, outputs, strict=True):
            op.call(op.launcher, case, out, status)

    launch()  # compiles, and builds the move's pointer table (cached per layout)
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            launch()
    torch.cuda.synchronize()
    assert int(status) == 0
