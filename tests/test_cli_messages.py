"""Every message the `specmeta` command gives on bad input: one line on stderr that names the
argument, the value and the fix, exit status 2, nothing on stdout and nothing created.

The expected lines are written here from what each message should say; a change of wording is a
change of this file.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from specmeta import cli
from specmeta.check import CHECKS

PLAN = ["--num-steps", "2", "--max-bs", "1", "--max-context-len", "10"]


def run(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``specmeta argv``; stdout must stay empty."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """An empty working folder, checked to stay empty."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- check


def test_check_device_cuda_with_a_cpu_only_torch(capsys, no_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert run(capsys, "check", "--device", "cuda") == (
        2,
        f"specmeta check: --device cuda: this torch ({torch.__version__}) is built without CUDA; "
        "leave --device out or pass --device cpu\n",
    )


def test_check_device_cuda_without_a_visible_gpu(capsys, no_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert run(capsys, "check", "--device", "cuda") == (
        2,
        "specmeta check: --device cuda: no CUDA device is visible; "
        "leave --device out or pass --device cpu\n",
    )


def test_check_device_index_beyond_the_gpus(capsys, one_gpu):
    assert run(capsys, "check", "--device", "cuda:3") == (
        2,
        "specmeta check: --device cuda:3: 1 CUDA device(s) visible, numbered from 0; "
        "pass --device cuda:0 or lower\n",
    )


def test_check_device_that_is_no_device(capsys):
    assert run(capsys, "check", "--device", "gpu0") == (
        2,
        "specmeta check: --device gpu0: not a device name; pass cpu or cuda\n",
    )


def test_check_device_of_another_kind(capsys):
    assert run(capsys, "check", "--device", "meta") == (
        2,
        "specmeta check: --device meta: specmeta checks on cpu or cuda only; pass one of them\n",
    )


def test_check_device_cpu_without_the_interpreter(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert run(capsys, "check", "--device", "cpu") == (
        2,
        "specmeta check: --device cpu: the kernels run on CPU tensors only under Triton's "
        "interpreter, and TRITON_INTERPRET is set to '0'; "
        "run TRITON_INTERPRET=1 specmeta check --device cpu\n",
    )


def _planted_gpu_kernel(x):  # the body of a kernel decorated with the interpreter off
    pass


def test_check_device_cpu_after_gpu_kernels_were_imported(capsys, one_gpu, monkeypatch):
    """Unset, the CLI sets TRITON_INTERPRET itself, but kernels a process already decorated
    for the GPU stay compiled (Triton reads the switch at decoration): it says so instead of
    running them on CPU tensors. The compiled kernel is planted: this process decorated the
    real ones under the interpreter."""
    import os
    import types

    from triton.runtime.jit import JITFunction

    module = types.ModuleType("specmeta._planted")
    module.kernel = JITFunction(_planted_gpu_kernel)
    monkeypatch.setitem(sys.modules, "specmeta._planted", module)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert run(capsys, "check", "--device", "cpu") == (
        2,
        "specmeta check: --device cpu: the kernels run on CPU tensors only under Triton's "
        "interpreter, and TRITON_INTERPRET is unset while specmeta's kernels are already "
        "compiled for the GPU in this process (Triton reads it when a kernel is decorated); run "
        "TRITON_INTERPRET=1 specmeta check --device cpu\n",
    )
    assert "TRITON_INTERPRET" not in os.environ


def test_check_device_cpu_sets_the_interpreter_itself(monkeypatch):
    """No kernel compiled for the GPU yet and TRITON_INTERPRET unset: set to 1 for this process
    (tests/test_cli.py runs the whole command in a fresh interpreter; here the scan is planted,
    as a GPU-tier test process holds compiled kernels)."""
    import os

    monkeypatch.setattr(cli, "_compiled_kernels", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli._device("cpu") == torch.device("cpu")
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_compiled_kernels_tells_how_this_process_decorated_them(device):
    """The CPU tier decorates every kernel under the interpreter, the GPU tier for the GPU."""
    import specmeta.kernels  # noqa: F401

    assert cli._compiled_kernels() == (device.type == "cuda")


def test_check_only_an_unknown_check(capsys):
    assert run(capsys, "check", "--only", "assign_draft_cache_locs", "fa4_builder") == (
        2,
        "specmeta check: --only fa4_builder: no such check; pick from "
        + ", ".join(CHECKS) + "\n",
    )  # fmt: skip


# ----------------------------------------------------------------------------------- plan


def test_plan_topk_zero(capsys):
    assert run(capsys, "plan", "--topk", "0", "--num-draft-tokens", "3", *PLAN) == (
        2,
        "specmeta plan: argument --topk: must be an integer >= 1, got '0'; "
        "see 'specmeta plan --help'\n",
    )


def test_plan_page_size_not_a_number(capsys):
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", "--page-size", "16k",
               *PLAN) == (
        2,
        "specmeta plan: argument --page-size: must be an integer >= 1, got '16k'; "
        "see 'specmeta plan --help'\n",
    )  # fmt: skip


def test_plan_num_draft_tokens_too_large(capsys):
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "9", *PLAN) == (
        2,
        "specmeta plan: --num-draft-tokens 9 is too large for --topk 2 --num-steps 2: a draft "
        "tree has at most 1 + K + (S-1)·K² = 7 nodes; pass at most 7\n",
    )


def test_plan_modes_that_the_named_backend_does_not_serve(capsys):
    """Naming a backend and a mode it does not serve plans nothing and says which modes it has
    and which backend has the mode (it used to print a note and exit 0)."""
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--backend",
               "fa3", "--modes", "draft_decode_shared_prefix") == (
        2,
        "specmeta plan: --modes draft_decode_shared_prefix: --backend fa3 (FA3MetadataBuilder) "
        "does not serve draft_decode_shared_prefix; it serves draft_decode, target_verify, "
        "draft_extend for this config; drop it from --modes, or pass --backend flashinfer, "
        "which serves it\n",
    )  # fmt: skip
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--backend",
               "flashinfer", "fa3", "--modes", "draft_decode_paged", "target_verify",
               "draft_decode_shared_prefix") == (
        2,
        "specmeta plan: --modes draft_decode_paged draft_decode_shared_prefix: --backend fa3 "
        "(FA3MetadataBuilder) does not serve draft_decode_paged or draft_decode_shared_prefix; "
        "it serves draft_decode, target_verify, draft_extend for this config; drop them from "
        "--modes, or pass --backend flashinfer, which serves them\n",
    )  # fmt: skip


