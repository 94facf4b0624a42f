"""The status word: how kernels report what they had to mask (design §2.5).

Every launcher takes an optional ``status`` tensor, ``int32 [1]`` on the launch device. A kernel
that masked a gather or a store ORs one bit per cause into it; nothing is ever written outside a
buffer. A launcher (or torch reference) called without ``status=`` reports into the device's
:func:`default_status` word, so no masked fault goes unreported. Reading a word is the only
operation in specmeta that synchronises with the device, and the caller decides when:
:func:`check_status` once per iteration, once per request, or only in debug builds.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "Status",
    "SpecmetaStatusError",
    "new_status",
    "default_status",
    "check_status",
    "decode_status",
]


class Status(enum.IntFlag):
    """One bit per cause of masking. Values are stable: they are part of the device ABI."""

    OK = 0
    ROW_OOB = 1
    """A ``req_pool_indices`` entry outside ``[0, R)``; every gather of that request read 0."""
    POS_OOB = 2
    """A token position outside ``[0, W_row)`` (or a negative ``seq_lens``); the gather read 0."""
    OUT_OF_CAPACITY = 4
    """A store fell past the extent of its output buffer and was dropped."""
    POOL_OOB = 8
    """A KV-cache location outside ``[0, P)``; the move was skipped, nothing dereferenced."""
    BAD_ACCEPT = 16
    """An ``accept_index`` entry outside its request's window, or a −1 run that is not a suffix."""
    BAD_PAGE = 32
    """A draft slot whose page does not follow the layout (more distinct pages than the layout allows)."""
    STALE_HOST_LENGTHS = 64
    """A build's ``seq_lens_cpu`` disagreed with the device's ``seq_lens`` (its host results,
    maxima and mirrors, were computed from other lengths than its lists)."""
    BAD_KV_ID = 128
    """A KV id read in another id space that does not map: a negative id, a page past the
    ``v2p`` map or a page it marks unmapped (negative); the sink slot 0 was emitted instead."""


_MESSAGES = {
    Status.ROW_OOB: "req_pool_indices pointed outside req_to_token's rows (gathers read the sink, 0)",
    Status.POS_OOB: "a token position fell outside a req_to_token row, or seq_lens was negative "
    "(gathers read the sink, 0)",
    Status.OUT_OF_CAPACITY: "an output buffer was too small for the batch (stores past its end were "
    "dropped); size it with specmeta.plan_buffers",
    Status.POOL_OOB: "a KV-cache location outside [0, pool size) (the move was skipped)",
    Status.BAD_ACCEPT: "accept_index had an entry outside its request's verify window or a -1 run "
    "that was not a suffix (the pair was skipped)",
    Status.BAD_PAGE: "draft slots spanned more distinct pages than the slot layout allows "
    "(extra pages were dropped)",
    Status.STALE_HOST_LENGTHS: "seq_lens_cpu is stale: it disagreed with the device's seq_lens "
    "(the host maxima and plan() mirrors of that build do not match its lists); pass the CPU "
    "copy of this iteration's seq_lens, and run a stage's host part before its launches",
    Status.BAD_KV_ID: "a KV id read through entry_page_size or v2p did not map (a negative id, "
    "or a page past v2p or unmapped in it); the sink slot 0 was emitted instead: check that the "
    "rows hold ids of the space the call was told (token or page ids, virtual or physical)",
}


# Every bit a Status flag names; the others are "unknown" (design §7).
_KNOWN = sum(int(flag) for flag in Status)
# A status word is int32: bit 31 reads as a negative value, so the word is taken as 32 bits.
_WORD_MASK = 0xFFFF_FFFF


def _unknown_text(unknown: int) -> str:
    """``"unknown bit 0x80"`` or ``"unknown bits 0x80, 0x80000000"``, with the fix."""
    bits = [1 << i for i in range(unknown.bit_length()) if unknown >> i & 1]
    names = ", ".join(f"0x{b:x}" for b in bits)
    return (
        f"unknown bit{'s' if len(bits) > 1 else ''} {names} (no specmeta.Status flag has "
        f"{'them' if len(bits) > 1 else 'it'}: only specmeta's kernels may write a status word; "
        "pass a word from specmeta.new_status that nothing else writes to, and run kernels of "
        "this specmeta version)"
    )


class SpecmetaStatusError(RuntimeError):
    """Raised by :func:`check_status` when a kernel had to mask something.

    Attributes
    ----------
    bits : Status
        Every bit of the word, the unknown ones included (``int(bits)`` is the word's value as
        32 bits); ``flag in bits`` tests one cause.
    unknown : int
        The bits no :class:`Status` flag names (0 when every bit is known): a word written by
        something other than specmeta's kernels, or by kernels of another specmeta version.
    where : str or None
        The label given to :func:`check_status`.
    """

    def __init__(self, bits: Status | int, where: str | None = None):
        self.bits = decode_status(bits)
        self.unknown = int(self.bits) & ~_KNOWN
        self.where = where
        causes = [msg for flag, msg in _MESSAGES.items() if flag in self.bits]
        if self.unknown:
            causes.append(_unknown_text(self.unknown))
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}specmeta status 0x{int(self.bits):x}: {'; '.join(causes)}")


