"""The `specmeta` command: plan and check."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from specmeta import SpecConfig, plan_buffers
from specmeta.cli import BUILDERS, main
from specmeta.plan_report import human as _human

PLAN = ["plan", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8", "--page-size", "16",
        "--max-bs", "8", "--max-context-len", "1024"]  # fmt: skip
CFG = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                 max_context_len=1024)  # fmt: skip


def _rows(out: str, prefix: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.split() and ln.split()[0].startswith(prefix)]


# Keys no builder allocates for topk = 4: none (TRT-LLM MLA verifies a tree as a cascade,
# design §3.4).
_NOT_SERVED: tuple[str, ...] = ()


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
        names += ["status", "host_lengths_host", "host_lengths_seen"]  # every builder owns them
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
    """Every plan key is a builder's (``<backend>.``, a window builder's ``<backend>_swa.``) or
    in a described engine group."""
    import dataclasses

    from specmeta.cli import ENGINE_GROUPS, WINDOW_BUILDERS

    prefixes = {name.split(".")[0] for name in plan_buffers(CFG)}
    assert prefixes == set(BUILDERS) | set(ENGINE_GROUPS)
    chain = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, max_context_len=64,
                       sliding_window_size=16)  # fmt: skip
    windows = {window.key for window in WINDOW_BUILDERS.values()}  # chains and trees alike
    assert windows == {"fa3_swa", "flashinfer_swa"}
    for cfg in (chain, dataclasses.replace(CFG, sliding_window_size=16)):
        prefixes = {name.split(".")[0] for name in plan_buffers(cfg)}
        assert prefixes == set(BUILDERS) | set(ENGINE_GROUPS) | windows, cfg.topk


def test_plan_totals_are_what_the_builders_allocate(device):
    """The device bytes per backend equal those of a builder created on the device under test:
    ``plan`` shows what the builder allocates, neither more nor less."""
    import torch

    from specmeta import (
        FA3MetadataBuilder,
        FlashInferBuilder,
        FlashInferMLABuilder,
        TrtllmMlaBuilder,
    )

    plan = plan_buffers(CFG)
    for backend, cls in (("fa3", FA3MetadataBuilder), ("flashinfer", FlashInferBuilder),
                         ("trtllm_mla", TrtllmMlaBuilder),
                         ("flashinfer_mla", FlashInferMLABuilder)):  # fmt: skip
        builder = cls(CFG, device)
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
    fa3 += 4 + 6 * 8  # its status word and host_lengths_seen (int64 [5 modes + ragged])
    grand = next(ln for ln in out.splitlines() if ln.startswith("grand total"))
    assert grand.split()[2:4] == _human(fa3).split()
    assert "draft_decode.kv_indices" not in out  # the free kernel's list: listed as a group only


def test_plan_with_engine_groups_adds_them_to_the_grand_total(capsys):
    assert main([*PLAN, "--backend", "trtllm_mla", "--with", "draft", "verify"]) == 0
    out = capsys.readouterr().out
    plan = plan_buffers(CFG)
    want = sum(spec.nbytes for name, spec in plan.items()
               if name.split(".")[0] in ("trtllm_mla", "status", "host_lengths_seen", "draft",
                                         "verify")
               and not name.startswith(_NOT_SERVED)
               and not name.endswith("_host"))  # the device column: host mirrors apart  # fmt: skip
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
    assert not (why or "").startswith("not built in this process"), (
        "check warms the host ops up before the checks, as an engine does"
    )


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
                                             ("flashinfer", "flashinfer-python"),
                                             ("flashinfer_mla", "flashinfer-python")])  # fmt: skip
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
                            "stats": {"median": 2e-5}, "extra_info": r} for r in rows],
            "datetime": "2026-11-21T08:12:17.235419+00:00"}  # fmt: skip
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
    assert "![bench_bench_x__bench_x](out/plots/bench_bench_x__bench_x.png)" in text, (
        "plots under its folder are linked"
    )
    # A second render replaces the generated section instead of appending another, and without
    # --date the results keep the day their JSON records, not today's.
    assert (
        main(["bench", "--from-json", str(src), "--out", str(out), "--results", str(results)]) == 0
    )
    text = results.read_text()
    assert text.count("TestGPU, torch") == 1
    assert "TestGPU, torch t, triton x, 2026-11-21. Copy bandwidth" in text
    assert "2026-01-02" not in text
    assert "TestGPU, torch t, triton x, 2026-11-21. Copy" in (out / "bench.md").read_text()


def _bench_json(path, day: str | None = "2026-11-21T23:59:59+00:00"):
    import json

    bench = {"name": "bench_y[1]", "fullname": "bench/bench_y.py::bench_y[1]",
             "stats": {"median": 1e-6}, "extra_info": {"gpu": "G", "bs": 1, "device_us": 1.0}}  # fmt: skip
    data = {"benchmarks": [bench]}
    if day is not None:
        data["datetime"] = day
    path.write_text(json.dumps(data))
    return path


def test_bench_from_json_writes_nothing_unless_told_where(tmp_path, monkeypatch, capsys):
    """Rendering earlier JSON prints the tables and writes no file: not bench/results (tracked
    files), not anywhere, until --out or --results names a place."""
    folder = tmp_path / "checkout"
    (folder / "bench" / "results").mkdir(parents=True)
    src = _bench_json(folder / "bench" / "results" / "bench.json")
    monkeypatch.chdir(folder)
    assert main(["bench", "--from-json", "bench/results/bench.json"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == [
        "bench", "bench/results", "bench/results/bench.json"]  # fmt: skip
    assert "### `bench/bench_y.py::bench_y`\n\nG, torch ?, triton ?, 2026-11-21. Copy" in out
    assert out.endswith("\nwrote nothing: pass --out DIR for the tables and plots, --results FILE "
                        "to update a RESULTS.md\n")  # fmt: skip
    # --results alone: that file only, and no plots to link.
    results = folder / "RESULTS.md"
    assert main(["bench", "--from-json", str(src), "--results", str(results)]) == 0
    assert capsys.readouterr().out.endswith(
        f"\nupdated {results} (no plots: --out DIR renders them)\n"
    )
    assert "G, torch ?, triton ?, 2026-11-21." in results.read_text()
    assert "![" not in results.read_text()
    assert sorted(p.name for p in folder.rglob("*")) == ["RESULTS.md", "bench", "bench.json",
                                                          "results"]  # fmt: skip


def test_bench_from_json_of_several_days_names_each(tmp_path, capsys):
    a = _bench_json(tmp_path / "a.json", "2026-11-26T21:50:10.582045+00:00")
    b = _bench_json(tmp_path / "b.json", "2026-11-21T08:12:17+00:00")
    c = _bench_json(tmp_path / "c.json", "2026-11-26T01:00:00+00:00")
    assert main(["bench", "--from-json", str(a), str(b), str(c)]) == 0
    assert "G, torch ?, triton ?, 2026-11-21, 2026-11-26. Copy" in capsys.readouterr().out


def test_plan_for_the_modes_an_engine_uses(capsys, device):
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
    fi = FlashInferBuilder(CFG, device, modes=modes, verify_mask="packed")
    device = sum(t.nbytes for k, t in fi.buffers.items() if not k.endswith("_host"))
    device += fi.status.nbytes + fi.host_lengths_seen.nbytes
    grand = next(ln for ln in out.splitlines() if ln.startswith("grand total"))
    assert grand.split()[2:4] == _human(device).split()
    assert isinstance(fi.status, torch.Tensor)
    assert set(fi.modes) == set(modes)


def test_plan_leaves_out_a_default_backend_that_does_not_serve_the_modes(capsys, monkeypatch):
    """Without --backend, a backend that cannot serve every --modes entry is named and left
    out (TRT-LLM MLA made unable to verify a topk = 4 tree, as it was before its cascade:
    planted here); the others are planned."""
    import dataclasses

    from specmeta import cli

    chains = dataclasses.replace(cli.CAPABILITIES["trtllm_mla"], tree_verify=False)
    monkeypatch.setitem(cli.CAPABILITIES, "trtllm_mla", chains)
    assert main([*PLAN, "--modes", "target_verify"]) == 0
    out = capsys.readouterr().out
    assert ("\ntrtllm_mla: not planned, TrtllmMlaBuilder does not serve target_verify for this "
            "config (it serves draft_decode, draft_extend)\n") in out  # fmt: skip
    assert not _rows(out, "trtllm_mla.")
    assert "FA3MetadataBuilder(cfg, device, modes=['target_verify'])" in out
    assert "FlashInferBuilder(cfg, device, modes=['target_verify'], verify_mask='both')" in out


@pytest.mark.parametrize("topk,ps", [(1, 1), (1, 16), (4, 1), (4, 16)])
def test_plan_keys_are_the_builders_own(topk, ps):
    """``specmeta plan`` reads what each builder serves, its plan groups and FlashInfer's mask
    fields from the data the builders read (:mod:`specmeta.metadata.capabilities`, which
    imports no torch). What a builder could still say otherwise is its own narrowing of the
    keys (``allocates``, FlashInfer's ``plan_keys``), its prefix and its class name: the keys
    ``plan`` lists must be those each builder allocates, for every choice of modes and mask."""
    from itertools import combinations

    from specmeta import (
        FA3MetadataBuilder,
        FlashInferBuilder,
        FlashInferMLABuilder,
        TrtllmMlaBuilder,
    )
    from specmeta.config import plan_sizes
    from specmeta.metadata import capabilities

    cfg = SpecConfig(topk=topk, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=3,
                     max_context_len=40)  # fmt: skip
    keys = list(plan_sizes(cfg))
    classes = {"fa3": FA3MetadataBuilder, "flashinfer": FlashInferBuilder,
               "trtllm_mla": TrtllmMlaBuilder,
               "flashinfer_mla": FlashInferMLABuilder}  # fmt: skip
    assert {b: cls.__name__ for b, cls in classes.items()} == capabilities.BUILDERS == BUILDERS
    for backend, cls in classes.items():
        assert cls.plan_prefix == backend + "."
        assert cls.capabilities is capabilities.CAPABILITIES[backend]
        served = cls.check_modes(cfg, None)
        masks = capabilities.VERIFY_MASKS if backend == "flashinfer" else [None]
        for count in range(1, len(served) + 1):
            for modes in combinations(served, count):
                for mask in masks:
                    extra = {} if mask is None else {"verify_mask": mask}
                    want = cls.plan_keys(cfg, modes, **extra)
                    got = capabilities.plan_keys(backend, keys, modes, **extra)
                    assert got == want, (backend, modes, mask)


# ----------------------------------------------------------------------------------------------
# What the command and the package import: neither `specmeta --help`, `specmeta plan` nor
# `import specmeta` imports torch or Triton (seconds), and `import specmeta` changes nothing.
# Each runs in a fresh interpreter, where nothing was imported before.
# ----------------------------------------------------------------------------------------------
_HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))"


def _fresh(code: str, env: dict | None = None) -> tuple[int, str, str]:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    return run.returncode, run.stdout, run.stderr


def test_python_dash_m_runs_the_command():
    """``python -m specmeta`` is the ``specmeta`` command (no script on ``PATH`` needed): its
    help names the subcommands, and a bad subcommand exits 2 as the script's does."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "specmeta", "--help"], capture_output=True,
                        text=True, timeout=300)  # fmt: skip
    assert ok.returncode == 0 and all(c in ok.stdout for c in ("check", "plan", "bench")), ok
    bad = subprocess.run([sys.executable, "-m", "specmeta", "frobnicate"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "frobnicate" in bad.stderr, bad


def test_help_imports_no_torch():
    code = ("import sys\nfrom specmeta.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "for command in ('plan', 'check', 'bench'):\n"
            "    try:\n        main([command, '--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0\n"
            f"print({_HEAVY}, file=sys.stderr)\n")  # fmt: skip
    code_, out, err = _fresh(code)
    assert (code_, err) == (0, "[]\n")
    assert out.startswith("usage: specmeta [-h] [--version] COMMAND ...\n")


def test_plan_imports_no_torch():
    args = [*PLAN[1:], "--with", "draft", "verify", "runner", "draft_decode", "status",
            "--sliding-window-size", "64"]  # fmt: skip
    code = ("import sys\nfrom specmeta.cli import main\n"
            f"assert main(['plan', *{args!r}]) == 0\n"
            f"print({_HEAVY}, file=sys.stderr)\n")  # fmt: skip
    code_, out, err = _fresh(code)
    assert (code_, err) == (0, "[]\n")
    assert "\ngrand total" in out


def test_import_specmeta_changes_nothing_and_imports_no_torch():
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, sys\nbefore = dict(os.environ)\nimport specmeta\n"
            "cfg = specmeta.SpecConfig(topk=2, num_steps=2, num_draft_tokens=4)\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
            "print(specmeta.__version__, 'TRITON_INTERPRET' in os.environ)\n"
            f"print({_HEAVY})\n"
            "specmeta.plan_buffers(cfg)  # torch dtypes: now torch is imported\n"
            "print('torch' in sys.modules, 'triton' in sys.modules)\n")  # fmt: skip
    assert _fresh(code, env) == (0, "0.1.0 False\n[]\nTrue False\n", "")


def test_version_reads_statically():
    """setup.cfg reads ``attr: specmeta.__version__`` without importing the package."""
    code = ("import sys\nfrom setuptools.config.expand import read_attr\n"
            "print(read_attr('specmeta.__version__', root_dir='.'), 'specmeta' in sys.modules)\n")  # fmt: skip
    assert _fresh(code) == (0, "0.1.0 False\n", "")


def test_public_names_are_the_lazy_table():
    import specmeta

    assert specmeta.__all__ == list(specmeta._SOURCES)
    assert set(specmeta.__all__) <= set(dir(specmeta))
    with pytest.raises(AttributeError) as info:
        specmeta.plan_bufers  # noqa: B018
    assert str(info.value) == "module 'specmeta' has no attribute 'plan_bufers'"
    assert not hasattr(specmeta, "_private") and not hasattr(specmeta, "tensor_layout")


def test_submodules_are_attributes_after_import_specmeta_alone():
    """``import specmeta`` then ``specmeta.config.<name>`` works as when the package imported
    its submodules eagerly; the submodule is imported on that first use."""
    code = ("import sys\nimport specmeta\n"
            "assert 'specmeta.workloads' not in sys.modules\n"
            "print(specmeta.config.ROW_ALIGN, specmeta.config is sys.modules['specmeta.config'])\n"
            f"print({_HEAVY})\n")  # fmt: skip
    assert _fresh(code) == (0, "16 True\n[]\n", "")


@pytest.mark.parametrize("name", __import__("specmeta").__all__)
def test_every_public_name_resolves(name):
    import importlib

    import specmeta

    value = getattr(specmeta, name)
    source = importlib.import_module(specmeta._SOURCES[name], "specmeta")
    assert value is (source if name == "probes" else getattr(source, name))
    assert specmeta.__dict__[name] is value, "kept after the first lookup"


def test_check_on_cpu_switches_the_interpreter_on_itself():
    """``specmeta check --device cpu`` with TRITON_INTERPRET unset sets it for its own process
    before the kernels are imported (``import specmeta`` no longer does)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, sys\nfrom specmeta.cli import main\n"
            "rc = main(['check', '--device', 'cpu', '--seed', '5', '--only', "
            "'assign_draft_cache_locs'])\n"
            "print('exit', rc, os.environ['TRITON_INTERPRET'])\n")  # fmt: skip
    code_, out, err = _fresh(code, env)
    assert code_ == 0, err
    assert out.endswith(" cases; 1 passed, 0 failed\nexit 0 1\n"), out


def test_plan_says_which_builder_cannot_be_created_and_exits_1(capsys):
    """A ten-million-token context for 256 requests: FlashInfer's and FlashInfer MLA's
    kv_indices rows pass what their int32 kv_indptr can address on any device; FA3 and TRT-LLM
    MLA hold dense tables only.
    The plan is still printed, with the reason under the builder's totals."""
    huge = ["plan", "--topk", "8", "--num-steps", "5", "--num-draft-tokens", "64", "--page-size",
            "16", "--max-bs", "256", "--max-context-len", "10000000"]  # fmt: skip
    assert main(huge) == 1
    out = capsys.readouterr().out
    cannot = [ln for ln in out.splitlines() if "cannot be created" in ln]
    assert cannot == [
        "  cannot be created: FlashInferBuilder: flashinfer.draft_decode.kv_indices of shape "
        "[5, 20480010240] has rows of 20,480,010,240 elements, more than the 2,147,483,647 "
        "(2**31 - 1) its int32 kv_indptr can address; it alone is 409,600,204,800 bytes "
        "(381.5 GiB) of 793,603,093,628 bytes (739.1 GiB) planned; 5 other buffers have such "
        "rows; shrink SpecConfig's max_bs or max_context_len, or allocate fewer buffers (a "
        "builder's modes=, allocate_buffers' names=)",
        "  cannot be created: FlashInferMLABuilder: flashinfer_mla.draft_extend.kv_indices of "
        "shape [2560016384] has rows of 2,560,016,384 elements, more than the 2,147,483,647 "
        "(2**31 - 1) its int32 kv_indptr can address; it alone is 10,240,065,536 bytes (9.5 GiB) "
        "of 30,725,144,172 bytes (28.6 GiB) planned; 2 other buffers have such rows; shrink "
        "SpecConfig's max_bs or max_context_len, or allocate fewer buffers (a builder's modes=, "
        "allocate_buffers' names=)",
        "FlashInferBuilder, FlashInferMLABuilder: cannot be created for this config (see above); "
        "exit status 1",
    ]
    assert main([*huge, "--backend", "fa3", "trtllm_mla"]) == 0
    assert "cannot be created" not in capsys.readouterr().out


def test_plan_of_a_draft_window_sizes_the_lists_for_it_and_names_who_builds_it(capsys, device):
    """--draft-window-size 100 --draft-sink-size 4: FlashInfer's per-branch lists are sized for
    104 prefix tokens a branch, as the builder made for that config allocates them; a backend
    whose draft decode builds no window is refused for --modes draft_decode, naming why."""
    from specmeta import FlashInferBuilder

    window = ["--draft-window-size", "100", "--draft-sink-size", "4"]
    args = [*PLAN, *window, "--backend", "flashinfer", "--modes", "draft_decode"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "max_context_len=1024 draft window 100 + sink 4\n" in out
    (row,) = _rows(out, "flashinfer.draft_decode.kv_indices")
    assert row.split()[1:3] == ["[3,", f"{4 * 8 * 104 + 8 * 4 * 3}]"]
    cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                     max_context_len=1024, draft_window_size=100, draft_sink_size=4)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, modes=["draft_decode"])
    assert tuple(fi.buffers["draft_decode.kv_indices"].shape) == (3, 4 * 8 * 104 + 8 * 4 * 3)
    assert main([*PLAN, *window, "--backend", "fa3", "--modes", "draft_decode"]) == 2
    err = capsys.readouterr().err
    assert ("--backend fa3 (FA3MetadataBuilder) does not serve draft_decode (draft_decode does "
            "not build a draft window (--draft-window-size) yet)") in err  # fmt: skip
    assert "or pass --backend flashinfer, which serves it" in err


