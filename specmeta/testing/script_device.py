"""The ``--device`` of an example script, read before specmeta's kernels (and so Triton) are
imported: the caller, not ``import specmeta``, chooses Triton's interpreter."""

from __future__ import annotations

import argparse
import os
import sys

import torch

__all__ = ["parse_device"]


def parse_device(script: str, argv: list[str] | None = None) -> torch.device:
    """``--device`` of the command line of ``script`` (its file name, for the messages).

    The default is ``cuda`` where torch sees a GPU, else ``cpu``. On the CPU the kernels run in
    Triton's interpreter, which must be on before Triton is first imported: this sets
    ``TRITON_INTERPRET=1`` unless the environment already says. A device the kernels cannot
    run on here ends the script with one line naming the problem and the fix.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    name = parser.parse_known_args(argv)[0].device
    script = os.path.basename(script)
    try:
        device = torch.device(name)
    except RuntimeError:
        sys.exit(f"{script}: --device {name} is not a torch device; pass --device cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script}: --device {name}, but this torch ({torch.__version__}) sees no CUDA "
                 "GPU; run with --device cpu (Triton's interpreter) or on a machine with one")  # fmt: skip
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        value = os.environ["TRITON_INTERPRET"]
        if value in ("", "0"):
            sys.exit(f"{script}: --device cpu runs the kernels in Triton's interpreter, which "
                     f"TRITON_INTERPRET={value!r} turns off; unset it or set it to 1")  # fmt: skip
        from ..launch import interpreter_problem  # imports Triton: the interpreter is on now

        if (problem := interpreter_problem()) is not None:
            sys.exit(f"{script}: --device cpu: {problem}")
    return device
