"""End-to-end draft loop (issue 6): a synthetic EAGLE tree iteration through the runners over
batch sizes 32 → 12 → 3 → 1 → 0 → 32, padding tails poisoned before every run. Every runner
output equals the eager build on the raw inputs, the draft forwards' attention through the
metadata equals dense attention over each branch's logical sequence, and the relocation commits
exactly the accepted KV. On CUDA the runners replay graphs; the GPU tier adds no-sync and
no-recompile."""

from __future__ import annotations

import pytest
import torch

from examples.draft_loop import (
    SEQUENCE,
    DraftLoop,
    LoopShape,
    Metadata,
    next_requests,
)
from specmeta import SpecConfig, probes
from specmeta.testing.consumers import flashinfer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import run_cascade
from tests.guard_bands import assert_equal

BUCKETS = (1, 4, 16, 32)
GARBAGE = 5  # a valid row, length, slot and node id: a missed pad shows as a wrong output
POISON = -7
CONFIGS = [(2, 3, 4, 4), (3, 2, 5, 1)]  # (K, S, N, ps): slot layout B, then layout A


def _first(fn):
    """The output of a consumer that returns ``(out, lse)``."""
    return lambda q, k, v, meta: fn(q, k, v, meta)[0]


CONSUMERS = {
    "draft.flashinfer": _first(flashinfer.decode),
    "draft.flashinfer_cascade": _first(flashinfer.cascade),
    "draft.flashinfer_paged": _first(flashinfer.decode),
    "draft.fa3": run_cascade,
    "verify.flashinfer": _first(flashinfer.prefill),
    "verify.fa3": run_cascade,
}


def _poison(stage, runner, meta, B, bp):
    for spec in runner.inputs.values():
        spec.buffer[B * spec.per_request : bp * spec.per_request] = GARBAGE
    for key, *_ in Metadata.outputs(stage, meta.cfg).values():
        meta.bufs[key].fill_(POISON)


def _config(k, s, n, ps):
    return SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=max(BUCKETS),
                      max_context_len=40)  # fmt: skip


def _cut(stage, cfg, outputs, B):
    cut = {}
    for name, (_, per, extra, dim) in Metadata.outputs(stage, cfg).items():
        t = outputs[name]
        cut[name] = t if per is None else t.narrow(dim, 0, B * per + extra)
    return cut


def _compare(stage, cfg, runner_out, eager_out, B):
    """The runner's outputs, cut to ``B``, equal the eager build's; a list buffer (no cut) up to
    the end its ``*indptr`` gives, row by row."""
    eager = _cut(stage, cfg, eager_out, B)
    for name, got in runner_out.items():
        want = eager[name]
        if Metadata.outputs(stage, cfg)[name][1] is not None:
            assert_equal(got, want, f"{stage} {name} B={B}")
            continue
        partner = name.replace("kv_indices", "kv_indptr").replace("custom_mask", "mask_indptr")
        ptr = runner_out[partner]
        if got.dim() == 1:
            used = int(ptr[-1])
            assert_equal(got[:used], want[:used], f"{stage} {name} B={B}")
        else:
            for row in range(got.shape[0]):
                used = int(ptr[row, -1])
                assert_equal(got[row, :used], want[row, :used], f"{stage} {name}[{row}] B={B}")


def _check_attention(got, want, real_rows, what):
    """``got`` covers the padded batch: the real rows equal dense attention, the padded rows
    (which read the sink) are finite."""
    torch.testing.assert_close(got[:real_rows], want, rtol=0, atol=1e-9,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip
    assert torch.isfinite(got[real_rows:]).all(), f"{what}: a padded row is not finite"


def _check_host_mirrors(host, bp):
    """FlashInfer's plan() mirrors, computed on the host from the padded CPU seq_lens, equal the
    device values of the padded batch: the padded rows' host scalars are right too."""
    for mode, res in host["plan"].items():
        if hasattr(res, "steps"):
            for s, step in enumerate(res.steps):
                if hasattr(step, "paged_kv_indptr_host_arr"):
                    pairs = [*zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr,
                                  strict=True),
                             *zip(step.paged_kv_last_page_len_host_arr,
                                  step.paged_kv_last_page_len, strict=True)]  # fmt: skip
                else:
                    pairs = [(step.kv_indptr_host, step.kv_indptr),
                             (step.kv_last_page_len_host, step.kv_last_page_len)]  # fmt: skip
                for i, (h, d) in enumerate(pairs):
                    assert_equal(h, d.cpu(), f"{mode}[{s}] mirror {i} (Bp={bp})")
        else:
            assert_equal(res.kv_indptr_host, res.kv_indptr.cpu(), f"{mode} kv_indptr (Bp={bp})")
            assert_equal(res.mask_indptr_host, res.mask_indptr.cpu(), f"{mode} mask (Bp={bp})")
            assert_equal(res.kv_last_page_len_host, res.kv_last_page_len.cpu(), f"{mode} lpl")


