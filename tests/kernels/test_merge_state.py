"""merge_state: the Triton merge against its torch reference and against attention over the
union of the two key sets, with empty passes (LSE −inf, output 0 or NaN) and strided LSEs."""

from __future__ import annotations

import pytest
import torch

from specmeta.kernels.merge_state import merge_state, merge_state_ref
from specmeta.testing.consumers.dense import dense_attention


def _passes(gen, T=7, H=4, H_kv=2, D=24, P=50):
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(P, H_kv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(P, H_kv, D, generator=gen, dtype=torch.float64)
    lists = [torch.randperm(P, generator=gen)[: 1 + 3 * i] for i in range(T)]
    first = [s[: len(s) // 2] for s in lists]  # row 0: one slot, so its first pass is empty
    second = [s[len(s) // 2 :] for s in lists]
    return (q, k, v), lists, first, second


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_is_attention_over_the_union(device, gen, dtype):
    (q, k, v), lists, first, second = _passes(gen)
    o1, l1 = dense_attention(q, k, v, first)
    o2, l2 = dense_attention(q, k, v, second)
    want, want_lse = dense_attention(q, k, v, lists)
    # A kernel's LSE comes as [H, T]: the merge reads it through the transposed view.
    l1_ht = l1.t().contiguous().float().to(device)
    args = (o1.to(device, dtype), l1_ht.t(), o2.to(device, dtype), l2.float().to(device))
    out_lse = torch.empty(l1.shape, dtype=torch.float32, device=device)
    out, lse = merge_state(*args, out_lse=out_lse)
    assert out.dtype == dtype and lse is out_lse
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)
    ref, ref_lse = merge_state_ref(*args)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), rtol=1e-6, atol=1e-6)


def test_empty_passes_contribute_nothing_even_when_their_output_is_nan(device):
    T, H, D = 4, 3, 8
    o1 = torch.full((T, H, D), float("nan"), device=device)
    o2 = torch.arange(T * H * D, dtype=torch.float32, device=device).view(T, H, D)
    lse1 = torch.full((T, H), float("-inf"), device=device)
    lse2 = torch.zeros(T, H, device=device)
    lse2[3] = float("-inf")  # row 3: both passes empty
    for fn in (merge_state, merge_state_ref):
        out, lse = fn(o1, lse1, o2, lse2, out_lse=torch.empty(T, H, device=device))
        assert torch.equal(out[:3].cpu(), o2[:3].cpu()), fn.__name__
        assert not out[3].any() and torch.isneginf(lse[3]).all(), fn.__name__
        assert torch.equal(lse[:3].cpu(), torch.zeros(3, H)), fn.__name__
        assert not torch.isnan(out).any(), fn.__name__


def test_in_place_into_the_first_pass(device, gen):
    (q, k, v), _, first, second = _passes(gen, T=5, H=2, H_kv=1, D=16)
    o1, l1 = (t.float().to(device) for t in dense_attention(q, k, v, first))
    o2, l2 = (t.float().to(device) for t in dense_attention(q, k, v, second))
    want, _ = merge_state_ref(o1, l1, o2, l2)
    out, lse = merge_state(o1, l1, o2, l2, out=o1)
    assert out is o1 and lse is None
    torch.testing.assert_close(o1, want, rtol=1e-6, atol=1e-6)


def test_empty_batch_launches_nothing(device):
    z = torch.empty(0, 2, 8, device=device)
    lz = torch.empty(0, 2, device=device)
    out, _ = merge_state(z, lz, z, lz)
    assert out.shape == (0, 2, 8)


def test_bad_input_is_rejected_before_launch(device):
    o = torch.zeros(3, 2, 8, device=device)
    lse = torch.zeros(3, 2, device=device)
    with pytest.raises(ValueError, match=r"lse1 must be \[T, H\].*lse\.t\(\)"):
        merge_state(o, lse.t(), o, lse)
    with pytest.raises(ValueError, match="o2 must have o1's shape"):
        merge_state(o, lse, o[:2], lse)
    with pytest.raises(TypeError, match="o1 must be"):
        merge_state(o.long(), lse, o, lse)
    with pytest.raises(TypeError, match="out_lse must be float32"):
        merge_state(o, lse, o, lse, out_lse=lse.double())
