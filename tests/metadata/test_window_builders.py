"""A hybrid model's window layers through FlashInfer's builder (design §2.10, §3.3):
``FlashInferBuilder(cfg, device, sliding_window_size=w)`` and its modes with ``full_to_swa=``.

What each query row attends to, read through the torch consumer of FlashInfer's metadata,
equals dense attention over exactly the positions the window read rail names, in window-pool
ids; the host mirrors equal the device offsets (compiled and torch writers); the plan sizes the
window builder's lists by the clipped lengths; and a property test shows no id crosses spaces:
over random maps (holes, ``−1`` runs, random permutations) and batches, every id a window
builder lists is the map's image of the full id its position names (or the sink with
``BAD_KV_ID``), and every id the full builder lists is a full-pool physical id.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmeta import SpecConfig, Status, new_status
from specmeta.config import plan_sizes
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.flashinfer_window import FlashInferWindowBuilder
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import emitted_id, sink_keeping_map, verify_split
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
ATOL = 1e-9
MAX_L = 40


def _setup(gen, device, *, k, s, n, ps, w, holes=0.0, batch_size=5, translate=False):
    """A config, a batch, with ``translate`` a page map of its virtual ids (a random injection
    into a physical pool of twice the size), and a full → window pool map over the full pool
    (a random injection into a window pool of twice its size, ``holes`` of it ``−1``); both
    keep the sink in place. The window pool has ``2 · len(full_to_swa)`` slots."""
    del w
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=MAX_L)  # fmt: skip
    batch = make_batch("random", batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=MAX_L)  # fmt: skip
    pages = batch.pool_size // ps
    v2p = None
    if translate:
        v2p = sink_keeping_map(pages, gen)
    full = batch.pool_size * (2 if translate else 1)
    f2s = torch.randperm(2 * full, generator=gen)[:full]
    f2s[torch.rand(full, generator=gen) < holes] = -1
    f2s[f2s == 0] = f2s[0].clone()
    f2s[0] = 0
    return cfg, batch, f2s, v2p


def _window_ids(batch, f2s, v2p, b, positions):
    """The window-pool ids of request ``b``'s row positions: the row's id (through ``v2p``),
    then the map (0 where it does not map)."""
    row = batch.req_to_token.cpu()[int(batch.req_pool_indices[b])]
    ps = batch.page_size
    out = []
    for p in positions:
        full = emitted_id(row, p, v2p, E=1, ps=ps)
        out.append(int(f2s[full]) if int(f2s[full]) >= 0 else 0)
    return out


def _chain_positions(L, t, steps, batch):
    K, S, ps = batch.topk, batch.num_steps, batch.page_size
    if ps > 1 and K > 1:
        lpl = L % ps
        nnp = -(-(lpl + S) // ps)
        return [L - lpl + t * nnp * ps + lpl + j for j in range(steps)]
    return [L + t * S + j for j in range(steps)]


def _caches(gen, size):
    kc = torch.randn(size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(size, H_KV, D, generator=gen, dtype=torch.float64)
    return kc, vc


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps,w", [(1, 3, 1, 5), (2, 3, 4, 3), (3, 2, 1, 1)])
def test_draft_decode_attends_to_the_rail_in_window_ids(k, s, ps, w, host_ops, gen, device,
                                                        request):  # fmt: skip
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    cfg, batch, f2s, _ = _setup(gen, device, k=k, s=s, n=min(1 + k, 4), ps=ps, w=w)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w, modes=("draft_decode",),
                           host_ops=host_ops)  # fmt: skip
    assert isinstance(fi, FlashInferWindowBuilder)
    meta = fi.draft_decode(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                           seq_lens_cpu=batch.seq_lens_cpu, num_rows=s,
                           full_to_swa=f2s.to(device))  # fmt: skip
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    for step, meta_s in enumerate(meta.steps):
        assert_equal(meta_s.kv_indptr_host, meta_s.kv_indptr, f"step {step}: kv_indptr_host")
        want = []
        for b, L in enumerate(batch.seq_lens_cpu.tolist()):
            for t in range(k):
                seq = list(range(L)) + _chain_positions(L, t, step + 1, batch)
                want.append(_window_ids(batch, f2s, None, b, seq[len(seq) - min(len(seq), w) :]))
        o, lse = consumer.decode(q, kc, vc, meta_s)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"step {step}: outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"step {step}: log-sum-exps"
    assert int(fi.status) == 0


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps,w", [(2, 3, 1, 4), (3, 2, 4, 6), (2, 3, 16, 60)])
def test_shared_prefix_cascade_attends_to_the_rail_in_window_ids(k, s, ps, w, host_ops, gen,
                                                                device, request):  # fmt: skip
    """The shared-prefix cascade of a window layer (``w > S``): step ``s``'s two levels, merged
    by the consumer, give each branch the last ``min(L + s + 1, w)`` of its prefix and chain in
    window-pool ids; its prefix row a step and every host mirror equal the device's."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    cfg, batch, f2s, v2p = _setup(gen, device, k=k, s=s, n=min(1 + k, 4), ps=ps, w=w,
                                  translate=True, holes=0.2)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w, modes=("draft_decode_shared_prefix",),
                           host_ops=host_ops)  # fmt: skip
    meta = fi.draft_decode_shared_prefix(batch.req_pool_indices, batch.req_to_token,
                                         batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
                                         num_rows=s, v2p=v2p.to(device),
                                         full_to_swa=f2s.to(device))  # fmt: skip
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    lengths = batch.seq_lens_cpu.tolist()
    for step, meta_s in enumerate(meta.steps):
        for host, dev, level in zip(meta_s.paged_kv_indptr_host_arr, meta_s.paged_kv_indptr_arr,
                                    ("prefix", "chain"), strict=True):  # fmt: skip
            assert_equal(host, dev, f"step {step}: {level} kv_indptr_host")
        keep = max(w - step - 1, 0)
        assert meta_s.paged_kv_indptr_host_arr[0].tolist() == [
            sum(min(L, keep) for L in lengths[:i]) for i in range(len(lengths) + 1)
        ], f"step {step}: the prefix row keeps min(L, w - s - 1)"
        want = []
        for b, L in enumerate(lengths):
            for t in range(k):
                seq = list(range(L)) + _chain_positions(L, t, step + 1, batch)
                want.append(_window_ids(batch, f2s, v2p, b, seq[len(seq) - min(len(seq), w) :]))
        o, lse = consumer.cascade(q, kc, vc, meta_s)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"step {step}: outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"step {step}: log-sum-exps"


