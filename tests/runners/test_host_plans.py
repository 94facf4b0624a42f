"""A typed runner's host plans (design §4): after the first call of a batch size, a stage whose
build returns builder results (one, or a tuple, list or dict of them) is described by running
its builder calls' host steps on the new ``seq_lens_cpu``, without calling the build. Each
call's results must equal the same builders called eagerly on the same batch; a stage whose
result no plan can make is built on every call; a planned call still refuses a bad length
before anything is written; on the GPU, persistent replays with host inputs do the same
without a sync."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, allocate_buffers
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.runners.graph_runner import StageBatch
from specmeta.workloads import make_batch
from tests._support import draft_stage_runner, no_host_sync
from tests.guard_bands import assert_equal

BUCKETS = (1, 4, 16)
ROWS = 30
SHAPES = ("one", "tuple", "list", "dict")


def _config(k: int, ps: int) -> SpecConfig:
    return SpecConfig(topk=k, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=16,
                      max_context_len=3 * ps + 5)  # fmt: skip


class Stage:
    """FA3's draft decode, FlashInfer's draft decode and TRT-LLM MLA's draft decode on one
    batch, returned in the shape ``shape``; ``describes`` counts the build's calls with
    ``launch=False``. ``derived``: FlashInfer reads a copy of the host input, not the input."""

    def __init__(self, cfg, device, req_to_token, shape: str, derived: bool = False):
        self.cfg, self.req_to_token, self.shape, self.derived = cfg, req_to_token, shape, derived
        self.fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
        self.fi = FlashInferBuilder(cfg, device, modes=("draft_decode",))
        self.trt = TrtllmMlaBuilder(cfg, device, modes=("draft_decode",))
        self.bufs = allocate_buffers(cfg, device)
        self.describes = 0

    def build(self, batch: StageBatch):
        c = self.cfg
        rpi, lens = batch.inputs["req_pool_indices"], batch.inputs["seq_lens"]
        slots = self.bufs["draft.out_cache_loc"][: rpi.shape[0] * c.topk * c.num_steps]
        if batch.launch:
            assign_draft_cache_locs(rpi, self.req_to_token, lens, topk=c.topk,
                                    num_steps=c.num_steps, page_size=c.page_size,
                                    out_cache_loc=slots, status=self.fa3.status)  # fmt: skip
        else:
            self.describes += 1
        host = batch.host.get("seq_lens")
        args, launch = (rpi, self.req_to_token, lens), batch.launch
        fa3 = self.fa3.draft_decode(*args, slots, seq_lens_cpu=host, launch=launch)
        if self.shape == "one":
            return fa3
        fi_host = host.clone() if self.derived and host is not None else host
        fi = self.fi.draft_decode(*args, seq_lens_cpu=fi_host, launch=launch)
        trt = self.trt.draft_decode(*args, seq_lens_cpu=host, launch=launch)
        if self.shape == "tuple":
            return fa3, fi, trt
        if self.shape == "list":
            return [fa3, fi, trt]
        return {"fa3": fa3, "fi": fi, "trt": trt}


def _parts(results, shape: str) -> dict:
    if shape == "one":
        return {"fa3": results}
    if shape in ("tuple", "list"):
        assert type(results) is (tuple if shape == "tuple" else list)
        return dict(zip(("fa3", "fi", "trt"), results, strict=True))
    assert type(results) is dict
    return results


def _compare(got, want, shape: str, B: int) -> None:
    """Every field of every step, exactly: host scalars, device views cut to ``B``, host
    mirrors (and that each mirror equals its device tensor)."""
    got, want = _parts(got, shape), _parts(want, shape)
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]), f"{name} steps (B={B})"
        for s, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
            where = f"{name} step {s} (B={B})"
            if name == "fa3":
                for part in ("normal", "expand"):
                    gm, wm = getattr(g, part), getattr(w, part)
                    assert (gm is None) == (wm is None), where
                    if wm is None:
                        continue
                    assert gm.max_seqlen_k == wm.max_seqlen_k, f"{where} {part} max_seqlen_k"
                    for key, value in wm.kwargs().items():
                        mine = getattr(gm, key)
                        if isinstance(value, torch.Tensor):
                            assert_equal(mine, value, f"{where} {part}.{key}")
                        else:
                            assert mine == value, f"{where} {part}.{key}"
            elif name == "fi":
                assert_equal(g.kv_indptr, w.kv_indptr, f"{where} kv_indptr")
                assert_equal(g.kv_indptr_host, w.kv_indptr_host, f"{where} kv_indptr_host")
                assert_equal(g.kv_indptr_host, g.kv_indptr.cpu(), f"{where} mirror = device")
                used = int(w.kv_indptr_host[-1])
                assert_equal(g.kv_indices[:used], w.kv_indices[:used], f"{where} kv_indices")
            else:
                assert_equal(g.seq_lens_k, w.seq_lens_k, f"{where} seq_lens_k")
                assert_equal(g.block_kv_indices, w.block_kv_indices, f"{where} blocks")
                assert g.max_seq_len_k == w.max_seq_len_k, f"{where} max_seq_len_k"


def _runner(cfg, device, table, shape, *, derived=False):
    stage = Stage(cfg, device, table, shape, derived)
    return draft_stage_runner(stage.build, stage.bufs, cfg, device, table, BUCKETS), stage


def _batch(cfg, B, gen, device, max_len=None):
    return make_batch("random", batch_size=B, topk=cfg.topk, num_steps=cfg.num_steps,
                      page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                      device=device, num_rows=ROWS,
                      max_len=max_len or cfg.max_context_len)  # fmt: skip


# Each B repeats with new lengths (a new max L, new mirrors): the repeats are planned calls.
SEQUENCE = ((5, None), (5, 6), (5, None), (16, None), (16, 5), (0, None), (3, None), (3, 4))


def _run(runner, stage, eager, cfg, gen, device, *, persistent=False) -> None:
    for B, max_len in SEQUENCE:
        batch = _batch(cfg, B, gen, device, max_len)
        stage.req_to_token.copy_(batch.req_to_token)
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
        host = {"seq_lens": batch.seq_lens_cpu}
        if persistent:
            for name, view in runner.static_inputs(B).items():
                view.copy_(inputs[name])
            torch.cuda.synchronize()
            with no_host_sync():
                res = runner.replay(B, host_inputs=host)
        else:
            res = runner.run(B, inputs, host_inputs=host, copy=False)
        want = eager.build(StageBatch(inputs, host, True))
        _compare(res.results, want, stage.shape, B)
    assert int(stage.fa3.status) == 0 and int(stage.fi.status) == 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,ps", [(2, 4), (1, 1)])
def test_planned_describes_equal_the_eager_builders(device, gen, shape, k, ps):
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table, shape)
    eager = Stage(cfg, device, table, shape)
    _run(runner, stage, eager, cfg, gen, device)
    batch_sizes = {B for B, _ in SEQUENCE}
    assert stage.describes == len(batch_sizes), "one build a batch size; the rest planned"


@pytest.mark.parametrize("shape,derived", [("dict", True), ("tuple", True)])
def test_a_stage_no_plan_can_make_is_built_on_every_call(device, gen, shape, derived):
    """FlashInfer given a copy of the host input: its step reads a tensor the runner does not
    hand out, so the stage is built (launch=False) on every call, and stays right."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table, shape, derived=derived)
    eager = Stage(cfg, device, table, shape)
    _run(runner, stage, eager, cfg, gen, device)
    assert stage.describes == len(SEQUENCE)


