"""The FA3 expand pass of a ragged verify (issue 40, design §2.9): ``verify_expand_ragged``.

Every query row ``qo_indptr[i] + j`` of the bucket lists the window slots it may see: node
``j < min(v_i, N)`` its ancestors among the first ``min(v_i, N)`` nodes, then the others; a
filler row ``j ≥ N`` every node in order; a row of no request nothing. The kernel runs into
guarded, poisoned buffers and is compared exactly, whole buffers and status words, with its
reference, and both with the rule read here with plain loops; splits are random (the issue's
padding rule over fresh lengths, tree or chain) and adversarial (nothing verified, one request
taking the whole bucket with filler rows, a bucket larger than its requests' rows). Faults are
planted one at a time with their bit alone.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.verify_expand_ragged import verify_expand_ragged, verify_expand_ragged_ref
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import padded_lengths, row_width, verify_split
from tests.guard_bands import POISON, Guarded, assert_equal

K, S = 2, 3


def _batch(gen, device, n, B):
    batch = make_batch("random", batch_size=B, topk=K, num_steps=S, page_size=1,
                       row_width=row_width(K, S, 1, extra=n), generator=gen, device=device,
                       extra_tokens=n)  # fmt: skip
    return batch, random_tree_mask(B, K, S, n, gen).to(device)


def _offsets(lens):
    return [sum(lens[:i]) for i in range(len(lens) + 1)]


def _rule(batch, tree, qo, T, n, width):
    """Rows and counts from the rule, read directly."""
    r2t = batch.req_to_token.cpu()
    table = [[0] * width for _ in range(T)]
    counts = [0] * T
    for i in range(batch.batch_size):
        L, row = int(batch.seq_lens_cpu[i]), r2t[int(batch.req_pool_indices[i])]
        rows = qo[i + 1] - qo[i]
        V = min(rows, n)
        window = [int(row[L + c]) for c in range(V)]
        for j in range(rows):
            if j < n:
                seen = [c for c in range(V) if (c <= j if tree is None else bool(tree[i, j, c]))]
                order = seen + [c for c in range(V) if c not in seen]
                counts[qo[i] + j] = len(seen)
            else:
                order = list(range(V))
                counts[qo[i] + j] = V
            table[qo[i] + j][:V] = [window[c] for c in order]
    return table, counts


def _run(batch, tree, qo, T, n, device, width=None, compare=True):
    """Kernel into guarded buffers, reference into poisoned ones; both compared whole (only
    the guards and the status words with ``compare=False``: rows that two requests' faulty
    offsets share are written by both, in an order the device does not fix)."""
    width = n + 3 if width is None else width
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
            torch.tensor(qo, dtype=torch.int32, device=device))  # fmt: skip
    kw = dict(num_rows=T, num_draft_tokens=n)
    pt, cs, cu = (Guarded((T + 2, width), torch.int32, device), Guarded((T + 2,), torch.int32, device),
                  Guarded((T + 3,), torch.int32, device))  # fmt: skip
    status, ref_status = new_status(device), new_status(device)
    verify_expand_ragged(*args, page_table=pt.view, cache_seqlens=cs.view, cu_seqlens_k=cu.view,
                         status=status, **kw)  # fmt: skip
    ref = [t.view.clone().fill_(POISON) for t in (pt, cs, cu)]
    verify_expand_ragged_ref(*args, page_table=ref[0], cache_seqlens=ref[1], cu_seqlens_k=ref[2],
                             status=ref_status, **kw)  # fmt: skip
    for got, want, name in zip((pt, cs, cu), ref, ("page_table", "cache_seqlens", "cu_seqlens_k"),
                               strict=True):  # fmt: skip
        got.assert_intact(name)
        if compare:
            assert_equal(got.view, want, f"{name} vs reference (qo={qo}, T={T})")
    assert_equal(status, ref_status, "status vs reference")
    return pt.view.cpu(), cs.view.cpu(), cu.view.cpu(), int(status)


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
def test_rows_match_reference_and_rule(device, gen, how, chain):
    n, Bp = 5, 4
    batch, tree = _batch(gen, device, n, Bp)
    real, T = verify_split(gen, Bp, n, how)
    qo = _offsets(padded_lengths(real, T, Bp))
    pt, cs, cu, status = _run(batch, None if chain else tree, qo, T, n, device)
    table, counts = _rule(batch, None if chain else tree.cpu(), qo, T, n, n + 3)
    assert pt[:T].tolist() == table and cs[:T].tolist() == counts, (real, T)
    assert cu[: T + 1].tolist() == _offsets(counts)
    assert (pt[T:] == POISON).all() and (cs[T:] == POISON).all(), "written past the bucket"
    assert status == 0


def test_rows_of_no_request_are_empty_and_every_row_is_written(device, gen):
    n = 4
    batch, tree = _batch(gen, device, n, 3)
    qo, T = [0, 2, 2, 3], 7  # the bucket holds 4 rows no request owns
    pt, cs, _, status = _run(batch, tree, qo, T, n, device)
    assert cs[3:T].tolist() == [0] * 4 and (pt[3:T] == 0).all()
    assert status == 0


def test_hand_worked_example(device):
    """The docstring's example: N = 2, a chain, two requests, one filler row, one empty."""
    r2t = torch.zeros(3, 8, dtype=torch.int32)
    r2t[1, 3:5] = torch.tensor([30, 31])
    r2t[2, 1:3] = torch.tensor([10, 11])
    pt, cs = verify_expand_ragged(
        torch.tensor([1, 2]).to(device), r2t.to(device), torch.tensor([3, 1]).to(device), None,
        torch.tensor([0, 1, 4]).to(device), num_rows=5, num_draft_tokens=2,
    )  # fmt: skip
    assert pt.tolist() == [[30, 0], [10, 11], [10, 11], [10, 11], [0, 0]]
    assert cs.tolist() == [1, 1, 2, 2, 0]


@pytest.mark.parametrize("fault", ["past_bucket", "decreasing", "negative_start"])
def test_a_bad_offset_sets_its_bit_alone(device, gen, fault):
    n = 4
    batch, tree = _batch(gen, device, n, 3)
    qo, T, bit = {
        "past_bucket": ([0, 3, 5, 9], 8, Status.OUT_OF_CAPACITY),
        "decreasing": ([0, 3, 2, 6], 6, Status.POS_OOB),
        "negative_start": ([0, 2, -1, 3], 3, Status.POS_OOB),
    }[fault]
    _, _, _, status = _run(batch, tree, qo, T, n, device, compare=False)
    assert status == int(bit), Status(status)


def test_bad_arguments_are_refused_naming_the_call(device, gen):
    batch, tree = _batch(gen, device, 4, 2)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for kw, words in [
        (dict(tree_mask=None, qo_indptr=qo, num_rows=2), "num_draft_tokens must be"),
        (dict(tree_mask=tree, qo_indptr=qo[:2], num_rows=2), "qo_indptr"),
        (dict(tree_mask=tree, qo_indptr=qo, num_rows=-1), "num_rows must be >= 0"),
        (dict(tree_mask=tree, qo_indptr=qo, num_rows=2, num_draft_tokens=3), "disagrees"),
    ]:
        with pytest.raises((TypeError, ValueError)) as err:
            verify_expand_ragged(*args, kw.pop("tree_mask"), kw.pop("qo_indptr"), **kw)
        assert str(err.value).startswith("verify_expand_ragged:") and words in str(err.value)
