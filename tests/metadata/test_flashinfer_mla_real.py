"""FlashInfer MLA's metadata read by the real kernel (GPU tier, design §3.5, §8).

``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (its ``fa3`` backend on sm_90, ``fa2``
elsewhere) is planned from each pass's host mirrors and run on a bf16 latent cache (``ckv``
512, ``kpe`` 64, the sizes the kernel serves), the passes of a cascade merged by
:func:`specmeta.merge_state`; every row is compared with dense attention over its logical keys,
computed in float64 from the same bf16 values. Draft decode, target verify (chains, and trees
as a cascade) and draft extend, ``topk`` 1, 2, 4, 8, page sizes 1, 16 and 64, batches holding
an empty prefix and one a token short of a page; then one case with
the build and the attention captured together in a CUDA graph, planned again and replayed for a
new batch. The kernel is imported, never skipped: where it is missing these tests fail.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, merge_state, warmup
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
from specmeta.runners import collector_off
from specmeta.testing.sequences import branch_sequences, extend_sequences, tree_sequences
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import (
    MLA_CKV,
    MLA_HEADS,
    MLA_KPE,
    latent_oracle,
    mla_wrapper,
    no_host_sync,
    plan_mla_pass,
)

pytestmark = pytest.mark.gpu

H, DC, DR = MLA_HEADS, MLA_CKV, MLA_KPE
S = 3
DTYPE = torch.bfloat16
TOL = 2e-2  # bf16 attention against a float64 oracle, as test_real_kernels
TOPKS = [1, 2, 4, 8]
PAGE_SIZES = [1, 16, 64]


class _Case:
    """A batch of 5 requests (lengths 0, ps − 1, then random), its draft slots and a bf16
    latent pool, with the pool's float64 copies for the oracle."""

    def __init__(self, gen, k, ps, *, batch_size=5):
        self.n = S + 1 if k == 1 else 8
        self.cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=self.n, page_size=ps,
                              max_bs=8, max_context_len=3 * ps + 150)  # fmt: skip
        self.batch = make_batch("random", batch_size=batch_size, topk=k, num_steps=S,
                                page_size=ps, row_width=self.cfg.req_to_token_width,
                                generator=gen, device="cuda", extra_tokens=self.n,
                                max_len=self.cfg.max_context_len)  # fmt: skip
        lengths = self.batch.seq_lens_cpu.clone()
        lengths[:2] = torch.tensor([0, ps - 1])[:batch_size]
        self.batch.seq_lens_cpu = lengths
        self.batch.seq_lens = lengths.to(self.batch.seq_lens.dtype).cuda()
        P = self.batch.pool_size
        self.ckv = torch.randn(P, DC, generator=gen).to("cuda", DTYPE)
        self.kpe = torch.randn(P, DR, generator=gen).to("cuda", DTYPE)
        self.slots = assign_draft_cache_locs(*self.args, topk=k, num_steps=S, page_size=ps)
        self.tree = random_tree_mask(batch_size, k, S, self.n, gen)  # CPU: the host's copy
        self.gen = gen

    @property
    def args(self):
        return self.batch.req_pool_indices, self.batch.req_to_token, self.batch.seq_lens

    def queries(self, rows):
        return (torch.randn(rows, H, DC, generator=self.gen).to("cuda", DTYPE),
                torch.randn(rows, H, DR, generator=self.gen).to("cuda", DTYPE))  # fmt: skip

    def oracle(self, qn, qp, lists):
        return latent_oracle(qn, qp, self.ckv, self.kpe, lists)

    def check(self, got, want, what):
        assert got.shape == want.shape, f"{what}: output shape {tuple(got.shape)}"
        torch.testing.assert_close(got.double().cpu(), want, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what}: {m}")  # fmt: skip


def _run(wrapper, p, c, qn, qp):
    """``run()`` of one pass over the pool viewed in pages of the pass's page size; natural-log
    LSE, as ``merge_state`` takes it."""
    ps = p.page_size
    return wrapper.run(query=(qn, qp), kv_cache=(c.ckv.view(-1, ps, DC), c.kpe.view(-1, ps, DR)),
                       return_lse=True, return_lse_base_on_e=True)  # fmt: skip


def _attention(workspace, result, c, qn, qp):
    """Every pass of a result, each planned on its own wrapper, merged by LSE."""
    out, out_lse = None, None
    for p in result.passes:
        wrapper = mla_wrapper(workspace)
        plan_mla_pass(wrapper, p)
        o, lse = _run(wrapper, p, c, qn, qp)
        out, out_lse = (o, lse) if out is None else merge_state(out, out_lse, o, lse,
                                                                out_lse=torch.empty_like(lse))  # fmt: skip
    return out


