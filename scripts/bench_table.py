"""Print pytest-benchmark JSON files as one Markdown table (device figures from extra_info)."""

from __future__ import annotations

import json
import sys

SKIP = {"gpu", "sms", "torch", "triton", "copy_GB/s", "write_GB/s", "launch_floor_us"}


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows = data.get("benchmarks", [])
        if not rows:
            continue
        first = rows[0]["extra_info"]
        print(f"\n### {path.split('/')[-1]}: {first.get('gpu')} torch {first.get('torch')} "
              f"triton {first.get('triton')}; copy {first.get('copy_GB/s')} GB/s, "
              f"write {first.get('write_GB/s')} GB/s; "
              f"launch floor {first.get('launch_floor_us')} us")  # fmt: skip
        keys = [k for k in first if k not in SKIP]
        print("| name | host_us | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 2) + "|")
        for r in rows:
            host_us = 1e6 * r["stats"]["median"]
            vals = [str(r["extra_info"].get(k, "")) for k in keys]
            print(
                f"| {r['name'].split('[')[-1].rstrip(']')} | {host_us:.1f} | "
                + " | ".join(vals)
                + " |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
