"""The kernel package's structure: what the ops share lives in ``kernels/_common.py``.

Each op module holds one op (kernel, launcher, reference). A module that reaches into another
op module's private names couples two ops through plumbing neither documents; those names
belong in the shared support module instead. Parsed with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

import triton.language as tl

import specmeta.kernels as kernels_pkg
from specmeta.kernels import _common
from specmeta.status import Status

_KERNELS = pathlib.Path(kernels_pkg.__file__).parent
_SHARED = {"_common"}  # modules whose names every op module may import


def _kernel_imports():
    """``(module, imported module, name)`` for every ``from .x import name`` in kernels/."""
    for path in sorted(_KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    source = node.module or ""
                elif node.module and node.module.startswith("specmeta.kernels."):
                    source = node.module.removeprefix("specmeta.kernels.")
                else:
                    continue
                for alias in node.names:
                    yield path.stem, source, alias.name


def test_no_kernel_module_imports_another_ops_private_names():
    offending = [
        f"{module}.py: from .{source} import {name}"
        for module, source, name in _kernel_imports()
        if source not in _SHARED and name.startswith("_")
    ]
    assert not offending, "private names crossing op modules (move them to _common): " + "; ".join(
        offending
    )


def test_status_bits_are_defined_once_and_equal_the_abi():
    for flag in Status:
        if flag is Status.OK:
            continue
        bit = getattr(_common, flag.name)
        assert isinstance(bit, tl.constexpr) and bit.value == int(flag), flag.name
    # No op module defines a status constant of its own.
    for path in sorted(_KERNELS.glob("*.py")):
        if path.stem in _SHARED:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    name = getattr(target, "id", "")
                    assert name.lstrip("_") not in Status.__members__, f"{path.name}: {name}"


def test_shared_helpers_are_defined_once():
    """Grid sizing and the batch check have one definition, in _common."""
    for path in sorted(_KERNELS.glob("*.py")):
        if path.stem in _SHARED:
            continue
        names = {
            node.name
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)
        }
        for shared in ("check_batch", "target_programs", "chunk_programs", "load_request",
                       "draft_slot_position", "gather_rows_ref"):  # fmt: skip
            assert shared not in names and f"_{shared}" not in names, f"{path.name}: {shared}"


def test_tests_import_shared_support_only():
    """Test modules share helpers through tests/_support.py, tests/guard_bands.py and
    tests/testing/lossless_checks.py (the lossless loop's checks, for every model), never by
    importing another test module."""
    tests_root = pathlib.Path(__file__).parent.parent
    allowed = {"tests._support", "tests.guard_bands", "tests.testing.lossless_checks"}
    offending = []
    for path in sorted(tests_root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if (module or "").startswith("tests.") and module not in allowed:
                offending.append(f"{path.relative_to(tests_root)}: from {module}")
    assert not offending, offending
