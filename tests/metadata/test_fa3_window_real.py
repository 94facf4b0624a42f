"""A hybrid model's window layers read by FlashAttention's real CuTe kernel (GPU tier,
design §2.10, design §3.2).

FA3's window builder (``FA3MetadataBuilder(cfg, "cuda", sliding_window_size=w)``) builds
full-length page tables in window-pool pages through the engine's full → window pool map and
sets ``window_size = (w − 1, 0)`` on every result; ``flash_attn.cute.flash_attn_varlen_func``
reads them through ``varlen_kwargs()`` over a bf16 window pool, and each output is compared
with float64 dense attention over exactly the positions ``(p − w, p]`` of each query row, their
ids taken from the rules (the row's id, through ``v2p``, then the map). The maps page like the
full pool, and every position below a request's ``L − w + 1`` is evicted (``−1``), as an engine
evicts: the tables sink those pages, and the kernel's window never reads them. Chains
(``topk = 1``): draft decode (every step), target verify (causal) and draft extend; trees
(``topk = 2``): target verify, and ragged verifies of either, as FA3's cascade split at the page
boundary ``P0`` (the normal pass the prefix every row reads, each expand row its band below
``P0`` and its ancestors within the window, design §2.10), merged by LSE; a tree's draft decode
(the normal pass at most ``G`` whole pages, each expand row its row pages from its floor and its
branch's pages under the kernel's window ``(w − 1 − G, 0)``); page sizes 1, 16 and 64; ``w``
inside a page, across pages, shorter than the tree, and past every prefix.

The kernel is imported, never skipped: where it is missing these tests fail
(``scripts/gpu_kernels.sh`` installs it on the GPU machine); without a GPU the ``gpu`` marker
skips them.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig
from specmeta.metadata.fa3 import FA3Cascade, FA3MetadataBuilder
from specmeta.testing.attention import CuteFlashAttention
from specmeta.testing.consumers.dense import dense_attention
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, no_host_sync, sink_keeping_map

pytestmark = pytest.mark.gpu

H, H_KV, D = 8, 2, 128
S = 3
N = 4
DTYPE = torch.bfloat16
TOL = 2e-2  # bf16 attention against a float64 oracle


@pytest.fixture(scope="module")
def cute():
    return CuteFlashAttention()


class _Case:
    """A chain batch over virtual ids (with ``translate``; a page map that keeps the sink), a
    full → window pool map that pages like the full pool (full page ``P`` to a random window
    page at the same offsets, the window pool twice the full pool's size) with every position
    below ``L − w + 1`` evicted, the bf16 window pool and its float64 copy."""

    def __init__(self, gen, ps, w, *, translate, batch_size=5, topk=1, n=N):
        self.ps, self.w = ps, w
        self.cfg = SpecConfig(topk=topk, num_steps=S, num_draft_tokens=n, page_size=ps,
                              max_bs=8, max_context_len=3 * ps + 150)  # fmt: skip
        self.batch = b = make_batch("random", batch_size=batch_size, topk=topk, num_steps=S,
                                    page_size=ps, row_width=self.cfg.req_to_token_width,
                                    generator=gen, device="cuda", extra_tokens=n,
                                    max_len=self.cfg.max_context_len)  # fmt: skip
        pages = b.pool_size // ps
        self.v2p = None
        if translate:
            v2p = sink_keeping_map(pages, gen)
            self.v2p = v2p
        full_pages = pages * (2 if translate else 1)
        window_pages = sink_keeping_map(full_pages, gen)
        f2s = (window_pages.view(-1, 1) * ps + torch.arange(ps)).flatten()
        self.rows = b.req_to_token.cpu()
        self.topk = topk
        for i, L in enumerate(b.seq_lens_cpu.tolist()):
            row = self.rows[int(b.req_pool_indices[i])]
            for p in range(max(0, L - w + 1)):  # evicted: no forward reads them again
                f2s[emitted_id(row, p, self.v2p, E=1, ps=ps)] = -1
        f2s[0] = 0
        self.f2s = f2s
        size = 2 * f2s.shape[0]
        self.k = torch.randn(size, H_KV, D, generator=gen).to(DTYPE).cuda()
        self.v = torch.randn(size, H_KV, D, generator=gen).to(DTYPE).cuda()
        self.k64, self.v64 = self.k.double().cpu(), self.v.double().cpu()  # what bf16 holds

    def args(self):
        b = self.batch
        return b.req_pool_indices, b.req_to_token, b.seq_lens

    def kwargs(self):
        return dict(full_to_swa=self.f2s.cuda(),
                    v2p=self.v2p.cuda() if self.v2p is not None else None)  # fmt: skip

    def want(self, queries):
        """The window-pool ids of every query row's ``(p − w, p]``, row by row."""
        b, out = self.batch, []
        for i, L in enumerate(b.seq_lens_cpu.tolist()):
            row = self.rows[int(b.req_pool_indices[i])]
            for p in queries(L):
                ids = [int(self.f2s[emitted_id(row, x, self.v2p, E=1, ps=self.ps)])
                       for x in range(max(0, p - self.w + 1), p + 1)]  # fmt: skip
                assert min(ids) >= 0, f"request {i}: a read position was evicted"
                out.append(ids)
        return out

    def ids(self, i, positions):
        """The window-pool ids of request ``i``'s ``positions`` (none evicted)."""
        row = self.rows[int(self.batch.req_pool_indices[i])]
        ids = [int(self.f2s[emitted_id(row, x, self.v2p, E=1, ps=self.ps)]) for x in positions]
        assert min(ids, default=0) >= 0, f"request {i}: a read position was evicted"
        return ids

    def check_rows(self, cute, meta, gen, rows, what):
        """A cascade with no kernel window against dense attention over ``rows`` (each query
        row's window-pool ids)."""
        assert meta.normal.window_size is None and meta.expand.window_size is None, what
        q64 = torch.randn(len(rows), H, D, generator=gen, dtype=torch.float64)
        q = q64.to(DTYPE).cuda()
        out = cute(meta, q, self.k, self.v)
        ref, _ = dense_attention(q.double().cpu(), self.k64, self.v64, rows)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < TOL, f"{what}: max error {err}"

    def check(self, cute, meta, gen, queries, what):
        single = meta.normal if isinstance(meta, FA3Cascade) else meta
        assert single.varlen_kwargs()["window_size"] == (self.w - 1, 0), what
        want = self.want(queries)
        q64 = torch.randn(len(want), H, D, generator=gen, dtype=torch.float64)
        q = q64.to(DTYPE).cuda()
        out = cute(meta, q, self.k, self.v)
        ref, _ = dense_attention(q.double().cpu(), self.k64, self.v64, want)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < TOL, f"{what}: max error {err}"


@pytest.mark.parametrize("ps,w,translate", [
    (1, 5, False), (1, 200, True), (16, 7, True), (16, 40, False), (64, 20, False),
    (64, 100, True),
])  # fmt: skip
def test_chain_modes_read_by_flash_attention(ps, w, translate, cute, gen):
    case = _Case(gen, ps, w, translate=translate)
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=w)
    b = case.batch
    steps = fa.draft_decode(*case.args(), num_rows=S, seq_lens_cpu=b.seq_lens_cpu,
                            **case.kwargs())  # fmt: skip
    for s, cascade in enumerate(steps.steps):
        case.check(cute, cascade, gen, lambda L, s=s: [L + s], f"draft step {s}")
    verify = fa.target_verify(*case.args(), seq_lens_cpu=b.seq_lens_cpu, **case.kwargs())
    case.check(cute, verify, gen, lambda L: range(L, L + N), "target verify")
    extend = fa.draft_extend(*case.args(), seq_lens_cpu=b.seq_lens_cpu, **case.kwargs())
    case.check(cute, extend, gen, lambda L: range(L, L + N), "draft extend")
    assert int(fa.status) == 0