def new_status(device: torch.device | str) -> torch.Tensor:
    """A zeroed status word, ``int32 [1]`` on ``device``."""
    return torch.zeros(1, dtype=torch.int32, device=device)


# The process-wide default words, one per device, created on first use.
_DEFAULT_WORDS: dict[torch.device, torch.Tensor] = {}


def _device_key(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` → ``cuda:<current>``, ``cpu:0`` → ``cpu``)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if d.type == "cpu":
        return torch.device("cpu")
    return d


def default_status(device: torch.device | str) -> torch.Tensor:
    """The process-wide default status word of ``device``, ``int32 [1]``, zeroed when created.

    Every launcher of :mod:`specmeta.kernels` (and its torch reference) called without
    ``status=`` ORs its bits into this word; :func:`check_status` with no word checks every
    default word created so far. The word is created on first use; creating it allocates
    device memory, which a CUDA graph capture forbids: call ``specmeta.default_status(device)``
    once before capturing (a warm-up launch does it too), or pass ``status=``.

    Raises
    ------
    ValueError
        If the word does not exist yet and the current CUDA stream is capturing a graph.
    """
    word = _DEFAULT_WORDS.get(device)  # a launch's own device: found without normalising
    if word is not None:
        return word
    key = _device_key(device)
    word = _DEFAULT_WORDS.get(key)
    if word is None:
        if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"the default status word of {key} would be created during CUDA graph capture; "
                f"call specmeta.default_status({str(key)!r}) before capture, or pass status="
            )
        word = torch.zeros(1, dtype=torch.int32, device=key)
        _DEFAULT_WORDS[key] = word
    return word


def decode_status(value: int) -> Status:
    """The :class:`Status` flags of a status word's integer value, every bit kept.

    The word is read as 32 bits (an int32 word with bit 31 set is negative). Bits that no flag
    names stay in the result, so ``int(decode_status(v)) == v & 0xFFFFFFFF``; the unknown ones
    are ``int(result) & ~sum(Status)`` (:attr:`SpecmetaStatusError.unknown`).

    >>> decode_status(2 | 64) == Status.POS_OOB | 64
    True
    """
    # IntFlag keeps bits that no member names (its boundary is KEEP), both in Python 3.10's
    # pseudo-members and in 3.11's flags.
    return Status(int(value) & _WORD_MASK)


def check_status(
    status: torch.Tensor | None = None, *, where: str | None = None, reset: bool = True
) -> None:
    """Raise :class:`SpecmetaStatusError` if any bit is set. **Synchronises** with the device.

    The rule for launchers: every launcher of :mod:`specmeta.kernels` and its ``_ref``
    reports every masked fault into the ``status`` word it is given, or, when called without
    ``status=``, into :func:`default_status` of its device. ``check_status()`` with no word
    checks those default words.

    Parameters
    ----------
    status : torch.Tensor, optional
        ``int32 [1]``, the word passed to the launchers. When omitted, every default word
        created so far (one per device, :func:`default_status`) is read, and the bits of all of
        them are reported together.
    where : str, optional
        A label for the message (the caller's step name).
    reset : bool
        Zero the word(s) after reading (default), so the next check sees only new causes.

    Raises
    ------
    SpecmetaStatusError
        If any bit is set: its message lists every cause, and names each bit that no
        :class:`Status` flag has as an unknown bit with its value (``unknown bit 0x80``); its
        ``bits`` keep every bit and its ``unknown`` holds those.
    TypeError
        If ``status`` is not an ``int32`` tensor of one element.
    """
    if status is None:
        value = 0
        for word in list(_DEFAULT_WORDS.values()):
            bits = int(word.item())  # one sync per device that has a default word
            if reset and bits:
                word.zero_()
            value |= bits
        if value:
            raise SpecmetaStatusError(decode_status(value), where)
        return
    if not isinstance(status, torch.Tensor) or status.dtype != torch.int32 or status.numel() != 1:
        got = (
            f"a tensor of dtype {str(status.dtype).removeprefix('torch.')} and shape "
            f"{list(status.shape)}"
            if isinstance(status, torch.Tensor)
            else type(status).__name__
        )
        raise TypeError(
            f"check_status: status must be an int32 tensor with one element, got {got}; pass the "
            "word given to the launchers (specmeta.new_status(device) makes one)"
        )
    value = int(status.item())  # the one deliberate sync of the library
    if reset and value:
        status.zero_()
    if value:
        raise SpecmetaStatusError(decode_status(value), where)
