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
    fix = "pass the word given to the launchers (specmeta.new_status(device) makes one)"
    with pytest.raises(TypeError) as info:
        check_status(torch.zeros(2, dtype=torch.int32))
    assert str(info.value) == (
        "check_status: status must be an int32 tensor with one element, got a tensor of dtype "
        f"int32 and shape [2]; {fix}"
    )
    with pytest.raises(TypeError) as info:
        check_status(torch.zeros(1, dtype=torch.int64))
    assert str(info.value) == (
        "check_status: status must be an int32 tensor with one element, got a tensor of dtype "
        f"int64 and shape [1]; {fix}"
    )
    with pytest.raises(TypeError) as info:
        check_status(0)
    assert str(info.value) == (
        f"check_status: status must be an int32 tensor with one element, got int; {fix}"
    )


# --------------------------------------------------------------------------------------------
# Bits that no Status flag names: named as unknown with their value, never dropped (design §7).
# --------------------------------------------------------------------------------------------
_POS_OOB = (
    "a token position fell outside a req_to_token row, or seq_lens was negative "
    "(gathers read the sink, 0)"
)
_UNKNOWN_FIX = (
    "only specmeta's kernels may write a status word; pass a word from specmeta.new_status "
    "that nothing else writes to, and run kernels of this specmeta version)"
)


def test_an_unknown_bit_alone_is_named_with_its_value():
    word = torch.tensor([256], dtype=torch.int32)
    with pytest.raises(SpecmetaStatusError) as info:
        check_status(word, where="draft step 2")
    assert str(info.value) == (
        f"draft step 2: specmeta status 0x100: unknown bit 0x100 (no specmeta.Status flag has "
        f"it: {_UNKNOWN_FIX}"
    )
    assert int(info.value.bits) == 256 and info.value.unknown == 256
    assert info.value.where == "draft step 2"
    assert int(word) == 0, "reset like any other bit"


def test_unknown_bits_are_named_beside_the_known_causes():
    with pytest.raises(SpecmetaStatusError) as info:
        check_status(torch.tensor([256 | int(Status.POS_OOB)], dtype=torch.int32))
    assert str(info.value) == (
        f"specmeta status 0x102: {_POS_OOB}; unknown bit 0x100 (no specmeta.Status flag has it: "
        f"{_UNKNOWN_FIX}"
    )
    err = info.value
    assert Status.POS_OOB in err.bits and Status.ROW_OOB not in err.bits
    assert int(err.bits) == 0x102, "bits keep every bit of the word"
    assert err.unknown == 0x100


def test_several_unknown_bits_and_bit_31_of_a_negative_word():
    """An int32 word with bit 31 set reads negative; it is taken as 32 bits, not as -2**31."""
    word = torch.tensor([-(2**31) | 0x200 | 0x100], dtype=torch.int32)
    with pytest.raises(SpecmetaStatusError) as info:
        check_status(word)
    assert str(info.value) == (
        "specmeta status 0x80000300: unknown bits 0x100, 0x200, 0x80000000 (no specmeta.Status "
        f"flag has them: {_UNKNOWN_FIX}"
    )
    assert info.value.unknown == 0x80000300 and int(info.value.bits) == 0x80000300


def test_decode_status_keeps_every_bit():
    from specmeta.status import decode_status

    assert decode_status(0) == Status.OK
    assert decode_status(int(Status.BAD_PAGE)) == Status.BAD_PAGE
    bits = decode_status(int(Status.ROW_OOB) | 1024)
    assert int(bits) == 1025 and Status.ROW_OOB in bits
    assert int(decode_status(-1)) == 0xFFFFFFFF, "a negative int32 word as its 32 bits"
    every = 0
    for flag in Status:
        every |= int(flag)
    assert every == 255, "the known flags are bits 0..7; a new flag changes this test on purpose"
    # An error made from an int (as the speculative loop does) says the same as check_status.
    err = SpecmetaStatusError(int(Status.POS_OOB) | 256, where="iteration 3 (B=2)")
    assert str(err) == (
        f"iteration 3 (B=2): specmeta status 0x102: {_POS_OOB}; unknown bit 0x100 (no "
        f"specmeta.Status flag has it: {_UNKNOWN_FIX}"
    )


