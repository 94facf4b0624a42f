"""Benchmarks run on CUDA only; everything else skips them with a reason."""

from __future__ import annotations

import pytest
import torch

import specmeta  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: the benchmarks measure one")
    for item in items:
        item.add_marker(skip)
