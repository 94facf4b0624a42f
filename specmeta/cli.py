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
    print(f"specmeta check on {device} (seed {seed}; reproduce with --seed {seed})", flush=True)
    tty = sys.stdout.isatty()
    width = 30

    def progress(done: int, name: str) -> None:
        filled = width * done // len(names)
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {done:>2}/{len(names)} {name:<28}"
        print("\r" + bar if tty else bar, end="" if tty else "\n", flush=True)

    done = 0

    def on_result(res) -> None:
        nonlocal done
        done += 1
        progress(done, res.name + ("" if res.ok else "  FAIL"))

    progress(0, "")
    results = run_checks(device, seed, names, on_result=on_result)
    if tty:
        print()
    print(f"\n{'check':<28} {'cases':>6} {'mismatches':>10} {'status':>7} {'time':>8}  result")
    for res in results:
        verdict = "ok" if res.ok else "FAIL"
        print(f"{res.name:<28} {res.cases:>6} {res.mismatches:>10} {f'0x{res.status_bits:x}':>7} "
              f"{res.seconds:>7.2f}s  {verdict}" + (f"  ({res.first_failure})" if res.first_failure else ""))  # fmt: skip
    for res in results:
        if res.details:
            print(f"\n{res.name}:")
            for line in res.details:
                print(f"  {line}")
    failed = [r.name for r in results if not r.ok]
    total = sum(r.cases for r in results)
    print(f"\n{total} cases; {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


BACKENDS = ("fa3", "flashinfer", "trtllm_mla")


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"


def _cmd_plan(args: argparse.Namespace) -> int:
    from .config import SpecConfig, plan_buffers

    try:
        cfg = SpecConfig(topk=args.topk, num_steps=args.num_steps, num_draft_tokens=args.num_draft_tokens,
                         page_size=args.page_size, max_bs=args.max_bs, max_context_len=args.max_context_len)  # fmt: skip
    except (TypeError, ValueError) as err:
        print(f"invalid configuration: {err}", file=sys.stderr)
        return 2
    plan = plan_buffers(cfg)
    wanted = set(args.backend or BACKENDS)

    def group(name: str) -> tuple[str, str]:
        parts = name.split(".")
        if parts[0] in BACKENDS:
            return parts[0], parts[1]
        return "common", parts[0]

    print(f"specmeta plan: topk={cfg.topk} num_steps={cfg.num_steps} num_draft_tokens="
          f"{cfg.num_draft_tokens} page_size={cfg.page_size} max_bs={cfg.max_bs} "
          f"max_context_len={cfg.max_context_len} req_to_token_width={cfg.req_to_token_width} "
          f"pool_size={cfg.pool_size} layout={'B' if cfg.layout_b else 'A'}")  # fmt: skip
    totals: dict[tuple[str, str], int] = {}
    print(f"\n{'buffer':<48} {'shape':<26} {'dtype':<8} {'bytes':>12}")
    for name, spec in plan.items():
        backend, mode = group(name)
        if backend != "common" and backend not in wanted:
            continue
        totals[(backend, mode)] = totals.get((backend, mode), 0) + spec.nbytes
        dtype = str(spec.dtype).replace("torch.", "")
        print(f"{name:<48} {str(list(spec.shape)):<26} {dtype:<8} {_human(spec.nbytes):>12}")
    print(f"\n{'backend':<12} {'mode':<24} {'bytes':>12}")
    per_backend: dict[str, int] = {}
    for (backend, mode), nbytes in totals.items():
        per_backend[backend] = per_backend.get(backend, 0) + nbytes
        print(f"{backend:<12} {mode:<24} {_human(nbytes):>12}")
    for backend, nbytes in per_backend.items():
        print(f"{backend:<12} {'(all modes)':<24} {_human(nbytes):>12}")
    per_branch = plan.get("flashinfer.draft_decode.kv_indices")
    shared = [spec for name, spec in plan.items() if name.startswith("flashinfer.draft_decode_shared.")
              and "kv_indices" in name]  # fmt: skip
    if per_branch is not None and shared:
        shared_bytes = sum(spec.nbytes for spec in shared)
        print(f"\ndraft-decode kv_indices: per-branch {_human(per_branch.nbytes)} vs shared-prefix "
              f"{_human(shared_bytes)} ({per_branch.nbytes / max(shared_bytes, 1):.1f}x smaller)")  # fmt: skip
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import datetime
    import pathlib
    import subprocess

    from . import report

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        jsons = [pathlib.Path(p) for p in args.from_json]
    else:
        if not torch.cuda.is_available():
            print("specmeta bench measures a GPU and none is visible here; render earlier results "
                  "with --from-json", file=sys.stderr)  # fmt: skip
            return 2
        bench_dir = pathlib.Path(args.bench_dir)
        if not bench_dir.is_dir():
            print(
                f"no benchmark folder at {bench_dir} (run from a specmeta checkout)",
                file=sys.stderr,
            )
            return 2
        jsons = [out / "bench.json"]
        cmd = [sys.executable, "-m", "pytest", "-q", str(bench_dir), f"--benchmark-json={jsons[0]}",
               "--benchmark-columns=median", "-p", "no:cacheprovider"]  # fmt: skip
        if args.k:
            cmd += ["-k", args.k]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc != 0 or not jsons[0].exists():
            print(f"benchmarks failed (pytest exit {rc})", file=sys.stderr)
            return 1
    rows = report.load_rows(jsons)
    if not rows:
        print("no benchmark results in " + ", ".join(map(str, jsons)), file=sys.stderr)
        return 1
    date = args.date or datetime.date.today().isoformat()
    section = report.markdown(rows, date)
    (out / "bench.md").write_text(section)
    pngs = report.plot(rows, out / "plots")
    print(section)
    print(f"wrote {out / 'bench.md'} and {len(pngs)} plots under {out / 'plots'}")
    if args.results:
        results = pathlib.Path(args.results)
        links = "\n".join(f"![{p.stem}]({p.relative_to(results.parent).as_posix()})" for p in pngs
                          if p.is_relative_to(results.parent))  # fmt: skip
        report.update_results(results, section + ("\n" + links if links else ""))
        print(f"updated {results}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmeta", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="every kernel against its reference on random workloads")
    check.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    check.add_argument("--seed", type=int, help="seed of the random workloads (default: fresh)")
    check.add_argument("--only", nargs="*", help="run only these checks")
    check.set_defaults(func=_cmd_check)
    plan = sub.add_parser("plan", help="every persistent buffer of a configuration, with bytes")
    plan.add_argument("--topk", type=int, required=True)
    plan.add_argument("--num-steps", type=int, required=True)
    plan.add_argument("--num-draft-tokens", type=int, required=True)
    plan.add_argument("--page-size", type=int, default=1)
    plan.add_argument("--max-bs", type=int, required=True)
    plan.add_argument("--max-context-len", type=int, required=True)
    plan.add_argument(
        "--backend", nargs="*", choices=BACKENDS, help="only these backends (default: all)"
    )
    plan.set_defaults(func=_cmd_plan)
    bench = sub.add_parser("bench", help="run the bench/ sweeps on the GPU; JSON, tables, plots")
    bench.add_argument("-k", help="pytest -k expression selecting benchmarks")
    bench.add_argument("--bench-dir", default="bench", help="the benchmark folder (default: bench)")
    bench.add_argument("--out", default="bench/results", help="where JSON, tables and plots go")
    bench.add_argument("--results", help="a RESULTS.md whose generated section is replaced")
    bench.add_argument(
        "--from-json", nargs="*", help="render these pytest-benchmark JSON files; run nothing"
    )
    bench.add_argument("--date", help="date printed with the results (default: today)")
    bench.set_defaults(func=_cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
