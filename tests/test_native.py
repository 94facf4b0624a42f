"""specmeta.native.OptionalModule: an optional compiled module is tried once per process, and
says why it is missing."""

from __future__ import annotations

from specmeta.native import OptionalModule


def test_a_module_that_fails_to_load_is_tried_once_and_says_why(monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no compiler here")

    monkeypatch.delenv("SPECMETA_TEST_SWITCH", raising=False)
    missing = OptionalModule("SPECMETA_TEST_SWITCH", broken)
    assert missing.get() is None and missing.get() is None
    assert missing.why() == "OSError: no compiler here"
    assert calls == [1], "loaded once, not on every call"


def test_a_loaded_module_and_the_switch_that_turns_it_off(monkeypatch):
    made = object()
    monkeypatch.delenv("SPECMETA_TEST_SWITCH", raising=False)
    found = OptionalModule("SPECMETA_TEST_SWITCH", lambda: made)
    assert found.get() is made and found.why() is None
    monkeypatch.setenv("SPECMETA_TEST_SWITCH", "0")
    off = OptionalModule("SPECMETA_TEST_SWITCH", lambda: made)
    assert off.get() is None and off.why() == "SPECMETA_TEST_SWITCH=0"
