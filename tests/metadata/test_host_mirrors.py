"""HostMirrorRing: sets handed out in turn, a set never handed out twice in a row, bad depths
rejected, the turn's events checked against a simulated stream (the wait on a real device is
the GPU tier's test), and every FlashInfer mode's bound stage writing its mirrors round the
ring."""

from __future__ import annotations

import random

import pytest
import torch

from specmeta import SpecConfig
from specmeta.config import BufferSpec
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.host_mirrors import HostMirrorRing
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import assert_equal


def test_sets_rotate_and_are_distinct(device):
    spec = {"a": BufferSpec((4,), torch.int32, "a"), "b": BufferSpec((2, 3), torch.int32, "b")}
    ring = HostMirrorRing(spec, 3, device)
    sets = [ring.next() for _ in range(6)]
    ptrs = [s["a"].data_ptr() for s in sets]
    assert len(set(ptrs[:3])) == 3 and ptrs[3:] == ptrs[:3]
    assert all(s["b"].shape == (2, 3) and s["a"].device.type == "cpu" for s in sets)
    assert sets[0]["a"].is_pinned() == (device.type == "cuda")


def test_the_turn_hands_out_the_sets_in_order(device):
    ring = HostMirrorRing({"a": BufferSpec((2,), torch.int32, "a")}, 5, device)
    assert ring.slot is None and ring.builds == 0
    taken = [(ring.take(), ring.slot) for _ in range(12)]
    assert taken == [(j % 5, j % 5) for j in range(12)] and ring.builds == 12


class _SimulatedStream:
    """A stream the host queues ``plan()`` copies on, and a device that runs them late, behind
    fake events: ``record`` marks the queue's end, ``query`` tells whether the device passed
    it, ``synchronize`` runs the device up to it."""

    def __init__(self, rng, lag):
        self.queue = []  # (build, slot) of every queued copy
        self.done = 0  # copies the device has run
        self.calls = []  # (call, event) in order
        self.rng, self.lag = rng, lag

    def device_runs(self):
        """The device runs some queued copies (none while it lags)."""
        if not self.lag:
            self.done = len(self.queue)
        elif self.rng.random() < 0.3:
            self.done = min(len(self.queue), self.done + self.rng.randrange(3))


class _FakeEvent:
    """What the ring calls of a ``torch.cuda.Event``, on a :class:`_SimulatedStream`."""

    def __init__(self, stream, name):
        self.stream, self.name, self.mark = stream, name, None

    def record(self, on):
        assert on == "the current stream", on
        self.stream.calls.append(("record", self.name))
        self.mark = len(self.stream.queue)

    def query(self):
        self.stream.calls.append(("query", self.name))
        return self.stream.done >= self.mark

    def synchronize(self):
        self.stream.calls.append(("synchronize", self.name))
        self.stream.done = max(self.stream.done, self.mark)


