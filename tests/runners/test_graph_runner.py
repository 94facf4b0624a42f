"""The graph runner (design §4): declared padding, bucket choice, poisoned tails, layout checks,
probes on inputs, and the copy-pad op. The runner's stage binds free launchers (``bind_<op>``)
to the views it is given; the caller cuts the outputs to ``B``. On CPU it runs the same path
without capture; on CUDA the same tests capture and replay graphs, and the GPU tier adds
no-sync and no-recompile."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from specmeta import SpecConfig, Stage, Status, allocate_buffers, probes
from specmeta.config import draft_decode_kv_indices_need
from specmeta.kernels.draft_cache_locs import (
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
)
from specmeta.kernels.draft_decode_kv_indices import bind_draft_decode_kv_indices
from specmeta.metadata.inputs import host_lengths
from specmeta.runners import padding
from specmeta.runners.graph_runner import GraphRunner
from specmeta.runners.padding import copy_pad, copy_pad_many, copy_pad_ref
from specmeta.workloads import make_batch
from tests._support import compiled_variants, no_host_sync
from tests.guard_bands import POISON, assert_equal

BUCKETS = (1, 4, 16, 32)
SEQUENCE = (32, 12, 3, 1, 0, 32)  # the batch sequence, B = 0 included
GARBAGE = 5  # a valid row id, length and slot: a missed pad gives wrong-but-plausible rows
ROWS = 40  # req_to_token rows (fixed: the runner's build reads one persistent table)


class DraftMetadata:
    """The draft-decode metadata of free launchers, bound into planned buffers: the stage's
    host part checks ``seq_lens_cpu`` (the library's host check) and returns every output cut
    to the batch, and ``ΣL``."""

    OUTPUTS = {
        # name: (per_request, extra, dim); per_request None: read up to the offsets' end
        "out_cache_loc": lambda c: (c.topk * c.num_steps, 0, 0),
        "positions": lambda c: (c.topk, 0, 0),
        "prefix_tail_tgt": lambda c: ((c.topk - 1) * (c.page_size - 1) if c.layout_b else 0, 0, 0),
        "prefix_tail_src": lambda c: ((c.topk - 1) * (c.page_size - 1) if c.layout_b else 0, 0, 0),
        "kv_indptr": lambda c: (c.topk, 1, 1),
        "kv_indices": lambda c: (None, 0, 0),
    }
    BUFFERS = {
        "out_cache_loc": "draft.out_cache_loc",
        "positions": "draft.positions",
        "prefix_tail_tgt": "draft.prefix_tail_tgt",
        "prefix_tail_src": "draft.prefix_tail_src",
        "kv_indptr": "draft_decode.kv_indptr",
        "kv_indices": "draft_decode.kv_indices",
    }

    def __init__(self, cfg: SpecConfig, device, req_to_token: torch.Tensor):
        self.cfg = cfg
        self.bufs = allocate_buffers(cfg, device)
        self.req_to_token = req_to_token

    def outputs(self, B: int) -> dict[str, torch.Tensor]:
        """Every output for ``B`` requests: the caller's cut of the planned buffers."""
        out = {}
        for name, rule in self.OUTPUTS.items():
            per, extra, dim = rule(self.cfg)
            buf = self.bufs[self.BUFFERS[name]]
            out[name] = buf if per is None else buf.narrow(dim, 0, B * per + extra)
        return out

    def stage(self, inp) -> Stage:
        c, b = self.cfg, self.bufs
        args = (inp["req_pool_indices"], self.req_to_token, inp["seq_lens"])
        kw = dict(topk=c.topk, num_steps=c.num_steps, page_size=c.page_size, status=b["status"])
        B = args[0].shape[0]
        outputs = self.outputs(B)

        def host(seq_lens_cpu):
            found = host_lengths("draft stage", c, B, seq_lens_cpu)
            return {**outputs, "seq_lens_sum": None if found is None else found[1]}

        return Stage([
            bind_assign_draft_cache_locs(*args, out_cache_loc=b["draft.out_cache_loc"],
                                         positions=b["draft.positions"], **kw),
            bind_prefix_tail_copy_pairs(*args, tgt=b["draft.prefix_tail_tgt"],
                                        src=b["draft.prefix_tail_src"], **kw),
            bind_draft_decode_kv_indices(*args, kv_indices=b["draft_decode.kv_indices"],
                                         kv_indptr=b["draft_decode.kv_indptr"], **kw),
        ], host=host)  # fmt: skip

    def build(self, raw, seq_lens_cpu):
        """The eager build: the stage bound to the raw batch and called at once."""
        return self.stage(raw)(seq_lens_cpu)


def _config(k, s, ps, max_bs=32):
    return SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(s + 1, 1 + k), page_size=ps,
                      max_bs=max_bs, max_context_len=3 * ps + 5)  # fmt: skip


