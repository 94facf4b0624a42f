"""Benchmark results: pytest-benchmark JSON → Markdown tables and PNG plots (``specmeta bench``).

Every row's device figures come from the ``extra_info`` the benchmarks record through
``bench/harness.py``: device µs from CUDA-graph replay, bytes moved, GB/s, the share of the
copy bandwidth and the launch floor measured in the same run. Host µs is pytest-benchmark's own
median of the launcher or builder call.
"""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

__all__ = ["load_rows", "markdown", "plot", "update_results"]

BEGIN = "<!-- specmeta bench: begin -->"
END = "<!-- specmeta bench: end -->"
# Run-wide facts, shown once per group rather than in every row.
_RUN_KEYS = ("gpu", "sms", "torch", "triton", "copy_GB/s", "write_GB/s", "launch_floor_us")


def load_rows(paths: list[pathlib.Path]) -> list[dict]:
    """One dict per benchmark: ``group`` (file::function), ``case``, ``host_us`` and every
    ``extra_info`` field."""
    rows = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        for bench in data.get("benchmarks", []):
            name = bench["name"]
            group = bench.get("fullname", name).split("[")[0]
            case = name.split("[", 1)[1].rstrip("]") if "[" in name else ""
            row = {
                "group": group,
                "case": case,
                "host_us": round(1e6 * bench["stats"]["median"], 1),
            }
            row.update(bench.get("extra_info", {}))
            rows.append(row)
    return rows


def _by_group(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["group"]].append(row)
    return groups


def markdown(rows: list[dict], date: str) -> str:
    """Markdown: one table per benchmark group, headed by device, versions and ceilings."""
    out = []
    for group, items in _by_group(rows).items():
        first = items[0]
        out.append(f"### `{group}`\n")
        out.append(
            f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '?')}, "
            f"{date}. Copy bandwidth {first.get('copy_GB/s', '?')} GB/s (read + write), write "
            f"bandwidth {first.get('write_GB/s', '?')} GB/s, empty-kernel launch floor "
            f"{first.get('launch_floor_us', '?')} µs in a graph; all measured in this run.\n"
        )
        keys = [k for k in items[0] if k not in _RUN_KEYS and k not in ("group",)]
        for item in items[1:]:
            keys += [k for k in item if k not in keys and k not in _RUN_KEYS and k != "group"]
        out.append("| " + " | ".join(keys) + " |")
        out.append("|" + "---|" * len(keys))
        for item in items:
            out.append("| " + " | ".join(str(item.get(k, "")) for k in keys) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Per group with a batch-size axis: device µs vs batch size (one line per topk and page
    size), and % of copy bandwidth where bytes were counted. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, items in _by_group(rows).items():
        items = [r for r in items if "bs" in r and r.get("device_us", 0) > 0]
        if not items:
            continue

        # One column per context length, one line per (topk, page size, mode), one colour per
        # line across every panel.
        def line_key(r: dict) -> tuple:
            return tuple((k, r[k]) for k in ("topk", "page_size", "mode") if k in r)

        palette = plt.get_cmap("tab20").colors
        colour = {key: palette[i % len(palette)]
                  for i, key in enumerate(sorted({line_key(r) for r in items}, key=str))}  # fmt: skip
        columns = sorted({r.get("ctx") for r in items}, key=lambda c: (c is None, c))
        metrics = [("device_us", "device µs (graph replay)")]
        if any("pct_copy_bw" in r for r in items):
            metrics.append(("pct_copy_bw", "% of copy bandwidth"))
        fig, axes = plt.subplots(len(metrics), len(columns), squeeze=False,
                                 figsize=(4.5 * len(columns), 3.6 * len(metrics)))  # fmt: skip
        for col, ctx in enumerate(columns):
            series: dict[tuple, list[dict]] = defaultdict(list)
            for r in items:
                if r.get("ctx") == ctx:
                    series[line_key(r)].append(r)
            for row, (metric, label) in enumerate(metrics):
                ax = axes[row][col]
                for labels, pts in sorted(series.items(), key=lambda kv: str(kv[0])):
                    pts = sorted((p for p in pts if metric in p), key=lambda p: p["bs"])
                    if pts:
                        ax.plot([p["bs"] for p in pts], [p[metric] for p in pts], marker="o",
                                color=colour[labels],
                                label=", ".join(f"{k}={v}" for k, v in labels))  # fmt: skip
                ax.set_xscale("log", base=2)
                if metric == "device_us":
                    ax.set_yscale("log")
                ax.set_xlabel("batch size")
                ax.set_ylabel(label)
                ax.set_title(f"context {ctx}" if ctx is not None else "")
                ax.grid(True, alpha=0.3)
        handles = [plt.Line2D([], [], color=c, marker="o", label=", ".join(f"{k}={v}" for k, v in key))
                   for key, c in colour.items()]  # fmt: skip
        fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7)
        fig.subplots_adjust(bottom=0.2)
        first = items[0]
        fig.suptitle(f"{group} — {first.get('gpu', '')}, triton {first.get('triton', '')}")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        path = out_dir / (group.replace("/", "_").replace("::", "__").replace(".py", "") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def update_results(results_md: pathlib.Path, section: str) -> None:
    """Replace the generated section of ``RESULTS.md`` (between the markers), keeping the
    hand-written text around it."""
    text = results_md.read_text() if results_md.exists() else "# specmeta benchmark results\n"
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    results_md.write_text(text)
