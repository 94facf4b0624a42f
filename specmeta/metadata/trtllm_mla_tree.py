"""TRT-LLM MLA's tree verify (design §3.4): a cascade of TRT-LLM's kernel and FlashInfer MLA's.

TRT-LLM's MLA kernel (``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``) reads one
block-table row per query sequence, in pages of 32 or 64 tokens, and is causal over a dense
``[B, q_len]`` query; it takes no custom mask. A tree's verify is therefore split, as FlashInfer
MLA's (design §3.5), into two passes over the same ``B·N`` query rows, row ``r = b·N + j`` for
node ``j`` of request ``b``, merged by log-sum-exp:

* the **prefix pass**, TRT-LLM's kernel with ``q_len = 1``: every row's block table is its
  request's prefix pages (the same row repeated ``N`` times) and ``seq_lens_k = L_b``;
* the **ancestor pass**, FlashInfer MLA's ``BatchMLAPagedAttentionWrapper`` at page size 1 over
  the same latent cache viewed ``[num_pages·ps, 1, D]``: one list a node, its ancestors' and
  its own window slots (``tree_ancestor_kv_indices``). Pages of 32 or 64 tokens cannot list a
  node's ancestors, a scattered subset of the window (two children of one node would need the
  same page offset), so this pass takes token lists; FlashInfer is the package that carries
  TRT-LLM's kernel, so an engine has it.

TRT-LLM's kernels leave a row with no keys undefined (the reference engine fixes such rows up
before a merge): a request with ``L_b = 0`` gives its prefix rows a stale output and LSE.
:meth:`TrtllmMlaTreeVerify.mask_empty_prefix` sets their LSE to ``−inf`` so that
:func:`specmeta.merge_state` weighs them 0 and never reads their output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..kernels.host_list_lengths import (
    bind_check_host_list_lengths,
    check_host_list_lengths_ref,
    publish_host_list_lengths,
)
from ..kernels.prefix_page_table import bind_prefix_page_table, prefix_page_table_ref
from ..kernels.tree_ancestor_kv_indices import (
    bind_tree_ancestor_kv_indices,
    tree_ancestor_host_mirrors_torch,
    tree_ancestor_kv_indices_ref,
)
from ..stage import Stage
from .flashinfer_mla_results import FlashInferMLAPass
from .host_mirrors import HostMirrorRing
from .inputs import check_node_depths_cpu
from .layout import UniformQueryLayout

__all__ = ["TrtllmMlaPrefixPass", "TrtllmMlaTreeVerify", "TreeVerify"]

_MODE = "target_verify"
# Host mirrors of the ancestor pass that change with the batch: from a ring (design §3.3).
RING_MIRRORS = ("ancestor_kv_indptr_host", "ancestor_kv_len_arr_host")


@dataclasses.dataclass(frozen=True)
class TrtllmMlaPrefixPass:
    """The prefix pass: TRT-LLM's MLA kernel on ``B·N`` query sequences of one token each.

    Attributes
    ----------
    block_kv_indices : torch.Tensor
        ``[B·N, maxblk]`` int32, device, contiguous: row ``b·N + j`` holds request ``b``'s
        prefix pages (``ceil(L_b / ps)`` of them), −1 beyond; exact.
    seq_lens_k : torch.Tensor
        ``[B·N]`` int32, device: ``L_b``; exact. 0 for an empty prefix, a row the kernel leaves
        undefined (:meth:`TrtllmMlaTreeVerify.mask_empty_prefix`).
    max_seq_len_k : int
        Host upper bound of ``seq_lens_k``: ``max_context_len``, the same at every replay.
    """

    block_kv_indices: torch.Tensor
    seq_lens_k: torch.Tensor
    max_seq_len_k: int

    def kernel_kwargs(self) -> dict[str, Any]:
        """The metadata keywords of ``trtllm_batch_decode_with_kv_cache_mla`` for this pass,
        the query ``[B·N, 1, H, Dc + Dr]`` (one token a sequence): ``block_tables``,
        ``seq_lens``, ``max_seq_len``, and the LSE in natural-log units, which
        :func:`specmeta.merge_state` takes (TRT-LLM's default is base 2)."""
        return dict(block_tables=self.block_kv_indices, seq_lens=self.seq_lens_k,
                    max_seq_len=self.max_seq_len_k, return_lse=True,
                    return_lse_base="basee")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrtllmMlaTreeVerify:
    """A tree's target verify: two passes over the same ``B·N`` query rows (row ``b·N + j``,
    node ``j`` of request ``b``), merged by log-sum-exp::

        o_p, lse_p = trtllm_batch_decode_with_kv_cache_mla(q.unsqueeze(1), kv_cache, ws,
                                                          ..., **meta.prefix.kernel_kwargs())
        wrapper.plan(**meta.ancestors.plan_kwargs(), ...)     # kv_cache viewed in pages of 1
        o_a, lse_a = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True,
                                 return_lse_base_on_e=True)
        merge_state(o_p.view(o_a.shape), meta.mask_empty_prefix(lse_p), o_a, lse_a, out=...)

    Attributes
    ----------
    prefix : TrtllmMlaPrefixPass
        Each node's request prefix, non-causal (one query token a sequence).
    ancestors : FlashInferMLAPass
        One list a node, its ancestors' and its own window slots (``depth + 1`` of them, from
        the engine's node depths on the host), page size 1, non-causal.
    """

    prefix: TrtllmMlaPrefixPass
    ancestors: FlashInferMLAPass

    def mask_empty_prefix(self, lse: torch.Tensor) -> torch.Tensor:
        """``lse`` (the prefix pass's ``[B·N, H]`` LSE, on the metadata's device) with ``−inf``
        in every row whose ``seq_lens_k`` is 0, in place, and returned: TRT-LLM's kernels
        leave such a row stale, and :func:`specmeta.merge_state` then gives it weight 0 and
        never reads its output. Two small launches (the rows' test, ``masked_fill_``), no host
        sync; capturable in a CUDA graph with the attention."""
        empty = (self.prefix.seq_lens_k == 0).view(-1, *([1] * (lse.dim() - 1)))
        return lse.masked_fill_(empty, float("-inf"))


class TreeVerify:
    """The tree verify of one :class:`~specmeta.metadata.trtllm_mla.TrtllmMlaBuilder`: its host
    buffers and mirror ring, its stages. ``buffers`` are the builder's ``target_verify.*``
    device buffers (keys without the backend prefix), ``host`` its host ones, ``specs`` the
    plan's specs of the ring's mirrors."""

    def __init__(self, builder: Any, host: dict[str, torch.Tensor], specs: dict,
                 mirror_depth: int) -> None:  # fmt: skip
        self.builder = builder
        self.host = host
        self.ring = HostMirrorRing(specs, mirror_depth, builder.device)
        cfg = builder.cfg
        bn = cfg.max_bs * cfg.num_draft_tokens
        # One query row a node, on the device and on the host, written once for max_bs.
        self.layout = UniformQueryLayout.create(
            1, bn, builder.device, out=builder.buffers[f"{_MODE}.ancestor_qo_indptr"]
        )
        UniformQueryLayout.create(1, bn, "cpu", out=host[f"{_MODE}.ancestor_qo_indptr_host"])

    def bind(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
             seq_lens: torch.Tensor, tree_mask: Any, status: torch.Tensor | None, v2p: Any,
             entry_page_size: Any) -> Stage:  # fmt: skip
        """The stage: each request's prefix table (``prefix_page_table``, ``extra = 0``), its
        copy into the node rows, the ancestor lists (``tree_ancestor_kv_indices``), the
        device's check of the host's ancestor counts and of its lengths. Its host part takes
        ``node_depths_cpu`` (required) and ``seq_lens_cpu`` (optional)."""
        b, cfg, buf = self.builder, self.builder.cfg, self.builder.buffers
        n, ps, where = cfg.num_draft_tokens, cfg.page_size, b.require(_MODE)
        if tree_mask is None:
            raise ValueError(
                f"{where}: tree_mask is required with topk={cfg.topk} > 1; pass the "
                f"[B, N, N] bool ancestor mask of the draft tree (N = {n})"
            )
        b.check(_MODE, req_pool_indices, req_to_token, seq_lens, tree_mask=tree_mask,
                status=status, entry_page_size=entry_page_size)  # the mask, then the spaces
        B, spaces = b._spaces(_MODE, req_pool_indices, req_to_token, seq_lens, status, v2p,
                             entry_page_size)  # fmt: skip
        word, args, BN = b.status_word(status), (req_pool_indices, req_to_token, seq_lens), B * n
        table, lens = buf[f"{_MODE}.block_kv_indices"], buf[f"{_MODE}.seq_lens_k"]
        width = table.shape[1]
        rows = buf[f"{_MODE}.prefix_block_kv_indices"][:BN]
        row_lens = buf[f"{_MODE}.prefix_seq_lens_k"][:BN]
        launches = [
            b._launch(bind_prefix_page_table, prefix_page_table_ref, *args, page_size=ps,
                      extra_tokens=0, fill_value=-1, page_table=table, cache_seqlens=lens,
                      status=word, **spaces),
            # Node j of request b reads request b's prefix: the request's row, N times (a
            # copy, no index computed; one torch launch each, no allocation, no sync).
            _copy(rows.view(B, n, width), table[:B].unsqueeze(1).expand(B, n, width)),
            _copy(row_lens.view(B, n), lens[:B].unsqueeze(1).expand(B, n)),
            b._launch(bind_tree_ancestor_kv_indices, tree_ancestor_kv_indices_ref, *args,
                      tree_mask, kv_len=buf[f"{_MODE}.ancestor_kv_len"][:BN],
                      kv_indptr=buf[f"{_MODE}.ancestor_kv_indptr"][: BN + 1],
                      kv_indices=buf[f"{_MODE}.ancestor_kv_indices"], status=word, page_size=ps,
                      **spaces),
        ]  # fmt: skip
        if b.check_host_lengths:  # the host's counts against the mask's, entry by entry
            launches.append(b._launch(
                bind_check_host_list_lengths, check_host_list_lengths_ref,
                buf[f"{_MODE}.ancestor_kv_len"][:BN],
                self.host[f"{_MODE}.ancestor_lengths_slot_host"],
                buf[f"{_MODE}.ancestor_lengths_seen"], status=word,
            ))  # fmt: skip
        made = b.views((_MODE, B, "tree"), _slots, len(self.ring.sets))
        ring, check, slot = self.ring, b.check_host_lengths, self.host[
            f"{_MODE}.ancestor_lengths_slot_host"]  # fmt: skip

        def host(seq_lens_cpu: torch.Tensor | None = None, node_depths_cpu: Any = None,
                 verify_lens_cpu: Any = None) -> TrtllmMlaTreeVerify:  # fmt: skip
            if verify_lens_cpu is not None:
                raise ValueError(f"{where}: verify_lens_cpu was given, but a tree's verify has "
                                 "no ragged form; drop verify_lens_cpu")  # fmt: skip
            check_node_depths_cpu(where, node_depths_cpu, B, n)
            if seq_lens_cpu is not None:
                b.lengths(_MODE, B, seq_lens_cpu)
            turn = ring.claim()
            entry = made[turn]
            if entry is None:
                entry = made[turn] = self._result(B, ring.sets[turn])
            ptr, count = entry.ancestors.kv_indptr_host, entry.ancestors.kv_len_arr_host
            try:  # every depth checked before anything is written
                tree_ancestor_host_mirrors_torch(node_depths_cpu, kv_indptr_host=ptr,
                                                 kv_len_host=count)  # fmt: skip
            except (TypeError, ValueError) as err:
                raise type(err)(f"{where}: {err}") from None
            if check:  # for the device's check, once it consumed the last counts
                publish_host_list_lengths(slot, count)
            ring.advance()
            return entry

        check_lengths = b.host_check(_MODE, seq_lens, word)
        return Stage([*launches, check_lengths], host=host)

    def _result(self, B: int, mirrors: dict) -> TrtllmMlaTreeVerify:
        """The result of ``B`` requests over the ring's set ``mirrors``."""
        cfg, buf = self.builder.cfg, self.builder.buffers
        BN = B * cfg.num_draft_tokens
        prefix = TrtllmMlaPrefixPass(
            block_kv_indices=buf[f"{_MODE}.prefix_block_kv_indices"][:BN],
            seq_lens_k=buf[f"{_MODE}.prefix_seq_lens_k"][:BN],
            max_seq_len_k=cfg.max_context_len,
        )
        ancestors = FlashInferMLAPass(
            qo_indptr=self.layout.cu_seqlens_q(BN),
            kv_indptr=buf[f"{_MODE}.ancestor_kv_indptr"][: BN + 1],
            kv_indices=buf[f"{_MODE}.ancestor_kv_indices"],
            qo_indptr_host=self.host[f"{_MODE}.ancestor_qo_indptr_host"][: BN + 1],
            kv_indptr_host=mirrors["ancestor_kv_indptr_host"][: BN + 1],
            kv_len_arr_host=mirrors["ancestor_kv_len_arr_host"][:BN],
            page_size=1, causal=False,
        )  # fmt: skip
        return TrtllmMlaTreeVerify(prefix, ancestors)


class _copy:
    """A launch that copies ``src`` into ``dst`` (views made once, at bind)."""

    __slots__ = ("dst", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def _slots(count: int) -> list:
    """A batch size's results, one slot per ring set (``None`` until made)."""
    return [None] * count
