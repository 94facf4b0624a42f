"""Compare the sm_90 PTX of every kernel between a git revision and the work tree, on a CPU.

A refactor that should not change what runs on the device (splitting a kernel into device
functions, renaming, moving helpers) can be checked without a GPU: compile each kernel of the
compile check (``tests/kernels/test_fa3_compile.py``, both integer widths) at ``REV`` and in the
work tree, and compare the instructions, opcode and operand shape, count for count. Register
names, labels, debug lines and instruction order are ignored: ``ptxas`` schedules anyway.

    python3 scripts/ptx_compare.py [REV]        # default REV: HEAD

Prints ``same`` or the differing instruction counts per (kernel, configuration); exits 1 when
any kernel differs. A difference is not a bug, but it needs a GPU measurement before landing.

``REV`` compiles its own list of kernels. When both lists have the same length, entry ``i`` of
one is compared with entry ``i`` of the other, so a renamed or merged kernel that keeps its
place in the list is still compared (printed ``now <key>`` under the key at ``REV``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILE_TEST = "tests/kernels/test_fa3_compile.py"


def _instructions(ptx: str) -> collections.Counter:
    """Instructions with registers, labels and kernel parameters named generically."""
    ops = collections.Counter()
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()  # a label's comment names an LLVM block
        if not line or line.endswith(":") or line.startswith((".", "{", "}", "(", ")", "//")):
            continue
        line = re.sub(r"%\w+?\d+", "R", line)
        line = re.sub(r"\$L__\w+", "L", line)
        line = re.sub(r"\[\w+_param_\d+\]", "[param]", line)  # the kernel's name, argument order
        ops[line] += 1
    return ops


def _ptx(package_root: Path, kernels: list) -> dict[str, str]:
    from tests.kernels.test_fa3_compile import COMPILE_SCRIPT

    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(kernels), str(package_root)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _keys(kernels: list) -> list[list[str]]:
    """The compile script's output keys of each entry, in list order."""
    return [[f"{module}.{name} {json.dumps(consts, sort_keys=True)} {scalar}"
             for scalar in ("i32", "i64")] for module, name, consts, _ in kernels]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.kernels.test_fa3_compile import KERNELS

    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "specmeta",
                                  COMPILE_TEST], capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        kernels_then = runpy.run_path(str(Path(tmp) / COMPILE_TEST))["KERNELS"]
        before = _ptx(Path(tmp), kernels_then)
    after = _ptx(ROOT, KERNELS)
    if len(kernels_then) == len(KERNELS):
        pairs = [pair for then, now in zip(_keys(kernels_then), _keys(KERNELS), strict=True)
                 for pair in zip(then, now, strict=True)]  # fmt: skip
    else:
        pairs = [(key, key) for key in sorted(set(before) | set(after))]
    differ = 0
    for key, key_now in pairs:
        a, b = _instructions(before.get(key, "")), _instructions(after.get(key_now, ""))
        now = f"\n         now {key_now}" if key_now != key else ""
        if "MISSING" in (before.get(key), after.get(key_now)):
            print(f"new      {key_now}" if before.get(key) == "MISSING" else f"gone     {key}")
        elif a == b:
            print(f"same     {key}{now}")
        else:
            differ += 1
            print(f"DIFFERS  {key}: {sum((a - b).values())} only at {args.rev}, "
                  f"{sum((b - a).values())} only in the work tree{now}")  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
