"""Outputs with huge row strides: every row offset is 64-bit (design §2.5, style §3).

A caller may hand any launcher an output that is a view into a larger buffer, whose row stride
is above 2**30 (so that ``(rows − 1) · stride`` passes 2**31 or 2**32 elements). Each output is
passed as such a view over storage from ``torch.empty`` (virtual memory: only the pages the
test fills, and those the kernel writes, are ever touched), with canaries right before and
after every row the kernel writes. The canaries must survive and the rows must equal the
reference's, computed into compact buffers. A 32-bit ``row · stride`` writes outside the view
(under the interpreter: a segmentation fault).
"""

from __future__ import annotations

import pytest
import torch

import specmeta.kernels as k
from specmeta import new_status
from tests.guard_bands import CANARY, POISON, assert_equal

STRIDES = [2**30 + 16, 2**31 + 16]
_GAP = 16  # canary entries before and after each row
ROWS = 3  # three step rows: extents (rows − 1)·stride past 2**31 and past 2**32


class HugeView:
    """A ``[rows, cols]`` view with row stride ``stride`` over ``torch.empty`` storage."""

    def __init__(self, rows, cols, stride, dtype, device):
        self.rows, self.cols, self.stride = rows, cols, stride
        self.storage = torch.empty((rows - 1) * stride + cols + 2 * _GAP, dtype=dtype,
                                   device=device)  # fmt: skip
        self.view = self.storage.as_strided((rows, cols), (stride, 1), _GAP)
        for r in range(rows):
            self._band(r, before=True).fill_(CANARY)
            self._band(r, before=False).fill_(CANARY)
        self.view.fill_(POISON)

    def _band(self, r, before):
        start = _GAP + r * self.stride + (-_GAP if before else self.cols)
        return self.storage[start : start + _GAP]

    def assert_intact(self, name):
        for r in range(self.rows):
            for before in (True, False):
                band = self._band(r, before)
                assert bool((band == CANARY).all()), (
                    f"{name}: canary {'before' if before else 'after'} row {r} overwritten"
                )


def _batch(device):
    req_to_token = torch.arange(6 * 64, dtype=torch.int32, device=device).view(6, 64)
    rpi = torch.tensor([2, 5], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    return rpi, req_to_token, seq_lens


K, S, PS = 2, ROWS, 4

# launcher, its 2-D outputs with their shapes, extra keyword arguments
CASES = {
    "branch_kv_indices": (
        dict(kv_indices=(S, 64), kv_indptr=(S, 2 * K + 1), kv_last_page_len=(S, 2 * K)),
        dict(topk=K, num_steps=S, page_size=PS),
    ),
    "branch_page_table": (
        dict(page_table=(2 * K, 16), seq_lens_k=(S, 2 * K)),
        dict(topk=K, num_steps=S, page_size=PS),
    ),
    "shared_prefix_kv_indices": (
        dict(chain_kv_indices=(S, 2 * K * S), chain_kv_indptr=(S, 2 * K + 1)),
        dict(topk=K, num_steps=S, page_size=PS),
    ),
    "draft_decode_kv_indices": (
        dict(kv_indices=(S, 256), kv_indptr=(S, 2 * K + 1)),
        dict(topk=K, num_steps=S, page_size=PS),
    ),
}

# Views of at most 16 GiB of virtual memory each (the 4-row page table skips the larger stride).
PARAMS = [(name, out, stride) for name, (outs, _) in CASES.items() for out in outs
          for stride in STRIDES if (outs[out][0] - 1) * stride * 4 <= 16 * 2**30 + 2**20]  # fmt: skip


@pytest.mark.parametrize("name, out, stride", PARAMS,
                         ids=[f"{n}-{o}-{s}" for n, o, s in PARAMS])  # fmt: skip
def test_huge_row_stride_writes_only_inside_the_view(name, out, stride, device):
    outs, kw = CASES[name]
    args = _batch(device)
    expected = {o: torch.full(shape, POISON, dtype=torch.int32, device=device)
                for o, shape in outs.items()}  # fmt: skip
    want_status = new_status(device)
    getattr(k, f"{name}_ref")(*args, **kw, **expected, status=want_status)

    huge = HugeView(*outs[out], stride, torch.int32, device)
    got = {o: torch.full(shape, POISON, dtype=torch.int32, device=device)
           for o, shape in outs.items()}  # fmt: skip
    got[out] = huge.view
    status = new_status(device)
    getattr(k, name)(*args, **kw, **got, status=status)
    huge.assert_intact(out)
    for o in outs:
        assert_equal(got[o], expected[o], f"{name}.{o}")
    assert int(status) == int(want_status) == 0
    del huge
