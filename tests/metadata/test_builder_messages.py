"""What a user sees when a builder gets bad input: one exception, raised before any launch and
before any write, naming the call, the argument, the value and the fix.

Every expected message below is written out in full. The config is small enough to work out
its numbers by hand: ``topk=2, num_steps=3, num_draft_tokens=6, page_size=4, max_bs=4,
max_context_len=32``. A request of 32 tokens in slot layout B needs at most
``base + K·nnp·ps = 28 + 2·2·4 = 44`` row positions (at ``L = 30`` or 31), more than its verify
window ``32 + 6 = 38``; the default ``req_to_token_width`` rounds 44 up to 48.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmeta import (
    FA3MetadataBuilder,
    FlashInferBuilder,
    FlashInferMLABuilder,
    SpecConfig,
    TrtllmMlaBuilder,
)
from specmeta.metadata import host_ops

CFG = SpecConfig(topk=2, num_steps=3, num_draft_tokens=6, page_size=4, max_bs=4,
                 max_context_len=32)  # fmt: skip
CHAIN = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=4, max_bs=4,
                   max_context_len=32)  # fmt: skip
B = 3


def _inputs(device, cfg=CFG, batch=B, width=48):
    """A valid batch: rows 1..B of a zeroed table, lengths 5, 9, 30."""
    return dict(
        req_pool_indices=torch.arange(1, batch + 1, dtype=torch.int32, device=device),
        req_to_token=torch.zeros(batch + 1, width, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([5, 9, 30, 7][:batch], dtype=torch.int32, device=device),
    )


def _call(builder, mode, inputs, **kw):
    args = (inputs["req_pool_indices"], inputs["req_to_token"], inputs["seq_lens"])
    return getattr(builder, mode)(*args, **kw)


def _raises(kind, message, fn, *args, **kw):
    with pytest.raises(kind) as info:
        fn(*args, **kw)
    assert str(info.value) == message
    return info


def _builders(device, reference=False):
    """Each builder by name, twice: ``seq_lens_cpu`` checked (and FlashInfer's host mirrors
    written) by the compiled calls of metadata/host_ops.py (built here by ``warmup()``, as an
    engine builds them; a machine where they do not build fails), and by torch ops."""
    done = host_ops.warmup()
    assert host_ops.compiled() is not None, f"the compiled host ops did not build: {done}"
    return [
        (cls.__name__, cls(CFG, device, host_ops=host_ops, reference=reference))
        for cls in (FA3MetadataBuilder, FlashInferBuilder, TrtllmMlaBuilder,
                    FlashInferMLABuilder)
        for host_ops in (True, False)
    ]


# Modes every builder serves on CFG; the FA3 ones get the extra argument they need.
def _modes(name, device):
    slots = torch.zeros(B * 2 * 3, dtype=torch.int64, device=device)
    mask = torch.ones(B, 6, 6, dtype=torch.bool, device=device)
    if name == "FA3MetadataBuilder":
        return [("draft_decode", dict(out_cache_loc=slots)),
                ("target_verify", dict(tree_mask=mask)), ("draft_extend", {})]  # fmt: skip
    if name == "FlashInferBuilder":
        return [("draft_decode", {}), ("draft_decode_shared_prefix", {}),
                ("draft_decode_paged", {}), ("target_verify", dict(tree_mask=mask)),
                ("draft_extend", {})]  # fmt: skip
    return [("draft_decode", {}), ("draft_extend", {})]


def _all(device, reference=False):
    for name, builder in _builders(device, reference):
        for mode, extra in _modes(name, device):
            yield f"{name}.{mode}", builder, mode, extra


def _snapshot(builder):
    """Every buffer the builder owns, and its status word, copied to the host."""
    bufs = {k: v.detach().cpu().clone() for k, v in builder.buffers.items()}
    return bufs, builder.status.cpu().clone()


def _unchanged(builder, before):
    bufs, status = _snapshot(builder)
    for key, value in before[0].items():
        assert torch.equal(bufs[key], value), f"{key} was written before the exception"
    assert torch.equal(status, before[1])


def test_seq_lens_over_the_plan_names_the_config_and_the_fix(device):
    for where, builder, mode, extra in _all(device):
        inputs = _inputs(device)
        lens_cpu = torch.tensor([5, 1500, 30], dtype=torch.int32)
        before = _snapshot(builder)
        _raises(ValueError,
                f"{where}: seq_lens_cpu holds 1500, over the plan's max_context_len=32; "
                "build the SpecConfig with max_context_len >= 1500",
                _call, builder, mode, inputs, seq_lens_cpu=lens_cpu, **extra)  # fmt: skip
        _unchanged(builder, before)


def test_negative_seq_lens_cpu(device):
    for where, builder, mode, extra in _all(device):
        lens_cpu = torch.tensor([5, -2, 30], dtype=torch.int64)
        _raises(ValueError,
                f"{where}: seq_lens_cpu holds -2; lengths must be >= 0 (pass the committed "
                "prefix length of each request)",
                _call, builder, mode, _inputs(device), seq_lens_cpu=lens_cpu, **extra)  # fmt: skip


def test_narrow_req_to_token_is_caught_on_the_host(device):
    for where, builder, mode, extra in _all(device):
        before = _snapshot(builder)
        _raises(ValueError,
                f"{where}: req_to_token is 40 positions wide, but the plan needs 44 (a prefix "
                "of max_context_len=32 plus its draft and verify slots); allocate req_to_token "
                "with at least 44 columns, e.g. SpecConfig.req_to_token_width=48",
                _call, builder, mode, _inputs(device, width=40), **extra)  # fmt: skip
        _unchanged(builder, before)


def test_batch_over_max_bs(device):
    for where, builder, mode, extra in _all(device):
        inputs = _inputs(device, batch=5)
        inputs["seq_lens"] = torch.full((5,), 3, dtype=torch.int32, device=device)
        if "out_cache_loc" in extra:
            extra = dict(out_cache_loc=torch.zeros(5 * 6, dtype=torch.int64, device=device))
        if "tree_mask" in extra:
            extra = dict(tree_mask=torch.ones(5, 6, 6, dtype=torch.bool, device=device))
        _raises(ValueError,
                f"{where}: the batch has 5 requests, over the plan's max_bs=4; build the "
                "SpecConfig with max_bs >= 5",
                _call, builder, mode, inputs, **extra)  # fmt: skip


def test_seq_lens_and_seq_lens_cpu_must_match_the_batch(device):
    for where, builder, mode, extra in _all(device):
        inputs = _inputs(device)
        short = dict(inputs, seq_lens=inputs["seq_lens"][:2])
        _raises(ValueError,
                f"{where}: seq_lens has 2 entries but req_pool_indices has 3; pass one length "
                "per request",
                _call, builder, mode, short, **extra)  # fmt: skip
        _raises(ValueError,
                f"{where}: seq_lens_cpu has 2 entries but the batch has 3; pass the CPU copy "
                "of this batch's seq_lens",
                _call, builder, mode, inputs, seq_lens_cpu=torch.tensor([5, 9]),
                **extra)  # fmt: skip


def test_wrong_dtype_rank_and_type(device):
    for where, builder, mode, extra in _all(device):
        inputs = _inputs(device)
        floats = dict(inputs, seq_lens=inputs["seq_lens"].float())
        _raises(TypeError,
                f"{where}: seq_lens has dtype float32; pass it as int32 or int64 "
                "(e.g. seq_lens.to(torch.int32))",
                _call, builder, mode, floats, **extra)  # fmt: skip
        flat = dict(inputs, req_to_token=inputs["req_to_token"].view(-1))
        _raises(ValueError,
                f"{where}: req_to_token has shape [192]; it must have 2 dimensions",
                _call, builder, mode, flat, **extra)  # fmt: skip
        listed = dict(inputs, req_pool_indices=[1, 2, 3])
        _raises(TypeError, f"{where}: req_pool_indices must be a torch.Tensor, got list",
                _call, builder, mode, listed, **extra)  # fmt: skip


def test_device_mismatch_names_the_argument_and_where_the_builder_lives():
    # A builder on the meta device (a reference builder: no kernel runs there), every input
    # on the CPU: each is on the wrong device.
    for where, builder, mode, _ in _all("meta", reference=True):
        extra = dict(_modes(where.split(".")[0], "meta"))[mode]
        inputs = dict(_inputs("meta"), req_to_token=_inputs("cpu")["req_to_token"])
        _raises(ValueError,
                f"{where}: req_to_token is on cpu, but this builder lives on meta; pass "
                "req_to_token on meta (or construct the builder on cpu)",
                _call, builder, mode, inputs, **extra)  # fmt: skip


def test_tree_mask_is_checked_before_the_first_launch(device):
    """FA3's verify launches twice; a mask of the wrong shape must stop it before either."""
    fa3, fi = FA3MetadataBuilder(CFG, device), FlashInferBuilder(CFG, device)
    inputs = _inputs(device)
    for where, builder in (("FA3MetadataBuilder", fa3), ("FlashInferBuilder", fi)):
        for shape in ((B, 5, 5), (B, 6, 6, 1), (2, 6, 6)):
            mask = torch.ones(shape, dtype=torch.bool, device=device)
            before = _snapshot(builder)
            with pytest.raises(ValueError) as info:
                _call(builder, "target_verify", inputs, tree_mask=mask)
            want = (f"{where}.target_verify: tree_mask has shape {list(shape)}; it must be "
                    f"[B, N, N] = [3, 6, 6] (B requests, N = num_draft_tokens = 6)")  # fmt: skip
            if len(shape) != 3:
                want = (f"{where}.target_verify: tree_mask has shape {list(shape)}; it must "
                        "have 3 dimensions")  # fmt: skip
            assert str(info.value) == want
            _unchanged(builder, before)
        _raises(TypeError,
                f"{where}.target_verify: tree_mask has dtype int64; pass it as bool "
                "(e.g. tree_mask.to(torch.bool))",
                _call, builder, "target_verify", inputs,
                tree_mask=torch.ones(B, 6, 6, dtype=torch.int64, device=device))  # fmt: skip
    _raises(ValueError,
            "FA3MetadataBuilder.target_verify: tree_mask is required with topk=2 > 1; pass the "
            "[B, N, N] bool ancestor mask of the draft tree (N = 6)",
            _call, fa3, "target_verify", inputs)  # fmt: skip