def test_plan_checks_a_ragged_verify_bucket_set(capsys):
    """``--verify-buckets T:BP``: a bucket fits the plan when BP <= max_bs and T <= BP·N (N = 8
    here); one that does not is named with its reason and the exit status is 1."""
    assert main([*PLAN, "--backend", "fa3", "--verify-buckets", "64:8", "0:1", "17:2"]) == 1
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if re.match(r"  \d+:\d+ ", ln)}
    assert rows == {"64:8": "yes", "0:1": "yes", "17:2": "no"}, out
    assert "17:2    no    T > Bp·N = 16" in out
    assert "verify buckets 17:2: do not fit this plan" in out
    assert main([*PLAN, "--backend", "fa3", "--verify-buckets", "8:9"]) == 1
    assert "Bp > max_bs = 8" in capsys.readouterr().out
    assert main([*PLAN, "--backend", "fa3", "--verify-buckets", "64:8", "16:2"]) == 0
    with pytest.raises(SystemExit):
        main([*PLAN, "--verify-buckets", "64"])
    assert "must be T:BP" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Window layers (--sliding-window-size, design §2.10): each backend's window builder beside its
# full layers' one, and the totals of each id space.
# ----------------------------------------------------------------------------------------------
CHAIN = ["plan", "--topk", "1", "--num-steps", "3", "--num-draft-tokens", "4", "--page-size", "16",
         "--max-bs", "8", "--max-context-len", "1024", "--sliding-window-size", "100"]  # fmt: skip
