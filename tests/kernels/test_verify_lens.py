"""pad_verify_lens_to_bucket against its reference, against hand-worked buckets, and on every
split that can go wrong: nothing to verify, one request holding the bucket, no pad request, a
full bucket, an overflowing one, a negative length, an empty batch."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.verify_lens import (
    bind_pad_verify_lens_to_bucket,
    pad_verify_lens_to_bucket,
    pad_verify_lens_to_bucket_ref,
)
from tests.guard_bands import Guarded, assert_equal

# The package re-exports functions of the module's name: fetch the module itself.
MODULE = importlib.import_module("specmeta.kernels.verify_lens")


def _run(device, lens, T, Bp, *, dtype=torch.int32, out_dtype=torch.int32, note="", n=None,
         cap=None):  # fmt: skip
    """Kernel into guarded, poisoned buffers; reference into plain poisoned ones; outputs and
    status words compared exactly, the kernel's canaries checked. Returns the kernel's outputs
    (on the CPU) and its status."""
    v = torch.tensor(lens, dtype=dtype).to(device)
    out = Guarded((Bp,), out_dtype, device)
    qo = Guarded((Bp + 1,), out_dtype, device)
    status = new_status(device)
    kw = {} if n is None else {"num_draft_tokens": n}
    if cap is not None:
        kw["cap"] = cap
    got = pad_verify_lens_to_bucket(v, T, Bp, out=out.view, qo_indptr=qo.view, status=status,
                                    **kw)  # fmt: skip
    assert got[0] is out.view and got[1] is qo.view
    ref_out = torch.full((Bp,), -3, dtype=out_dtype, device=device)
    ref_qo = torch.full((Bp + 1,), -3, dtype=out_dtype, device=device)
    ref_status = new_status(device)
    pad_verify_lens_to_bucket_ref(v, T, Bp, out=ref_out, qo_indptr=ref_qo, status=ref_status,
                                  **kw)  # fmt: skip
    what = f"verify_lens={list(lens)[:16]} T={T} Bp={Bp} cap={cap} {note}"
    out.assert_intact(f"out [{what}]")
    qo.assert_intact(f"qo_indptr [{what}]")
    assert_equal(out.view, ref_out, f"out [{what}]")
    assert_equal(qo.view, ref_qo, f"qo_indptr [{what}]")
    assert_equal(status, ref_status, f"status [{what}]")
    return out.view.cpu().long(), qo.view.cpu().long(), Status(int(status))


def _check_bucket(lens, T, Bp, out, qo, what):
    """The contract read directly: lengths ≥ 0 summing to T, qo_indptr their exclusive prefix
    sum from 0 to T; pads within one token of each other, the longer ones first."""
    B = len(lens)
    assert not bool((out < 0).any()), f"negative length {out.tolist()} [{what}]"
    assert int(out.sum()) == T, f"lengths {out.tolist()} do not sum to T={T} [{what}]"
    assert int(qo[0]) == 0 and int(qo[-1]) == T, f"qo_indptr {qo.tolist()} [{what}]"
    assert torch.equal(qo[1:], out.cumsum(0)), f"qo_indptr {qo.tolist()} [{what}]"
    pads = out[B:]
    if pads.numel():
        assert int(pads.max()) - int(pads.min()) <= 1, f"pads {pads.tolist()} [{what}]"
        assert torch.equal(pads, pads.sort(descending=True).values), f"{pads.tolist()} [{what}]"


# ------------------------------------------------------------------------------------ random
@pytest.mark.parametrize(
    "B,pads,dtype,out_dtype",
    [
        (1, 0, torch.int32, torch.int32),
        (1, 3, torch.int64, torch.int32),
        (7, 1, torch.int32, torch.int64),
        (13, 0, torch.int64, torch.int32),
        (13, 19, torch.int32, torch.int32),
        (0, 5, torch.int64, torch.int32),
    ],
)
def test_random_matches_reference_and_the_contract(device, seed, B, pads, dtype, out_dtype):
    rng = random.Random(seed)
    N = rng.randint(1, 16)
    lens = [rng.randint(0, N) for _ in range(B)]
    Bp = B + pads
    T = sum(lens) + rng.randint(0, 3 * N)
    what = f"seed={seed}"
    out, qo, status = _run(device, lens, T, Bp, dtype=dtype, out_dtype=out_dtype, note=what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_bucket(lens, T, Bp, out, qo, what)
    if pads:
        assert out[:B].tolist() == lens, f"real lengths changed: {out.tolist()} [{what}]"
    else:
        assert out[: B - 1].tolist() == lens[:-1], f"{out.tolist()} [{what}]"


@pytest.mark.parametrize("overflow", [False, True])
def test_loops_over_several_blocks(device, seed, monkeypatch, overflow):
    """Blocks of 4 requests: the total, the carried prefix and the pads' closed forms cross
    block boundaries (13 real requests, 23 pads: 37 offsets in 10 blocks)."""
    monkeypatch.setattr(MODULE, "_MIN_BLOCK", 1)
    monkeypatch.setattr(MODULE, "_MAX_BLOCK", 4)
    rng = random.Random(seed)
    lens = [rng.randint(0, 9) for _ in range(13)]
    total = sum(lens)
    T = rng.randint(0, max(total - 1, 0)) if overflow else total + rng.randint(0, 60)
    what = f"seed={seed}"
    out, qo, status = _run(device, lens, T, 36, note=what)
    want = Status.OUT_OF_CAPACITY if overflow and total > T else Status.OK
    assert status == want, f"{status!r} [{what}]"
    _check_bucket(lens, T, 36, out, qo, what)


# -------------------------------------------------------------------------- capped (dense)
def _check_capped(lens, T, Bp, cap, out, qo, what):
    """The capped layout read against the uncapped one: each length min(·, cap) of the padded
    length, qo_indptr their exclusive prefix sum from 0 (ending at most at T)."""
    full = torch.tensor(lens + [0] * (Bp - len(lens)), dtype=torch.int64)
    full[: len(lens)] = torch.tensor(lens, dtype=torch.int64)
    # The uncapped padding of a valid split, from the contract: pads share the leftover.
    left, pads = T - sum(lens), Bp - len(lens)
    if pads:
        full[len(lens):] = left // pads
        full[len(lens) : len(lens) + left % pads] += 1
    elif lens:
        full[len(lens) - 1] += left
    want = full.clamp(max=cap)
    assert torch.equal(out, want), f"lengths {out.tolist()}, want {want.tolist()} [{what}]"
    assert int(qo[0]) == 0 and torch.equal(qo[1:], out.cumsum(0)), f"{qo.tolist()} [{what}]"
    assert int(qo[-1]) <= T, f"qo_indptr ends past T: {qo.tolist()} [{what}]"


@pytest.mark.parametrize("B,pads", [(1, 0), (5, 0), (6, 3), (0, 4), (11, 21)])
def test_capped_matches_reference_and_the_contract(device, seed, B, pads):
    """A dense consumer's layout (cap = N): every padded length clamped to N, the offsets of
    the clamped lengths; the real requests' lengths are as without a cap."""
    rng = random.Random(seed)
    N = rng.randint(1, 8)
    lens = [rng.randint(0, N) for _ in range(B)]
    Bp = B + pads
    T = sum(lens) + rng.randint(0, max(Bp * N - sum(lens), 0))
    what = f"seed={seed}"
    out, qo, status = _run(device, lens, T, Bp, note=what, n=N, cap=N)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_capped(lens, T, Bp, N, out, qo, what)