def _simulated_ring(depth, stream):
    """A ring whose events are fake ones on ``stream`` (a CPU ring has none of its own)."""
    ring = HostMirrorRing({"a": BufferSpec((1,), torch.int32, "a")}, depth, torch.device("cpu"))
    assert ring._events == []
    count = depth // max(1, depth // 2) + 2
    ring._events = [_FakeEvent(stream, i) for i in range(count)]
    ring._current_stream = lambda: "the current stream"
    return ring


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 8, 9, 16])
def test_the_turn_reuses_a_set_only_after_its_copy_ran(depth, lag, seed):
    """The turn on fake events: when build ``j`` takes a set, every copy queued from that set
    before has run on the (simulated) device; an event is recorded once every
    ``E = max(1, depth // 2)`` builds and queried at most as often; a device that keeps up is
    never waited for, and a lagging one only by the builds that reuse a set."""
    every = max(1, depth // 2)
    stream = _SimulatedStream(random.Random(seed), lag)
    ring = _simulated_ring(depth, stream)
    builds = 6 * depth + 7
    for j in range(builds):
        stream.device_runs()
        slot = ring.take()
        assert slot == j % depth
        pending = [b for b, s in stream.queue[stream.done :] if s == slot]
        assert not pending, f"build {j} takes set {slot} while the copies of {pending} wait"
        stream.queue.append((j, slot))  # this build's plan() copy
    assert ring.builds == builds
    kinds = [call for call, _ in stream.calls]
    assert kinds.count("record") == (builds - 1) // every
    assert kinds.count("query") == max(0, (builds - 1 - depth) // every + 1)
    if not lag:
        assert "synchronize" not in kinds
    # A wait synchronizes only on an event its query found unpassed.
    for i, (call, name) in enumerate(stream.calls):
        if call == "synchronize":
            assert stream.calls[i - 1] == ("query", name)


class _CudaLikeEvent(_FakeEvent):
    """A fake event that, as a ``torch.cuda.Event``, has nothing to wait for before it is
    first recorded: ``query()`` is True and ``synchronize()`` returns at once."""

    def query(self):
        if self.mark is None:
            self.stream.calls.append(("query", self.name))
            return True
        return super().query()

    def synchronize(self):
        if self.mark is None:
            self.stream.calls.append(("synchronize", self.name))
            return
        super().synchronize()


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 8])
def test_the_turn_waits_for_the_event_that_covers_the_sets_last_build(depth):
    """A device that runs nothing unless the host waits: every copy that has run was run by a
    wait of the ring's, so a build that takes a set whose copy is still queued shows that the
    ring waited for an event recorded too early (or for none). An event never recorded passes
    at once, as a CUDA event does. At depth 4 (``E = 2``) the calls are exactly: event ``m``
    recorded at build ``2m``; build ``j ≥ 4``, ``j`` even, waits for the event recorded at
    build ``j − 2``, the first that covers build ``j − 4``."""
    stream = _SimulatedStream(random.Random(0), True)
    ring = _simulated_ring(depth, stream)
    ring._events = [_CudaLikeEvent(stream, i) for i in range(len(ring._events))]
    for j in range(4 * depth + 3):
        slot = ring.take()
        pending = [b for b, s in stream.queue[stream.done :] if s == slot]
        assert not pending, f"depth {depth}: build {j} takes set {slot} while {pending} wait"
        stream.queue.append((j, slot))
    if depth == 4:
        assert stream.calls[:10] == [
            ("record", 1),  # build 2
            ("record", 2), ("query", 1), ("synchronize", 1),  # build 4 reuses build 0's set
            ("record", 3), ("query", 2), ("synchronize", 2),  # build 6 reuses build 2's set
            ("record", 0), ("query", 3), ("synchronize", 3),  # build 8 reuses build 4's set
        ], stream.calls[:10]  # fmt: skip


def test_a_failed_record_raises_and_takes_no_turn():
    """An event call that raises (a CUDA error) leaves the count where it was: the next call
    takes the same turn again."""

    class Failing(_FakeEvent):
        def record(self, on):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    stream = _SimulatedStream(random.Random(0), False)
    ring = _simulated_ring(2, stream)
    assert ring.take() == 0
    ring._events = [Failing(stream, i) for i in range(len(ring._events))]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ring.take()
    assert ring.builds == 1 and ring.slot == 0


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_depth_is_rejected(device, depth):
    with pytest.raises(ValueError, match="mirror_depth must be an int >= 1"):
        HostMirrorRing({}, depth, device)


def test_builder_keeps_the_last_results_mirrors_until_the_ring_comes_round(device, gen):
    """Two builds of different batches: the first result's host mirrors still hold the first
    batch (depth 2), the device values of both match their own batch."""
    cfg = SpecConfig(topk=2, num_steps=2, num_draft_tokens=4, page_size=1, max_bs=4,
                     max_context_len=40)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, mirror_depth=2)
    batches = [make_batch("random", batch_size=3, topk=2, num_steps=2, page_size=1,
                          row_width=cfg.req_to_token_width, generator=gen, device=device,
                          max_len=40) for _ in range(2)]  # fmt: skip
    results = [fi.draft_extend(b.req_pool_indices, b.req_to_token, b.seq_lens,
                               seq_lens_cpu=b.seq_lens_cpu) for b in batches]  # fmt: skip
    for b, res in zip(batches, results, strict=True):
        want = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(b.seq_lens_cpu + 4, 0)])
        assert res.kv_indptr_host.tolist() == want.tolist()
    assert results[0].kv_indptr_host.data_ptr() != results[1].kv_indptr_host.data_ptr()


