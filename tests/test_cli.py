"""The `specmeta` command: plan and check."""

from __future__ import annotations

import re

import pytest
import torch

from specmeta import SpecConfig, plan_buffers
from specmeta.cli import BUILDERS, _human, main

PLAN = ["plan", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8", "--page-size", "16",
        "--max-bs", "8", "--max-context-len", "1024"]  # fmt: skip
CFG = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                 max_context_len=1024)  # fmt: skip


def _rows(out: str, prefix: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.split() and ln.split()[0].startswith(prefix)]


# TRT-LLM MLA cannot verify a tree: with topk = 4 its builder serves no target_verify and
# allocates none of its buffers.
_NOT_SERVED = "trtllm_mla.target_verify."


def test_plan_lists_what_each_builder_allocates_with_totals(capsys):
    groups = ["draft", "verify", "runner", "draft_decode", "status"]
    assert main([*PLAN, "--with", *groups]) == 0
    out = capsys.readouterr().out
    plan = plan_buffers(CFG)
    for name, spec in plan.items():
        line = next((ln for ln in out.splitlines() if ln.split()[:1] == [name]), None)
        if name.startswith(_NOT_SERVED):
            assert line is None, f"{name} is not allocated by a topk=4 TRT-LLM MLA builder"
            continue
        assert line is not None, f"{name} missing from the plan output"
        assert str(list(spec.shape)) in line and _human(spec.nbytes) in line
    # The summary, after the last blank line: one row per builder and engine group, a grand total.
    rows = [re.fullmatch(r"(.+?) {2,}(\S+ \S+) +(\S+ \S+)", ln)
            for ln in out.split("\n\n")[-1].splitlines()[1:]]  # fmt: skip
    summary = {m[1]: [*m[2].split(), *m[3].split()] for m in rows}
    grand_dev = grand_host = 0
    for backend, builder in BUILDERS.items():
        names = [n for n in plan if n.startswith(backend + ".") and not n.startswith(_NOT_SERVED)]
        names += ["status"]  # every builder owns one
        dev = sum(plan[n].nbytes for n in names if not n.endswith("_host"))
        host = sum(plan[n].nbytes for n in names if n.endswith("_host"))
        assert f"{backend} total" in out
        assert summary[builder] == [*_human(dev).split(), *_human(host).split()], builder
        grand_dev, grand_host = grand_dev + dev, grand_host + host
    for group in groups:
        dev = sum(spec.nbytes for name, spec in plan.items() if name.split(".")[0] == group)
        assert summary[f"engine: {group}"] == [*_human(dev).split(), "0", "B"], group
        grand_dev += dev
    assert summary["grand total"] == [*_human(grand_dev).split(), *_human(grand_host).split()]


def test_plan_knows_every_group_of_plan_keys():
    """Every plan key is a builder's (``<backend>.``) or in a described engine group."""
    from specmeta.cli import ENGINE_GROUPS

    prefixes = {name.split(".")[0] for name in plan_buffers(CFG)}
    assert prefixes == set(BUILDERS) | set(ENGINE_GROUPS)


def test_plan_totals_are_what_the_builders_allocate():
    """The device bytes per backend equal those of a builder created on the CPU: ``plan`` shows
    what the builder allocates, neither more nor less."""
    import torch

    from specmeta import FA3MetadataBuilder, FlashInferBuilder, TrtllmMlaBuilder

    plan = plan_buffers(CFG)
    for backend, cls in (("fa3", FA3MetadataBuilder), ("flashinfer", FlashInferBuilder),
                         ("trtllm_mla", TrtllmMlaBuilder)):  # fmt: skip
        builder = cls(CFG, "cpu")
        got = [t for key, t in builder.buffers.items() if not key.endswith("_host")]
        assert isinstance(builder.status, torch.Tensor)
        got.append(builder.status)
        names = [n for n in plan if n.startswith(backend + ".") and not n.endswith("_host")
                 and not n.startswith(_NOT_SERVED)]  # fmt: skip
        names += ["status"]
        assert sum(t.nbytes for t in got) == sum(plan[n].nbytes for n in names), backend
        assert len(got) == len(names), backend


def test_plan_for_one_backend_shows_only_its_buffers(capsys):
    assert main([*PLAN, "--backend", "fa3"]) == 0
    out = capsys.readouterr().out
    assert not _rows(out, "flashinfer.") and not _rows(out, "trtllm_mla.")
    assert "shared-prefix" not in out and "FlashInferBuilder  " not in out
    # The engine buffers are listed, not counted: the grand total is the FA3 builder's.
    fa3 = sum(spec.nbytes for name, spec in plan_buffers(CFG).items() if name.startswith("fa3."))
    fa3 += 4  # its status word
    grand = next(ln for ln in out.splitlines() if ln.startswith("grand total"))
    assert grand.split()[2:4] == _human(fa3).split()
    assert "draft_decode.kv_indices" not in out  # the free kernel's list: listed as a group only