def test_capped_loops_over_several_blocks(device, seed, monkeypatch):
    """Blocks of 4: the clamped lengths' carried sum crosses block boundaries."""
    monkeypatch.setattr(MODULE, "_MIN_BLOCK", 1)
    monkeypatch.setattr(MODULE, "_MAX_BLOCK", 4)
    rng = random.Random(seed)
    lens = [rng.randint(0, 5) for _ in range(9)]
    T = sum(lens) + rng.randint(0, 70)
    what = f"seed={seed}"
    out, qo, status = _run(device, lens, T, 17, note=what, cap=5)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_capped(lens, T, 17, 5, out, qo, what)


@pytest.mark.parametrize("fn", [pad_verify_lens_to_bucket_ref, pad_verify_lens_to_bucket])
@pytest.mark.parametrize(
    "lens,T,Bp,cap,want_out,want_qo",
    [
        # no pad: the last request's 5 is clamped to 4, the offsets end at 7 < T
        ([3, 1], 8, 2, 4, [3, 4], [0, 3, 7]),
        # leftover 9 over 2 pads: 5 and 4, the first clamped to 4
        ([3, 1], 13, 4, 4, [3, 1, 4, 4], [0, 3, 4, 8, 12]),
        # nothing to clamp: as without a cap
        ([3, 1], 8, 4, 4, [3, 1, 2, 2], [0, 3, 4, 6, 8]),
    ],
)
def test_hand_worked_capped_buckets(device, fn, lens, T, Bp, cap, want_out, want_qo):
    v = torch.tensor(lens, dtype=torch.int32, device=device)
    status = new_status(device)
    out, qo = fn(v, T, Bp, status=status, cap=cap)
    assert out.cpu().tolist() == want_out
    assert qo.cpu().tolist() == want_qo
    assert int(status) == 0


