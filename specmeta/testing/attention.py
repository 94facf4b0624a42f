"""Attention over a paged KV pool, driven by a builder's metadata: one object per backend.

An engine's attention layer runs in two steps, and so does every backend here:

* ``handle = backend.prepare(meta)`` once per forward (FlashInfer: the wrapper's ``plan()``
  from the builder's host mirrors; the others: nothing);
* ``out = backend(handle, q, k_pool, v_pool)`` once per layer, on that layer's KV pool.

``meta`` is whatever the builder returned for the forward: an :class:`~specmeta.FA3Cascade`
or :class:`~specmeta.FA3Metadata`, a FlashInfer decode step, cascade step or prefill, a
TRT-LLM MLA decode step or prefill, or a FlashInfer MLA attention (its passes). ``q`` is
``[T, H, D]`` (one row per query token, in the builder's row order), ``k_pool`` and ``v_pool``
are ``[P, H_kv, D]``, one row per KV slot (the pool is viewed in pages of the metadata's page
size, so ``P`` is a multiple of it). The result is ``[T, H, D]`` in ``q``'s dtype, with the
softmax scale ``1/sqrt(D)``.

FlashInfer MLA's metadata is read over a latent pool
(:class:`~specmeta.testing.tiny_model.LatentCache`): ``k_pool`` is then ``ckv [P, Dc]`` and
``v_pool`` ``kpe [P, Dr]``, ``q`` is ``[q_nope, q_pe]`` (``[T, H, Dc + Dr]``), the values are
``ckv`` and the result ``[T, H, Dc]``, with the scale ``1/sqrt(Dc + Dr)`` (design §3.5).
TRT-LLM MLA's is read over either pool (a 2-D ``k_pool`` is a latent one), and its tree
verify (design §3.4) over a latent pool only.

:class:`TorchAttention` reads the metadata with the torch consumers of
:mod:`specmeta.testing.consumers` (float64, any device; the CPU tier). The real kernels are
:class:`CuteFlashAttention` (FlashAttention's CuTe kernels, ``flash_attn.cute``) and
:class:`FlashInferAttention` (FlashInfer's wrappers); they import their library when
constructed and need a CUDA device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..kernels.merge_state import merge_state, merge_state_ref
from ..metadata.fa3 import FA3Cascade, FA3Metadata
from ..metadata.flashinfer import FlashInferCascadeStep, FlashInferDecodeStep, FlashInferPrefill
from ..metadata.flashinfer_mla_results import FlashInferMLAAttention
from ..metadata.trtllm_mla import TrtllmMlaDecodeStep, TrtllmMlaPrefill, TrtllmMlaTreeVerify
from .consumers import fa3 as fa3_consumer
from .consumers import flashinfer as flashinfer_consumer
from .consumers import flashinfer_mla as flashinfer_mla_consumer
from .consumers import trtllm_mla as trtllm_consumer
from .consumers.dense import dense_attention

__all__ = ["TorchAttention", "CuteFlashAttention", "FlashInferAttention", "FlashInferMLAKernel",
           "backend", "latent_scale"]

# Wrappers of one kind used in turn by FlashInferAttention: more than the forwards a host plans
# ahead of its device within one draft iteration.
_WRAPPERS_PER_KIND = 8


class TorchAttention:
    """The torch consumers (float64 arithmetic, exact reading of the metadata).

    Parameters
    ----------
    page_size : int
        The pool's page size: TRT-LLM MLA's metadata does not carry it.
    """

    name = "torch"

    def __init__(self, page_size: int = 1):
        self.page_size = page_size

    def prepare(self, meta: Any) -> Any:
        return meta

    def __call__(self, meta, q, k_pool, v_pool) -> torch.Tensor:
        if isinstance(meta, FA3Cascade | FA3Metadata) and _fa3_windowed(meta):
            out = fa3_window_cascade(q, k_pool, v_pool, meta)  # a window layer's (design §2.10)
        elif isinstance(meta, FA3Cascade):
            out = fa3_consumer.run_cascade(q, k_pool, v_pool, meta)
        elif isinstance(meta, FA3Metadata):
            out = fa3_consumer.attend(q, k_pool, v_pool, meta)[0]
        elif isinstance(meta, FlashInferDecodeStep):
            out = flashinfer_consumer.decode(q, k_pool, v_pool, meta)[0]
        elif isinstance(meta, FlashInferCascadeStep):
            out = flashinfer_consumer.cascade(q, k_pool, v_pool, meta)[0]
        elif isinstance(meta, FlashInferPrefill):
            out = flashinfer_consumer.prefill(q, k_pool, v_pool, meta)[0]
        elif isinstance(meta, TrtllmMlaTreeVerify):  # k_pool, v_pool: ckv, kpe
            dc = k_pool.shape[-1]
            out = trtllm_consumer.tree_verify(meta, q[..., :dc], q[..., dc:], k_pool, v_pool,
                                              latent_scale(k_pool, v_pool), self.page_size)[0]  # fmt: skip
        elif isinstance(meta, (TrtllmMlaDecodeStep, TrtllmMlaPrefill)):
            if k_pool.dim() == 2:  # a latent pool: keys [ckv, kpe], values ckv (scale 1/sqrt)
                k_pool, v_pool = torch.cat([k_pool, v_pool], -1).unsqueeze(1), k_pool.unsqueeze(1)
            read = (trtllm_consumer.decode if isinstance(meta, TrtllmMlaDecodeStep)
                    else trtllm_consumer.prefill)  # fmt: skip
            out = read(q, k_pool, v_pool, meta, self.page_size)[0]
        elif isinstance(meta, FlashInferMLAAttention):  # k_pool, v_pool: ckv, kpe
            dc = k_pool.shape[-1]
            out = flashinfer_mla_consumer.attention(meta, q[..., :dc], q[..., dc:], k_pool, v_pool,
                                                    latent_scale(k_pool, v_pool))[0]  # fmt: skip
        else:
            raise TypeError(f"no torch consumer for metadata of type {type(meta).__name__}")
        return out.to(q.dtype)


class CuteFlashAttention:
    """FlashAttention's CuTe kernels (``flash_attn.cute.flash_attn_varlen_func``, the
    ``flash-attn-4`` package) reading :class:`~specmeta.FA3Metadata` through
    :meth:`~specmeta.FA3Metadata.varlen_kwargs`; a cascade's two passes are merged by
    :func:`~specmeta.kernels.merge_state.merge_state`.

    TRT-LLM MLA's block tables are read too, as plain paged attention (one query row per branch
    in draft decode, ``cu_seqlens_q`` rows causal in a prefill): TRT-LLM's own MLA kernels need
    Blackwell, so this is how their page ids and lengths are checked on Hopper.

    Parameters
    ----------
    page_size : int
        The pool's page size, for TRT-LLM MLA metadata (FA3 metadata carries its own).
    """

    name = "flash_attn.cute"

    def __init__(self, page_size: int = 1):
        from flash_attn.cute import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func
        self.page_size = page_size
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}

    def prepare(self, meta: Any) -> Any:
        if isinstance(meta, TrtllmMlaDecodeStep):
            rows = meta.seq_lens_k.shape[0]
            key = (rows, meta.seq_lens_k.device)
            if key not in self._aranges:  # one query row per branch: cu_seqlens_q = arange
                self._aranges[key] = torch.arange(
                    rows + 1, dtype=torch.int32, device=meta.seq_lens_k.device
                )
            return _Paged(meta.block_kv_indices, meta.seq_lens_k, self._aranges[key], 1, False,
                          self.page_size)  # fmt: skip
        if isinstance(meta, TrtllmMlaPrefill) and meta.seq_lens_q is not None:
            # A ragged verify: the kernel runs the dense [B, N] rows (an engine scatters the
            # bucket's tokens into them and gathers the output back, __call__ here).
            n, B = meta.max_seq_len_q, meta.seq_lens_k.shape[0]
            dense = torch.arange(B + 1, dtype=torch.int32, device=meta.seq_lens_k.device) * n
            return _Paged(meta.block_kv_indices, meta.seq_lens_k, dense, n, True, self.page_size,
                          (meta.seq_lens_q, meta.cu_seqlens_q, meta.sum_seq_lens_q))  # fmt: skip
        if isinstance(meta, TrtllmMlaPrefill):
            return _Paged(meta.block_kv_indices, meta.seq_lens_k, meta.cu_seqlens_q,
                          meta.max_seq_len_q, True, self.page_size)  # fmt: skip
        if not isinstance(meta, FA3Cascade | FA3Metadata):
            raise TypeError(f"FlashAttention reads FA3 metadata, got {type(meta).__name__}")
        return meta

    def _pass(self, meta: FA3Metadata, q, k_pool, v_pool):
        ps = meta.page_size
        k_cache = k_pool.view(-1, ps, *k_pool.shape[1:])
        v_cache = v_pool.view(-1, ps, *v_pool.shape[1:])
        scale = 1.0 / math.sqrt(q.shape[-1])
        return self._fn(q, k_cache, v_cache, **meta.varlen_kwargs(), softmax_scale=scale)

    def __call__(self, meta, q, k_pool, v_pool) -> torch.Tensor:
        if isinstance(meta, _Paged) and meta.scatter is not None:
            lens, cu, total = meta.scatter
            n, B = meta.max_seqlen_q, lens.shape[0]
            lens, cu = lens.tolist(), cu.tolist()
            pairs = [(cu[i] + j, i * n + j) for i in range(B) for j in range(lens[i])]
            idx = torch.tensor(pairs, dtype=torch.int64, device=q.device).view(-1, 2)
            token, row = idx[:, 0], idx[:, 1]  # a covered token and its dense row
            dense = q.new_zeros(B * n, *q.shape[1:])
            dense[row] = q[token]
            out = q.new_zeros(total, *q.shape[1:])
            out[token] = self._pass(meta, dense, k_pool, v_pool)[0][row]
            return out
        if isinstance(meta, FA3Metadata | _Paged):
            return self._pass(meta, q, k_pool, v_pool)[0]
        out, lse = self._pass(meta.normal, q, k_pool, v_pool)
        if meta.expand is None:
            return out
        out_e, lse_e = self._pass(meta.expand, q, k_pool, v_pool)
        # The kernels' LSE is [H, total_q]: the merge reads it through the transposed view.
        return merge_state(out, lse.t(), out_e, lse_e.t(), out=out)[0]


@dataclasses.dataclass(frozen=True)
class _Paged:
    """TRT-LLM MLA metadata as the keywords of a plain paged ``flash_attn_varlen_func`` call."""

    page_table: torch.Tensor
    seqused_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    causal: bool
    page_size: int
    # A ragged verify's (seq_lens_q, cu_seqlens_q, T): the bucket's tokens in the dense rows.
    scatter: tuple | None = None

    def varlen_kwargs(self) -> dict[str, Any]:
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "seqused_k": self.seqused_k,
            "page_table": self.page_table,
            "max_seqlen_q": self.max_seqlen_q,
            "causal": self.causal,
        }


class FlashInferAttention:
    """FlashInfer's wrappers, planned from the builder's host mirrors (no device-to-host copy).

    ``prepare`` plans a wrapper of the kind the metadata is for (decode, cascade, prefill);
    ``__call__`` runs it. One workspace serves every wrapper. A ``plan()`` queues copies from
    the wrapper's own pinned buffers, so each kind keeps a few wrappers used in turn: planning
    the next forward never rewrites what an earlier plan's copy has still to read.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim : int
        The model's attention shape.
    dtype : torch.dtype
        Query and KV dtype.
    device : torch.device or str
        Where the workspace lives.
    """

    name = "flashinfer"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
        import flashinfer

        self._fi = flashinfer
        self.shape = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, int], Any] = {}
        self._turn: dict[str, int] = {}

    def _wrapper(self, kind: str):
        turn = self._turn[kind] = (self._turn.get(kind, -1) + 1) % _WRAPPERS_PER_KIND
        if (kind, turn) not in self._wrappers:
            fi, ws = self._fi, self._workspace
            self._wrappers[(kind, turn)] = {
                "decode": lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD"),
                "cascade": lambda: fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD"),
                # fa2 takes custom masks; "auto" would pick fa3 on Hopper for the first,
                # unmasked plan and keep it.
                "prefill": lambda: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2"),
            }[kind]()
        return self._wrappers[(kind, turn)]

    def prepare(self, meta: Any) -> Any:
        hq, hkv, d = self.shape
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if _batch(meta) == 0:
            return None  # FlashInfer 0.7's plan() rejects an empty batch: an idle rank skips it
        if isinstance(meta, FlashInferDecodeStep):
            w = self._wrapper("decode")
            w.plan(meta.kv_indptr_host, meta.kv_indices, meta.kv_last_page_len_host, hq, hkv, d,
                   meta.page_size, **kw)  # fmt: skip
        elif isinstance(meta, FlashInferCascadeStep):
            w = self._wrapper("cascade")
            w.plan(list(meta.qo_indptr_host_arr), list(meta.paged_kv_indptr_host_arr),
                   list(meta.paged_kv_indices_arr), list(meta.paged_kv_last_page_len_host_arr),
                   hq, hkv, d, meta.page_size, **kw)  # fmt: skip
        elif isinstance(meta, FlashInferPrefill):
            w = self._wrapper("prefill")
            w.plan(meta.qo_indptr_host, meta.kv_indptr_host, meta.kv_indices,
                   meta.kv_last_page_len_host, hq, hkv, d, meta.page_size,
                   custom_mask=meta.custom_mask, packed_custom_mask=meta.packed_custom_mask,
                   causal=meta.causal, window_left=getattr(meta, "window_left", -1),
                   **kw)  # fmt: skip
        else:
            raise TypeError(f"FlashInfer reads FlashInfer metadata, got {type(meta).__name__}")
        return (w, meta.page_size)

    def __call__(self, handle, q, k_pool, v_pool) -> torch.Tensor:
        if handle is None:
            return torch.empty_like(q)
        w, ps = handle
        k_cache = k_pool.view(-1, ps, *k_pool.shape[1:])
        v_cache = v_pool.view(-1, ps, *v_pool.shape[1:])
        return w.run(q, (k_cache, v_cache))


def latent_scale(ckv: torch.Tensor, kpe: torch.Tensor) -> float:
    """MLA's softmax scale over a latent pool: ``1/sqrt(Dc + Dr)``, the width of the whole key
    ``[ckv, kpe]`` (the dense reference's ``1/sqrt(D)``)."""
    return 1.0 / math.sqrt(ckv.shape[-1] + kpe.shape[-1])


class FlashInferMLAKernel:
    """FlashInfer's MLA kernel (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, ``fa3`` on
    sm_90, ``fa2`` elsewhere) reading :class:`~specmeta.FlashInferMLABuilder`'s passes over a
    latent pool: ``prepare`` plans one wrapper a pass from the pass's host mirrors (nothing
    copied from the device), ``__call__`` runs them on ``(ckv, kpe)`` viewed in pages of the
    pass's page size, with natural-log LSEs, and merges two passes by
    :func:`specmeta.merge_state`. Wrappers are used in turn, as
    :class:`FlashInferAttention`'s: planning the next forward never rewrites what an earlier
    plan's copy has still to read.

    Parameters
    ----------
    num_heads : int
        Query heads (they share the one latent KV head).
    ckv_dim, kpe_dim : int
        The latent widths (the kernel serves 512 and 64).
    dtype : torch.dtype
        Query and pool dtype.
    device : torch.device or str
        Where the workspace lives.
    """

    name = "flashinfer_mla"

    def __init__(self, num_heads: int, ckv_dim: int, kpe_dim: int, dtype, device):
        import flashinfer.mla

        self._mla = flashinfer.mla
        cuda = torch.device(device).type == "cuda"
        hopper = cuda and torch.cuda.get_device_capability(device)[0] == 9
        self._backend = "fa3" if hopper else "fa2"
        self.num_heads, self.dims, self.dtype = num_heads, (ckv_dim, kpe_dim), dtype
        self.scale = 1.0 / math.sqrt(ckv_dim + kpe_dim)
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrappers: list[Any] = []
        self._turn = -1

    def _wrapper(self):
        self._turn = (self._turn + 1) % (2 * _WRAPPERS_PER_KIND)  # two passes a forward at most
        if self._turn == len(self._wrappers):
            self._wrappers.append(self._mla.BatchMLAPagedAttentionWrapper(
                self._workspace, backend=self._backend))  # fmt: skip
        return self._wrappers[self._turn]

    def prepare(self, meta: Any) -> Any:
        if not isinstance(meta, FlashInferMLAAttention):
            raise TypeError(f"FlashInfer MLA reads FlashInfer MLA metadata, got "
                            f"{type(meta).__name__}")  # fmt: skip
        if meta.prefix.kv_len_arr_host.shape[0] == 0:
            return None  # an empty batch: plan() takes no empty list set, an idle rank skips it
        (dc, dr), planned = self.dims, []
        for p in meta.passes:
            w = self._wrapper()
            used = int(p.kv_indptr_host[-1])  # a host mirror: no sync
            w.plan(
                metadata=self._mla.MLAPlanMetadata.csr(
                    qo_indptr=p.qo_indptr_host, kv_indptr=p.kv_indptr_host,
                    kv_indices=p.kv_indices[:used], kv_len_arr=p.kv_len_arr_host),
                num_heads=self.num_heads, head_dim_ckv=dc, head_dim_kpe=dr,
                page_size=p.page_size, causal=p.causal, sm_scale=self.scale,
                q_data_type=self.dtype, kv_data_type=self.dtype, query_layout="split",
                kv_cache_layout="split", lse_mode="basee",
            )  # fmt: skip
            planned.append((w, p.page_size))
        return planned

    def __call__(self, handle, q, ckv, kpe) -> torch.Tensor:
        dc, dr = self.dims
        if handle is None:
            return q.new_empty(q.shape[0], q.shape[1], dc)
        qn, qp = q[..., :dc].contiguous(), q[..., dc:].contiguous()
        runs = [w.run(query=(qn, qp), kv_cache=(ckv.view(-1, ps, dc), kpe.view(-1, ps, dr)),
                      return_lse=True, return_lse_base_on_e=True)
                for w, ps in handle]  # fmt: skip
        if len(runs) == 1:
            return runs[0][0]
        (o1, lse1), (o2, lse2) = runs  # the prefix pass and the ancestor pass
        return merge_state(o1, lse1, o2, lse2)[0]


def _fa3_windowed(meta: FA3Cascade | FA3Metadata) -> bool:
    """Whether a pass of FA3 metadata runs FlashAttention's own window."""
    passes = (meta,) if isinstance(meta, FA3Metadata) else (meta.normal, meta.expand)
    return any(p is not None and p.window_size is not None for p in passes)


def fa3_windowed_attend(q, k_pool, v_pool, meta: FA3Metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """One FlashAttention call with its own window (``meta.window_size = (left, right)``,
    design §2.10) over a pool ``[P, H_kv, D]`` viewed in pages of ``meta.page_size``, read as
    its kernels read it: sequence ``b`` has the query rows ``cu_seqlens_q[b] …`` and the keys
    ``0 … cache_seqlens[b] − 1`` (key ``k`` at offset ``k % ps`` of page ``page_table[b, k //
    ps]``); query row ``i`` of ``n_q`` sits at key position ``p = n_k − n_q + i`` and reads the
    keys ``[p − left, p + right]`` (``right = 0`` when causal) inside ``[0, n_k)``. Only the
    pages those keys lie on are read, and each must be a page of the pool (the sink page 0 of
    a column below the read floor is never read); a row past its table's width, more query rows
    than ``max_seqlen_q`` or non-int32 metadata is refused. Without a window (``None``) it is
    :func:`~specmeta.testing.consumers.fa3.attend`. Returns ``(out, lse [T, H])``, float64."""
    if meta.window_size is None:
        return fa3_consumer.attend(q, k_pool, v_pool, meta)
    ps = meta.page_size
    left, right = meta.window_size
    right = 0 if meta.causal else right
    for name in ("cache_seqlens", "page_table", "cu_seqlens_q"):
        if getattr(meta, name).dtype != torch.int32:
            raise AssertionError(f"FlashAttention needs int32 {name}")
    table, lens = meta.page_table.cpu().long(), meta.cache_seqlens.cpu().long()
    cu_q = meta.cu_seqlens_q.cpu().long()
    num_pages = k_pool.shape[0] // ps
    if int(cu_q[0]) != 0 or int(cu_q[-1]) != q.shape[0]:
        raise AssertionError("cu_seqlens_q must cover q")
    rows = []
    for b in range(cu_q.numel() - 1):
        n_q, n_k = int(cu_q[b + 1] - cu_q[b]), int(lens[b])
        if n_q > meta.max_seqlen_q or -(-n_k // ps) > table.shape[1]:
            raise AssertionError(f"sequence {b}: {n_q} query rows or {n_k} keys past the "
                                 f"metadata's bounds")  # fmt: skip
        for i in range(n_q):
            p = n_k - n_q + i
            keys = torch.arange(max(0, p - left), min(n_k, p + right + 1))
            pages = table[b, keys // ps]
            if not bool(((pages >= 0) & (pages < num_pages)).all()):
                raise AssertionError(f"sequence {b}, row {i}: a page id read is out of the pool")
            rows.append(pages * ps + keys % ps)
    return dense_attention(q, k_pool, v_pool, rows)


def fa3_window_cascade(q, k_pool, v_pool, meta: FA3Cascade | FA3Metadata) -> torch.Tensor:
    """A window layer's FA3 result (:func:`fa3_windowed_attend` on each pass), a cascade's two
    passes merged by LSE."""
    if isinstance(meta, FA3Metadata):
        return fa3_windowed_attend(q, k_pool, v_pool, meta)[0]
    out, lse = fa3_windowed_attend(q, k_pool, v_pool, meta.normal)
    if meta.expand is None:
        return out
    out_e, lse_e = fa3_windowed_attend(q, k_pool, v_pool, meta.expand)
    return merge_state_ref(out, lse, out_e, lse_e)[0]


def _batch(meta: Any) -> int:
    """Sequences of a FlashInfer result (its query groups), from shapes only."""
    if isinstance(meta, FlashInferCascadeStep):
        return meta.qo_indptr_arr[0].shape[0] - 1
    if isinstance(meta, FlashInferPrefill):
        return meta.qo_indptr.shape[0] - 1
    if isinstance(meta, FlashInferDecodeStep):
        return meta.kv_indptr.shape[0] - 1
    raise TypeError(f"FlashInfer reads FlashInfer metadata, got {type(meta).__name__}")


def backend(name: str, **kwargs) -> Any:
    """``"torch"``, ``"flash_attn.cute"``, ``"flashinfer"`` or ``"flashinfer_mla"`` by name
    (``kwargs`` go to its constructor)."""
    kinds = {c.name: c for c in (TorchAttention, CuteFlashAttention, FlashInferAttention,
                                 FlashInferMLAKernel)}  # fmt: skip
    if name not in kinds:
        raise ValueError(f"backend must be one of {sorted(kinds)}, got {name!r}")
    return kinds[name](**kwargs)
