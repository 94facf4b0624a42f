"""A tiny decoder-only transformer whose attention reads a paged KV pool through specmeta's
metadata: the model of the end-to-end lossless tests (:mod:`specmeta.testing.spec_loop`).

Random weights from a seed, ``num_layers`` pre-norm blocks (RMSNorm, grouped-query attention
with rotary positions, a SwiGLU MLP), a small vocabulary. :meth:`TinyModel.forward` takes the
attention as an argument, ``attention(layer, q, k, v) -> out``, so one set of weights runs
three ways:

* :class:`PagedAttention`: the engine's way. The forward's keys and values are written into the
  KV pool at ``out_cache_loc``, then an attention backend of :mod:`specmeta.testing.attention`
  reads the pool through a builder's metadata (draft decode, target verify, draft extend);
* :class:`DenseCache`: plain causal attention over a growing per-sequence cache, with no paging
  and nothing of specmeta: the greedy reference (:meth:`TinyModel.greedy`);
* :class:`DensePrefill`: causal attention inside one sequence that also stores its keys and
  values into the pool: prompt prefill, which is outside specmeta's scope.

An MLA model (``ckv_dim``, ``kpe_dim``: multi-head latent attention, as DeepSeek's, absorbed)
keeps one latent KV head a token: ``ckv`` (``ckv_dim`` wide, RMS-normalised) and a rotary part
``kpe`` (``kpe_dim``). Every head's query is ``q_nope`` (``ckv_dim`` wide: the key projection
absorbed into it) beside a rotary ``q_pe``; the scores are ``(q_nope·ckv + q_pe·kpe) /
sqrt(ckv_dim + kpe_dim)`` and the values are ``ckv`` itself, projected back by ``wo``. The
forward hands the attention ``q = [q_nope, q_pe]``, ``k = [ckv, kpe]`` and ``v = ckv`` (one KV
head), so the dense references run unchanged; the paged pool is a :class:`LatentCache` (one
``ckv`` and one ``kpe`` buffer a layer), read through FlashInfer MLA's metadata.

A hybrid model (``window_layers``, ``sliding_window_size = w``) has sliding-window layers beside
its full ones: there a query at position ``p`` attends to positions ``(p − w, p]`` only, and
the layer keeps its KV in a second, smaller pool (the window pool) whose slots the engine maps
from the full pool's (``full_to_swa``, design §2.10). The dense references apply the window;
:class:`PagedAttention` stores a window layer's KV at the forward's window-pool slots and reads
it through the window layers' metadata.

Margins. Greedy decoding is compared token for token, so a near-tie between the two largest
logits is where two correct implementations may disagree (bf16 kernels against a float32
reference). The logits are ``logit_scale · W_out · rmsnorm(h)``: at the default scale the top
logit leads the second by about 1 (median), and :data:`DEFAULT_MARGIN` is the lead the GPU tests
call decisive. A token emitted where the float32 reference leads it by less is a near-tie,
counted and reported; any other difference is a failure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from ..kernels.cache_loc_move import KVPool

__all__ = [
    "DEFAULT_MARGIN",
    "TinyConfig",
    "TinyModel",
    "KVCache",
    "LatentCache",
    "PagedAttention",
    "DenseCache",
    "DensePrefill",
    "DenseDraftWindow",
    "Attention",
]

DEFAULT_MARGIN = 0.5
"""Top logit over an emitted token (float32 reference, logits) below which a difference is a
near-tie. Measured on the CPU for the GPU configuration (``head_dim`` 128, bf16 weights and
activations against float32 arithmetic on the same weights, 12 seeds × 256 greedy steps): a
single logit moved by at most 0.16, the argmax changed at 1 % of the steps, all with a lead
below 0.12; a quarter of the steps lead by less than 0.5 (``test_lossless.py`` re-measures it)."""

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attention(layer, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D_v]) -> [T, H, D_v]`` (an MLA
model: ``D = ckv_dim + kpe_dim``, ``H_kv = 1``, ``v`` the ``ckv`` part of ``k``, ``D_v = ckv_dim``)."""


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """Sizes of a :class:`TinyModel`.

    Attributes
    ----------
    vocab_size, hidden_size, num_layers : int
        Vocabulary, residual width and number of blocks.
    num_heads, num_kv_heads, head_dim : int
        Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` KV heads.
    intermediate_size : int
        SwiGLU width.
    rope_theta : float
        Rotary base.
    logit_scale : float
        Multiplies the output logits: sets how far the top logit leads (see the module).
    window_layers : tuple of int
        The sliding-window layers (a hybrid model); the others attend to the whole prefix.
    sliding_window_size : int
        ``w`` of the window layers: a query at position ``p`` attends to ``(p − w, p]``; 0
        (required without window layers) is no window.
    ckv_dim, kpe_dim : int
        An MLA model's latent widths (see the module): both > 0 (``kpe_dim`` even), with one
        KV head (``num_kv_heads = 1``) and no window layers; ``head_dim`` is then unused. Both
        0 (the default): grouped-query attention.
    """

    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    logit_scale: float = 4.0
    window_layers: tuple[int, ...] = ()
    sliding_window_size: int = 0
    ckv_dim: int = 0
    kpe_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")  # fmt: skip
        if self.head_dim % 2:
            raise ValueError(f"TinyConfig.head_dim={self.head_dim} must be even (rotary pairs)")
        layers, w = tuple(self.window_layers), self.sliding_window_size
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers
               for i in layers) or len(set(layers)) != len(layers):  # fmt: skip
            raise ValueError(f"TinyConfig.window_layers must name distinct layers in "
                             f"[0, {self.num_layers}), got {self.window_layers!r}")  # fmt: skip
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or bool(layers) != bool(w):
            raise ValueError(f"TinyConfig.sliding_window_size must be an int >= 1 with window "
                             f"layers and 0 without, got {w!r} for window_layers={layers!r}")  # fmt: skip
        ckv, kpe = self.ckv_dim, self.kpe_dim
        if (any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in (ckv, kpe))
                or bool(ckv) != bool(kpe) or kpe % 2):  # fmt: skip
            raise ValueError(f"TinyConfig.ckv_dim and kpe_dim must both be ints > 0 (kpe_dim "
                             f"even: rotary pairs) for an MLA model, both 0 otherwise, got "
                             f"ckv_dim={ckv!r}, kpe_dim={kpe!r}")  # fmt: skip
        if ckv and (self.num_kv_heads != 1 or layers):
            raise ValueError(f"an MLA TinyConfig (ckv_dim={ckv}) has one latent KV head and no "
                             f"window layers: pass num_kv_heads=1 and window_layers=(), got "
                             f"num_kv_heads={self.num_kv_heads}, window_layers={layers!r}")  # fmt: skip

    @property
    def mla(self) -> bool:
        """Whether the attention layers are MLA (a latent KV pool)."""
        return bool(self.ckv_dim)

    @property
    def hybrid(self) -> bool:
        """Whether the model has sliding-window layers."""
        return bool(self.window_layers)

    def layer_window(self, layer: int) -> int:
        """``w`` of a window layer, 0 for a full layer."""
        return self.sliding_window_size if layer in self.window_layers else 0


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [T, H, D]`` at ``positions [T]``; the angles
    are computed in float64 whatever ``x``'s dtype."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = positions.to(torch.float64).view(-1, 1) * inv.view(1, -1)  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _causal_attention(q, k, v, first: int, window: int = 0,
                      visible: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``q [T, H, D]`` at sequence positions ``first … first+T−1`` over ``k, v [first+T, H_kv, D]``
    (positions ``0 …``), causal; with ``window = w > 0`` a query at ``p`` sees ``(p − w, p]``
    only; ``visible [T, first+T]``, if given, replaces both. Computed in ``q``'s dtype."""
    T, H, D = q.shape
    group = H // k.shape[1]
    kk = k.repeat_interleave(group, 1)
    vv = v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q, kk) / math.sqrt(D)
    if visible is None:
        qpos = first + torch.arange(T, device=q.device).view(-1, 1)
        kpos = torch.arange(k.shape[0], device=q.device).view(1, -1)
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), vv)


