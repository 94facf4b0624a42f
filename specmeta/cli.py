"""The ``specmeta`` command: ``check``, ``plan`` and ``bench``.

Every mistake in what the user typed ends in one line on stderr, ``specmeta <command>: ...``,
that names the argument, the value and the fix, and exit status 2 (:class:`UsageError`);
``check`` and ``bench`` exit 1 when what they ran failed, ``plan`` when a builder it plans cannot
be created for the configuration (:func:`specmeta.config.check_fits`).

Importing this module imports neither torch nor Triton (seconds): ``specmeta --help`` and
``specmeta plan`` need neither; ``check`` and ``bench`` import them when they run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
from typing import TYPE_CHECKING

from .metadata.capabilities import BUILDERS, CAPABILITIES, MODES, VERIFY_MASKS
from .plan_report import (
    ENGINE_GROUPS,
    WINDOW_BUILDERS,
    plan_builders,
    print_builder,
    print_engine,
    print_header,
    print_summary,
    table,
)

if TYPE_CHECKING:
    import torch

    from .config import SpecConfig

DESCRIPTION = """\
specmeta builds the attention metadata of speculative decoding (EAGLE, EAGLE3, MTP, topk > 1
tree drafts) for paged KV caches and CUDA graphs. This command checks the kernels on this
machine, sizes the buffers of a configuration, and benchmarks a GPU."""

EPILOG = """\
examples:
  specmeta check                        every kernel against its reference (CPU: Triton's interpreter)
  specmeta check --only fa3_builder     one check
  specmeta plan --topk 8 --num-steps 5 --num-draft-tokens 64 --page-size 16 \\
      --max-bs 256 --max-context-len 32768 --backend fa3
  specmeta plan --topk 1 --num-steps 3 --num-draft-tokens 4 --max-bs 64 \\
      --max-context-len 131072 --sliding-window-size 4096
                                        a hybrid model: window builders, totals per id space
  specmeta bench --from-json bench/results/bench.json --out /tmp/bench

'specmeta COMMAND --help' describes each command's options."""


class UsageError(Exception):
    """A mistake in the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the message and where help is), not the usage."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see '{self.prog} --help'\n")


def _int_at_least(minimum: int):
    """An argparse ``type``: the text as an int ``>= minimum``, or an error naming both."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _bucket(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``T:BP``, a ragged verify's bucket of ``T ≥ 0`` tokens over
    ``BP ≥ 1`` requests."""
    tokens, _, requests = text.partition(":")
    try:
        pair = (int(tokens), int(requests))
    except ValueError:
        pair = None
    if pair is None or pair[0] < 0 or pair[1] < 1:
        raise argparse.ArgumentTypeError(
            f"must be T:BP, T >= 0 tokens over BP >= 1 requests (e.g. 256:32), got {text!r}"
        )
    return pair


# ----------------------------------------------------------------------------------------------
# specmeta check


def _compiled_kernels() -> bool:
    """Whether a Triton kernel of specmeta was decorated for the GPU in this process (with the
    interpreter off): such a kernel cannot run on CPU tensors, whatever TRITON_INTERPRET says
    now. Under the interpreter Triton makes an ``InterpretedFunction``, else a ``JITFunction``."""
    if "triton" not in sys.modules:
        return False  # nothing decorated yet
    from triton.runtime.jit import JITFunction

    return any(
        isinstance(value, JITFunction)
        for name, module in list(sys.modules.items())
        if (name == "specmeta" or name.startswith("specmeta.")) and module is not None
        for value in list(vars(module).values())
    )


def _device(name: str | None) -> torch.device:
    """The device the checks run on, or a :class:`UsageError` saying why it cannot be used.

    On the CPU the kernels run under Triton's interpreter, which Triton reads when a kernel is
    decorated: with ``TRITON_INTERPRET`` unset, this sets it to 1 for this process, before the
    kernels are imported (a value the user set is kept, and refused if it is not 1; kernels
    already decorated for the GPU, in a process that imported them first, are refused too)."""
    import torch

    if not name:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UsageError(f"--device {name}: not a device name; pass cpu or cuda") from None
    label = f"--device {name}" if name else f"--device (default: {device})"
    if device.type == "cpu":
        interpret = os.environ.get("TRITON_INTERPRET")
        if interpret is None and not _compiled_kernels():
            os.environ["TRITON_INTERPRET"] = "1"  # this process only, before the kernels
        elif interpret != "1":
            state = (
                f"set to {interpret!r}"
                if interpret is not None
                else "unset while specmeta's kernels are already compiled for the GPU in this "
                "process (Triton reads it when a kernel is decorated)"
            )
            raise UsageError(
                f"{label}: the kernels run on CPU tensors only under Triton's interpreter, and "
                f"TRITON_INTERPRET is {state}; run TRITON_INTERPRET=1 specmeta check --device cpu"
            )
        return device
    if device.type != "cuda":
        raise UsageError(f"{label}: specmeta checks on cpu or cuda only; pass one of them")
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise UsageError(f"{label}: {why}; leave --device out or pass --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(
            f"{label}: {count} CUDA device(s) visible, numbered from 0; pass --device "
            f"cuda:{count - 1} or lower"
        )
    return device


def _cmd_check(args: argparse.Namespace) -> int:
    device = _device(args.device)  # first: on the CPU it switches the interpreter on
    from .check import CHECKS, run_checks

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    names = args.only or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UsageError(
            f"--only {' '.join(unknown)}: no such check; pick from {', '.join(CHECKS)}"
        )
    print(f"specmeta check on {device} (seed {seed}; reproduce with --seed {seed})", flush=True)
    from .metadata import host_ops

    # The builders' host work on seq_lens_cpu (design §3) is compiled only where warmup() built
    # it, as an engine calls it at start-up; the checks run what an engine would.
    host_ops.warmup(device)
    why = host_ops.unavailable()
    print("host work on seq_lens_cpu: " + ("compiled" if why is None else f"torch ({why})"))
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


# ----------------------------------------------------------------------------------------------
# specmeta plan

# What each builder serves and which plan keys it allocates come from the data the builders
# themselves read (specmeta.metadata.capabilities), which imports neither torch nor Triton; how
# the plan is printed is specmeta.plan_report's.
BACKENDS = tuple(BUILDERS)


def _unserved(backend: str, missing: list[str], cfg: SpecConfig) -> UsageError:
    """The error for ``--modes`` naming modes that ``--backend backend`` does not serve."""
    served = CAPABILITIES[backend].served(cfg)
    modes = CAPABILITIES[backend].modes
    them = "it" if len(missing) == 1 else "them"
    why = []
    for mode in missing:
        if (
            mode in modes
            and cfg.draft_window_size
            and mode.startswith("draft_decode")
            and (mode not in CAPABILITIES[backend].draft_window)
        ):
            why.append(f"{mode} does not build a draft window (--draft-window-size) yet")
        elif mode in modes:  # a mode of the builder, but not for a tree
            what = "verify" if mode == "target_verify" else "draft"
            why.append(f"{mode} with --topk {cfg.topk} needs a tree, which it cannot {what}")
    others = [b for b in BACKENDS
              if b != backend and all(CAPABILITIES[b].serves(m, cfg) for m in missing)]  # fmt: skip
    alternative = (
        f", or pass --backend {' '.join(others)}, which serve{'s' if len(others) == 1 else ''} {them}"
        if others else ""
    )  # fmt: skip
    return UsageError(
        f"--modes {' '.join(missing)}: --backend {backend} ({BUILDERS[backend]}) does not "
        f"serve {' or '.join(missing)}{' (' + '; '.join(why) + ')' if why else ''}; it serves "
        f"{', '.join(served)} for this config; drop {them} from --modes{alternative}"
    )


def _no_window(backend: str, cfg: SpecConfig,
               wanted: tuple[str, ...]) -> tuple[tuple[str, ...], str] | None:  # fmt: skip
    """Why ``backend`` builds no window layers for ``cfg`` (design §2.10), or none for some
    modes ``--modes`` names (``wanted``): ``(those modes, why)``, no modes when it has no
    window builder; ``None`` when it builds them. A named mode needs a window form
    (:meth:`~specmeta.plan_report.WindowBuilder.form`): the mode itself, or for a draft form
    the window builder's ``draft_decode``."""
    window = WINDOW_BUILDERS.get(backend)
    if window is None:
        return (), "it has no window-layer builder"
    forms = {mode: window.form(mode, cfg) for mode in wanted}
    unbuilt = {mode: why for mode, (form, why) in forms.items() if form is None}
    if not unbuilt:
        return None
    return tuple(unbuilt), (f"its {window.builder} builds no form of {' or '.join(unbuilt)} "
                            f"({'; '.join(unbuilt.values())})")  # fmt: skip


def _scope(modes: tuple[str, ...]) -> str:
    """What a backend builds no window layers for: the config, or the ``--modes`` entries."""
    return f"--modes {' '.join(modes)}" if modes else "this config"


def _unwindowed(backend: str, modes: tuple[str, ...], why: str, cfg: SpecConfig,
                wanted: tuple[str, ...]) -> UsageError:  # fmt: skip
    """The error for ``--sliding-window-size`` with a ``--backend`` that builds no window layers
    (for the config, or for the ``modes`` of ``--modes``)."""
    others = [b for b in BACKENDS if b != backend and _no_window(b, cfg, wanted) is None
              and all(CAPABILITIES[b].serves(m, cfg) for m in wanted)]  # fmt: skip
    alternative = (f", or pass --backend {' '.join(others)}, which "
                   f"build{'s' if len(others) == 1 else ''} them" if others else "")  # fmt: skip
    drop = f"{' '.join(modes)} from --modes or " if modes else ""
    return UsageError(
        f"--sliding-window-size {cfg.sliding_window_size}: --backend {backend} "
        f"({BUILDERS[backend]}) builds no window layers for {_scope(modes)}, design §2.10: "
        f"{why}; drop {drop}--sliding-window-size{alternative}"
    )


def _select(args: argparse.Namespace, cfg: SpecConfig) -> tuple[list[str], list[str]]:
    """The backends to plan and a line for each one left out: a backend named with --backend
    that does not serve every --modes entry, or builds no window layers for the config or for
    an entry of --modes, is an error; one of the default backends is left out (unless it is the
    last)."""
    backends = [b for b in BACKENDS if b in (args.backend or BACKENDS)]
    wanted = tuple(dict.fromkeys(args.modes or ()))
    skipped = []
    for backend in list(backends):
        missing = [m for m in wanted if not CAPABILITIES[backend].serves(m, cfg)]
        if missing and args.backend is None and len(backends) > 1:
            backends.remove(backend)  # not named: plan the backends that serve them all
            skipped.append(f"{backend}: not planned, {BUILDERS[backend]} does not serve "
                           f"{' or '.join(missing)} for this config (it serves "
                           f"{', '.join(CAPABILITIES[backend].served(cfg))})")  # fmt: skip
        elif missing:
            raise _unserved(backend, missing, cfg)
    for backend in list(backends) if cfg.sliding_window_size else ():
        no_window = _no_window(backend, cfg, wanted)
        if no_window and args.backend is None and len(backends) > 1:
            backends.remove(backend)  # a hybrid model needs both builders of its backend
            skipped.append(f"{backend}: not planned, {BUILDERS[backend]} builds no window layers "
                           f"for {_scope(no_window[0])} (--sliding-window-size "
                           f"{cfg.sliding_window_size}): {no_window[1]}")  # fmt: skip
        elif no_window:
            raise _unwindowed(backend, *no_window, cfg, wanted)
    return backends, skipped


def _cmd_plan(args: argparse.Namespace) -> int:
    # Config arithmetic only: plan_sizes is plan_buffers with dtype names, without torch.
    from .config import SpecConfig, max_num_draft_tokens, plan_sizes

    k, s, n = args.topk, args.num_steps, args.num_draft_tokens
    if n > max_num_draft_tokens(k, s):
        top = max_num_draft_tokens(k, s)
        raise UsageError(
            f"--num-draft-tokens {n} is too large for --topk {k} --num-steps {s}: a draft tree "
            f"has at most 1 + K + (S-1)·K² = {top} nodes; pass at most {top}"
        )
    try:
        cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=args.page_size,
                         max_bs=args.max_bs, max_context_len=args.max_context_len,
                         draft_window_size=args.draft_window_size,
                         draft_sink_size=args.draft_sink_size,
                         sliding_window_size=args.sliding_window_size)  # fmt: skip
    except (TypeError, ValueError) as err:
        raise UsageError(f"invalid configuration: {err}") from None
    backends, skipped = _select(args, cfg)
    plan = plan_sizes(cfg)
    wanted = tuple(dict.fromkeys(args.modes or ()))
    builders, notes = plan_builders(cfg, plan, backends, wanted, args.verify_mask)
    engine = [g for g in ENGINE_GROUPS if g in (args.with_ or ())]
    print_header(cfg)
    for line in skipped + notes:
        print(f"\n{line}")
    totals, unbuildable = [], []
    for planned in builders:
        dev, host, ok = print_builder(planned, plan)
        totals.append((planned, dev, host))
        if not ok:
            unbuildable.append(planned.builder)
    engine_bytes = print_engine(plan, engine, window=bool(cfg.sliding_window_size))
    print_summary(totals, engine_bytes)
    misfits = _print_buckets(cfg, args.verify_buckets or (),
                             [p.builder for p in builders if p.space == "window"])  # fmt: skip
    if unbuildable:
        print(f"\n{', '.join(unbuildable)}: cannot be created for this config (see above); exit "
              "status 1")  # fmt: skip
    if misfits:
        print(f"\nverify buckets {', '.join(misfits)}: do not fit this plan (see above); exit "
              "status 1")  # fmt: skip
    return 1 if unbuildable or misfits else 0


