"""A stale ``seq_lens_cpu`` is reported on the device (design §3, §7).

Every build given ``seq_lens_cpu`` sends what its host part read (``n``, ``ΣL``, ``max L``) to
the device, and the build's launches check it against ``seq_lens``: a copy one iteration behind
sets ``Status.STALE_HOST_LENGTHS`` and no other bit, in every mode of every builder, eagerly,
through a bound stage, through the graph runner (a captured graph on the GPU) and in the torch
references. A fresh copy, or none, sets nothing.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, allocate_buffers, new_status
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.host_lengths import (
    check_host_lengths,
    check_host_lengths_ref,
    publish_host_lengths,
)
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.workloads import random_tree_mask
from tests._support import draft_stage_runner

K, S, N, PS, MAX_BS = 2, 2, 3, 4, 4
CFG = SpecConfig(topk=K, num_steps=S, num_draft_tokens=N, page_size=PS, max_bs=MAX_BS,
                 max_context_len=40)  # fmt: skip
STALE = int(Status.STALE_HOST_LENGTHS)


def _word(status: torch.Tensor) -> int:
    return int(status.item())


# -- the kernel against its reference ------------------------------------------------------------
def _slot(device, values):
    """A host slot as a builder keeps it (pinned for CUDA) and a device ``seen`` word."""
    slot = torch.tensor([*values, 0, 0, 0], dtype=torch.int64)  # 8 fields, 3 unused
    return slot.pin_memory() if device.type == "cuda" else slot


def test_check_equals_reference_on_random_slots(device, gen, seed):
    """Random lengths and slots (the host's own numbers, a stale copy's, a longer batch's, or
    nothing new): the kernel's status bit, slot and seen word equal the reference's."""
    for trial in range(12):
        B = int(torch.randint(0, 6, (1,), generator=gen))
        lens = torch.randint(0, 30, (B,), generator=gen)
        n = int(torch.randint(0, B + 1, (1,), generator=gen)) if B else 0
        kind = trial % 4
        read = lens[:n] - (1 if kind == 1 else 0)  # kind 1: one iteration behind
        if kind == 2:
            n += 1  # the host read more requests than the build has
        total, top = int(read.sum()), int(read.max()) if read.numel() else 0
        seq = int(torch.randint(1, 9, (1,), generator=gen))
        seen = seq if kind == 3 else seq - 1  # kind 3: nothing new since the last check
        values = [seq, n, total, top, seq - 1]
        for dtype in (torch.int32, torch.int64):
            got_status, want_status = new_status(device), new_status("cpu")
            got_slot, want_slot = _slot(device, values), _slot(torch.device("cpu"), values)
            got_seen = torch.tensor([seen], device=device)
            want_seen = torch.tensor([seen])
            check_host_lengths(lens.to(dtype).to(device), got_slot, got_seen, status=got_status)
            check_host_lengths_ref(lens.to(dtype), want_slot, want_seen, status=want_status)
            where = f"seed {seed}, trial {trial}, lens {lens.tolist()}, slot {values}"
            assert _word(got_status) == _word(want_status), where
            assert torch.equal(got_slot.cpu(), want_slot), where
            assert torch.equal(got_seen.cpu(), want_seen), where


@pytest.mark.parametrize(
    ("lens", "slot", "seen", "bits"),
    [
        ([5, 7, 9], [1, 2, 12, 7, 0], 0, 0),  # a graph padded to 3 for 2 requests: pads unread
        ([5, 7, 9], [1, 2, 10, 6, 0], 0, STALE),  # one iteration behind
        ([5, 7, 9], [1, 3, 21, 8, 0], 0, STALE),  # the same total, another maximum
        ([5, 7, 9], [1, 3, 20, 9, 0], 0, STALE),  # the same maximum, another total
        ([5, 7, 9], [1, 4, 21, 9, 0], 0, STALE),  # the host read more requests than the build
        ([5, 7, 9], [1, 2, 10, 6, 1], 1, 0),  # nothing new: checked already
        ([5, 7, 9], [4, -1, 0, 0, 3], 3, 0),  # n = -1: nothing to compare
        ([], [1, 0, 0, 0, 0], 0, 0),  # an empty batch
    ],
)
def test_check_worked_examples(device, lens, slot, seen, bits):
    for check in (check_host_lengths, check_host_lengths_ref):
        on = device if check is check_host_lengths else torch.device("cpu")
        status = new_status(on)
        slot_t = _slot(on, slot)
        seen_t = torch.tensor([seen], device=on)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=on)
        check(lens_t, slot_t, seen_t, status=status)
        assert _word(status) == bits, (check.__name__, lens, slot)
        assert slot_t.tolist() == [*slot[:4], slot[0], 0, 0, 0], "the check marks it consumed"
        assert seen_t.tolist() == [slot[0]]


def test_a_host_part_publishes_only_what_the_device_consumed():
    """The handshake: values and then seq + 1, and only over consumed values."""
    slot = [3, 2, 10, 6, 3]
    assert publish_host_lengths(slot, 2, 12, 7) and slot == [4, 2, 12, 7, 3]
    assert not publish_host_lengths(slot, 2, 14, 8), "seq 4 is not consumed yet"
    assert slot == [4, 2, 12, 7, 3]
    slot[4] = 4
    assert publish_host_lengths(slot, 2, 14, 8) and slot == [5, 2, 14, 8, 4]


# -- every mode of every builder -----------------------------------------------------------------
def _batch(device, gen):
    """Three requests with prefixes ≥ 1 (so a copy one behind differs), rows 1..3."""
    B = 3
    lens = torch.randint(1, CFG.max_context_len - N, (B,), generator=gen)
    r2t = torch.zeros(MAX_BS + 2, CFG.req_to_token_width, dtype=torch.int32)
    r2t[1:] = torch.arange(r2t[1:].numel(), dtype=torch.int32).view(MAX_BS + 1, -1) + PS
    rpi = torch.tensor([2, 1, 3], dtype=torch.int32)
    return rpi.to(device), r2t.to(device), lens.to(torch.int32).to(device), lens


def _modes(device, compiled: bool = True):
    """``(name, builder, bind(builder, rpi, r2t, seq_lens, status) -> Stage)`` of every mode,
    its host part through the compiled host ops or the torch ones."""
    mask = random_tree_mask(3, K, S, N, torch.Generator().manual_seed(0)).to(device)

    def slots(rpi, r2t, lens):
        return assign_draft_cache_locs(rpi, r2t, lens, topk=K, num_steps=S, page_size=PS)

    fa3 = FA3MetadataBuilder(CFG, device, host_ops=compiled)
    fi = FlashInferBuilder(CFG, device, host_ops=compiled)
    mla = TrtllmMlaBuilder(CFG, device, host_ops=compiled)
    return [
        ("fa3.draft_decode", fa3,
         lambda b, r, t, L, st: b.bind_draft_decode(r, t, L, slots(r, t, L), status=st)),
        ("fa3.target_verify", fa3,
         lambda b, r, t, L, st: b.bind_target_verify(r, t, L, mask, status=st)),
        ("fa3.draft_extend", fa3, lambda b, r, t, L, st: b.bind_draft_extend(r, t, L, status=st)),
        ("flashinfer.draft_decode", fi,
         lambda b, r, t, L, st: b.bind_draft_decode(r, t, L, status=st)),
        ("flashinfer.draft_decode_shared_prefix", fi,
         lambda b, r, t, L, st: b.bind_draft_decode_shared_prefix(r, t, L, status=st)),
        ("flashinfer.draft_decode_paged", fi,
         lambda b, r, t, L, st: b.bind_draft_decode_paged(r, t, L, status=st)),
        ("flashinfer.target_verify", fi,
         lambda b, r, t, L, st: b.bind_target_verify(r, t, L, mask, status=st)),
        ("flashinfer.draft_extend", fi,
         lambda b, r, t, L, st: b.bind_draft_extend(r, t, L, status=st)),
        ("trtllm_mla.draft_decode", mla,
         lambda b, r, t, L, st: b.bind_draft_decode(r, t, L, status=st)),
        ("trtllm_mla.draft_extend", mla,
         lambda b, r, t, L, st: b.bind_draft_extend(r, t, L, status=st)),
    ]  # fmt: skip


@pytest.mark.parametrize("writers", ["compiled", "torch"])
def test_every_mode_reports_a_copy_one_iteration_behind(device, gen, seed, writers, request):
    """Per mode, one bound stage: a fresh copy sets nothing, the copy of the iteration before
    sets ``STALE_HOST_LENGTHS`` alone, and the next fresh copy sets nothing again (the slot is
    per mode and consumed). FA3 and TRT-LLM MLA also take no copy at all. Each host part
    publishes through the compiled host ops (after ``warmup()``) and through the torch ones."""
    if writers == "compiled":
        request.getfixturevalue("compiled_host_ops")
    rpi, r2t, lens, lens_cpu = _batch(device, gen)
    behind = (lens_cpu - 1).to(torch.int32)
    for name, builder, bind in _modes(device, compiled=writers == "compiled"):
        status = new_status(device)
        stage = bind(builder, rpi, r2t, lens, status)
        where = f"{name}, seed {seed}, seq_lens {lens_cpu.tolist()}"
        stage(lens_cpu.to(torch.int32))
        assert _word(status) == 0, f"{where}: a fresh copy"
        stage.host(behind)
        stage.launch()
        assert _word(status) == STALE, f"{where}: one iteration behind"
        status.zero_()
        stage(lens_cpu.to(torch.int64))
        assert _word(status) == 0, f"{where}: fresh again"
        if not name.startswith("flashinfer"):  # FlashInfer refuses a missing copy at the call
            stage(None)
            assert _word(status) == 0, f"{where}: no copy"
        # A host part ahead of the device (the last one's launches have not run) publishes
        # nothing: its build goes unchecked, and nothing is reported wrongly.
        stage.host(lens_cpu)
        stage.host(behind)
        stage.launch()
        stage.launch()
        assert _word(status) == 0, f"{where}: a host part ahead of the device"


@pytest.mark.parametrize("backend", ["fa3", "flashinfer", "trtllm_mla", "flashinfer_mla"])
def test_a_builder_made_without_the_check_launches_none(device, gen, seed, backend):
    """``check_host_lengths=False``: every stage has one launch fewer and a stale copy sets
    nothing; the same builder with the check reports it."""
    rpi, r2t, lens, lens_cpu = _batch(device, gen)
    cls = {"fa3": FA3MetadataBuilder, "flashinfer": FlashInferBuilder,
           "trtllm_mla": TrtllmMlaBuilder, "flashinfer_mla": FlashInferMLABuilder}[backend]  # fmt: skip
    counts = {}
    for check in (True, False):
        builder = cls(CFG, device, modes=["draft_extend"], check_host_lengths=check)
        stage = builder.bind_draft_extend(rpi, r2t, lens)
        counts[check] = len(stage.launches)
        stage(lens_cpu - 1)
        assert _word(builder.status) == (STALE if check else 0), f"{backend}, seed {seed}"
    assert counts[True] == counts[False] + 1


@pytest.mark.parametrize("backend", ["fa3", "flashinfer", "trtllm_mla", "flashinfer_mla"])
def test_eager_and_reference_builds_report_a_stale_copy(device, gen, seed, backend):
    """The eager call (binds and launches) and a reference builder report it too."""
    rpi, r2t, lens, lens_cpu = _batch(device, gen)
    cls = {"fa3": FA3MetadataBuilder, "flashinfer": FlashInferBuilder,
           "trtllm_mla": TrtllmMlaBuilder, "flashinfer_mla": FlashInferMLABuilder}[backend]  # fmt: skip
    for reference in (False, True):
        builder = cls(CFG, device, modes=["draft_extend"], reference=reference)
        status = new_status(device)
        builder.draft_extend(rpi, r2t, lens, seq_lens_cpu=lens_cpu - 1, status=status)
        assert _word(status) == STALE, f"{backend}, reference={reference}, seed {seed}"
        status.zero_()
        builder.draft_extend(rpi, r2t, lens, seq_lens_cpu=lens_cpu, status=status)
        assert _word(status) == 0, f"{backend}, reference={reference}, seed {seed}"


def _runner_case(device, gen, graphs):
    """A runner of FA3 draft extend with buckets [4]: 3 requests replay padded to 4."""
    rpi, r2t, lens, lens_cpu = _batch(device, gen)
    fa3 = FA3MetadataBuilder(CFG, device, modes=["draft_extend"])
    bufs = allocate_buffers(CFG, device, ["runner.req_pool_indices", "runner.seq_lens"])

    def build(inputs):
        return fa3.bind_draft_extend(inputs["req_pool_indices"], r2t, inputs["seq_lens"])

    runner = draft_stage_runner(build, bufs, CFG, device, r2t, [MAX_BS], graphs=graphs)
    inputs = {"req_pool_indices": rpi.long(), "seq_lens": lens.long()}  # the runner's dtypes
    return runner, fa3, inputs, lens_cpu


def _check_runner(runner, fa3, inputs, lens_cpu, where):
    for host, bits in ((lens_cpu, 0), (lens_cpu - 1, STALE), (lens_cpu, 0)):
        result = runner.run(3, inputs, host_inputs={"seq_lens": host})
        assert result.padded_batch_size == MAX_BS
        assert _word(fa3.status) == bits, f"{where}: run with {host.tolist()}"
        fa3.status.zero_()
    statics = runner.static_inputs(3)  # a persistent batch, kept in the runner's buffers
    for host, bits in ((lens_cpu, 0), (lens_cpu - 1, STALE)):
        runner.replay(3, host_inputs={"seq_lens": host})
        assert _word(fa3.status) == bits, f"{where}: replay with {host.tolist()}"
        fa3.status.zero_()
    assert statics["seq_lens"].shape[0] == 3


def test_runner_reports_a_stale_copy_on_a_padded_batch(device, gen, seed):
    """``run`` and ``replay`` of 3 requests in a bucket of 4: the pad's length is not read."""
    runner, fa3, inputs, lens_cpu = _runner_case(device, gen, graphs=False)
    _check_runner(runner, fa3, inputs, lens_cpu, f"seed {seed}")