def _paged_pool(gen, batch, v2p, w):
    """A full → window map that pages like the full pool (a full page's slots on one window
    page, same offsets; the sink page in place) with the engine's evictions: the window slots
    of every request's positions below its read floor ``max(0, L − w + 1)`` are ``−1``."""
    ps, full = batch.page_size, batch.pool_size * 2
    pages = full // ps
    perm = torch.cat([torch.zeros(1, dtype=torch.int64),
                      1 + torch.randperm(2 * pages - 1, generator=gen)[: pages - 1]])  # fmt: skip
    f2s = (perm.view(-1, 1) * ps + torch.arange(ps)).view(-1)
    rows = batch.req_to_token.cpu()
    for b, L in enumerate(batch.seq_lens_cpu.tolist()):
        row = rows[int(batch.req_pool_indices[b])]
        for p in range(max(0, L - w + 1)):
            slot = emitted_id(row, p, v2p, E=1, ps=ps)
            if slot:
                f2s[slot] = -1
    return f2s


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps,w", [(2, 3, 4, 3), (3, 2, 8, 13), (1, 3, 4, 6), (2, 2, 4, 60)])
def test_paged_draft_decode_read_with_window_left(k, s, ps, w, host_ops, gen, device, request):
    """The paged form of a window layer (full-length page lists, window-pool pages, the sink
    below the read floor) read as FlashInfer's decode planned with ``window_left = w − 1``
    reads it gives each branch the last ``min(L + s + 1, w)`` of its prefix and chain; the
    engine's evictions below the floor are never read (no fault), the layout-B prefix-tail
    copies in place in the window pool, the mirrors equal the device's."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    cfg, batch, _, v2p = _setup(gen, device, k=k, s=s, n=min(1 + k, 4), ps=ps, w=w,
                                translate=True)  # fmt: skip
    f2s = _paged_pool(gen, batch, v2p, w)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w, modes=("draft_decode_paged",),
                           host_ops=host_ops)  # fmt: skip
    meta = fi.draft_decode_paged(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                 seq_lens_cpu=batch.seq_lens_cpu, num_rows=s, v2p=v2p.to(device),
                                 full_to_swa=f2s.to(device))  # fmt: skip
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    lengths = batch.seq_lens_cpu.tolist()
    if k > 1:  # the layout-B prefix-tail copies, made in the window pool as in the full one
        for b, L in enumerate(lengths):
            lpl, base = L % ps, L - L % ps
            for t in range(1, k):
                region = _chain_positions(L, t, 1, batch)[0] - lpl
                for u in range(lpl):
                    src, tgt = _window_ids(batch, f2s, v2p, b, [base + u, region + u])
                    kc[tgt], vc[tgt] = kc[src], vc[src]
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    for step, meta_s in enumerate(meta.steps):
        assert meta_s.page_size == ps
        assert_equal(meta_s.kv_indptr_host, meta_s.kv_indptr, f"step {step}: kv_indptr_host")
        assert_equal(meta_s.kv_last_page_len_host, meta_s.kv_last_page_len, f"step {step}: last")
        lists = consumer.csr_slots(meta_s.kv_indptr, meta_s.kv_indices, meta_s.kv_last_page_len,
                                   ps)  # fmt: skip
        rows = [slots[max(0, slots.numel() - w) :] for slots in lists]  # window_left = w - 1
        want = []
        for b, L in enumerate(lengths):
            for t in range(k):
                assert lists[b * k + t].numel() == L + step + 1, "full-length lists"
                seq = list(range(L)) + _chain_positions(L, t, step + 1, batch)
                want.append(_window_ids(batch, f2s, v2p, b, seq[len(seq) - min(len(seq), w) :]))
        o, lse = dense_attention(q, kc, vc, rows)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"step {step}: outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"step {step}: log-sum-exps"
    assert int(fi.status) == 0, "an eviction below the floor was read"


def _tree_rows(batch, tree_mask, f2s, v2p, w):
    """Each verify node's logical sequence under the rail, in window-pool ids: node ``j`` at
    position ``L + d_j`` reads its prefix positions above ``L + d_j − w`` and its ancestors
    ``c`` (at ``L + d_c``) with ``d_c > d_j − w``; depths counted from the ancestor mask."""
    rows = []
    n = tree_mask.shape[1]
    for b, L in enumerate(batch.seq_lens_cpu.tolist()):
        m = tree_mask[b].cpu()
        depth = [int(m[j].sum()) - 1 for j in range(n)]
        for j in range(n):
            pos = [p for p in range(L) if p > L + depth[j] - w]
            pos += [L + c for c in range(n) if m[j, c] and depth[c] > depth[j] - w]
            rows.append(_window_ids(batch, f2s, v2p, b, pos))
    return rows


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("k,ps,w", [(1, 4, 2), (4, 1, 3), (2, 16, 9)])
def test_target_verify_attends_to_the_rail_in_window_ids(k, ps, w, packed, gen, device):
    n = 1 + k if k > 1 else 4
    cfg, batch, f2s, v2p = _setup(gen, device, k=k, s=3, n=n, ps=ps, w=w, translate=True)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w)
    tree = random_tree_mask(batch.batch_size, k, 3, n, gen).to(device)
    meta = fi.target_verify(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
                            seq_lens_cpu=batch.seq_lens_cpu, packed=packed, v2p=v2p.to(device),
                            full_to_swa=f2s.to(device))  # fmt: skip
    assert_equal(meta.kv_indptr_host, meta.kv_indptr, "kv_indptr_host")
    assert_equal(meta.mask_indptr_host, meta.mask_indptr, "mask_indptr_host")
    kc, vc = _caches(gen, 2 * f2s.shape[0])
    q = torch.randn(batch.batch_size * n, H, D, generator=gen, dtype=torch.float64)
    o, lse = consumer.prefill(q, kc, vc, meta)
    o_ref, lse_ref = dense_attention(q, kc, vc, _tree_rows(batch, tree, f2s, v2p, w))
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), "outputs"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), "log-sum-exps"
    assert int(fi.status) == 0


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
def test_a_chain_reads_the_clipped_list_with_window_left(host_ops, gen, device, request):
    """Draft extend (causal): the result's ``window_left = w − 1`` over the clipped list gives
    each row exactly its ``(p − w, p]`` (design §2.10)."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    n, w = 4, 3
    cfg, batch, f2s, _ = _setup(gen, device, k=1, s=3, n=n, ps=1, w=w)
    fi = FlashInferBuilder(cfg, device, sliding_window_size=w, host_ops=host_ops)
    meta = fi.draft_extend(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                           seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device))  # fmt: skip
    assert_equal(meta.kv_indptr_host, meta.kv_indptr, "kv_indptr_host")
    assert meta.causal and meta.custom_mask is None and meta.packed_custom_mask is None
    # FlashInfer's causal prefill with window_left = wl, read as its kernel reads it: query row
    # j of a request sits at column kv_len - q_len + j and sees the columns from that minus wl
    lists = consumer.csr_slots(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 1)
    qo, wl = meta.qo_indptr.cpu().tolist(), w - 1
    rows = []
    for i, kv in enumerate(lists):
        q_len, kv_len = qo[i + 1] - qo[i], kv.numel()
        rows += [kv[max(0, kv_len - q_len + j - wl) : kv_len - q_len + j + 1] for j in range(q_len)]
    want = [_window_ids(batch, f2s, None, b, range(max(0, L + j - w + 1), L + j + 1))
            for b, L in enumerate(batch.seq_lens_cpu.tolist()) for j in range(n)]  # fmt: skip
    assert [r.tolist() for r in rows] == want