def _print_buckets(cfg, buckets, window: list[str]) -> list[str]:
    """The ragged verify's buckets (design §2.9) against the plan: a bucket of ``T`` tokens over
    ``Bp`` requests fits when ``Bp ≤ max_bs`` and ``T ≤ Bp·N`` (every list, mask and expand
    row a ragged build writes then lies within what the plan sizes for the uniform verify).
    The window builders (``window``) build a ragged verify too, their ragged buffers planned
    for the same ``max_bs`` requests and ``max_bs·N`` tokens (design §2.10), so the same
    buckets fit them. Returns the buckets that do not fit."""
    if not buckets:
        return []
    n, misfits = cfg.num_draft_tokens, []
    print("\nragged verify buckets (T tokens over Bp requests, design §2.9): the builders' "
          "buffers serve every\nbucket with Bp <= max_bs and T <= Bp·N")  # fmt: skip
    if window:
        print(f"  (the window builders' too: {', '.join(window)}, sized for the same buckets, "
              "design §2.10)")  # fmt: skip
    rows = [("bucket", "fits", "why")]
    for T, bp in buckets:
        why = []
        if bp > cfg.max_bs:
            why.append(f"Bp > max_bs = {cfg.max_bs}")
        if T > bp * n:
            why.append(f"T > Bp·N = {bp * n}")
        rows.append((f"{T}:{bp}", "no" if why else "yes",
                     "; ".join(why) or f"T <= Bp·N = {bp * n}, Bp <= max_bs"))  # fmt: skip
        if why:
            misfits.append(f"{T}:{bp}")
    for line in table(rows, right=set()):
        print(line)
    return misfits