@pytest.mark.gpu
def test_a_captured_graph_reports_a_stale_copy(gen, seed):
    """The same in a captured CUDA graph: the check replays inside it and reads what the host
    part sent before the replay."""
    device = torch.device("cuda")
    runner, fa3, inputs, lens_cpu = _runner_case(device, gen, graphs=True)
    _check_runner(runner, fa3, inputs, lens_cpu, f"captured graph, seed {seed}")


def test_the_check_refuses_bad_slots_before_launching(device):
    """A slot of the wrong dtype or too short, or a seen word of the wrong dtype: refused on
    the host, naming the argument, with nothing written."""
    lens = torch.tensor([5, 7], dtype=torch.int32, device=device)
    seen = torch.zeros(1, dtype=torch.int64, device=device)
    good = _slot(device, [1, 2, 12, 7, 0])
    for check in (check_host_lengths, check_host_lengths_ref):
        on = device if check is check_host_lengths else torch.device("cpu")
        args = (lens.to(on), good.clone() if on.type == "cpu" else good, seen.to(on))
        with pytest.raises(TypeError, match="slot must be int64, got int32"):
            check(args[0], good.to(torch.int32), args[2])
        with pytest.raises(ValueError, match="slot is too small: need 8 elements, have 5"):
            check(args[0], good[:5], args[2])
        with pytest.raises(TypeError, match="seen must be int64, got int32"):
            check(args[0], args[1], args[2].to(torch.int32))
        assert good.tolist() == [1, 2, 12, 7, 0, 0, 0, 0], "nothing written"
    if device.type == "cuda":
        with pytest.raises(ValueError, match="got pageable CPU memory; pass slot.pin_memory"):
            check_host_lengths(lens, torch.tensor([1, 2, 12, 7, 0, 0, 0, 0]), seen)