def _runner(cfg, device, req_to_token, fill, buckets=BUCKETS, wrap=None):
    """The draft-metadata runner; ``wrap(stage)``, when given, is the stage function it binds."""
    meta = DraftMetadata(cfg, device, req_to_token)
    stage = meta.stage if wrap is None else wrap(meta.stage)
    runner = GraphRunner(stage, batch_sizes=buckets, device=device)
    rows = req_to_token.shape[0]
    runner.add_input("req_pool_indices", meta.bufs["runner.req_pool_indices"],
                     pad=padding.SINK_ROW,
                     probe=functools.partial(probes.detect_oob, lo=0, hi=rows))  # fmt: skip
    runner.add_input("seq_lens", meta.bufs["runner.seq_lens"], pad=fill, host_mirror=True)
    return runner, meta


def _draw(shape, B, cfg, gen, device, rows=ROWS):
    return make_batch(shape, batch_size=B, topk=cfg.topk, num_steps=cfg.num_steps,
                      page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                      device=device, num_rows=rows, max_len=cfg.max_context_len)  # fmt: skip


def _raw(batch):
    return {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}


def _compare(got, eager, cfg, B, seq_lens_sum):
    K, S = cfg.topk, cfg.num_steps
    for name in ("out_cache_loc", "positions", "prefix_tail_tgt", "prefix_tail_src", "kv_indptr"):
        assert_equal(got[name], eager[name], f"{name} (B={B})")
    for s in range(S):
        used = draft_decode_kv_indices_need(seq_lens_sum, B, K, s + 1)
        assert_equal(got["kv_indices"][s, :used], eager["kv_indices"][s, :used],
                     f"kv_indices[{s}] (B={B})")  # fmt: skip
    assert got["seq_lens_sum"] == eager["seq_lens_sum"] == seq_lens_sum, "the batch's own ΣL"


def _check_padded_rows(meta, cfg, B, bp, fill, raw_sum):
    """design §4 read directly: every padded request is a complete request on the sink."""
    K, S, b = cfg.topk, cfg.num_steps, meta.bufs
    assert b["runner.req_pool_indices"][B:bp].eq(0).all()
    assert b["runner.seq_lens"][B:bp].eq(fill).all()
    assert b["draft.out_cache_loc"][B * K * S : bp * K * S].eq(0).all(), "padded slots: the sink"
    assert b["draft.positions"][B * K : bp * K].eq(fill).all()
    w = (K - 1) * (cfg.page_size - 1) if cfg.layout_b else 0
    assert b["draft.prefix_tail_tgt"][B * w : bp * w].eq(0).all()
    assert b["draft.prefix_tail_src"][B * w : bp * w].eq(0).all()
    ptr, idx = b["draft_decode.kv_indptr"], b["draft_decode.kv_indices"]
    for s in range(S):
        row = ptr[s, : bp * K + 1].long()
        lengths = row[1:] - row[:-1]
        assert lengths[B * K :].eq(fill + s + 1).all(), "padded branch: fill prefix + own chain"
        assert int(row[-1]) == K * (raw_sum + (bp - B) * fill) + bp * K * (s + 1)
        assert idx[s, int(row[B * K]) : int(row[-1])].eq(0).all(), "padded lists: the sink"


def _poison_tails(runner, meta, B, bp):
    for spec in runner.inputs.values():
        spec.buffer[B * spec.per_request : bp * spec.per_request] = GARBAGE
    for name in DraftMetadata.BUFFERS.values():
        meta.bufs[name].fill_(POISON)


# --------------------------------------------------------------------------------------------
# The batch sequence with poisoned tails
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (1, 2, 1)])
def test_batch_sequence_with_poisoned_tails(device, gen, k, s, ps):
    cfg = _config(k, s, ps)
    fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
    first = _draw("random", 32, cfg, gen, device)
    r2t = first.req_to_token.clone()  # the engine's persistent table, read by the graphs
    runner, meta = _runner(cfg, device, r2t, fill)
    eager = DraftMetadata(cfg, device, r2t)  # the same stage on the raw, unpadded inputs
    runner.capture()
    shapes = ("random", "long_short", "modm1", "one", "empty", "max")
    for B, shape in zip(SEQUENCE, shapes, strict=True):
        batch = first if B == 32 and shape == "random" else _draw(shape, B, cfg, gen, device)
        r2t.copy_(batch.req_to_token)
        bp = runner.bucket(B)
        assert bp == min(x for x in BUCKETS if x >= B)
        _poison_tails(runner, meta, B, bp)
        res = runner.run(B, _raw(batch), host_inputs={"seq_lens": batch.seq_lens_cpu})
        assert (res.batch_size, res.padded_batch_size) == (B, bp)
        _compare(res.results, eager.build(_raw(batch), batch.seq_lens_cpu), cfg, B,
                 batch.seq_lens_sum)  # fmt: skip
        _check_padded_rows(meta, cfg, B, bp, fill, batch.seq_lens_sum)
        assert int(meta.bufs["status"]) == 0, "a padded request was masked somewhere"
        assert int(eager.bufs["status"]) == 0


