"""The mutation list of ``scripts/mutations.py`` stays applicable (issue 17).

The mutations themselves take minutes (``python3 scripts/mutations.py``); this only checks the
list, so that a refactor that moves a planted line makes the list fail here rather than go
stale: enough CPU mutations, unique ids, every ``old`` snippet exactly once in its file of the
current tree, and every layer covered.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "specmeta_mutations", ROOT / "scripts" / "mutations.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


mutations = _load()
MUTATIONS = mutations.MUTATIONS


def test_enough_cpu_mutations_with_unique_ids():
    assert sum(not m.gpu for m in MUTATIONS) >= 30
    ids = [m.id for m in MUTATIONS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_every_snippet_occurs_once_in_the_current_tree(m):
    assert m.old != m.new
    assert mutations.stale(m, ROOT) is None
    assert m.tests and all(isinstance(t, str) for t in m.tests)
    files = [t.split("::")[0] for t in m.tests if t.split("::")[0].endswith(".py")]
    assert files, f"{m.id}: no test file in {m.tests}"
    assert all((ROOT / f).is_file() for f in files), f"{m.id}: no such test file in {files}"


def test_every_layer_has_a_mutation():
    assert set(mutations.LAYERS) >= {m.layer for m in MUTATIONS}
    missing = set(mutations.LAYERS) - {m.layer for m in MUTATIONS}
    assert not missing, f"layers without a mutation: {sorted(missing)}"
    # The lossless loop (of the hybrid and MLA models too) catches at least the four end-to-end
    # bugs of the issue.
    e2e = [m for m in MUTATIONS if m.layer == "e2e"]
    loops = {mutations.LOSSLESS, mutations.HYBRID, mutations.MLA}
    assert len(e2e) >= 4 and all(loops & set(m.tests) for m in e2e)
    assert any(m.also for m in MUTATIONS if m.layer == "shared")
    assert any(m.gpu for m in MUTATIONS)
