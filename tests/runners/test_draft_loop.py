"""End-to-end draft loop (issue 6): a synthetic EAGLE tree iteration through the runners over
batch sizes 32 → 12 → 3 → 1 → 0 → 32, padding tails poisoned before every run. Every runner's
result (the builders' own, for B) equals the eager twin's (the same stages on specmeta's
references, bound once per batch size to persistent inputs), the draft forwards' attention
through the metadata equals dense attention over each branch's logical sequence, and the
relocation commits exactly the accepted KV. On CUDA the runners replay graphs; the GPU tier
adds no-sync and no-recompile. On the CPU (Triton's interpreter runs a launch's programs one
after the other) the same walk runs a quarter of the size: 8 → 5 → 3 → 1 → 0 → 8 over the
buckets 1, 4, 8."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from examples.draft_loop import SEQUENCE, DraftLoop, LoopShape, next_requests
from specmeta import SpecConfig, probes
from specmeta.metadata.contract import DraftSteps
from specmeta.testing.consumers import flashinfer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.consumers.fa3 import run_cascade
from tests._support import all_compiled_variants, no_host_sync
from tests.guard_bands import assert_equal

BUCKETS = (1, 4, 16, 32)
# The CPU tier's walk: every bucket once on the way down (a bucket, between buckets, one, an
# idle rank), then a full batch of new requests.
CPU_BUCKETS, CPU_SEQUENCE = (1, 4, 8), (8, 5, 3, 1, 0, 8)
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


# The buffers each stage rewrites on every run (poisoned before it, so a stale entry shows).
REBUILT = {
    "draft": ["draft.out_cache_loc", "draft.positions", "draft.prefix_tail_tgt",
              "draft.prefix_tail_src", "flashinfer.draft_decode.kv_indptr",
              "flashinfer.draft_decode.kv_indices", "flashinfer.draft_decode_shared.prefix_kv_indptr",
              "flashinfer.draft_decode_shared.prefix_kv_indices",
              "flashinfer.draft_decode_shared.chain_kv_indptr",
              "flashinfer.draft_decode_shared.chain_kv_indices",
              "flashinfer.draft_decode_paged.kv_indptr", "flashinfer.draft_decode_paged.kv_indices",
              "flashinfer.draft_decode_paged.kv_last_page_len", "fa3.draft_decode.page_table",
              "fa3.draft_decode.cache_seqlens", "fa3.draft_decode.cu_seqlens_k"],
    "verify": ["flashinfer.target_verify.kv_indptr", "flashinfer.target_verify.kv_indices",
               "flashinfer.target_verify.mask_indptr", "flashinfer.target_verify.custom_mask",
               "fa3.target_verify.page_table", "fa3.target_verify.cache_seqlens",
               "fa3.target_verify.cu_seqlens_k"],
    "accept": ["verify.tgt_cache_loc", "verify.src_cache_loc"],
}  # fmt: skip


def _poison(stage, runner, meta, B, bp):
    for spec in runner.inputs.values():
        spec.buffer[B * spec.per_request : bp * spec.per_request] = GARBAGE
    for key in REBUILT[stage]:
        meta.bufs[key].fill_(POISON)
    mode = "draft_decode" if stage == "draft" else "target_verify"
    if stage != "accept" and meta.cfg.topk > 1:  # the expand pass's tables (not its query strides)
        for field in ("page_table", "cache_seqlens", "cu_seqlens_k"):
            meta.bufs[f"fa3.{mode}.expand_{field}"].fill_(POISON)


def _walk(device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(buckets, batch sizes)``: the issue's on a GPU, the CPU tier's under the interpreter."""
    cuda = torch.device(device).type == "cuda"
    return (BUCKETS, SEQUENCE) if cuda else (CPU_BUCKETS, CPU_SEQUENCE)


def _config(k, s, n, ps, buckets=BUCKETS):
    return SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=max(buckets),
                      max_context_len=40)  # fmt: skip


# A list buffer is read up to the end its offsets give: (list field, offsets field).
_LISTS = {"kv_indices": "kv_indptr", "custom_mask": "mask_indptr",
          "packed_custom_mask": "mask_indptr", "paged_kv_indices_arr": "paged_kv_indptr_arr"}  # fmt: skip


def _same(got, want, what):
    """``got`` equals ``want`` field by field: tensors exactly, lists up to their used end,
    host scalars equal; results of another shape (a cut to the wrong ``B``) fail."""
    if isinstance(want, torch.Tensor):
        assert_equal(got, want, what)
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), what
        for f in dataclasses.fields(want):
            g, w = getattr(got, f.name), getattr(want, f.name)
            if f.name in _LISTS and w is not None:
                ends = getattr(want, _LISTS[f.name])
                if isinstance(w, tuple):
                    for i, (gi, wi, e) in enumerate(zip(g, w, ends, strict=True)):
                        n = int(e[-1])
                        assert_equal(gi[:n], wi[:n], f"{what}.{f.name}[{i}]")
                else:
                    n = int(ends[-1])
                    assert_equal(g[:n], w[:n], f"{what}.{f.name}")
            else:
                _same(g, w, f"{what}.{f.name}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{what}: {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{what}[{i}]")
    elif isinstance(want, dict):
        assert set(got) == set(want), what
        for k in want:
            _same(got[k], want[k], f"{what}[{k!r}]")
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _check_attention(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=lambda m: f"{what}: {m}")