def test_results_are_views_the_next_run_overwrites(device, gen):
    """A run's results view the runner's buffers (the builders' own, or planned ones): the next
    run rewrites them; nothing is copied."""
    cfg = _config(2, 2, 1)
    a = _draw("random", 4, cfg, gen, device)
    runner, meta = _runner(cfg, device, a.req_to_token, 3)
    runner.capture()
    # The same requests one token shorter (or longer, from 0): other draft slots.
    b_lens = torch.where(a.seq_lens_cpu > 0, a.seq_lens_cpu - 1, 1)

    def run(lens_cpu):
        raw = {"req_pool_indices": a.req_pool_indices, "seq_lens": lens_cpu.to(device)}
        return runner.run(4, raw, host_inputs={"seq_lens": lens_cpu})

    view = run(a.seq_lens_cpu).results["out_cache_loc"]
    assert view.data_ptr() == meta.bufs["draft.out_cache_loc"].data_ptr()
    before = view.clone()
    run(b_lens)
    assert not torch.equal(view, before), "a result follows the next run"


def test_stage_function_must_return_a_stage(device):
    buf = torch.zeros(8, dtype=torch.int64, device=device)
    runner = GraphRunner(lambda inp: {"x": inp["a"]}, batch_sizes=[4], device=device)
    runner.add_input("a", buf, pad=0)
    with pytest.raises(TypeError, match="must return a specmeta.Stage"):
        runner.capture()
    with pytest.raises(TypeError, match="stage must be callable"):
        GraphRunner(None, batch_sizes=[4], device=device)


# --------------------------------------------------------------------------------------------
# Registration: no buffer without a pad value
# --------------------------------------------------------------------------------------------
def test_a_buffer_cannot_be_registered_without_a_pad(device):
    runner = GraphRunner(lambda inp: {}, batch_sizes=[2, 8], device=device)
    buf = torch.zeros(8, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="pad"):
        runner.add_input("seq_lens", buf)  # keyword-only, no default
    with pytest.raises(TypeError, match="pad value .* is required"):
        runner.add_input("seq_lens", buf, pad=None)
    with pytest.raises(TypeError, match="does not fit"):
        runner.add_input("seq_lens", buf, pad=0.5)
    with pytest.raises(ValueError, match="outside the range"):
        runner.add_input("x", torch.zeros(8, dtype=torch.int8, device=device), pad=300)
    with pytest.raises(ValueError, match="need 16 rows"):
        runner.add_input("out_cache_loc", buf, pad=0, per_request=2)
    with pytest.raises(ValueError, match="contiguous"):
        runner.add_input("x", torch.zeros(8, 2, device=device).t(), pad=0)
    with pytest.raises(ValueError, match="must be on"):
        runner.add_input("x", torch.zeros(8, device="meta"), pad=0)
    runner.add_input("seq_lens", buf, pad=1)
    with pytest.raises(ValueError, match="already registered"):
        runner.add_input("seq_lens", buf, pad=1)
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphRunner(lambda inp: {}, batch_sizes=[], device=device)
    with pytest.raises(ValueError, match=">= 1"):
        GraphRunner(lambda inp: {}, batch_sizes=[0, 4], device=device)