def test_fa3_draft_slots_and_rows(device):
    fa3 = FA3MetadataBuilder(CFG, device)
    inputs = _inputs(device)
    _raises(ValueError,
            "FA3MetadataBuilder.draft_decode: out_cache_loc is required with topk=2 > 1 (the "
            "expand pass reads each branch's draft slots); pass the out_cache_loc of "
            "assign_draft_cache_locs",
            _call, fa3, "draft_decode", inputs)  # fmt: skip
    _raises(ValueError,
            "FA3MetadataBuilder.draft_decode: out_cache_loc has 10 slots, but the batch needs "
            "B·K·S = 18 (laid out [B, K, S]); pass the out_cache_loc filled by "
            "assign_draft_cache_locs for this batch",
            _call, fa3, "draft_decode", inputs,
            out_cache_loc=torch.zeros(10, dtype=torch.int64, device=device))  # fmt: skip


def test_num_rows_and_status(device):
    slots = torch.zeros(B * 6, dtype=torch.int64, device=device)
    for name, builder in _builders(device):
        extra = dict(out_cache_loc=slots) if name == "FA3MetadataBuilder" else {}
        _raises(ValueError,
                f"{name}.draft_decode: num_rows=4 is outside [0, num_steps=3]; pass at most "
                "num_steps rows (the default, 2, builds every draft forward)",
                _call, builder, "draft_decode", _inputs(device), num_rows=4,
                **extra)  # fmt: skip
        _raises(TypeError, f"{name}.draft_decode: num_rows must be an int, got float",
                _call, builder, "draft_decode", _inputs(device), num_rows=2.0,
                **extra)  # fmt: skip
        _raises(ValueError,
                f"{name}.draft_extend: status has shape [2]; it must be int32 [1] "
                "(specmeta.new_status(device))",
                _call, builder, "draft_extend", _inputs(device),
                status=torch.zeros(2, dtype=torch.int32, device=device))  # fmt: skip


