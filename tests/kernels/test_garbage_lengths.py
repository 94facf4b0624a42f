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


@pytest.mark.parametrize("dtype, garbage", GARBAGE)
def test_row_copies(dtype, garbage, device):
    """verify_kv_indices, shared_prefix_kv_indices and branch_kv_indices copy a request's row
    in chunks: the chunks stop at the end of the output."""
    req_to_token = torch.arange(6 * 64, dtype=torch.int32, device=device).view(6, 64)
    rpi = torch.tensor([2, 5, 1], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, garbage, 3], dtype=dtype, device=device)
    want = int(Status.POS_OOB | Status.OUT_OF_CAPACITY)

    out = Guarded((64,), torch.int32, device)
    status = new_status(device)
    k.verify_kv_indices(rpi, req_to_token, seq_lens, extra_tokens=2, kv_indices=out.view,
                        status=status)  # fmt: skip
    out.assert_intact("kv_indices")
    assert int(status) == want, Status(int(status))

    out = Guarded((64,), torch.int32, device)
    status = new_status(device)
    k.shared_prefix_kv_indices(rpi, req_to_token, seq_lens, topk=2, num_steps=2,
                               prefix_kv_indices=out.view, status=status)  # fmt: skip
    out.assert_intact("prefix_kv_indices")
    assert int(status) == want, Status(int(status))

    out = Guarded((2, 64), torch.int32, device)
    status = new_status(device)
    k.branch_kv_indices(rpi, req_to_token, seq_lens, topk=2, num_steps=2, page_size=4,
                        kv_indices=out.view, status=status)  # fmt: skip
    out.assert_intact("kv_indices")
    assert int(status) == want, Status(int(status))

    out = Guarded((2, 64), torch.int32, device)
    status = new_status(device)
    k.draft_decode_kv_indices(rpi, req_to_token, seq_lens, topk=2, num_steps=2,
                              kv_indices=out.view, status=status)  # fmt: skip
    out.assert_intact("kv_indices")
    assert int(status) == want, Status(int(status))
