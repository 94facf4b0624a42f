"""One planted fault, one status bit (design §2.5).

For every status bit a launcher can set, a batch that is clean but for exactly ONE fault must
set that bit and no other, in the kernel and in its torch reference alike. A batch carrying two
faults that set the same bit hides a deleted detection (deleting ``| ~L_ok`` from
``prefix_page_table`` once passed every test for that reason); one fault per batch does not.

The clean batch: ``B = 3`` requests on rows 2, 5, 1 of an ``[8, 64]`` ``req_to_token`` whose
row ``r`` holds slots ``r·64 + p`` (page aligned, every slot > 0 off row 0), prefixes
``[5, 9, 3]``, ``K = 2``, ``S = 3``, ``ps = 4`` (slot layout B) unless a case says otherwise.
Outputs are sized with room to spare, so only the planted fault can set a bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import specmeta.kernels as k
from specmeta import Status, new_status

R, W_ROW, K, S, PS = 8, 64, 2, 3, 4
OK_LENS = (5, 9, 3)
OK_ROWS = (2, 5, 1)


@dataclass(frozen=True)
class Batch:
    rows: tuple = OK_ROWS
    lens: tuple = OK_LENS
    bad_slot: tuple | None = None  # (row, position, value) planted in req_to_token
    dtype: torch.dtype = torch.int32

    def tensors(self, device):
        r2t = torch.arange(R * W_ROW, dtype=torch.int64).view(R, W_ROW)
        r2t[0] = 0
        if self.bad_slot is not None:
            row, pos, value = self.bad_slot
            r2t[row, pos] = value
        return (
            torch.tensor(self.rows, dtype=self.dtype, device=device),
            r2t.to(torch.int32).to(device),
            torch.tensor(self.lens, dtype=self.dtype, device=device),
        )


CLEAN = Batch()
BAD_ROW = Batch(rows=(2, R + 3, 1))
NEG_ROW = Batch(rows=(2, -1, 1))
NEG_LEN = Batch(lens=(5, -3, 3))
NEG_LEN64 = Batch(lens=(5, -(2**40), 3), dtype=torch.int64)


def _status(fn, *args, **kw):
    """The status word of one call, on the device of the call's first tensor argument."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    status = new_status(first.device)
    fn(*args, status=status, **kw)
    return Status(int(status))


def _both(name, device, call):
    """Status of the kernel and of its reference for one call pattern."""
    return call(getattr(k, name), device), call(getattr(k, f"{name}_ref"), device)


# --------------------------------------------------------------------------------------------
# Call patterns: (launcher name, call(fn, device) -> Status).
# --------------------------------------------------------------------------------------------
def assign(batch, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw
    return lambda fn, d: _status(fn, *batch.tensors(d), **kw)


def tail_pairs(batch, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw
    return lambda fn, d: _status(fn, *batch.tensors(d), **kw)


def draft_kv(batch, width=4096, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw

    def call(fn, d):
        out = torch.zeros(S, width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), kv_indices=out, **kw)

    return call


def verify_kv(batch, width=4096, extra=4):
    def call(fn, d):
        out = torch.zeros(width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), extra_tokens=extra, kv_indices=out)

    return call


def shared_kv(batch, width=4096, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw

    def call(fn, d):
        out = torch.zeros(width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), prefix_kv_indices=out, **kw)

    return call


def branch_pt(batch, width=64, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw

    def call(fn, d):
        table = torch.zeros(3 * K, width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), page_table=table, **kw)

    return call


def branch_kv(batch, width=4096, **kw):
    kw = dict(topk=K, num_steps=S, page_size=PS) | kw

    def call(fn, d):
        out = torch.zeros(S, width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), kv_indices=out, **kw)

    return call


def prefix_pt(batch, width=64, **kw):
    kw = dict(page_size=PS) | kw

    def call(fn, d):
        table = torch.zeros(3, width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), page_table=table, **kw)

    return call


def _draft_slots(batch, d, page_size=PS, plant=None):
    """out_cache_loc of the batch (from the clean rows when a row is bad), one entry planted."""
    rows, r2t, lens = replace(batch, rows=OK_ROWS).tensors(d)
    loc = k.assign_draft_cache_locs(rows, r2t, lens, topk=K, num_steps=S, page_size=page_size,
                                    status=new_status(d))  # fmt: skip
    if plant is not None:
        loc[plant[0]] = plant[1]
    return loc