def test_bucket_is_the_smallest_captured_size_at_least_b(device):
    runner = GraphRunner(lambda inp: {}, batch_sizes=[8, 1, 4, 4], device=device)
    assert runner.batch_sizes == (1, 4, 8)
    assert [runner.bucket(b) for b in range(9)] == [1, 1, 4, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest captured bucket 8"):
        runner.bucket(9)
    with pytest.raises(ValueError, match="batch_size"):
        runner.bucket(-1)


# --------------------------------------------------------------------------------------------
# Mismatched layouts are refused on the host, before any device work
# --------------------------------------------------------------------------------------------
def test_mismatched_layout_cannot_be_replayed(device, gen):
    cfg = _config(2, 2, 4)
    batch = _draw("random", 3, cfg, gen, device)
    runner, meta = _runner(cfg, device, batch.req_to_token, 3)
    good = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
    host = {"seq_lens": batch.seq_lens_cpu}
    with pytest.raises(ValueError, match="capture"):
        runner.run(3, good, host_inputs=host)
    runner.capture()
    meta.bufs["runner.seq_lens"].fill_(-9)
    before = meta.bufs["runner.seq_lens"].clone()
    bad_cases = [
        (TypeError, "must be int64", 3, {**good, "seq_lens": batch.seq_lens.int()}, host),
        (ValueError, r"must have shape \(4,\)", 4, good, {"seq_lens": torch.ones(4)}),
        (ValueError, r"must have shape \(3,\)", 3, {**good, "seq_lens": batch.seq_lens[:2]}, host),
        (ValueError, "missing", 3, {"seq_lens": batch.seq_lens}, host),
        (ValueError, "unexpected", 3, {**good, "positions": batch.seq_lens}, host),
        (ValueError, "host_inputs: missing", 3, good, {}),
        (ValueError, "exceeds the largest", 33, good, host),
    ]
    for exc, match, B, inputs, host_inputs in bad_cases:
        with pytest.raises(exc, match=match):
            runner.run(B, inputs, host_inputs=host_inputs)
    assert torch.equal(meta.bufs["runner.seq_lens"], before), "nothing ran before the check"
    with pytest.raises(ValueError, match="captured"):
        runner.add_input("late", torch.zeros(64, device=device), pad=0)
    # A static buffer that changed storage after capture no longer matches the graphs.
    meta.bufs["runner.seq_lens"].set_(torch.zeros(64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="seq_lens changed address, shape or strides"):
        runner.run(3, good, host_inputs=host)


def test_guarded_tensors_beyond_the_inputs_stop_a_stale_replay(device, gen):
    """``req_to_token`` and a KV pool are read by the graphs but are not inputs: reallocated or
    reshaped after capture, a run raises before anything is written."""
    cfg = _config(2, 2, 4)
    batch = _draw("random", 3, cfg, gen, device)
    engine = {"req_to_token": batch.req_to_token.clone()}
    pool = torch.zeros(64, 2, device=device)
    runner, meta = _runner(cfg, device, engine["req_to_token"], 3)
    runner.add_guard("req_to_token", lambda: engine["req_to_token"])
    runner.add_guard("kv_pool", pool)
    with pytest.raises(TypeError, match="a function returning it"):
        runner.add_guard("x", 3)
    with pytest.raises(ValueError, match="already registered"):
        runner.add_guard("kv_pool", pool)
    runner.capture()
    good = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens}
    host = {"seq_lens": batch.seq_lens_cpu}
    runner.run(3, good, host_inputs=host)  # unchanged: runs
    with pytest.raises(ValueError, match="captured"):
        runner.add_guard("late", pool)
    engine["req_to_token"] = engine["req_to_token"].clone()  # the engine reallocated it
    meta.bufs["runner.seq_lens"].fill_(-9)
    with pytest.raises(ValueError, match="guarded tensor req_to_token changed"):
        runner.run(3, good, host_inputs=host)
    assert (meta.bufs["runner.seq_lens"] == -9).all(), "nothing ran before the check"
    pool.resize_(32, 2)  # reshaped in place
    with pytest.raises(ValueError, match="guarded tensor req_to_token, guarded tensor kv_pool "
                       "changed"):  # fmt: skip
        runner.run(3, good, host_inputs=host)


def test_host_part_refuses_a_length_before_anything_is_copied(device, gen):
    """The stage's host part checks ``seq_lens_cpu`` against the plan before the pad-copy and
    the launches: a length past ``max_context_len`` raises, nothing is written."""
    cfg = _config(2, 2, 4)
    batch = _draw("max", 32, cfg, gen, device)
    runner, meta = _runner(cfg, device, batch.req_to_token, 3)
    runner.capture()
    too_long = batch.seq_lens_cpu + cfg.max_context_len  # past the planned capacity
    meta.bufs["runner.seq_lens"].fill_(-9)
    meta.bufs["draft.out_cache_loc"].fill_(POISON)
    with pytest.raises(ValueError, match="max_context_len"):
        runner.run(32, {"req_pool_indices": batch.req_pool_indices,
                        "seq_lens": too_long.to(device)},
                   host_inputs={"seq_lens": too_long})  # fmt: skip
    assert meta.bufs["runner.seq_lens"].eq(-9).all(), "nothing was copied before the check"
    assert meta.bufs["draft.out_cache_loc"].eq(POISON).all(), "nothing was launched"


# --------------------------------------------------------------------------------------------
# Probes on the runner's inputs
# --------------------------------------------------------------------------------------------
def test_runner_probes_its_inputs_when_enabled(device, gen):
    cfg = _config(2, 2, 4)
    batch = _draw("random", 3, cfg, gen, device)
    runner, meta = _runner(cfg, device, batch.req_to_token, 3)
    runner.capture()
    bad_rpi = batch.req_pool_indices.clone()
    bad_rpi[1] = ROWS  # one past the last row
    inputs = {"req_pool_indices": bad_rpi, "seq_lens": batch.seq_lens}
    host = {"seq_lens": batch.seq_lens_cpu}
    previous = probes.enable(False)
    try:
        runner.run(3, inputs, host_inputs=host)  # probes off: the kernels mask it
        assert int(meta.bufs["status"]) & int(Status.ROW_OOB)
        if device.type == "cpu":
            probes.enable(True)
            meta.bufs["runner.req_pool_indices"].fill_(-9)
            with pytest.raises(ValueError, match="runner input 'req_pool_indices'.*outside"):
                runner.run(3, inputs, host_inputs=host)
            assert meta.bufs["runner.req_pool_indices"].eq(-9).all(), "raised before the copy"
    finally:
        probes.enable(previous)


# --------------------------------------------------------------------------------------------
# copy_pad
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,pad",
    [(torch.int64, 0), (torch.int32, -1), (torch.bool, True), (torch.float16, 0.0),
     (torch.bfloat16, 0), (torch.float32, 1.5), (torch.int64, 2**40), (torch.uint8, 7)],
)  # fmt: skip
@pytest.mark.parametrize("n,npad,row", [(3, 7, ()), (0, 5, (3,)), (6, 6, (2, 2)), (0, 0, ())])
def test_copy_pad_matches_reference_and_spares_the_tail(device, gen, dtype, pad, n, npad, row):
    # Guard bands in the buffer's own dtype: 99 fits every dtype here and is neither a pad nor a
    # source value; for bool the guard is the opposite of the pad.
    guard, m = (not pad) if dtype == torch.bool else 99, 3
    src = torch.randint(0, 2, (n, *row), generator=gen).to(dtype).to(device)
    storage = torch.full((m + npad + m, *row), guard, dtype=dtype, device=device)
    storage[m : m + npad] = guard if dtype == torch.bool else 55  # poison: unwritten shows
    want = storage.clone()
    copy_pad(src, storage[m : m + npad], pad)
    copy_pad_ref(src, want[m : m + npad], pad)
    assert_equal(storage, want, "copy_pad (guard bands included)")
    # design §4 read directly: [:n] the raw rows, [n:npad] the pad, the guards untouched.
    assert torch.equal(storage[m : m + n], src)
    assert storage[m + n : m + npad].eq(torch.tensor(pad).to(dtype)).all()
    assert storage[:m].eq(guard).all() and storage[m + npad :].eq(guard).all()


