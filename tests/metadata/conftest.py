"""Fixtures of the builder tests: the compiled host ops, built the way an engine builds them."""

from __future__ import annotations

import pytest

from specmeta.metadata import host_ops


@pytest.fixture
def compiled_host_ops():
    """The compiled host ops module, after :func:`specmeta.warmup` (the builders never build
    it themselves). Where it does not build, a test of the compiled path fails here, naming
    why: gcc and Python's headers are part of every image these tests run on, as they are of
    every machine Triton launches on."""
    done = host_ops.warmup()
    op = host_ops.compiled()
    assert op is not None, f"the compiled host ops did not build: {done}"
    return op
