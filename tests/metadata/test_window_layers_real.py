"""A hybrid model's window layers read by FlashInfer's real kernels (GPU tier, design §2.10).

The window builder (``FlashInferBuilder(cfg, "cuda", sliding_window_size=w)``) builds its lists
in window-pool ids through the engine's full → window pool map; FlashInfer's decode and prefill
wrappers, planned from its host mirrors, read them over a bf16 window pool, and each output is
compared with float64 dense attention over exactly the positions the window read rail names,
their ids taken from the rules (the row's id, then the map): draft decode through the decode
wrapper (its per-branch page lists too, with ``window_left = w − 1``), its shared-prefix
cascade through the cascade wrapper, target verify through the prefill wrapper's custom mask
(bool and packed), causal prefills over the clipped lists (draft extend, a chain's verify)
with ``window_left = w − 1``, and a ragged verify (design §2.9) through the prefill wrapper
planned from its ragged mirrors.

FlashInfer is imported, never skipped: where it is missing these tests fail
(``scripts/gpu_kernels.sh`` installs it on the GPU machine); without a GPU the ``gpu`` marker
skips them.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.status import Status
from specmeta.testing.consumers.dense import dense_attention
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, padded_lengths, verify_split

pytestmark = pytest.mark.gpu

H, H_KV, D = 8, 2, 128
S = 3
DTYPE = torch.bfloat16
TOL = 2e-2  # bf16 attention against a float64 oracle


@pytest.fixture(scope="module")
def flashinfer():
    import flashinfer

    return flashinfer


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


class _Case:
    """A batch over virtual ids (a page map that keeps the sink), a full → window pool map
    (a shuffled injection into a window pool twice the full pool's size, a fifth of it −1),
    the bf16 window pool and its float64 copy."""

    def __init__(self, gen, k, ps, w, *, batch_size=5, n=None):
        self.k, self.ps, self.w = k, ps, w
        self.n = n if n is not None else (S + 1 if k == 1 else 8)
        self.cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=self.n, page_size=ps,
                              max_bs=8, max_context_len=3 * ps + 150)  # fmt: skip
        self.batch = make_batch("random", batch_size=batch_size, topk=k, num_steps=S,
                                page_size=ps, row_width=self.cfg.req_to_token_width,
                                generator=gen, device="cuda", extra_tokens=self.n,
                                max_len=self.cfg.max_context_len)  # fmt: skip
        pages = self.batch.pool_size // ps
        self.v2p = torch.cat([torch.zeros(1, dtype=torch.int64),
                              1 + torch.randperm(pages - 1, generator=gen)])  # fmt: skip
        full = self.batch.pool_size
        self.f2s = 1 + torch.randperm(2 * full - 1, generator=gen)[:full]
        self.f2s[torch.rand(full, generator=gen) < 0.2] = -1
        self.f2s[0] = 0
        size = 2 * full
        self.k_pool = torch.randn(size, H_KV, D, generator=gen).to("cuda", DTYPE)
        self.v_pool = torch.randn(size, H_KV, D, generator=gen).to("cuda", DTYPE)
        self.k64, self.v64 = self.k_pool.double().cpu(), self.v_pool.double().cpu()
        self.tree = random_tree_mask(batch_size, k, S, self.n, gen).cuda()
        self.gen = gen
        self.builder = FlashInferBuilder(self.cfg, "cuda", sliding_window_size=w)
        self.read_evicted = False  # whether ids() met a slot the window pool evicted (−1)
        self.kw = dict(seq_lens_cpu=self.batch.seq_lens_cpu, v2p=self.v2p.cuda(),
                       full_to_swa=self.f2s.cuda())  # fmt: skip

    @property
    def args(self):
        return self.batch.req_pool_indices, self.batch.req_to_token, self.batch.seq_lens

    def ids(self, b, positions):
        """Window-pool ids of request ``b``'s row positions, from the rules."""
        row = self.batch.req_to_token.cpu()[int(self.batch.req_pool_indices[b])]
        out = []
        for p in positions:
            full = emitted_id(row, p, self.v2p, E=1, ps=self.ps)
            slot = int(self.f2s[full])
            self.read_evicted |= slot < 0
            out.append(max(slot, 0))  # an evicted slot is read as the sink (design §2.10)
        return out

    def chain(self, L, t, steps):
        """Row positions of branch ``t``'s first ``steps`` draft tokens (design §1)."""
        if self.ps > 1 and self.k > 1:
            lpl = L % self.ps
            nnp = -(-(lpl + S) // self.ps)
            return [L - lpl + t * nnp * self.ps + lpl + j for j in range(steps)]
        return [L + t * S + j for j in range(steps)]

    def check(self, wrapper, lists, what):
        q = torch.randn(len(lists), H, D, generator=self.gen).to("cuda", DTYPE)
        out = wrapper.run(q, (self.k_pool.view(-1, 1, H_KV, D), self.v_pool.view(-1, 1, H_KV, D)))
        want, _ = dense_attention(q.double().cpu(), self.k64, self.v64, lists)
        torch.testing.assert_close(out.double().cpu(), want, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what}: {m}")  # fmt: skip


@pytest.mark.parametrize("k,ps,w", [(1, 1, 1), (1, 16, 40), (4, 16, 7), (8, 64, 130)])
def test_gpu_window_draft_decode_through_flashinfer(gen, flashinfer, workspace, k, ps, w):
    c = _Case(gen, k, ps, w)
    meta = c.builder.draft_decode(*c.args, num_rows=S, **c.kw)
    for s, step in enumerate(meta.steps):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(step.kv_indptr_host, step.kv_indices, step.kv_last_page_len_host, H, H_KV,
                     D, 1, q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
        lists = []
        for b, L in enumerate(c.batch.seq_lens_cpu.tolist()):
            for t in range(k):
                seq = list(range(L)) + c.chain(L, t, s + 1)
                lists.append(c.ids(b, seq[len(seq) - min(len(seq), w) :]))
        c.check(wrapper, lists, f"window draft decode k={k} ps={ps} w={w} step {s}")
    want = Status.BAD_KV_ID if c.read_evicted else 0  # design §2.10: an evicted slot read
    assert int(c.builder.status) == want, f"status {int(c.builder.status)}, expected {want}"


@pytest.mark.parametrize("k,ps,w", [(2, 1, 4), (4, 16, 40), (8, 64, 130)])
def test_gpu_window_shared_prefix_through_flashinfer(gen, flashinfer, workspace, k, ps, w):
    """The shared-prefix cascade of a window layer (``w > S``) through
    ``MultiLevelCascadeAttentionWrapper``: step ``s`` plans its own prefix level (each
    request's last ``min(L, w − s − 1)`` positions) and its chain level, and each branch row
    reads the last ``min(L + s + 1, w)`` of its prefix and chain. Every prefix is at least one
    token (the wrapper's empty-level rows are wrong, design §8; a drafting request has one)."""
    c = _Case(gen, k, ps, w)
    c.batch.seq_lens.clamp_(min=1)
    c.batch.seq_lens_cpu = c.batch.seq_lens.cpu()
    c.kw["seq_lens_cpu"] = c.batch.seq_lens_cpu
    meta = c.builder.draft_decode_shared_prefix(*c.args, num_rows=S, **c.kw)
    for s, step in enumerate(meta.steps):
        wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        wrapper.plan(list(step.qo_indptr_host_arr), list(step.paged_kv_indptr_host_arr),
                     list(step.paged_kv_indices_arr), list(step.paged_kv_last_page_len_host_arr),
                     H, H_KV, D, 1, q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
        lists = []
        for b, L in enumerate(c.batch.seq_lens_cpu.tolist()):
            for t in range(k):
                seq = list(range(L)) + c.chain(L, t, s + 1)
                lists.append(c.ids(b, seq[len(seq) - min(len(seq), w) :]))
        c.check(wrapper, lists, f"window shared prefix k={k} ps={ps} w={w} step {s}")
    want = Status.BAD_KV_ID if c.read_evicted else 0  # design §2.10: an evicted slot read
    assert int(c.builder.status) == want, f"status {int(c.builder.status)}, expected {want}"


@pytest.mark.parametrize("k,ps,w", [(1, 16, 40), (4, 16, 7), (8, 64, 130), (2, 4, 3)])
def test_gpu_window_paged_draft_decode_through_flashinfer(gen, flashinfer, workspace, k, ps, w):
    """The paged form of a window layer: full-length page lists in window-pool pages (the
    window pool paging like the full pool, the engine's evictions below each read floor),
    planned with ``window_left = w − 1``; every branch row reads the last ``min(L + s + 1,
    w)`` of its prefix and chain, the layout-B prefix-tail copies made in the window pool."""
    c = _Case(gen, k, ps, w)
    pages = c.batch.pool_size // ps
    perm = torch.cat([torch.zeros(1, dtype=torch.int64),
                      1 + torch.randperm(2 * pages - 1, generator=gen)[: pages - 1]])  # fmt: skip
    c.f2s = (perm.view(-1, 1) * ps + torch.arange(ps)).view(-1)
    rows = c.batch.req_to_token.cpu()
    lengths = c.batch.seq_lens_cpu.tolist()
    for b, L in enumerate(lengths):  # the engine evicts what no later query reads
        row = rows[int(c.batch.req_pool_indices[b])]
        for p in range(max(0, L - w + 1)):
            slot = emitted_id(row, p, c.v2p, E=1, ps=ps)
            if slot:
                c.f2s[slot] = -1
    c.kw["full_to_swa"] = c.f2s.cuda()
    if k > 1:  # the layout-B prefix-tail copies, in the window pool too
        for b, L in enumerate(lengths):
            lpl = L % ps
            for t in range(1, k):
                region = c.chain(L, t, 1)[0] - lpl
                for u in range(lpl):
                    src, tgt = c.ids(b, [L - lpl + u, region + u])
                    for pool in (c.k_pool, c.v_pool, c.k64, c.v64):
                        pool[tgt] = pool[src]
    meta = c.builder.draft_decode_paged(*c.args, num_rows=S, **c.kw)
    for s, step in enumerate(meta.steps):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(step.kv_indptr_host, step.kv_indices, step.kv_last_page_len_host, H, H_KV,
                     D, ps, window_left=w - 1, q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
        lists = []
        for b, L in enumerate(lengths):
            for t in range(k):
                seq = list(range(L)) + c.chain(L, t, s + 1)
                lists.append(c.ids(b, seq[len(seq) - min(len(seq), w) :]))
        q = torch.randn(len(lists), H, D, generator=gen).to("cuda", DTYPE)
        out = wrapper.run(q, (c.k_pool.view(-1, ps, H_KV, D), c.v_pool.view(-1, ps, H_KV, D)))
        want, _ = dense_attention(q.double().cpu(), c.k64, c.v64, lists)
        torch.testing.assert_close(out.double().cpu(), want, rtol=TOL, atol=TOL,
                                   msg=lambda m, s=s: f"window paged k={k} ps={ps} w={w} [{s}]: {m}")  # fmt: skip
    assert int(c.builder.status) == 0, "an eviction below the floor was read"


def _tree_lists(c):
    """Node ``j`` (at ``L + d_j``) reads its prefix above ``L + d_j − w`` and its ancestors
    ``a`` with ``d_a > d_j − w``, depths from the ancestor mask."""
    lists = []
    for b, L in enumerate(c.batch.seq_lens_cpu.tolist()):
        m = c.tree[b].cpu()
        depth = [int(m[j].sum()) - 1 for j in range(c.n)]
        for j in range(c.n):
            pos = [p for p in range(L) if p > L + depth[j] - c.w]
            pos += [L + a for a in range(c.n) if m[j, a] and depth[a] > depth[j] - c.w]
            lists.append(c.ids(b, pos))
    return lists


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("k,ps,w", [(1, 16, 3), (4, 1, 2), (2, 64, 50)])
def test_gpu_window_target_verify_through_flashinfer(gen, flashinfer, workspace, k, ps, w,
                                                     packed):  # fmt: skip
    c = _Case(gen, k, ps, w)
    meta = c.builder.target_verify(*c.args, c.tree, packed=packed, **c.kw)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(meta.qo_indptr_host, meta.kv_indptr_host, meta.kv_indices,
                 meta.kv_last_page_len_host, H, H_KV, D, 1, custom_mask=meta.custom_mask,
                 packed_custom_mask=meta.packed_custom_mask, causal=False, q_data_type=DTYPE,
                 kv_data_type=DTYPE)  # fmt: skip
    c.check(wrapper, _tree_lists(c), f"window target verify k={k} ps={ps} w={w} {packed=}")


@pytest.mark.parametrize("mode", ["draft_extend", "chain_verify"])
@pytest.mark.parametrize("ps,w", [(1, 2), (16, 33)])
def test_gpu_window_causal_prefill_with_window_left(gen, flashinfer, workspace, mode, ps, w):
    """A chain's causal prefill over the clipped list, planned with ``window_left = w − 1``:
    query ``j`` (at ``L + j``) reads exactly ``(L + j − w, L + j]``."""
    c = _Case(gen, 1, ps, w)
    if mode == "draft_extend":
        meta = c.builder.draft_extend(*c.args, **c.kw)
    else:  # the same clipped list, read causally instead of through the chain's mask
        meta = c.builder.target_verify(*c.args, c.tree, **c.kw)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(meta.qo_indptr_host, meta.kv_indptr_host, meta.kv_indices,
                 meta.kv_last_page_len_host, H, H_KV, D, 1, causal=True, window_left=w - 1,
                 q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
    lists = [c.ids(b, range(max(0, L + j - w + 1), L + j + 1))
             for b, L in enumerate(c.batch.seq_lens_cpu.tolist()) for j in range(c.n)]  # fmt: skip
    c.check(wrapper, lists, f"window {mode} ps={ps} w={w}")


def _ragged_lists(c, lens):
    """A window layer's ragged verify (design §2.9, §2.10), request ``b`` verifying ``v_b``
    rows: node ``j < min(v_b, N)`` reads its prefix above ``L + d_j − w`` and its ancestors
    among the first ``min(v_b, N)`` within ``w``; a filler row (``j ≥ N``) the request's whole
    clipped list, ``max(0, L − w + 1) … L + min(v_b, N) − 1``."""
    lists = []
    for b, (L, v) in enumerate(zip(c.batch.seq_lens_cpu.tolist(), lens, strict=True)):
        m, nodes, first = c.tree[b].cpu(), min(v, c.n), max(0, L - c.w + 1)
        depth = [int(m[j, :nodes].sum()) - 1 for j in range(nodes)]
        for j in range(v):
            if j >= c.n:
                lists.append(c.ids(b, range(first, L + nodes)))
                continue
            pos = [p for p in range(first, L) if p > L + depth[j] - c.w]
            pos += [L + a for a in range(nodes) if m[j, a] and depth[a] > depth[j] - c.w]
            lists.append(c.ids(b, pos))
    return lists


@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "no_pad_leftover"])
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("k,ps,w", [(1, 16, 3), (4, 1, 2), (2, 64, 50), (8, 16, 400)])
def test_gpu_window_ragged_verify_through_flashinfer(gen, flashinfer, workspace, k, ps, w,
                                                     packed, how):  # fmt: skip
    """A window layer's ragged verify over a bucket of 5 requests, planned from the host
    mirrors of ``verify_lens_cpu``: every row of the bucket, filler rows too."""
    c = _Case(gen, k, ps, w)
    real, T = verify_split(gen, 5, c.n, how)
    meta = c.builder.target_verify(
        *c.args, c.tree, packed=packed, num_tokens=T,
        verify_lens=torch.tensor(real, dtype=torch.int32, device="cuda"),
        verify_lens_cpu=torch.tensor(real, dtype=torch.int32), **c.kw,
    )  # fmt: skip
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(meta.qo_indptr_host, meta.kv_indptr_host, meta.kv_indices,
                 meta.kv_last_page_len_host, H, H_KV, D, 1, custom_mask=meta.custom_mask,
                 packed_custom_mask=meta.packed_custom_mask, causal=False, q_data_type=DTYPE,
                 kv_data_type=DTYPE)  # fmt: skip
    lists = _ragged_lists(c, padded_lengths(real, T, 5))
    c.check(wrapper, lists, f"window ragged verify k={k} ps={ps} w={w} {how} {real} T={T}")
