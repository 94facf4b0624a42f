"""The logical sequences every query row must attend to, as KV slot lists, from the contract
alone (never from the metadata under test): the truth that attention through any backend's
metadata is compared with (:func:`specmeta.testing.consumers.dense.dense_attention`).

All three read a :class:`specmeta.workloads.Batch` (its ``req_to_token`` rows and CPU lengths)
and return one CPU ``int64`` slot list per query row, in the builders' row order.
"""

from __future__ import annotations

import torch

from ..workloads import Batch

__all__ = ["branch_sequences", "window_sequences", "tree_sequences", "ragged_tree_sequences",
           "extend_sequences"]  # fmt: skip


def _rows(batch: Batch) -> list[tuple[torch.Tensor, int]]:
    r2t = batch.req_to_token.cpu().long()
    rpi = batch.req_pool_indices.cpu().long()
    return [(r2t[int(rpi[b])], int(batch.seq_lens_cpu[b])) for b in range(batch.batch_size)]


def branch_sequences(batch: Batch, out_cache_loc: torch.Tensor, step: int) -> list[torch.Tensor]:
    """Draft-decode forward ``step``: branch ``b·K + t`` reads its prefix ``row_b[0:L_b]``, then
    its own draft slots ``out_cache_loc[b, t, 0 … step]`` (design §1)."""
    K, S = batch.topk, batch.num_steps
    chains = out_cache_loc.cpu().long().view(-1, K, S)
    return [
        torch.cat([row[:L], chains[b, t, : step + 1]])
        for b, (row, L) in enumerate(_rows(batch))
        for t in range(K)
    ]


def window_sequences(batch: Batch, out_cache_loc: torch.Tensor, step: int, window: int,
                     sink: int, v2p: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
    """:func:`branch_sequences` under a draft window (design §2.10): the prefix keeps its first
    ``min(sink, L)`` tokens and then its most recent ones, ``min(L, window + sink)`` in all;
    with ``v2p`` every slot (prefix and draft, virtual) is read as ``v2p[id // ps]·ps +
    id mod ps``."""
    K, S, ps = batch.topk, batch.num_steps, batch.page_size
    chains = out_cache_loc.cpu().long().view(-1, K, S)
    table = v2p.cpu().long() if v2p is not None else None
    out = []
    for b, (row, L) in enumerate(_rows(batch)):
        kept, head = min(L, window + sink), min(sink, L)
        prefix = torch.cat([row[:head], row[L - (kept - head) : L]])
        for t in range(K):
            ids = torch.cat([prefix, chains[b, t, : step + 1]])
            out.append(ids if table is None else table[ids // ps] * ps + ids % ps)
    return out


def tree_sequences(batch: Batch, tree_mask: torch.Tensor) -> list[torch.Tensor]:
    """Target verify: node ``j`` of request ``i`` reads its prefix, then the verify-window slots
    ``row_i[L_i + c]`` of its ancestors and itself (the columns set in ``tree_mask[i, j]``)."""
    tree = tree_mask.cpu()
    n = tree.shape[-1]
    return [
        torch.cat([row[:L], row[L : L + n][tree[i, j]]])
        for i, (row, L) in enumerate(_rows(batch))
        for j in range(n)
    ]


def ragged_tree_sequences(batch: Batch, tree_mask: torch.Tensor,
                          verify_lens: list[int]) -> list[torch.Tensor]:  # fmt: skip
    """A ragged target verify (design §2.9), request ``i`` verifying ``v_i`` rows (the lengths
    padded to the bucket): row ``j < min(v_i, N)`` reads its prefix and its ancestors among the
    first ``min(v_i, N)`` nodes; a filler row ``j ≥ N`` reads the prefix and those nodes."""
    tree = tree_mask.cpu()
    n = tree.shape[-1]
    out = []
    for i, ((row, L), v) in enumerate(zip(_rows(batch), verify_lens, strict=True)):
        nodes = row[L : L + min(v, n)]
        for j in range(v):
            seen = tree[i, j, : nodes.numel()] if j < n else torch.ones(nodes.numel(), dtype=bool)
            out.append(torch.cat([row[:L], nodes[seen]]))
    return out


def extend_sequences(batch: Batch, num_tokens: int) -> list[torch.Tensor]:
    """Draft extend (and a chain's verify): query ``j`` of request ``i`` reads
    ``row_i[0 : L_i + j + 1]`` (causal, bottom-right over ``L_i + num_tokens`` keys)."""
    return [row[: L + j + 1] for row, L in _rows(batch) for j in range(num_tokens)]
