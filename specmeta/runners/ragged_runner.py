"""A CUDA-graph runner keyed by token bucket, for a ragged target verify (design §2.9, §4).

An engine that verifies ``v_b`` draft tokens per request, decided on the device, captures one
graph per bucket ``(T, Bp)``: ``T`` query tokens shared by up to ``Bp`` requests. The graph's
layout is fixed by the bucket and the device decides the split inside it, so one capture serves
every split of up to ``T`` tokens over up to ``Bp`` requests, without recapture.

:class:`RaggedGraphRunner` is a :class:`~specmeta.runners.GraphRunner` whose stage function
also takes the bucket's token count, ``stage(inputs, num_tokens) -> Stage``, and binds a ragged
builder mode (``FlashInferBuilder.bind_target_verify(..., verify_lens=inputs["verify_lens"],
num_tokens=num_tokens)``) on the views ``[:Bp]``. A run of ``B`` requests needing ``t`` tokens
takes the captured bucket with ``Bp ≥ B`` and ``T ≥ t`` of fewest tokens (then fewest
requests), copies and pads every input as the base runner does (``verify_lens`` padded with
:data:`~specmeta.runners.padding.NOT_VERIFIED`), and runs the bucket's host part on the host
inputs padded alike to ``Bp``: the pad requests verify no token of their own, so the bucket's
leftover ``T − Σv`` goes to its last request (filler rows, design §2.9), on the device and in
the host mirrors alike. The layout is the one an eager call on the same padded inputs builds.

Examples
--------
>>> def stage(inp, num_tokens):
...     return fi.bind_target_verify(inp["req_pool_indices"], req_to_token, inp["seq_lens"],
...                                  inp["tree_mask"], verify_lens=inp["verify_lens"],
...                                  num_tokens=num_tokens)
>>> runner = RaggedGraphRunner(stage, buckets=[(16, 4), (64, 16)], device="cuda")
>>> runner.add_input("verify_lens", bufs["runner.verify_lens"], pad=padding.NOT_VERIFIED,
...                  host_mirror="verify_lens_cpu")
>>> ...  # req_pool_indices, seq_lens (host_mirror=True), tree_mask, as for GraphRunner
>>> runner.capture()
>>> res = runner.run(3, inputs, num_tokens=11, host_inputs={"seq_lens": lens_cpu,
...                                                         "verify_lens": verify_cpu})
>>> res.padded_batch_size, res.results.qo_indptr_host[-1]
(4, tensor(16, dtype=torch.int32))
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence

import torch

from .. import probes, validate
from ..stage import Stage
from .graph_runner import GraphRunner, RunResult

__all__ = ["RaggedGraphRunner"]

_CPU = torch.device("cpu")


class RaggedGraphRunner(GraphRunner):
    """Captures a ragged stage once per bucket ``(T, Bp)`` and replays it for every split.

    Parameters
    ----------
    stage : callable
        ``stage(inputs, num_tokens) -> Stage``: binds the stage's work to ``inputs``, the
        static views ``[:Bp·per_request]`` of every registered input, for a bucket of
        ``num_tokens`` query tokens (as :class:`GraphRunner`'s stage, with the token count).
    buckets : sequence of (int, int)
        The buckets ``(T, Bp)`` to capture, ``T ≥ 0`` tokens over ``Bp ≥ 1`` requests.
    device, graphs
        As :class:`GraphRunner`.
    """

    def __init__(self, stage: Callable[..., Stage], *, buckets: Sequence[tuple[int, int]],
                 device: torch.device | str, graphs: bool | None = None) -> None:  # fmt: skip
        pairs = set()
        for i, pair in enumerate(buckets):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise TypeError(f"buckets[{i}] must be a (num_tokens, batch_size) pair, got "
                                f"{pair!r}")  # fmt: skip
            T = validate.positive(f"buckets[{i}] num_tokens", pair[0], minimum=0)
            pairs.add((T, validate.positive(f"buckets[{i}] batch_size", pair[1])))
        if not pairs:
            raise ValueError("buckets must name at least one (num_tokens, batch_size) pair")
        super().__init__(stage, batch_sizes=[bp for _, bp in pairs], device=device,
                         graphs=graphs)  # fmt: skip
        #: The captured buckets ``(T, Bp)``, by tokens, then requests.
        self.buckets: tuple[tuple[int, int], ...] = tuple(sorted(pairs))
        self._host_padded: dict[str, torch.Tensor] = {}  # name -> CPU copy, pads included

    def _bucket_keys(self) -> tuple:
        return self.buckets

    def _rows(self, key) -> int:
        return key[1]

    def _bind_bucket(self, key) -> Stage:
        T, bp = key
        return self._stage_fn(types.MappingProxyType(self._views_of(bp)), T)

    def bucket(self, batch_size: int, num_tokens: int = 0) -> tuple[int, int]:
        """The captured ``(T, Bp)`` with ``Bp ≥ batch_size`` and ``T ≥ num_tokens``, of fewest
        tokens, then fewest requests."""
        B = validate.positive("batch_size", batch_size, minimum=0)
        t = validate.positive("num_tokens", num_tokens, minimum=0)
        for T, bp in self.buckets:
            if T >= t and bp >= B:
                return T, bp
        raise ValueError(
            f"no captured bucket holds batch_size={B} requests and num_tokens={t} tokens; the "
            f"buckets (T, Bp) are {list(self.buckets)}: capture one with T >= {t} and Bp >= {B}"
        )

    def run(self, batch_size: int, inputs: Mapping[str, torch.Tensor], *, num_tokens: int,
            host_inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:  # fmt: skip
        """As :meth:`GraphRunner.run`, for a batch that verifies ``num_tokens`` tokens in all
        (``Σv``): the bucket's host part runs on the host inputs padded to ``Bp``, and the
        result is the whole bucket's (``Bp`` requests, ``T`` query rows)."""
        if self._layout is None:
            raise ValueError("call capture() before run()")
        key = self.bucket(batch_size, num_tokens)
        B, bp = batch_size, key[1]
        self._check_held()
        raw = self._check_inputs(B, inputs)
        values, extra = self._host_values(host_inputs)
        if probes.enabled():
            self._probe(raw)
        results = self._host_of(key, B, values, extra)
        self._pad(B, bp, raw)
        self._dirty = B if self._dirty <= bp else self._dirty
        self._launch(key)
        return RunResult(B, bp, results)

    def replay(self, batch_size: int, *, num_tokens: int,
               host_inputs: Mapping[str, torch.Tensor] | None = None) -> object:  # fmt: skip
        """As :meth:`GraphRunner.replay` (a persistent batch written into
        :meth:`static_inputs`), for a batch that verifies ``num_tokens`` tokens in all."""
        if self._layout is None:
            raise ValueError("call capture() before replay()")
        key = self.bucket(batch_size, num_tokens)
        self._check_held()
        values, extra = self._host_values(host_inputs)
        if probes.enabled():
            self._probe(self._views_of(batch_size))
        results = self._host_of(key, batch_size, values, extra)
        if self._dirty > batch_size:
            self._pad(batch_size, self._dirty, None)  # a larger batch's rows back to pads
        self._dirty = batch_size
        self._launch(key)
        return results

    def _host_of(self, key: tuple[int, int], B: int, values, extra: dict) -> object:
        """The bucket's host part on the host inputs of ``B`` requests, each padded to the
        bucket's ``Bp`` with its input's pad (what the device reads after :meth:`_pad`)."""
        bp = key[1]
        padded = {}
        for name, spec in self._inputs.items():
            if spec.host_mirror is None:
                continue
            given = values if spec.host_mirror == "seq_lens_cpu" else extra[spec.host_mirror]
            padded[spec.host_mirror] = self._pad_host(name, spec, given, B, bp)
        return self._buckets[key].host(padded.pop("seq_lens_cpu", None), **padded)

    def _pad_host(self, name: str, spec, given: object, B: int, bp: int) -> torch.Tensor:
        """``given`` (the CPU values of ``B`` requests) into the input's CPU copy, rows
        ``[B, bp)`` its pad; returns the copy's ``[:bp]`` view."""
        n, m = B * spec.per_request, bp * spec.per_request
        label = f"host_inputs[{name!r}]"
        validate.tensor(label, given, device=_CPU, contiguous_last=False)
        if tuple(given.shape) != (n, *spec.buffer.shape[1:]):
            raise ValueError(f"{label} must have shape {(n, *spec.buffer.shape[1:])} (the CPU "
                             f"copy of {B} requests), got {tuple(given.shape)}")  # fmt: skip
        copy = self._host_padded.get(name)
        if copy is None:
            copy = torch.empty(spec.buffer.shape, dtype=spec.buffer.dtype)
            self._host_padded[name] = copy
        copy[:n].copy_(given)
        copy[n:m] = spec.pad
        return copy[:m]
