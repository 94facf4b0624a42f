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
:func:`specmeta.warmup` built them), draft decode's through a torch writer of the rail
(:class:`RailDraftIndptr`; the compiled draft-decode writer knows a draft window, not the
rail; a ragged verify's through the ragged writer, capped alike). The shared-prefix and paged
draft forms are not built for a window layer: they are refused, naming what serves it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import SpecConfig
from ..kernels._window import check_window, window_layer_config
from .capabilities import Capabilities, verify_mask_keys
from .flashinfer import FlashInferBuilder
from .host_ops import LengthTable
from .window_plan import WINDOW_MODES, WINDOW_PREFIX

__all__ = ["FlashInferWindowBuilder", "RailDraftIndptr", "WINDOW_CAPABILITIES"]

#: What a window layer's builder serves: the page-size-1 draft lists and the prefill lists. A
#: config's draft window bounds the draft model, not a window layer: with one, draft decode
#: is not served here.
WINDOW_CAPABILITIES = Capabilities(
    modes=WINDOW_MODES,
    tree_draft=True,
    tree_verify=True,
    page_sizes="any",
    graph_safe=frozenset(WINDOW_MODES),
)


class RailDraftIndptr:
    """The torch writer of a window layer's draft-decode ``kv_indptr`` mirror (design §2.10):
    ``out[s, z] = Σ_{z' < z} min(L_{b(z')} + s + 1, w)`` for ``rows`` steps of ``batch``
    requests of ``topk`` branches, ``out[:, 0]`` left at the 0 the ring's buffers hold.

    ``writer(seq_lens_cpu)`` checks the lengths (shape ``[batch]``, every value in the
    table's ``[0, max_len]``: ``IndexError`` otherwise) before it writes anything, then makes
    four torch ops into buffers made here; returns ``None`` (its caller publishes the
    lengths)."""

    def __init__(self, table: LengthTable, topk: int, batch: int, rows: int, rail: int,
                 out: torch.Tensor):  # fmt: skip
        lists = batch * topk
        if out.dtype != torch.int32 or tuple(out.shape) != (rows, lists + 1):
            raise ValueError(f"RailDraftIndptr: out must be an int32 [{rows}, {lists + 1}] "
                             f"view, got {out.dtype} {list(out.shape)}")  # fmt: skip
        self._table, self._batch, self._rail, self._tail = table, batch, rail, out[:, 1:]
        self._branch_request = torch.arange(lists) // topk  # z → b
        self._branch_lengths = torch.empty(lists, dtype=torch.int32)
        self._steps = torch.arange(1, rows + 1, dtype=torch.int32).view(-1, 1)  # s + 1
        self._lengths = torch.empty(rows, lists, dtype=torch.int32)

    def __call__(self, seq_lens_cpu: torch.Tensor) -> None:
        if not isinstance(seq_lens_cpu, torch.Tensor) or tuple(seq_lens_cpu.shape) != (
            self._batch,
        ):
            raise ValueError(f"seq_lens_cpu must be a tensor of shape [{self._batch}]")
        lengths = self._table.gather(seq_lens_cpu)  # every value checked, nothing written yet
        torch.index_select(lengths, 0, self._branch_request, out=self._branch_lengths)
        torch.add(self._branch_lengths, self._steps, out=self._lengths)  # L + s + 1
        self._lengths.clamp_(max=self._rail)
        torch.cumsum(self._lengths, 1, out=self._tail)


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
    plan_groups: dict[str, str] = {}

    @classmethod
    def plan_keys(cls, cfg: SpecConfig, modes: Iterable[str] | None = None,
                  verify_mask: str = "both") -> list[str]:  # fmt: skip
        """As :meth:`FlashInferBuilder.plan_keys`, over the ``flashinfer_swa.*`` keys."""
        dropped = {key.replace("flashinfer.", WINDOW_PREFIX, 1)
                   for key in verify_mask_keys(verify_mask)}  # fmt: skip
        return [key for key in super().plan_keys(cfg, modes, verify_mask) if key not in dropped]

    @classmethod
    def check_modes(cls, cfg: SpecConfig, modes: Iterable[str] | None) -> tuple[str, ...]:
        """As :meth:`MetadataBuilder.check_modes`; a mode only a full layer's builder serves is
        refused naming the window builder's modes."""
        for mode in (modes,) if isinstance(modes, str) else modes or ():
            if mode not in WINDOW_MODES:
                raise ValueError(
                    f"{cls.__name__}: {mode!r} is not built for a window layer (design §2.10); "
                    f"a window builder serves {', '.join(WINDOW_MODES)}: drop {mode!r}, or "
                    "build it for the full layers with FlashInferBuilder(cfg, device)"
                )
        return super().check_modes(cfg, modes)

    def __init__(self, cfg: SpecConfig, device: torch.device | str, *,
                 sliding_window_size: int | None = None, **kwargs: Any):  # fmt: skip
        where = type(self).__name__
        w, window_cfg = window_layer_config(where, cfg, sliding_window_size)
        self.sliding_window_size = w
        # Its buffers are the plan's flashinfer_swa.* keys for w (the config's own plan lists
        # them when it names w).
        super().__init__(window_cfg, device, **kwargs)
        # The prefill lists hold min(L, w − 1) + N entries: their mirrors read each length
        # capped at w − 1 (the same table checks every length against the plan).
        for mode in ("target_verify", "draft_extend"):
            if mode in self.modes:
                self._length_tables[mode] = LengthTable(cfg.max_context_len, cfg.max_bs,
                                                        cfg.num_draft_tokens, cap=w - 1)  # fmt: skip

    def require(self, mode: str) -> str:
        if mode not in WINDOW_MODES:
            raise ValueError(
                f"{type(self).__name__}.{mode}: not built for a window layer (design §2.10); "
                f"a window builder serves {', '.join(WINDOW_MODES)}; build {mode} for the full "
                "layers with FlashInferBuilder(cfg, device)"
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
        write = RailDraftIndptr(self._length_tables["draft_decode"], K, B, rows,
                                self.sliding_window_size, host[:rows, : B * K + 1])  # fmt: skip
        return self._decode_steps("draft_decode", B, rows, host, ones, ones_host, 1), write
