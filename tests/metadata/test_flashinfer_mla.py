"""FlashInfer MLA builder (design §3.5): its lists, read by a torch consumer the way
``BatchMLAPagedAttentionWrapper``'s ``plan()``/``run()`` read them, give MLA attention over every
branch's or query row's logical sequence; the kernels build exactly what the references build;
the host checks and the stale check."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, plan_buffers
from specmeta.cli import main
from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
from specmeta.testing.consumers import flashinfer_mla as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import tree_sequences
from specmeta.workloads import make_batch, max_prefix_len, random_tree_mask
from tests._support import branch_sequences

H, DC, DR = 2, 512, 64  # query heads; latent (ckv) and rope (kpe) widths the kernel serves
SCALE = 0.05
ATOL = 1e-9  # float64 oracle against float64 consumer: only summation order differs
DECODE = [(1, 3, 1), (1, 3, 16), (1, 2, 64), (2, 3, 16), (4, 2, 1), (2, 2, 64)]  # (K, S, ps)


def _setup(gen, device, k, s, ps, *, n=None, B=4, ctx=40, lengths=None):
    """A config and a batch whose lengths include 0 and ps − 1 (then random ones)."""
    n = (s + 1 if k == 1 else 4) if n is None else n
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch("random", batch_size=B, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    fit = min(ctx, max_prefix_len(cfg.req_to_token_width, k, s, ps, n))
    if lengths is None:
        drawn = torch.randint(0, fit + 1, (B,), generator=gen).tolist()
        lengths = ([0, min(ps - 1, fit), min(2 * ps - 1, fit)] + drawn)[:B]
    batch.seq_lens_cpu = torch.tensor(lengths, dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.to(batch.req_pool_indices.dtype).to(device)
    return cfg, batch


def _cache(gen, pool):
    ckv = torch.randn(pool, DC, generator=gen, dtype=torch.float64)
    kpe = torch.randn(pool, DR, generator=gen, dtype=torch.float64)
    return ckv, kpe


def _queries(gen, rows):
    return (torch.randn(rows, H, DC, generator=gen, dtype=torch.float64),
            torch.randn(rows, H, DR, generator=gen, dtype=torch.float64))  # fmt: skip


def _oracle(qn, qp, ckv, kpe, lists):
    """Dense float64 MLA attention of every row over its logical keys."""
    k = torch.cat([ckv, kpe], dim=-1).unsqueeze(1)
    return dense_attention(torch.cat([qn, qp], -1), k, ckv.unsqueeze(1), lists,
                           softmax_scale=SCALE)  # fmt: skip


def _close(got, want, what):
    (o, lse), (o_ref, lse_ref) = got, want
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"{what}: outputs differ"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"{what}: log-sum-exps differ"


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _written(p):
    """Every integer a pass hands to ``plan()``: the written part of each list, as int64."""
    end = int(p.kv_indptr_host[-1])
    return [p.qo_indptr.cpu(), p.kv_indptr.cpu(), p.kv_indices[:end].cpu(), p.qo_indptr_host,
            p.kv_indptr_host, p.kv_len_arr_host]  # fmt: skip


def _assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: field {i}: {a} != {b}"


def _depths(tree):
    """Each node's depth in its tree (the root 0), as an engine holds it on the host."""
    return tree.sum(-1) - 1


def _window_rows(batch, n):
    """``[i·N + j]``: row j of request i attends to ``row_i[0 : L_i + j + 1]``."""
    r2t = batch.req_to_token.cpu().long()
    return [r2t[int(batch.req_pool_indices[i])][: int(batch.seq_lens_cpu[i]) + j + 1]
            for i in range(batch.batch_size) for j in range(n)]  # fmt: skip