def test_bound_stages_build_without_a_host_sync(cute, gen):
    """The window builder's bound stages (built once), run again under the sync check, then
    read by the kernel."""
    case = _Case(gen, 16, 24, translate=True)
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=24)
    b = case.batch
    stages = (fa.bind_draft_decode(*case.args(), num_rows=S, **case.kwargs()),
              fa.bind_target_verify(*case.args(), **case.kwargs()),
              fa.bind_draft_extend(*case.args(), **case.kwargs()))  # fmt: skip
    for stage in stages:
        stage(b.seq_lens_cpu)
    torch.cuda.synchronize()
    with no_host_sync():
        metas = [stage(b.seq_lens_cpu) for stage in stages]
    decode, verify, extend = metas
    for s, cascade in enumerate(decode.steps):
        case.check(cute, cascade, gen, lambda L, s=s: [L + s], f"draft step {s}")
    case.check(cute, verify, gen, lambda L: range(L, L + N), "target verify")
    case.check(cute, extend, gen, lambda L: range(L, L + N), "draft extend")
    assert int(fa.status) == 0


def _tree_positions(mask, i, j, L, w):
    """What node ``j`` of request ``i`` reads, from the rule: at depth ``d`` (its ancestors
    less one) it sits at ``L + d`` and reads ``(L + d − w, L + d]``: the prefix from
    ``L + d − w + 1`` on, and its ancestors-or-self ``c`` whose depth is above ``d − w``."""
    m = mask[i].cpu()
    depth = [int(m[c].sum()) - 1 for c in range(m.shape[0])]
    d = depth[j]
    prefix = list(range(max(0, L + d - w + 1), L))
    return prefix + [L + c for c in range(m.shape[0]) if bool(m[j, c]) and depth[c] > d - w]