def expand_pt(batch, plant=None, page_size=PS, **kw):
    def call(fn, d):
        loc = _draft_slots(batch, d, page_size, plant)
        lens = batch.tensors(d)[2]
        return _status(fn, loc, lens, topk=K, num_steps=S, page_size=page_size, **kw)

    return call


def fused_pt(batch, plant=None, page_size=PS, width=64, **kw):
    def call(fn, d):
        loc = _draft_slots(batch, d, page_size, plant)
        table = torch.zeros(3, width, dtype=torch.int32, device=d)
        return _status(fn, *batch.tensors(d), loc, topk=K, num_steps=S, page_size=page_size,
                       exclude_last_partial=page_size > 1, page_table=table, **kw)  # fmt: skip

    return call


def verify_expand(batch):
    def call(fn, d):
        m = torch.eye(4, dtype=torch.bool, device=d).expand(3, 4, 4).clone()
        m[:, :, 0] = True
        return _status(fn, *batch.tensors(d), m)

    return call


def tree_mask(lens, width=4096, dtype=torch.int32, packed=False):
    def call(fn, d):
        m = torch.eye(4, dtype=torch.bool, device=d).expand(len(lens), 4, 4).clone()
        out = torch.zeros(width, dtype=torch.uint8 if packed else torch.bool, device=d)
        seq = torch.tensor(lens, dtype=dtype, device=d)
        return _status(fn, seq, m, packed=packed, custom_mask=out)

    return call


def accept(index, lens):
    def call(fn, d):
        idx = torch.tensor(index, dtype=torch.int32, device=d)
        acc = torch.tensor(lens, dtype=torch.int32, device=d)
        loc = torch.arange(10, 10 + 3 * 4, dtype=torch.int64, device=d)
        return _status(fn, idx, acc, loc, num_draft_tokens=4)

    return call


def move(tgt, src):
    def call(fn, d):
        bufs = [torch.arange(8 * 4, dtype=torch.float32, device=d).view(8, 4)]
        return _status(fn, bufs, torch.tensor(tgt, device=d), torch.tensor(src, device=d))

    return call


