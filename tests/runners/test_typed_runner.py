"""A runner of builder modes (design §4): the stage binds FA3's and FlashInfer's draft decode
(``bind_draft_decode``) and a draft-slot launch to the views it is given, and each run returns
the builders' own results for ``B``. Each run's results must equal what the same stage returns
when bound to the raw batch and called at once, for the batch sequence of the padding tests
(B = 0 included), with the padded rows poisoned before every run; on the GPU the same through
captured graphs. Also here: a replay after a guarded tensor changed in place, and two threads
binding through one builder."""

from __future__ import annotations

import threading

import pytest
import torch

from specmeta import SpecConfig, Stage, allocate_buffers
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_cache_locs import (
    assign_draft_cache_locs_ref,
    bind_assign_draft_cache_locs,
)
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.runners import padding
from specmeta.runners.graph_runner import GraphRunner
from specmeta.workloads import make_batch
from tests._support import draft_stage_runner, no_host_sync
from tests.guard_bands import POISON, assert_equal

BUCKETS = (1, 4, 16)
SEQUENCE = (16, 5, 3, 1, 0, 9)
GARBAGE = 5
ROWS = 30


class DraftStage:
    """Draft slots, FA3's cascade and (with ``flashinfer``) FlashInfer's lists of one draft
    stage, on one set of builders; :meth:`bind` is the runner's stage function, and bound to a
    raw batch and called at once it is the eager path (:meth:`build`)."""

    def __init__(self, cfg: SpecConfig, device, req_to_token: torch.Tensor, *,
                 flashinfer: bool = True):  # fmt: skip
        self.cfg = cfg
        self.req_to_token = req_to_token
        self.fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
        self.fi = FlashInferBuilder(cfg, device, modes=("draft_decode",)) if flashinfer else None
        self.bufs = allocate_buffers(cfg, device)

    def bind(self, inputs) -> Stage:
        c = self.cfg
        rpi, lens = inputs["req_pool_indices"], inputs["seq_lens"]
        slots = self.bufs["draft.out_cache_loc"][: rpi.shape[0] * c.topk * c.num_steps]
        args = (rpi, self.req_to_token, lens)
        assign = bind_assign_draft_cache_locs(*args, topk=c.topk, num_steps=c.num_steps,
                                              page_size=c.page_size, out_cache_loc=slots)  # fmt: skip
        modes = {"fa3": self.fa3.bind_draft_decode(*args, slots)}
        if self.fi is not None:
            modes["fi"] = self.fi.bind_draft_decode(*args)

        def host(seq_lens_cpu):
            return {"slots": slots, **{k: m.host(seq_lens_cpu) for k, m in modes.items()}}

        return Stage([assign, *modes.values()], host=host)

    def build(self, inputs, seq_lens_cpu=None) -> dict:
        """The eager call: bound to ``inputs`` and called at once."""
        return self.bind(inputs)(seq_lens_cpu)

    @property
    def statuses(self) -> list[int]:
        return [int(b.status) for b in (self.fa3, self.fi) if b is not None]


def _config(k, ps):
    return SpecConfig(topk=k, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=16,
                      max_context_len=3 * ps + 5)  # fmt: skip


def _runner(cfg, device, req_to_token, *, graphs=None):
    stage = DraftStage(cfg, device, req_to_token)
    runner = draft_stage_runner(stage.bind, stage.bufs, cfg, device, req_to_token, BUCKETS,
                                graphs=graphs)  # fmt: skip
    return runner, stage


def _batch(cfg, B, gen, device, max_len=None):
    return make_batch("random", batch_size=B, topk=cfg.topk, num_steps=cfg.num_steps,
                      page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                      device=device, num_rows=ROWS,
                      max_len=max_len or cfg.max_context_len)  # fmt: skip


def _raw(batch):
    return {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}


def _compare_fa3(got, want, B):
    assert len(got) == len(want)
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
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


def _compare(got: dict, want: dict, cfg, B, total):
    K, S = cfg.topk, cfg.num_steps
    assert_equal(got["slots"], want["slots"], f"draft slots (B={B})")
    assert len(got["fa3"]) == S - 1
    _compare_fa3(got["fa3"], want["fa3"], B)
    if "fi" not in want:
        return
    for s in range(S - 1):
        gf, wf = got["fi"][s], want["fi"][s]
        assert_equal(gf.kv_indptr, wf.kv_indptr, f"fi kv_indptr[{s}] (B={B})")
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
        batch = _batch(cfg, B, gen, device, max_len)
        stage.req_to_token.copy_(batch.req_to_token)
        for spec in runner.inputs.values():  # a missed pad reads plausible garbage
            spec.buffer.fill_(GARBAGE)
        res = runner.run(B, _raw(batch), host_inputs={"seq_lens": batch.seq_lens_cpu})
        assert res.batch_size == B and res.padded_batch_size == runner.bucket(B)
        buckets.add(res.padded_batch_size)
        want = eager.build(_raw(batch), batch.seq_lens_cpu)
        _compare(res.results, want, cfg, B, batch.seq_lens_sum)
    return buckets