_MANY_DTYPES = [(torch.int64, 0), (torch.int32, -1), (torch.bool, True), (torch.float32, 1.5),
                (torch.bfloat16, 0), (torch.uint8, 7)]  # fmt: skip


@pytest.mark.parametrize("count", [1, 3, 4, 6])
def test_copy_pad_many_matches_copy_pad_ref_per_buffer(device, gen, count):
    """Buffers of mixed dtypes, sizes and row shapes (some empty, some past one block), four to
    a launch: each equals copy_pad_ref of its own triple, guard bands untouched."""
    pairs, stores, wants = [], [], []
    for i in range(count):
        dtype, pad = _MANY_DTYPES[i % len(_MANY_DTYPES)]
        row = () if i % 2 else (3,)
        npad = int(torch.randint(0, 1500, (1,), generator=gen))
        n = int(torch.randint(0, npad + 1, (1,), generator=gen))
        guard = (not pad) if dtype == torch.bool else 99
        src = torch.randint(0, 2, (n, *row), generator=gen).to(dtype).to(device)
        storage = torch.full((2 + npad + 2, *row), guard, dtype=dtype, device=device)
        want = storage.clone()
        copy_pad_ref(src, want[2 : 2 + npad], pad)
        pairs.append((src, storage[2 : 2 + npad], pad))
        stores.append(storage)
        wants.append(want)
    copy_pad_many(pairs)
    for i, (got, want) in enumerate(zip(stores, wants, strict=True)):
        assert_equal(got, want, f"buffer {i} of {count}")


def test_copy_pad_many_rejects_bad_arguments(device):
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    src = torch.ones(2, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match=r"pairs\[1\] must be a \(src, dst, pad\) tuple"):
        copy_pad_many([(src, dst, 0), (src, dst)])
    with pytest.raises(TypeError, match="src must be int64"):
        copy_pad_many([(src, dst, 0), (src.int(), dst.clone(), 0)])
    with pytest.raises(ValueError, match="dst is too small"):
        copy_pad_many([(torch.ones(5, dtype=torch.int64, device=device), dst, 0)])
    assert not dst.any(), "nothing was written"