def _check_host_mirrors(results, B):
    """FlashInfer's plan() mirrors, computed on the host from the CPU seq_lens, equal the device
    values the graph wrote, for the B requests."""
    for mode, res in results.items():
        if not mode.startswith("flashinfer"):
            continue
        steps = res if isinstance(res, (tuple, DraftSteps)) else (res,)
        for s, step in enumerate(steps):
            if hasattr(step, "paged_kv_indptr_host_arr"):
                pairs = [*zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True),
                         *zip(step.paged_kv_last_page_len_host_arr, step.paged_kv_last_page_len,
                              strict=True)]  # fmt: skip
            elif hasattr(step, "mask_indptr_host"):
                pairs = [(step.kv_indptr_host, step.kv_indptr),
                         (step.mask_indptr_host, step.mask_indptr),
                         (step.kv_last_page_len_host, step.kv_last_page_len)]  # fmt: skip
            else:
                pairs = [(step.kv_indptr_host, step.kv_indptr),
                         (step.kv_last_page_len_host, step.kv_last_page_len)]  # fmt: skip
            for i, (h, d) in enumerate(pairs):
                assert_equal(h, d.cpu(), f"{mode}[{s}] mirror {i} (B={B})")


def _check_draft(loop, reqs, d):
    B, K = len(reqs), loop.cfg.topk
    _same(d.runner, d.eager, f"draft B={B}")
    _check_host_mirrors(d.runner, B)
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
        want = dense_attention(q, _cat(keys, loop), _cat(vals, loop), lists)[0]
        for name, outs in d.attention.items():
            _check_attention(outs[s], want, f"draft {name} step {s} B={B}")


def _cat(parts, loop):
    H, D = loop.shape.heads, loop.shape.head_dim
    return torch.cat(parts) if parts else torch.zeros(0, H, D, device=loop.device)


def _check_verify(loop, reqs, v):
    """Runner equals eager; every verify consumer equals dense attention of each tree node over
    its prefix and its ancestors (itself included), rebuilt from the table."""
    B, N = len(reqs), loop.cfg.num_draft_tokens
    _same(v.runner, v.eager, f"verify B={B}")
    _check_host_mirrors(v.runner, B)
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
    want = dense_attention(v.queries, _cat(keys, loop), _cat(vals, loop), lists)[0]
    for name, got in v.attention.items():
        _check_attention(got, want, f"verify {name} B={B}")


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
    _same(a.runner, a.eager, f"accept B={B}")
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


def _drive(loop, between=None, sequence=SEQUENCE):
    """Run the batch sequence stage by stage, checking each stage right after it ran."""
    sizes, reqs = [], []
    for B in sequence:
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
    buckets, sequence = _walk(device)
    cfg = _config(k, s, n, ps, buckets)
    loop = DraftLoop(cfg, LoopShape(iterations=len(sequence)), buckets, device, gen, CONSUMERS,
                     poison=_poison)  # fmt: skip
    assert _drive(loop, sequence=sequence) == list(sequence)


def test_padded_layout_b_rows_set_no_status_bit(device, gen):
    """A padded request's slots are all the sink (design §4); no kernel may report them. The
    eager twin here makes the eager call, which gives the runner's results too."""
    buckets, _ = _walk(device)
    cfg = _config(2, 3, 4, 4, buckets)
    # The eager twin by the eager call (each stage bound to the raw batch, called at once).
    loop = DraftLoop(cfg, LoopShape(), buckets, device, gen, CONSUMERS, bind_once=False)
    reqs = loop.new_requests(3)
    d = loop.draft(reqs)  # bucket 4: one padded request
    _check_draft(loop, reqs, d)
    assert int(loop.eager.status) == 0
    assert int(loop.meta.status) == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="runs the loop on the CPU, which needs TRITON_INTERPRET=1")  # fmt: skip
def test_runner_probes_catch_a_request_on_the_reserved_row(device, gen):
    """With probes on, a request on row 0 is refused before the draft run. The loop runs on the
    CPU whatever the device: a failing probe on CUDA is a device assert (see test_probes); so
    it needs Triton's interpreter, which the CPU tier has on and the GPU tier off."""
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
            with no_host_sync():
                return _run(*args, **kwargs)

        runner.run = no_sync_run

    def after_iteration():
        torch.cuda.synchronize()
        compiled.append(all_compiled_variants())

    assert _drive(loop, after_iteration) == list(SEQUENCE)
    # The first iteration warms up the eager twin; after it, nothing compiles.
    assert compiled[1:] == [compiled[1]] * (len(compiled) - 1), f"compilations: {compiled}"
