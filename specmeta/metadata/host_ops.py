"""A build's per-call host work on ``seq_lens_cpu``, one compiled call each (design §3).

Every build given ``seq_lens_cpu`` checks each length against ``[0, max_context_len]``. FA3
and TRT-LLM MLA then need ``max L`` (and ``ΣL``); FlashInfer's ``plan()`` reads index pointers
on the host, so a FlashInfer build also writes those **host mirrors**. In torch each is one to
four CPU ops of a microsecond or more. Here each is one call: ``stats`` (the check, ``max L``
and ``ΣL``) and a **writer** per mirror rule (:func:`draft_decode_writer`,
:func:`prefix_writer`, :func:`paged_writer`): ``writer(seq_lens_cpu)`` checks every length
before it writes anything (``IndexError``, which the builder names), then writes the mirrors
and returns what ``stats`` would have (so a compiled host part is one call).

* **compiled**: the C module ``host_ops.c``, built only by :func:`warmup` (exported as
  :func:`specmeta.warmup`) with Triton's own C build helper, never inside a build's call. It
  holds no address: a writer passes its mirror views (numpy views of the mirror tensors, each
  keeping its tensor alive) on every call, read through the buffer protocol.
* **numpy**: :mod:`.host_ops_numpy`, the same calls with the same arguments, results and
  errors, a few numpy ops each on the numpy views of the mirrors: before :func:`warmup`,
  without a C compiler, under ``SPECMETA_HOST_OPS=0`` or for a builder made with
  ``host_ops=False``. A call costs 2 to 5 times the compiled one (bench/RESULTS.md).

The rules are the torch ones (:class:`~specmeta.kernels.draft_decode_kv_indices.
DraftDecodeIndptr`, :func:`~specmeta.kernels.branch_kv_indices.branch_kv_indptr`, a
``cumsum``, :func:`~specmeta.kernels.verify_lens.pad_verify_lens_to_bucket_ref`); the tests
compare both writers with them exactly. A :class:`LengthRule` says how a mode reads each length
(its range, shift and cap).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import validate
from ..kernels.draft_decode_kv_indices import DraftDecodeIndptr
from . import host_ops_numpy

__all__ = ["Writer", "LengthRule", "compiled", "unavailable", "warmup", "stats_for",
           "draft_decode_writer", "prefix_writer", "paged_writer", "ragged_verify_writer"]  # fmt: skip

#: ``writer(seq_lens_cpu) -> (max L, ΣL)``, what ``stats`` returns, so one call, compiled or
#: numpy, is a host part's check and its write.
Writer = Callable[[torch.Tensor], "tuple[int, int]"]

_SOURCE = Path(__file__).with_name("host_ops.c")
_SWITCH = "SPECMETA_HOST_OPS"

# The module once warmup() built it; why the build failed (it is tried once a process).
_module = None
_failure: str | None = None
_LOCK = threading.Lock()  # held by warmup(): a second caller waits for the build under way


def compiled():
    """The compiled module where :func:`warmup` built it in this process, else ``None`` (then
    :func:`unavailable` says why). Never builds: a first build must not cost a build's call
    a compile."""
    return _module


def unavailable() -> str | None:
    """Why the compiled host ops are not in use (``None`` when they are)."""
    if _module is not None:
        return None
    if os.environ.get(_SWITCH, "1") == "0":
        return f"{_SWITCH}=0"
    if _failure is not None:
        return _failure
    return "not built in this process: call specmeta.warmup() once, before the first build"


def warmup(device: torch.device | str | None = None) -> dict[str, str]:
    """Build the compiled host ops, once per process, and say what was done.

    Call it once at start-up, before the first build (the builders never build the module
    themselves: until it is built, the numpy implementation serves). Thread-safe: a caller
    that arrives while another builds waits for that build and gets the same module. A build
    that fails is not tried again; :func:`unavailable` keeps the reason. ``SPECMETA_HOST_OPS=0``
    (read on every call) leaves the module unbuilt.

    Parameters
    ----------
    device : torch.device or str, optional
        The device the builders will run on. The host ops are the same for every device; it
        is taken so that :func:`specmeta.warmup` has one signature for everything it warms.

    Returns
    -------
    dict of str to str
        ``{"host_ops": what happened}``: ``"built in 1.3 s"``, ``"built earlier in this
        process"``, or why the module is not available (the numpy writers then serve).
    """
    del device  # the same module serves every device
    global _module, _failure
    with _LOCK:
        if _module is not None:
            return {"host_ops": "built earlier in this process"}
        if os.environ.get(_SWITCH, "1") == "0":
            return {"host_ops": f"not built: {_SWITCH}=0 (the numpy implementation serves)"}
        if _failure is not None:
            return {"host_ops": f"not available: {_failure} (the numpy implementation serves)"}
        start = time.perf_counter()
        try:
            module = _build()
        except Exception as exc:  # no compiler or headers, failed known answers
            _failure = f"{type(exc).__name__}: {str(exc)[-400:]}"
            return {"host_ops": f"not available: {_failure} (the numpy implementation serves)"}
        _module = module
        return {"host_ops": f"built in {time.perf_counter() - start:.1f} s"}


def _build():
    """Compile (or load from Triton's cache) and import ``host_ops.c``, and check one known
    answer."""
    from triton.runtime.build import compile_module_from_src

    module = compile_module_from_src(_SOURCE.read_text(), "specmeta_host_ops")
    module.init(torch.int64, torch.int32)
    got = module.stats(9, 3, torch.tensor([4, 9, 0], dtype=torch.int32))
    if got != (9, 13):
        raise RuntimeError(f"host_ops: stats of [4, 9, 0] gave {got}, not (9, 13)")
    return module


class LengthRule:
    """How a mode's mirror writer reads each length of ``seq_lens_cpu``: checked in ``[0,
    max_len]`` (the plan's ``max_context_len``), then read as ``min(L, cap) + shift``. ``shift``
    is ``N`` for the prefill modes, whose lists hold ``L + N``; ``cap`` a draft window's
    ``window + sink`` or a window layer's ``w − 1`` (design §2.10), ``max_len`` without one."""

    __slots__ = ("max_len", "shift", "cap")

    def __init__(self, max_len: int, shift: int = 0, cap: int | None = None):
        self.max_len = validate.positive("max_len", max_len, 0)
        self.shift = validate.positive("shift", shift, 0)
        self.cap = max_len if cap is None else validate.positive("cap", cap, 0)


def _rows(out: object) -> int:
    """The rows of a 2-D mirror view (its other checks are :func:`_int32_view`'s)."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError(f"out must be a 2-D int32 CPU view, got {type(out).__name__} "
                         f"{list(out.shape) if isinstance(out, torch.Tensor) else ''}")  # fmt: skip
    return out.shape[0]


def _int32_view(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A mirror view a writer fills, after checking what both writers rely on: int32 on the
    CPU, the given shape, unit last stride."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 CPU tensor view, got {type(t).__name__}")
    if (
        t.dtype != torch.int32
        or t.device.type != "cpu"
        or tuple(t.shape) != shape
        or (t.dim() and shape[-1] > 1 and t.stride(-1) != 1)
    ):
        raise ValueError(
            f"{name} must be an int32 CPU view of shape {list(shape)} with unit last stride, "
            f"got {t.dtype} on {t.device}, shape {list(t.shape)}, strides {list(t.stride())}"
        )
    return t


def stats_for(use_compiled: bool) -> Callable[[int, int, object], tuple[int, int]]:
    """``stats(max_len, batch, seq_lens_cpu) -> (max L, ΣL)``: the compiled one where
    ``use_compiled`` and :func:`warmup` built it, else numpy's (same checks, same errors)."""
    op = _module_for(use_compiled)
    return host_ops_numpy.stats if op is None else op.stats


def _module_for(use_compiled: bool):
    """The compiled module a writer binds to, or ``None`` for the numpy writer."""
    return compiled() if use_compiled else None


def draft_decode_writer(lengths: LengthRule, rule: DraftDecodeIndptr, topk: int, batch: int,
                        out: torch.Tensor, *, use_compiled: bool = True) -> Writer:  # fmt: skip
    """``out`` (``[rows, batch·topk + 1]``) ← draft decode's ``kv_indptr`` (design §2.2), the
    rule of ``rule``, a :class:`DraftDecodeIndptr` of ``topk`` made for at least ``batch``
    requests; ``lengths`` of shift 0, its ``cap`` a draft window's (design §2.10). Compiled
    where ``use_compiled`` and :func:`warmup` built the module, else numpy."""
    validate.positive("topk", topk)
    rows = _rows(out)
    _int32_view("out", out, (rows, batch * topk + 1))
    if lengths.shift:
        raise ValueError(f"draft_decode_writer: the length rule's shift is {lengths.shift}; "
                         "pass one made with shift=0")  # fmt: skip
    rule.bind(batch, out)  # checks out against the rule's maxima
    args = (lengths.max_len, topk, batch, lengths.cap, out.numpy())
    op = _module_for(use_compiled)
    if op is None:
        return host_ops_numpy.DraftDecode(*args)
    return functools.partial(op.draft_decode, *args)


def prefix_writer(lengths: LengthRule, batch: int, out: torch.Tensor,
                  scaled: torch.Tensor | None = None, scale: int = 0, *,
                  use_compiled: bool = True) -> Writer:  # fmt: skip
    """``out`` (``[batch + 1]``) ← ``[0, cumsum(min(L, lengths.cap) + lengths.shift)]``, and
    ``scaled`` ← ``scale · out`` when given: the cascade's prefix offsets (shift 0; the cap a
    draft window's, design §2.10), the prefill modes' ``kv_indptr`` (shift ``N``) and target
    verify's mask offsets (scale ``N``). Both writers write ``out[0]`` and ``scaled[0]``."""
    validate.positive("scale", scale, 0)
    need = (batch + 1,)
    _int32_view("out", out, need)
    if scaled is not None:
        _int32_view("scaled", scaled, need)
    args = (lengths.max_len, lengths.shift, scale, lengths.cap, batch, out.numpy(),
            scaled.numpy() if scaled is not None else None)  # fmt: skip
    op = _module_for(use_compiled)
    if op is None:
        return host_ops_numpy.Prefix(*args)
    return functools.partial(op.prefix, *args)


def paged_writer(lengths: LengthRule, topk: int, page_size: int, batch: int,
                 out: torch.Tensor, last: torch.Tensor, *,
                 use_compiled: bool = True) -> Writer:  # fmt: skip
    """``out`` (``[rows, batch·K + 1]``) and ``last`` (``[rows, batch·K]``) ← the page offsets
    and last-page lengths of per-branch page lists (:func:`branch_kv_indptr`'s rule)."""
    validate.positive("topk", topk)
    validate.positive("page_size", page_size)
    rows = _rows(out)
    _int32_view("out", out, (rows, batch * topk + 1))
    _int32_view("last", last, (rows, batch * topk))
    args = (lengths.max_len, topk, page_size, batch, out.numpy(), last.numpy())
    op = _module_for(use_compiled)
    if op is None:
        return host_ops_numpy.Paged(*args)
    return functools.partial(op.paged, *args)


def ragged_verify_writer(lengths: LengthRule, batch: int, count: int, num_tokens: int,
                         num_draft_tokens: int, verify_out: torch.Tensor, qo_out: torch.Tensor,
                         kv_out: torch.Tensor, mask_out: torch.Tensor, *,
                         use_compiled: bool = True) -> Callable[[torch.Tensor, torch.Tensor], tuple]:  # fmt: skip
    """The host mirrors of a ragged target verify (design §2.9) over ``batch`` requests (the
    bucket's ``Bp``), ``count`` of them real, and ``num_tokens`` (its ``T``): ``verify_out`` ←
    the padded lengths ``v_b`` (the rule of
    :func:`~specmeta.kernels.verify_lens.pad_verify_lens_to_bucket_ref` on checked lengths,
    :func:`~specmeta.kernels.verify_lens.fill_bucket`), ``qo_out`` ← their offsets, ``kv_out``
    ← ``[0, cumsum(L' + min(v, N))]`` and ``mask_out`` ← ``[0, cumsum(v·(L' + min(v, N)))]``,
    ``L' = min(L, lengths.cap)`` (a window layer's ``w − 1``, design §2.10; ``L`` itself with the
    plan's ``max_context_len``). ``lengths`` has shift ``N``. ``write(seq_lens_cpu,
    verify_lens_cpu)``: every length checked before anything is written (the builder names
    what it refuses); returns ``(max L, ΣL, max v, Σv)``."""
    n = num_draft_tokens
    if lengths.shift != n:
        raise ValueError(f"ragged_verify_writer: the length rule's shift is {lengths.shift}; "
                         f"pass one made with shift=N={n}")  # fmt: skip
    _int32_view("verify_out", verify_out, (batch,))
    for name, out in (("qo_out", qo_out), ("kv_out", kv_out), ("mask_out", mask_out)):
        _int32_view(name, out, (batch + 1,))
    args = (lengths.max_len, n, num_tokens, batch, count, lengths.cap, verify_out.numpy(),
            qo_out.numpy(), kv_out.numpy(), mask_out.numpy())  # fmt: skip
    op = _module_for(use_compiled)
    if op is None:
        return host_ops_numpy.Ragged(*args)
    return functools.partial(op.ragged, *args)
