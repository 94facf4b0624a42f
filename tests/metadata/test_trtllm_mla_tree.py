"""TRT-LLM MLA's tree verify (design §3.4): a cascade of a prefix pass in TRT-LLM's kernel (a
block-table row a node, its request's prefix pages, ``seq_lens_k = L``) and an ancestor pass in
FlashInfer MLA's (a token list a node, its ancestors' and its own window slots), read by the
torch models of both kernels and merged by LSE, is MLA attention over exactly each node's prefix
and ancestors; an empty prefix (``L = 0``, a row TRT-LLM's kernel leaves stale) is masked before
the merge; the kernels build exactly what the references build; the host refuses what it can
see and the device reports node depths that disagree with the mask."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, plan_buffers
from specmeta.cli import main
from specmeta.kernels.tree_ancestor_kv_indices import tree_ancestor_kv_indices_need
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.testing.consumers import trtllm_mla as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import tree_sequences
from specmeta.workloads import make_batch, random_tree_mask

H, DC, DR = 2, 16, 8  # query heads; latent (ckv) and rope (kpe) widths (small: the CPU tier)
SCALE = 0.2
ATOL = 1e-9  # float64 oracle against float64 models: only summation order differs
S, N = 3, 6


def _setup(gen, device, k, ps, *, B=3, ctx=None):
    """A config and a batch whose lengths are 0, ps − 1 and one past a page (the adversarial
    ones: an empty prefix, a prefix one short of a page, a prefix into its second page)."""
    ctx = 2 * ps + 8 if ctx is None else ctx
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=4,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch("random", batch_size=B, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=N, max_len=ctx)  # fmt: skip
    lengths = torch.tensor([0, ps - 1, ps + 1 + int(torch.randint(0, ps, (1,), generator=gen))])
    batch.seq_lens_cpu = lengths[:B].clone()
    batch.seq_lens = batch.seq_lens_cpu.to(batch.req_pool_indices.dtype).to(device)
    return cfg, batch


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _depths(tree):
    """Each node's depth (the root 0), as an engine holds it on the host."""
    return tree.sum(-1) - 1


def _latent(gen, pool, rows):
    """A float64 latent pool (``ckv``, ``kpe`` by slot) and ``rows`` latent queries."""
    return (torch.randn(pool, DC, generator=gen, dtype=torch.float64),
            torch.randn(pool, DR, generator=gen, dtype=torch.float64),
            torch.randn(rows, H, DC, generator=gen, dtype=torch.float64),
            torch.randn(rows, H, DR, generator=gen, dtype=torch.float64))  # fmt: skip


def _oracle(qn, qp, ckv, kpe, lists):
    """Dense float64 MLA attention of every row over its logical keys."""
    k = torch.cat([ckv, kpe], dim=-1).unsqueeze(1)
    return dense_attention(torch.cat([qn, qp], -1), k, ckv.unsqueeze(1), lists,
                           softmax_scale=SCALE)  # fmt: skip


def _integers(meta):
    """Every integer the two passes hand to their kernels (the written part of the lists)."""
    a = meta.ancestors
    used = int(a.kv_indptr_host[-1])
    return [meta.prefix.block_kv_indices.cpu(), meta.prefix.seq_lens_k.cpu(), a.qo_indptr.cpu(),
            a.kv_indptr.cpu(), a.kv_indices[:used].cpu(), a.qo_indptr_host, a.kv_indptr_host,
            a.kv_len_arr_host]  # fmt: skip


def _assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: field {i}: {a} != {b}"