def _host_mirrors(result):
    """Every per-batch host mirror of a FlashInfer result, with the device tensor it mirrors."""
    if hasattr(result, "steps"):
        pairs = []
        for step in result.steps:
            if hasattr(step, "paged_kv_indptr_host_arr"):
                pairs += zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True)
            else:
                pairs.append((step.kv_indptr_host, step.kv_indptr))
        return pairs
    pairs = [(result.kv_indptr_host, result.kv_indptr)]
    if result.mask_indptr_host is not None:
        pairs.append((result.mask_indptr_host, result.mask_indptr))
    return pairs


def test_every_mode_rewrites_its_mirrors_on_each_build_round_the_ring(device, gen):
    """Seven builds of every mode, the batch size, the lengths and draft decode's rows
    changing, so each ring set (and each batch size's views of it) is written again with new
    values: every host mirror equals the device offsets of its own build, and the previous
    build's mirrors (depth 2) still hold that build's values."""
    k, s, n = 3, 3, 5
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=1, max_bs=4,
                     max_context_len=30)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, mirror_depth=2)
    previous = {}
    for B in (3, 3, 4, 3, 0, 3, 4):
        b = make_batch("random", batch_size=B, topk=k, num_steps=s, page_size=1,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=30)  # fmt: skip
        a, lens = (b.req_pool_indices, b.req_to_token, b.seq_lens), b.seq_lens_cpu
        tree = random_tree_mask(B, k, s, n, gen).to(device)
        plain, verify = (*a, lens), (*a, tree, lens)
        builds = (  # (ring, method, arguments): the target-verify forms share one ring
            ("draft_decode", fi.draft_decode, plain, {"num_rows": s - B % 2}),
            ("shared", fi.draft_decode_shared_prefix, plain, {"num_rows": s}),
            ("verify", fi.target_verify, verify, {}),
            ("verify", fi.target_verify, verify, {"packed": True}),
            ("verify", fi.target_verify, verify, {}),  # a third: the sets shift by one
            ("extend", fi.draft_extend, plain, {}),
        )
        for ring, method, args, kw in builds:
            pairs = _host_mirrors(method(*args[:-1], seq_lens_cpu=args[-1], **kw))
            for i, (host, dev) in enumerate(pairs):
                assert_equal(host, dev, f"B={B} {ring} mirror {i}")
            for i, (host, want) in enumerate(previous.get(ring, ())):
                assert_equal(host, want, f"B={B} {ring}: the previous build's mirror {i}")
            previous[ring] = [(host, dev.cpu().clone()) for host, dev in pairs]
    assert int(fi.status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 8, 16])
def test_gpu_a_set_is_never_rewritten_while_its_copy_waits_on_the_stream(depth):
    """A host far ahead of its device: the stream is held busy, then every build writes its
    own value into the ring's next set and queues a non-blocking copy of it (what ``plan()``
    does), for three rounds of the ring. Each copy must read its own build's value: the ring
    makes the host wait, on torch's events, before it reuses a set whose copy has not run
    yet."""
    ring = HostMirrorRing({"a": BufferSpec((4096,), torch.int32, "a")}, depth,
                          torch.device("cuda"))  # fmt: skip
    builds = 3 * depth + 2
    copies = torch.full((builds, 4096), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(100e6))  # about 100 ms at 1 GHz or more: every copy queues behind
    for i in range(builds):
        host = ring.next()["a"]
        host.fill_(i)
        copies[i].copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    got = copies[:, 0].tolist()
    assert got == list(range(builds)), f"depth {depth}: build i's copy read {got}"
    assert bool((copies == copies[:, :1]).all()), "every copy whole"


