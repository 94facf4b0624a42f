"""verify_expand_page_table against its reference and against design §3.2 (verify cascade, expand
rows from the tree mask) read directly."""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.verify_expand_page_table import (
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from specmeta.workloads import SHAPES, make_batch, random_tree_mask
from tests.guard_bands import POISON, Guarded, assert_equal

CONFIGS = [(2, 3, 6, 1), (4, 2, 8, 16), (3, 3, 10, 4), (8, 2, 16, 64), (2, 4, 5, 2)]  # K S N ps


def _draw(shape, gen, device, k, s, n, ps, batch_size=None):
    row_width = -(-(40 + k * (s + ps) + n + 2 * ps) // ps) * ps
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width, generator=gen, device=device, extra_tokens=n)  # fmt: skip
    mask = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    return batch, mask


def _run(batch, mask, device, *, width=None, spare_rows=0, dtype=torch.int32):
    B, N = mask.shape[0], mask.shape[1]
    width = N if width is None else width
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, mask)
    pt = Guarded((B * N + spare_rows, width), dtype, device)
    cs = Guarded((B * N + spare_rows,), dtype, device)
    cu = Guarded((B * N + 1 + spare_rows,), dtype, device)
    status = new_status(device)
    verify_expand_page_table(*args, page_table=pt.view, cache_seqlens=cs.view,
                             cu_seqlens_k=cu.view, status=status)  # fmt: skip
    ref_pt, ref_cs, ref_cu = (g.view.clone() for g in (pt, cs, cu))
    ref_status = new_status(device)
    verify_expand_page_table_ref(*args, page_table=ref_pt, cache_seqlens=ref_cs,
                                 cu_seqlens_k=ref_cu, status=ref_status)  # fmt: skip
    for g, name in ((pt, "page_table"), (cs, "cache_seqlens"), (cu, "cu_seqlens_k")):
        g.assert_intact(name)
    assert_equal(pt.view, ref_pt, f"page_table [{batch.describe()}]")
    assert_equal(cs.view, ref_cs, "cache_seqlens")
    assert_equal(cu.view, ref_cu, "cu_seqlens_k")
    assert_equal(status, ref_status, "status")
    assert (pt.view[B * N :] == POISON).all() and (cs.view[B * N :] == POISON).all()
    return pt.view[: B * N], cs.view[: B * N], cu.view[: B * N + 1], status


def _check_against_spec(batch, mask, pt, cs, cu):
    """Node j's row starts with the slots row_i[L_i + c] of its ancestors (and itself) in
    increasing c, cache_seqlens counts them; the row is a permutation of the N verify slots."""
    N = mask.shape[1]
    pt, cs, cu, m = pt.cpu().long(), cs.cpu().long(), cu.cpu().long(), mask.cpu()
    r2t = batch.req_to_token.cpu().long()
    for i in range(batch.batch_size):
        row = r2t[int(batch.req_pool_indices[i])]
        L = int(batch.seq_lens_cpu[i])
        verify = row[L : L + N]
        for j in range(N):
            r = i * N + j
            anc = [c for c in range(N) if m[i, j, c]]
            assert anc[0] == 0 and anc[-1] == j, "a tree node sees the root and itself"
            assert int(cs[r]) == len(anc)
            assert pt[r, : len(anc)].tolist() == verify[anc].tolist(), f"node {j} of request {i}"
            assert sorted(pt[r, :N].tolist()) == sorted(verify.tolist())
            assert not pt[r, N:].any()
    assert torch.equal(cu[1:], cs.cumsum(0)) and int(cu[0]) == 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,n,ps", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, n, ps):
    batch, mask = _draw(shape, gen, device, k, s, n, ps)
    pt, cs, cu, status = _run(batch, mask, device, width=n + 3, spare_rows=n)
    assert int(status) == 0
    _check_against_spec(batch, mask, pt, cs, cu)


def test_spec_example(device):
    r2t = torch.zeros(2, 10, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(45, 55)
    m = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool, device=device)
    pt, cs = verify_expand_page_table(torch.tensor([1], device=device), r2t,
                                      torch.tensor([5], device=device), m)  # fmt: skip
    assert pt.tolist() == [[50, 51, 52], [50, 51, 52], [50, 52, 51]] and cs.tolist() == [1, 2, 2]


def test_arbitrary_masks_stay_in_bounds(device, gen):
    """Any bit pattern (not a tree, empty rows, a uint8 mask, a strided view): the rows are
    still permutations written inside the buffer, equal to the reference."""
    batch, _ = _draw("random", gen, device, 4, 3, 9, 4, batch_size=6)
    big = torch.randint(0, 2, (6, 9, 12), generator=gen, dtype=torch.uint8).to(device)
    mask = big[:, :, :9]
    mask[0, 3] = 0
    pt, cs, _, status = _run(batch, mask, device, width=11, spare_rows=5)
    assert int(status) == 0 and int(cs[3]) == 0
    assert_equal(cs, mask.sum(-1).reshape(-1), "cache_seqlens counts the set columns")


def test_out_of_range_inputs_are_masked(device, gen):
    batch, mask = _draw("random", gen, device, 2, 3, 6, 4, batch_size=4)
    R, W_row = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[1] = W_row - 2  # the window runs past the row: those slots read 0
    batch.req_to_token[int(batch.req_pool_indices[2]), int(batch.seq_lens[2])] = -7
    pt, _, _, status = _run(batch, mask, device)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB | Status.POOL_OOB)
    assert not pt[:6].any(), "request 0's bad row reads as the sink"


def test_empty_batch(device, gen):
    batch, mask = _draw("empty", gen, device, 2, 3, 6, 4)
    _, cs, cu, status = _run(batch, mask, device, spare_rows=4)
    assert cu.tolist() == [0] and cs.numel() == 0 and int(status) == 0


def test_bad_arguments_raise_before_launch(device, gen):
    batch, mask = _draw("random", gen, device, 2, 3, 6, 4, batch_size=4)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)

    def i32(*shape):
        return torch.zeros(shape, dtype=torch.int32, device=device)

    with pytest.raises(ValueError, match="page_table is too small: need 6 columns"):
        verify_expand_page_table(*args, mask, page_table=i32(24, 5))
    with pytest.raises(ValueError, match="page_table is too small: need 24 rows"):
        verify_expand_page_table(*args, mask, page_table=i32(23, 6))
    with pytest.raises(ValueError, match="cache_seqlens is too small: need 24"):
        verify_expand_page_table(*args, mask, cache_seqlens=i32(23))
    with pytest.raises(ValueError, match="cu_seqlens_k is too small: need 25"):
        verify_expand_page_table(*args, mask, cu_seqlens_k=i32(24))
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        verify_expand_page_table(*args, mask[:3])
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        verify_expand_page_table(*args, mask[:, :5])
    with pytest.raises(TypeError, match="tree_mask must be bool or uint8"):
        verify_expand_page_table(*args, mask.float())


def test_cu_seqlens_k_over_several_blocks(device, gen):
    """More nodes than the sums kernel's block (1024): the running total crosses blocks."""
    batch, mask = _draw("random", gen, device, 4, 3, 16, 4, batch_size=70)
    pt, cs, cu, status = _run(batch, mask, device, spare_rows=3)
    assert int(status) == 0 and cu.shape[0] == 70 * 16 + 1 > 1024
    _check_against_spec(batch, mask, pt, cs, cu)