# -------------------------------------------------------------------- worked by hand (design)
@pytest.mark.parametrize("fn", [pad_verify_lens_to_bucket_ref, pad_verify_lens_to_bucket])
@pytest.mark.parametrize(
    "lens,T,Bp,want_out,want_qo,bits",
    [
        # leftover 4 over 2 pads: 2 each
        ([3, 1], 8, 4, [3, 1, 2, 2], [0, 3, 4, 6, 8], Status.OK),
        # leftover 5 over 2 pads: 2 each, one more for the first
        ([3, 1], 9, 4, [3, 1, 3, 2], [0, 3, 4, 7, 9], Status.OK),
        # no pad request: the last real request takes the leftover 4
        ([3, 1], 8, 2, [3, 5], [0, 3, 8], Status.OK),
        # 9 tokens in a bucket of 5: request 1 is cut to 2, request 2 and the pad get 0
        ([3, 4, 2], 5, 4, [3, 2, 0, 0], [0, 3, 5, 5, 5], Status.OUT_OF_CAPACITY),
        # -2 reads as 0; no pad, so the last request takes 6 - 4 = 2 more
        ([3, -2, 1], 6, 3, [3, 0, 3], [0, 3, 3, 6], Status.POS_OOB),
        # no real request: 7 tokens over 3 pads
        ([], 7, 3, [3, 2, 2], [0, 3, 5, 7], Status.OK),
        ([], 0, 0, [], [0], Status.OK),
    ],
)
def test_hand_worked_buckets(device, fn, lens, T, Bp, want_out, want_qo, bits):
    status = new_status(device)
    out, qo = fn(torch.tensor(lens, dtype=torch.int32, device=device), T, Bp, status=status)
    assert out.dtype == torch.int32 and qo.dtype == torch.int32
    assert out.tolist() == want_out and qo.tolist() == want_qo
    assert Status(int(status)) == bits


