"""The status word and check_status (design §2.5)."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecmetaStatusError, Status, check_status, new_status


def test_clean_word_passes_and_set_bits_raise_with_causes(device):
    status = new_status(device)
    check_status(status)
    status |= int(Status.ROW_OOB | Status.OUT_OF_CAPACITY)
    with pytest.raises(SpecmetaStatusError, match="req_pool_indices.*too small") as info:
        check_status(status, where="draft decode")
    assert info.value.bits == Status.ROW_OOB | Status.OUT_OF_CAPACITY
    assert "draft decode" in str(info.value)
    assert int(status) == 0, "check_status resets the word by default"


def test_rejects_wrong_kind_of_word():
    with pytest.raises(TypeError):
        check_status(torch.zeros(2, dtype=torch.int32))


def test_validate_treats_cuda_and_cuda_index_alike():
    from specmeta.validate import same_device

    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "meta")
    if torch.cuda.is_available():
        assert same_device("cuda", f"cuda:{torch.cuda.current_device()}")