def test_plan_tree_verify_on_a_backend_that_cannot_verify_a_tree(capsys, monkeypatch):
    # TRT-LLM MLA verifies trees as a cascade (design §3.4); planted here without it, as it was.
    chains = dataclasses.replace(cli.CAPABILITIES["trtllm_mla"], tree_verify=False)
    monkeypatch.setitem(cli.CAPABILITIES, "trtllm_mla", chains)
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--backend",
               "trtllm_mla", "--modes", "draft_extend", "target_verify") == (
        2,
        "specmeta plan: --modes target_verify: --backend trtllm_mla (TrtllmMlaBuilder) does not "
        "serve target_verify (target_verify with --topk 2 needs a tree, which it cannot "
        "verify); it serves draft_decode, draft_extend for this config; drop it from --modes, "
        "or pass --backend fa3 flashinfer flashinfer_mla, which serve it\n",
    )  # fmt: skip
    # A chain (topk = 1) is no tree: the same request plans.
    assert cli.main(["plan", "--topk", "1", "--num-draft-tokens", "3", *PLAN, "--backend",
                     "trtllm_mla", "--modes", "draft_extend", "target_verify"]) == 0  # fmt: skip
    assert "TrtllmMlaBuilder(cfg, device, modes=['target_verify', 'draft_extend'])" in (
        capsys.readouterr().out
    )


