"""A typed runner (design §4): builder modes bound as one stage, results cut to ``B`` by the
builders themselves. Each run's results must equal what the same builders return when called
eagerly on the raw batch, for the batch sequence of the padding tests (B = 0 included), with the
padded rows poisoned before every run; on the GPU the same through captured graphs."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, allocate_buffers
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.runners import padding
from specmeta.runners.graph_runner import GraphRunner, StageBatch
from specmeta.workloads import make_batch
from tests._support import draft_stage_runner, no_host_sync
from tests.guard_bands import assert_equal

BUCKETS = (1, 4, 16)
SEQUENCE = (16, 5, 3, 1, 0, 9)
GARBAGE = 5
ROWS = 30


class Stage:
    """Draft slots, FA3's cascade and FlashInfer's lists of one draft stage, on one set of
    builders; ``build`` is the typed runner's build and also the eager path."""

    def __init__(self, cfg: SpecConfig, device, req_to_token: torch.Tensor):
        self.cfg = cfg
        self.req_to_token = req_to_token
        self.fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
        self.fi = FlashInferBuilder(cfg, device, modes=("draft_decode",))
        self.bufs = allocate_buffers(cfg, device)

    def build(self, batch: StageBatch) -> dict:
        c = self.cfg
        rpi, lens = batch.inputs["req_pool_indices"], batch.inputs["seq_lens"]
        B = rpi.shape[0]
        slots = self.bufs["draft.out_cache_loc"][: B * c.topk * c.num_steps]
        if batch.launch:
            assign_draft_cache_locs(rpi, self.req_to_token, lens, topk=c.topk,
                                    num_steps=c.num_steps, page_size=c.page_size,
                                    out_cache_loc=slots)  # fmt: skip
        host = batch.host.get("seq_lens")
        args = (rpi, self.req_to_token, lens)
        return {
            "slots": slots,
            "fa3": self.fa3.draft_decode(*args, slots, seq_lens_cpu=host, launch=batch.launch),
            "fi": self.fi.draft_decode(*args, seq_lens_cpu=host, launch=batch.launch),
        }


def _config(k, ps):
    return SpecConfig(topk=k, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=16,
                      max_context_len=3 * ps + 5)  # fmt: skip


def _typed_runner(cfg, device, req_to_token, *, graphs=None):
    stage = Stage(cfg, device, req_to_token)
    runner = draft_stage_runner(stage.build, stage.bufs, cfg, device, req_to_token, BUCKETS,
                                graphs=graphs)  # fmt: skip
    return runner, stage


def _compare(got: dict, want: dict, cfg, B, total):
    K, S = cfg.topk, cfg.num_steps
    assert_equal(got["slots"], want["slots"], f"draft slots (B={B})")
    rows = S - 1
    assert len(got["fa3"]) == len(want["fa3"]) == rows
    for s in range(rows):
        g, w = got["fa3"][s], want["fa3"][s]
        for part in ("normal", "expand"):
            gm, wm = getattr(g, part), getattr(w, part)
            assert (gm is None) == (wm is None)
            if gm is None:
                continue
            for name, value in wm.kwargs().items():
                if isinstance(value, torch.Tensor):
                    got_v = getattr(gm, name)
                    assert got_v.shape == value.shape, f"fa3 {part}.{name} cut to B={B}"
                    assert_equal(got_v, value, f"fa3 step {s} {part}.{name} (B={B})")
                else:
                    assert getattr(gm, name) == value, f"fa3 step {s} {part}.{name} (B={B})"
            assert gm.max_seqlen_k == wm.max_seqlen_k, f"fa3 step {s} {part} max_seqlen_k (B={B})"
        gf, wf = got["fi"][s], want["fi"][s]
        assert_equal(gf.kv_indptr, wf.kv_indptr, f"fi kv_indptr[{s}] (B={B})")
        if wf.kv_indptr_host is None:  # a stage run without seq_lens_cpu has no mirrors
            assert gf.kv_indptr_host is None, f"fi host mirror[{s}] (B={B})"
        else:
            assert_equal(gf.kv_indptr_host, wf.kv_indptr_host, f"fi host mirror[{s}] (B={B})")
            assert_equal(gf.kv_indptr_host, gf.kv_indptr.cpu(), f"fi mirror = device (B={B})")
        used = draft_decode_kv_indices_need(total, B, K, s + 1)
        assert_equal(gf.kv_indices[:used], wf.kv_indices[:used], f"fi kv_indices[{s}] (B={B})")


def _run_sequence(runner, stage, eager, cfg, gen, device, sequence=SEQUENCE,
                  max_lens=None) -> set[int]:  # fmt: skip
    """Run the batch sequence, each run compared with the eager stage; returns the buckets
    the runs replayed. ``max_lens``: each batch's longest length (default the plan's)."""
    buckets = set()
    lens = max_lens or [cfg.max_context_len] * len(sequence)
    for B, max_len in zip(sequence, lens, strict=True):
        batch = make_batch("random", batch_size=B, topk=cfg.topk, num_steps=cfg.num_steps,
                           page_size=cfg.page_size, row_width=cfg.req_to_token_width,
                           generator=gen, device=device, num_rows=ROWS,
                           max_len=max_len)  # fmt: skip
        stage.req_to_token.copy_(batch.req_to_token)
        for spec in runner.inputs.values():  # a missed pad reads plausible garbage
            spec.buffer.fill_(GARBAGE)
        res = runner.run(B, {"req_pool_indices": batch.req_pool_indices,
                             "seq_lens": batch.seq_lens},
                         host_inputs={"seq_lens": batch.seq_lens_cpu}, copy=False)  # fmt: skip
        assert res.batch_size == B and res.padded_batch_size == runner.bucket(B)
        buckets.add(res.padded_batch_size)
        host = {"seq_lens": batch.seq_lens_cpu}
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
        want = eager.build(StageBatch(inputs, host, True))
        _compare(res.results, want, cfg, B, batch.seq_lens_sum)
    return buckets