NT = 6  # a tree's verify window


@pytest.mark.parametrize("ps,w,translate", [
    (1, 3, False), (1, 200, True), (16, 4, True), (16, 40, False), (64, 20, False),
    (64, 150, True),
])  # fmt: skip
def test_tree_verify_read_by_flash_attention(ps, w, translate, cute, gen):
    case = _Case(gen, ps, w, translate=translate, topk=2, n=NT)
    b = case.batch
    mask = random_tree_mask(b.batch_size, 2, S, NT, gen).cuda()
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=w)
    verify = fa.target_verify(*case.args(), mask, seq_lens_cpu=b.seq_lens_cpu, **case.kwargs())
    rows = [case.ids(i, _tree_positions(mask, i, j, L, w))
            for i, L in enumerate(b.seq_lens_cpu.tolist()) for j in range(NT)]  # fmt: skip
    case.check_rows(cute, verify, gen, rows, "tree verify")
    extend = fa.draft_extend(*case.args(), seq_lens_cpu=b.seq_lens_cpu, **case.kwargs())
    case.check(cute, extend, gen, lambda L: range(L, L + NT), "draft extend")
    assert int(fa.status) == 0


@pytest.mark.parametrize("topk,ps,w", [(1, 16, 7), (1, 64, 100), (2, 1, 5), (2, 16, 30)])
def test_ragged_verify_read_by_flash_attention(topk, ps, w, cute, gen):
    """Each request's first ``v`` nodes read their windows; a filler row reads what the last
    node of a chain through all the window's nodes reads."""
    n = NT if topk > 1 else N
    case = _Case(gen, ps, w, translate=False, topk=topk, n=n)
    b = case.batch
    chain = torch.ones(1, n, n, dtype=torch.bool).tril()
    mask = (random_tree_mask(b.batch_size, topk, S, n, gen) if topk > 1
            else chain.expand(b.batch_size, n, n)).cuda()  # fmt: skip
    v = torch.randint(0, n + 1, (b.batch_size,), generator=gen)
    # The last request pads to the bucket (filler rows past N where it verifies all N).
    T = min(int(v.sum()) + 3, b.batch_size * n)
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=w)
    verify = fa.target_verify(*case.args(), mask if topk > 1 else None,
                              seq_lens_cpu=b.seq_lens_cpu, verify_lens=v.cuda(),
                              verify_lens_cpu=v, num_tokens=T, **case.kwargs())  # fmt: skip
    padded = v.tolist()
    padded[-1] += T - int(v.sum())
    rows = [case.ids(i, _tree_positions(mask, i, j, L, w) if j < n
                     else _tree_positions(chain, 0, n - 1, L, w))
            for i, L in enumerate(b.seq_lens_cpu.tolist()) for j in range(padded[i])]  # fmt: skip
    case.check_rows(cute, verify, gen, rows, "ragged verify")
    assert int(fa.status) == 0


