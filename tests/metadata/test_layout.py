"""The uniform-stride query layout (design §3.1, seed 004)."""

from __future__ import annotations

import pytest
import torch

from specmeta.metadata.layout import UniformQueryLayout


@pytest.mark.parametrize("q", [1, 4, 8])
def test_same_values_for_every_batch_as_a_capture_at_that_batch(device, q):
    full = UniformQueryLayout.create(q, 16, device)
    for b in (0, 1, 7, 16):
        captured = UniformQueryLayout.create(q, b, device)
        assert torch.equal(full.cu_seqlens_q(b), captured.cu_seqlens_q(b))
        assert full.cu_seqlens_q(b).tolist() == [q * i for i in range(b + 1)]
        assert full.sum_seqlens_q(b) == b * q and full.max_seqlen_q == q


def test_writes_into_a_planned_buffer_and_rejects_bad_ones(device):
    buf = torch.full((20,), -7, dtype=torch.int32, device=device)
    layout = UniformQueryLayout.create(3, 10, device, out=buf)
    assert layout.cu_seqlens_q(10).data_ptr() == buf.data_ptr()
    assert buf[11:].eq(-7).all(), "nothing written past max_bs + 1"
    with pytest.raises(ValueError, match="need 11"):
        UniformQueryLayout.create(3, 10, device, out=buf[:10])
    with pytest.raises(TypeError):
        UniformQueryLayout.create(3, 10, device, out=buf.long())
    with pytest.raises(ValueError, match="batch"):
        layout.cu_seqlens_q(11)