def test_copy_pad_rejects_bad_arguments(device):
    dst = torch.zeros(4, 3, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="src must be int64"):
        copy_pad(torch.zeros(2, 3, dtype=torch.int32, device=device), dst, 0)
    with pytest.raises(ValueError, match="shape"):
        copy_pad(torch.zeros(2, 2, dtype=torch.int64, device=device), dst, 0)
    with pytest.raises(ValueError, match="need 5 rows"):
        copy_pad(torch.zeros(5, 3, dtype=torch.int64, device=device), dst, 0)
    with pytest.raises(ValueError, match="contiguous"):
        copy_pad(torch.zeros(3, 2, dtype=torch.int64, device=device).t(), dst, 0)
    with pytest.raises(TypeError, match="pad"):
        copy_pad(dst[:1], dst, None)


def test_seq_lens_fill_covers_every_query_width(device):
    assert padding.seq_lens_fill(4) == 4
    assert padding.seq_lens_fill(4, 8, 1) == 8
    with pytest.raises(ValueError):
        padding.seq_lens_fill(0)


# --------------------------------------------------------------------------------------------
# A persistent batch: the engine writes the runner's own buffers, the runner replays
# --------------------------------------------------------------------------------------------
def _persistent_replays(runner, meta, cfg, gen, device, first, r2t, sizes, shapes):
    """Each batch written into ``static_inputs(B)`` (rows ``[:B]`` only, as the contract says),
    its outputs poisoned, then :meth:`GraphRunner.replay` (on CUDA with host syncs made
    errors); yields ``(batch, result)``."""
    for i, (B, shape) in enumerate(zip(sizes, shapes, strict=True)):
        batch = first if i == 0 else _draw(shape, B, cfg, gen, device)
        r2t.copy_(batch.req_to_token)
        views = runner.static_inputs(B)
        views["req_pool_indices"].copy_(batch.req_pool_indices)
        views["seq_lens"].copy_(batch.seq_lens)
        for name in DraftMetadata.BUFFERS.values():
            meta.bufs[name].fill_(POISON)
        cuda = device == "cuda" or getattr(device, "type", None) == "cuda"
        if cuda:
            torch.cuda.synchronize()
        with no_host_sync() if cuda else contextlib.nullcontext():
            res = runner.replay(B, host_inputs={"seq_lens": batch.seq_lens_cpu})
        yield batch, res


def _check_replay(res, eager, meta, cfg, batch, bp, fill):
    """A persistent replay's result (the stage's own) against the eager build, and its padded
    requests."""
    B = batch.batch_size
    _compare(res, eager.build(_raw(batch), batch.seq_lens_cpu), cfg, B, batch.seq_lens_sum)
    _check_padded_rows(meta, cfg, B, bp, fill, batch.seq_lens_sum)
    assert int(meta.bufs["status"]) == 0, "a padded request was masked somewhere"


def _rows_past_b_hold_pads(meta, B, fill) -> bool:
    """Every row past ``B`` of both static inputs holds its pad (past the bucket too)."""
    return bool(meta.bufs["runner.req_pool_indices"][B:].eq(padding.SINK_ROW).all()) and bool(
        meta.bufs["runner.seq_lens"][B:].eq(fill).all()
    )


@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (1, 2, 1)])
def test_persistent_batch_replays_pad_only_what_a_larger_batch_left(device, gen, k, s, ps):
    cfg = _config(k, s, ps)
    fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
    first = _draw("random", 32, cfg, gen, device)
    r2t = first.req_to_token.clone()
    runner, meta = _runner(cfg, device, r2t, fill)
    eager = DraftMetadata(cfg, device, r2t)
    runner.capture()
    # Shrinking (32 → 12 → 3 …) leaves rows that must go back to their pads; growing does not.
    sizes = (32, 12, 3, 1, 0, 32, 5, 5)
    shapes = ("random", "long_short", "modm1", "one", "empty", "max", "random", "random")
    for batch, res in _persistent_replays(runner, meta, cfg, gen, device, first, r2t, sizes,
                                          shapes):  # fmt: skip
        _check_replay(res, eager, meta, cfg, batch, runner.bucket(batch.batch_size), fill)
        assert _rows_past_b_hold_pads(meta, batch.batch_size, fill), batch.batch_size