_STAGE_MODES = (  # (method, keyword arguments): every mode with host mirrors
    ("draft_decode", {"num_rows": 2}),
    ("draft_decode_shared_prefix", {}),
    ("draft_decode_paged", {}),
    ("target_verify", {"tree": True}),
    ("target_verify", {"tree": True, "packed": True}),
    ("draft_extend", {}),
)


@pytest.mark.parametrize("writers", ["compiled", "torch"])
def test_a_bound_stage_writes_what_the_call_would_round_the_ring(device, gen, writers, request):
    """A mode's stage, bound once, its host part run on new lengths round a ring of depth 3,
    every other run after an eager call that takes a turn of the same ring: each run's host
    mirrors equal those of a torch builder (``host_ops=False``) given the same lengths, the
    previous run's still hold its own, and the ring's count moves by one a run. A refused
    length raises the call's message before taking a turn and leaves the previous run's
    mirrors as they were; so does a missing ``seq_lens_cpu``. With the compiled
    writers (after ``warmup()``) and the torch ones."""
    if writers == "compiled":
        request.getfixturevalue("compiled_host_ops")
    k, s, n, B = 2, 3, 4, 3
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=4, max_bs=4,
                     max_context_len=40)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, mirror_depth=3, host_ops=writers == "compiled")
    ref = FlashInferBuilder(cfg, device, mirror_depth=3, host_ops=False)
    b = make_batch("random", batch_size=B, topk=k, num_steps=s, page_size=4,
                   row_width=cfg.req_to_token_width, generator=gen, device=device,
                   extra_tokens=n, max_len=40)  # fmt: skip
    tree = random_tree_mask(B, k, s, n, gen).to(device)

    def arguments(kw):
        args = [b.req_pool_indices, b.req_to_token, b.seq_lens]
        if kw.get("tree"):
            args.append(tree)
        return args, {key: v for key, v in kw.items() if key != "tree"}

    def call(builder, mode, kw, lens):
        args, kw = arguments(kw)
        return getattr(builder, mode)(*args, seq_lens_cpu=lens, launch=False, **kw)

    def host(result):
        return [h.clone() for h, _ in _host_mirrors(result)]

    for mode, kw in _STAGE_MODES:
        where = f"{mode} {kw}"
        args, bind_kw = arguments(kw)
        stage = fi.bind(mode, *args, **bind_kw)
        ring = fi._mirrors[fi.plan_groups.get(mode, mode)]
        previous = None
        for i in range(7):
            if i % 2:
                call(fi, mode, kw, b.seq_lens_cpu)  # an eager call's turn in between
            lens = torch.randint(0, 41, (B,), generator=gen, dtype=torch.int64)
            before = ring.builds
            got = stage.host(lens)
            assert ring.builds == before + 1, f"{where}, run {i}: the ring moved"
            want = host(call(ref, mode, kw, lens))
            for j, (g, w) in enumerate(zip(host(got), want, strict=True)):
                assert_equal(g, w, f"{where}, run {i} (lengths {lens.tolist()}): mirror {j}")
            if previous is not None:
                for j, (g, w) in enumerate(zip(host(previous[0]), previous[1], strict=True)):
                    assert_equal(g, w, f"{where}, run {i}: the previous run's mirror {j}")
            previous = (got, host(got))
        bad = torch.tensor([5, 41, 2])
        with pytest.raises(ValueError) as want:
            call(fi, mode, kw, bad)
        before = ring.builds
        with pytest.raises(ValueError) as raised:
            stage.host(bad)
        assert str(raised.value) == str(want.value), where
        assert ring.builds == before, f"{where}: a refusal took a turn of the ring"
        for j, (g, w) in enumerate(zip(host(previous[0]), previous[1], strict=True)):
            assert_equal(g, w, f"{where}: after the refusal, the last run's mirror {j}")
        with pytest.raises(ValueError, match="seq_lens_cpu is None"):
            stage.host(None)
        assert ring.builds == before, f"{where}: a missing seq_lens_cpu took a turn"