@pytest.mark.parametrize("extra", ["view", "new_tensor", "int"])
def test_a_stage_returning_other_values(device, gen, extra):
    """Beside the builder's result, a static buffer cut to B (the same view on every describe)
    is planned from the second describe of B on, and handed back as it is; a tensor made anew
    on every describe, or a host value, keeps the build on every call."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    stage = Stage(cfg, device, table, "one")

    def build(batch):
        rpi = batch.inputs["req_pool_indices"]
        if extra == "view":
            other = stage.bufs["draft.out_cache_loc"][: rpi.shape[0]]
        elif extra == "new_tensor":
            other = torch.zeros(rpi.shape[0], dtype=torch.int64, device=device)
        else:
            other = rpi.shape[0]
        return stage.build(batch), other

    runner = draft_stage_runner(build, stage.bufs, cfg, device, table, BUCKETS)
    eager = Stage(cfg, device, table, "one")
    for max_len in (None, 7, 5, 6):
        batch = _batch(cfg, 4, gen, device, max_len)
        table.copy_(batch.req_to_token)
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
        host = {"seq_lens": batch.seq_lens_cpu}
        res = runner.run(4, inputs, host_inputs=host, copy=False)
        _compare(res.results[0], eager.build(StageBatch(inputs, host, True)), "one", 4)
        if extra == "view":
            view = res.results[1]
            want = stage.bufs["draft.out_cache_loc"][:4]
            assert (view.data_ptr(), view.shape, view.stride()) == (
                want.data_ptr(), want.shape, want.stride()
            ), "the static view, as the build returns it"
    assert stage.describes == (2 if extra == "view" else 4)


@pytest.mark.parametrize("shape", ["one", "dict"])
def test_a_planned_call_refuses_a_bad_length_before_any_write(device, gen, shape):
    """The plan's steps check every value as the builders do: a length over max_context_len
    raises the builder's named error before the pad copy and the build or replay."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table, shape)
    batch = _batch(cfg, 4, gen, device)
    table.copy_(batch.req_to_token)
    inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
    runner.run(4, inputs, host_inputs={"seq_lens": batch.seq_lens_cpu}, copy=False)
    assert stage.describes == 1  # B = 4 is planned from here on
    before = {n: s.buffer.clone() for n, s in runner.inputs.items()}
    outputs = {k: v.clone() for k, v in stage.fa3.buffers.items()}
    bad = batch.seq_lens_cpu.clone()
    bad[2] = cfg.max_context_len + 1
    with pytest.raises(ValueError, match=r"seq_lens_cpu holds .*max_context_len"):
        runner.run(4, {"req_pool_indices": batch.req_pool_indices, "seq_lens": bad.to(device)},
                   host_inputs={"seq_lens": bad}, copy=False)  # fmt: skip
    assert stage.describes == 1, "the refusal came from the plan, not from a build"
    for name, spec in runner.inputs.items():
        assert torch.equal(spec.buffer, before[name]), f"{name} written before the check"
    for key, value in stage.fa3.buffers.items():
        assert torch.equal(value, outputs[key]), f"fa3 {key} written before the check"
    assert int(stage.fa3.status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["one", "dict"])
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_persistent_replays_with_host_inputs(gen, shape, k, ps):
    """The engine writes the static buffers and passes seq_lens_cpu: after the first replay of
    a B, the leanest path with host inputs (plan, graph, the results' RunResult). Every replay
    equals the eager stage and none syncs; a bad length stops the replay before the graph."""
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    runner, stage = _runner(cfg, "cuda", table, shape)
    eager = Stage(cfg, "cuda", table, shape)
    _run(runner, stage, eager, cfg, gen, "cuda", persistent=True)
    assert stage.describes == len({B for B, _ in SEQUENCE})
    batch = _batch(cfg, 3, gen, "cuda")
    table.copy_(batch.req_to_token)
    views = runner.static_inputs(3)
    views["req_pool_indices"].copy_(batch.req_pool_indices)
    views["seq_lens"].copy_(batch.seq_lens)
    runner.replay(3, host_inputs={"seq_lens": batch.seq_lens_cpu})
    torch.cuda.synchronize()
    outputs = {k: v.clone() for k, v in stage.fa3.buffers.items()}
    views["seq_lens"].fill_(1)  # what the graph would write, were it replayed
    bad = batch.seq_lens_cpu.clone()
    bad[0] = -1
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        runner.replay(3, host_inputs={"seq_lens": bad})
    torch.cuda.synchronize()
    for key, value in stage.fa3.buffers.items():
        assert torch.equal(value, outputs[key]), f"fa3 {key} written: the graph ran"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["one", "dict"])
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_runs_on_the_engines_own_tensors(gen, monkeypatch, shape, k, ps):
    """The engine keeps its batch in tensors of its own and passes their first B rows on every
    call: a repeated call takes the lean run (plan, the key's pad launch, graph). Every call
    equals the eager stage, pads rows [B, Bp) and does not sync; a launch hook sends the pad
    through Triton's launch, still right; a bad length stops the call before the pad copy and
    the graph; a guarded tensor reshaped in place stops the next call."""
    import specmeta.launch as launch_module

    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    runner, stage = _runner(cfg, "cuda", table, shape)
    eager = Stage(cfg, "cuda", table, shape)
    rpi = torch.zeros(16, dtype=torch.int64, device="cuda")
    lens = torch.zeros(16, dtype=torch.int64, device="cuda")
    lens_cpu = torch.zeros(16, dtype=torch.int64)
    pad = runner.inputs["seq_lens"].pad
    sizes = (5, 5, 5, 16, 16, 3, 3, 3, 5, 5)
    for i, B in enumerate(sizes):
        if i == len(sizes) - 1:  # a profiler's launch hook: plans are off
            monkeypatch.setattr(launch_module, "_hooks_installed", lambda: True)
        batch = _batch(cfg, B, gen, "cuda")
        table.copy_(batch.req_to_token)
        rpi[:B].copy_(batch.req_pool_indices)
        lens[:B].copy_(batch.seq_lens)
        lens_cpu[:B].copy_(batch.seq_lens_cpu)
        torch.cuda.synchronize()
        with no_host_sync():
            res = runner.run(B, {"req_pool_indices": rpi[:B], "seq_lens": lens[:B]},
                             host_inputs={"seq_lens": lens_cpu[:B]}, copy=False)  # fmt: skip
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
        want = eager.build(StageBatch(inputs, {"seq_lens": batch.seq_lens_cpu}, True))
        _compare(res.results, want, shape, B)
        bp = runner.bucket(B)
        assert runner.inputs["seq_lens"].buffer[B:bp].eq(pad).all(), (i, B)
    monkeypatch.undo()
    assert stage.describes == len(set(sizes))
    torch.cuda.synchronize()
    before = {n: s.buffer.clone() for n, s in runner.inputs.items()}
    outputs = {key: v.clone() for key, v in stage.fa3.buffers.items()}
    lens[:5].fill_(1)  # what the pad copy would write, were it launched
    lens_cpu[1] = cfg.max_context_len + 1
    with pytest.raises(ValueError, match=r"seq_lens_cpu holds .*max_context_len"):
        runner.run(5, {"req_pool_indices": rpi[:5], "seq_lens": lens[:5]},
                   host_inputs={"seq_lens": lens_cpu[:5]}, copy=False)  # fmt: skip
    torch.cuda.synchronize()
    for name, spec in runner.inputs.items():
        assert torch.equal(spec.buffer, before[name]), f"{name} written before the check"
    for key, value in stage.fa3.buffers.items():
        assert torch.equal(value, outputs[key]), f"fa3 {key} written: the graph ran"
    lens_cpu[1] = 1
    runner.run(5, {"req_pool_indices": rpi[:5], "seq_lens": lens[:5]},
               host_inputs={"seq_lens": lens_cpu[:5]}, copy=False)  # fmt: skip
    table.resize_(ROWS - 1, table.shape[1])  # the same storage, a new shape
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.run(5, {"req_pool_indices": rpi[:5], "seq_lens": lens[:5]},
                   host_inputs={"seq_lens": lens_cpu[:5]}, copy=False)  # fmt: skip
