"""Accept compaction over ragged verify windows (issue 40, design §2.4 and §2.9): ``qo_indptr``.

In a ragged verify, request ``i``'s query rows (and its ``out_cache_loc`` slots) are
``qo_indptr[i] … qo_indptr[i+1] − 1``; its tree nodes are the first ``w_i = min(length, N)`` of
them, the rows past ``N`` filler rows of the bucket's padding. ``accept_index`` holds rows
``qo_indptr[i] + node``; the pairs are ``tgt = out_cache_loc[qo_indptr[i] + k]``,
``src = out_cache_loc[accept_index[i, k]]``, compacted as in the uniform layout.

Each call writes into guarded, poisoned buffers longer than its ``B·C`` pairs; the kernel is
compared whole with the reference (written into poisoned buffers too) and with the rule read
directly here (Python loops over the inputs). Splits come from the padding rule of the issue
(``tests/_support.py``): ``v_b = 0`` for some or all, a length past ``N`` (filler rows), every
token on one request, ``B = 1``, ``B = 0``; every ``v_b = N`` must equal the uniform call byte
for byte. Faults are planted one at a time and each must report ``BAD_ACCEPT`` alone.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.accept_cache_locs import (
    accept_cache_locs,
    accept_cache_locs_ref,
    bind_accept_cache_locs,
)
from specmeta.workloads import random_tree_mask
from tests._support import padded_lengths, verify_split
from tests.guard_bands import POISON, Guarded, assert_equal

K, S, N = 2, 3, 5  # C = S + 1 = 4 entries a row; N − 1 ≤ K + (S − 1)·K² holds
C = S + 1
SPARE = 3  # pair entries past B·C: must stay poisoned


# ------------------------------------------------------------------------------------ inputs
def _draw(gen, lens, *, extra=0, idx_dtype=torch.int32, qo_dtype=torch.int32):
    """Accepted paths over windows of padded lengths ``lens``: request ``i`` accepts a prefix
    of the root-to-node path of a random node among its first ``min(lens[i], N)`` (ancestors
    have smaller ids, so the path stays there), as rows ``qo_indptr[i] + node``.
    ``out_cache_loc`` holds distinct slots ≥ 1, ``extra`` more than the bucket's rows."""
    B = len(lens)
    qo = [0]
    for v in lens:
        qo.append(qo[-1] + v)
    tree = random_tree_mask(B, K, S, N, gen)
    accept_index = torch.full((B, C), -1, dtype=torch.int64)
    accept_lens = torch.zeros(B, dtype=torch.int64)
    for i, v in enumerate(lens):
        w = min(v, N)
        if w == 0:
            continue
        node = int(torch.randint(0, w, (1,), generator=gen))
        path = tree[i, node].nonzero().flatten()
        k = int(torch.randint(0, path.numel() + 1, (1,), generator=gen))
        accept_index[i, :k] = path[:k] + qo[i]
        accept_lens[i] = k
    T = qo[-1] + extra
    slots = torch.randperm(3 * T + 8, generator=gen)[:T] + 1
    return (accept_index.to(idx_dtype), accept_lens.to(torch.int32), slots,
            torch.tensor(qo, dtype=qo_dtype))  # fmt: skip


def _on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


# -------------------------------------------------------------------- the rule, read directly
def _rule(accept_index, accept_lens, out_cache_loc, qo_indptr, n):
    """design §2.4 over ragged windows (§2.9), with loops: ``(tgt, src, bad)`` for ``B·C``
    pairs. Window ``i`` starts at ``qo_indptr[i]`` and holds ``min(qo_indptr[i+1] −
    qo_indptr[i], n)`` nodes; an accepted entry outside it, at ``k`` past its width or on a row
    outside ``out_cache_loc`` is a fault, its pair ``(0, 0)``."""
    idx, lens = accept_index.cpu().tolist(), accept_lens.cpu().tolist()
    slots, qo = out_cache_loc.cpu().tolist(), qo_indptr.cpu().tolist()
    B = len(idx)
    cols = len(idx[0]) if B else 0
    tgt, src = [0] * (B * cols), [0] * (B * cols)
    bad, at = False, 0
    for i in range(B):
        acc = min(max(lens[i], 0), cols)
        bad |= acc != lens[i]
        start, width = qo[i], min(qo[i + 1] - qo[i], n)
        for k in range(cols):
            e = idx[i][k]
            if k >= acc:
                bad |= e != -1
                continue
            rows_ok = 0 <= start + k < len(slots) and 0 <= e < len(slots)
            if k < width and start <= e < start + width and rows_ok:
                tgt[at + k], src[at + k] = slots[start + k], slots[e]
            else:
                bad = True
        at += acc
    return tgt, src, bad