@pytest.mark.parametrize("k,ps", [(2, 4), (1, 1), (4, 16)])
def test_runner_results_equal_eager_builders(device, gen, k, ps):
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table)
    eager = DraftStage(cfg, device, table)
    assert _run_sequence(runner, stage, eager, cfg, gen, device) == set(BUCKETS)


def test_runner_repeated_batch_size_gets_this_calls_results(device, gen):
    """The builders' result object for a B is the same at every run; a new batch of the same B
    with shorter requests (a new max_seqlen_k) gets its own values."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table)
    eager = DraftStage(cfg, device, table)
    buckets = _run_sequence(runner, stage, eager, cfg, gen, device,
                            sequence=(5, 5, 5, 16, 16), max_lens=(17, 9, 17, 17, 12))  # fmt: skip
    assert buckets == {16}, "every run of the sequence (compared inside) replayed bucket 16"


def test_runner_checks_host_input_before_any_launch(device):
    """A length over the plan's max_context_len is refused by the builders' host parts, which
    run before the pad-copy and the replay: nothing is written."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table)
    before = {n: s.buffer.clone() for n, s in runner.inputs.items()}
    rpi = torch.ones(2, dtype=torch.int64, device=device)
    lens = torch.full((2,), cfg.max_context_len + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_context_len"):
        runner.run(2, {"req_pool_indices": rpi, "seq_lens": lens.to(device)},
                   host_inputs={"seq_lens": lens})  # fmt: skip
    for name, spec in runner.inputs.items():
        assert torch.equal(spec.buffer, before[name]), f"{name} written before the check"


def test_flashinfer_stage_needs_seq_lens_cpu(device):
    """FlashInfer's host part writes plan()'s host mirrors: it needs the batch's CPU lengths,
    so a runner of a FlashInfer stage without a host input refuses to run (before any
    launch)."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    stage = DraftStage(cfg, device, table)
    runner = GraphRunner(stage.bind, batch_sizes=BUCKETS, device=device)
    runner.add_input("req_pool_indices", stage.bufs["runner.req_pool_indices"],
                     pad=padding.SINK_ROW)  # fmt: skip
    runner.add_input("seq_lens", stage.bufs["runner.seq_lens"], pad=4)
    runner.capture()
    stage.bufs["draft.out_cache_loc"].fill_(POISON)
    rpi = torch.ones(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        runner.run(2, {"req_pool_indices": rpi, "seq_lens": torch.full_like(rpi, 3)})
    assert stage.bufs["draft.out_cache_loc"].eq(POISON).all(), "launched before the refusal"


@pytest.mark.parametrize("fresh", [False, True], ids=["replayed-b", "new-b"])
def test_replay_after_a_guarded_tensor_was_resized_raises_before_any_launch(device, gen, fresh):
    """A persistent batch replayed after ``req_to_token`` (guarded) was resized in place (same
    object, same storage, a new shape): the replay raises, naming it, before the host part and
    any launch: the poisoned outputs stay poisoned. The same for a batch size never replayed
    before (its stage is not bound yet) and for ``run``."""
    cfg = _config(2, 4)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device=device)
    runner, stage = _runner(cfg, device, table)
    batch = _batch(cfg, 5, gen, device)
    table.copy_(batch.req_to_token)
    views = runner.static_inputs(5)
    views["req_pool_indices"].copy_(batch.req_pool_indices)
    views["seq_lens"].copy_(batch.seq_lens)
    runner.replay(5, host_inputs={"seq_lens": batch.seq_lens_cpu})  # unchanged: runs
    outputs = [*stage.fa3.buffers.values(), *stage.fi.buffers.values(),
               stage.bufs["draft.out_cache_loc"]]  # fmt: skip
    outputs = [t for t in outputs if t.device == table.device and t.dtype != torch.bool]
    for t in outputs:
        t.fill_(POISON)
    # One flat row: what the graphs index is no longer there (a new batch size's stage, bound
    # on it, would be refused for its rank: the runner names the change first).
    table.resize_(ROWS * cfg.req_to_token_width)
    B = 3 if fresh else 5
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.replay(B, host_inputs={"seq_lens": batch.seq_lens_cpu[:B]})
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.run(B, _raw(batch) if B == 5 else {k: v[:B] for k, v in _raw(batch).items()},
                   host_inputs={"seq_lens": batch.seq_lens_cpu[:B]})  # fmt: skip
    for i, t in enumerate(outputs):
        assert t.eq(POISON).all(), f"output {i} was written after the resize"


def test_two_threads_bind_through_one_builder(device, gen):
    """Two threads bind FA3's draft decode through one builder at once (released together by
    a barrier), on two batches of different sizes: each stage, called, gives the reference
    builder's result for its batch. The binds run concurrently; the calls (which write the
    builder's shared buffers) take turns."""
    cfg = _config(2, 4)
    fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
    ref = FA3MetadataBuilder(cfg, device, modes=("draft_decode",), reference=True)
    big = _batch(cfg, 9, gen, device)
    table = big.req_to_token
    # Two batches of one table: the nine requests, and five of them in another order.
    pick = torch.tensor([8, 6, 4, 2, 0])
    lens_cpu = [big.seq_lens_cpu, big.seq_lens_cpu[pick]]
    rpis = [big.req_pool_indices, big.req_pool_indices[pick.to(device)]]
    lens = [big.seq_lens, big.seq_lens[pick.to(device)]]
    kw = dict(topk=cfg.topk, num_steps=cfg.num_steps, page_size=cfg.page_size)
    slots = [assign_draft_cache_locs_ref(rpis[i], table, lens[i], **kw) for i in range(2)]
    barrier, turn = threading.Barrier(2), threading.Lock()
    got, errors = [None, None], []

    def work(i):
        try:
            barrier.wait()
            stage = fa3.bind_draft_decode(rpis[i], table, lens[i], slots[i])
            with turn:
                result = stage(lens_cpu[i])
                got[i] = [(s.normal.page_table.clone(), s.normal.cache_seqlens.clone(),
                           s.normal.max_seqlen_k, s.expand.page_table.clone(),
                           s.expand.cache_seqlens.clone()) for s in result]  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        want = ref.draft_decode(rpis[i], table, lens[i], slots[i], seq_lens_cpu=lens_cpu[i])
        for s, (step, mine) in enumerate(zip(want, got[i], strict=True)):
            theirs = (step.normal.page_table, step.normal.cache_seqlens, step.normal.max_seqlen_k,
                      step.expand.page_table, step.expand.cache_seqlens)  # fmt: skip
            for j, (g, w) in enumerate(zip(mine, theirs, strict=True)):
                what = f"batch {i} (B={rpis[i].shape[0]}) step {s} field {j}"
                if isinstance(w, torch.Tensor):
                    assert_equal(g, w, what)
                else:
                    assert g == w, what
    assert int(fa3.status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_runner_replays_equal_eager_and_do_not_sync(gen, k, ps):
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    runner, stage = _runner(cfg, "cuda", table, graphs=True)
    eager = DraftStage(cfg, "cuda", table)
    assert _run_sequence(runner, stage, eager, cfg, gen, "cuda") == set(BUCKETS)
    rpi = torch.ones(3, dtype=torch.int64, device="cuda")
    lens = torch.full((3,), 3, dtype=torch.int64, device="cuda")
    lens_cpu = lens.cpu()
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            res = runner.run(3, {"req_pool_indices": rpi, "seq_lens": lens},
                             host_inputs={"seq_lens": lens_cpu})  # fmt: skip
    assert res.results["fa3"][0].normal.cache_seqlens.shape[0] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(4, 16), (1, 1)])
