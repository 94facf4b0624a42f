"""Shared fixtures: the device under test and a fresh, reported seed per test.

Kernel tests run on CUDA where it exists and on CPU under TRITON_INTERPRET=1 elsewhere (that is
CI). ``SPECMETA_TEST_DEVICE=cpu`` forces the CPU tier on a GPU machine. Tests marked ``gpu`` are
skipped with the reason "needs a CUDA GPU" when CUDA is absent.

``import specmeta`` changes nothing in the environment, so this file switches Triton's
interpreter on for the CPU tier, before any test module imports a kernel (Triton reads
``TRITON_INTERPRET`` when a kernel is decorated). A value already set is kept; subprocesses of
the tests inherit it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch


def _device_name() -> str:
    forced = os.environ.get("SPECMETA_TEST_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


if _device_name() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(_device_name())


@pytest.fixture
def seed(request) -> int:
    """A fresh seed each run (``SPECMETA_SEED`` pins it); printed with any failure."""
    value = int(os.environ.get("SPECMETA_SEED", random.SystemRandom().randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"reproduce with SPECMETA_SEED={value}"))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    elif os.environ.get("SPECMETA_TEST_DEVICE", "cuda") != "cuda":
        reason = "a GPU-tier test; SPECMETA_TEST_DEVICE=cpu runs the CPU tier only (unset it)"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
