"""The README's integration examples (issue 7): each script runs on the device under test (its
runner replays CUDA graphs there, or takes the same path without capture on CPU) and exits 0
from the command line; the eager metadata each one returns, read by the torch reference
consumer of its backend, gives the attention of every branch's (draft decode) or tree node's
(target verify) logical sequence, rebuilt here from design §1 with the library's references."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs_ref
from specmeta.launch import interpreter_problem
from specmeta.testing.consumers import flashinfer, trtllm_mla
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import run_cascade
from tests.guard_bands import assert_equal

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("fa3_backend", "flashinfer_backend", "trtllm_mla_backend")
H, H_KV, D = 4, 2, 8


def _load(name: str):
    """Import ``examples/<name>.py`` by path (examples/ is not a package)."""
    module = f"_specmeta_example_{name}"
    spec = importlib.util.spec_from_file_location(module, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod  # dataclasses resolve their module while the file executes
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, device, seed):
    return _load(name).main(["--device", str(device), "--seed", str(seed)])


def _pools(batch, gen, device):
    """Random float64 K/V pools (no prefix-tail copies: page-size-1 lists never read a hole)."""
    return tuple(torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
                 .to(device) for _ in "kv")  # fmt: skip


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _rows(batch):
    r2t = batch.req_to_token.cpu().long()
    rows, lens = batch.req_pool_indices.cpu().tolist(), batch.seq_lens_cpu.tolist()
    return [(r2t[r], L) for r, L in zip(rows, lens, strict=True)]


def _branch_lists(batch, step: int):
    """Draft forward ``step``: branch (b, t) reads ``row_b[:L_b]`` then its chain ``j ≤ step``."""
    K, S = batch.topk, batch.num_steps
    slots = assign_draft_cache_locs_ref(*_args(batch), topk=K, num_steps=S,
                                        page_size=batch.page_size)  # fmt: skip
    chains = slots.cpu().long().view(-1, K, S)
    return [torch.cat([row[:L], chains[b, t, : step + 1]])
            for b, (row, L) in enumerate(_rows(batch)) for t in range(K)]  # fmt: skip


def _tree_lists(batch, tree):
    """Node j of request i reads ``row_i[:L_i]`` then the window slots ``row_i[L_i + c]`` of
    its ancestors and itself (the columns set in the tree mask)."""
    n = tree.shape[-1]
    return [torch.cat([row[:L], row[L : L + n][tree[i, j].cpu()]])
            for i, (row, L) in enumerate(_rows(batch)) for j in range(n)]  # fmt: skip


def _causal_lists(batch, n):
    return [row[: L + j + 1] for row, L in _rows(batch) for j in range(n)]


def _close(got, want, what):
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=1e-9,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


def _queries(rows, gen, k_cache):
    """``[rows, H, D]`` float64 queries for a cache ``[P, H_kv, D]`` (``H`` a multiple of
    ``H_kv``: grouped-query attention)."""
    return torch.randn(rows, H, k_cache.shape[-1], generator=gen, dtype=torch.float64).to(
        k_cache.device
    )


def test_fa3_example_means_what_spec_says(device, gen, seed):
    res = _run("fa3_backend", device, seed)
    batch, cfg = res.batch, res.cfg
    B, K, S, N = batch.batch_size, cfg.topk, cfg.num_steps, cfg.num_draft_tokens
    assert K > 1 and cfg.layout_b, "the example is a tree draft in slot layout B"
    assert_equal(res.out_cache_loc, assign_draft_cache_locs_ref(
        *_args(batch), topk=K, num_steps=S, page_size=cfg.page_size), "out_cache_loc")  # fmt: skip
    # The example's own cache: its prefix-tail moves must be in place for the expand pass.
    k, v = res.kv_cache
    assert len(res.draft) == S - 1, "one metadata set per draft forward"
    q = _queries(B * K, gen, k)
    for s, step in enumerate(res.draft):
        assert step.is_cascade, "K > 1: a normal (prefix) and an expand (own chain) pass"
        assert step.normal.cu_seqlens_q.tolist() == [K * i for i in range(B + 1)]  # design §3.1
        want = dense_attention(q, k, v, _branch_lists(batch, s))[0]
        _close(run_cascade(q, k, v, step), want, f"FA3 draft forward {s}")
    q = _queries(B * N, gen, k)
    want = dense_attention(q, k, v, _tree_lists(batch, res.tree_mask))[0]
    _close(run_cascade(q, k, v, res.verify), want, "FA3 target verify")


def test_flashinfer_example_means_what_spec_says(device, gen, seed):
    res = _run("flashinfer_backend", device, seed)
    batch, cfg = res.batch, res.cfg
    B, K, S, N = batch.batch_size, cfg.topk, cfg.num_steps, cfg.num_draft_tokens
    assert K > 1
    k, v = _pools(batch, gen, device)
    assert len(res.draft.steps) == S - 1
    q = _queries(B * K, gen, k)
    for s, step in enumerate(res.draft.steps):
        assert step.page_size == 1 and step.kv_indptr_host.device.type == "cpu"
        assert_equal(step.kv_indptr_host, step.kv_indptr, f"kv_indptr_host of forward {s}")
        want = dense_attention(q, k, v, _branch_lists(batch, s))
        got = flashinfer.decode(q, k, v, step)
        _close(got[0], want[0], f"FlashInfer draft forward {s}")
        _close(got[1], want[1], f"FlashInfer draft forward {s} (lse)")
    ver = res.verify
    assert_equal(ver.kv_indptr_host, ver.kv_indptr, "verify kv_indptr_host")
    assert_equal(ver.qo_indptr_host, torch.arange(B + 1) * N, "verify qo_indptr_host")
    q = _queries(B * N, gen, k)
    want = dense_attention(q, k, v, _tree_lists(batch, res.tree_mask))[0]
    _close(flashinfer.prefill(q, k, v, ver)[0], want, "FlashInfer target verify")


def test_trtllm_mla_example_means_what_spec_says(device, gen, seed):
    res = _run("trtllm_mla_backend", device, seed)
    batch, cfg = res.batch, res.cfg
    B, K, S, N, ps = batch.batch_size, cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.page_size
    assert K > 1 and cfg.layout_b, "the example is a tree draft in slot layout B"
    # The example's own latent cache (MLA: keys and values are the one latent head), its
    # prefix-tail moves in place for the branch rows' first pages.
    k = v = res.ckv_cache
    assert len(res.draft.steps) == S - 1
    q = _queries(B * K, gen, k)
    for s, step in enumerate(res.draft.steps):
        lens = batch.seq_lens_cpu.repeat_interleave(K) + s + 1  # design §3.4: L + s + 1
        assert step.seq_lens_k.cpu().tolist() == lens.tolist()
        want = dense_attention(q, k, v, _branch_lists(batch, s))[0]
        _close(trtllm_mla.decode(q, k, v, step, ps)[0], want, f"TRT-LLM MLA draft forward {s}")
    for meta, n, what in ((res.extend, N, "draft extend"), (res.verify, S + 1, "chain verify")):
        assert meta.max_seq_len_q == n and meta.sum_seq_lens_q == B * n
        q = _queries(B * n, gen, k)
        want = dense_attention(q, k, v, _causal_lists(batch, n))[0]
        _close(trtllm_mla.prefill(q, k, v, meta, ps)[0], want, f"TRT-LLM MLA {what}")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_exits_zero_from_the_command_line(device, seed, name):
    """Each script runs as a command: on the CPU with TRITON_INTERPRET unset in its
    environment (the script switches Triton's interpreter on before Triton is imported)."""
    env = dict(os.environ)
    if device.type == "cpu":
        if interpreter_problem() is not None:
            pytest.skip(interpreter_problem())
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--device", str(device),
         "--seed", str(seed)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = re.findall(r"^runner, B=(\d+) \(bucket (\d+)\): equal to the eager build$",
                      proc.stdout, flags=re.M)  # fmt: skip
    assert runs == [("2", "4"), ("0", "4"), ("5", "8")], proc.stdout  # B = 2, 0, 5
    if name == "fa3_backend":  # the stage bound once, then launched and asked for its host part
        assert "bound stage, B=5, two steps: equal to the eager build" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", [*SCRIPTS, "draft_loop", "speculative_loop"])
def test_scripts_name_a_missing_gpu_in_one_line(name, capsys):
    """``--device cuda`` where torch sees no GPU: the script ends before anything is imported
    or built, with one line naming the problem and the fix, and a non-zero status."""
    module = _load(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--device", "cuda"])
    message = str(exit_.value.code)
    assert "\n" not in message and "sees no CUDA GPU" in message and "--device cpu" in message
    assert message.startswith(f"{name}.py: --device cuda"), message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_script_without_a_gpu_exits_non_zero_with_one_line():
    """The same from the command line: one line on stderr, exit status 1, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "fa3_backend.py"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0], proc.stderr


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_quickstart_runs(device):
    """The Quickstart block runs as it stands (on the device under test) and means what it says."""
    (code,) = [b for b in _readme_blocks() if "specmeta.SpecConfig(" in b and "make_batch" in b]
    default = 'device = "cuda" if torch.cuda.is_available() else "cpu"'
    assert default in code
    scope: dict = {}
    exec(compile(code.replace(default, f'device = "{device}"'), "README.md", "exec"), scope)
    cfg, batch, meta = scope["cfg"], scope["batch"], scope["meta"]
    assert len(meta.steps) == cfg.num_steps - 1 and batch.batch_size == 8
    for step in meta.steps:
        assert_equal(step.kv_indptr_host, step.kv_indptr, "Quickstart kv_indptr_host")
    K, lens = cfg.topk, batch.seq_lens_cpu
    first = [0] + (lens.repeat_interleave(K) + 1).cumsum(0).tolist()  # design §2.2, forward 0
    assert meta.steps[0].kv_indptr_host.tolist() == first


def test_readme_excerpts_are_the_scripts_own_lines():
    """Every README excerpt marked ``# examples/<name>.py, inside main()`` is a contiguous run of
    that script's lines (dedented, formatter markers dropped): the guides cannot drift from the
    code the tests run. (The README may excerpt any of the scripts, or none.)"""
    marker = re.compile(r"# examples/(\w+)\.py, inside main\(\)\n")
    seen = []
    for block in _readme_blocks():
        m = marker.match(block)
        if m is None:
            continue
        seen.append(m.group(1))
        excerpt = block[m.end() :].rstrip("\n")
        text = (ROOT / "examples" / f"{m.group(1)}.py").read_text()
        lines = [line.removesuffix("  # fmt: skip") for line in text.splitlines()]
        n = excerpt.count("\n") + 1
        windows = {textwrap.dedent("\n".join(lines[i : i + n])) for i in range(len(lines) - n + 1)}
        assert excerpt in windows, f"a README excerpt of examples/{m.group(1)}.py is not in it"
    assert set(seen) <= {p.stem for p in (ROOT / "examples").glob("*.py")}, seen


@pytest.mark.gpu
@pytest.mark.parametrize("name", SCRIPTS)
def test_gpu_examples_replay_captured_graphs(seed, name, monkeypatch):
    """On CUDA every runner call of an example replays a captured graph (not the eager path)."""
    from specmeta.runners import GraphRunner

    replays = []
    original = GraphRunner.run

    def run(self, *args, **kwargs):
        res = original(self, *args, **kwargs)
        replays.append((self.graphs, res.padded_batch_size))
        return res

    monkeypatch.setattr(GraphRunner, "run", run)
    _run(name, "cuda", seed)
    assert replays == [(True, 4), (True, 4), (True, 8)], "B = 2, 0, 5: the graphs of 4, 4, 8"
