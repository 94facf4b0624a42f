"""A hybrid model's window layers through FA3's builder (design §2.10, §3.2):
``FA3MetadataBuilder(cfg, device, sliding_window_size=w)`` and its chain modes with
``full_to_swa=``.

Each result is read through a torch model of FlashAttention's windowed paged attention (the
page table, ``cache_seqlens``, the query rows bottom-right aligned, ``window_size = (left,
right)``: query position ``p`` reads keys ``[p − left, p + right]``), and what each row attends
to equals dense attention over exactly the positions the window read rail names, ``(p − w,
p]``, in window-pool ids. The maps page like the full pool, with the engine's evictions below
``L − w + 1`` (and so ``−1`` on pages the tables sink) and random holes on positions no query
reads. Bound stages equal eager calls and the reference builder; the refusals name the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmeta import SpecConfig, Status, new_status
from specmeta.config import plan_sizes
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs_ref
from specmeta.kernels.merge_state import merge_state_ref
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.fa3_window import FA3WindowBuilder
from specmeta.metadata.window_plan import window_tree_gap
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import attend, run_cascade
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, sink_keeping_map
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
ATOL = 1e-9
MAX_L = 40


def _setup(gen, device, *, s, n, ps, w, translate=False, batch_size=5, topk=1):
    """A config (a chain unless ``topk > 1``), a batch, with ``translate`` a page map of its virtual ids, and a full →
    window pool map that pages like the full pool (full page ``P`` to a random window page at
    the same offsets) with every position below a request's ``L − w + 1`` evicted (``−1``) as
    an engine evicts, and random ``−1`` on slots no row of the batch names."""
    cfg = SpecConfig(topk=topk, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=MAX_L)  # fmt: skip
    batch = make_batch("random", batch_size=batch_size, topk=topk, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=MAX_L)  # fmt: skip
    pages = batch.pool_size // ps
    v2p = None
    if translate:
        v2p = sink_keeping_map(pages, gen)
    full_pages = pages * (2 if translate else 1)
    window_pages = sink_keeping_map(full_pages, gen)
    f2s = (window_pages.view(-1, 1) * ps + torch.arange(ps)).flatten()
    named = torch.zeros(f2s.shape[0], dtype=torch.bool)
    rows = batch.req_to_token.cpu()
    for b, L in enumerate(batch.seq_lens_cpu.tolist()):
        row = rows[int(batch.req_pool_indices[b])]
        # A tree's draft slots lie anywhere in its branch regions (design §1): the whole row.
        reach = row.shape[0] if topk > 1 else L + max(n, s)
        ids = [emitted_id(row, p, v2p, E=1, ps=ps) for p in range(reach)]
        named[ids] = True
        for p in range(max(0, L - w + 1)):  # evicted: no forward reads them again
            f2s[ids[p]] = -1
    f2s[~named & (torch.rand(f2s.shape[0], generator=gen) < 0.3)] = -1
    f2s[0] = 0
    return cfg, batch, f2s, v2p


def _window_ids(batch, f2s, v2p, b, positions):
    row = batch.req_to_token.cpu()[int(batch.req_pool_indices[b])]
    out = []
    for p in positions:
        full = emitted_id(row, p, v2p, E=1, ps=batch.page_size)
        assert int(f2s[full]) >= 0, f"request {b}: position {p} read but evicted"
        out.append(int(f2s[full]))
    return out


def flash_attn_windowed(q, k_pool, v_pool, meta):
    """FlashAttention's paged attention with its own window, read as its kernels read it:
    sequence ``b`` has query rows ``cu_seqlens_q[b] … cu_seqlens_q[b + 1] − 1`` and keys ``0 …
    cache_seqlens[b] − 1``, key ``k`` on page ``page_table[b, k // ps]`` at offset ``k % ps``;
    query row ``i`` of ``n_q`` sits at key position ``p = n_k − n_q + i`` and reads the keys
    ``[p − left, p + right]`` (``right = 0`` when causal) inside ``[0, n_k)``. Only the pages
    those keys lie on are read, and each must be a page of the pool. Returns ``(out, lse)``."""
    ps = meta.page_size
    left, right = meta.window_size
    right = 0 if meta.causal else right
    table, lens = meta.page_table.cpu().long(), meta.cache_seqlens.cpu().long()
    cu_q = meta.cu_seqlens_q.cpu().long()
    num_pages = k_pool.shape[0] // ps
    rows = []
    for b in range(cu_q.numel() - 1):
        n_q, n_k = int(cu_q[b + 1] - cu_q[b]), int(lens[b])
        assert n_q <= meta.max_seqlen_q
        for i in range(n_q):
            p = n_k - n_q + i
            keys = torch.arange(max(0, p - left), min(n_k, p + right + 1))
            pages = table[b, keys // ps]
            assert bool(((pages >= 0) & (pages < num_pages)).all()), f"sequence {b}: page id"
            rows.append(pages * ps + keys % ps)
    return dense_attention(q, k_pool, v_pool, rows)


def _caches(gen, size):
    kc = torch.randn(size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(size, H_KV, D, generator=gen, dtype=torch.float64)
    return kc, vc


def _check(meta, batch, f2s, v2p, gen, w, queries):
    """The result through the model against dense attention over ``queries[b]``'s positions'
    windows ``(p − w, p]`` in window-pool ids."""
    assert meta.window_size == (w - 1, 0)
    assert meta.kwargs()["window_size"] == (w - 1, 0)
    assert meta.varlen_kwargs()["window_size"] == (w - 1, 0)
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    want = [_window_ids(batch, f2s, v2p, b, range(max(0, p - w + 1), p + 1))
            for b, L in enumerate(batch.seq_lens_cpu.tolist()) for p in queries(L)]  # fmt: skip
    q = torch.randn(len(want), H, D, generator=gen, dtype=torch.float64)
    o, lse = flash_attn_windowed(q, kc, vc, meta)
    o_ref, lse_ref = dense_attention(q, kc, vc, want)
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), "outputs"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), "log-sum-exps"


@pytest.mark.parametrize("ps,w,translate", [(1, 3, False), (4, 6, True), (16, 9, False),
                                            (16, 1, True)])  # fmt: skip
def test_chain_modes_attend_to_the_rail_in_window_ids(ps, w, translate, gen, device):
    s, n = 3, 4
    cfg, batch, f2s, v2p = _setup(gen, device, s=s, n=n, ps=ps, w=w, translate=translate)
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w)
    assert isinstance(fa, FA3WindowBuilder)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device),
              v2p=v2p.to(device) if translate else None)  # fmt: skip
    steps = fa.draft_decode(*args, num_rows=s, **kw)
    for step, cascade in enumerate(steps.steps):
        assert cascade.expand is None
        _check(cascade.normal, batch, f2s, v2p, gen, w, lambda L, st=step: [L + st])
    verify = fa.target_verify(*args, **kw)
    assert verify.expand is None and verify.normal.causal
    _check(verify.normal, batch, f2s, v2p, gen, w, lambda L: range(L, L + n))
    extend = fa.draft_extend(*args, **kw)
    _check(extend, batch, f2s, v2p, gen, w, lambda L: range(L, L + n))
    assert int(fa.status) == 0


def test_a_read_slot_evicted_is_reported(gen, device):
    """One ``−1`` planted at the floor of one request: ``BAD_KV_ID`` alone, its page the
    sink."""
    ps, w = 4, 6
    cfg, batch, f2s, _ = _setup(gen, device, s=2, n=3, ps=ps, w=w, batch_size=3)
    L = int(batch.seq_lens_cpu[1])
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w, modes=("draft_extend",))
    f = max(0, L - w + 1)
    row = batch.req_to_token.cpu()[int(batch.req_pool_indices[1])]
    f2s[int(row[f])] = -1
    meta = fa.draft_extend(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                           seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device))  # fmt: skip
    assert int(fa.status) == int(Status.BAD_KV_ID)
    assert int(meta.page_table[1, f // ps]) == 0


def test_bound_stages_build_what_the_eager_calls_and_the_reference_build(gen, device):
    s, n, ps, w = 3, 3, 4, 5
    cfg, batch, f2s, _ = _setup(gen, device, s=s, n=n, ps=ps, w=w)
    f2s[torch.randint(1, f2s.shape[0], (20,), generator=gen)] = -1  # faults too, alike
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    f2s = f2s.to(device)
    got = []
    for reference, bound in ((False, True), (False, False), (True, True)):
        fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w, reference=reference)
        if bound:
            stages = (fa.bind_draft_decode(*args, num_rows=s, full_to_swa=f2s),
                      fa.bind_target_verify(*args, full_to_swa=f2s),
                      fa.bind_draft_extend(*args, full_to_swa=f2s))  # fmt: skip
            metas = [stage(batch.seq_lens_cpu) for stage in stages]
        else:
            metas = [fa.draft_decode(*args, num_rows=s, seq_lens_cpu=batch.seq_lens_cpu,
                                     full_to_swa=f2s),
                     fa.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s),
                     fa.draft_extend(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s)]  # fmt: skip
        d, v, e = metas
        flat = [d.steps[0].normal, *(st.normal for st in d.steps[1:]), v.normal, e]
        got.append(([(m.page_table.clone(), m.cache_seqlens.clone(), m.cu_seqlens_k_new.clone(),
                      m.max_seqlen_k, m.window_size) for m in flat], int(fa.status)))  # fmt: skip
    (want, want_status), *others = got
    for what, (metas, status) in zip(("eager", "reference"), others, strict=True):
        assert status == want_status, what
        for i, (a, b) in enumerate(zip(metas, want, strict=True)):
            for x, y in zip(a, b, strict=True):
                if isinstance(x, torch.Tensor):
                    assert_equal(x, y, f"{what}: result {i}")
                else:
                    assert x == y, f"{what}: result {i}"


def test_the_plan_and_the_buffers(device):
    cfg = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=4, max_bs=4,
                     max_context_len=32, sliding_window_size=6)  # fmt: skip
    plan = plan_sizes(cfg)
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=6)
    assert fa.buffers and all(f"fa3_swa.{name}" in plan for name in fa.buffers)
    for name, buf in fa.buffers.items():
        assert tuple(buf.shape) == plan[f"fa3_swa.{name}"].shape, name
        # full-length tables: as the full layers' chain buffers; a ragged verify's expand
        # rows hold a band of prefix positions too
        if name != "target_verify.expand_page_table":
            assert plan[f"fa3_swa.{name}"].shape == plan[f"fa3.{name}"].shape, name
    tree = SpecConfig(topk=2, num_steps=3, num_draft_tokens=5, page_size=4, max_bs=4,
                      max_context_len=32, sliding_window_size=6)  # fmt: skip
    tree_plan = plan_sizes(tree)
    fa = FA3MetadataBuilder(tree, device, sliding_window_size=6)
    assert fa.modes == ("draft_decode", "target_verify", "draft_extend")
    for name, buf in fa.buffers.items():
        assert tuple(buf.shape) == tree_plan[f"fa3_swa.{name}"].shape, name
    # A verify expand row: its band below the normal pass (< D + 2·ps − 1 − d with the depth
    # bound D = N − 1), then at most d + 1 ancestors.
    assert tree_plan["fa3_swa.target_verify.expand_page_table"].shape == (4 * 5, 5 + 2 * 4 - 2)
    # A draft-decode expand row: its row pages from its floor up to the normal pass (w − G
    # positions with G = 0 here: k = ⌊(6 − 2 − 4) / 4⌋ = 0; at most ⌊(6 + 4 − 2) / 4⌋ = 2
    # pages), then its branch's S.
    assert tree_plan["fa3_swa.draft_decode.expand_page_table"].shape == (3, 4 * 2, 3 + 2)
    assert not any(key.startswith("fa3_swa.")
                   for key in plan_sizes(dataclasses.replace(cfg, sliding_window_size=0)))  # fmt: skip


def test_refusals_name_the_call_and_the_fix(gen, device):
    cfg, batch, f2s, _ = _setup(gen, device, s=3, n=3, ps=4, w=4, batch_size=3)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    with pytest.raises(ValueError, match=r"FA3MetadataBuilder.draft_extend: full_to_swa was given"):
        FA3MetadataBuilder(cfg, device).bind_draft_extend(*args, full_to_swa=f2s.to(device))
    win = FA3MetadataBuilder(cfg, device, sliding_window_size=4)
    with pytest.raises(TypeError, match=r"FA3WindowBuilder.target_verify: full_to_swa must be"):
        win.bind_target_verify(*args, full_to_swa=f2s.float().to(device))
    with pytest.raises(ValueError, match=r"sliding_window_size=4, but the config plans window "
                                         r"layers of sliding_window_size=6"):  # fmt: skip
        FA3MetadataBuilder(dataclasses.replace(cfg, sliding_window_size=6), device,
                           sliding_window_size=4)  # fmt: skip
    status = new_status(device)
    win.draft_extend(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device),
                     status=status)  # fmt: skip
    assert int(status) == 0


# --------------------------------------------------------------------------------------------
# Trees and ragged verifies: the cascade split at P0 (design §2.10).
# --------------------------------------------------------------------------------------------
def _tree_positions(mask, b, j, L, w):
    """What node ``j`` of request ``b`` reads, from the rule: at depth ``d`` (its ancestors
    less one) it sits at ``L + d`` and reads ``(L + d − w, L + d]``: the prefix positions from
    ``L + d − w + 1`` on, and its ancestors-or-self ``c`` whose depth is above ``d − w``."""
    m = mask[b].cpu()
    depth = [int(m[c].sum()) - 1 for c in range(m.shape[0])]
    d = depth[j]
    prefix = list(range(max(0, L + d - w + 1), L))
    return prefix + [L + c for c in range(m.shape[0]) if bool(m[j, c]) and depth[c] > d - w]


def _check_cascade(result, batch, f2s, v2p, gen, rows_of):
    """The cascade through FA3's torch model (normal and expand merged by LSE) against dense
    attention over each query row's positions, ``rows_of(b)`` its rows' position lists, in
    window-pool ids; neither pass runs a kernel window."""
    assert result.is_cascade
    assert result.normal.window_size is None and result.expand.window_size is None
    assert "window_size" not in result.normal.varlen_kwargs()
    for meta in (result.normal, result.expand):
        assert int(meta.cache_seqlens.amax()) <= meta.max_seqlen_k
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    want = [_window_ids(batch, f2s, v2p, b, positions)
            for b in range(batch.batch_size) for positions in rows_of(b)]  # fmt: skip
    q = torch.randn(len(want), H, D, generator=gen, dtype=torch.float64)
    out = run_cascade(q, kc, vc, result)
    o_ref, _ = dense_attention(q, kc, vc, want)
    assert torch.allclose(out, o_ref, atol=ATOL, rtol=0), "outputs"


@pytest.mark.parametrize("ps,w,n", [(1, 2, 5), (4, 3, 6), (4, 9, 6), (4, 14, 5),
                                    (16, 20, 6)])  # fmt: skip
def test_tree_verify_attends_to_the_rail_in_window_ids(ps, w, n, gen, device):
    """A tree's verify: every node reads exactly ``(L + d − w, L + d]`` (small windows clip its
    ancestors too; large ones leave the normal pass most of the prefix)."""
    s, k = 3, 2
    cfg, batch, f2s, v2p = _setup(gen, device, s=s, n=n, ps=ps, w=w, topk=k,
                                  translate=ps == 4 and w == 9)  # fmt: skip
    mask = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, mask)
    kw = dict(seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device),
              v2p=v2p.to(device) if v2p is not None else None)  # fmt: skip
    result = fa.target_verify(*args, **kw)
    lens = batch.seq_lens_cpu.tolist()
    _check_cascade(result, batch, f2s, v2p, gen,
                   lambda b: [_tree_positions(mask, b, j, lens[b], w) for j in range(n)])  # fmt: skip
    assert int(fa.status) == 0
    ref = FA3MetadataBuilder(cfg, device, sliding_window_size=w, reference=True)
    want = ref.target_verify(*args, **kw)
    for a, b in ((result.normal, want.normal), (result.expand, want.expand)):
        for field in ("page_table", "cache_seqlens", "cu_seqlens_k_new"):
            assert_equal(getattr(a, field), getattr(b, field), field)
    # The draft extend of a tree's config is a chain's: one causal pass under the window.
    extend = fa.draft_extend(*args[:3], **kw)
    _check(extend, batch, f2s, v2p, gen, w, lambda L: range(L, L + n))


@pytest.mark.parametrize("topk,ps,w", [(1, 4, 3), (2, 4, 7), (2, 1, 4)])
def test_ragged_verify_attends_to_the_rail_in_window_ids(topk, ps, w, gen, device):
    """A ragged verify (a cascade for every ``topk``): each request's first ``v`` nodes read
    exactly their windows; a filler row reads what the last node of a chain through all ``N``
    nodes reads."""
    s, n = 3, 4
    cfg, batch, f2s, _ = _setup(gen, device, s=s, n=n, ps=ps, w=w, topk=topk, batch_size=4)
    mask = (random_tree_mask(4, topk, s, n, gen) if topk > 1
            else torch.ones(4, n, n, dtype=torch.bool).tril()).to(device)  # fmt: skip
    v = torch.tensor([2, 0, 4, 3])
    T = int(v.sum()) + 2  # two filler rows: the last request pads to the bucket
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
            mask if topk > 1 else None)  # fmt: skip
    result = fa.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device),
                              verify_lens=v.to(device), verify_lens_cpu=v, num_tokens=T)  # fmt: skip
    lens = batch.seq_lens_cpu.tolist()
    padded = v.tolist()
    padded[-1] += 2
    chain = torch.ones(1, n, n, dtype=torch.bool).tril()  # a filler row: its last node's rows

    def rows_of(b):
        return [_tree_positions(mask, b, j, lens[b], w) if j < n
                else _tree_positions(chain, 0, n - 1, lens[b], w) for j in range(padded[b])]  # fmt: skip

    _check_cascade(result, batch, f2s, None, gen, rows_of)
    assert int(fa.status) == 0


def _windowed_cascade(q, kc, vc, cascade):
    """A cascade whose passes may each run FlashAttention's own window (the torch model
    above; none: FA3's model), merged by LSE."""
    parts = []
    for meta in (cascade.normal, cascade.expand):
        if meta.window_size is None:
            parts.append(attend(q, kc, vc, meta))
        else:
            parts.append(flash_attn_windowed(q, kc, vc, meta))
    (o1, s1), (o2, s2) = parts
    return merge_state_ref(o1, s1, o2, s2)[0]