def test_tree_stages_build_without_a_host_sync(cute, gen):
    """A tree's draft decode and verify and a ragged verify, bound once, run again under the
    sync check; the verifies then read by the kernel (the draft decode's rows are checked by
    :func:`test_tree_draft_decode_read_by_flash_attention`)."""
    from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs

    w = 20
    case = _Case(gen, 16, w, translate=True, topk=2, n=NT)
    b = case.batch
    mask = random_tree_mask(b.batch_size, 2, S, NT, gen).cuda()
    v = torch.full((b.batch_size,), 3)
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=w)
    ocl = assign_draft_cache_locs(*case.args(), topk=2, num_steps=S, page_size=16,
                                  **case.kwargs())  # fmt: skip
    draft = fa.bind_draft_decode(*case.args(), ocl, **case.kwargs())
    draft(b.seq_lens_cpu)
    torch.cuda.synchronize()
    with no_host_sync():
        draft(b.seq_lens_cpu)
    stages = (fa.bind_target_verify(*case.args(), mask, **case.kwargs()),
              fa.bind_target_verify(*case.args(), mask, verify_lens=v.cuda(),
                                    num_tokens=int(v.sum()), **case.kwargs()))  # fmt: skip
    lens = b.seq_lens_cpu.tolist()
    # The two verifies share the mode's buffers: each is read before the other runs.
    for stage, width, what in ((stages[0], NT, "tree verify"), (stages[1], 3, "ragged verify")):
        stage(b.seq_lens_cpu)
        torch.cuda.synchronize()
        with no_host_sync():
            meta = stage(b.seq_lens_cpu)
        rows = [case.ids(i, _tree_positions(mask, i, j, L, w))
                for i, L in enumerate(lens) for j in range(width)]  # fmt: skip
        case.check_rows(cute, meta, gen, rows, what)
    assert int(fa.status) == 0


@pytest.mark.parametrize("ps,w,k", [
    (1, 3, 2), (1, 200, 3), (16, 7, 2), (16, 40, 2), (64, 20, 2), (64, 150, 2),
])  # fmt: skip
def test_tree_draft_decode_read_by_flash_attention(ps, w, k, cute, gen):
    """Every branch of step ``s`` reads exactly ``(L + s − w, L + s]``: its prefix in window
    ids and its own draft slots (``assign_draft_cache_locs(full_to_swa=...)``), the layout-B
    prefix-tail copies made in the window pool as an engine makes them."""
    from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs

    case = _Case(gen, ps, w, translate=False, topk=k, n=NT)
    b = case.batch
    ocl = assign_draft_cache_locs(*case.args(), topk=k, num_steps=S, page_size=ps,
                                  full_to_swa=case.f2s.cuda())  # fmt: skip
    fa = FA3MetadataBuilder(case.cfg, "cuda", sliding_window_size=w)
    steps = fa.draft_decode(*case.args(), ocl, seq_lens_cpu=b.seq_lens_cpu,
                            full_to_swa=case.f2s.cuda())  # fmt: skip
    assert int(fa.status) == 0
    ocl = ocl.cpu()
    lens = b.seq_lens_cpu.tolist()
    for i, L in enumerate(lens):  # the engine's layout-B prefix-tail copies, window pool
        row, base = case.rows[int(b.req_pool_indices[i])], L - L % ps
        nnp = -(-(L % ps + S) // ps)
        for t in range(1, k if case.cfg.layout_b else 1):
            for u in range(L % ps):
                src = int(case.f2s[int(row[base + u])])
                if src >= 0:  # an evicted tail position lies below every step's floor
                    tgt = int(case.f2s[int(row[base + t * nnp * ps + u])])
                    case.k[tgt], case.v[tgt] = case.k[src], case.v[src]
    case.k64, case.v64 = case.k.double().cpu(), case.v.double().cpu()
    for s, cascade in enumerate(steps.steps):
        assert cascade.normal.window_size is None
        assert cascade.expand.varlen_kwargs()["window_size"][0] <= w - 1
        rows = []
        for i, L in enumerate(lens):
            prefix = case.ids(i, range(max(0, L + s - w + 1), L))
            for t in range(k):
                rows.append(prefix + [int(ocl[(i * k + t) * S + j]) for j in range(s + 1)
                                      if j > s - w])  # fmt: skip
        q = torch.randn(len(rows), H, D, generator=gen, dtype=torch.float64).to(DTYPE).cuda()
        out = cute(cascade, q, case.k, case.v)
        ref, _ = dense_attention(q.double().cpu(), case.k64, case.v64, rows)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < TOL, f"draft step {s}: max error {err}"