def test_gpu_persistent_replays_of_a_stage_without_host_inputs(gen, k, ps):
    """A stage with no host inputs (FA3 only: its host part then writes the planned bound as
    max_seqlen_k), its batch written into the runner's static buffers: repeated B replay the
    captured tensors' check, the host part and the graph, a shrunk batch its pad first; every
    replay equals the eager stage, none syncs, and a guarded tensor changed in place stops the
    next replay."""
    cfg = _config(k, ps)
    table = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int64, device="cuda")
    stage = DraftStage(cfg, "cuda", table, flashinfer=False)
    runner = GraphRunner(stage.bind, batch_sizes=BUCKETS, device="cuda")
    runner.add_input("req_pool_indices", stage.bufs["runner.req_pool_indices"],
                     pad=padding.SINK_ROW)  # fmt: skip
    runner.add_input("seq_lens", stage.bufs["runner.seq_lens"],
                     pad=padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens))  # fmt: skip
    runner.add_guard("req_to_token", table)
    runner.capture()
    eager = DraftStage(cfg, "cuda", table, flashinfer=False)
    for B in (9, 9, 9, 3, 3, 3, 16, 16, 16, 1, 1, 1):
        batch = _batch(cfg, B, gen, "cuda")
        table.copy_(batch.req_to_token)
        views = runner.static_inputs(B)
        views["req_pool_indices"].copy_(batch.req_pool_indices)
        views["seq_lens"].copy_(batch.seq_lens)
        torch.cuda.synchronize()
        with no_host_sync():
            res = runner.replay(B)
        _compare(res, eager.build(_raw(batch)), cfg, B, batch.seq_lens_sum)
        assert runner.inputs["seq_lens"].buffer[B:].eq(runner.inputs["seq_lens"].pad).all(), B
        assert stage.statuses == [0], B
    table.resize_(ROWS - 1, table.shape[1])  # the same storage, a new shape
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.replay(1)