def test_bound_stages_build_what_the_eager_calls_build(gen, device):
    """A bound stage (host part, then launches) writes what the reference builder writes:
    every mode of a window builder, the cascade, the paged form and a ragged verify too."""
    k, n, w = 2, 3, 4
    cfg, batch, f2s, _ = _setup(gen, device, k=k, s=3, n=n, ps=1, w=w, holes=0.3)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    tree = random_tree_mask(batch.batch_size, k, 3, n, gen).to(device)
    f2s = f2s.to(device)
    got = []
    for reference in (False, True):
        fi = FlashInferBuilder(cfg, device, sliding_window_size=w, reference=reference)
        verify = torch.tensor([2, 0, 3], dtype=torch.int32)  # a ragged bucket of 3 + N - 1
        stages = (fi.bind_draft_decode(*args, full_to_swa=f2s),
                  fi.bind_target_verify(*args, tree, full_to_swa=f2s),
                  fi.bind_draft_extend(*args, full_to_swa=f2s),
                  fi.bind_draft_decode_shared_prefix(*args, full_to_swa=f2s),
                  fi.bind_draft_decode_paged(*args, full_to_swa=f2s),
                  fi.bind_target_verify(*args, tree, full_to_swa=f2s, num_tokens=4 + n,
                                        verify_lens=verify.to(device)))  # fmt: skip
        metas = []
        for i, stage in enumerate(stages):
            more = dict(verify_lens_cpu=verify) if i == 5 else {}
            metas.append(stage.host(batch.seq_lens_cpu, **more))
            stage.launch()
        d, v, e, c, p, r = metas
        more = [(lvl.clone(), idx[: int(host[-1])].clone()) for st in c.steps
                for lvl, idx, host in zip(st.paged_kv_indptr_arr, st.paged_kv_indices_arr,
                                          st.paged_kv_indptr_host_arr, strict=True)]  # fmt: skip
        more += [(st.kv_indptr.clone(), st.kv_indices[: int(st.kv_indptr_host[-1])].clone())
                 for st in p.steps]  # fmt: skip
        more += [(r.kv_indptr.clone(), r.kv_indices[: int(r.kv_indptr_host[-1])].clone()),
                 (r.mask_indptr.clone(), r.custom_mask[: int(r.mask_indptr_host[-1])].clone())]  # fmt: skip
        got.append(([(st.kv_indptr.clone(), st.kv_indices[: int(st.kv_indptr_host[-1])].clone())
                     for st in d.steps],
                    v.kv_indices[: int(v.kv_indptr_host[-1])].clone(),
                    v.custom_mask[: int(v.mask_indptr_host[-1])].clone(),
                    e.kv_indices[: int(e.kv_indptr_host[-1])].clone(), int(fi.status), more))  # fmt: skip
    (steps, vi, vm, ei, status, more), (rsteps, rvi, rvm, rei, rstatus, rmore) = got
    for i, ((ptr, idx), (rptr, ridx)) in enumerate(zip(more, rmore, strict=True)):
        assert_equal(ptr, rptr, f"cascade, paged and ragged list {i}: offsets")
        assert_equal(idx, ridx, f"cascade, paged and ragged list {i}: entries")
    for s, ((ptr, idx), (rptr, ridx)) in enumerate(zip(steps, rsteps, strict=True)):
        assert_equal(ptr, rptr, f"draft step {s} kv_indptr")
        assert_equal(idx, ridx, f"draft step {s} kv_indices")
    assert_equal(vi, rvi, "verify kv_indices")
    assert_equal(vm, rvm, "verify custom_mask")
    assert_equal(ei, rei, "extend kv_indices")
    assert status == rstatus