CHAIN_CFG = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=16, max_bs=8,
                       max_context_len=1024, sliding_window_size=100)  # fmt: skip


def _summary(out: str) -> dict[str, list[str]]:
    """The closing table (after the last blank line): row label -> device and host bytes."""
    rows = [re.fullmatch(r"(.+?) {2,}(\S+ \S+) +(\S+ \S+)", ln)
            for ln in out.split("\n\n")[-1].splitlines()[1:]]  # fmt: skip
    return {m[1]: [*m[2].split(), *m[3].split()] for m in rows}


def test_plan_of_window_layers_totals_each_id_space(capsys):
    """A chain with w = 100: FA3's and FlashInfer's window builders are planned beside their
    full layers' builders, every window buffer listed with its shape; the full pool's metadata
    (the full builders and the engine groups of --with) and the window pool's (the window
    builders, their own status words included) are totalled apart, and add up to the grand
    total. TRT-LLM MLA and FlashInfer MLA build no window layers: left out, and said so."""
    assert main([*CHAIN, "--with", "draft", "verify"]) == 0
    out = capsys.readouterr().out
    assert "max_context_len=1024 sliding window 100\n" in out
    assert (
        "one window builder per id space beside each full layers' builder, not one per layer" in out
    )
    for backend in ("trtllm_mla", "flashinfer_mla"):
        assert (f"\n{backend}: not planned, {BUILDERS[backend]} builds no window layers for this "
                "config (--sliding-window-size 100): it has no window-layer builder\n") in out  # fmt: skip
        assert not _rows(out, backend + ".")
    plan = plan_buffers(CHAIN_CFG)
    for name, spec in plan.items():
        if name.startswith(("fa3_swa.", "flashinfer_swa.")):
            (row,) = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
            assert str(list(spec.shape)) in row and _human(spec.nbytes) in row
    own = ["status", "host_lengths_host", "host_lengths_seen"]
    spaces = {"full": [0, 0], "window": [0, 0]}
    summary = _summary(out)
    for key, builder, space in (("fa3", "FA3MetadataBuilder", "full"),
                                ("fa3_swa", "FA3WindowBuilder", "window"),
                                ("flashinfer", "FlashInferBuilder", "full"),
                                ("flashinfer_swa", "FlashInferWindowBuilder", "window")):  # fmt: skip
        names = [n for n in plan if n.split(".")[0] == key] + own
        dev = sum(plan[n].nbytes for n in names if not n.endswith("_host"))
        host = sum(plan[n].nbytes for n in names if n.endswith("_host"))
        assert summary[builder] == [*_human(dev).split(), *_human(host).split()], builder
        spaces[space][0] += dev
        spaces[space][1] += host
    spaces["full"][0] += sum(
        s.nbytes for n, s in plan.items() if n.split(".")[0] in ("draft", "verify")
    )
    assert summary["full-pool metadata"] == [*_human(spaces["full"][0]).split(),
                                             *_human(spaces["full"][1]).split()]  # fmt: skip
    assert summary["window-pool metadata"] == [*_human(spaces["window"][0]).split(),
                                               *_human(spaces["window"][1]).split()]  # fmt: skip
    grand = [sum(v[i] for v in spaces.values()) for i in (0, 1)]
    assert summary["grand total"] == [*_human(grand[0]).split(), *_human(grand[1]).split()]
    assert ("fa3_swa: FA3MetadataBuilder(cfg, device, sliding_window_size=100, modes=["
            "'draft_decode', 'target_verify', 'draft_extend']) (FA3WindowBuilder: window-pool "
            "ids) allocates these") in out  # fmt: skip


