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
    assert "ok   assign_draft_cache_locs" in out and "1 passed, 0 failed" in out
