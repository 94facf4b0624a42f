"""Work bounded by capacity: a garbage length costs no more than a full buffer (design §2.5).

A kernel whose loop ran over a request's whole ``seq_lens`` would hold the stream for as long as
a garbage value says (2**40 entries). Every loop is bounded by what its output can hold, so
these launches finish as fast as a full buffer; the garbage is reported, and nothing is written
outside the buffer (guard bands). No timing is asserted: a loop over the garbage length would
not finish within the test run.
"""

from __future__ import annotations

import pytest
import torch

import specmeta.kernels as k
from specmeta import Status, new_status
from tests.guard_bands import Guarded

GARBAGE = [(torch.int32, 2**31 - 1), (torch.int64, 2**40)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype, garbage", GARBAGE)
def test_tree_custom_mask(dtype, garbage, packed, device):
    N = 4
    seq_lens = torch.tensor([3, garbage, 2], dtype=dtype, device=device)
    tree = torch.eye(N, dtype=torch.bool, device=device).expand(3, N, N).clone()
    width = 96  # what lengths [3, 5, 2] would need (N·ΣL + B·N² = 40 + 48): far less than 2**33
    results = {}
    for fn in (k.tree_custom_mask, k.tree_custom_mask_ref):
        storage = torch.full((width + 128,), 0xA5, dtype=torch.uint8, device=device)  # canary
        view = storage[64 : 64 + width]
        view.fill_(0)  # a bool view holds 0 or 1 only
        status = new_status(device)
        fn(seq_lens, tree, packed=packed, custom_mask=view if packed else view.view(torch.bool),
           status=status)  # fmt: skip
        assert bool((storage[:64] == 0xA5).all()) and bool((storage[64 + width :] == 0xA5).all())
        assert int(status) == int(Status.OUT_OF_CAPACITY), Status(int(status))
        results[fn.__name__] = view.clone()
    assert torch.equal(results["tree_custom_mask"], results["tree_custom_mask_ref"])


_ROW_COPIES = {
    # op: (call(fn, rpi, table, lens, out, status), output shape)
    "verify_kv_indices": (lambda fn, *a, out, status: fn(
        *a, extra_tokens=2, kv_indices=out, status=status), (64,)),
    "shared_prefix_kv_indices": (lambda fn, *a, out, status: fn(
        *a, topk=2, num_steps=2, prefix_kv_indices=out, status=status), (64,)),
    "branch_kv_indices": (lambda fn, *a, out, status: fn(
        *a, topk=2, num_steps=2, page_size=4, kv_indices=out, status=status), (2, 64)),
    "draft_decode_kv_indices": (lambda fn, *a, out, status: fn(
        *a, topk=2, num_steps=2, kv_indices=out, status=status), (2, 64)),
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(_ROW_COPIES))
@pytest.mark.parametrize("dtype, garbage", GARBAGE)
def test_row_copies(op, dtype, garbage, device):
    """verify_kv_indices, shared_prefix_kv_indices, branch_kv_indices and
    draft_decode_kv_indices copy a request's row in chunks: the chunks stop at the end of the
    output, in the kernel and in its torch reference (which would otherwise build index tensors
    as long as the garbage length); both report the same bits and write the same entries."""
    req_to_token = torch.arange(6 * 64, dtype=torch.int32, device=device).view(6, 64)
    rpi = torch.tensor([2, 5, 1], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, garbage, 3], dtype=dtype, device=device)
    want = int(Status.POS_OOB | Status.OUT_OF_CAPACITY)
    call, shape = _ROW_COPIES[op]
    written = {}
    for fn in (getattr(k, op), getattr(k, f"{op}_ref")):
        out = Guarded(shape, torch.int32, device)
        status = new_status(device)
        call(fn, rpi, req_to_token, seq_lens, out=out.view, status=status)
        out.assert_intact(f"{fn.__name__} output")
        assert int(status) == want, (fn.__name__, Status(int(status)))
        written[fn.__name__] = out.view.clone()
    kernel, ref = written.values()
    assert torch.equal(kernel, ref), f"{op}: kernel and reference wrote different entries"