def test_plan_without_window_layers_totals_no_id_space(capsys):
    assert main([*CHAIN[:-2], "--backend", "fa3"]) == 0
    out = capsys.readouterr().out
    assert "window" not in out and not _rows(out, "fa3_swa.")
    assert set(_summary(out)) == {"FA3MetadataBuilder", "grand total"}


def test_plan_window_builders_follow_the_backend_selection(capsys):
    """--backend names the full layers' builders; each brings its own window builder, no
    other. A tree (topk = 4) has both window builders too (FA3's serves trees as a cascade
    split at a page boundary, design §2.10): a default plan leaves out only the backends with
    no window builder."""
    assert main([*CHAIN, "--backend", "fa3"]) == 0
    out = capsys.readouterr().out
    assert _rows(out, "fa3.") and _rows(out, "fa3_swa.")
    assert not _rows(out, "flashinfer") and "FlashInferWindowBuilder" not in out
    assert main([*CHAIN, "--backend", "flashinfer"]) == 0
    out = capsys.readouterr().out
    assert _rows(out, "flashinfer.") and _rows(out, "flashinfer_swa.")
    assert not _rows(out, "fa3.") and "FA3WindowBuilder" not in out
    assert main([*PLAN, "--sliding-window-size", "100"]) == 0
    out = capsys.readouterr().out
    assert "fa3: not planned" not in out and "serves chains only" not in out
    assert "trtllm_mla: not planned" in out and "flashinfer_mla: not planned" in out
    assert not _rows(out, "trtllm_mla.") and not _rows(out, "flashinfer_mla.")
    tree = dataclasses.replace(CFG, sliding_window_size=100)
    for name, spec in plan_buffers(tree).items():
        if name.startswith(("fa3_swa.", "flashinfer_swa.")):  # the tree's cascade keys too
            (row,) = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
            assert str(list(spec.shape)) in row, name
    assert set(_summary(out)) == {"FA3MetadataBuilder", "FA3WindowBuilder", "FlashInferBuilder",
                                  "FlashInferWindowBuilder", "full-pool metadata",
                                  "window-pool metadata", "grand total"}  # fmt: skip


