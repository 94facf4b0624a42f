"""A window layer's ragged target verify (design §2.9, §2.10): ``FlashInferBuilder(cfg, device,
sliding_window_size=w).target_verify(verify_lens=, verify_lens_cpu=, num_tokens=)``.

Request ``b`` verifies ``v_b`` rows (the lengths padded to the bucket); its list starts at the
earliest position its first row (at ``L_b``) reads, ``max(0, L_b − w + 1)``, and ends at
``L_b + min(v_b, N)``. What each query row attends to, read through the torch consumer of
FlashInfer's metadata, equals dense attention over exactly the positions the rail names, in
window-pool ids: node ``j`` its prefix above ``L + d_j − w`` and its ancestors within ``w``, a
filler row (past ``N``) every listed position. The host mirrors (compiled and torch writers,
the lengths capped at ``w − 1``) equal the device's offsets. The expected values are read from
the rules here, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig
from specmeta.metadata import host_ops
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.host_ops import LengthRule
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, padded_lengths, sink_keeping_map, verify_split
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
ATOL = 1e-9
MAX_L = 40
POISON = -7


def _setup(gen, device, *, k, n, w, batch_size=5):
    """A config, a batch over virtual ids (a page map into a pool twice the size), a tree, and
    a full → window pool map with holes (the sink kept in place)."""
    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=4, max_bs=8,
                     max_context_len=MAX_L, sliding_window_size=w)  # fmt: skip
    batch = make_batch("random", batch_size=batch_size, topk=k, num_steps=3, page_size=4,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=MAX_L)  # fmt: skip
    pages = batch.pool_size // 4
    v2p = sink_keeping_map(pages, gen)
    full = 2 * batch.pool_size
    f2s = torch.randperm(2 * full, generator=gen)[:full]
    f2s[torch.rand(full, generator=gen) < 0.2] = -1
    f2s[f2s == 0] = f2s[0].clone()
    f2s[0] = 0
    tree = random_tree_mask(batch.batch_size, k, 3, n, gen).to(device)
    return cfg, batch, tree, v2p, f2s


def _rows(batch, tree, v2p, f2s, lens, w):
    """Every query row's keys in window-pool ids, from the rules (see the module's text)."""
    n = tree.shape[-1]
    out = []
    for b, (L, v) in enumerate(zip(batch.seq_lens_cpu.tolist(), lens, strict=True)):
        row = batch.req_to_token.cpu()[int(batch.req_pool_indices[b])]
        m = tree[b].cpu()
        nodes = min(v, n)
        depth = [int(m[j, :nodes].sum()) - 1 for j in range(nodes)]
        first = max(0, L - w + 1)
        for j in range(v):
            if j >= n:  # a filler row: the request's whole list
                pos = list(range(first, L + nodes))
            else:
                pos = [p for p in range(first, L) if p > L + depth[j] - w]
                pos += [L + c for c in range(nodes) if m[j, c] and depth[c] > depth[j] - w]
            ids = [emitted_id(row, p, v2p, E=1, ps=batch.page_size) for p in pos]
            out.append(torch.tensor([max(int(f2s[i]), 0) for i in ids], dtype=torch.int64))
    return out


@pytest.mark.parametrize("how,k,w,packed,host", [
    ("random", 2, 3, False, "compiled"), ("random", 2, 3, True, "torch"),
    ("zeros", 1, 1, True, "compiled"), ("zeros", 1, 1, False, "torch"),
    ("no_pad_leftover", 4, 9, False, "compiled"), ("no_pad_leftover", 4, 9, True, "torch"),
    ("one_takes_all", 2, 64, True, "compiled"), ("one_takes_all", 2, 64, False, "torch"),
])  # fmt: skip
def test_a_window_layers_ragged_verify_attends_to_the_rail(how, k, w, packed, host, gen, device,
                                                           request):  # fmt: skip
    """``w`` 1, below, at and above the prefixes; a bucket of random lengths, of zeros, one
    request taking it all, and the last request's filler rows (no pad request)."""
    if host == "compiled":
        request.getfixturevalue("compiled_host_ops")
    n = 1 + k if k > 1 else 4
    cfg, batch, tree, v2p, f2s = _setup(gen, device, k=k, n=n, w=w)
    Bp = batch.batch_size
    real, T = verify_split(gen, Bp, n, how)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w, host_ops=host == "compiled")
    meta = fi.target_verify(
        batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
        seq_lens_cpu=batch.seq_lens_cpu, packed=packed, v2p=v2p.to(device),
        full_to_swa=f2s.to(device), num_tokens=T,
        verify_lens=torch.tensor(real, dtype=torch.int32, device=device),
        verify_lens_cpu=torch.tensor(real, dtype=torch.int32),
    )  # fmt: skip
    lens = padded_lengths(real, T, Bp)
    assert meta.verify_lens.tolist() == lens and meta.max_q_len == T and not meta.causal
    for host_t, dev_t, name in ((meta.qo_indptr_host, meta.qo_indptr, "qo_indptr"),
                                (meta.kv_indptr_host, meta.kv_indptr, "kv_indptr"),
                                (meta.mask_indptr_host, meta.mask_indptr, "mask_indptr")):  # fmt: skip
        assert_equal(host_t, dev_t, f"{name}_host")
    cols = [min(L, w - 1) + min(v, n)
            for L, v in zip(batch.seq_lens_cpu.tolist(), lens, strict=True)]
    assert meta.kv_indptr_host.tolist() == [sum(cols[:i]) for i in range(Bp + 1)]
    window_pool = 2 * f2s.shape[0]
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    kc = torch.randn(window_pool, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(window_pool, H_KV, D, generator=gen, dtype=torch.float64)
    o, lse = consumer.prefill(q, kc, vc, meta)
    o_ref, lse_ref = dense_attention(q, kc, vc, _rows(batch, tree, v2p, f2s, lens, w))
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"outputs ({real}, T={T})"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"log-sum-exps ({real}, T={T})"


def test_ragged_writers_cap_the_prefixes_alike(gen, compiled_host_ops):
    """The compiled and numpy ragged writers over lengths capped at ``w − 1`` write the rule's
    offsets of ``min(L, w − 1) + min(v, N)`` and nothing past their views; a cap at the plan's
    ``max_context_len`` is the full layer's rule."""
    del compiled_host_ops
    n, max_bs = 5, 9
    for cap in (0, 3, 17, MAX_L):
        lengths = LengthRule(MAX_L, n, cap=cap)
        for B in (1, 4, max_bs):
            L = torch.randint(0, MAX_L + 1, (B,), generator=gen)
            L[0] = MAX_L
            count = int(torch.randint(0, B + 1, (1,), generator=gen))
            real = torch.randint(0, n + 1, (count,), generator=gen, dtype=torch.int32)
            T = int(real.sum()) + int(torch.randint(0, B * n - int(real.sum()) + 1, (1,),
                                                    generator=gen))  # fmt: skip
            v = padded_lengths(real.tolist(), T, B)
            cols = [min(x, cap) + min(y, n) for x, y in zip(L.tolist(), v, strict=True)]
            acc = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
            want = (v, acc(v), acc(cols), acc([x * c for x, c in zip(v, cols, strict=True)]))
            for use_compiled in (True, False):
                bufs = [torch.full((max_bs + (i > 0),), POISON, dtype=torch.int32)
                        for i in range(4)]  # fmt: skip
                for buf in bufs[1:]:
                    buf[0] = 0  # the ring's buffers are allocated zeroed
                views = [bufs[0][:B], *(b[: B + 1] for b in bufs[1:])]
                write = host_ops.ragged_verify_writer(lengths, B, count, T, n, *views,
                                                      use_compiled=use_compiled)  # fmt: skip
                write(L, real)
                for name, buf, exp in zip(("verify", "qo", "kv", "mask"), bufs, want, strict=True):
                    assert buf[: len(exp)].tolist() == exp, (name, cap, use_compiled, L, real, T)
                    assert buf[len(exp) :].eq(POISON).all(), (name, cap, use_compiled, "past")
