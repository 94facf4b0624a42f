"""Tensor layouts (address, dtype, device, shape, strides) recorded and compared in one native
call: the check a graph runner makes before every replay (design §4).

``validate.pinned`` compares the tensors a graph captured with what they were at capture. In
Python that is an address call per tensor and torch's tensor guard: some 400 ns on a fast host
for three tensors, and 1.3–1.5 µs on the GPU machines' hosts, the largest host cost of a
replay. ``tensor_layout.cpp`` reads each tensor through torch's own C++ object instead.

It is built on first use against the installed torch's headers and libraries (a C++ compiler
is needed; torch's extension helpers name the paths and flags), cached by a hash of its source,
the torch and Python versions, and loaded in this process. :func:`module` returns it, or
``None`` where it cannot be built or does not pass its known answers, or when
``SPECMETA_NATIVE=0``; then the callers keep their Python checks (:func:`unavailable` says why).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile

import torch

from .native import OptionalModule

__all__ = ["module", "unavailable"]

_SOURCE = pathlib.Path(__file__).with_name("tensor_layout.cpp")
_NAME = "specmeta_tensor_layout"


def module():
    """The built module (``record``, ``same``, ``lengths_view``), or ``None`` (then
    :func:`unavailable` says why). Built, loaded and tried once per process."""
    return _MODULE.get()


def unavailable() -> str | None:
    """Why :func:`module` is ``None`` (``None`` when it is not)."""
    return _MODULE.why()


def _built_and_checked():
    found = _load(_build())
    why = _known_answers(found)
    if why is not None:
        raise RuntimeError(why)
    return found


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("SPECMETA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specmeta"
    )
    return pathlib.Path(root)


def _command(src: pathlib.Path, out: pathlib.Path, std: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", f"-std={std}", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in includes], str(src), "-o", str(out),
        *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
        "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
    ]  # fmt: skip


def _build() -> pathlib.Path:
    """The shared object for this source, torch and Python, built unless cached."""
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(
        source + torch.__version__.encode() + sys.version.encode() + sys.executable.encode()
    ).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    folder = _cache_dir() / tag
    target = folder / f"{_NAME}{suffix}"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = pathlib.Path(tmp) / target.name
        for std in ("c++17", "c++20"):  # torch's headers need C++17; newer ones may want 20
            run = subprocess.run(_command(_SOURCE, built, std), capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"building {_SOURCE.name} failed: {run.stderr.strip()}")
        os.replace(built, target)  # atomic: a process beside this one loads a whole file
    return target


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(_NAME, path)
    found = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(found)
    return found


def _known_answers(found) -> str | None:
    """``None`` when the module tells apart what the runner's check must tell apart (a tensor
    and an equal one elsewhere, another shape, stride order, dtype, rank or number of
    tensors); else what it got wrong."""
    x = torch.zeros(2, 3, dtype=torch.int32)
    layouts = found.record(x, x[0])
    cases = {
        "the same tensors": (True, (x, x[0])),
        "a view object of the same layout": (True, (x[:], x[0])),
        "another address": (False, (x.clone(), x[0])),
        "another shape": (False, (x[:1], x[0])),
        "another stride order": (False, (x.t(), x[0])),
        "another dtype": (False, (x.view(torch.float32), x[0])),
        "another rank": (False, (x, x[:1])),
        "one tensor fewer": (False, (x,)),
        "not a tensor": (False, (x, 3)),
    }
    for what, (want, args) in cases.items():
        if found.same(layouts, *args) is not want:
            return f"known answers: {what} gave {not want}"
    return None


_MODULE = OptionalModule("SPECMETA_NATIVE", _built_and_checked)
