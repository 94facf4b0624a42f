"""Replay cost of the draft loop's metadata stages (draft decode: draft slots, prefix-tail
pairs and move, FlashInfer lists / cascade / pages, FA3 cascade; target verify: FlashInfer lists
and tree mask, FA3 tree cascade; accept: compaction and KV move) through the graph runner vs
the eager builds, at B ∈ {1, 8, 64, 256}.

Per (config, stage, B) and mode:

* ``eager``: the stage called directly on the raw inputs with ``launch=True`` (what an engine
  without graphs runs, host mirrors included); host µs is the fixture's timing of that call.
* ``replay``: :meth:`GraphRunner.run` of a typed runner — host checks, the builders' describing
  call for ``B`` (host mirrors), one copy-pad launch for up to four static inputs, one graph replay; host
  µs is the fixture's timing of ``run``.

Both record ``device_us``, the device time of the stage's kernels (graph replay of the eager
build, ``bench.harness.graph_us``), and ``latency_us``, CUDA events from before the call to the
end of its device work on an idle GPU (host launch gaps included: what a step waits for).
"""

from __future__ import annotations

import functools
import statistics

import pytest
import torch

from bench.harness import graph_us, record
from examples.draft_loop import Metadata, build_runners
from specmeta import SpecConfig
from specmeta.runners import StageBatch
from specmeta.workloads import make_batch, random_tree_mask

BUCKETS = (1, 8, 64, 256)
CONFIGS = [(1, 3, 4, 1), (4, 5, 16, 16), (8, 4, 32, 1)]  # (K, S, N, ps)
CTX = 4096


def _latency_us(fn, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times)


class StageSetup:
    """The three runners of :mod:`examples.draft_loop`, captured once per config, an eager
    twin on its own buffers, and a batch of ``max(BUCKETS)`` requests whose first ``B`` form
    the batch of ``B``."""

    def __init__(self, k, s, n, ps):
        self.cfg = cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps,
                                    max_bs=max(BUCKETS), max_context_len=CTX)  # fmt: skip
        self.gen = g = torch.Generator().manual_seed(1000 * k + 10 * ps + s)
        bs = max(BUCKETS)
        batch = make_batch("random", batch_size=bs, topk=k, num_steps=s, page_size=ps,
                           row_width=cfg.req_to_token_width, generator=g, device="cuda",
                           num_rows=bs + 3, max_len=CTX)  # fmt: skip
        self.batch = batch
        self.eager = Metadata(cfg, "cuda", batch.req_to_token)
        self.meta = Metadata(cfg, "cuda", batch.req_to_token)
        self.runners = build_runners(self.meta, BUCKETS, "cuda", pool_size=batch.pool_size)

    def inputs(self, stage: str, B: int):
        """``(raw, host_inputs)`` of ``B`` requests for ``stage``."""
        batch, g = self.batch, self.gen
        s, n = self.cfg.num_steps, self.cfg.num_draft_tokens
        rpi, lens = batch.req_pool_indices[:B].contiguous(), batch.seq_lens[:B].contiguous()
        host = {"seq_lens": batch.seq_lens_cpu[:B].contiguous()}
        if stage == "draft":
            return {"req_pool_indices": rpi, "seq_lens": lens}, host
        if stage == "verify":
            mask = random_tree_mask(B, self.cfg.topk, s, n, g).to(lens.device)
            return {"req_pool_indices": rpi, "seq_lens": lens, "tree_mask": mask}, host
        window = torch.randperm(batch.pool_size - 1, generator=g)[: B * n] + 1
        acc = torch.randint(1, s + 2, (B,), generator=g)
        index = torch.full((B, s + 1), -1, dtype=torch.int32)
        for i, a in enumerate(acc.tolist()):
            index[i, :a] = i * n + torch.arange(a, dtype=torch.int32)  # a root chain of the tree
        raw = {"accept_index": index.cuda(), "accept_lens": acc.int().cuda(),
               "verify_out_cache_loc": window.cuda()}  # fmt: skip
        return raw, None


@functools.lru_cache(maxsize=1)
def _setup(k, s, n, ps) -> StageSetup:
    return StageSetup(k, s, n, ps)