def _device_bytes(builder) -> int:
    """A builder's device bytes: its buffers but the host mirrors, its status word, its host
    lengths' device words."""
    own = [t for k, t in builder.buffers.items() if not k.endswith("_host")]
    return sum(t.nbytes for t in own) + builder.status.nbytes + builder.host_lengths_seen.nbytes


@pytest.mark.parametrize("form", ["draft_decode_shared_prefix", "draft_decode_paged"])
def test_plan_window_totals_are_what_the_window_builders_allocate(capsys, device, form):
    """--modes and --verify-mask choose the window builder's modes as an engine would make it:
    each step's own mode, the full layers' draft form included (w = 100 > S = 3: the window
    builder builds the shared-prefix cascade and the paged form too), the same mask form; the
    window pool's total is the device bytes the window builders made with those choices
    allocate. FA3's window builder of a tree (topk = 4) is totalled as it allocates too."""
    from specmeta import FA3MetadataBuilder, FlashInferBuilder

    modes = [form, "target_verify"]
    assert main([*CHAIN, "--backend", "flashinfer", "--modes", *modes, "--verify-mask",
                 "packed"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert (f"FlashInferBuilder(cfg, device, sliding_window_size=100, modes=['{form}', "
            "'target_verify'], verify_mask='packed')") in out  # fmt: skip
    assert "for the window layers" not in out  # no other form: no note
    assert not _rows(out, "flashinfer_swa.target_verify.custom_mask")
    assert not _rows(out, "flashinfer_swa.draft_extend.")
    assert not _rows(out, "flashinfer_swa.draft_decode.")
    fi = FlashInferBuilder(CHAIN_CFG, device, sliding_window_size=100, verify_mask="packed",
                           modes=modes)  # fmt: skip
    assert type(fi).__name__ == "FlashInferWindowBuilder"
    assert _summary(out)["window-pool metadata"][:2] == _human(_device_bytes(fi)).split()
    if form != "draft_decode_paged":
        return
    tree = [*PLAN, "--sliding-window-size", "100", "--backend", "fa3"]
    assert main(tree) == 0
    fa = FA3MetadataBuilder(dataclasses.replace(CFG, sliding_window_size=100), device,
                            sliding_window_size=100)  # fmt: skip
    assert type(fa).__name__ == "FA3WindowBuilder"
    assert _summary(capsys.readouterr().out)["window-pool metadata"][:2] == (
        _human(_device_bytes(fa)).split()
    )


def test_plan_window_layers_of_a_shared_prefix_no_wider_than_the_steps(capsys, device):
    """w = 3 <= S = 3: FlashInfer's window builder does not build the shared-prefix cascade (a
    step would keep no prefix position, design §2.10), so the full layers' shared-prefix draft
    decode is the window layers' draft_decode (per-branch lists serve any window), with a line
    saying why; the window pool's total is that builder's."""
    from specmeta import FlashInferBuilder

    narrow = [*CHAIN[:-1], "3", "--backend", "flashinfer"]
    assert main([*narrow, "--modes", "draft_decode_shared_prefix", "draft_extend"]) == 0
    out = capsys.readouterr().out
    assert ("\nflashinfer_swa: the full layers' draft_decode_shared_prefix is draft_decode for "
            "the window layers (FlashInferWindowBuilder's draft_decode serves any window): "
            "draft_decode_shared_prefix needs a window wider than the draft steps "
            "(sliding_window_size=3 <= num_steps=3: a step would keep no prefix position), "
            "design §2.10\n") in out  # fmt: skip
    assert ("FlashInferBuilder(cfg, device, sliding_window_size=3, modes=['draft_decode', "
            "'draft_extend'], verify_mask='both')") in out  # fmt: skip
    assert not _rows(out, "flashinfer_swa.draft_decode_shared.")
    cfg = dataclasses.replace(CHAIN_CFG, sliding_window_size=3)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=3,
                           modes=["draft_decode", "draft_extend"])  # fmt: skip
    assert _summary(out)["window-pool metadata"][:2] == _human(_device_bytes(fi)).split()
    with pytest.raises(ValueError, match="needs a window wider than the draft steps"):
        FlashInferBuilder(cfg, "cpu", sliding_window_size=3, modes=["draft_decode_shared_prefix"])
    assert main(narrow) == 0  # the default modes: the same line, the builder's default modes
    out = capsys.readouterr().out
    assert "the full layers' draft_decode_shared_prefix is draft_decode for the window" in out
    assert ("FlashInferBuilder(cfg, device, sliding_window_size=3, modes=['draft_decode', "
            "'draft_decode_paged', 'target_verify', 'draft_extend'], verify_mask='both')") in out  # fmt: skip


@pytest.mark.parametrize("topk,ps,w", [(1, 1, 9), (4, 16, 9), (2, 1, 3)])
def test_window_plan_keys_are_the_window_builders_own(topk, ps, w):
    """``specmeta plan`` reads the window builders' capabilities from the torch-free data their
    classes read (:mod:`specmeta.metadata.capabilities`, not a copy), and the one rule those
    fields cannot say, FlashInfer's shared-prefix cascade only for ``w > S``
    (:class:`~specmeta.plan_report.WindowBuilder`): what it says each builds must be what each
    constructor accepts, and its keys each builder's own, for every choice of modes and mask."""
    from itertools import combinations

    from specmeta.config import plan_sizes
    from specmeta.metadata import capabilities
    from specmeta.metadata.fa3_window import FA3_WINDOW_CAPABILITIES, FA3WindowBuilder
    from specmeta.metadata.flashinfer_window import WINDOW_CAPABILITIES, FlashInferWindowBuilder
    from specmeta.plan_report import WINDOW_BUILDERS, window_plan_keys

    cfg = SpecConfig(topk=topk, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=3,
                     max_context_len=40, sliding_window_size=w)  # fmt: skip
    keys = list(plan_sizes(cfg))
    classes = {"fa3": (FA3WindowBuilder, FA3_WINDOW_CAPABILITIES),
               "flashinfer": (FlashInferWindowBuilder, WINDOW_CAPABILITIES)}  # fmt: skip
    assert FA3_WINDOW_CAPABILITIES is capabilities.FA3_WINDOW_CAPABILITIES
    assert WINDOW_CAPABILITIES is capabilities.FLASHINFER_WINDOW_CAPABILITIES
    assert set(WINDOW_BUILDERS) == set(classes)
    for backend, (cls, caps) in classes.items():
        window = WINDOW_BUILDERS[backend]
        assert (window.key + ".", window.builder) == (cls.plan_prefix, cls.__name__)
        assert window.capabilities is caps is cls.capabilities
        served = cls.check_modes(cfg, None)
        assert window.served(cfg) == served, backend
        for mode in caps.modes:
            if window.why_not(mode, cfg) is not None:
                with pytest.raises(ValueError):
                    cls.check_modes(cfg, [mode])
        masks = ("bool", "packed", "both") if backend == "flashinfer" else (None,)
        for count in range(1, len(served) + 1):
            for modes in combinations(served, count):
                for mask in masks:
                    extra = {} if mask is None else {"verify_mask": mask}
                    want = cls.plan_keys(cfg, modes, **extra)
                    assert window_plan_keys(backend, keys, modes, **extra) == want, (modes, mask)
    shared = "draft_decode_shared_prefix" in WINDOW_BUILDERS["flashinfer"].served(cfg)
    assert shared == (w > 3)


def test_plan_fits_a_ragged_verify_bucket_of_window_layers(capsys):
    """Every window builder builds a ragged verify (design §2.10), its ragged buffers planned
    for the uniform verify's max_bs requests and max_bs·N tokens: with window layers a bucket
    fits on the same rule (N = 4 here), and says the window builders share it."""
    assert main([*CHAIN, "--verify-buckets", "32:8", "0:1", "33:8"]) == 1
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if re.match(r"  \d+:\d+ ", ln)}
    assert rows == {"32:8": "yes", "0:1": "yes", "33:8": "no"}, out
    assert ("  (the window builders' too: FA3WindowBuilder, FlashInferWindowBuilder, sized for "
            "the same buckets, design §2.10)\n") in out  # fmt: skip
    assert "no ragged verify" not in out
    assert main([*CHAIN, "--backend", "fa3", "--verify-buckets", "16:8"]) == 0