def test_trtllm_hints_and_trees(device):
    mla = TrtllmMlaBuilder(CFG, device)
    _raises(ValueError,
            "TrtllmMlaBuilder.draft_extend: max_seq_len=1500 exceeds the plan's "
            "max_context_len=32; build the SpecConfig with max_context_len >= 1500",
            _call, mla, "draft_extend", _inputs(device), max_seq_len=1500)  # fmt: skip
    _raises(TypeError,
            "TrtllmMlaBuilder.draft_decode: max_seq_len must be a host int, got Tensor; pass "
            "int(...) of a value the host already holds, or seq_lens_cpu=",
            _call, mla, "draft_decode", _inputs(device), max_seq_len=torch.tensor(3))  # fmt: skip
    _raises(ValueError,
            "TrtllmMlaBuilder.target_verify: tree_mask is required with topk=2 > 1; pass the "
            "[B, N, N] bool ancestor mask of the draft tree (N = 6)",
            _call, mla, "target_verify", _inputs(device))  # fmt: skip


def test_builders_own_a_status_word_that_a_masked_fault_reaches(device):
    """One rule: each builder reports into its own word unless the call passes one."""
    for cls in (FA3MetadataBuilder, FlashInferBuilder, TrtllmMlaBuilder):
        builder = cls(CHAIN, device)
        inputs = _inputs(device, cfg=CHAIN)
        inputs["req_pool_indices"][1] = 99  # a row outside req_to_token: ROW_OOB, masked
        lens = dict(seq_lens_cpu=inputs["seq_lens"].cpu())  # FlashInfer's mirrors need it
        _call(builder, "draft_extend", inputs, **lens)
        assert int(builder.status) == 1, cls.__name__
        passed = torch.zeros(1, dtype=torch.int32, device=device)
        builder.status.zero_()
        _call(builder, "draft_extend", inputs, status=passed, **lens)
        assert (int(passed), int(builder.status)) == (1, 0), cls.__name__


