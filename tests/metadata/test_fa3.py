"""FA3 metadata builders (design §3.2): the metadata read by a torch model of FA3 gives the same
attention as dense attention over each branch's or node's logical sequence; plus exact equality
with the reference builder, the planned buffers, and the edge cases (B = 0, padding, reuse)."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, new_status, plan_buffers
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.metadata.fa3 import FA3Cascade, FA3Metadata, FA3MetadataBuilder
from specmeta.runners import collector_off
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import run_cascade
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import compiled_variants, no_host_sync
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
SHAPES = ("random", "modm1", "mod1", "long_short", "mod0")


def _setup(device, gen, k, ps, *, s=3, n=None, batch_size=5, max_bs=7, shape="random"):
    """A config, a batch drawn for it (shuffled pages), a K/V pool and a builder."""
    n = s + 1 if n is None else n
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=max_bs,
                     max_context_len=2 * ps + 24)  # fmt: skip
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
    k_pool = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64).to(device)
    v_pool = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64).to(device)
    return cfg, batch, k_pool, v_pool, FA3MetadataBuilder(cfg, device)


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _rows(batch):
    r2t = batch.req_to_token.cpu().long()
    return [(r2t[int(batch.req_pool_indices[b])], int(batch.seq_lens_cpu[b]))
            for b in range(batch.batch_size)]  # fmt: skip


def _draft_slots(batch, k_pool, v_pool):
    """Draft slots per design §1 and, in layout B, the prefix-tail copies into branches 1…K−1
    (what move_kv_cache does before a page-granular consumer reads a branch)."""
    kw = dict(topk=batch.topk, num_steps=batch.num_steps, page_size=batch.page_size)
    slots = assign_draft_cache_locs(*_args(batch), **kw)
    tgt, src = prefix_tail_copy_pairs(*_args(batch), **kw)
    for pool in (k_pool, v_pool):
        pool[tgt.long()] = pool[src.long()].clone()
    return slots


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_decode_equals_dense_attention(device, gen, k, ps):
    """Step s: branch (b, t) attends to row_b[:L_b] plus its own chain slots j ≤ s."""
    S = 3
    shape = SHAPES[(k + ps) % len(SHAPES)]
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, k, ps, s=S, shape=shape)
    slots = _draft_slots(batch, k_pool, v_pool)
    status = new_status(device)
    steps = fa3.draft_decode(
        *_args(batch),
        slots,
        seq_lens_cpu=batch.seq_lens_cpu,
        status=status,
        num_rows=fa3.cfg.num_steps,
    )
    assert len(steps) == S and all(st.is_cascade == (k > 1) for st in steps)
    B = batch.batch_size
    q = torch.randn(B * k, H, D, generator=gen, dtype=torch.float64).to(device)
    chains = slots.cpu().long().view(B * k, S)
    for s, step in enumerate(steps):
        lists = [torch.cat([row[:L], chains[b * k + t, : s + 1]])
                 for b, (row, L) in enumerate(_rows(batch)) for t in range(k)]  # fmt: skip
        want, _ = dense_attention(q, k_pool, v_pool, lists)
        _close(run_cascade(q, k_pool, v_pool, step), want, f"step {s} [{batch.describe()}]")
    assert int(status) == 0


def test_layout_b_without_the_prefix_tail_copy_is_wrong(device, gen):
    """The end-to-end comparison can fail: skip the prefix-tail copy of layout B and branches
    t ≥ 1 read stale KV in their first page."""
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 2, 4, shape="modm1", batch_size=3)
    slots = assign_draft_cache_locs(*_args(batch), topk=2, num_steps=3, page_size=4)
    steps = fa3.draft_decode(*_args(batch), slots, num_rows=fa3.cfg.num_steps)
    q = torch.randn(6, H, D, generator=gen, dtype=torch.float64).to(device)
    chains = slots.cpu().long().view(6, 3)
    lists = [torch.cat([row[:L], chains[b * 2 + t, :1]])
             for b, (row, L) in enumerate(_rows(batch)) for t in range(2)]  # fmt: skip
    want, _ = dense_attention(q, k_pool, v_pool, lists)
    got = run_cascade(q, k_pool, v_pool, steps[0])
    assert torch.allclose(got[0::2], want[0::2], rtol=1e-10, atol=1e-10), "branch 0 needs no copy"
    assert not torch.allclose(got[1::2], want[1::2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_target_verify_equals_dense_attention(device, gen, k, ps):
    """Node j of request i attends to row_i[:L_i] plus the verify slots row_i[L_i + c] of its
    ancestors c (itself included); with K == 1 the tree is the chain 0 … j."""
    S = 3
    N = S + 1 if k == 1 else 6
    shape = SHAPES[(2 * k + ps) % len(SHAPES)]
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, k, ps, s=S, n=N, shape=shape)
    B = batch.batch_size
    mask = random_tree_mask(B, k, S, N, gen)
    if k == 1:
        assert torch.equal(mask, torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N))
    status = new_status(device)
    meta = fa3.target_verify(*_args(batch), mask.to(device), seq_lens_cpu=batch.seq_lens_cpu,
                             status=status)  # fmt: skip
    assert meta.is_cascade == (k > 1)
    q = torch.randn(B * N, H, D, generator=gen, dtype=torch.float64).to(device)
    lists = []
    for i, (row, L) in enumerate(_rows(batch)):
        for j in range(N):
            ancestors = [c for c in range(N) if mask[i, j, c]]
            lists.append(torch.cat([row[:L], row[L + torch.tensor(ancestors, dtype=torch.long)]]))
    want, _ = dense_attention(q, k_pool, v_pool, lists)
    _close(run_cascade(q, k_pool, v_pool, meta), want, f"verify [{batch.describe()}]")
    assert int(status) == 0


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_extend_equals_dense_attention(device, gen, k, ps):
    """Row j of request i (of N) attends causally to row_i[:L_i + j + 1]."""
    N = 4
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, k, ps, n=N, shape=SHAPES[k % 5])
    status = new_status(device)
    meta = fa3.draft_extend(*_args(batch), status=status)
    B = batch.batch_size
    q = torch.randn(B * N, H, D, generator=gen, dtype=torch.float64).to(device)
    lists = [row[: L + j + 1] for row, L in _rows(batch) for j in range(N)]
    want, _ = dense_attention(q, k_pool, v_pool, lists)
    _close(run_cascade(q, k_pool, v_pool, FA3Cascade(meta, None)), want, "extend")
    assert meta.causal and meta.max_seqlen_q == N and int(status) == 0


@pytest.mark.parametrize("k,ps", [(1, 4), (2, 16), (4, 1)])
def test_equals_reference_builder_exactly(device, gen, k, ps):
    """Every metadata tensor of every mode equals the pure-torch builder's, integer for integer;
    the kernel builder returns views into its planned buffers."""
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, k, ps, n=6 if k > 1 else 4)
    ref = FA3MetadataBuilder(cfg, device, reference=True)
    slots = _draft_slots(batch, k_pool, v_pool)
    mask = random_tree_mask(batch.batch_size, k, 3, cfg.num_draft_tokens, gen).to(device)
    got = [*fa3.draft_decode(*_args(batch), slots, num_rows=fa3.cfg.num_steps), fa3.target_verify(*_args(batch), mask),
           FA3Cascade(fa3.draft_extend(*_args(batch)), None)]  # fmt: skip
    want = [*ref.draft_decode(*_args(batch), slots, num_rows=ref.cfg.num_steps), ref.target_verify(*_args(batch), mask),
            FA3Cascade(ref.draft_extend(*_args(batch)), None)]  # fmt: skip
    owned = {t.untyped_storage().data_ptr() for t in fa3.buffers.values()}
    for g, w in zip(got, want, strict=True):
        for part in ("normal", "expand"):
            gm, wm = getattr(g, part), getattr(w, part)
            assert (gm is None) == (wm is None)
            if gm is None:
                continue
            for name, value in gm.kwargs().items():
                if isinstance(value, torch.Tensor):
                    assert_equal(value, getattr(wm, name), f"{part}.{name}")
                    assert value.untyped_storage().data_ptr() in owned, f"{name} not planned"
                else:
                    assert value == getattr(wm, name), f"{part}.{name}"


def test_metadata_reads_as_the_spec_says(device, gen):
    """design §3.2 read directly on one configuration (K = 4, ps = 16, layout B)."""
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 4, 16, s=3, n=6, shape="modm1")
    slots = _draft_slots(batch, k_pool, v_pool)
    steps = fa3.draft_decode(
        *_args(batch), slots, seq_lens_cpu=batch.seq_lens_cpu, num_rows=fa3.cfg.num_steps
    )
    B, L = batch.batch_size, batch.seq_lens_cpu
    lpl = L % 16
    normal = steps[0].normal
    assert normal.cache_seqlens.tolist() == (L - lpl).tolist() and normal.max_seqlen_q == 4
    assert normal.cu_seqlens_q.tolist() == [4 * b for b in range(B + 1)] and not normal.causal
    assert normal.max_seqlen_k == int((L - lpl).max())
    for s, step in enumerate(steps):
        assert step.normal is normal
        exp = step.expand
        assert exp.cache_seqlens.tolist() == (lpl + s + 1).repeat_interleave(4).tolist()
        assert exp.cu_seqlens_q.tolist() == list(range(4 * B + 1)) and exp.max_seqlen_q == 1
        assert exp.page_table.shape == (4 * B, 3) and exp.max_seqlen_k == 15 + s + 1  # bound
    verify = fa3.target_verify(*_args(batch), random_tree_mask(B, 4, 3, 6, gen).to(device))
    assert verify.normal.cache_seqlens.tolist() == L.tolist() and verify.expand.page_size == 1
    assert verify.normal.cu_seqlens_q.tolist() == [6 * b for b in range(B + 1)]
    extend = fa3.draft_extend(*_args(batch))
    assert extend.cache_seqlens.tolist() == (L + 6).tolist() and extend.causal


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("k,ps", [(1, 1), (1, 4), (4, 16), (2, 4)])
def test_max_seqlen_k_follows_seq_lens_cpu_call_after_call(device, gen, k, ps, host_ops,
                                                           request):  # fmt: skip
    """A decode loop: one builder, a fresh batch of lengths each call (back to an earlier one
    too). Every normal pass's max_seqlen_k is design §3.2's reading of this call's
    seq_lens_cpu, the expand passes' their bounds, and a K > 1 draft decode shares one normal
    pass across its steps. A mode's result is one object per batch size (and rows), whose
    maxima the host part rewrites on every call; with the compiled ``stats`` (after
    ``warmup()``) and with torch's reduction."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")  # compiled here, not skipped
    n = 3 if k == 1 else 6
    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=ps, max_bs=7,
                     max_context_len=2 * ps + 24)  # fmt: skip
    fa3 = FA3MetadataBuilder(cfg, device, host_ops=host_ops)
    ctx, tables = cfg.max_context_len, []
    for max_len in (ctx, ctx // 2, ctx - 1, ctx // 2, 3, ctx):
        batch = make_batch("random", batch_size=5, topk=k, num_steps=3, page_size=ps,
                           row_width=cfg.req_to_token_width, generator=gen, device=device,
                           extra_tokens=n, max_len=max_len)  # fmt: skip
        L = batch.seq_lens_cpu.long()
        slots = assign_draft_cache_locs(*_args(batch), topk=k, num_steps=3, page_size=ps)
        lens = dict(seq_lens_cpu=batch.seq_lens_cpu)
        steps = fa3.draft_decode(*_args(batch), slots, num_rows=3, launch=False, **lens)
        tree = random_tree_mask(5, k, 3, n, gen).to(device) if k > 1 else None
        verify = fa3.target_verify(*_args(batch), tree, launch=False, **lens)
        extend = fa3.draft_extend(*_args(batch), launch=False, **lens)
        top = int((L - L % ps).max()) if cfg.layout_b else int(L.max())
        for s, step in enumerate(steps):
            if k == 1:
                assert step.normal.max_seqlen_k == int(L.max()) + s + 1, (max_len, s)
                assert step.expand is None
            else:
                assert step.normal is steps[0].normal, "one normal pass for every step"
                assert step.normal.max_seqlen_k == top, (max_len, s)
                assert step.expand.max_seqlen_k == (ps - 1 + s + 1 if ps > 1 else s + 1)
        assert verify.normal.max_seqlen_k == int(L.max()) + (n if k == 1 else 0), max_len
        if k > 1:
            assert verify.expand.max_seqlen_k == n
        assert extend.max_seqlen_k == int(L.max()) + n, max_len
        tables.append((steps, verify, extend))
    for results in tables:  # one object per mode and batch size, rewritten by every call
        assert all(got is last for got, last in zip(results, tables[-1], strict=True))


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("k,ps", [(1, 4), (2, 4), (4, 16), (2, 1)])
def test_a_bound_stage_follows_new_inputs_launch_after_launch(device, gen, k, ps, host_ops,
                                                              request):  # fmt: skip
    """Every mode bound once to the engine's own tensors, then run twice with new device
    values copied into them (lengths, rows, pages, draft slots, tree) and the new
    ``seq_lens_cpu``: each run's metadata equals, integer for integer, the reference builder's
    for that batch, host scalars (``max_seqlen_k``) included."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    n = 4 if k == 1 else 6
    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=ps, max_bs=7,
                     max_context_len=2 * ps + 24)  # fmt: skip
    draws = []
    for _ in range(3):
        b = make_batch("random", batch_size=5, topk=k, num_steps=3, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       num_rows=9, extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
        slots = assign_draft_cache_locs(*_args(b), topk=k, num_steps=3, page_size=ps)
        draws.append((b, slots, random_tree_mask(5, k, 3, n, gen).to(device)))
    rpi, r2t, sl = (t.clone() for t in _args(draws[0][0]))
    ocl, tree = draws[0][1].clone(), draws[0][2].clone()
    fa3 = FA3MetadataBuilder(cfg, device, host_ops=host_ops)
    ref = FA3MetadataBuilder(cfg, device, reference=True, host_ops=False)
    stages = [
        fa3.bind_draft_decode(rpi, r2t, sl, ocl, num_rows=3),
        fa3.bind_target_verify(rpi, r2t, sl, tree),
        fa3.bind_draft_extend(rpi, r2t, sl),
    ]
    for i, (batch, slots, mask) in enumerate(draws[1:]):
        for dst, src in zip((rpi, r2t, sl, ocl, tree), (*_args(batch), slots, mask), strict=True):
            dst.copy_(src)
        got = [stage(batch.seq_lens_cpu.clone()) for stage in stages]
        lens = dict(seq_lens_cpu=batch.seq_lens_cpu)
        want = [ref.draft_decode(*_args(batch), slots, num_rows=3, **lens),
                ref.target_verify(*_args(batch), mask, **lens),
                FA3Cascade(ref.draft_extend(*_args(batch), **lens), None)]  # fmt: skip
        got = [*got[0], got[1], FA3Cascade(got[2], None)]
        want = [*want[0], *want[1:]]
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            for part in ("normal", "expand"):
                gm, wm = getattr(g, part), getattr(w, part)
                assert (gm is None) == (wm is None), (i, j, part)
                if gm is None:
                    continue
                for name in ("cache_seqlens", "page_table", "cu_seqlens_q", "cu_seqlens_k_new"):
                    assert_equal(getattr(gm, name), getattr(wm, name), f"run {i} [{j}] {name}")
                for name in ("max_seqlen_q", "causal", "page_size", "max_seqlen_k"):
                    assert getattr(gm, name) == getattr(wm, name), f"run {i} [{j}] {part}.{name}"
    assert int(fa3.status) == 0 and int(ref.status) == 0


@pytest.mark.parametrize("k,ps", [(1, 4), (2, 4)])
def test_each_eager_call_reads_its_own_tensors(device, gen, k, ps):
    """An eager call binds on every call (design §2.7): three calls of every mode for the same
    batch size, each on new tensors with other values, each equal the reference builder's for
    its own batch; nothing bound for an earlier call's tensors is launched again."""
    n = 4 if k == 1 else 6
    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=ps, max_bs=7,
                     max_context_len=2 * ps + 24)  # fmt: skip
    fa3 = FA3MetadataBuilder(cfg, device)
    for call in range(3):
        b = make_batch("random", batch_size=5, topk=k, num_steps=3, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       num_rows=9, extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
        slots = assign_draft_cache_locs(*_args(b), topk=k, num_steps=3, page_size=ps)
        tree = random_tree_mask(5, k, 3, n, gen).to(device)
        lens = dict(seq_lens_cpu=b.seq_lens_cpu)
        got = [*fa3.draft_decode(*_args(b), slots, num_rows=3, **lens),
               fa3.target_verify(*_args(b), tree, **lens),
               FA3Cascade(fa3.draft_extend(*_args(b), **lens), None)]  # fmt: skip
        ref = FA3MetadataBuilder(cfg, device, reference=True, host_ops=False)
        want = [*ref.draft_decode(*_args(b), slots, num_rows=3, **lens),
                ref.target_verify(*_args(b), tree, **lens),
                FA3Cascade(ref.draft_extend(*_args(b), **lens), None)]  # fmt: skip
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            for part in ("normal", "expand"):
                gm, wm = getattr(g, part), getattr(w, part)
                assert (gm is None) == (wm is None), (call, j, part)
                if gm is None:
                    continue
                for name in ("cache_seqlens", "page_table", "cu_seqlens_k_new"):
                    assert_equal(getattr(gm, name), getattr(wm, name),
                                 f"call {call} [{j}] {part}.{name}")  # fmt: skip
                assert gm.max_seqlen_k == wm.max_seqlen_k, (call, j, part)
    assert int(fa3.status) == 0


def test_plan_has_every_fa3_buffer_and_nothing_else_is_allocated(device, gen):
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 4, 4, n=6)
    plan = {name: spec for name, spec in plan_buffers(cfg).items() if name.startswith("fa3.")}
    assert {"fa3." + name for name in fa3.buffers} == set(plan)  # keyed without "fa3."
    for name, spec in plan.items():
        buf = fa3.buffers[name.removeprefix("fa3.")]
        assert tuple(buf.shape) == spec.shape and buf.dtype == spec.dtype == torch.int32, name
    assert plan["fa3.draft_decode.expand_page_table"].shape == (3, 7 * 4, 3)
    assert plan["fa3.target_verify.expand_page_table"].shape == (7 * 6, 6)
    k1 = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=4, max_bs=7)
    # K = 1: no draft-decode cascade, but target verify keeps its expand pass, which a ragged
    # verify uses for every K (design §2.9).
    k1_plan = plan_buffers(k1)
    assert not any(name.startswith("fa3.draft_decode.expand") for name in k1_plan)
    assert k1_plan["fa3.target_verify.expand_page_table"].shape == (7 * 4, 4)


