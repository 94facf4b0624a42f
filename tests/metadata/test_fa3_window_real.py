"""A hybrid model's window layers read by FlashAttention's real CuTe kernel (GPU tier,
design §2.10, design §3.2).

FA3's window builder (``FA3MetadataBuilder(cfg, "cuda", sliding_window_size=w)``) builds
full-length page tables in window-pool pages through the engine's full → window pool map and
sets ``window_size = (w − 1, 0)`` on every result; ``flash_attn.cute.flash_attn_varlen_func``
reads them through ``varlen_kwargs()`` over a bf16 window pool, and each output is compared
with float64 dense attention over exactly the positions ``(p − w, p]`` of each query row, their
ids taken from the rules (the row's id, through ``v2p``, then the map). The maps page like the
full pool, and every position below a request's ``L − w + 1`` is evicted (``−1``), as an engine
evicts: the tables sink those pages, and the kernel's window never reads them. Chains only
(``topk = 1``): draft decode (every step), target verify (causal) and draft extend; page sizes
1, 16 and 64; ``w`` inside a page, across pages, and past every prefix.

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
from specmeta.workloads import make_batch
from tests._support import emitted_id, no_host_sync

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

    def __init__(self, gen, ps, w, *, translate, batch_size=5):
        self.ps, self.w = ps, w
        self.cfg = SpecConfig(topk=1, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=8,
                              max_context_len=3 * ps + 150)  # fmt: skip
        self.batch = b = make_batch("random", batch_size=batch_size, topk=1, num_steps=S,
                                    page_size=ps, row_width=self.cfg.req_to_token_width,
                                    generator=gen, device="cuda", extra_tokens=N,
                                    max_len=self.cfg.max_context_len)  # fmt: skip
        pages = b.pool_size // ps
        self.v2p = None
        if translate:
            v2p = torch.randperm(2 * pages, generator=gen)[:pages]
            v2p[v2p == 0] = v2p[0].clone()
            v2p[0] = 0
            self.v2p = v2p
        full_pages = pages * (2 if translate else 1)
        window_pages = torch.randperm(2 * full_pages, generator=gen)[:full_pages]
        window_pages[window_pages == 0] = window_pages[0].clone()
        window_pages[0] = 0
        f2s = (window_pages.view(-1, 1) * ps + torch.arange(ps)).flatten()
        self.rows = b.req_to_token.cpu()
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