@pytest.mark.parametrize("k,s,ps", DECODE)
def test_draft_decode_is_mla_attention_over_each_branch(device, gen, k, s, ps):
    """Chains in one pass of the request's pages, trees as a cascade (each prefix once, then
    each branch's chain) merged by LSE: every branch attends to its prefix and its first
    ``s + 1`` draft tokens; an empty prefix and one a token short of a page included. The
    kernels build exactly the references' lists, and the host mirrors equal the device's."""
    cfg, batch = _setup(gen, device, k, s, ps)
    mla = FlashInferMLABuilder(cfg, device)
    ref = FlashInferMLABuilder(cfg, device, reference=True)
    meta = mla.draft_decode(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, num_rows=s)
    want_meta = ref.draft_decode(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, num_rows=s)
    ckv, kpe = _cache(gen, batch.pool_size)
    qn, qp = _queries(gen, batch.batch_size * k)
    for i, (step, want) in enumerate(zip(meta.steps, branch_sequences(batch, s), strict=True)):
        assert (step.ancestors is None) == (k == 1)
        assert step.prefix.page_size == (ps if k == 1 else 1) and not step.prefix.causal
        for p, p_ref in zip(step.passes, want_meta.steps[i].passes, strict=True):
            _assert_same(_written(p), _written(p_ref), f"step {i}")
            assert torch.equal(p.kv_indptr_host, p.kv_indptr.cpu()), "kv_indptr mirror"
            assert torch.equal(p.qo_indptr_host, p.qo_indptr.cpu()), "qo_indptr mirror"
        got = consumer.attention(step, qn, qp, ckv, kpe, SCALE)
        _close(got, _oracle(qn, qp, ckv, kpe, want), f"step {i}")
    assert int(mla.status) == 0 and int(ref.status) == 0


@pytest.mark.parametrize("mode,k,ps", [("target_verify", 1, 1), ("target_verify", 1, 16),
                                       ("target_verify", 1, 64), ("draft_extend", 1, 16),
                                       ("draft_extend", 2, 1), ("draft_extend", 4, 64)])  # fmt: skip
def test_verify_and_extend_are_causal_mla_attention(device, gen, mode, k, ps):
    """``N`` causal rows a request over ``row[0 : L + N]``: row ``j`` attends to the prefix and
    the window's first ``j + 1`` tokens, for every ``topk`` in draft extend."""
    cfg, batch = _setup(gen, device, k, 2, ps)
    n = cfg.num_draft_tokens
    mla = FlashInferMLABuilder(cfg, device, modes=[mode])
    ref = FlashInferMLABuilder(cfg, device, modes=[mode], reference=True)
    meta = getattr(mla, mode)(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)
    want_meta = getattr(ref, mode)(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)
    assert meta.ancestors is None and meta.prefix.causal and meta.prefix.page_size == 1
    _assert_same(_written(meta.prefix), _written(want_meta.prefix), mode)
    assert torch.equal(meta.prefix.kv_indptr_host, meta.prefix.kv_indptr.cpu())
    ckv, kpe = _cache(gen, batch.pool_size)
    qn, qp = _queries(gen, batch.batch_size * n)
    _close(consumer.attention(meta, qn, qp, ckv, kpe, SCALE),
           _oracle(qn, qp, ckv, kpe, _window_rows(batch, n)), mode)  # fmt: skip
    assert int(mla.status) == 0


@pytest.mark.parametrize("k,s,ps", [(2, 3, 1), (2, 3, 16), (4, 2, 64)])
def test_tree_verify_is_a_cascade_over_each_nodes_ancestors(device, gen, k, s, ps):
    """A tree's verify: each prefix once for the request's ``N`` rows, merged with each node's
    ancestors in the window (their count, ``depth + 1``, from the engine's node depths): every
    node attends to its prefix, its ancestors and itself; an empty prefix included."""
    cfg, batch = _setup(gen, device, k, s, ps, n=6)
    n = cfg.num_draft_tokens
    tree = random_tree_mask(batch.batch_size, k, s, n, gen)
    mla = FlashInferMLABuilder(cfg, device, modes=["target_verify"])
    ref = FlashInferMLABuilder(cfg, device, modes=["target_verify"], reference=True)
    meta, want_meta = (b.target_verify(*_args(batch), tree.to(device),
                                       seq_lens_cpu=batch.seq_lens_cpu,
                                       node_depths_cpu=_depths(tree))
                       for b in (mla, ref))  # fmt: skip
    assert meta.ancestors is not None and not meta.prefix.causal and not meta.ancestors.causal
    for p, q in zip(meta.passes, want_meta.passes, strict=True):
        _assert_same(_written(p), _written(q), "tree verify")
        assert torch.equal(p.kv_indptr_host, p.kv_indptr.cpu()), "kv_indptr mirror"
    counts = meta.ancestors.kv_len_arr_host.long()
    assert torch.equal(counts, tree.sum(-1).view(-1)), "ancestor counts"
    ckv, kpe = _cache(gen, batch.pool_size)
    qn, qp = _queries(gen, batch.batch_size * n)
    _close(consumer.attention(meta, qn, qp, ckv, kpe, SCALE),
           _oracle(qn, qp, ckv, kpe, tree_sequences(batch, tree)), "tree verify")  # fmt: skip
    assert int(mla.status) == 0 and int(ref.status) == 0