def test_persistent_batch_mark_pads_only_rows_a_larger_batch_wrote(device, gen):
    """The runner's mark (design §4): a replay below it launches one pad of rows ``[B, mark)``
    and moves it to ``B``; a replay at or above it launches no pad at all. Seen from a row past
    every bucket the batches used, written behind the runner's back: no pad launch reaches it."""
    cfg = _config(2, 3, 4)
    fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
    r2t = _draw("random", 32, cfg, gen, device).req_to_token
    runner, meta = _runner(cfg, device, r2t, fill)
    runner.capture()
    lens = meta.bufs["runner.seq_lens"]

    def replay(B):
        views = runner.static_inputs(B)
        views["req_pool_indices"].fill_(1)
        views["seq_lens"].fill_(3)
        runner.replay(B, host_inputs={"seq_lens": torch.full((B,), 3, dtype=torch.int64)})

    replay(12)  # rows [0, 12) written; [12, 32) hold their pads since capture
    lens[20] = 7  # a contract breach, past bucket 16: only a pad launch would restore it
    replay(12)
    replay(16)  # growing: rows [0, 16) are the batch's, no pad
    assert int(lens[20]) == 7, "a replay at or above the mark launched a pad"
    replay(5)  # shrinking: one pad of rows [5, 16), the rows the larger batch wrote
    assert lens[5:16].eq(fill).all() and lens[:5].eq(3).all()
    assert int(lens[20]) == 7, "the pad reached past the mark"
    replay(1)
    assert lens[1:16].eq(fill).all() and int(lens[20]) == 7
    runner.run(3, {"req_pool_indices": torch.ones(3, dtype=torch.int64, device=device),
                   "seq_lens": torch.full((3,), 3, dtype=torch.int64, device=device)},
               host_inputs={"seq_lens": torch.full((3,), 3, dtype=torch.int64)})  # fmt: skip
    assert lens[3:4].eq(fill).all(), "run pads its bucket's tail [B, Bp)"
    assert int(lens[20]) == 7