CASES = [
    # name, case id, call pattern, the one bit expected
    ("assign_draft_cache_locs", "bad row", assign(BAD_ROW), Status.ROW_OOB),
    ("assign_draft_cache_locs", "negative row", assign(NEG_ROW), Status.ROW_OOB),
    ("assign_draft_cache_locs", "negative length", assign(NEG_LEN), Status.POS_OOB),
    ("assign_draft_cache_locs", "negative int64 length", assign(NEG_LEN64), Status.POS_OOB),
    ("assign_draft_cache_locs", "slot past the row", assign(Batch(lens=(5, 60, 3))), Status.POS_OOB),
    ("prefix_tail_copy_pairs", "bad row", tail_pairs(BAD_ROW), Status.ROW_OOB),
    ("prefix_tail_copy_pairs", "negative row", tail_pairs(NEG_ROW), Status.ROW_OOB),
    ("prefix_tail_copy_pairs", "negative row, layout A", tail_pairs(NEG_ROW, page_size=1),
     Status.ROW_OOB),
    ("prefix_tail_copy_pairs", "negative length", tail_pairs(NEG_LEN), Status.POS_OOB),
    ("prefix_tail_copy_pairs", "negative length, layout A", tail_pairs(NEG_LEN, topk=1),
     Status.POS_OOB),
    ("prefix_tail_copy_pairs", "target past the row", tail_pairs(Batch(lens=(5, 61, 3))),
     Status.POS_OOB),
    ("draft_decode_kv_indices", "bad row", draft_kv(BAD_ROW), Status.ROW_OOB),
    ("draft_decode_kv_indices", "negative length", draft_kv(NEG_LEN), Status.POS_OOB),
    ("draft_decode_kv_indices", "prefix past the row", draft_kv(Batch(lens=(5, 70, 3)), page_size=1,
                                                                 topk=1), Status.POS_OOB),
    ("draft_decode_kv_indices", "chain past the row", draft_kv(Batch(lens=(5, 60, 3))),
     Status.POS_OOB),
    ("draft_decode_kv_indices", "kv_indices too small", draft_kv(CLEAN, width=40),
     Status.OUT_OF_CAPACITY),
    ("verify_kv_indices", "bad row", verify_kv(BAD_ROW), Status.ROW_OOB),
    ("verify_kv_indices", "negative length", verify_kv(NEG_LEN), Status.POS_OOB),
    ("verify_kv_indices", "list past the row", verify_kv(Batch(lens=(5, 62, 3))), Status.POS_OOB),
    ("verify_kv_indices", "kv_indices too small", verify_kv(CLEAN, width=20),
     Status.OUT_OF_CAPACITY),
    ("shared_prefix_kv_indices", "bad row", shared_kv(BAD_ROW), Status.ROW_OOB),
    ("shared_prefix_kv_indices", "negative length", shared_kv(NEG_LEN), Status.POS_OOB),
    ("shared_prefix_kv_indices", "chain past the row", shared_kv(Batch(lens=(5, 60, 3))),
     Status.POS_OOB),
    ("shared_prefix_kv_indices", "prefix past the row", shared_kv(Batch(lens=(5, 70, 3)),
                                                                   page_size=1, topk=1,
                                                                   num_rows=0), Status.POS_OOB),
    ("shared_prefix_kv_indices", "prefix too small", shared_kv(CLEAN, width=10),
     Status.OUT_OF_CAPACITY),
    ("branch_page_table", "bad row", branch_pt(BAD_ROW), Status.ROW_OOB),
    ("branch_page_table", "negative length", branch_pt(NEG_LEN), Status.POS_OOB),
    ("branch_page_table", "page past the row", branch_pt(Batch(lens=(5, 60, 3))), Status.POS_OOB),
    ("branch_page_table", "table too narrow", branch_pt(CLEAN, width=2), Status.OUT_OF_CAPACITY),
    ("branch_kv_indices", "bad row", branch_kv(BAD_ROW), Status.ROW_OOB),
    ("branch_kv_indices", "negative length", branch_kv(NEG_LEN), Status.POS_OOB),
    ("branch_kv_indices", "page past the row", branch_kv(Batch(lens=(5, 60, 3))), Status.POS_OOB),
    ("branch_kv_indices", "kv_indices too small", branch_kv(CLEAN, width=12),
     Status.OUT_OF_CAPACITY),
    ("prefix_page_table", "bad row", prefix_pt(BAD_ROW), Status.ROW_OOB),
    ("prefix_page_table", "negative length", prefix_pt(NEG_LEN), Status.POS_OOB),
    ("prefix_page_table", "negative int64 length", prefix_pt(NEG_LEN64), Status.POS_OOB),
    ("prefix_page_table", "page past the row", prefix_pt(Batch(lens=(5, 70, 3))), Status.POS_OOB),
    ("prefix_page_table", "table too narrow", prefix_pt(CLEAN, width=2), Status.OUT_OF_CAPACITY),
    ("prefix_page_table", "negative slot", prefix_pt(Batch(bad_slot=(5, 4, -8))), Status.POOL_OOB),
    ("expand_page_table", "negative length", expand_pt(NEG_LEN), Status.POS_OOB),
    ("expand_page_table", "negative slot", expand_pt(CLEAN, plant=(8, -1)), Status.POOL_OOB),
    ("expand_page_table", "int32-min slot, flat", expand_pt(CLEAN, plant=(7, -(2**31)),
                                                             page_size=1), Status.POOL_OOB),
    ("expand_page_table", "negative slot in an unbuilt step",
     expand_pt(CLEAN, plant=(8, -1), num_rows=2), Status.POOL_OOB),
    ("expand_page_table", "slot off the layout", expand_pt(CLEAN, plant=(7, 5 * 64 + 40)),
     Status.BAD_PAGE),
    ("draft_decode_page_tables", "bad row", fused_pt(BAD_ROW), Status.ROW_OOB),
    ("draft_decode_page_tables", "negative length", fused_pt(NEG_LEN), Status.POS_OOB),
    ("draft_decode_page_tables", "table too narrow", fused_pt(CLEAN, width=1),
     Status.OUT_OF_CAPACITY),
    ("draft_decode_page_tables", "negative slot in the row", fused_pt(Batch(bad_slot=(5, 4, -8))),
     Status.POOL_OOB),
    ("draft_decode_page_tables", "negative draft slot", fused_pt(CLEAN, plant=(8, -1)),
     Status.POOL_OOB),
    ("draft_decode_page_tables", "int32-min draft slot in an unbuilt step",
     fused_pt(CLEAN, plant=(8, -(2**31)), num_rows=2), Status.POOL_OOB),
    ("draft_decode_page_tables", "draft slot off the layout", fused_pt(CLEAN, plant=(7, 5 * 64 + 40)),
     Status.BAD_PAGE),
    ("verify_expand_page_table", "bad row", verify_expand(BAD_ROW), Status.ROW_OOB),
    ("verify_expand_page_table", "negative length", verify_expand(NEG_LEN), Status.POS_OOB),
    ("verify_expand_page_table", "window past the row", verify_expand(Batch(lens=(5, 62, 3))),
     Status.POS_OOB),
    ("verify_expand_page_table", "negative slot", verify_expand(Batch(bad_slot=(5, 10, -8))),
     Status.POOL_OOB),
    ("tree_custom_mask", "negative length", tree_mask((5, -3, 3)), Status.POS_OOB),
    ("tree_custom_mask", "negative int64 length", tree_mask((5, -(2**40), 3), dtype=torch.int64),
     Status.POS_OOB),
    ("tree_custom_mask", "mask too small", tree_mask((5, 9, 3), width=100), Status.OUT_OF_CAPACITY),
    ("tree_custom_mask", "packed mask too small", tree_mask((5, 9, 3), width=10, packed=True),
     Status.OUT_OF_CAPACITY),
    ("accept_cache_locs", "entry outside the window", accept([[0, 1], [4, 9], [8, -1]], [2, 2, 1]),
     Status.BAD_ACCEPT),
    ("accept_cache_locs", "-1 run not a suffix", accept([[0, 1], [-1, 5], [8, -1]], [2, 0, 1]),
     Status.BAD_ACCEPT),
    ("accept_cache_locs", "length past the row", accept([[0, 1], [4, 5], [8, -1]], [2, 3, 1]),
     Status.BAD_ACCEPT),
    ("move_kv_cache", "target past the pool", move([1, 9, 0], [2, 3, 0]), Status.POOL_OOB),
    ("move_kv_cache", "negative source", move([1, 4, 0], [2, -1, 0]), Status.POOL_OOB),
]  # fmt: skip