# ------------------------------------------------------------------------------- adversarial
@pytest.mark.parametrize(
    "lens,T,Bp",
    [
        ([0, 0, 0, 0, 0], 7, 8),  # nothing to verify: the pads take the whole bucket
        ([0, 0, 0, 0, 0], 7, 5),  # nothing to verify and no pad: the last request takes it all
        ([0, 0, 0, 0, 0], 0, 8),  # an empty bucket
        ([0, 0, 11, 0], 11, 6),  # all tokens on one request, sum(v) == T: pads get 0
        ([0, 0, 0, 11], 16, 4),  # all tokens on the last request, which takes the leftover
        ([2, 5, 1, 3, 4], 15, 5),  # B == Bp, sum(v) == T exactly
        ([2, 5, 1, 3, 4], 15, 9),  # sum(v) == T exactly with pads: they get 0
        ([2, 5, 1, 3, 4], 20, 5),  # B == Bp with a leftover
        ([], 9, 1),  # B = 0: one pad holds the bucket
        ([], 0, 4),  # B = 0, empty bucket
        ([], 0, 0),  # B = Bp = 0: qo_indptr = [0] and nothing else
    ],
)
def test_valid_splits(device, lens, T, Bp):
    out, qo, status = _run(device, lens, T, Bp)
    assert status == Status.OK
    what = f"verify_lens={lens} T={T} Bp={Bp}"
    _check_bucket(lens, T, Bp, out, qo, what)
    B = len(lens)
    if Bp > B:
        assert out[:B].tolist() == lens, what
    elif B:
        assert out[: B - 1].tolist() == lens[:-1] and int(out[B - 1]) == lens[-1] + T - sum(lens)


@pytest.mark.parametrize(
    "lens,T,Bp,dtype",
    [
        ([3, 4, 2], 5, 6, torch.int32),  # pads present: they get 0
        ([3, 4, 2], 5, 3, torch.int32),  # B == Bp
        ([6, 6], 5, 2, torch.int32),  # the first request alone overflows
        ([1, 2, 2**31 - 1], 4, 5, torch.int32),  # the largest int32 length
        ([1, 2**62, 2**62, 2**62], 10, 6, torch.int64),  # a sum that wraps int64 unclamped
        ([1, 2], 0, 4, torch.int32),  # an empty bucket
    ],
)
def test_overflow_sets_capacity_alone_and_stays_in_the_bucket(device, lens, T, Bp, dtype):
    """sum(v) > T: OUT_OF_CAPACITY alone; the real lengths are taken in order until the bucket
    is full and the pads get 0, so the bucket still sums to T; nothing lands past it (the
    canary after out[Bp - 1] and qo_indptr[Bp] survives)."""
    out, qo, status = _run(device, lens, T, Bp, dtype=dtype)
    assert status == Status.OUT_OF_CAPACITY
    _check_bucket(lens, T, Bp, out, qo, f"verify_lens={lens} T={T} Bp={Bp}")
    fill, want = T, []
    for v in lens:
        want.append(min(v, fill))
        fill -= want[-1]
    assert out.tolist() == want + [0] * (Bp - len(lens))


@pytest.mark.parametrize(
    "lens,T,Bp",
    [
        ([3, -2, 1], 10, 5),  # pads take the leftover of 3 + 0 + 1
        ([3, -2, 1], 10, 3),  # no pad: the last request takes it
        ([-1], 4, 1),
        ([-(2**31), 5], 5, 2),  # the most negative int32, sum(v) == T once it reads as 0
    ],
)
def test_negative_length_sets_pos_oob_alone(device, lens, T, Bp):
    out, qo, status = _run(device, lens, T, Bp)
    assert status == Status.POS_OOB
    read = [max(v, 0) for v in lens]
    _check_bucket(read, T, Bp, out, qo, f"verify_lens={lens} T={T} Bp={Bp}")
    negative = [b for b, v in enumerate(lens) if v < 0 and b < len(lens) - (Bp == len(lens))]
    assert all(int(out[b]) == 0 for b in negative), out.tolist()