def test_persistent_batch_checks_its_host_inputs(device):
    """The host values go to the stage's host part, which checks them (the library's check
    here, as every builder's); the runner checks their names and the batch size."""
    cfg = _config(2, 3, 4)
    r2t = torch.zeros(ROWS, cfg.req_to_token_width, dtype=torch.int32, device=device)
    runner, _ = _runner(cfg, device, r2t, 2)
    runner.capture()
    with pytest.raises(ValueError, match="seq_lens_cpu has 4 entries but the batch has 3"):
        runner.replay(3, host_inputs={"seq_lens": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(
        ValueError, match=r"host_inputs: missing \['seq_lens'\], unexpected \['lens'\]"
    ):
        runner.replay(3, host_inputs={"lens": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="exceeds the largest captured bucket 32"):
        runner.replay(33, host_inputs={"seq_lens": torch.zeros(33, dtype=torch.int64)})
    with pytest.raises(ValueError, match="missing"):
        runner.replay(3)


# --------------------------------------------------------------------------------------------
# GPU tier
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k,s,ps", [(4, 5, 16), (8, 3, 1)])
def test_replays_do_not_sync_and_compile_nothing(gen, k, s, ps):
    from specmeta.kernels.draft_cache_locs import _assign_draft_cache_locs_kernel
    from specmeta.kernels.draft_decode_kv_indices import _draft_decode_kv_indices_kernel
    from specmeta.runners.padding import _copy_pad_kernel

    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=s + 1, page_size=ps, max_bs=256,
                     max_context_len=2048)  # fmt: skip
    rows = 300
    r2t = _draw("random", 256, cfg, gen, "cuda", rows).req_to_token
    runner, meta = _runner(cfg, "cuda", r2t, cfg.topk, buckets=(1, 8, 64, 256))
    runner.capture()
    assert runner.graphs and runner.pool is not None
    kernels = (_assign_draft_cache_locs_kernel, _draft_decode_kv_indices_kernel, _copy_pad_kernel)
    batches = [_draw(sh, b, cfg, gen, "cuda", rows) for sh, b in
               (("random", 200), ("long_short", 33), ("modm1", 7), ("one", 1), ("empty", 0))]  # fmt: skip
    compiled = [compiled_variants(f) for f in kernels]
    torch.cuda.synchronize()
    with no_host_sync():
        for batch in batches:
            r2t.copy_(batch.req_to_token)
            runner.run(batch.batch_size, {"req_pool_indices": batch.req_pool_indices,
                                          "seq_lens": batch.seq_lens},
                       host_inputs={"seq_lens": batch.seq_lens_cpu})  # fmt: skip
    torch.cuda.synchronize()
    assert [compiled_variants(f) for f in kernels] == compiled, "a replay compiled a kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (1, 2, 1)])
def test_gpu_repeated_runs_and_persistent_replays_equal_eager_without_sync(gen, k, s, ps):
    """Runs that repeat an earlier run's tensors (an engine's persistent tensors, new device
    values) and batch sizes met before: results equal the eager build every time, the padded
    rows hold their pads, no host sync; a persistent batch the same."""
    cfg = _config(k, s, ps)
    fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
    first = _draw("random", 32, cfg, gen, "cuda")
    r2t = first.req_to_token.clone()
    runner, meta = _runner(cfg, "cuda", r2t, fill)
    eager = DraftMetadata(cfg, "cuda", r2t)
    runner.capture()
    rpi = torch.zeros(32, dtype=torch.int64, device="cuda")
    lens = torch.zeros(32, dtype=torch.int64, device="cuda")
    lens_cpu = torch.zeros(32, dtype=torch.int64)
    for round_ in range(6):
        B = (12, 12, 3, 12, 3, 3)[round_]
        batch = _draw("random", B, cfg, gen, "cuda")
        r2t.copy_(batch.req_to_token)
        rpi[:B].copy_(batch.req_pool_indices)
        lens[:B].copy_(batch.seq_lens)
        lens_cpu[:B].copy_(batch.seq_lens_cpu)
        bp = runner.bucket(B)
        _poison_tails(runner, meta, B, bp)
        torch.cuda.synchronize()
        with no_host_sync():
            res = runner.run(B, {"req_pool_indices": rpi[:B], "seq_lens": lens[:B]},
                             host_inputs={"seq_lens": lens_cpu[:B]})  # fmt: skip
        _compare(res.results, eager.build(_raw(batch), batch.seq_lens_cpu), cfg, B,
                 batch.seq_lens_sum)  # fmt: skip
        _check_padded_rows(meta, cfg, B, bp, fill, batch.seq_lens_sum)
        assert int(meta.bufs["status"]) == 0, round_
    sizes, shapes = (32, 32, 12, 12, 3, 3, 32, 1), ("random",) * 7 + ("one",)
    for batch, res in _persistent_replays(runner, meta, cfg, gen, "cuda", first, r2t, sizes,
                                          shapes):  # fmt: skip
        _check_replay(res, eager, meta, cfg, batch, runner.bucket(batch.batch_size), fill)
        assert _rows_past_b_hold_pads(meta, batch.batch_size, fill), batch.batch_size


def test_collector_off_turns_the_collector_off_and_back_as_it_was():
    import gc

    from specmeta.runners import collector_off

    was = gc.isenabled()
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            with collector_off():
                assert not gc.isenabled()
            assert gc.isenabled() is start
            with pytest.raises(RuntimeError, match="inside"), collector_off():
                raise RuntimeError("inside")
            assert gc.isenabled() is start, "an exception left the collector changed"
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.gpu
def test_capture_survives_a_dead_graph_that_a_collection_would_destroy(gen):
    """An engine's old runner, dead in a reference cycle, still owns captured graphs; the
    collector destroys them whenever it next runs, and a graph destroyed during a capture
    invalidates that capture. The build below makes such a cycle inside the capture and then
    allocates past a collection threshold of 1, so a capture that left the collector on
    fails; the runner's captures survive, and the old graph is destroyed after them."""
    import gc
    import weakref

    cfg = _config(2, 3, 4)
    fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
    batch = _draw("random", 12, cfg, gen, "cuda")
    r2t = batch.req_to_token.clone()
    eager = DraftMetadata(cfg, "cuda", r2t)
    x = torch.zeros(1, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.add_(1)
    doomed, dead = [old], weakref.ref(old)
    del old
    made_in_capture = []

    def wrap(stage_fn):
        def with_a_cycle(inp):
            stage = stage_fn(inp)

            def making_a_cycle():  # a launch of the stage: it runs inside the capture
                if doomed and torch.cuda.is_current_stream_capturing():
                    cycle = [doomed.pop()]
                    cycle.append(cycle)
                    del cycle
                    made_in_capture.append([[] for _ in range(1000)])  # a collection's trigger

            return Stage([making_a_cycle, stage], host=stage.host)

        return with_a_cycle

    runner, meta = _runner(cfg, "cuda", r2t, fill, wrap=wrap)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        runner.capture()
    finally:
        gc.set_threshold(*thresholds)
    assert made_in_capture and not doomed, "the cycle was not made inside a capture"
    assert gc.isenabled(), "capture() left the collector off"
    gc.collect()
    assert dead() is None, "the old graph outlived a collection after the capture"
    res = runner.run(12, _raw(batch), host_inputs={"seq_lens": batch.seq_lens_cpu})
    _compare(res.results, eager.build(_raw(batch), batch.seq_lens_cpu), cfg, 12,
             batch.seq_lens_sum)  # fmt: skip
    assert int(meta.bufs["status"]) == 0