def test_plan_with_engine_groups_adds_them_to_the_grand_total(capsys):
    assert main([*PLAN, "--backend", "trtllm_mla", "--with", "draft", "verify"]) == 0
    out = capsys.readouterr().out
    plan = plan_buffers(CFG)
    want = sum(spec.nbytes for name, spec in plan.items()
               if name.split(".")[0] in ("trtllm_mla", "status", "draft", "verify")
               and not name.startswith(_NOT_SERVED))  # fmt: skip
    grand = next(ln for ln in out.splitlines() if ln.startswith("grand total"))
    assert grand.split()[2:4] == _human(want).split()
    assert _rows(out, "draft.out_cache_loc") and _rows(out, "verify.tgt_cache_loc")


def test_plan_columns_fit_the_longest_name(capsys):
    assert main([*PLAN, "--backend", "flashinfer"]) == 0
    rows = _rows(capsys.readouterr().out, "flashinfer.")
    longest = max(len(ln.split()[0]) for ln in rows)
    starts = {ln.index("[") for ln in rows}  # the shape column
    assert len(starts) == 1 and starts.pop() > 2 + longest


def test_check_reports_and_exits_zero(capsys, device):
    assert (
        main(["check", "--device", str(device), "--seed", "3", "--only", "assign_draft_cache_locs"])
        == 0
    )
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("assign_draft_cache_locs "))
    assert row.split()[-1] == "ok" and row.split()[2] == "0", row
    assert "1 passed, 0 failed" in out
    from specmeta.metadata import host_ops

    why = host_ops.unavailable()  # which host path the builders use, said before the checks
    want = "compiled" if why is None else f"torch ({why})"
    assert f"host work on seq_lens_cpu: {want}\n" in out
    from specmeta import tensor_layout

    why = tensor_layout.unavailable()
    want = "native" if why is None else f"Python and torch's guard ({why})"
    assert f"tensor reads (call keys, the runner's captured tensors, seq_lens_cpu): {want}\n" in out


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


@pytest.mark.parametrize("backend,package", [("fa3", "flash-attn-4"),
                                             ("flashinfer", "flashinfer-python")])  # fmt: skip
def test_check_on_a_gpu_without_a_real_kernel_reads_with_torch_and_says_so(monkeypatch, backend,
                                                                           package):  # fmt: skip
    """specmeta check's end-to-end loop on a GPU where a backend's kernel package is not
    installed (the import planted to fail): the torch consumer reads that backend's metadata,
    and the check's line names the missing package instead of the check dying on the import."""
    import sys

    from specmeta.check import loop_attention
    from specmeta.testing.attention import TorchAttention
    from specmeta.testing.tiny_model import TinyConfig

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn...` raises
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    attention, why = loop_attention(backend, True, TinyConfig(), torch.bfloat16,
                                    torch.device("cuda"), 4)  # fmt: skip
    assert isinstance(attention, TorchAttention) and attention.page_size == 4
    assert why is not None and f"pip install {package}" in why, why
    for gpu, name in ((False, backend), (True, "trtllm_mla")):  # the torch consumer by design
        attention, why = loop_attention(name, gpu, TinyConfig(), torch.float64,
                                        torch.device("cpu"), 4)  # fmt: skip
        assert isinstance(attention, TorchAttention) and why is None, (gpu, name)


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


def test_plan_for_the_modes_an_engine_uses(capsys):
    """``--modes`` and ``--verify-mask`` narrow the plan to what a builder constructed with the
    same choice allocates: here FlashInfer's shared-prefix draft decode and a packed verify."""
    import torch

    from specmeta import FlashInferBuilder

    modes = ["draft_decode_shared_prefix", "target_verify"]
    args = [*PLAN, "--backend", "flashinfer", "--modes", *modes, "--verify-mask", "packed"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert not _rows(out, "flashinfer.draft_decode.") and not _rows(out, "flashinfer.draft_extend")
    assert not _rows(out, "flashinfer.draft_decode_paged")
    assert not _rows(out, "flashinfer.target_verify.custom_mask")
    assert _rows(out, "flashinfer.target_verify.packed_custom_mask")
    assert _rows(out, "flashinfer.draft_decode_shared.prefix_kv_indices")
    fi = FlashInferBuilder(CFG, "cpu", modes=modes, verify_mask="packed")
    device = sum(t.nbytes for k, t in fi.buffers.items() if not k.endswith("_host"))
    device += fi.status.nbytes
    grand = next(ln for ln in out.splitlines() if ln.startswith("grand total"))
    assert grand.split()[2:4] == _human(device).split()
    assert isinstance(fi.status, torch.Tensor)
    assert set(fi.modes) == set(modes)