def test_plan_modes_that_no_backend_serves(capsys, monkeypatch):
    """Without --backend, backends that miss a mode are left out; when every backend misses
    one, the first is named (no builder serves every mode list today: planted here)."""
    flashinfer = dataclasses.replace(cli.CAPABILITIES["flashinfer"],
                                     modes=cli.CAPABILITIES["fa3"].modes)  # fmt: skip
    monkeypatch.setitem(cli.CAPABILITIES, "flashinfer", flashinfer)
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--modes",
               "draft_decode_paged") == (
        2,
        "specmeta plan: --modes draft_decode_paged: --backend flashinfer_mla "
        "(FlashInferMLABuilder) does not serve draft_decode_paged; it serves draft_decode, "
        "target_verify, draft_extend for this config; drop it from --modes\n",
    )  # fmt: skip


def test_plan_sliding_window_size_negative(capsys):
    assert run(capsys, "plan", "--topk", "1", "--num-draft-tokens", "3", *PLAN,
               "--sliding-window-size", "-1") == (
        2,
        "specmeta plan: argument --sliding-window-size: must be an integer >= 0, got '-1'; "
        "see 'specmeta plan --help'\n",
    )  # fmt: skip


def test_plan_window_layers_on_a_backend_without_a_window_builder(capsys):
    """A named backend that builds no window layers plans nothing and names the backends that
    do (with the other options: both window builders serve a tree, FA3's too)."""
    assert run(capsys, "plan", "--topk", "1", "--num-draft-tokens", "3", *PLAN, "--backend",
               "flashinfer", "trtllm_mla", "--sliding-window-size", "4") == (
        2,
        "specmeta plan: --sliding-window-size 4: --backend trtllm_mla (TrtllmMlaBuilder) builds "
        "no window layers for this config, design §2.10: it has no window-layer builder; drop "
        "--sliding-window-size, or pass --backend fa3 flashinfer, which build them\n",
    )  # fmt: skip
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--backend",
               "flashinfer_mla", "--sliding-window-size", "4") == (
        2,
        "specmeta plan: --sliding-window-size 4: --backend flashinfer_mla (FlashInferMLABuilder) "
        "builds no window layers for this config, design §2.10: it has no window-layer builder; "
        "drop --sliding-window-size, or pass --backend fa3 flashinfer, which build them\n",
    )  # fmt: skip


def test_plan_window_layers_of_a_named_mode_no_window_builder_builds(capsys):
    """A mode named in --modes whose window form the named backend's window builder does not
    build (draft decode beside a draft window, which bounds the draft model, not a window
    layer) is refused, naming why and the fixes, as its constructor refuses it."""
    assert run(capsys, "plan", "--topk", "2", "--num-draft-tokens", "3", *PLAN, "--backend",
               "flashinfer", "--modes", "draft_decode", "target_verify", "--draft-window-size",
               "4", "--sliding-window-size", "4") == (
        2,
        "specmeta plan: --sliding-window-size 4: --backend flashinfer (FlashInferBuilder) builds "
        "no window layers for --modes draft_decode, design §2.10: its FlashInferWindowBuilder "
        "builds no form of draft_decode (draft_decode does not build a draft window yet "
        "(draft_window_size=4); it is built by none of its modes); drop draft_decode from "
        "--modes or --sliding-window-size\n",
    )  # fmt: skip


def test_plan_without_its_required_options(capsys):
    assert run(capsys, "plan", "--topk", "2") == (
        2,
        "specmeta plan: the following arguments are required: --num-steps, --num-draft-tokens, "
        "--max-bs, --max-context-len; see 'specmeta plan --help'\n",
    )


def test_no_command(capsys):
    assert run(capsys) == (
        2,
        "specmeta: the following arguments are required: COMMAND; see 'specmeta --help'\n",
    )


# ---------------------------------------------------------------------------------- bench