class KVCache:
    """One model's paged KV pools: per layer ``k, v [P, H_kv, D]``; slot ``s`` is row ``s``
    (page ``s // page_size``), slot 0 the reserved sink. A hybrid model's window layers keep
    theirs in the window pool, ``[P_swa, H_kv, D]`` (slot 0 its sink too).

    Attributes
    ----------
    k, v : list of torch.Tensor
        Per layer.
    pool : KVPool
        The full layers' K and V buffers, for :func:`specmeta.move_kv_cache` (one launch for
        all of them).
    window_pool : KVPool or None
        The window layers' (a hybrid model), moved with window-pool slots.
    """

    def __init__(self, cfg: TinyConfig, pool_size: int, dtype: torch.dtype, device,
                 window_pool_size: int | None = None):  # fmt: skip
        if cfg.hybrid and not window_pool_size:
            raise ValueError("a hybrid model's cache needs window_pool_size (its window pool)")
        self.window_layers = cfg.window_layers

        def zeros(i):
            rows = window_pool_size if i in cfg.window_layers else pool_size
            return torch.zeros((rows, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device)

        self.k = [zeros(i) for i in range(cfg.num_layers)]
        self.v = [zeros(i) for i in range(cfg.num_layers)]
        full = [i for i in range(cfg.num_layers) if i not in cfg.window_layers]
        self.pool = KVPool([*(self.k[i] for i in full), *(self.v[i] for i in full)])
        self.window_pool = (KVPool([*(self.k[i] for i in cfg.window_layers),
                                    *(self.v[i] for i in cfg.window_layers)])
                            if cfg.hybrid else None)  # fmt: skip

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The forward's KV write: row ``slots[i]`` of layer ``layer`` gets ``k[i], v[i]``
        (``slots`` in the layer's pool)."""
        idx = slots.reshape(-1).long()
        self.k[layer][idx] = k.to(self.k[layer].dtype)
        self.v[layer][idx] = v.to(self.v[layer].dtype)


class LatentCache:
    """An MLA model's paged latent pool: per layer ``ckv [P, ckv_dim]`` and ``kpe [P,
    kpe_dim]``, slots as :class:`KVCache`'s (slot ``s`` is row ``s``, page ``s // page_size``;
    slot 0 the sink).

    Attributes
    ----------
    ckv, kpe : list of torch.Tensor
        Per layer.
    k, v : list of torch.Tensor
        ``ckv`` and ``kpe``: the two buffers of a layer in the order an attention backend
        takes them (``backend(handle, q, ckv, kpe)`` for MLA metadata).
    pool : KVPool
        Every ``ckv`` and ``kpe`` buffer, for :func:`specmeta.move_kv_cache` (one launch).
    """

    window_layers: tuple[int, ...] = ()
    window_pool = None

    def __init__(self, cfg: TinyConfig, pool_size: int, dtype: torch.dtype, device):
        if not cfg.mla:
            raise ValueError("a LatentCache is an MLA model's (TinyConfig.ckv_dim > 0)")
        self.ckv = [torch.zeros((pool_size, cfg.ckv_dim), dtype=dtype, device=device)
                    for _ in range(cfg.num_layers)]  # fmt: skip
        self.kpe = [torch.zeros((pool_size, cfg.kpe_dim), dtype=dtype, device=device)
                    for _ in range(cfg.num_layers)]  # fmt: skip
        self.pool = KVPool([*self.ckv, *self.kpe])

    @property
    def k(self) -> list[torch.Tensor]:
        return self.ckv

    @property
    def v(self) -> list[torch.Tensor]:
        return self.kpe

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The forward's latent write: row ``slots[i]`` of layer ``layer`` gets the token's
        ``ckv`` (``v[i]``, the first ``ckv_dim`` of ``k[i]``) and ``kpe`` (the rest of
        ``k[i]``, rotated)."""
        idx = slots.reshape(-1).long()
        dc = self.ckv[layer].shape[1]
        self.ckv[layer][idx] = v[:, 0].to(self.ckv[layer].dtype)
        self.kpe[layer][idx] = k[:, 0, dc:].to(self.kpe[layer].dtype)


class PagedAttention:
    """Attention of one forward through specmeta metadata: store this forward's KV at
    ``out_cache_loc``, then ``backend(handle, q, k_pool, v_pool)`` per layer.

    Parameters
    ----------
    cache : KVCache
        The model's pools.
    out_cache_loc : torch.Tensor
        ``[T]`` slots of the forward's tokens, in query-row order.
    backend : object
        An attention backend of :mod:`specmeta.testing.attention`.
    handle : object
        ``backend.prepare(meta)`` of the forward's metadata (once per forward, not per layer).
    timer : callable, optional
        ``timer(name)`` returns a context manager; the backend call is timed as
        ``"attention"``.
    window : tuple, optional
        A hybrid model's ``(window_out_cache_loc, window_handle)``: its window layers store
        their KV at those window-pool slots and read it through that metadata.
    """

    def __init__(self, cache: KVCache, out_cache_loc: torch.Tensor, backend, handle, timer=None,
                 window: tuple | None = None):  # fmt: skip
        if cache.window_layers and window is None:
            raise ValueError("a hybrid model's forward needs its window layers' slots and metadata")
        self.cache, self.out_cache_loc = cache, out_cache_loc
        self.backend, self.handle, self.timer = backend, handle, timer
        self.window = window

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        slots, handle = self.out_cache_loc, self.handle
        if layer in self.cache.window_layers:
            slots, handle = self.window
        self.cache.store(layer, slots, k, v)
        if self.timer is None:
            return self.backend(handle, q, self.cache.k[layer], self.cache.v[layer])
        with self.timer("attention"):
            return self.backend(handle, q, self.cache.k[layer], self.cache.v[layer])


class DensePrefill:
    """Causal attention within one sequence (positions ``0 … T−1``, a window layer's window
    applied) that also stores the keys and values at ``slots`` of ``cache`` (a window layer's
    at ``window_slots``): a prompt's prefill, dense, outside specmeta."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, windows: Sequence[int],
                 window_slots: torch.Tensor | None = None):  # fmt: skip
        self.cache, self.slots, self.windows = cache, slots, windows
        self.window_slots = window_slots

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        window = self.windows[layer]
        self.cache.store(layer, self.window_slots if window else self.slots, k, v)
        return _causal_attention(q, k, v, 0, window)


class DenseCache:
    """Plain causal attention over a per-sequence cache that grows with every call: no pages,
    no metadata (``windows[layer]``: the layer's sliding window, 0 for none). Calls must pass
    consecutive positions (the chunk follows the cache)."""

    def __init__(self, num_layers: int, windows: Sequence[int] | None = None):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.windows = tuple(windows) if windows is not None else (0,) * num_layers

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        first = 0 if self.k[layer] is None else self.k[layer].shape[0]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        return _causal_attention(q, self.k[layer], self.v[layer], first, self.windows[layer])


class DenseDraftWindow:
    """Dense attention of a draft-decode forward under a draft window (design §2.10): over a
    sequence of a prefix of ``Ld`` tokens and a chain after it, the prefix rows are causal;
    a chain row of a full layer sees the first ``min(sink, Ld)`` positions, the most recent
    ``min(Ld, window + sink) − min(sink, Ld)`` ones of the prefix, and the chain up to itself;
    a window layer keeps its own window ``(p − w, p]`` (the draft window bounds the full
    layers' lists only)."""

    def __init__(self, prefix_len: int, window: int, sink: int, windows: Sequence[int]):
        self.Ld, self.window, self.sink, self.windows = prefix_len, window, sink, windows

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        T, Ld, dev = q.shape[0], self.Ld, q.device
        if self.windows[layer] or not self.window:
            return _causal_attention(q, k, v, 0, self.windows[layer])
        kept, head = min(Ld, self.window + self.sink), min(self.sink, Ld)
        qpos = torch.arange(T, device=dev).view(-1, 1)
        kpos = torch.arange(T, device=dev).view(1, -1)
        in_window = (kpos < head) | ((kpos >= Ld - (kept - head)) & (kpos < Ld)) | (kpos >= Ld)
        visible = (kpos <= qpos) & ((qpos < Ld) | in_window)
        return _causal_attention(q, k, v, 0, visible=visible)


class TinyModel:
    """The model: weights and the forward pass.

    Parameters
    ----------
    cfg : TinyConfig
        Sizes.
    weights : dict of str to torch.Tensor
        As drawn by :meth:`random`; all of one dtype and device.

    Examples
    --------
    >>> model = TinyModel.random(TinyConfig(), seed=0)
    >>> tokens, margins = model.greedy(torch.tensor([3, 1, 4]), 8)   # the reference
    >>> draft = model.perturbed(0.3, seed=1)                         # a worse draft
    """

    def __init__(self, cfg: TinyConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.weights = weights
        first = next(iter(weights.values()))
        self.dtype, self.device = first.dtype, first.device

    @classmethod
    def random(cls, cfg: TinyConfig, seed: int, *, dtype: torch.dtype = torch.float64,
               device: torch.device | str = "cpu") -> TinyModel:  # fmt: skip
        """Weights drawn from ``seed`` (float64 on the CPU, then cast to ``dtype``): the same
        seed gives the same model on every device and in every dtype, up to the cast."""
        g = torch.Generator().manual_seed(seed)

        def normal(*shape, std):
            return torch.randn(*shape, generator=g, dtype=torch.float64) * std

        c = cfg
        hd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        w = {"embed": normal(c.vocab_size, c.hidden_size, std=1.0)}
        for i in range(c.num_layers):
            w[f"{i}.attn_norm"] = 1.0 + normal(c.hidden_size, std=0.1)
            if c.mla:  # the query's two parts per head, the latent and rotary keys, wo over ckv
                hc = c.num_heads * c.ckv_dim
                w[f"{i}.wq"] = normal(c.hidden_size, c.num_heads * (c.ckv_dim + c.kpe_dim),
                                      std=c.hidden_size**-0.5)  # fmt: skip
                w[f"{i}.wkv"] = normal(c.hidden_size, c.ckv_dim, std=c.hidden_size**-0.5)
                w[f"{i}.kv_norm"] = 1.0 + normal(c.ckv_dim, std=0.1)
                w[f"{i}.wkpe"] = normal(c.hidden_size, c.kpe_dim, std=c.hidden_size**-0.5)
                w[f"{i}.wo"] = normal(hc, c.hidden_size, std=hc**-0.5)
            else:
                w[f"{i}.wq"] = normal(c.hidden_size, hd, std=c.hidden_size**-0.5)
                w[f"{i}.wk"] = normal(c.hidden_size, kvd, std=c.hidden_size**-0.5)
                w[f"{i}.wv"] = normal(c.hidden_size, kvd, std=c.hidden_size**-0.5)
                w[f"{i}.wo"] = normal(hd, c.hidden_size, std=hd**-0.5)
            w[f"{i}.mlp_norm"] = 1.0 + normal(c.hidden_size, std=0.1)
            w[f"{i}.w_gate"] = normal(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5)
            w[f"{i}.w_up"] = normal(c.hidden_size, c.intermediate_size, std=c.hidden_size**-0.5)
            w[f"{i}.w_down"] = normal(c.intermediate_size, c.hidden_size,
                                      std=c.intermediate_size**-0.5)  # fmt: skip
        w["final_norm"] = 1.0 + normal(c.hidden_size, std=0.1)
        w["lm_head"] = normal(c.hidden_size, c.vocab_size, std=c.logit_scale * c.hidden_size**-0.5)
        return cls(cfg, {k: v.to(device=device, dtype=dtype) for k, v in w.items()})

    def perturbed(self, scale: float, seed: int) -> TinyModel:
        """A copy whose every weight matrix gets Gaussian noise of ``scale`` times its own
        standard deviation: a draft model that is right often, but not always."""
        if not scale >= 0:
            raise ValueError(f"scale must be >= 0, got {scale!r}")
        g = torch.Generator().manual_seed(seed)
        out = {}
        for name, w in self.weights.items():
            w64 = w.to(torch.float64).cpu()
            noise = torch.randn(w64.shape, generator=g, dtype=torch.float64)
            out[name] = (w64 + scale * w64.std() * noise).to(device=self.device, dtype=self.dtype)
        return TinyModel(self.cfg, out)

    def to(self, *, dtype: torch.dtype | None = None, device=None) -> TinyModel:
        """The same weights in another dtype or on another device."""
        dtype = dtype or self.dtype
        device = device if device is not None else self.device
        return TinyModel(self.cfg, {k: v.to(device=device, dtype=dtype)
                                    for k, v in self.weights.items()})  # fmt: skip

    def new_cache(self, pool_size: int,
                  window_pool_size: int | None = None) -> KVCache | LatentCache:  # fmt: skip
        """An empty paged KV pool of ``pool_size`` slots in the model's dtype and device (and a
        window pool of ``window_pool_size`` for a hybrid model's window layers); an MLA model's
        is a :class:`LatentCache`."""
        if self.cfg.mla:
            return LatentCache(self.cfg, pool_size, self.dtype, self.device)
        return KVCache(self.cfg, pool_size, self.dtype, self.device, window_pool_size)

    @property
    def windows(self) -> tuple[int, ...]:
        """Every layer's sliding window (0: a full layer)."""
        return tuple(self.cfg.layer_window(i) for i in range(self.cfg.num_layers))

    # ----------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                attention: Attention) -> torch.Tensor:  # fmt: skip
        """Logits ``[T, V]`` (float32 or wider) of ``tokens [T]`` at ``positions [T]``; the
        attention of every layer is ``attention(layer, q, k, v)``, with rotary positions
        already applied to ``q`` and ``k``."""
        c, w = self.cfg, self.weights
        T = tokens.shape[0]
        tokens = tokens.to(self.device).long()
        positions = positions.to(self.device)
        h = w["embed"][tokens]
        for i in range(c.num_layers):
            x = _rmsnorm(h, w[f"{i}.attn_norm"])
            if c.mla:
                q, k, v = self._latent_qkv(i, x, positions)
            else:
                q = (x @ w[f"{i}.wq"]).view(T, c.num_heads, c.head_dim)
                k = (x @ w[f"{i}.wk"]).view(T, c.num_kv_heads, c.head_dim)
                v = (x @ w[f"{i}.wv"]).view(T, c.num_kv_heads, c.head_dim)
                q = _rope(q, positions, c.rope_theta)
                k = _rope(k, positions, c.rope_theta)
            o = attention(i, q, k, v).to(h.dtype)
            h = h + o.reshape(T, w[f"{i}.wo"].shape[0]) @ w[f"{i}.wo"]
            x = _rmsnorm(h, w[f"{i}.mlp_norm"])
            gate = torch.nn.functional.silu(x @ w[f"{i}.w_gate"])
            h = h + (gate * (x @ w[f"{i}.w_up"])) @ w[f"{i}.w_down"]
        logits = _rmsnorm(h, w["final_norm"]) @ w["lm_head"]
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def _latent_qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        """An MLA layer's ``q = [q_nope, q_pe] [T, H, Dc + Dr]``, ``k = [ckv, kpe] [T, 1, Dc +
        Dr]`` and ``v = ckv [T, 1, Dc]``, the rotary parts rotated at ``positions``."""
        c, w, T = self.cfg, self.weights, x.shape[0]
        dc = c.ckv_dim
        q = (x @ w[f"{i}.wq"]).view(T, c.num_heads, dc + c.kpe_dim)
        q = torch.cat([q[..., :dc], _rope(q[..., dc:], positions, c.rope_theta)], -1)
        ckv = _rmsnorm(x @ w[f"{i}.wkv"], w[f"{i}.kv_norm"]).view(T, 1, dc)
        kpe = _rope((x @ w[f"{i}.wkpe"]).view(T, 1, c.kpe_dim), positions, c.rope_theta)
        return q, torch.cat([ckv, kpe], -1), ckv

    def prefill(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                window_slots: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits ``[T, V]`` of a whole prompt at positions ``0 … T−1``, its KV stored at
        ``slots [T]`` of ``cache`` (a window layer's at ``window_slots``, window-pool ids)
        (dense attention: prefill is not specmeta's)."""
        positions = torch.arange(tokens.shape[0], device=self.device)
        return self.forward(tokens, positions,
                            DensePrefill(cache, slots, self.windows, window_slots))  # fmt: skip

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of a whole sequence, dense causal attention (windowed in window
        layers), no cache."""
        positions = torch.arange(tokens.shape[0], device=self.device)
        return self.forward(tokens, positions, DenseCache(self.cfg.num_layers, self.windows))

    @torch.no_grad()
    def draft_logits(self, prefix: torch.Tensor, chain: torch.Tensor, window_size: int = 0,
                     sink_size: int = 0) -> torch.Tensor:  # fmt: skip
        """Logits ``[C, V]`` of a draft chain ``chain [C]`` after ``prefix [Ld]`` as draft decode
        computes them under a draft window (:class:`DenseDraftWindow`; ``window_size = 0``: no
        window): the dense reference of a windowed draft."""
        seq = torch.cat([prefix, chain]).to(self.device).long()
        positions = torch.arange(seq.shape[0], device=self.device)
        attn = DenseDraftWindow(prefix.shape[0], window_size, sink_size, self.windows)
        return self.forward(seq, positions, attn)[prefix.shape[0] :]

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain greedy decoding, the reference of the lossless tests: no pages, no metadata,
        no specmeta, one token a forward over a dense per-sequence cache.

        Returns
        -------
        (tokens, margins) : tuple of torch.Tensor
            ``tokens [num_tokens]`` int64 (CPU), the continuation of ``prompt``, and
            ``margins [num_tokens]`` float64, the lead of each step's top logit over the
            second.
        """
        cache = DenseCache(self.cfg.num_layers, self.windows)
        seq = prompt.to(self.device).long()
        logits = self.forward(seq, torch.arange(seq.shape[0], device=self.device), cache)[-1]
        tokens, margins = [], []
        pos = seq.shape[0]
        for _ in range(num_tokens):
            top = logits.double().topk(2).values
            nxt = int(logits.argmax())
            tokens.append(nxt)
            margins.append(float(top[0] - top[1]))
            step = torch.tensor([nxt], device=self.device)
            logits = self.forward(step, torch.tensor([pos], device=self.device), cache)[-1]
            pos += 1
        return torch.tensor(tokens, dtype=torch.int64), torch.tensor(margins, dtype=torch.float64)
