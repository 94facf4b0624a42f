"""HostMirrorRing: sets handed out in turn, a set never handed out twice in a row, bad depths
rejected, and the compiled turn's driver calls checked against a simulated stream (the wait
on a real device is the GPU tier's test)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from specmeta import SpecConfig
from specmeta.config import BufferSpec
from specmeta.metadata import host_ops
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


@pytest.mark.parametrize("compiled", [True, False])
def test_both_turns_hand_out_the_same_sets(device, compiled):
    if compiled and host_ops.compiled() is None:
        pytest.fail(f"the compiled host ops are missing here: {host_ops.unavailable()}")
    ring = HostMirrorRing({"a": BufferSpec((2,), torch.int32, "a")}, 5, device,
                          use_compiled=compiled)  # fmt: skip
    assert ring.compiled == compiled and ring.slot is None
    taken = [(ring.take(), ring.slot) for _ in range(12)]
    assert taken == [(j % 5, j % 5) for j in range(12)]


class _SimulatedStream:
    """A stream the host queues ``plan()`` copies on, and a device that runs them late, behind
    fake driver event calls: ``record`` marks the queue's end, ``query`` tells whether the
    device passed it, ``synchronize`` runs the device up to it."""

    NOT_READY = 600

    def __init__(self, count, rng, lag):
        self.queue = []  # (build, slot) of every queued copy
        self.done = 0  # copies the device has run
        self.marks = {}  # event handle -> queue length when recorded
        self.calls = []  # (call, handle) in order
        self.rng, self.lag = rng, lag
        self.events = list(range(1, count + 1))  # fake handles
        proto2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        proto1 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
        self.fns = (proto2(self.record), proto1(self.query), proto1(self.synchronize))

    def addresses(self):
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self.fns]

    def record(self, event, stream):
        assert stream == 0xBEEF, stream
        self.calls.append(("record", event))
        self.marks[event] = len(self.queue)
        return 0

    def query(self, event):
        self.calls.append(("query", event))
        return 0 if self.done >= self.marks[event] else self.NOT_READY

    def synchronize(self, event):
        self.calls.append(("synchronize", event))
        self.done = max(self.done, self.marks[event])
        return 0

    def device_runs(self):
        """The device runs some queued copies (none while it lags)."""
        if not self.lag:
            self.done = len(self.queue)
        elif self.rng.random() < 0.3:
            self.done = min(len(self.queue), self.done + self.rng.randrange(3))


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 8, 9, 16])
def test_compiled_turn_reuses_a_set_only_after_its_copy_ran(depth, lag, seed):
    """The compiled ``ring_take`` on fake driver calls: when build ``j`` takes a set, every
    copy queued from that set before has run on the (simulated) device; an event is recorded
    once every ``E = max(1, depth // 2)`` builds and queried at most as often; a device that
    keeps up is never waited for, and a lagging one only by the builds that reuse a set."""
    op = host_ops.compiled()
    if op is None:
        pytest.fail(f"the compiled host ops are missing here: {host_ops.unavailable()}")
    every = max(1, depth // 2)
    count = depth // every + 2
    stream = _SimulatedStream(count, random.Random(seed), lag)
    state = torch.tensor([0, depth, every, count, *stream.addresses(), *stream.events],
                         dtype=torch.int64)  # fmt: skip
    builds = 6 * depth + 7
    for j in range(builds):
        stream.device_runs()
        slot = op.ring_take(state.data_ptr(), lambda device: 0xBEEF, 3)
        assert slot == j % depth
        pending = [b for b, s in stream.queue[stream.done :] if s == slot]
        assert not pending, f"build {j} takes set {slot} while the copies of {pending} wait"
        stream.queue.append((j, slot))  # this build's plan() copy
    assert int(state[0]) == builds
    kinds = [call for call, _ in stream.calls]
    assert kinds.count("record") == (builds - 1) // every
    assert kinds.count("query") == max(0, (builds - 1 - depth) // every + 1)
    if not lag:
        assert "synchronize" not in kinds
    assert set(h for _, h in stream.calls) <= set(stream.events)


def test_compiled_turn_names_a_failed_driver_call_and_does_not_advance():
    op = host_ops.compiled()
    if op is None:
        pytest.fail(f"the compiled host ops are missing here: {host_ops.unavailable()}")
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda e, s: 201)
    ok = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda e: 0)
    addr = [ctypes.cast(f, ctypes.c_void_p).value for f in (failing, ok, ok)]
    state = torch.tensor([1, 2, 1, 4, *addr, 1, 2, 3, 4], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cuEventRecord returned CUresult 201"):
        op.ring_take(state.data_ptr(), lambda device: 0, 0)
    assert int(state[0]) == 1


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
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 8, 16])
def test_gpu_a_set_is_never_rewritten_while_its_copy_waits_on_the_stream(depth, compiled):
    """A host far ahead of its device: the stream is held busy, then every build writes its
    own value into the ring's next set and queues a non-blocking copy of it (what ``plan()``
    does), for three rounds of the ring. Each copy must read its own build's value: the ring
    makes the host wait before it reuses a set whose copy has not run yet. Both turns: the
    compiled one through the driver, the Python one through torch's events."""
    ring = HostMirrorRing({"a": BufferSpec((4096,), torch.int32, "a")}, depth,
                          torch.device("cuda"), use_compiled=compiled)  # fmt: skip
    assert ring.compiled == compiled
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