# ------------------------------------------------------------------------------------ runner
def _run(device, accept_index, accept_lens, out_cache_loc, qo_indptr, what, *, n=N, **kw):
    """Kernel into guarded, poisoned buffers of ``B·C + SPARE`` pairs, reference into poisoned
    ones: whole buffers, canaries and status words compared exactly. Returns the kernel's
    ``(tgt, src)`` buffers (CPU, spare included) and its status."""
    B, cols = accept_index.shape
    size = B * cols + SPARE
    tgt, src = Guarded((size,), torch.int64, device), Guarded((size,), torch.int64, device)
    status, ref_status = new_status(device), new_status(device)
    args = (accept_index, accept_lens, out_cache_loc)
    got_t, got_s = accept_cache_locs(*args, num_draft_tokens=n, tgt=tgt.view, src=src.view,
                                     status=status, qo_indptr=qo_indptr, **kw)  # fmt: skip
    assert got_t.shape == got_s.shape == (B * cols,), what
    assert B == 0 or (got_t.data_ptr(), got_s.data_ptr()) == (tgt.view.data_ptr(),
                                                                src.view.data_ptr()), what  # fmt: skip
    ref_t, ref_s = torch.full_like(tgt.view, POISON), torch.full_like(src.view, POISON)
    accept_cache_locs_ref(*args, num_draft_tokens=n, tgt=ref_t, src=ref_s, status=ref_status,
                          qo_indptr=qo_indptr, **kw)  # fmt: skip
    tgt.assert_intact(f"tgt [{what}]")
    src.assert_intact(f"src [{what}]")
    assert_equal(tgt.view, ref_t, f"tgt vs reference [{what}]")
    assert_equal(src.view, ref_s, f"src vs reference [{what}]")
    assert_equal(status, ref_status, f"status vs reference [{what}]")
    return tgt.view.cpu(), src.view.cpu(), Status(int(status))


def _check(device, inputs, what, **kw):
    """:func:`_run`, then the rule read directly; returns the pairs and the status."""
    tgt, src, status = _run(device, *_on(device, *inputs), what, **kw)
    want_t, want_s, bad = _rule(*inputs, N)
    assert tgt.tolist() == want_t + [POISON] * SPARE, f"tgt vs rule [{what}]"
    assert src.tolist() == want_s + [POISON] * SPARE, f"src vs rule [{what}]"
    assert status == (Status.BAD_ACCEPT if bad else Status.OK), f"{status!r} [{what}]"
    return tgt, src, status


# ------------------------------------------------------------------------------------ splits
@pytest.mark.parametrize(
    "how,Bp,real_rows",
    [("random", 5, True), ("zeros", 4, False), ("one_takes_all", 4, False),
     ("no_pad_leftover", 4, False), ("random", 1, False)],
)  # fmt: skip
def test_splits_match_reference_and_rule(device, seed, gen, how, Bp, real_rows):
    """Splits of a bucket by the padding rule. ``zeros``: every real ``v_b = 0``, the pads take
    the bucket (lengths past ``N``: filler rows); ``one_takes_all``: every token on one
    request; ``no_pad_leftover``: the last request's filler rows; ``real_rows``: accept rows
    for the real requests only (``qo_indptr`` longer than ``B + 1``)."""
    real, T = verify_split(gen, Bp, N, how)
    lens = padded_lengths(real, T, Bp)
    inputs = _draw(gen, lens, extra=int(torch.randint(0, 3, (1,), generator=gen)),
                   idx_dtype=(torch.int32, torch.int64)[Bp % 2],
                   qo_dtype=(torch.int64, torch.int32)[Bp % 2])  # fmt: skip
    if real_rows:
        inputs = (inputs[0][: len(real)], inputs[1][: len(real)], *inputs[2:])
    what = f"seed={seed} {how} lens={lens} accept_lens={inputs[1].tolist()}"
    _, _, status = _check(device, inputs, what)
    assert status == Status.OK, what