@pytest.mark.parametrize("mode", ["eager", "replay"])
@pytest.mark.parametrize("B", BUCKETS)
@pytest.mark.parametrize("stage", ["draft", "verify", "accept"])
@pytest.mark.parametrize("k,s,n,ps", CONFIGS, ids=lambda v: str(v))
def bench_runner(benchmark, k, s, n, ps, stage, B, mode):
    st = _setup(k, s, n, ps)
    raw, host = st.inputs(stage, B)
    runner = st.runners[stage]
    build = getattr(st.eager, stage)

    def eager():
        # What an engine without graphs runs: the stage's launches and the host mirrors.
        return build(StageBatch(raw, host or {}, True))

    def replay():
        return runner.run(B, raw, host_inputs=host, copy=False).results

    # Correctness first: the replay's per-request results equal the eager stage's (list
    # buffers are compared through their offsets in the tests).
    want, got = eager(), replay()
    names = {"draft": ("out_cache_loc", "positions"), "accept": ("tgt", "src")}.get(stage, ())
    for name in names:
        assert torch.equal(got[name], want[name]), name
    if stage != "accept":
        g = got["fa3"][0] if stage == "draft" else got["fa3"]
        w = want["fa3"][0] if stage == "draft" else want["fa3"]
        assert torch.equal(g.normal.page_table, w.normal.page_table)
        assert torch.equal(g.normal.cache_seqlens, w.normal.cache_seqlens)
    assert int(st.meta.status) == 0 and int(st.eager.status) == 0

    fn = eager if mode == "eager" else replay
    # Device time of the stage's launches: captured without host values (the builders' mirror
    # rings wait on events, which a capture cannot).
    device_us = graph_us(lambda: build(StageBatch(raw, {}, True)))
    latency_us = _latency_us(fn)
    torch.cuda.synchronize()
    benchmark.pedantic(fn, setup=torch.cuda.synchronize, rounds=50, warmup_rounds=3)
    record(benchmark, device_us=device_us, latency_us=round(latency_us, 2), mode=mode,
           stage=stage, bs=B, topk=k, steps=s, draft_tokens=n, page_size=ps, ctx=CTX,
           seq_lens_sum=st.batch.seq_lens_sum)  # fmt: skip


class OneBackendStage:
    """The draft stage of an engine on one backend, as a typed runner's build: draft slots and
    FA3's draft decode, or FlashInfer's draft-decode lists. ``host=True`` registers
    ``seq_lens``'s CPU mirror (FA3: exact ``max_seqlen_k`` and checked lengths; FlashInfer:
    checked lengths and the ``plan()`` mirrors, written before every replay), ``host=False``
    runs on the planned bounds."""

    def __init__(self, host: bool, backend: str = "fa3"):
        from specmeta import allocate_buffers
        from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
        from specmeta.metadata.fa3 import FA3MetadataBuilder
        from specmeta.metadata.flashinfer import FlashInferBuilder
        from specmeta.runners import GraphRunner, padding

        k, s, n, ps = 4, 5, 16, 16
        self.cfg = cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps,
                                    max_bs=max(BUCKETS), max_context_len=CTX)  # fmt: skip
        g = torch.Generator().manual_seed(7)
        self.batch = make_batch("random", batch_size=max(BUCKETS), topk=k, num_steps=s,
                                page_size=ps, row_width=cfg.req_to_token_width, generator=g,
                                device="cuda", max_len=CTX)  # fmt: skip
        builder = FA3MetadataBuilder if backend == "fa3" else FlashInferBuilder
        self.builder = builder(cfg, "cuda", modes=("draft_decode",))
        self.bufs = allocate_buffers(cfg, "cuda")
        r2t, assign = self.batch.req_to_token, assign_draft_cache_locs

        def build(batch):
            rpi, lens = batch.inputs["req_pool_indices"], batch.inputs["seq_lens"]
            host = batch.host.get("seq_lens")
            if backend == "flashinfer":
                return self.builder.draft_decode(rpi, r2t, lens, launch=batch.launch,
                                                 seq_lens_cpu=host)  # fmt: skip
            slots = self.bufs["draft.out_cache_loc"][: rpi.shape[0] * k * s]
            if batch.launch:
                assign(rpi, r2t, lens, topk=k, num_steps=s, page_size=ps, out_cache_loc=slots,
                       status=self.builder.status)  # fmt: skip
            return self.builder.draft_decode(rpi, r2t, lens, slots, launch=batch.launch,
                                             seq_lens_cpu=host)  # fmt: skip

        self.build = build
        self.runner = GraphRunner(build, batch_sizes=BUCKETS, device="cuda", typed=True)
        self.runner.add_input("req_pool_indices", self.bufs["runner.req_pool_indices"],
                              pad=padding.SINK_ROW)  # fmt: skip
        self.runner.add_input("seq_lens", self.bufs["runner.seq_lens"],
                              pad=padding.seq_lens_fill(k, n), host_mirror=host)  # fmt: skip
        self.runner.add_guard("req_to_token", r2t)
        self.runner.capture()
        self.host = host