@pytest.mark.parametrize("k,ps", [(1, 16), (2, 16)])
def test_bound_stage_rebuilds_for_new_lengths_as_the_eager_call(device, gen, k, ps):
    """A draft-decode stage bound once, its host part and launches run for one set of lengths
    and then another (written into the same tensors), builds what an eager call builds for each;
    the ring hands out a new set of mirrors each time."""
    cfg, batch = _setup(gen, device, k, 2, ps)
    mla = FlashInferMLABuilder(cfg, device, modes=["draft_decode"])
    eager = FlashInferMLABuilder(cfg, device, modes=["draft_decode"])
    seq_lens = batch.seq_lens.clone()
    stage = mla.bind_draft_decode(batch.req_pool_indices, batch.req_to_token, seq_lens)
    for lengths in (batch.seq_lens_cpu, batch.seq_lens_cpu.flip(0)):
        seq_lens.copy_(lengths)
        got = stage.host(lengths)
        stage.launch()
        want = eager.draft_decode(batch.req_pool_indices, batch.req_to_token, seq_lens,
                                  seq_lens_cpu=lengths)  # fmt: skip
        for p, q in zip(got[0].passes, want[0].passes, strict=True):
            _assert_same(_written(p), _written(q), "bound vs eager")
    assert int(mla.status) == 0


@pytest.mark.parametrize("mode,k", [("draft_decode", 1), ("draft_decode", 2),
                                    ("draft_extend", 1), ("target_verify", 2)])  # fmt: skip