def test_bench_without_a_gpu_creates_nothing(capsys, no_cuda, empty_cwd):
    assert run(capsys, "bench") == (
        2,
        "specmeta bench: no CUDA device is visible and the benchmarks measure a GPU; run it on a "
        "GPU machine, or render earlier results with --from-json FILE\n",
    )


def test_bench_without_the_benchmark_folder(capsys, one_gpu, empty_cwd):
    assert run(capsys, "bench") == (
        2,
        "specmeta bench: --bench-dir bench: no such folder; run from a specmeta checkout or pass "
        "--bench-dir PATH\n",
    )


def test_bench_without_pytest_benchmark(capsys, one_gpu, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench").mkdir()
    monkeypatch.setitem(sys.modules, "pytest_benchmark", None)  # find_spec: not installed
    assert run(capsys, "bench") == (
        2,
        "specmeta bench: running the benchmarks needs pytest_benchmark, which is not installed; "
        'pip install "specmeta[bench]"\n',
    )
    assert [p.name for p in tmp_path.iterdir()] == ["bench"]


def test_bench_from_a_missing_json(capsys, empty_cwd):
    assert run(capsys, "bench", "--from-json", "results.json") == (
        2,
        "specmeta bench: --from-json results.json: no such file; pass the JSON that "
        "pytest --benchmark-json wrote\n",
    )


def test_bench_from_json_without_matplotlib(capsys, tmp_path, monkeypatch):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"benchmarks": []}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not installed
    assert run(capsys, "bench", "--from-json", str(src), "--out", str(tmp_path / "out")) == (
        2,
        "specmeta bench: --from-json (its plots) needs matplotlib, which is not installed; "
        'pip install "specmeta[bench]"\n',
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,error", [('{"benchmarks": [', "JSONDecodeError"),
                                        ("[1, 2]", "AttributeError")])  # fmt: skip
def test_bench_from_json_that_is_not_pytest_benchmark(capsys, tmp_path, text, error):
    src = tmp_path / "in.json"
    src.write_text(text)
    assert run(capsys, "bench", "--from-json", str(src), "--out", str(tmp_path / "out")) == (
        2,
        f"specmeta bench: --from-json {src}: not pytest-benchmark JSON ({error}); pass the file "
        "pytest --benchmark-json wrote\n",
    )
    assert not (tmp_path / "out").exists()


def test_bench_results_in_a_missing_folder(capsys, empty_cwd):
    assert run(capsys, "bench", "--from-json", "x.json", "--results", "docs/RESULTS.md") == (
        2,
        "specmeta bench: --results docs/RESULTS.md: its folder does not exist; pass a path in an "
        "existing folder\n",
    )


def test_bench_date_that_is_not_a_date(capsys, empty_cwd):
    assert run(capsys, "bench", "--from-json", "x.json", "--date", "26.11.2026") == (
        2,
        "specmeta bench: --date 26.11.2026: not a date; pass YYYY-MM-DD, e.g. --date 2026-11-26\n",
    )


def test_bench_from_json_without_a_date(capsys, tmp_path):
    """The results keep their own day; a JSON that records none needs --date (never today's,
    which would re-date old results)."""
    src = tmp_path / "in.json"
    bench = {"name": "b[1]", "fullname": "bench/b.py::b[1]", "stats": {"median": 1e-6}}
    src.write_text(json.dumps({"benchmarks": [bench]}))
    assert run(capsys, "bench", "--from-json", str(src), "--out", str(tmp_path / "out")) == (
        2,
        f"specmeta bench: --from-json {src}: records no date (no 'datetime' field, which "
        "pytest-benchmark writes); pass --date YYYY-MM-DD\n",
    )
    assert not (tmp_path / "out").exists()
    src.write_text(json.dumps({"benchmarks": [bench], "datetime": "yesterday"}))
    assert run(capsys, "bench", "--from-json", str(src))[1].startswith(
        f"specmeta bench: --from-json {src}: records no date"
    )