@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16)])
def test_empty_batch(device, gen, k, ps):
    n = 6 if k > 1 else 4
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, k, ps, n=n, shape="empty")
    slots = _draft_slots(batch, k_pool, v_pool)
    mask = torch.zeros(0, n, n, dtype=torch.bool, device=device)
    status = new_status(device)
    steps = fa3.draft_decode(
        *_args(batch),
        slots,
        seq_lens_cpu=batch.seq_lens_cpu,
        status=status,
        num_rows=fa3.cfg.num_steps,
    )
    verify = fa3.target_verify(*_args(batch), mask, status=status)
    extend = fa3.draft_extend(*_args(batch), status=status)
    for meta in [*(st.normal for st in steps), *(st.expand for st in steps if st.expand),
                 verify.normal, *([verify.expand] if verify.expand else []), extend]:  # fmt: skip
        assert meta.cache_seqlens.numel() == 0 and meta.page_table.shape[0] == 0
        assert meta.cu_seqlens_q.tolist() == [0] and meta.cu_seqlens_k_new.tolist() == [0]
    assert int(status) == 0


def test_rebuild_leaves_nothing_stale(device, gen):
    """A long batch then a short one into the same buffers: the short one's tables end in zeros
    and the consumer still matches dense attention (the tail is rewritten every build)."""
    cfg, long_b, k_pool, v_pool, fa3 = _setup(device, gen, 2, 4, shape="max")
    short = make_batch("long_short", batch_size=5, topk=2, num_steps=3, page_size=4,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=4, max_len=cfg.max_context_len)  # fmt: skip
    fa3.draft_decode(*_args(long_b), _draft_slots(long_b, k_pool, v_pool))
    k_pool = torch.randn(short.pool_size, H_KV, D, generator=gen, dtype=torch.float64).to(device)
    v_pool = torch.randn_like(k_pool)
    slots = _draft_slots(short, k_pool, v_pool)
    steps = fa3.draft_decode(*_args(short), slots, num_rows=fa3.cfg.num_steps)
    pt, lens = steps[0].normal.page_table.cpu(), steps[0].normal.cache_seqlens.cpu()
    for b in range(5):
        assert not pt[b, -(-int(lens[b]) // 4) :].any(), f"stale pages in row {b}"
    q = torch.randn(10, H, D, generator=gen, dtype=torch.float64).to(device)
    chains = slots.cpu().long().view(10, 3)
    lists = [torch.cat([row[:L], chains[b * 2 + t, :3]])
             for b, (row, L) in enumerate(_rows(short)) for t in range(2)]  # fmt: skip
    _close(run_cascade(q, k_pool, v_pool, steps[2]), dense_attention(q, k_pool, v_pool, lists)[0],
           "after rebuild")  # fmt: skip


def test_bad_inputs_raise_before_launch(device, gen):
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 2, 4, n=6)
    slots = _draft_slots(batch, k_pool, v_pool)
    with pytest.raises(ValueError, match="out_cache_loc is required"):
        fa3.draft_decode(*_args(batch))
    with pytest.raises(ValueError, match="tree_mask is required"):
        fa3.target_verify(*_args(batch))
    with pytest.raises(ValueError, match=r"num_rows=4 is outside \[0, num_steps=3\]"):
        fa3.draft_decode(*_args(batch), slots, num_rows=4)
    assert fa3.draft_decode(*_args(batch), slots, num_rows=0).steps == ()
    big = make_batch("random", batch_size=8, topk=2, num_steps=3, page_size=4,
                     row_width=cfg.req_to_token_width, generator=gen, device=device)  # fmt: skip
    with pytest.raises(ValueError, match="the batch has 8 requests, over the plan's max_bs=7"):
        fa3.draft_extend(*_args(big))
    with pytest.raises(ValueError, match="seq_lens_cpu has 4 entries but the batch has 5"):
        fa3.draft_extend(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu[:4])
    with pytest.raises(ValueError, match="out_cache_loc has 10 slots, but the batch needs"):
        fa3.draft_decode(*_args(batch), slots[:10])
    with pytest.raises(TypeError, match="cfg must be a SpecConfig"):
        FA3MetadataBuilder({"topk": 2}, device)


def test_out_of_range_inputs_are_reported(device, gen):
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 2, 4, n=6)
    slots = _draft_slots(batch, k_pool, v_pool)
    batch.req_pool_indices[1] = batch.req_to_token.shape[0]
    slots[0] = -1
    status = new_status(device)
    fa3.draft_decode(*_args(batch), slots, status=status)
    assert int(status) & int(Status.ROW_OOB) and int(status) & int(Status.POOL_OOB)