def test_no_id_crosses_spaces(gen, device):
    """Property over random maps and batches: a window builder lists, for each entry, the
    map's image of the full id the full builder lists at the same position (the tail the rail
    keeps, a ragged verify's and each cascade level's too; a paged list's page is the map's
    image of the full page's slot at the read floor, or the sink page below it), or the sink 0
    with BAD_KV_ID set; every full-builder id is a physical id of the full pool (the image of
    the page map), every window id one of the window pool."""
    for draw in range(3):
        k = int(torch.randint(1, 4, (1,), generator=gen))
        ps = (1, 4, 16)[draw]
        w = int(torch.randint(4 if draw == 0 else 1, 12, (1,), generator=gen))  # draw 0: w > S
        n = min(1 + k, 4) if k > 1 else 3
        cfg, batch, f2s, v2p = _setup(gen, device, k=k, s=3, n=n, ps=ps, w=w, translate=True,
                                      holes=float(torch.rand(1, generator=gen)) * 0.5)  # fmt: skip
        runs = torch.randint(0, f2s.shape[0], (3,), generator=gen)  # −1 runs
        for start in runs.tolist():
            f2s[max(start, 1) : start + 8] = -1
        window_pool = 2 * f2s.shape[0]
        physical = set((v2p.view(-1, 1) * ps + torch.arange(ps)).view(-1).tolist())
        args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
        full, win = FlashInferBuilder(cfg, device), FlashInferBuilder(cfg, device, sliding_window_size=w)
        win.status.zero_()
        fd = full.draft_decode(*args, seq_lens_cpu=batch.seq_lens_cpu, v2p=v2p.to(device))
        wd = win.draft_decode(*args, seq_lens_cpu=batch.seq_lens_cpu, v2p=v2p.to(device),
                              full_to_swa=f2s.to(device))  # fmt: skip
        pairs = []
        for fs, ws in zip(fd.steps, wd.steps, strict=True):
            fp, wp = fs.kv_indptr_host.tolist(), ws.kv_indptr_host.tolist()
            for z in range(len(fp) - 1):
                f_ids = fs.kv_indices[fp[z] : fp[z + 1]].tolist()
                w_ids = ws.kv_indices[wp[z] : wp[z + 1]].tolist()
                assert len(w_ids) == min(len(f_ids), w), f"draw {draw}: list {z} length"
                pairs += list(zip(f_ids[len(f_ids) - len(w_ids) :], w_ids, strict=True))
        if draw == 0:  # the shared-prefix cascade (w > S): each level a tail of the full one's
            fc = full.draft_decode_shared_prefix(*args, seq_lens_cpu=batch.seq_lens_cpu,
                                                 v2p=v2p.to(device))  # fmt: skip
            wc = win.draft_decode_shared_prefix(*args, seq_lens_cpu=batch.seq_lens_cpu,
                                                v2p=v2p.to(device), full_to_swa=f2s.to(device))  # fmt: skip
            for s, (fs, ws) in enumerate(zip(fc.steps, wc.steps, strict=True)):
                for level, keep in ((0, w - s - 1), (1, s + 1)):
                    fp = fs.paged_kv_indptr_host_arr[level].tolist()
                    wp = ws.paged_kv_indptr_host_arr[level].tolist()
                    for z in range(len(fp) - 1):
                        f_ids = fs.paged_kv_indices_arr[level][fp[z] : fp[z + 1]].tolist()
                        w_ids = ws.paged_kv_indices_arr[level][wp[z] : wp[z + 1]].tolist()
                        assert len(w_ids) == min(len(f_ids), keep), f"draw {draw}: cascade {z}"
                        pairs += list(zip(f_ids[len(f_ids) - len(w_ids) :], w_ids, strict=True))
        # the paged form (ps > 1): a page at or above the read floor is the window page the
        # map gives the full page's slot there (read at the floor where it falls inside it)
        paged = []  # (the full slot the window page is read at, the window page)
        if ps > 1:
            fpg = full.draft_decode_paged(*args, seq_lens_cpu=batch.seq_lens_cpu,
                                          v2p=v2p.to(device))  # fmt: skip
            wpg = win.draft_decode_paged(*args, seq_lens_cpu=batch.seq_lens_cpu,
                                         v2p=v2p.to(device), full_to_swa=f2s.to(device))  # fmt: skip
            for fs, ws in zip(fpg.steps, wpg.steps, strict=True):
                assert_equal(ws.kv_indptr_host, fs.kv_indptr_host, f"draw {draw}: paged indptr")
                ptr = fs.kv_indptr_host.tolist()
                for z in range(len(ptr) - 1):
                    floor = max(0, int(batch.seq_lens_cpu[z // k]) - w + 1)
                    f_pages = fs.kv_indices[ptr[z] : ptr[z + 1]].tolist()
                    w_pages = ws.kv_indices[ptr[z] : ptr[z + 1]].tolist()
                    for c, (f_page, w_page) in enumerate(zip(f_pages, w_pages, strict=True)):
                        if (c + 1) * ps <= floor:
                            assert w_page == 0, f"draw {draw}: a page below the floor was read"
                            continue
                        paged.append((f_page * ps + max(floor - c * ps, 0), w_page))
        real, T = verify_split(gen, batch.batch_size, n, "random")
        ragged = dict(verify_lens=torch.tensor(real, dtype=torch.int32, device=device),
                      verify_lens_cpu=torch.tensor(real, dtype=torch.int32), num_tokens=T)  # fmt: skip
        for mode, more in (("target_verify", {}), ("draft_extend", {}), ("target_verify", ragged)):
            tree = (random_tree_mask(batch.batch_size, k, 3, n, gen).to(device),)
            extra = tree if mode == "target_verify" else ()
            fm = getattr(full, mode)(*args, *extra, seq_lens_cpu=batch.seq_lens_cpu,
                                     v2p=v2p.to(device), **more)  # fmt: skip
            wm = getattr(win, mode)(*args, *extra, seq_lens_cpu=batch.seq_lens_cpu,
                                    v2p=v2p.to(device), full_to_swa=f2s.to(device), **more)  # fmt: skip
            fp, wp = fm.kv_indptr_host.tolist(), wm.kv_indptr_host.tolist()
            for b in range(batch.batch_size):
                f_ids = fm.kv_indices[fp[b] : fp[b + 1]].tolist()
                w_ids = wm.kv_indices[wp[b] : wp[b + 1]].tolist()
                L = int(batch.seq_lens_cpu[b])
                assert len(f_ids) - len(w_ids) == max(0, L - w + 1), f"draw {draw}: {mode}"
                pairs += list(zip(f_ids[len(f_ids) - len(w_ids) :], w_ids, strict=True))
        unmapped = False
        for f_id, w_id in pairs:
            assert f_id in physical, f"draw {draw}: full id {f_id} is no physical slot"
            assert 0 <= w_id < window_pool, f"draw {draw}: window id {w_id} past the pool"
            image = int(f2s[f_id])
            assert w_id == max(image, 0), f"draw {draw}: window id {w_id} != map[{f_id}]"
            unmapped |= image < 0
        for f_id, w_page in paged:
            assert f_id in physical, f"draw {draw}: full slot {f_id} is no physical slot"
            image = int(f2s[f_id])
            assert w_page == max(image, 0) // ps, f"draw {draw}: page {w_page} != map[{f_id}]"
            unmapped |= image < 0
        assert int(full.status) == 0
        assert int(win.status) == (int(Status.BAD_KV_ID) if unmapped else 0), f"draw {draw}"


def test_the_plan_sizes_the_window_lists_by_the_clipped_lengths():
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=3, page_size=4, max_bs=8,
                     max_context_len=100, sliding_window_size=10)  # fmt: skip
    plan = plan_sizes(cfg)
    bs, k, s, n, w, total = 8, 2, 3, 3, 10, 8 * 100
    # read from the rail: a draft list at most w entries, a prefill list w - 1 + N
    assert plan["flashinfer_swa.draft_decode.kv_indices"].shape == (s, bs * k * w)
    assert plan["flashinfer_swa.target_verify.kv_indices"].shape == (bs * (w - 1 + n),)
    assert plan["flashinfer_swa.draft_extend.kv_indices"].shape == (bs * (w - 1 + n),)
    assert plan["flashinfer_swa.target_verify.custom_mask"].shape == (bs * n * (w - 1 + n),)
    assert plan["flashinfer.target_verify.kv_indices"].shape == (total + bs * n,)
    # the cascade: a prefix row a step, each at most w - 1 positions a request (step 0)
    assert plan["flashinfer_swa.draft_decode_shared.prefix_kv_indices"].shape == (s, bs * (w - 1))
    assert plan["flashinfer_swa.draft_decode_shared.prefix_kv_indptr_host"].shape == (s, bs + 1)
    narrow = plan_sizes(dataclasses.replace(cfg, sliding_window_size=s))  # w <= S: not served
    assert not any(key.startswith("flashinfer_swa.draft_decode_shared.") for key in narrow)
    swa = sum(v.nbytes for key, v in plan.items() if key.startswith("flashinfer_swa."))
    assert 0 < swa < sum(v.nbytes for key, v in plan.items() if key.startswith("flashinfer."))
    # a window wider than any list: the full layer's sizes
    wide = plan_sizes(dataclasses.replace(cfg, sliding_window_size=1000))
    for key in ("draft_decode.kv_indices", "target_verify.kv_indices", "target_verify.custom_mask"):
        assert wide[f"flashinfer_swa.{key}"].shape == wide[f"flashinfer.{key}"].shape, key
    assert not any(key.startswith("flashinfer_swa.")
                   for key in plan_sizes(dataclasses.replace(cfg, sliding_window_size=0)))  # fmt: skip


def test_the_window_builder_allocates_its_plan(device):
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=3, page_size=4, max_bs=4,
                     max_context_len=32)  # fmt: skip
    fi = FlashInferBuilder(cfg, device, sliding_window_size=5, verify_mask="packed")
    plan = plan_sizes(dataclasses.replace(cfg, sliding_window_size=5))
    assert fi.cfg.sliding_window_size == 5
    assert "target_verify.custom_mask" not in fi.buffers
    for name, buf in fi.buffers.items():
        assert tuple(buf.shape) == plan[f"flashinfer_swa.{name}"].shape, name


def test_refusals_name_the_call_and_the_fix(gen, device):
    cfg, batch, f2s, _ = _setup(gen, device, k=2, s=3, n=3, ps=4, w=4)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    win = FlashInferBuilder(cfg, device, sliding_window_size=4)
    with pytest.raises(ValueError, match=r"'draft_decode_shared_prefix' needs a window wider "
                                         r"than the draft steps.*num_steps=3.*'draft_decode'"):  # fmt: skip
        FlashInferBuilder(cfg, device, sliding_window_size=3,
                          modes=("draft_decode_shared_prefix",))  # fmt: skip
    narrow = FlashInferBuilder(dataclasses.replace(cfg, sliding_window_size=3), device,
                               sliding_window_size=3)  # fmt: skip
    assert "draft_decode_shared_prefix" not in narrow.modes and "draft_decode" in narrow.modes

    full = FlashInferBuilder(cfg, device)
    for mode in ("draft_extend", "draft_decode_shared_prefix", "draft_decode_paged"):
        with pytest.raises(ValueError, match=rf"FlashInferBuilder.{mode}: full_to_swa was given"):
            getattr(full, f"bind_{mode}")(*args, full_to_swa=f2s.to(device))
    with pytest.raises(ValueError, match=r"draft_decode_paged: full_to_swa was given"):
        full.draft_decode_paged(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device))
    with pytest.raises(TypeError, match=r"draft_extend: full_to_swa must be"):
        win.bind_draft_extend(*args, full_to_swa=f2s.float().to(device))
    with pytest.raises(ValueError, match=r"sliding_window_size=4, but the config plans window "
                                         r"layers of sliding_window_size=6"):  # fmt: skip
        FlashInferBuilder(dataclasses.replace(cfg, sliding_window_size=6), device,
                          sliding_window_size=4)  # fmt: skip
    windowed = dataclasses.replace(cfg, draft_window_size=8)  # a draft window bounds the draft
    assert FlashInferBuilder(windowed, device, sliding_window_size=4).modes == (
        "target_verify", "draft_extend")
    status = new_status(device)
    win.draft_extend(*args, seq_lens_cpu=batch.seq_lens_cpu, full_to_swa=f2s.to(device),
                     status=status)  # fmt: skip
    assert int(status) == 0
