"""FlashInfer metadata of a hybrid model's sliding-window layers (design §2.10, §3.3).

A hybrid model (full-attention layers beside sliding-window layers) reads its window layers
from a second KV pool, so their metadata lives in another id space, and each of their queries
reads only the positions ``(p − w, p]``. An engine makes one builder per id space from one
:class:`~specmeta.SpecConfig` (its ``sliding_window_size = w``): ``FlashInferBuilder(cfg,
device)`` for the full layers and ``FlashInferBuilder(cfg, device, sliding_window_size=w)``, a
:class:`FlashInferWindowBuilder`, for the window layers (its :attr:`cfg` is the config with
that ``w``). The window builder's buffers are its
own (plan keys ``flashinfer_swa.<mode>.<field>``, sized for the clipped lists), and its modes
take the engine's full → window pool map, ``full_to_swa=``, on every call:

* ``draft_decode``: step ``s`` of branch ``(b, t)`` lists the last ``min(L + s + 1, w)``
  entries of its prefix and chain, in window-pool ids; ``kv_indptr[s, z] = K·Σ_{b'<b} m_b' +
  t·m_b``, ``m_b = min(L_b + s + 1, w)``.
* ``draft_decode_shared_prefix`` (``w > S``): step ``s``'s prefix level lists each request's
  last ``min(L, w − s − 1)`` positions once (a prefix list a step), its chain level each
  branch's own steps: a branch reads the last ``min(L + s + 1, w)`` of its prefix and chain.
* ``draft_decode_paged``: full-length per-branch page lists in window-pool pages, the pages
  wholly below the read floor ``max(0, L − w + 1)`` the sink page 0; the consumer plans
  FlashInfer's decode with ``window_left = w − 1`` (the window pool must page like the full
  pool).
* ``target_verify`` and ``draft_extend``: request ``b`` lists positions ``max(0, L_b − w + 1)
  … L_b + N − 1``; target verify's mask hides from node ``j`` (at ``L_b + d_j``) every
  position at or before ``L_b + d_j − w``. A causal prefill over the clipped list (draft
  extend, or a chain's verify run causal) is planned by the consumer with FlashInfer's
  ``window_left = w − 1``: the list keeps exactly what the first query row reads, and the
  kernel's own window hides what each later row no longer sees. A ragged verify
  (``verify_lens=``, design §2.9) clips each request's list alike, ``min(L_b, w − 1) +
  min(v_b, N)`` entries, its mask ``v_b × (min(L_b, w − 1) + min(v_b, N))``.

The host mirrors follow the clipped lengths exactly: target verify's and draft extend's
through the host ops' writers with the lengths capped at ``w − 1`` (compiled where
:func:`specmeta.warmup` built them; a ragged verify's through the ragged writer, capped
alike), the cascade's prefix rows a step through :class:`RailPrefixIndptr` (compiled or
torch), draft decode's through a torch writer of the rail (:class:`RailDraftIndptr`; the
compiled draft-decode writer knows a draft window, not the rail); the paged form's are a full
layer's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from ..config import SpecConfig, plan_sizes
from ..kernels._window import check_window, window_layer_config
from ..kernels.shared_prefix_kv_indices import (
    bind_shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from ..stage import Stage
from . import host_ops, host_ops_numpy
from .capabilities import FLASHINFER_WINDOW_CAPABILITIES, verify_mask_keys
from .flashinfer import FlashInferBuilder
from .flashinfer_results import (
    FlashInferCascadeDecode,
    FlashInferCascadeStep,
    FlashInferDraftDecode,
)
from .host_ops import LengthRule
from .window_plan import FLASHINFER_WINDOW_MODES, WINDOW_PREFIX, shared_prefix_served

__all__ = ["FlashInferWindowBuilder", "RailDraftIndptr", "RailPrefixIndptr",
           "WINDOW_CAPABILITIES"]  # fmt: skip

_SHARED = "draft_decode_shared_prefix"
#: What a window layer's builder serves: the page-size-1 draft lists (per branch, or the
#: shared-prefix cascade for ``w > S``), the paged form and the prefill lists. A config's draft
#: window bounds the draft model, not a window layer: with one, draft decode is not served here.
#: Torch-free data (:mod:`.capabilities`), which ``specmeta plan`` reads too.
WINDOW_CAPABILITIES = FLASHINFER_WINDOW_CAPABILITIES


class RailDraftIndptr:
    """The writer of a window layer's draft-decode ``kv_indptr`` mirror (design §2.10):
    ``out[s, z] = Σ_{z' < z} min(L_{b(z')} + s + 1, w)`` for ``rows`` steps of ``batch``
    requests of ``topk`` branches, ``out[:, 0]`` left at the 0 the ring's buffers hold.

    ``writer(seq_lens_cpu)`` checks the tensor and every length in ``[0, max_len]`` as the host
    ops do (:func:`.host_ops_numpy.stats`: ``IndexError`` for a length outside) before it
    writes anything, then makes four torch ops into buffers made here (torch's ``cumsum`` over
    the branches is several times numpy's at large batches); returns ``(max L, ΣL)`` (its
    caller publishes them)."""

    def __init__(self, lengths: LengthRule, topk: int, batch: int, rows: int, rail: int,
                 out: torch.Tensor):  # fmt: skip
        lists = batch * topk
        if out.dtype != torch.int32 or tuple(out.shape) != (rows, lists + 1):
            raise ValueError(f"RailDraftIndptr: out must be an int32 [{rows}, {lists + 1}] "
                             f"view, got {out.dtype} {list(out.shape)}")  # fmt: skip
        self._max_len, self._batch, self._rail = lengths.max_len, batch, rail
        self._tail = out[:, 1:]
        self._branch_request = torch.arange(lists) // topk  # z → b
        # L of each branch, in the dtype of the lengths (index_select writes its own dtype)
        self._branch_lengths = {dtype: torch.empty(lists, dtype=dtype)
                                for dtype in (torch.int32, torch.int64)}  # fmt: skip
        self._steps = torch.arange(1, rows + 1, dtype=torch.int32).view(-1, 1)  # s + 1
        self._lengths = torch.empty(rows, lists, dtype=torch.int32)

    def __call__(self, seq_lens_cpu: torch.Tensor) -> tuple[int, int]:
        # the tensor and every value checked as the host ops check them, nothing written yet
        found = host_ops_numpy.stats(self._max_len, self._batch, seq_lens_cpu)
        branch = torch.index_select(seq_lens_cpu, 0, self._branch_request,
                                    out=self._branch_lengths[seq_lens_cpu.dtype])  # fmt: skip
        torch.add(branch, self._steps, out=self._lengths)  # L + s + 1
        self._lengths.clamp_(max=self._rail)
        torch.cumsum(self._lengths, 1, out=self._tail)
        return found


class RailPrefixIndptr:
    """The writer of a window layer's shared-prefix mirror (design §2.10): ``out[s] = [0,
    cumsum(min(L, max(w − s − 1, 0)))]`` for ``rows`` steps of ``batch`` requests.

    Compiled (``use_compiled`` where :func:`specmeta.warmup` built the host ops): one call of
    the host ops' ``prefix`` a step, each with its step's cap, each checking every length
    before it writes (the first call refuses a bad length, nothing written); returns what the
    last returned, ``(max L, ΣL)``. Otherwise the host ops' checks
    (:func:`.host_ops_numpy.stats`), then a broadcast minimum against the caps and one torch
    ``cumsum``; ``out[:, 0]`` left at the 0 the ring's buffers hold; returns ``(max L,
    ΣL)``."""

    def __init__(self, lengths: LengthRule, batch: int, rows: int, rail: int, out: torch.Tensor,
                 use_compiled: bool = True):  # fmt: skip
        if out.dtype != torch.int32 or tuple(out.shape) != (rows, batch + 1):
            raise ValueError(f"RailPrefixIndptr: out must be an int32 [{rows}, {batch + 1}] "
                             f"view, got {out.dtype} {list(out.shape)}")  # fmt: skip
        caps = [max(rail - s - 1, 0) for s in range(rows)]  # step s keeps min(L, w - s - 1)
        op = host_ops.compiled() if use_compiled else None
        self._calls = None
        if op is not None:
            self._calls = [functools.partial(op.prefix, lengths.max_len, 0, 0, cap, batch,
                                             out[s].numpy(), None)
                           for s, cap in enumerate(caps)]  # fmt: skip
        self._max_len, self._batch, self._tail = lengths.max_len, batch, out[:, 1:]
        self._caps = torch.tensor(caps, dtype=torch.int32).view(-1, 1)
        self._lengths = torch.empty(rows, batch, dtype=torch.int32)

    def __call__(self, seq_lens_cpu: torch.Tensor) -> Any:
        if self._calls is not None:
            found = None
            for call in self._calls:
                found = call(seq_lens_cpu)
            return found
        # the tensor and every value checked as the host ops check them, nothing written yet
        found = host_ops_numpy.stats(self._max_len, self._batch, seq_lens_cpu)
        torch.minimum(seq_lens_cpu.view(1, -1), self._caps, out=self._lengths)
        torch.cumsum(self._lengths, 1, out=self._tail)
        return found


class FlashInferWindowBuilder(FlashInferBuilder):
    """FlashInfer metadata of a hybrid model's window layers: ``FlashInferBuilder(cfg, device,
    sliding_window_size=w)`` makes one (see the module's text). Its buffers are the
    ``flashinfer_swa.*`` keys of the config's plan with that ``w`` (a config that names
    another window is refused); the other arguments are
    :class:`~.flashinfer.FlashInferBuilder`'s.

    Attributes
    ----------
    sliding_window_size : int
        ``w``: each query at position ``p`` reads the positions ``(p − w, p]``.
    """

    plan_prefix = WINDOW_PREFIX
    capabilities = WINDOW_CAPABILITIES
    # plan_groups: FlashInferBuilder's (the shared-prefix form's keys under draft_decode_shared)

    @classmethod
    def plan_keys(cls, cfg: SpecConfig, modes: Iterable[str] | None = None,
                  verify_mask: str = "both") -> list[str]:  # fmt: skip
        """As :meth:`FlashInferBuilder.plan_keys`, over the ``flashinfer_swa.*`` keys (the
        shared-prefix form's under its plan group, ``draft_decode_shared``)."""
        if verify_mask not in cls.VERIFY_MASKS:
            raise ValueError(
                f"{cls.__name__}: verify_mask={verify_mask!r}; pass one of "
                f"{', '.join(map(repr, cls.VERIFY_MASKS))}"
            )
        groups = {cls.plan_groups.get(m, m) for m in cls.check_modes(cfg, modes)}
        dropped = {key.replace("flashinfer.", WINDOW_PREFIX, 1)
                   for key in verify_mask_keys(verify_mask)}  # fmt: skip
        return [key for key in plan_sizes(cfg) if key.startswith(WINDOW_PREFIX)
                and key not in dropped and key[len(WINDOW_PREFIX) :].split(".")[0] in groups]  # fmt: skip

    @classmethod
    def check_modes(cls, cfg: SpecConfig, modes: Iterable[str] | None) -> tuple[str, ...]:
        """As :meth:`MetadataBuilder.check_modes`; a mode only a full layer's builder serves is
        refused naming the window builder's modes, and so is the shared-prefix cascade for a
        window no wider than the draft steps (:func:`.window_plan.shared_prefix_served`),
        which the default modes then leave out."""
        for mode in (modes,) if isinstance(modes, str) else modes or ():
            if mode not in FLASHINFER_WINDOW_MODES:
                raise ValueError(
                    f"{cls.__name__}: {mode!r} is not built for a window layer (design §2.10); "
                    f"a window builder serves {', '.join(FLASHINFER_WINDOW_MODES)}: drop "
                    f"{mode!r}, or build it for the full layers with FlashInferBuilder(cfg, "
                    "device)"
                )
            if mode == _SHARED and cfg.sliding_window_size and not shared_prefix_served(cfg):
                raise ValueError(
                    f"{cls.__name__}: {mode!r} needs a window wider than the draft steps "
                    f"(sliding_window_size={cfg.sliding_window_size} <= num_steps="
                    f"{cfg.num_steps}: a step would keep no prefix position, design §2.10); "
                    "serve this window layer's draft decode with 'draft_decode' (per-branch "
                    "lists), or drop it from modes"
                )
        served = super().check_modes(cfg, modes)
        if modes is None and cfg.sliding_window_size and not shared_prefix_served(cfg):
            served = tuple(m for m in served if m != _SHARED)
        return served

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 sliding_window_size: int | None = None, **kwargs: Any):  # fmt: skip
        where = type(self).__name__
        w, window_cfg = window_layer_config(where, cfg, sliding_window_size)
        self.sliding_window_size = w
        # Its buffers are the plan's flashinfer_swa.* keys for w (the config's own plan lists
        # them when it names w).
        super().__init__(window_cfg, device, **kwargs)
        # The prefill lists hold min(L, w − 1) + N entries: their mirrors read each length
        # capped at w − 1 (the same rule checks every length against the plan).
        for mode in ("target_verify", "draft_extend"):
            if mode in self.modes:
                self._length_rules[mode] = LengthRule(cfg.max_context_len, cfg.num_draft_tokens,
                                                      cap=w - 1)  # fmt: skip

    def require(self, mode: str) -> str:
        if mode not in FLASHINFER_WINDOW_MODES:
            raise ValueError(
                f"{type(self).__name__}.{mode}: not built for a window layer (design §2.10); "
                f"a window builder serves {', '.join(FLASHINFER_WINDOW_MODES)}; build {mode} "
                "for the full layers with FlashInferBuilder(cfg, device)"
            )
        return super().require(mode)

    def _window_lists(self, mode: str, full_to_swa: Any) -> dict:
        """The rail and the map for ``mode``'s list kernels (design §2.10), the map checked."""
        check_window(self.require(mode), self.sliding_window_size, full_to_swa, self.device)
        return dict(sliding_window_size=self.sliding_window_size, full_to_swa=full_to_swa)

    def _draft_decode_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """The result of ``B`` requests and ``rows`` steps over the ring's set ``mirrors``, and
        the rail's writer of its host mirror."""
        del compiled  # the compiled draft-decode writer knows a draft window, not the rail
        buf, K = self.buffers, self.cfg.topk
        host = mirrors["kv_indptr_host"]
        ones = [buf["draft_decode.kv_last_page_len"][: B * K]] * rows
        ones_host = [buf["draft_decode.kv_last_page_len_host"][: B * K]] * rows
        write = RailDraftIndptr(self._length_rules["draft_decode"], K, B, rows,
                                self.sliding_window_size, host[:rows, : B * K + 1])  # fmt: skip
        return self._decode_steps("draft_decode", B, rows, host, ones, ones_host, 1), write

    # -- draft decode: the shared-prefix cascade under the rail ---------------------------------
    def bind_draft_decode_shared_prefix(self, req_pool_indices: torch.Tensor,
                                        req_to_token: torch.Tensor, seq_lens: torch.Tensor, *,
                                        num_rows: int | None = None,
                                        status: torch.Tensor | None = None,
                                        v2p: torch.Tensor | None = None,
                                        entry_page_size: int = 1,
                                        full_to_swa: torch.Tensor | None = None) -> Stage:  # fmt: skip
        """:meth:`draft_decode_shared_prefix` bound once to these tensors (arguments as
        there); ``host(seq_lens_cpu)`` returns the :class:`FlashInferCascadeDecode`."""
        return self._bind_draft(
            _SHARED, bind_shared_prefix_kv_indices, shared_prefix_kv_indices_ref,
            (req_pool_indices, req_to_token, seq_lens), num_rows, status,
            ("prefix_kv_indices", "prefix_kv_indptr", "chain_kv_indices", "chain_kv_indptr"),
            self._shared_result, v2p=v2p, entry_page_size=entry_page_size,
            **self._window_lists(_SHARED, full_to_swa),
        )  # fmt: skip

    def draft_decode_shared_prefix(self, req_pool_indices: torch.Tensor,
                                   req_to_token: torch.Tensor, seq_lens: torch.Tensor, *,
                                   seq_lens_cpu: torch.Tensor | None = None,
                                   num_rows: int | None = None,
                                   status: torch.Tensor | None = None, launch: bool = True,
                                   v2p: torch.Tensor | None = None, entry_page_size: int = 1,
                                   full_to_swa: torch.Tensor | None = None,
                                   ) -> FlashInferCascadeDecode:  # fmt: skip
        """The shared-prefix cascade of a window layer (design §2.10), ``w > S``: step ``s``'s
        prefix level lists each request's last ``min(L, w − s − 1)`` positions once (its own
        level a step: ``paged_kv_indptr_arr[0]`` and its mirror differ by step), its chain
        level each branch's ``s + 1`` draft slots, both in window-pool ids through
        ``full_to_swa``; a branch so reads the last ``min(L + s + 1, w)`` of its prefix and
        chain. Arguments as in :meth:`draft_decode`."""
        stage = self.bind_draft_decode_shared_prefix(
            req_pool_indices, req_to_token, seq_lens, num_rows=num_rows, status=status, v2p=v2p,
            entry_page_size=entry_page_size, full_to_swa=full_to_swa,
        )  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)

    def _shared_result(self, B: int, rows: int, mirrors: dict, compiled: bool):
        """The cascade result over the ring's set ``mirrors``, a prefix row a step, and the
        writer of its prefix rows' host offsets (:class:`RailPrefixIndptr`)."""
        buf, K, mode = self.buffers, self.cfg.topk, "draft_decode_shared"
        prefix_host = mirrors["prefix_kv_indptr_host"]
        ones, ones_host = buf[f"{mode}.kv_last_page_len"], buf[f"{mode}.kv_last_page_len_host"]
        qo = (self._layouts["prefix"].cu_seqlens_q(B), self._layouts["chain"].cu_seqlens_q(B * K))
        qo_host = (buf[f"{mode}.prefix_qo_indptr_host"][: B + 1],
                   buf[f"{mode}.chain_qo_indptr_host"][: B * K + 1])  # fmt: skip
        chain_host = buf[f"{mode}.chain_kv_indptr_host"]
        steps = tuple(
            FlashInferCascadeStep(
                qo_indptr_arr=qo,
                paged_kv_indptr_arr=(buf[f"{mode}.prefix_kv_indptr"][s, : B + 1],
                                     buf[f"{mode}.chain_kv_indptr"][s, : B * K + 1]),
                paged_kv_indices_arr=(buf[f"{mode}.prefix_kv_indices"][s],
                                      buf[f"{mode}.chain_kv_indices"][s]),
                paged_kv_last_page_len=(ones[:B], ones[: B * K]),
                qo_indptr_host_arr=qo_host,
                paged_kv_indptr_host_arr=(prefix_host[s, : B + 1], chain_host[s, : B * K + 1]),
                paged_kv_last_page_len_host_arr=(ones_host[:B], ones_host[: B * K]),
            )
            for s in range(rows)
        )  # fmt: skip
        write = RailPrefixIndptr(self._length_rules[_SHARED], B, rows, self.sliding_window_size,
                                 prefix_host[:rows, : B + 1], use_compiled=compiled)  # fmt: skip
        return FlashInferCascadeDecode(steps), write

    # -- draft decode: per-branch page lists, read with the kernel's window ---------------------
    def draft_decode_paged(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                           seq_lens: torch.Tensor, *, seq_lens_cpu: torch.Tensor | None = None,
                           num_rows: int | None = None, status: torch.Tensor | None = None,
                           launch: bool = True, v2p: torch.Tensor | None = None,
                           entry_page_size: int = 1,
                           full_to_swa: torch.Tensor | None = None) -> FlashInferDraftDecode:  # fmt: skip
        """Per-branch page lists of a window layer (design §2.10), read by FlashInfer's decode
        planned with ``window_left = w − 1`` (the kernel's own window: a page list cannot be
        cut inside a page). The lists, their offsets and last-page lengths are a full
        layer's (:meth:`FlashInferBuilder.draft_decode_paged`); a page wholly below the read
        floor ``max(0, L − w + 1)`` is the sink page 0, any other the window-pool page
        ``full_to_swa`` gives the id at its first position from the floor on. The window pool
        must page like the full pool, and the layout-B prefix-tail copies be in place in it
        too. Arguments as in :meth:`draft_decode`."""
        stage = self.bind_draft_decode_paged(req_pool_indices, req_to_token, seq_lens,
                                             num_rows=num_rows, status=status, v2p=v2p,
                                             entry_page_size=entry_page_size,
                                             full_to_swa=full_to_swa)  # fmt: skip
        return stage(seq_lens_cpu) if launch else stage.host(seq_lens_cpu)