def test_default_words_report_unknown_bits_too(device, clean_default_words):
    from specmeta import default_status

    default_status(device).fill_(256)
    with pytest.raises(SpecmetaStatusError) as info:
        check_status()
    assert str(info.value) == (
        f"specmeta status 0x100: unknown bit 0x100 (no specmeta.Status flag has it: {_UNKNOWN_FIX}"
    )
    assert info.value.unknown == 256
    assert int(default_status(device)) == 0


def test_validate_treats_cuda_and_cuda_index_alike():
    from specmeta.validate import same_device

    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "meta")
    if torch.cuda.is_available():
        assert same_device("cuda", f"cuda:{torch.cuda.current_device()}")


# --------------------------------------------------------------------------------------------
# The default word: every launcher reports, with or without status=.
# --------------------------------------------------------------------------------------------
@pytest.fixture
def clean_default_words():
    """Start and end with every default word zeroed (other tests may leave bits in them)."""
    from specmeta.status import _DEFAULT_WORDS

    for word in _DEFAULT_WORDS.values():
        word.zero_()
    yield
    for word in _DEFAULT_WORDS.values():
        word.zero_()


def test_default_status_is_one_zeroed_word_per_device(device, clean_default_words):
    from specmeta import default_status

    word = default_status(device)
    assert word.dtype == torch.int32 and word.shape == (1,) and int(word) == 0
    assert default_status(device) is word
    assert default_status(str(device)) is word
    check_status()  # nothing set: passes


def test_default_status_refuses_to_be_created_during_capture(monkeypatch):
    from specmeta import status as status_module

    monkeypatch.setattr(status_module, "_DEFAULT_WORDS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match=r"specmeta.default_status\('cuda:0'\) before capture"):
        status_module.default_status("cuda:0")


def _bad_row_batch(device):
    req_to_token = torch.arange(4 * 16, dtype=torch.int32, device=device).view(4, 16)
    req_pool_indices = torch.tensor([1, 9], dtype=torch.int32, device=device)  # row 9 of 4
    seq_lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    return req_pool_indices, req_to_token, seq_lens


def _launch(name, device):
    import specmeta.kernels as k

    rpi, r2t, sl = _bad_row_batch(device)
    if name.startswith("assign_draft_cache_locs"):
        getattr(k, name)(rpi, r2t, sl, topk=2, num_steps=2)
    elif name.startswith("verify_kv_indices"):
        getattr(k, name)(rpi, r2t, sl, extra_tokens=2)
    elif name.startswith("prefix_page_table"):
        getattr(k, name)(rpi, r2t, sl, page_size=4)
    elif name.startswith("accept_cache_locs"):
        idx = torch.tensor([[0, 5]], dtype=torch.int32, device=device)  # 5 is outside [0, 4)
        lens = torch.tensor([2], dtype=torch.int32, device=device)
        loc = torch.arange(4, dtype=torch.int64, device=device)
        getattr(k, name)(idx, lens, loc, num_draft_tokens=4)
    elif name.startswith("move_kv_cache"):
        buf = torch.zeros(4, 8, device=device)
        tgt = torch.tensor([7], device=device)  # row 7 of 4
        getattr(k, name)([buf], tgt, torch.tensor([1], device=device))


@pytest.mark.parametrize(
    "name, bit",
    [
        ("assign_draft_cache_locs", Status.ROW_OOB),
        ("assign_draft_cache_locs_ref", Status.ROW_OOB),
        ("verify_kv_indices", Status.ROW_OOB),
        ("verify_kv_indices_ref", Status.ROW_OOB),
        ("prefix_page_table", Status.ROW_OOB),
        ("accept_cache_locs", Status.BAD_ACCEPT),
        ("accept_cache_locs_ref", Status.BAD_ACCEPT),
        ("move_kv_cache", Status.POOL_OOB),
        ("move_kv_cache_ref", Status.POOL_OOB),
    ],
)
def test_launch_without_status_reports_into_the_default_word(name, bit, device,
                                                              clean_default_words):  # fmt: skip
    from specmeta import default_status

    _launch(name, device)
    assert int(default_status(device)) == int(bit), "the fault's bit, alone, in the default word"
    with pytest.raises(SpecmetaStatusError) as info:
        check_status()
    assert info.value.bits == bit
    assert int(default_status(device)) == 0, "check_status() resets the default words"
    check_status()