def test_free_launchers_say_the_argument_the_value_and_the_fix(device):
    """The launchers' own checks (specmeta.validate), seen through public launchers."""
    from specmeta import accept_cache_locs, assign_draft_cache_locs

    rpi = torch.tensor([1, 2], dtype=torch.int32, device=device)
    table = torch.zeros(3, 48, dtype=torch.int32, device=device)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    kw = dict(topk=2, num_steps=3, page_size=4)
    _raises(TypeError,
            "seq_lens must be int32 or int64, got float32; convert it with "
            "seq_lens.to(torch.int32)",
            assign_draft_cache_locs, rpi, table, lens.float(), **kw)  # fmt: skip
    _raises(ValueError,
            "seq_lens must have 2 elements, got shape (3,); its length must match the other "
            "inputs of this call",
            assign_draft_cache_locs, rpi, table, torch.cat([lens, lens[:1]]), **kw)  # fmt: skip
    _raises(ValueError,
            "out_cache_loc is too small: need 12 elements, have 5; allocate it from "
            "specmeta.plan_buffers(cfg) with a config that covers this batch",
            assign_draft_cache_locs, rpi, table, lens,
            out_cache_loc=torch.zeros(5, dtype=torch.int64, device=device), **kw)  # fmt: skip
    _raises(ValueError,
            "req_to_token must have unit stride in its last dimension, got (1, 3); pass "
            "req_to_token.contiguous()",
            assign_draft_cache_locs, rpi, table.t().contiguous().t()[:, :3], lens,
            **kw)  # fmt: skip
    index = torch.tensor([[0, -1, -1, -1]], dtype=torch.int32, device=device)
    _raises(ValueError,
            "accept_index must have rank 2, got shape (4,); see the launcher's docstring for "
            "its shape",
            accept_cache_locs, index[0], torch.ones(1, dtype=torch.int32, device=device),
            torch.zeros(6, dtype=torch.int64, device=device), num_draft_tokens=6)  # fmt: skip


def test_the_host_checks_hold_at_their_exact_limits(device):
    """One past each limit raises, the limit itself does not: a check off by one fails here.
    By hand for CFG: the row need is 44, ``max_context_len`` 32, lengths start at 0."""
    for _, builder, mode, extra in _all(device):
        lens = torch.tensor([5, 9, 30])
        _call(builder, mode, _inputs(device, width=44), seq_lens_cpu=lens, **extra)  # the need
        with pytest.raises(ValueError, match="req_to_token is 43 positions wide"):
            _call(builder, mode, _inputs(device, width=43), **extra)
        top = torch.tensor([0, 32, 30])  # 0 and max_context_len themselves are valid
        _call(builder, mode, _inputs(device), seq_lens_cpu=top, **extra)
        with pytest.raises(ValueError, match="seq_lens_cpu holds 33, over"):
            _call(builder, mode, _inputs(device), seq_lens_cpu=torch.tensor([5, 33, 30]),
                  **extra)  # fmt: skip
        with pytest.raises(ValueError, match="seq_lens_cpu holds -1; lengths must be >= 0"):
            _call(builder, mode, _inputs(device), seq_lens_cpu=torch.tensor([5, -1, 30]),
                  **extra)  # fmt: skip