def _graph_wrapper(workspace, p):
    """A graph-mode wrapper for pass ``p``: its reserved offsets on the device, and as its
    ``kv_indices`` the builder's own list, so the graph's build writes what its kernel reads.
    The passes run one after another on one stream: they share the float workspace."""
    lists = p.kv_len_arr_host.shape[0]
    reserved = dict(
        qo_indptr=torch.zeros(lists + 1, dtype=torch.int32, device="cuda"),
        kv_indptr=torch.zeros(lists + 1, dtype=torch.int32, device="cuda"),
        kv_indices=p.kv_indices,
        kv_len_arr=torch.zeros(lists, dtype=torch.int32, device="cuda"),
    )
    return mla_wrapper(workspace, use_cuda_graph=True, **reserved)


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_mla_draft_decode(gen, workspace, k, ps):
    """Chains as each request's pages, trees as the cascade: every branch attends to its prefix
    and its own draft tokens; an empty prefix weighs 0 in the merge."""
    c = _Case(gen, k, ps)
    mla = FlashInferMLABuilder(c.cfg, "cuda", modes=["draft_decode"])
    meta = mla.draft_decode(*c.args, seq_lens_cpu=c.batch.seq_lens_cpu, num_rows=S)
    qn, qp = c.queries(c.batch.batch_size * k)
    for s, step in enumerate(meta.steps):
        want = c.oracle(qn, qp, branch_sequences(c.batch, c.slots, s))
        c.check(_attention(workspace, step, c, qn, qp), want, f"draft decode k={k} ps={ps} [{s}]")
    assert int(mla.status) == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
@pytest.mark.parametrize("mode", ["target_verify", "draft_extend"])
def test_gpu_flashinfer_mla_verify_and_extend(gen, workspace, mode, k, ps):
    """``N`` causal rows a request over ``row[0 : L + N]``; a tree's verify as the cascade of
    each prefix and each node's ancestors (their counts from the node depths)."""
    c = _Case(gen, k, ps)
    mla = FlashInferMLABuilder(c.cfg, "cuda", modes=[mode])
    tree = mode == "target_verify" and k > 1
    extra = dict(node_depths_cpu=c.tree.sum(-1) - 1) if tree else {}
    args = (*c.args, c.tree.cuda()) if tree else c.args
    meta = getattr(mla, mode)(*args, seq_lens_cpu=c.batch.seq_lens_cpu, **extra)
    qn, qp = c.queries(c.batch.batch_size * c.n)
    lists = tree_sequences(c.batch, c.tree) if tree else extend_sequences(c.batch, c.n)
    want = c.oracle(qn, qp, lists)
    c.check(_attention(workspace, meta, c, qn, qp), want, f"{mode} k={k} ps={ps}")
    assert int(mla.status) == 0


@pytest.mark.parametrize("k", [1, 4])
def test_gpu_flashinfer_mla_build_and_attention_in_one_graph(gen, workspace, k):
    """Draft decode's build and every step's passes and merge captured in one CUDA graph, with
    graph-mode wrappers whose ``kv_indices`` buffer is the builder's own list; for a new batch
    the stage's host part writes the mirrors, every wrapper is planned from them, and the replay
    rebuilds the lists its kernels read."""
    ps, B = 16, 4
    c = _Case(gen, k, ps, batch_size=B)
    builder = FlashInferMLABuilder(c.cfg, "cuda", modes=["draft_decode"])
    rpi, seq_lens = c.batch.req_pool_indices.clone(), c.batch.seq_lens.clone()
    stage = builder.bind_draft_decode(rpi, c.batch.req_to_token, seq_lens, num_rows=S)
    result = stage(c.batch.seq_lens_cpu)  # host part and launches: the lists to plan from
    qn, qp = c.queries(B * k)

    wrappers = [[_graph_wrapper(workspace, p) for p in step.passes] for step in result.steps]

    def plan(res):
        for step, ws in zip(res.steps, wrappers, strict=True):
            for p, w in zip(step.passes, ws, strict=True):
                plan_mla_pass(w, p)

    outs = [torch.zeros(B * k, H, DC, dtype=DTYPE, device="cuda") for _ in range(S)]

    def attend(res):
        for s, (step, ws) in enumerate(zip(res.steps, wrappers, strict=True)):
            got = [_run(w, p, c, qn, qp) for p, w in zip(step.passes, ws, strict=True)]
            if len(got) == 1:
                outs[s].copy_(got[0][0])
            else:
                merge_state(got[0][0], got[0][1], got[1][0], got[1][1], out=outs[s])

    plan(result)
    attend(result)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        stage.launch()
        attend(result)
    for _ in range(2):
        # A new batch in the same tensors: other rows, fresh lengths (0 and ps − 1 among them).
        new = _Case(gen, k, ps, batch_size=B)
        new.ckv, new.kpe = c.ckv, c.kpe
        new.batch.req_to_token = c.batch.req_to_token
        rows = c.batch.req_to_token.shape[0]
        rpi.copy_(torch.randperm(rows - 1, generator=gen)[:B] + 1)
        new.batch.req_pool_indices = rpi
        seq_lens.copy_(new.batch.seq_lens)
        new.batch.seq_lens = seq_lens
        slots = assign_draft_cache_locs(*new.args, topk=k, num_steps=S, page_size=ps)
        res = stage.host(new.batch.seq_lens_cpu)  # the ring's next set of mirrors
        plan(res)
        graph.replay()
        for s in range(S):
            want = new.oracle(qn, qp, branch_sequences(new.batch, slots, s))
            new.check(outs[s], want, f"graph k={k} step {s}")
    assert int(builder.status) == 0