# ----------------------------------------------------------------------------------------------
# specmeta bench


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{what} needs {module}, which is not installed; "
                         "pip install \"specmeta[bench]\"")  # fmt: skip


# Where a benchmark run writes its JSON, tables and plots when --out is not given. Rendering
# earlier JSON (--from-json) has no default: it writes only where --out and --results say.
RUN_OUT = "bench/results"


def _json_date(path) -> str | None:
    """The day pytest-benchmark recorded in ``path`` (its ``datetime``, UTC), ``YYYY-MM-DD``,
    or ``None`` if the JSON has no such field."""
    import datetime
    import json

    try:
        stamp = json.loads(path.read_text()).get("datetime")
        # The day only: an ISO timestamp starts with it, whatever its time zone's spelling.
        return datetime.date.fromisoformat(str(stamp)[:10]).isoformat()
    except (AttributeError, ValueError):  # not a dict, no field, not a timestamp
        return None


def _cmd_bench(args: argparse.Namespace) -> int:
    import datetime
    import pathlib
    import subprocess

    # Everything the command line asks for is checked before anything is created or run.
    date = None
    if args.date is not None:
        try:
            date = datetime.date.fromisoformat(args.date).isoformat()
        except ValueError:
            raise UsageError(f"--date {args.date}: not a date; pass YYYY-MM-DD, e.g. --date "
                             "2026-11-26") from None  # fmt: skip
    if args.results and not pathlib.Path(args.results).parent.is_dir():
        raise UsageError(f"--results {args.results}: its folder does not exist; pass a path in an "
                         "existing folder")  # fmt: skip
    if args.from_json:
        out = pathlib.Path(args.out) if args.out else None  # only where the user says
        jsons = [pathlib.Path(p) for p in args.from_json]
        for path in jsons:
            if not path.is_file():
                raise UsageError(f"--from-json {path}: no such file; pass the JSON that "
                                 "pytest --benchmark-json wrote")  # fmt: skip
        if out is not None:
            _require("matplotlib", "--from-json (its plots)")
    else:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("no CUDA device is visible and the benchmarks measure a GPU; run it on "
                             "a GPU machine, or render earlier results with --from-json FILE")  # fmt: skip
        bench_dir = pathlib.Path(args.bench_dir)
        if not bench_dir.is_dir():
            raise UsageError(f"--bench-dir {bench_dir}: no such folder; run from a specmeta "
                             "checkout or pass --bench-dir PATH")  # fmt: skip
        _require("pytest_benchmark", "running the benchmarks")
        _require("matplotlib", "running the benchmarks (their plots)")
        out = pathlib.Path(args.out or RUN_OUT)
        out.mkdir(parents=True, exist_ok=True)
        jsons = [out / "bench.json"]
        cmd = [sys.executable, "-m", "pytest", "-q", str(bench_dir), f"--benchmark-json={jsons[0]}",
               "--benchmark-columns=median", "-p", "no:cacheprovider"]  # fmt: skip
        if args.k:
            cmd += ["-k", args.k]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc != 0 or not jsons[0].exists():
            print(f"specmeta bench: benchmarks failed (pytest exit {rc})", file=sys.stderr)
            return 1

    from . import report

    label = "--from-json " if args.from_json else ""
    rows = []
    for path in jsons:
        try:
            rows += report.load_rows([path])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UsageError(f"{label}{path}: not pytest-benchmark JSON ({type(err).__name__}); "
                             "pass the file pytest --benchmark-json wrote") from None  # fmt: skip
    if not rows:
        raise UsageError("no benchmark results in " + ", ".join(map(str, jsons)))
    if date is None:  # the results' own day, not today's
        days = set()
        for path in jsons:
            day = _json_date(path)
            if day is None:
                raise UsageError(f"{label}{path}: records no date (no 'datetime' field, which "
                                 "pytest-benchmark writes); pass --date YYYY-MM-DD")  # fmt: skip
            days.add(day)
        date = ", ".join(sorted(days))
    section = report.markdown(rows, date)
    pngs: list[pathlib.Path] = []
    print(section)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(section)
        pngs = report.plot(rows, out / "plots")
        print(f"wrote {out / 'bench.md'} and {len(pngs)} plots under {out / 'plots'}")
    if args.results:
        results = pathlib.Path(args.results)
        links = "\n".join(f"![{p.stem}]({p.relative_to(results.parent).as_posix()})" for p in pngs
                          if p.is_relative_to(results.parent))  # fmt: skip
        report.update_results(results, section + ("\n" + links if links else ""))
        print(f"updated {results}" + ("" if out else " (no plots: --out DIR renders them)"))
    if out is None and not args.results:
        print("wrote nothing: pass --out DIR for the tables and plots, --results FILE to update "
              "a RESULTS.md")  # fmt: skip
    return 0


# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specmeta", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    from . import __version__

    parser.add_argument("--version", action="version", version=f"specmeta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser(
        "check", help="every kernel against its pure-torch reference, on random workloads",
        description="Run every kernel (or those of --only) against its pure-torch reference on "
        "random workloads and print one line per check; exit status 1 if any failed.",
    )  # fmt: skip
    check.add_argument("--device", metavar="DEVICE",
                       help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")  # fmt: skip
    check.add_argument("--seed", type=int, help="seed of the random workloads (default: a fresh "
                       "one, printed so that a run can be repeated)")  # fmt: skip
    check.add_argument("--only", nargs="+", metavar="CHECK",
                       help="run only these checks (default: all)")  # fmt: skip
    check.set_defaults(func=_cmd_check)

    plan = sub.add_parser(
        "plan", help="the buffers each builder allocates for a configuration, with totals",
        description="Size a configuration: every buffer each backend's builder allocates when it "
        "is created (all of its modes), per-mode and per-backend totals, the buffers an engine "
        "allocates itself, and a grand total (with --sliding-window-size, the window layers' "
        "builders too, and a total per id space). Sizes come from specmeta.plan_buffers(cfg). A "
        "mode that a named --backend does not serve is an error; exit status 1 when a builder's "
        "buffers pass what their int32 offsets can address (it cannot be created).",
    )  # fmt: skip
    plan.add_argument("--topk", type=_positive_int, required=True, metavar="K",
                      help="K, branches per request during draft decode (1: a chain, as MTP); required")  # fmt: skip
    plan.add_argument(
        "--num-steps",
        type=_positive_int,
        required=True,
        metavar="S",
        help="S, draft steps; required",
    )
    plan.add_argument("--num-draft-tokens", type=_positive_int, required=True, metavar="N",
                      help="N, verify-window width: the draft tree's nodes, root included; "
                      "N - 1 <= K + (S-1)·K² (with K = 1 usually N = S + 1); required")  # fmt: skip
    plan.add_argument(
        "--page-size",
        type=_positive_int,
        default=1,
        metavar="PS",
        help="tokens per KV page (default: %(default)s)",
    )
    plan.add_argument(
        "--max-bs",
        type=_positive_int,
        required=True,
        metavar="B",
        help="largest batch (the largest CUDA-graph bucket); required",
    )
    plan.add_argument("--max-context-len", type=_positive_int, required=True, metavar="L",
                      help="longest committed prefix of a request; draft and verify slots come "
                      "on top; required")  # fmt: skip
    plan.add_argument("--draft-window-size", type=_non_negative_int, default=0, metavar="W",
                      help="a bounded draft attention: each draft list keeps its first "
                      "--draft-sink-size prefix tokens and its most recent ones, W + sink in "
                      "all, and is sized for that (default: 0, no window)")  # fmt: skip
    plan.add_argument("--draft-sink-size", type=_non_negative_int, default=0, metavar="SK",
                      help="sink tokens of --draft-window-size (default: %(default)s)")  # fmt: skip
    plan.add_argument("--sliding-window-size", type=_non_negative_int, default=0, metavar="w",
                      help="a hybrid model's window layers: each query at position p reads "
                      "(p - w, p] from a second KV pool; each --backend's window builder "
                      "(FA3's, FlashInfer's) is planned beside its full layers' one for the "
                      "window form of each mode, and the window pool's metadata totalled apart; "
                      "a backend that builds no window layers (for a mode --modes names) is left "
                      "out, or an error if named (default: 0, none)")  # fmt: skip
    plan.add_argument("--verify-buckets", nargs="+", type=_bucket, metavar="T:BP",
                      help="a ragged verify's captured buckets, T tokens over BP requests "
                      "(design §2.9): each is checked against the plan (BP <= --max-bs, "
                      "T <= BP·N); exit status 1 when one does not fit")  # fmt: skip
    plan.add_argument(
        "--backend",
        nargs="+",
        choices=BACKENDS,
        metavar="BACKEND",
        help=f"only these backends, of {', '.join(BACKENDS)} (default: all)",
    )
    plan.add_argument("--modes", nargs="+", choices=MODES, metavar="MODE",
                      help="the builder modes the engine uses (default: every mode each backend "
                      "serves for the config); every named --backend must serve each of them; "
                      "without --backend, the backends that do not are left out; choices: "
                      f"{', '.join(MODES)}")  # fmt: skip
    plan.add_argument("--verify-mask", choices=VERIFY_MASKS, default="both",
                      help="FlashInfer's target-verify mask forms to allocate, each N·ΣL + B·N² "
                      "bytes at full capacity; packed is what FlashInfer 0.7's plan() reads "
                      "without a sync")  # fmt: skip
    plan.add_argument("--with", dest="with_", nargs="+", choices=tuple(ENGINE_GROUPS),
                      metavar="GROUP", help="add these engine buffer groups, of "
                      f"{', '.join(ENGINE_GROUPS)}, to the grand total (default: none)")  # fmt: skip
    plan.set_defaults(func=_cmd_plan)

    bench = sub.add_parser(
        "bench", help="run the bench/ sweeps on a GPU, or render earlier results",
        description="Run the benchmark sweeps of a specmeta checkout on the GPU and write their "
        "JSON, Markdown tables and plots; with --from-json, render earlier JSON and run nothing.",
    )  # fmt: skip
    bench.add_argument("-k", metavar="EXPR", help="pytest -k expression selecting benchmarks")
    bench.add_argument(
        "--bench-dir",
        default="bench",
        metavar="DIR",
        help="the benchmark folder (default: %(default)s)",
    )
    bench.add_argument("--out", metavar="DIR",
                       help="where the JSON, the tables (bench.md) and the plots go (default: "
                       f"{RUN_OUT} for a run; with --from-json, none: only the tables are "
                       "printed)")  # fmt: skip
    bench.add_argument(
        "--results", metavar="FILE", help="a RESULTS.md whose generated section is replaced"
    )
    bench.add_argument("--from-json", nargs="+", metavar="FILE",
                       help="render these pytest-benchmark JSON files; run nothing, and write "
                       "only where --out and --results say")  # fmt: skip
    bench.add_argument(
        "--date",
        metavar="YYYY-MM-DD",
        help="date printed with the results (default: the day the JSON records)",
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"specmeta {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