def test_dataclasses_are_frozen_and_kwargs_are_fa3_keywords(device, gen):
    cfg, batch, k_pool, v_pool, fa3 = _setup(device, gen, 1, 4)
    meta = fa3.draft_extend(*_args(batch))
    assert isinstance(meta, FA3Metadata)
    assert set(meta.kwargs()) == {"cache_seqlens", "page_table", "cu_seqlens_q",
                                  "cu_seqlens_k_new", "max_seqlen_q", "causal",
                                  "return_softmax_lse"}  # fmt: skip
    with pytest.raises(AttributeError):
        meta.causal = False


# --------------------------------------------------------------------------------------------
# GPU tier: production shapes, graph capture and replay, no host sync, no recompilation, and a
# real FlashAttention-3 kernel reading the metadata.
# --------------------------------------------------------------------------------------------
def _all_passes(fa3, batch, slots, mask):
    """Every metadata object of every mode, in a fixed order."""
    out = []
    for step in fa3.draft_decode(*_args(batch), slots, num_rows=fa3.cfg.num_steps):
        out += [step.normal, step.expand]
    verify = fa3.target_verify(*_args(batch), mask)
    return [m for m in out + [verify.normal, verify.expand, fa3.draft_extend(*_args(batch))] if m]


def _assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, value in g.kwargs().items():
            if isinstance(value, torch.Tensor):
                assert_equal(value, getattr(w, name), f"pass {i}: {name}")
            else:
                assert value == getattr(w, name), f"pass {i}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(8, 1), (8, 16), (1, 16)])