@pytest.mark.parametrize(
    "lens,T,Bp",
    [
        ([3, 9, 1], 12, 5),  # 9 > N = 4 reads as 4; the pads take the leftover of 3 + 4 + 1
        ([3, 9, 1], 12, 3),  # no pad: the last request takes it
        ([2**31 - 1], 4, 1),
    ],
)
def test_a_real_length_past_n_sets_pos_oob_alone(device, lens, T, Bp):
    """With ``num_draft_tokens = N`` a real ``v_b > N`` is a fault: read as ``N``, reported;
    without it the same lengths are only bounded by the bucket."""
    out, qo, status = _run(device, lens, T, Bp, n=4)
    assert status == Status.POS_OOB
    read = [min(v, 4) for v in lens]
    _check_bucket(read, T, Bp, out, qo, f"verify_lens={lens} T={T} Bp={Bp}")
    assert all(int(out[b]) == read[b] for b in range(len(lens) - (Bp == len(lens))))
    same, _, clean = _run(device, read, T, Bp, n=4)
    assert clean == Status.OK and torch.equal(out, same), (out.tolist(), same.tolist())


def test_both_faults_set_both_bits(device):
    out, qo, status = _run(device, [-4, 9, 9], 10, 4)
    assert status == Status.POS_OOB | Status.OUT_OF_CAPACITY
    assert out.tolist() == [0, 9, 1, 0] and qo.tolist() == [0, 0, 9, 10, 10]


def test_a_bound_stage_reads_the_lengths_on_every_call(device):
    """The lengths are device values read by each launch, not baked in when bound."""
    v = torch.tensor([3, 1], dtype=torch.int32, device=device)
    stage = bind_pad_verify_lens_to_bucket(v, 9, 4, status=new_status(device))
    out, qo = stage()
    assert out.tolist() == [3, 1, 3, 2] and qo.tolist() == [0, 3, 4, 7, 9]
    v.copy_(torch.tensor([0, 5]))
    assert stage() == (out, qo)
    assert out.tolist() == [0, 5, 2, 2] and qo.tolist() == [0, 0, 5, 7, 9]


# ------------------------------------------------------------------------------ host checks
@pytest.mark.parametrize("fn", [pad_verify_lens_to_bucket, pad_verify_lens_to_bucket_ref])
def test_bad_arguments_name_the_call_argument_and_value(device, fn):
    call = fn.__name__
    v = torch.tensor([3, 1, 2], dtype=torch.int32, device=device)
    i32 = torch.zeros(8, dtype=torch.int32, device=device)
    cases = [
        (ValueError, (v, 8, 2), {}, ["padded_batch", "B = 3", "got 2", "Bp >= B"]),
        (ValueError, (v, -1, 4), {}, ["num_tokens", "got -1", "token count"]),
        (ValueError, (v, 2**31, 4), {}, ["num_tokens", f"got {2**31}"]),
        (ValueError, (v[:0], 3, 0), {}, ["padded_batch", "num_tokens=3", "padded_batch=0"]),
        (TypeError, (v.float(), 8, 4), {}, ["verify_lens", "float32", "verify_lens.to("]),
        (TypeError, (v, 8, 4), {"out": i32.float()}, ["out", "float32", "out.to("]),
        (TypeError, (v, 8.0, 4), {}, ["num_tokens", "float"]),
        (TypeError, (v, 8, True), {}, ["padded_batch", "bool"]),
        (ValueError, (v.view(1, 3), 8, 4), {}, ["verify_lens", "rank 1", "(1, 3)"]),
        (ValueError, (v, 8, 4), {"out": i32[:3]}, ["out is too small", "need 4", "have 3"]),
        (ValueError, (v, 8, 4), {"qo_indptr": i32[:4]}, ["qo_indptr", "need 5", "have 4"]),
        (ValueError, (v, 8, 4), {"status": i32[:2]}, ["status", "(2,)"]),
        (ValueError, (v, 8, 4), {"cap": 0}, ["cap", ">= 1", "got 0"]),
        (TypeError, (v, 8, 4), {"cap": 2.0}, ["cap", "float"]),
    ]
    for exc, args, kwargs, words in cases:
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
        text = str(info.value)
        assert text.startswith(f"{call}: "), text
        missing = [w for w in words if w not in text]
        assert not missing, f"{missing} not in {text!r}"