@functools.lru_cache(maxsize=4)
def _one_backend(host: bool, backend: str) -> OneBackendStage:
    return OneBackendStage(host, backend)


@pytest.mark.parametrize("mode", ["run", "persistent"])
@pytest.mark.parametrize("B", BUCKETS)
@pytest.mark.parametrize("host", [False, True], ids=["no_host_inputs", "seq_lens_cpu"])
@pytest.mark.parametrize("backend", ["fa3", "flashinfer"])
def bench_runner_one_backend(benchmark, backend, host, B, mode):
    """``GraphRunner.run`` with the engine's own tensors (one pad-and-copy launch, then the
    replay) and :meth:`GraphRunner.replay` of a persistent batch (the engine wrote the static
    buffers), against the targets ``floor_graph + floor_run + 5`` and ``floor_graph + 3``."""
    from bench.harness import paired_host_us

    st = _one_backend(host, backend)
    batch, runner = st.batch, st.runner
    raw = {"req_pool_indices": batch.req_pool_indices[:B].contiguous(),
           "seq_lens": batch.seq_lens[:B].contiguous()}  # fmt: skip
    host_inputs = {"seq_lens": batch.seq_lens_cpu[:B].contiguous()} if host else None
    if mode == "run":

        def fn():
            return runner.run(B, raw, host_inputs=host_inputs, copy=False)
    else:
        for name, view in runner.static_inputs(B).items():
            view.copy_(raw[name])

        def fn():
            return runner.replay(B, host_inputs=host_inputs)

    eager = st.build  # the stage itself, for the device time of its launches
    want = eager(StageBatch(raw, host_inputs or {}, True))
    got = fn().results
    for s in range(len(want)):
        if backend == "fa3":
            assert torch.equal(got[s].normal.page_table, want[s].normal.page_table)
            assert torch.equal(got[s].expand.cache_seqlens, want[s].expand.cache_seqlens)
            assert got[s].normal.max_seqlen_k == want[s].normal.max_seqlen_k
        else:
            assert torch.equal(got[s].kv_indptr, want[s].kv_indptr)
            if host:
                assert torch.equal(got[s].kv_indptr_host, want[s].kv_indptr_host)
    device_us = graph_us(lambda: eager(StageBatch(raw, {}, True)))
    benchmark.pedantic(fn, rounds=30, iterations=200, warmup_rounds=2)
    paired = paired_host_us(fn)  # the call and its floors in alternating rounds
    budget = paired["floor_graph"] + (paired["floor_run"] + 5 if mode == "run" else 3)
    # Rounds of 200 calls measure the device, not the host, once a call's device work exceeds
    # its host time and anything bounds how far the host may run ahead (FlashInfer's mirror
    # ring: mirror_depth // 2 builds). So every row is also timed in rounds of 8 calls that
    # start on an idle device, each with its floors: the host cost of a call the device does
    # not pace (an engine's draft loop waits on its device every few builds).
    drained = paired_host_us(fn, rounds=100, calls=8)
    drained_budget = drained["floor_graph"] + (drained["floor_run"] + 5 if mode == "run" else 3)
    record(benchmark, device_us=device_us, mode=mode, bs=B, host_inputs=host, backend=backend,
           target_us=round(budget, 1), met=paired["host_paired_us"] <= budget,
           drained_us=drained["host_paired_us"], drained_target_us=round(drained_budget, 1),
           drained_floor_run=drained["floor_run"], drained_floor_graph=drained["floor_graph"],
           drained_met=drained["host_paired_us"] <= drained_budget,
           **paired)  # fmt: skip
    assert int(st.builder.status) == 0