@pytest.mark.parametrize("ps", [32, 64])
@pytest.mark.parametrize("k", [2, 4])
def test_tree_verify_is_mla_attention_over_each_nodes_prefix_and_ancestors(device, gen, k, ps):
    """Every node attends to its request's prefix, its ancestors and itself, whatever the tree;
    prefixes of 0, ps − 1 and past a page. The prefix pass's rows are the request's pages (−1
    past them) at ``L``, the ancestor counts the trees' (``depth + 1``); kernels and references
    build the same integers, and the host mirrors equal the device's offsets."""
    cfg, batch = _setup(gen, device, k, ps)
    B = batch.batch_size
    tree = random_tree_mask(B, k, S, N, gen)
    mla = TrtllmMlaBuilder(cfg, device, modes=["target_verify"])
    ref = TrtllmMlaBuilder(cfg, device, modes=["target_verify"], reference=True)
    meta, want_meta = (b.target_verify(*_args(batch), tree.to(device),
                                       seq_lens_cpu=batch.seq_lens_cpu,
                                       node_depths_cpu=_depths(tree))
                       for b in (mla, ref))  # fmt: skip
    _assert_same(_integers(meta), _integers(want_meta), "kernels vs references")
    lens = batch.seq_lens_cpu.repeat_interleave(N)
    assert meta.prefix.seq_lens_k.cpu().tolist() == lens.tolist()
    assert meta.prefix.max_seq_len_k == cfg.max_context_len
    table = meta.prefix.block_kv_indices.cpu()
    assert table.shape == (B * N, mla.max_blocks) and table.is_contiguous()
    for r, L in enumerate(lens.tolist()):
        pages = -(-L // ps)
        assert table[r, pages:].eq(-1).all() and table[r, :pages].ge(0).all(), f"row {r}"
    a = meta.ancestors
    assert (a.page_size, a.causal, meta.ancestors.kv_indices.dtype) == (1, False, torch.int32)
    assert torch.equal(a.kv_len_arr_host.long(), tree.sum(-1).view(-1)), "ancestor counts"
    assert torch.equal(a.kv_indptr_host, a.kv_indptr.cpu()), "kv_indptr mirror"
    ckv, kpe, qn, qp = _latent(gen, batch.pool_size, B * N)
    got = consumer.tree_verify(meta, qn, qp, ckv, kpe, SCALE, ps)
    want = _oracle(qn, qp, ckv, kpe, tree_sequences(batch, tree))
    assert torch.allclose(got[0], want[0], atol=ATOL, rtol=0), "outputs differ"
    assert torch.allclose(got[1], want[1], atol=ATOL, rtol=0), "log-sum-exps differ"
    assert int(mla.status) == 0 and int(ref.status) == 0


def test_an_empty_prefix_is_masked_before_the_merge(device, gen):
    """TRT-LLM's kernel leaves the rows of an empty prefix stale (the model: NaN outputs, an LSE
    that outweighs any other); ``mask_empty_prefix`` gives exactly those rows ``−inf``, in
    place, so the merge weighs them 0. Without it the merge is not attention (planted here)."""
    from specmeta.kernels.merge_state import merge_state_ref
    from specmeta.testing.consumers import flashinfer_mla

    cfg, batch = _setup(gen, device, 2, 32, B=2)
    tree = random_tree_mask(2, 2, S, N, gen)
    mla = TrtllmMlaBuilder(cfg, device, modes=["target_verify"], reference=True)
    meta = mla.target_verify(*_args(batch), tree.to(device), node_depths_cpu=_depths(tree))
    ckv, kpe, qn, qp = _latent(gen, batch.pool_size, 2 * N)
    o_p, lse_p = consumer.prefix_pass(meta.prefix, qn, qp, ckv, kpe, SCALE, 32)
    assert torch.isnan(o_p[:N]).all() and not torch.isnan(o_p[N:]).any()  # request 0: L = 0
    o_a, lse_a = flashinfer_mla.run_pass(meta.ancestors, qn, qp, ckv, kpe, SCALE)
    unmasked = merge_state_ref(o_p, lse_p.clone(), o_a, lse_a)[0]
    masked = meta.mask_empty_prefix(lse_p.to(device)).cpu()
    assert torch.isneginf(masked[:N]).all() and torch.equal(masked[N:], lse_p[N:])
    want = _oracle(qn, qp, ckv, kpe, tree_sequences(batch, tree))[0]
    assert torch.allclose(merge_state_ref(o_p, masked, o_a, lse_a)[0], want, atol=ATOL, rtol=0)
    assert not torch.allclose(unmasked[:N], want[:N], atol=1e-3, equal_nan=False)


def test_a_bound_tree_verify_follows_new_batches_and_trees(device, gen):
    """Bound once to the engine's tensors, the stage rebuilds for a new batch and tree written
    into them (its host part takes the ring's next mirrors), as an eager reference build does;
    node depths that disagree with the mask, even two swapped (same sum and maximum), set
    ``STALE_HOST_LENGTHS`` alone."""
    cfg, batch = _setup(gen, device, 2, 32)
    B = batch.batch_size
    rpi, r2t, lens = (t.clone() for t in _args(batch))
    tree = torch.zeros(B, N, N, dtype=torch.bool, device=device)
    mla = TrtllmMlaBuilder(cfg, device, modes=["target_verify"], host_ops=False)
    ref = TrtllmMlaBuilder(cfg, device, modes=["target_verify"], reference=True)
    stage = mla.bind_target_verify(rpi, r2t, lens, tree)
    seen = set()
    for flip in (False, True):
        new = random_tree_mask(B, 2, S, N, gen)
        lengths = batch.seq_lens_cpu.flip(0) if flip else batch.seq_lens_cpu
        lens.copy_(lengths.to(lens.dtype))
        tree.copy_(new)
        got = stage(lengths, node_depths_cpu=_depths(new))
        seen.add(got.ancestors.kv_indptr_host.data_ptr())
        want = ref.target_verify(rpi, r2t, lens, tree, seq_lens_cpu=lengths,
                                 node_depths_cpu=_depths(new))  # fmt: skip
        _assert_same(_integers(got), _integers(want), f"flip={flip}")
    assert len(seen) == 2, "each build takes the ring's next set of mirrors"
    assert int(mla.status) == 0
    parents = [-1, 0, 0, 1, 3, 2]  # depths 0, 1, 1, 2, 3, 2
    chain = torch.zeros(B, N, N, dtype=torch.bool)
    for j, parent in enumerate(parents):
        chain[:, j, j] = True
        if parent >= 0:
            chain[:, j] |= chain[:, parent]
    tree.copy_(chain)
    swapped = _depths(chain)
    swapped[1, [1, 3]] = swapped[1, [3, 1]]
    stage(batch.seq_lens_cpu.flip(0), node_depths_cpu=swapped)
    assert int(mla.status) == int(Status.STALE_HOST_LENGTHS)


def test_the_host_refuses_what_it_can_see(device, gen):
    cfg, batch = _setup(gen, device, 2, 32)
    tree = random_tree_mask(batch.batch_size, 2, S, N, gen)
    mla = TrtllmMlaBuilder(cfg, device, modes=["target_verify"])
    where = r"TrtllmMlaBuilder\.target_verify: "
    with pytest.raises(ValueError, match=where + r"tree_mask is required with topk=2 > 1; pass "
                       r"the \[B, N, N\] bool ancestor mask of the draft tree \(N = 6\)"):  # fmt: skip
        mla.target_verify(*_args(batch), node_depths_cpu=_depths(tree))
    with pytest.raises(ValueError, match=where + r"verify_lens/num_tokens were given with "
                       r"topk=2 > 1, but a tree's verify is a cascade"):  # fmt: skip
        mla.bind_target_verify(*_args(batch), tree.to(device), num_tokens=3,
                               verify_lens=batch.seq_lens)  # fmt: skip
    stage = mla.bind_target_verify(*_args(batch), tree.to(device))
    with pytest.raises(TypeError, match=where + r"node_depths_cpu is NoneType; pass "
                       r"node_depths_cpu=, the \[B, N\] = \[3, 6\] integer CPU copy"):  # fmt: skip
        stage.host(batch.seq_lens_cpu)
    deep = _depths(tree)
    deep[2, 4] = N
    with pytest.raises(ValueError, match=where + r"tree_ancestor_host_mirrors_torch: "
                       r"node_depths_cpu\[2, 4\] = 6 is outside \[0, N - 1\]"):  # fmt: skip
        stage.host(batch.seq_lens_cpu, node_depths_cpu=deep)
    over = batch.seq_lens_cpu.clone()
    over[1] = cfg.max_context_len + 1
    with pytest.raises(ValueError, match=where + rf"seq_lens_cpu holds {over[1]}, over the"):
        stage.host(over, node_depths_cpu=_depths(tree))
    with pytest.raises(ValueError, match=where + r"verify_lens_cpu was given, but a tree's "
                       r"verify has no ragged form"):  # fmt: skip
        stage.host(batch.seq_lens_cpu, node_depths_cpu=_depths(tree),
                   verify_lens_cpu=batch.seq_lens_cpu)  # fmt: skip
    chain_cfg = SpecConfig(topk=1, num_steps=S, num_draft_tokens=S + 1, page_size=32,
                           max_bs=4, max_context_len=cfg.max_context_len)  # fmt: skip
    chain = TrtllmMlaBuilder(chain_cfg, device, modes=["target_verify"])
    square = torch.ones(batch.batch_size, S + 1, S + 1, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=where + r"tree_mask was given, but with topk=1"):
        chain.target_verify(*_args(batch), square)
    with pytest.raises(ValueError, match=where + r"node_depths_cpu was given, but with topk=1"):
        chain.target_verify(*_args(batch), node_depths_cpu=_depths(tree))
    assert int(mla.status) == 0 and int(chain.status) == 0  # nothing was launched


def test_the_plan_holds_both_passes(capsys):
    """``trtllm_mla.target_verify.*`` of a tree: the prefix pass's ``[B·N, maxblk]`` rows and
    the ancestor lists at the kernel module's own worst case; ``specmeta plan`` lists them."""
    cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=64, max_bs=8,
                     max_context_len=1000)  # fmt: skip
    plan, mode = plan_buffers(cfg), "trtllm_mla.target_verify"
    maxblk = plan["trtllm_mla.draft_extend.block_kv_indices"].shape[1]
    assert plan[f"{mode}.prefix_block_kv_indices"].shape == (8 * 8, maxblk)
    assert plan[f"{mode}.prefix_seq_lens_k"].shape == (8 * 8,)
    assert plan[f"{mode}.ancestor_kv_indices"].shape == (tree_ancestor_kv_indices_need(8, 8),)
    mla = TrtllmMlaBuilder(cfg, "cpu", modes=["target_verify"], reference=True)
    for name, buf in mla.buffers.items():
        spec = plan["trtllm_mla." + name]
        assert tuple(buf.shape) == spec.shape and buf.dtype == spec.dtype, name
        assert (buf.device.type == "cpu") if name.endswith("_host") else True
    chain = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=64, max_bs=8,
                       max_context_len=1000)  # fmt: skip
    assert f"{mode}.prefix_block_kv_indices" not in plan_buffers(chain)
    args = ["plan", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "8", "--page-size",
            "64", "--max-bs", "8", "--max-context-len", "1000", "--backend", "trtllm_mla"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for key in TrtllmMlaBuilder.plan_keys(cfg):
        assert any(ln.split()[:1] == [key] for ln in out.splitlines()), key
    assert f"{mode}.ancestor_kv_indices" in TrtllmMlaBuilder.plan_keys(cfg)