_STEP_MODES = (  # (method, keyword arguments): every mode with host mirrors
    ("draft_decode", {"num_rows": 2}),
    ("draft_decode_shared_prefix", {}),
    ("draft_decode_paged", {}),
    ("target_verify", {"tree": True}),
    ("target_verify", {"tree": True, "packed": True}),
    ("draft_extend", {}),
)


@pytest.mark.parametrize("turn", ["compiled", "python"])
def test_a_recorded_host_step_writes_what_the_call_would_round_the_ring(device, gen, turn):
    """The host step a runner replays instead of the call (with the compiled turn, one
    compiled call: the turn, the set's writer, the set's result), mode by mode: recorded
    once, then run on new lengths round a ring of depth 3, every other run after a direct
    build that takes a turn of the same ring. Each run's host mirrors equal those of a torch
    builder (``host_ops=False``) given the same lengths; the previous run's still hold its
    own; the ring's count moves by one a run; a refused length takes one turn, raises the
    call's message and leaves the previous run's mirrors as they were. A step recorded from
    a call given no ``seq_lens_cpu`` gives that call's result."""
    from specmeta.metadata.contract import describing

    if host_ops.compiled() is None:
        pytest.fail(f"the compiled host ops are missing here: {host_ops.unavailable()}")
    k, s, n, B = 2, 3, 4, 3
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=4, max_bs=4,
                     max_context_len=40)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, mirror_depth=3)
    ref = FlashInferBuilder(cfg, device, mirror_depth=3, host_ops=False)
    rings = fi._mirrors
    if turn == "python":
        for ring in rings.values():
            ring.turn = None
    b = make_batch("random", batch_size=B, topk=k, num_steps=s, page_size=4,
                   row_width=cfg.req_to_token_width, generator=gen, device=device,
                   extra_tokens=n, max_len=40)  # fmt: skip
    tree = random_tree_mask(B, k, s, n, gen).to(device)

    def call(builder, mode, kw, lens):
        args = [b.req_pool_indices, b.req_to_token, b.seq_lens]
        if kw.get("tree"):
            args.append(tree)
        kw = {key: v for key, v in kw.items() if key != "tree"}
        return getattr(builder, mode)(*args, seq_lens_cpu=lens, launch=False, **kw)

    def host(result):
        return [h.clone() for h, _ in _host_mirrors(result)]

    for mode, kw in _STEP_MODES:
        where = f"{mode} {kw}"
        with describing() as steps:
            plain = call(fi, mode, kw, None)
        assert steps[0].run(None) is plain, f"{where}: a call given no seq_lens_cpu"
        with describing() as steps:
            call(fi, mode, kw, b.seq_lens_cpu)
        (step,) = steps
        ring = rings[fi.plan_groups.get(mode, mode)]
        assert (ring.turn is not None) == (turn == "compiled"), where
        previous = None
        for i in range(7):
            if i % 2:
                call(fi, mode, kw, b.seq_lens_cpu)  # a direct build's turn in between
            lens = torch.randint(0, 41, (B,), generator=gen, dtype=torch.int64)
            before = int(ring._state[0]) if ring.compiled else ring._builds
            got = step.run(lens)
            after = int(ring._state[0]) if ring.compiled else ring._builds
            assert after == before + 1, f"{where}, run {i}: the ring moved {after - before}"
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
        before = int(ring._state[0]) if ring.compiled else ring._builds
        with pytest.raises(ValueError) as raised:
            step.run(bad)
        after = int(ring._state[0]) if ring.compiled else ring._builds
        assert str(raised.value) == str(want.value), where
        assert after == before + 1, f"{where}: a refusal moved the ring {after - before}"
        for j, (g, w) in enumerate(zip(host(previous[0]), previous[1], strict=True)):
            assert_equal(g, w, f"{where}: after the refusal, the last run's mirror {j}")
