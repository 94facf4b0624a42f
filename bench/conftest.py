"""Benchmarks run on CUDA only; everything else skips them with a reason."""

from __future__ import annotations

import pathlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: the benchmarks measure one")
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(item.path).parents:  # a run of bench/ and tests/ keeps the tests
            item.add_marker(skip)