def _check_draft(loop, reqs, d):
    cfg, B, K = loop.cfg, len(reqs), loop.cfg.topk
    _compare("draft", cfg, d.runner, d.eager, B)
    _check_host_mirrors(d.host, d.padded_batch_size)
    assert d.host["seq_lens_sum"] == sum(d.seq_lens) + (d.padded_batch_size - B) * loop.fill
    # Dense truth: each branch attends to its logical prefix and its own chain 0 … s, rebuilt
    # from the model's table (not from any pool slot or metadata). Every consumer must agree.
    assert set(d.attention) == {k.split(".", 1)[1] for k in CONSUMERS if k.startswith("draft.")}
    for s, q in enumerate(d.queries):
        keys, vals, lists, start = [], [], [], 0
        for z in range(B * K):
            b, t = divmod(z, K)
            L = d.seq_lens[b]
            pos = L + torch.arange(s + 1, device=loop.device)
            chain_k, chain_v = loop.model.kv(d.tokens[b, t, : s + 1], pos)[0]
            keys += [reqs[b].keys[0][:L], chain_k]
            vals += [reqs[b].values[0][:L], chain_v]
            lists.append(list(range(start, start + L + s + 1)))
            start += L + s + 1
        want = dense_attention(q[: B * K], _cat(keys, loop), _cat(vals, loop), lists)[0]
        for name, outs in d.attention.items():
            _check_attention(outs[s], want, B * K, f"draft {name} step {s} B={B}")


def _cat(parts, loop):
    H, D = loop.shape.heads, loop.shape.head_dim
    return torch.cat(parts) if parts else torch.zeros(0, H, D, device=loop.device)


def _check_verify(loop, reqs, v):
    """Runner equals eager; every verify consumer equals dense attention of each tree node over
    its prefix and its ancestors (itself included), rebuilt from the table."""
    cfg, B, N = loop.cfg, len(reqs), loop.cfg.num_draft_tokens
    _compare("verify", cfg, v.runner, v.eager, B)
    _check_host_mirrors(v.host, v.padded_batch_size)
    keys, vals, lists, start = [], [], [], 0
    for i, L in enumerate(v.seq_lens):
        node_k, node_v = loop.model.kv(v.tokens[i], L + v.depth[i])[0]
        keys += [reqs[i].keys[0][:L], node_k]
        vals += [reqs[i].values[0][:L], node_v]
        for j in range(N):
            ancestors = v.tree_mask[i, j].nonzero().flatten().tolist()
            lists.append(list(range(start, start + L)) + [start + L + c for c in ancestors])
        start += L + N
    assert set(v.attention) == {k.split(".", 1)[1] for k in CONSUMERS if k.startswith("verify.")}
    want = dense_attention(v.queries[: B * N], _cat(keys, loop), _cat(vals, loop), lists)[0]
    for name, got in v.attention.items():
        _check_attention(got, want, B * N, f"verify {name} B={B}")