def test_a_free_launcher_rejects_a_status_word_of_the_wrong_shape(device):
    from specmeta import assign_draft_cache_locs

    rpi = torch.tensor([1, 2], dtype=torch.int32, device=device)
    table = torch.zeros(3, 48, dtype=torch.int32, device=device)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    kw = dict(topk=2, num_steps=3, page_size=4)
    for bad in (torch.zeros(2, dtype=torch.int32, device=device),
                torch.zeros(0, dtype=torch.int32, device=device)):  # fmt: skip
        with pytest.raises(ValueError, match="status must have 1 elements"):
            assign_draft_cache_locs(rpi, table, lens, status=bad, **kw)
    with pytest.raises(TypeError, match="status must be int32"):
        assign_draft_cache_locs(rpi, table, lens, status=torch.zeros(1, device=device), **kw)


def test_a_length_rule_refuses_bad_construction_arguments():
    """LengthRule, on its own: a negative range, shift or cap, or a non-int, is refused with
    the argument named (the lengths themselves are checked by the writers that read it)."""
    from specmeta.metadata.host_ops import LengthRule

    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        LengthRule(-1)
    with pytest.raises(TypeError, match="shift must be an int, got float"):
        LengthRule(8, 1.5)
    with pytest.raises(ValueError, match="cap must be >= 0, got -2"):
        LengthRule(8, cap=-2)
    rule = LengthRule(8, 3)
    assert (rule.max_len, rule.shift, rule.cap) == (8, 3, 8)  # no cap: the plan's range


def test_a_bound_stage_refuses_what_the_call_refuses(device):
    """A mode bound once (``builder.bind(mode, ...)``) runs its host part on each call's
    ``seq_lens_cpu`` (design §3, §4): given a bad one, ``stage.host`` and ``stage()`` raise the
    exception and message the eager call itself raises, whichever compiled or torch path
    checks it, before anything is launched or written; a good one still gives the call's
    result."""
    good = torch.tensor([5, 9, 30], dtype=torch.int32)
    bad = [
        torch.tensor([5, 1500, 30], dtype=torch.int32),
        torch.tensor([5, -2, 30], dtype=torch.int32),
        torch.tensor([5, 9], dtype=torch.int32),
        torch.tensor([5.0, 9.0, 30.0]),
        torch.tensor([[5, 9, 30]], dtype=torch.int32),
        torch.tensor([5, 0, 9, 0, 30, 0], dtype=torch.int32)[::2],  # strided
        [5, 9, 30],
    ]
    for where, builder, mode, extra in _all(device):
        inputs = _inputs(device)
        args = (inputs["req_pool_indices"], inputs["req_to_token"], inputs["seq_lens"])
        stage = builder.bind(mode, *args, **extra)
        _same(stage.host(good), _call(builder, mode, inputs, seq_lens_cpu=good, launch=False,
                                      **extra), where)  # fmt: skip
        for value in bad:
            with pytest.raises((TypeError, ValueError)) as want:
                _call(builder, mode, inputs, seq_lens_cpu=value, launch=False, **extra)
            before = _snapshot(builder)
            for run in (stage.host, stage):
                with pytest.raises(want.type) as got:
                    run(value)
                assert str(got.value) == str(want.value), f"{where}: {value!r}"
            _unchanged(builder, before)
        other = torch.tensor([5, 17, 9], dtype=torch.int32)  # another max L
        want = _call(builder, mode, inputs, seq_lens_cpu=other, launch=False, **extra)
        _same(stage.host(other.clone()), want, where)


def _same(got, want, where: str) -> None:
    """Two results field by field: host scalars exactly, tensors by shape, dtype and value
    (the host mirrors of two calls sit in different ring sets)."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert (got.shape, got.dtype) == (want.shape, want.dtype), where
        assert torch.equal(got.cpu(), want.cpu()), where
    elif isinstance(want, tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{i}]")
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            _same(getattr(got, field.name), getattr(want, field.name), f"{where}.{field.name}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
