"""Stages (design §2.7, §3, §4): calling a stage runs its host part before any launch, so a
refused length leaves every output as it was; a builder's stage of one batch size and rows
reads and writes its own views, whatever was bound before or after it; and the graph runner
refuses to replay a stage whose captured tensors changed address, shape or strides."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Stage
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3Cascade, FA3MetadataBuilder
from specmeta.runners.graph_runner import GraphRunner
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import POISON, assert_equal


def test_calling_a_stage_runs_its_host_part_before_any_launch():
    """``stage(seq_lens_cpu)`` is ``host`` then ``launch``: a host part that refuses raises
    before the first launch; a nested stage contributes its own launches, in order."""
    calls = []

    def host(lens):
        calls.append(("host", lens))
        if lens == "bad":
            raise ValueError("refused")
        return "result"

    inner = Stage([lambda: calls.append("inner")])
    stage = Stage([lambda: calls.append("first"), inner, lambda: calls.append("last")],
                  host=host)  # fmt: skip
    assert len(stage.launches) == 3
    with pytest.raises(ValueError, match="^refused$"):
        stage("bad")
    assert calls == [("host", "bad")], "a launch ran before the host part refused"
    calls.clear()
    assert stage("good") == "result"
    assert calls == [("host", "good"), "first", "inner", "last"]
    calls.clear()
    stage.launch()
    assert calls == ["first", "inner", "last"]
    calls.clear()
    assert stage.host("good") == "result" and calls == [("host", "good")]
    assert Stage([], result=7)() == 7 and Stage([], result=7).host() == 7
    with pytest.raises(TypeError, match="^Stage: a launch must be callable, got int$"):
        Stage([3])


def _config(k, ps=4):
    n = 4 if k == 1 else 6
    return SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=ps, max_bs=7,
                      max_context_len=2 * ps + 24)  # fmt: skip


def _draw(cfg, B, gen, device):
    """A batch of ``B`` requests (new tensors), its draft slots and a tree mask."""
    b = make_batch("random", batch_size=B, topk=cfg.topk, num_steps=3, page_size=cfg.page_size,
                   row_width=cfg.req_to_token_width, generator=gen, device=device,
                   num_rows=9, extra_tokens=cfg.num_draft_tokens,
                   max_len=cfg.max_context_len)  # fmt: skip
    args = (b.req_pool_indices, b.req_to_token, b.seq_lens)
    slots = assign_draft_cache_locs(*args, topk=cfg.topk, num_steps=3, page_size=cfg.page_size)
    tree = random_tree_mask(B, cfg.topk, 3, cfg.num_draft_tokens, gen).to(device)
    return b, args, slots, tree


@pytest.mark.parametrize("k", [1, 2])
def test_a_refused_length_leaves_every_output_as_it_was(device, gen, k):
    """Every FA3 mode, eager and bound, given a length past the plan: it raises the plan's
    message before anything is launched, so every buffer (poisoned) and the status word are
    as they were; the same call with good lengths then writes them."""
    cfg = _config(k)
    fa3 = FA3MetadataBuilder(cfg, device)
    b, args, slots, tree = _draw(cfg, 5, gen, device)
    outputs = {name: t for name, t in fa3.buffers.items() if not name.endswith("cu_seqlens_q")}
    for t in outputs.values():
        t.fill_(POISON)  # (cu_seqlens_q is written once, at construction)
    before = {name: t.clone() for name, t in outputs.items()}
    bad = b.seq_lens_cpu.clone()
    bad[2] = cfg.max_context_len + 1
    message = (f"seq_lens_cpu holds {cfg.max_context_len + 1}, over the plan's "
               f"max_context_len={cfg.max_context_len}")  # fmt: skip
    calls = {
        "draft_decode": lambda lens: fa3.draft_decode(
            *args, slots, num_rows=3, seq_lens_cpu=lens
        ),  # fmt: skip
        "target_verify": lambda lens: fa3.target_verify(*args, tree, seq_lens_cpu=lens),
        "draft_extend": lambda lens: fa3.draft_extend(*args, seq_lens_cpu=lens),
        "bound draft_decode": fa3.bind_draft_decode(*args, slots, num_rows=3),
        "bound target_verify": fa3.bind_target_verify(*args, tree),
        "bound draft_extend": fa3.bind_draft_extend(*args),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call(bad)
        for name, t in outputs.items():
            assert_equal(t, before[name], f"{where}: {name} after the refusal")
        assert int(fa3.status) == 0, where
    for call in calls.values():
        call(b.seq_lens_cpu)
    written = [name for name, t in outputs.items() if not torch.equal(t, before[name])]
    assert "draft_extend.cache_seqlens" in written, written  # so the checks above can fail


def _assert_same(got, want, where):
    """Two FA3 passes (``FA3Metadata``), field by field."""
    for name in ("cache_seqlens", "page_table", "cu_seqlens_q", "cu_seqlens_k_new"):
        assert_equal(getattr(got, name), getattr(want, name), f"{where} {name}")
    for name in ("max_seqlen_q", "causal", "page_size", "max_seqlen_k"):
        assert getattr(got, name) == getattr(want, name), f"{where} {name}"


@pytest.mark.parametrize("k", [1, 2])
def test_a_stage_of_each_batch_size_and_rows_reads_its_own_views(device, gen, k):
    """One builder binds every FA3 mode for several batch sizes and draft rows, all before any
    launch; each stage then launched in turn gives its own batch's metadata (``B`` requests,
    ``rows`` steps), equal to a fresh reference builder's: a stage never reads, writes or
    returns the views of another batch size or of other rows."""
    cfg = _config(k)
    fa3 = FA3MetadataBuilder(cfg, device)
    draws = {B: _draw(cfg, B, gen, device) for B in (5, 3, 1)}
    bound = {}
    for B, rows in ((5, 3), (3, 2), (1, 1), (5, 1), (3, 3)):
        _, args, slots, tree = draws[B]
        bound[B, rows] = (
            fa3.bind_draft_decode(*args, slots, num_rows=rows),
            fa3.bind_target_verify(*args, tree),
            fa3.bind_draft_extend(*args),
        )
    for (B, rows), stages in bound.items():
        b, args, slots, tree = draws[B]
        where = f"B={B} rows={rows}"
        steps, verify, extend = (stage(b.seq_lens_cpu) for stage in stages)
        assert len(steps) == rows, where
        assert extend.cache_seqlens.shape == (B,) and verify.normal.cache_seqlens.shape == (B,)
        ref = FA3MetadataBuilder(cfg, device, reference=True, host_ops=False)
        lens = dict(seq_lens_cpu=b.seq_lens_cpu)
        want = [*ref.draft_decode(*args, slots, num_rows=rows, **lens),
                ref.target_verify(*args, tree, **lens), FA3Cascade(ref.draft_extend(*args, **lens),
                                                                   None)]  # fmt: skip
        got = [*steps, verify, FA3Cascade(extend, None)]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            for part in ("normal", "expand"):
                assert (getattr(g, part) is None) == (getattr(w, part) is None), (where, i, part)
                if getattr(w, part) is not None:
                    _assert_same(getattr(g, part), getattr(w, part), f"{where} [{i}] {part}")
    assert int(fa3.status) == 0


# --------------------------------------------------------------------------------------------
# The graph runner: what its stages hold is checked before every run and replay
# --------------------------------------------------------------------------------------------
def _changes():
    """``(what, change, undo)``: in-place changes that keep the tensor's address and change
    only its shape or only its strides."""
    return {
        "shape": (
            lambda t: t.resize_(t.shape[0] // 2, t.shape[1]),
            lambda t: t.resize_(t.shape[0] * 2, t.shape[1]),
        ),
        "strides": (lambda t: t.t_(), lambda t: t.t_()),
    }


@pytest.mark.parametrize("change", ["shape", "strides"])
@pytest.mark.parametrize("held", ["x", "guarded tensor table"])
def test_a_runner_refuses_a_stage_whose_held_tensor_changed_in_place(device, held, change):
    """A static input (``x``) or a guarded tensor (``table``), square, changed in place after
    capture: its address stays, only its shape (a smaller ``resize_``) or only its strides
    (``t_``) change. Every ``replay`` (of a batch size replayed before or not) and ``run``
    raises, naming it, before the host part, the pad and the launch; undone, the runner
    replays again."""
    x = torch.zeros(8, 8, dtype=torch.int64, device=device)
    table = torch.zeros(6, 6, dtype=torch.int64, device=device)
    events = []

    def stage_fn(inputs):
        view = inputs["x"]
        return Stage([lambda: events.append(("launch", view.shape[0]))],
                     host=lambda lens: events.append(("host", view.shape[0])))  # fmt: skip

    runner = GraphRunner(stage_fn, batch_sizes=[2, 8], device=device, graphs=False)
    runner.add_input("x", x, pad=0)
    runner.add_guard("table", table)
    runner.capture()
    ones = {"x": torch.ones(2, 8, dtype=torch.int64, device=device)}
    runner.replay(2)
    runner.run(2, ones)
    assert events == [("host", 2), ("launch", 2), ("host", 2), ("launch", 2)]
    events.clear()
    x.fill_(5)
    target = x if held == "x" else table
    ptr, shape, strides = target.data_ptr(), target.shape, target.stride()
    do, undo = _changes()[change]
    do(target)
    assert target.data_ptr() == ptr
    assert (target.shape != shape) == (change == "shape"), "the change is of one kind only"
    assert (target.stride() != strides) == (change == "strides"), "the change is of one kind"
    message = f"^{held} changed address, shape or strides since capture\\(\\)"
    for call in (lambda: runner.replay(2), lambda: runner.replay(5), lambda: runner.run(2, ones)):
        with pytest.raises(ValueError, match=message):
            call()
    assert events == [], "the host part or a launch ran on the changed tensor"
    undo(target)
    assert (target.shape, target.stride()) == (shape, strides)
    assert bool(x.eq(5).all()), "a pad or a copy ran on the changed tensor"
    runner.replay(2)
    assert events == [("host", 2), ("launch", 2)]