def test_id_spaces_build_what_the_physical_rows_build(device, gen, mode, k):
    """``v2p=`` over virtual rows and ``entry_page_size=`` over rows of page ids build, byte for
    byte, what the plain physical rows build (design §2.10)."""
    ps = 16
    cfg, batch = _setup(gen, device, k, 2, ps)
    r2t = batch.req_to_token
    v2p = torch.randperm(batch.pool_size // ps, generator=gen).to(device)
    physical = v2p[torch.div(r2t, ps, rounding_mode="floor")] * ps + r2t % ps
    pages = torch.div(r2t[:, ::ps], ps, rounding_mode="floor").contiguous()
    tree = random_tree_mask(batch.batch_size, k, 2, cfg.num_draft_tokens, gen)
    extra = dict(node_depths_cpu=_depths(tree)) if mode == "target_verify" else {}
    args = (tree.to(device),) if mode == "target_verify" else ()
    built = []
    for rows, kw in ((r2t, dict(v2p=v2p)), (physical.to(r2t.dtype), {}),
                     (pages, dict(entry_page_size=ps)), (r2t, {})):  # fmt: skip
        mla = FlashInferMLABuilder(cfg, device, modes=[mode])
        meta = getattr(mla, mode)(batch.req_pool_indices, rows, batch.seq_lens, *args,
                                  seq_lens_cpu=batch.seq_lens_cpu, **extra, **kw)  # fmt: skip
        attn = meta[0] if mode == "draft_decode" else meta
        built.append([t for p in attn.passes for t in _written(p)])
        assert int(mla.status) == 0
    _assert_same(built[0], built[1], "v2p vs physical rows")
    _assert_same(built[2], built[3], "page rows vs token rows")


def test_host_checks_name_the_call_the_argument_and_the_fix(device, gen):
    cfg, batch = _setup(gen, device, 2, 2, 16)
    mla = FlashInferMLABuilder(cfg, device)
    with pytest.raises(ValueError, match=r"FlashInferMLABuilder\.draft_decode: seq_lens_cpu is "
                       r"None, but FlashInfer MLA's plan\(\) reads the host mirrors"):  # fmt: skip
        mla.draft_decode(*_args(batch))
    over = batch.seq_lens_cpu.clone()
    over[1] = cfg.max_context_len + 1
    with pytest.raises(ValueError, match=r"FlashInferMLABuilder\.draft_extend: seq_lens_cpu "
                       rf"holds {cfg.max_context_len + 1}, over the plan's max_context_len"):  # fmt: skip
        mla.draft_extend(*_args(batch), seq_lens_cpu=over)
    with pytest.raises(ValueError, match=r"FlashInferMLABuilder\.target_verify: tree_mask is "
                       r"required with topk=2 > 1"):  # fmt: skip
        mla.target_verify(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)
    tree = random_tree_mask(batch.batch_size, 2, 2, 4, gen)
    stage = mla.bind_target_verify(*_args(batch), tree.to(device))
    fix = r"pass node_depths_cpu=, the \[B, N\] = \[4, 4\] integer CPU copy of the draft tree"
    with pytest.raises(TypeError, match=r"FlashInferMLABuilder\.target_verify: "
                       r"node_depths_cpu is NoneType; " + fix):  # fmt: skip
        stage.host(batch.seq_lens_cpu)
    with pytest.raises(ValueError, match=r"target_verify: node_depths_cpu is torch.int64 "
                       r"\[4, 3\] on cpu; " + fix):  # fmt: skip
        stage.host(batch.seq_lens_cpu, node_depths_cpu=_depths(tree)[:, :3])
    deep = _depths(tree)
    deep[1, 2] = 4
    with pytest.raises(ValueError, match=r"FlashInferMLABuilder\.target_verify: "
                       r"tree_ancestor_host_mirrors_torch: node_depths_cpu\[1, 2\] = 4 is "
                       r"outside \[0, N - 1\]"):  # fmt: skip
        stage.host(batch.seq_lens_cpu, node_depths_cpu=deep)
    with pytest.raises(ValueError, match=r"draft_extend: node_depths_cpu was given, but this "
                       r"stage builds no tree verify"):  # fmt: skip
        mla.bind_draft_extend(*_args(batch)).host(batch.seq_lens_cpu,
                                                  node_depths_cpu=_depths(tree))
    windowed = SpecConfig(topk=2, num_steps=2, num_draft_tokens=4, page_size=16, max_bs=8,
                          max_context_len=40, draft_window_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"draft_decode does not build a draft window"):
        FlashInferMLABuilder(windowed, device, modes=["draft_decode"])
    chain = SpecConfig(topk=1, num_steps=2, num_draft_tokens=3, page_size=16, max_bs=8,
                       max_context_len=40)  # fmt: skip
    one = FlashInferMLABuilder(chain, device, modes=["target_verify"])
    mask = torch.ones(batch.batch_size, 3, 3, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"target_verify: tree_mask was given, but with topk=1"):
        one.target_verify(*_args(batch), mask, seq_lens_cpu=batch.seq_lens_cpu)
    with pytest.raises(TypeError, match=r"FlashInferMLABuilder\.draft_decode: .*v2p"):
        mla.draft_decode(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, v2p=[0, 1])
    assert int(mla.status) == 0  # nothing was launched


def test_a_stale_seq_lens_cpu_is_reported_on_the_device(device, gen):
    """A host part given lengths that are not the device's sets ``STALE_HOST_LENGTHS`` alone."""
    cfg, batch = _setup(gen, device, 1, 2, 16)
    mla = FlashInferMLABuilder(cfg, device, modes=["draft_extend"])
    mla.draft_extend(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)
    assert int(mla.status) == 0
    stale = batch.seq_lens_cpu.clone()
    stale[2] = (int(stale[2]) + 1) % (cfg.max_context_len + 1)
    mla.draft_extend(*_args(batch), seq_lens_cpu=stale)
    assert int(mla.status) == int(Status.STALE_HOST_LENGTHS)


def test_node_depths_that_disagree_with_the_mask_are_reported_on_the_device(device, gen):
    """A tree verify's host counts (``depth + 1``) are checked against the mask's entry by
    entry: two nodes of different depths swapped keep the sum and the maximum and still set
    ``STALE_HOST_LENGTHS`` alone; the true depths set nothing."""
    cfg, batch = _setup(gen, device, 2, 3, 16, n=6)
    tree = torch.zeros(batch.batch_size, 6, 6, dtype=torch.bool)
    parents = [-1, 0, 0, 1, 3, 2]  # depths 0, 1, 1, 2, 3, 2
    for j, parent in enumerate(parents):
        tree[:, j, j] = True
        if parent >= 0:
            tree[:, j] |= tree[:, parent]
    mla = FlashInferMLABuilder(cfg, device, modes=["target_verify"])
    stage = mla.bind_target_verify(*_args(batch), tree.to(device))
    stage(batch.seq_lens_cpu, node_depths_cpu=_depths(tree))
    assert int(mla.status) == 0
    swapped = _depths(tree)
    swapped[2, [1, 3]] = swapped[2, [3, 1]]
    stage(batch.seq_lens_cpu, node_depths_cpu=swapped)
    assert int(mla.status) == int(Status.STALE_HOST_LENGTHS)


def test_plan_lists_the_backend_buffers(capsys):
    """``specmeta plan --backend flashinfer_mla`` lists the builder's own keys: the cascades'
    for a tree."""
    args = ["plan", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8", "--page-size",
            "16", "--max-bs", "8", "--max-context-len", "1024", "--backend", "flashinfer_mla"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                     max_context_len=1024)  # fmt: skip
    keys = FlashInferMLABuilder.plan_keys(cfg)
    assert "flashinfer_mla.draft_decode.ancestor_kv_indices" in keys
    assert "flashinfer_mla.target_verify.ancestor_kv_indices" in keys
    assert "flashinfer_mla.target_verify.kv_indices" not in keys  # the chain's single pass
    from specmeta.kernels.tree_ancestor_kv_indices import tree_ancestor_kv_indices_need

    plan = plan_buffers(cfg)  # the plan's own copy of the kernel's rule, held to it
    assert plan["flashinfer_mla.target_verify.ancestor_kv_indices"].shape == (
        tree_ancestor_kv_indices_need(cfg.max_bs, cfg.num_draft_tokens),)
    for key in keys:
        assert any(ln.split()[:1] == [key] for ln in out.splitlines()), key
    assert "FlashInferMLABuilder" in out


def test_the_consumer_refuses_what_plan_refuses(device, gen):
    """The torch consumer makes ``plan()``'s checks: a list whose page count is not
    ``ceil(kv_len / page_size)`` is refused."""
    cfg, batch = _setup(gen, device, 1, 2, 16)
    mla = FlashInferMLABuilder(cfg, device, modes=["draft_decode"])
    step = mla.draft_decode(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)[0].prefix
    consumer.pass_slots(step)  # as built: accepted
    step.kv_len_arr_host[1] += cfg.page_size
    with pytest.raises(AssertionError, match="pages for kv_len"):
        consumer.pass_slots(step)


def test_specmeta_check_has_the_mla_line(device, seed):
    """``specmeta check`` runs FlashInfer MLA's builder against its reference build."""
    from specmeta.check import run_checks

    (result,) = run_checks(torch.device(device), seed, ["flashinfer_mla_builder"])
    assert result.name == "flashinfer_mla_builder" and result.cases > 0
    assert result.ok, result.first_failure


@pytest.mark.parametrize("k", [1, 2])
def test_compiled_host_ops_write_the_torch_mirrors(device, gen, compiled_host_ops, k):
    """With :func:`specmeta.warmup`'s compiled writers, every mode's host part writes the
    mirrors the torch writers write, and names a bad length the same way."""
    del compiled_host_ops  # built: the builders made with host_ops=True use it
    cfg, batch = _setup(gen, device, k, 3, 16)
    fast, slow = (FlashInferMLABuilder(cfg, device, host_ops=flag) for flag in (True, False))
    tree = random_tree_mask(batch.batch_size, k, 3, cfg.num_draft_tokens, gen)
    for mode in fast.modes:
        kw = dict(num_rows=3) if mode == "draft_decode" else {}
        tree_kw = dict(node_depths_cpu=_depths(tree)) if mode == "target_verify" and k > 1 else {}
        if tree_kw:
            kw = dict(tree_mask=tree.to(device))
        got, want = (getattr(b, f"bind_{mode}")(*_args(batch), **kw).host(batch.seq_lens_cpu,
                                                                          **tree_kw)
                     for b in (fast, slow))  # fmt: skip
        got, want = (r.steps if mode == "draft_decode" else (r,) for r in (got, want))
        for one, ref in zip(got, want, strict=True):
            for p, q in zip(one.passes, ref.passes, strict=True):
                for name in ("qo_indptr_host", "kv_indptr_host", "kv_len_arr_host"):
                    assert torch.equal(getattr(p, name), getattr(q, name)), (mode, name)
        over = batch.seq_lens_cpu.clone()
        over[0] = -1
        for b in (fast, slow):
            with pytest.raises(ValueError, match=rf"FlashInferMLABuilder\.{mode}: seq_lens_cpu"):
                getattr(b, f"bind_{mode}")(*_args(batch), **kw).host(over, **tree_kw)