@pytest.mark.parametrize("ps,w,k", [(1, 2, 2), (1, 6, 3), (4, 3, 2), (4, 7, 2), (4, 13, 2),
                                    (16, 9, 2), (16, 40, 2)])  # fmt: skip
def test_tree_draft_decode_attends_to_the_rail_in_window_ids(ps, w, k, gen, device):
    """A tree's draft decode: every branch of step ``s`` reads exactly ``(L + s − w, L + s]``,
    its prefix in window ids and its own chain's draft slots (window ids too), the layout-B
    prefix-tail copies in the window pool as an engine makes them."""
    s, n = 3, 4
    cfg, batch, f2s, _ = _setup(gen, device, s=s, n=n, ps=ps, w=w, topk=k)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    ocl = assign_draft_cache_locs_ref(*args, topk=k, num_steps=s, page_size=ps,
                                      full_to_swa=f2s.to(device)).cpu()  # fmt: skip
    fa = FA3MetadataBuilder(cfg, device, sliding_window_size=w)
    steps = fa.draft_decode(*args, ocl.to(device), seq_lens_cpu=batch.seq_lens_cpu,
                            full_to_swa=f2s.to(device))  # fmt: skip
    assert int(fa.status) == 0
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    rows = batch.req_to_token.cpu()
    lens = batch.seq_lens_cpu.tolist()
    for b, L in enumerate(lens):  # the engine's layout-B prefix-tail copies, window pool
        row, base = rows[int(batch.req_pool_indices[b])], L - L % ps
        nnp = -(-(L % ps + s) // ps)
        for t in range(1, k if cfg.layout_b else 1):
            for u in range(L % ps):
                src = int(f2s[int(row[base + u])])
                if src >= 0:  # an evicted tail position lies below every step's floor
                    tgt = int(f2s[int(row[base + t * nnp * ps + u])])
                    kc[tgt], vc[tgt] = kc[src], vc[src]
    for step, cascade in enumerate(steps.steps):
        gap = window_tree_gap(w, s - 1, ps)
        assert cascade.normal.window_size is None
        assert cascade.expand.window_size == (w - 1 - gap, 0)
        want = []
        for b, L in enumerate(lens):
            prefix = _window_ids(batch, f2s, None, b, range(max(0, L + step - w + 1), L))
            for t in range(k):
                chain = [int(ocl[(b * k + t) * s + j]) for j in range(step + 1) if j > step - w]
                want.append(prefix + chain)
        q = torch.randn(len(want), H, D, generator=gen, dtype=torch.float64)
        out = _windowed_cascade(q, kc, vc, cascade)
        o_ref, _ = dense_attention(q, kc, vc, want)
        assert torch.allclose(out, o_ref, atol=ATOL, rtol=0), f"step {step}"
    ref = FA3MetadataBuilder(cfg, device, sliding_window_size=w, reference=True)
    again = ref.draft_decode(*args, ocl.to(device), seq_lens_cpu=batch.seq_lens_cpu,
                             full_to_swa=f2s.to(device))  # fmt: skip
    for a, r in zip(steps.steps, again.steps, strict=True):
        for x, y in ((a.normal, r.normal), (a.expand, r.expand)):
            for field in ("page_table", "cache_seqlens", "cu_seqlens_k_new"):
                assert_equal(getattr(x, field), getattr(y, field), field)