@pytest.mark.parametrize("name, case, call, bit", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_one_fault_sets_its_bit_alone(name, case, call, bit, device):
    kernel, reference = _both(name, device, call)
    assert kernel == bit, f"{name} ({case}): kernel set {kernel!r}, want {bit!r} alone"
    assert reference == bit, f"{name} ({case}): reference set {reference!r}, want {bit!r} alone"


CLEAN_CASES = [
    ("assign_draft_cache_locs", assign(CLEAN)),
    ("prefix_tail_copy_pairs", tail_pairs(CLEAN)),
    ("draft_decode_kv_indices", draft_kv(CLEAN)),
    ("verify_kv_indices", verify_kv(CLEAN)),
    ("shared_prefix_kv_indices", shared_kv(CLEAN)),
    ("branch_page_table", branch_pt(CLEAN)),
    ("branch_kv_indices", branch_kv(CLEAN)),
    ("prefix_page_table", prefix_pt(CLEAN)),
    ("expand_page_table", expand_pt(CLEAN)),
    ("draft_decode_page_tables", fused_pt(CLEAN)),
    ("verify_expand_page_table", verify_expand(CLEAN)),
    ("tree_custom_mask", tree_mask(OK_LENS)),
    ("accept_cache_locs", accept([[0, 1], [4, 5], [8, -1]], [2, 2, 1])),
    ("move_kv_cache", move([1, 4, 0], [2, 3, 0])),
]


@pytest.mark.parametrize("name, call", CLEAN_CASES, ids=[c[0] for c in CLEAN_CASES])
def test_the_clean_batch_sets_no_bit_anywhere(name, call, device):
    kernel, reference = _both(name, device, call)
    assert kernel == Status.OK and reference == Status.OK, (kernel, reference)