@pytest.mark.parametrize("k,ps", [(2, 4), (1, 1), (4, 16)])
def test_typed_runner_results_equal_eager_builders(device, gen, k, ps):
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _typed_runner(cfg, device, table)
    eager = Stage(cfg, device, table)
    assert _run_sequence(runner, stage, eager, cfg, gen, device) == set(BUCKETS)


def test_typed_runner_repeated_batch_size_gets_this_calls_results(device, gen):
    """A typed runner hands one RunResult per B while the builders' result is the same object;
    a new batch of the same B with shorter requests (a new max_seqlen_k) gets its own."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _typed_runner(cfg, device, table)
    eager = Stage(cfg, device, table)
    buckets = _run_sequence(runner, stage, eager, cfg, gen, device,
                            sequence=(5, 5, 5, 5, 16, 16), max_lens=(17, 17, 9, 17, 17, 12))
    assert buckets == {16}, "every run of the sequence (compared inside) replayed bucket 16"


def test_typed_runner_declares_no_outputs_and_copies_nothing(device):
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    stage = Stage(cfg, device, table)
    runner = GraphRunner(stage.build, batch_sizes=BUCKETS, device=device, typed=True)
    runner.add_input("req_pool_indices", stage.bufs["runner.req_pool_indices"], pad=0)
    runner.add_output("kv_indices", per_request=None)
    with pytest.raises(ValueError, match="declare no outputs"):
        runner.capture()
    runner, stage = _typed_runner(cfg, device, table)
    rpi = torch.ones(2, dtype=torch.int64, device=device)
    lens = torch.full((2,), 3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="copy=False"):
        runner.run(2, {"req_pool_indices": rpi, "seq_lens": lens},
                   host_inputs={"seq_lens": lens.cpu()}, copy=True)  # fmt: skip


def test_typed_runner_checks_host_input_before_any_launch(device):
    """A length over the plan's max_context_len is refused by the builders' host checks in the
    describing call, which runs before the pad-copy and the replay: nothing is written."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _typed_runner(cfg, device, table)
    before = {n: s.buffer.clone() for n, s in runner.inputs.items()}
    rpi = torch.ones(2, dtype=torch.int64, device=device)
    lens = torch.full((2,), cfg.max_context_len + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_context_len"):
        runner.run(2, {"req_pool_indices": rpi, "seq_lens": lens.to(device)},
                   host_inputs={"seq_lens": lens}, copy=False)  # fmt: skip
    for name, spec in runner.inputs.items():
        assert torch.equal(spec.buffer, before[name]), f"{name} written before the check"


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_typed_runner_replays_equal_eager_and_do_not_sync(gen, k, ps):
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    runner, stage = _typed_runner(cfg, "cuda", table, graphs=True)
    eager = Stage(cfg, "cuda", table)
    assert _run_sequence(runner, stage, eager, cfg, gen, "cuda") == set(BUCKETS)
    rpi = torch.ones(3, dtype=torch.int64, device="cuda")
    lens = torch.full((3,), 3, dtype=torch.int64, device="cuda")
    lens_cpu = lens.cpu()
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            res = runner.run(3, {"req_pool_indices": rpi, "seq_lens": lens},
                             host_inputs={"seq_lens": lens_cpu}, copy=False)  # fmt: skip
    assert res.results["fa3"][0].normal.cache_seqlens.shape[0] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_persistent_replays_of_a_stage_without_host_inputs(gen, k, ps):
    """A typed stage with no host inputs, its batch written into the runner's static buffers:
    repeated B take the leanest replay (the captured tensors compared, the graph, B's result),
    a shrunk batch its pad first; every replay equals the eager stage, none syncs, and a
    guarded tensor changed in place stops the next replay."""
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    stage = Stage(cfg, "cuda", table)
    runner = GraphRunner(stage.build, batch_sizes=BUCKETS, device="cuda", typed=True)
    runner.add_input("req_pool_indices", stage.bufs["runner.req_pool_indices"],
                     pad=padding.SINK_ROW)  # fmt: skip
    runner.add_input("seq_lens", stage.bufs["runner.seq_lens"],
                     pad=padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens))  # fmt: skip
    runner.add_guard("req_to_token", table)
    runner.capture()
    eager = Stage(cfg, "cuda", table)
    for B in (9, 9, 9, 3, 3, 3, 16, 16, 16, 1, 1, 1):
        batch = make_batch("random", batch_size=B, topk=cfg.topk, num_steps=cfg.num_steps,
                           page_size=cfg.page_size, row_width=cfg.req_to_token_width,
                           generator=gen, device="cuda", num_rows=ROWS,
                           max_len=cfg.max_context_len)  # fmt: skip
        table.copy_(batch.req_to_token)
        views = runner.static_inputs(B)
        views["req_pool_indices"].copy_(batch.req_pool_indices)
        views["seq_lens"].copy_(batch.seq_lens)
        torch.cuda.synchronize()
        with no_host_sync():
            res = runner.replay(B)
        assert (res.batch_size, res.padded_batch_size) == (B, runner.bucket(B))
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
        _compare(res.results, eager.build(StageBatch(inputs, {}, True)), cfg, B,
                 batch.seq_lens_sum)  # fmt: skip
        assert runner.inputs["seq_lens"].buffer[B:].eq(runner.inputs["seq_lens"].pad).all(), B
        assert int(stage.fa3.status) == 0 and int(stage.fi.status) == 0, B
    table.resize_(ROWS - 1, table.shape[1])  # the same storage, a new shape
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.replay(1)