def test_plan_notes_a_mode_the_window_builder_does_not_build(capsys):
    """With a draft window (which bounds the draft model, not a window layer, design §2.10) the
    window builder builds no draft decode: the default modes plan the full layers' draft decode
    and the window builder's other modes, each unbuilt form named, as its constructor refuses
    it; naming draft_decode in --modes is refused (tests/test_cli_messages.py)."""
    from specmeta import FlashInferBuilder

    window = ["--draft-window-size", "100", "--draft-sink-size", "4", "--sliding-window-size", "64"]
    assert main([*PLAN, *window, "--backend", "flashinfer"]) == 0
    out = capsys.readouterr().out
    for mode in ("draft_decode", "draft_decode_shared_prefix"):
        assert (f"\nflashinfer_swa: the full layers' {mode} has no window-layer form: "
                f"FlashInferWindowBuilder does not build it ({mode} does not build a draft "
                "window yet (draft_window_size=100); it is built by none of its modes)\n") in out  # fmt: skip
    assert ("FlashInferBuilder(cfg, device, sliding_window_size=64, modes=['target_verify', "
            "'draft_extend'], verify_mask='both')") in out  # fmt: skip
    assert _rows(out, "flashinfer.draft_decode.") and not _rows(out, "flashinfer_swa.draft_decode")
    cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                     max_context_len=1024, draft_window_size=100, draft_sink_size=4,
                     sliding_window_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="draft_decode"):
        FlashInferBuilder(cfg, "cpu", sliding_window_size=64, modes=["draft_decode"])
