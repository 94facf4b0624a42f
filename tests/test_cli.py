"""The `specmeta` command: plan and check."""

from __future__ import annotations

import re

from specmeta import SpecConfig, plan_buffers
from specmeta.cli import main


def test_plan_lists_every_buffer_with_its_bytes(capsys):
    args = ["plan", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8", "--page-size", "16",
            "--max-bs", "8", "--max-context-len", "1024"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    plan = plan_buffers(SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                                   max_context_len=1024))  # fmt: skip
    for name, spec in plan.items():
        line = next((ln for ln in out.splitlines() if ln.startswith(name + " ")), None)
        assert line is not None, f"{name} missing from the plan output"
        assert str(list(spec.shape)) in line
    assert "(all modes)" in out


def test_plan_rejects_an_invalid_config(capsys):
    args = ["plan", "--topk", "2", "--num-steps", "2", "--num-draft-tokens", "9", "--max-bs", "1",
            "--max-context-len", "10"]  # fmt: skip
    assert main(args) == 2
    assert re.search(r"num_draft_tokens=9 is too large", capsys.readouterr().err)


def test_check_reports_and_exits_zero(capsys, device):
    assert (
        main(["check", "--device", str(device), "--seed", "3", "--only", "assign_draft_cache_locs"])
        == 0
    )
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("assign_draft_cache_locs "))
    assert row.split()[-1] == "ok" and row.split()[2] == "0", row
    assert "1 passed, 0 failed" in out


def test_check_fails_on_a_mismatch(capsys, monkeypatch, device):
    import torch

    from specmeta import check

    def broken(dev, gen):
        res = check.CheckResult("broken")
        res.compare("x", torch.zeros(3), torch.ones(3), "planted mismatch")
        return res

    monkeypatch.setitem(check.CHECKS, "broken", broken)
    # A reference on another device than the kernel's output is compared, not an error.
    res = check.CheckResult("devices")
    res.compare("x", torch.ones(2, device=device), torch.ones(2), "cross-device")
    assert res.ok and res.cases == 1
    assert main(["check", "--device", str(device), "--only", "broken"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "planted mismatch" in out and "0 passed, 1 failed" in out


def test_bench_renders_json_into_tables_plots_and_results(tmp_path, capsys):
    import json

    extra = {"gpu": "TestGPU", "torch": "t", "triton": "x", "copy_GB/s": 1000.0, "write_GB/s": 1500.0,
             "launch_floor_us": 1.5, "device_us": 2.0, "bs": 8, "topk": 4, "page_size": 16,
             "ctx": 1024, "pct_copy_bw": 50.0}  # fmt: skip
    rows = [dict(extra, bs=bs, device_us=float(bs)) for bs in (1, 8, 64)]
    data = {"benchmarks": [{"name": f"bench_x[{r['bs']}]", "fullname": "bench/bench_x.py::bench_x[1]",
                            "stats": {"median": 2e-5}, "extra_info": r} for r in rows]}  # fmt: skip
    src = tmp_path / "in.json"
    src.write_text(json.dumps(data))
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nhand-written intro\n")
    out = tmp_path / "out"
    assert main(["bench", "--from-json", str(src), "--out", str(out), "--results", str(results),
                 "--date", "2026-01-02"]) == 0  # fmt: skip
    table = (out / "bench.md").read_text()
    assert "TestGPU" in table and "2026-01-02" in table and "1000.0 GB/s" in table
    assert table.count("| 20.0 |") == 3, "host µs of every row"
    assert list((out / "plots").glob("*.png"))
    text = results.read_text()
    assert "hand-written intro" in text and "TestGPU" in text
    # A second render replaces the generated section instead of appending another.
    assert (
        main(["bench", "--from-json", str(src), "--out", str(out), "--results", str(results)]) == 0
    )
    assert results.read_text().count("TestGPU, torch") == 1
