"""The ``specmeta`` command."""

from __future__ import annotations

import argparse
import random
import sys

import torch


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import CHECKS, run_checks

    device = _device(args.device)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    names = args.only or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(
            f"unknown check(s): {', '.join(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr
        )
        return 2
    print(f"specmeta check on {device} (seed {seed}; reproduce with --seed {seed})")

    def show(res):
        verdict = "ok  " if res.ok else "FAIL"
        line = (f"{verdict} {res.name:<28} cases {res.cases:>5}  mismatches {res.mismatches:>3}  "
                f"status 0x{res.status_bits:x}  {res.seconds:6.2f}s")  # fmt: skip
        print(line + (f"  first: {res.first_failure}" if res.first_failure else ""), flush=True)

    results = run_checks(device, seed, names, on_result=show)
    failed = [r.name for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmeta", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="every kernel against its reference on random workloads")
    check.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    check.add_argument("--seed", type=int, help="seed of the random workloads (default: fresh)")
    check.add_argument("--only", nargs="*", help="run only these checks")
    check.set_defaults(func=_cmd_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