def test_gpu_production_shape_equals_reference(gen, k, ps):
    """B = 256, S = 5, contexts up to 32k, every mode, kernels against the torch builder."""
    B, S, ctx = 256, 5, 32768
    n = 16 if k > 1 else S + 1
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=B,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch("long_short", batch_size=B, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                       extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
    batch.seq_lens[1::2] = torch.randint(ctx // 2, ctx, (B // 2,), device="cuda")
    slots = assign_draft_cache_locs(*_args(batch), topk=k, num_steps=S, page_size=ps)
    mask = random_tree_mask(B, k, S, n, gen).cuda()
    status = new_status("cuda")
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    got = []
    for step in fa3.draft_decode(*_args(batch), slots, status=status, num_rows=fa3.cfg.num_steps):
        got += [step.normal, step.expand]
    verify = fa3.target_verify(*_args(batch), mask, status=status)
    got += [verify.normal, verify.expand, fa3.draft_extend(*_args(batch), status=status)]
    want = _all_passes(FA3MetadataBuilder(cfg, "cuda", reference=True), batch, slots, mask)
    _assert_same([m for m in got if m], want)
    assert int(status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16), (8, 64), (2, 1)])
def test_gpu_graph_replay_equals_eager_with_changing_batches(gen, k, ps):
    """Every mode captured in one graph at Bp; replayed on new batches (new lengths, rows,
    pages, draft slots, trees) it gives what an eager reference build gives."""
    Bp, S, ctx = 16, 4, 1024
    n = 8 if k > 1 else S + 1
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=Bp,
                     max_context_len=ctx)  # fmt: skip
    draws = []
    for shape in ("random", "long_short", "modm1", "max", "mod0"):
        b = make_batch(shape, batch_size=Bp, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                       num_rows=Bp + 8, extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
        slots = assign_draft_cache_locs(*_args(b), topk=k, num_steps=S, page_size=ps)
        draws.append((b, slots, random_tree_mask(Bp, k, S, n, gen).cuda()))
    first, slots0, mask0 = draws[0]
    rpi, r2t, sl = (t.clone() for t in _args(first))
    ocl, tree = slots0.clone(), mask0.clone()
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    status = new_status("cuda")

    def build():
        passes = []
        for step in fa3.draft_decode(rpi, r2t, sl, ocl, status=status, num_rows=fa3.cfg.num_steps):
            passes += [step.normal, step.expand]
        verify = fa3.target_verify(rpi, r2t, sl, tree, status=status)
        passes += [verify.normal, verify.expand, fa3.draft_extend(rpi, r2t, sl, status=status)]
        return [m for m in passes if m]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        captured = build()
    ref = FA3MetadataBuilder(cfg, "cuda", reference=True)
    for batch, slots, mask in draws[1:] + draws[:1]:
        for dst, src in zip((rpi, r2t, sl, ocl, tree), (*_args(batch), slots, mask), strict=True):
            dst.copy_(src)
        for buf in fa3.buffers.values():
            if buf.dim() > 1:
                buf.fill_(-7)  # stale values must not survive a replay
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(captured, _all_passes(ref, batch, slots, mask))
        assert int(status) == 0


@pytest.mark.gpu
def test_gpu_no_host_sync_on_the_build_path(gen):
    B, K, S, ps, n = 16, 4, 3, 16, 8
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=B,
                     max_context_len=1024)  # fmt: skip
    batch = make_batch("random", batch_size=B, topk=K, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                       extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
    slots = assign_draft_cache_locs(*_args(batch), topk=K, num_steps=S, page_size=ps)
    mask = random_tree_mask(B, K, S, n, gen).cuda()
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    status = new_status("cuda")

    def build():
        fa3.draft_decode(*_args(batch), slots, seq_lens_cpu=batch.seq_lens_cpu, num_rows=S - 1,
                         status=status)  # fmt: skip
        fa3.target_verify(*_args(batch), mask, seq_lens_cpu=batch.seq_lens_cpu, status=status)
        fa3.draft_extend(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, status=status)

    build()
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            build()
    torch.cuda.synchronize()
    assert int(status) == 0


@pytest.mark.gpu
def test_gpu_new_batch_size_compiles_nothing(gen):
    from specmeta.kernels._page_tables import page_tables_kernel
    from specmeta.kernels.verify_expand_page_table import _verify_expand_page_table_kernel

    K, S, ps, n = 4, 5, 16, 8
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=200,
                     max_context_len=2048)  # fmt: skip
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    # The page-table kernel serves both prefix_page_table and draft_decode_page_tables.
    kernels = (page_tables_kernel, _verify_expand_page_table_kernel)
    counts = []
    for B in (7, 13, 1, 64, 200):
        batch = make_batch("random", batch_size=B, topk=K, num_steps=S, page_size=ps,
                           row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                           extra_tokens=n, max_len=cfg.max_context_len)  # fmt: skip
        slots = assign_draft_cache_locs(*_args(batch), topk=K, num_steps=S, page_size=ps)
        _all_passes(fa3, batch, slots, random_tree_mask(B, K, S, n, gen).cuda())
        torch.cuda.synchronize()
        counts.append(tuple(compiled_variants(kern) for kern in kernels))
    assert all(c >= 1 for c in counts[0])
    assert counts == [counts[0]] * len(counts), f"recompiled for a new batch size: {counts}"