def _check_prefix_tails(loop, reqs, d):
    """design §1, layout B: right after the draft run, the hole slots of branches 1 … K−1 hold a
    copy of the prefix tail, in every layer's K and V."""
    cfg = loop.cfg
    if not cfg.layout_b:
        return
    K, S, ps = cfg.topk, cfg.num_steps, cfg.page_size
    for r, L in zip(reqs, d.seq_lens, strict=True):
        lpl, row = L % ps, loop.req_to_token[r.row].long()
        base, nnp = L - lpl, -(-(lpl + S) // ps)
        for t in range(1, K):
            holes = row[base + t * nnp * ps + torch.arange(lpl)]
            for layer in range(loop.shape.layers):
                assert torch.equal(loop.model.k[layer][holes], r.keys[layer][base:L])
                assert torch.equal(loop.model.v[layer][holes], r.values[layer][base:L])


def _check_accept(loop, reqs, v, a, lengths_before):
    cfg, B = loop.cfg, len(reqs)
    N, C = cfg.num_draft_tokens, cfg.num_steps + 1
    eager = _cut("accept", cfg, a.eager, B)
    for name, got in a.runner.items():
        assert_equal(got, eager[name], f"accept {name} B={B}")
    # design §2.4 read directly: accepted pairs compacted in request order, then (0, 0).
    window = v.window.cpu()
    tgt, src = [], []
    for i, path in enumerate(a.paths):
        tgt += [int(window[i * N + k]) for k in range(len(path))]
        src += [int(window[i * N + node]) for node in path]
    n = len(tgt)
    assert a.runner["tgt"][:n].tolist() == tgt and a.runner["src"][:n].tolist() == src
    bp = loop.runners["accept"].bucket(B)
    bufs = loop.meta.bufs
    assert bufs["verify.tgt_cache_loc"][n : bp * C].eq(0).all(), "padded requests move nothing"
    assert bufs["verify.src_cache_loc"][n : bp * C].eq(0).all()
    # The commit: every layer's pool holds each request's logical sequence, accepted KV included.
    for r, before, path in zip(reqs, lengths_before, a.paths, strict=True):
        assert r.length == before + len(path)
        slots = loop.req_to_token[r.row, : r.length].long()
        for layer in range(loop.shape.layers):
            assert torch.equal(loop.model.k[layer][slots], r.keys[layer]), f"row {r.row} K"
            assert torch.equal(loop.model.v[layer][slots], r.values[layer]), f"row {r.row} V"


def _check_padding(loop, B):
    """Every static input's tail holds its pad after the run (design §4)."""
    for runner in loop.runners.values():
        bp = runner.bucket(B)
        for spec in runner.inputs.values():
            tail = spec.buffer[B * spec.per_request : bp * spec.per_request]
            assert tail.eq(spec.pad).all(), f"{spec.name}[{B}:{bp}] is not padded"


def _drive(loop, between=None):
    """Run the batch sequence stage by stage, checking each stage right after it ran."""
    sizes, reqs = [], []
    for B in SEQUENCE:
        reqs = next_requests(loop, reqs, B)
        d = loop.draft(reqs)
        _check_prefix_tails(loop, reqs, d)
        _check_draft(loop, reqs, d)
        v = loop.verify(reqs)
        _check_verify(loop, reqs, v)
        a = loop.accept(reqs, v)
        _check_accept(loop, reqs, v, a, d.seq_lens)
        _check_padding(loop, B)
        assert int(loop.eager.status) == 0 and int(loop.meta.status) == 0
        sizes.append(B)
        if between is not None:
            between()
    return sizes


@pytest.mark.parametrize("k,s,n,ps", CONFIGS)
def test_draft_loop_through_runners(device, gen, k, s, n, ps):
    cfg = _config(k, s, n, ps)
    loop = DraftLoop(cfg, LoopShape(), BUCKETS, device, gen, CONSUMERS, poison=_poison)
    assert _drive(loop) == list(SEQUENCE)


def test_padded_layout_b_rows_set_no_status_bit(device, gen):
    """A padded request's slots are all the sink (design §4); no kernel may report them."""
    cfg = _config(2, 3, 4, 4)
    loop = DraftLoop(cfg, LoopShape(), BUCKETS, device, gen, CONSUMERS)
    loop.draft(loop.new_requests(3))  # bucket 4: one padded request
    assert int(loop.eager.status) == 0
    assert int(loop.meta.status) == 0


def test_runner_probes_catch_a_request_on_the_reserved_row(device, gen):
    """With probes on, a request on row 0 is refused before the draft run. The loop runs on the
    CPU whatever the device: a failing probe on CUDA is a device assert (see test_probes)."""
    cfg = _config(2, 2, 3, 1)
    loop = DraftLoop(cfg, LoopShape(), (1, 4), "cpu", gen, CONSUMERS)
    reqs = loop.new_requests(3)
    reqs[1].row = 0
    static = loop.meta.bufs["runner.req_pool_indices"]
    static.fill_(-9)
    previous = probes.enable(True)
    try:
        with pytest.raises(ValueError, match=r"runner input 'req_pool_indices'.*outside \[1,"):
            loop.draft(reqs)
    finally:
        probes.enable(previous)
    assert static.eq(-9).all(), "refused before any copy"


# --------------------------------------------------------------------------------------------
# GPU tier
# --------------------------------------------------------------------------------------------
def _compiled_variants() -> int:
    """Compiled specialisations of every specmeta Triton kernel."""
    import sys

    import triton

    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("specmeta."):
            continue
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.JITFunction):
                caches = getattr(obj, "device_caches", None)
                if caches is not None:
                    total += sum(len(entry[0]) for entry in caches.values())
                else:
                    total += sum(len(c) for c in obj.cache.values())
    return total


@pytest.mark.gpu
@pytest.mark.parametrize("k,s,n,ps", CONFIGS + [(8, 4, 16, 16)])
def test_draft_loop_replays_without_sync_or_compilation(gen, k, s, n, ps):
    cfg = _config(k, s, n, ps)
    loop = DraftLoop(cfg, LoopShape(), BUCKETS, "cuda", gen, CONSUMERS, poison=_poison)
    assert all(r.graphs for r in loop.runners.values())
    compiled = []
    for runner in loop.runners.values():
        run = runner.run

        def no_sync_run(*args, _run=run, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _run(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.run = no_sync_run

    def after_iteration():
        torch.cuda.synchronize()
        compiled.append(_compiled_variants())

    assert _drive(loop, after_iteration) == list(SEQUENCE)
    # The first iteration warms up the eager twin; after it, nothing compiles.
    assert compiled[1:] == [compiled[1]] * (len(compiled) - 1), f"compilations: {compiled}"