def test_gpu_flashinfer_mla_build_plan_and_attention_make_no_host_sync(gen, workspace):
    """Every mode's build, ``plan()`` from the host mirrors and ``run()``, and the cascade's
    merge, under ``torch.cuda.set_sync_debug_mode("error")``: the path an engine takes each
    step copies nothing back from the device (``plan()`` reads pinned mirrors only), the
    mirrors written by the compiled host ops as an engine that calls ``warmup()`` has them."""
    warmup()
    c = _Case(gen, 4, 16)
    builders = {mode: FlashInferMLABuilder(c.cfg, "cuda", modes=[mode])
                for mode in ("draft_decode", "draft_extend", "target_verify")}  # fmt: skip
    chain = _Case(gen, 1, 16)
    builders["chain_verify"] = FlashInferMLABuilder(chain.cfg, "cuda", modes=["target_verify"])
    tree, depths = c.tree.cuda(), dict(node_depths_cpu=c.tree.sum(-1) - 1)
    wrappers = [mla_wrapper(workspace)
                for _ in range(2)]  # fmt: skip
    qn, qp = c.queries(c.batch.batch_size * c.n)
    vn, vp = chain.queries(chain.batch.batch_size * chain.n)
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu)

    def attend(result, case, q_nope, q_pe):
        got = []
        for p, w in zip(result.passes, wrappers, strict=False):
            plan_mla_pass(w, p)
            got.append(_run(w, p, case, q_nope, q_pe))
        if len(got) == 2:
            return merge_state(got[0][0], got[0][1], got[1][0], got[1][1])[0]
        return got[0][0]

    def iteration():
        rows = c.batch.batch_size * 4
        outs = [attend(step, c, qn[:rows], qp[:rows])
                for step in builders["draft_decode"].draft_decode(*c.args, num_rows=S, **kw)]  # fmt: skip
        outs.append(attend(builders["draft_extend"].draft_extend(*c.args, **kw), c, qn, qp))
        verify = builders["target_verify"].target_verify(*c.args, tree, **depths, **kw)
        outs.append(attend(verify, c, qn, qp))
        verify = builders["chain_verify"].target_verify(
            *chain.args, seq_lens_cpu=chain.batch.seq_lens_cpu)  # fmt: skip
        outs.append(attend(verify, chain, vn, vp))
        return outs

    iteration()  # compile and plan once outside the check
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(2):
            iteration()
    torch.cuda.synchronize()
    assert all(int(b.status) == 0 for b in builders.values())


def test_gpu_flashinfer_mla_tree_verify_in_one_graph(gen, workspace):
    """A tree's verify, build and both passes and the merge in one CUDA graph; for each new
    batch and tree the host part reads the node depths, the wrappers are planned from its
    mirrors and the replay rebuilds the lists (and checks the depths against the mask)."""
    ps, B, k = 16, 4, 4
    c = _Case(gen, k, ps, batch_size=B)
    n, r2t = c.n, c.batch.req_to_token
    builder = FlashInferMLABuilder(c.cfg, "cuda", modes=["target_verify"])
    rpi, seq_lens, tree = c.batch.req_pool_indices.clone(), c.batch.seq_lens.clone(), c.tree.cuda()
    stage = builder.bind_target_verify(rpi, r2t, seq_lens, tree)
    result = stage(c.batch.seq_lens_cpu, node_depths_cpu=c.tree.sum(-1) - 1)
    qn, qp = c.queries(B * n)
    wrappers = [_graph_wrapper(workspace, p) for p in result.passes]
    out = torch.zeros(B * n, H, DC, dtype=DTYPE, device="cuda")

    def plan(res):
        for p, w in zip(res.passes, wrappers, strict=True):
            plan_mla_pass(w, p)

    def attend(res):
        (o1, l1), (o2, l2) = (_run(w, p, c, qn, qp)
                              for p, w in zip(res.passes, wrappers, strict=True))  # fmt: skip
        merge_state(o1, l1, o2, l2, out=out)

    plan(result)
    attend(result)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        stage.launch()
        attend(result)
    for _ in range(2):
        new = _Case(gen, k, ps, batch_size=B)
        new.ckv, new.kpe, new.batch.req_to_token = c.ckv, c.kpe, r2t
        rpi.copy_(torch.randperm(r2t.shape[0] - 1, generator=gen)[:B] + 1)
        seq_lens.copy_(new.batch.seq_lens)
        tree.copy_(new.tree)
        new.batch.req_pool_indices, new.batch.seq_lens = rpi, seq_lens
        plan(stage.host(new.batch.seq_lens_cpu, node_depths_cpu=new.tree.sum(-1) - 1))
        graph.replay()
        new.check(out, new.oracle(qn, qp, tree_sequences(new.batch, new.tree)), "graph tree")
    assert int(builder.status) == 0