def test_full_windows_equal_the_uniform_call(device, seed, gen):
    """Every length ``N`` and ``qo_indptr = N·arange``: the uniform call's buffers and status,
    byte for byte, on valid rows and with random entries corrupted (foreign rows, stray −1s)."""
    B = 4
    ai, al, slots, qo = _draw(gen, [N] * B)
    for corrupt in (0, 3):
        ai = ai.clone()
        for _ in range(corrupt):
            i, c = (int(torch.randint(0, hi, (1,), generator=gen)) for hi in (B, C))
            ai[i, c] = int(torch.randint(-1, B * N, (1,), generator=gen))
        what = f"seed={seed} accept_index={ai.tolist()} accept_lens={al.tolist()}"
        inputs = (ai, al, slots, qo)
        ragged = _check(device, inputs, what)
        uniform = _run(device, *_on(device, ai, al, slots), None, what)
        for name, r, u in zip(("tgt", "src", "status"), ragged, uniform, strict=True):
            assert r == u if name == "status" else torch.equal(r, u), f"{name} [{what}]"


def test_ragged_with_v2p(device, seed, gen):
    """Virtual verify slots (design §2.10): the ragged pairs leave as physical slots."""
    ai, al, slots, qo = _draw(gen, [3, 0, 7, 5])
    ps = 4
    pages = int(slots.max()) // ps + 1
    v2p = torch.randperm(2 * pages, generator=gen)[:pages]
    what = f"seed={seed} accept_index={ai.tolist()}"
    tgt, src, status = _run(device, *_on(device, ai, al, slots, qo), what, v2p=v2p.to(device),
                            page_size=ps)  # fmt: skip
    assert status == Status.OK, what
    want_t, want_s, _ = _rule(ai, al, slots, qo, N)
    phys = lambda s: int(v2p[s // ps]) * ps + s % ps if s else 0  # noqa: E731
    assert tgt.tolist() == [phys(s) for s in want_t] + [POISON] * SPARE, what
    assert src.tolist() == [phys(s) for s in want_s] + [POISON] * SPARE, what


def test_empty_batch(device):
    """``B = 0``: nothing launched, nothing written, nothing reported."""
    ai = torch.empty((0, C), dtype=torch.int32, device=device)
    al = torch.empty(0, dtype=torch.int32, device=device)
    slots = torch.arange(1, 4, device=device)
    qo = torch.zeros(1, dtype=torch.int32, device=device)
    tgt, src, status = _run(device, ai, al, slots, qo, "B = 0")
    assert status == Status.OK
    assert tgt.tolist() == [POISON] * SPARE and src.tolist() == [POISON] * SPARE


def test_docstring_example(device):
    """Request 1's rows 7 and 8 (past N = 4) are filler."""
    ai = torch.tensor([[0, 2, -1], [3, 5, 6]], device=device)
    out = accept_cache_locs(ai, torch.tensor([2, 3], device=device),
                            torch.tensor([10, 11, 12, 20, 21, 22, 23, 24, 25], device=device),
                            num_draft_tokens=4, qo_indptr=torch.tensor([0, 3, 9], device=device))  # fmt: skip
    assert [t.tolist() for t in out] == [[10, 11, 20, 21, 22, 0], [10, 12, 20, 22, 23, 0]]


def test_bound_once_reads_new_offsets(device, seed, gen):
    """A bind holds the tensors, not their values: new offsets and paths in the same tensors
    give the new pairs on the next call."""
    first, second = _draw(gen, [2, 6, 0, 4]), _draw(gen, [5, 1, 6, 0])
    held = [t.clone().to(device) for t in first]
    stage = bind_accept_cache_locs(*held[:3], num_draft_tokens=N, qo_indptr=held[3])
    for draw in (first, second):
        for t, new in zip(held, draw, strict=True):
            t.copy_(new.to(device))
        tgt, src = stage()
        want_t, want_s, _ = _rule(*draw, N)
        assert tgt.tolist() == want_t and src.tolist() == want_s, f"seed={seed}"


# ------------------------------------------------------------------------------ planted faults
def _base(gen):
    """Lengths [3, 5, 7, 2] (request 2 has two filler rows), ``qo_indptr = [0, 3, 8, 15, 17]``;
    request 0 accepts rows 0, 1 and request 3 rows 15, 16."""
    ai, al, slots, qo = _draw(gen, [3, 5, 7, 2], idx_dtype=torch.int64)
    ai[0], al[0] = torch.tensor([0, 1, -1, -1]), 2
    ai[3], al[3] = torch.tensor([15, 16, -1, -1]), 2
    return ai, al, slots, qo


def _plant(fault, ai, al, slots, qo):
    if fault == "filler_row":  # request 2's row 13 = qo[2] + N is a filler row
        ai[2], al[2] = torch.tensor([8, 13, -1, -1]), 2
    elif fault == "other_window":  # request 0 names request 1's second row
        ai[0, 1] = 9
    elif fault == "k_past_width":  # request 0 has w = 3 nodes: no fourth accepted entry
        ai[0], al[0] = torch.tensor([0, 1, 2, 2]), 4
    elif fault == "decreasing":  # request 3's window ends before it starts
        qo[4] = 14
    elif fault == "negative_start":  # request 0's window starts at row −2
        qo[0] = -2
    elif fault == "past_out_cache_loc":  # request 3's row 16 lies past out_cache_loc
        slots = slots[:16]
    else:
        raise AssertionError(fault)
    return ai, al, slots, qo


@pytest.mark.parametrize(
    "fault",
    ["filler_row", "other_window", "k_past_width", "decreasing", "negative_start",
     "past_out_cache_loc"],
)  # fmt: skip
def test_planted_fault_reports_bad_accept_alone(device, seed, gen, fault):
    """One fault on valid input: ``BAD_ACCEPT`` alone, its pair ``(0, 0)``, the other pairs in
    their places (the rule), nothing read or written outside the buffers (the guard bands)."""
    base = _base(gen)
    _, _, ok = _check(device, base, f"seed={seed} base")
    assert ok == Status.OK
    inputs = _plant(fault, *(t.clone() for t in base))
    what = f"seed={seed} {fault} accept_index={inputs[0].tolist()} qo_indptr={inputs[3].tolist()}"
    tgt, src, status = _check(device, inputs, what)
    assert status == Status.BAD_ACCEPT, f"{status!r} [{what}]"


# --------------------------------------------------------------------------------- host checks
def test_bad_qo_indptr_raises_before_launch(device):
    ai = torch.tensor([[0, -1], [2, -1]], dtype=torch.int32, device=device)
    al = torch.tensor([1, 1], device=device)
    slots = torch.arange(1, 5, device=device)
    qo = torch.tensor([0, 2, 4], device=device)
    for fn in (accept_cache_locs, accept_cache_locs_ref):
        call, name = functools.partial(fn, ai, al, slots, num_draft_tokens=2), fn.__name__
        with pytest.raises(TypeError, match=f"{name}: qo_indptr must be int32 or int64, got "
                                            "float32.*pad_verify_lens_to_bucket"):  # fmt: skip
            call(qo_indptr=qo.float())
        with pytest.raises(ValueError, match=f"{name}: qo_indptr must have rank 1"):
            call(qo_indptr=qo.view(1, 3))
        with pytest.raises(ValueError, match=rf"{name}: qo_indptr must have at least B \+ 1 = 3 "
                                             r"entries .* got shape \(2,\); pass"):  # fmt: skip
            call(qo_indptr=qo[:2])
        with pytest.raises(ValueError, match=f"{name}: qo_indptr must be on"):
            call(qo_indptr=qo.to("meta"))
        with pytest.raises(ValueError, match=f"{name}: qo_indptr must have unit stride"):
            call(qo_indptr=torch.arange(6, device=device)[::2])
