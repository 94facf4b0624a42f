"""Speculative decoding of a hybrid model (sliding-window layers) with windowed drafts is
lossless (issue 38).

The tiny model of :mod:`test_lossless` with every other layer a sliding-window layer (window
``w``: a query at ``p`` attends to ``(p − w, p]``) whose KV lives in a second, smaller pool, read
through the engine's full → window pool map (:mod:`specmeta.testing.window_pool`: every full slot
gets a window slot, positions that fall out of the window are evicted, ``−1``, and their window
slots reused). FlashInfer's builder builds the full layers' metadata, a second one
(``sliding_window_size``) the window layers' in window-pool ids; the draft slots are translated
by ``assign_draft_cache_locs(full_to_swa=)``, the accepted KV moved in both pools (the window
pool's pairs through ``accept_cache_locs`` with the map as a page map of page size 1). Some cases
also bound the draft's full layers with a draft window (``draft_window_size``,
``draft_sink_size``); some verify ragged (each request its first nodes, design §2.9). The
``fa3`` cases serve both kinds of layer with FA3's builders
(``FA3MetadataBuilder(cfg, dev, sliding_window_size=w)`` for the window layers, design §2.10):
their page tables read the window pool a page at a time, so the map pages like the full pool
(``WindowSlots(..., page_size=ps)``: whole window pages handed out and taken back, a full page's
slots at the same offsets of one window page, the floor's page cleared token by token), the
window results run FlashAttention's own window, and in slot layout B the prefix-tail copies are
made in the window pool too (checked after every draft stage). For every request:

* the output equals plain greedy decoding of the target (dense attention, the window applied
  in the window layers);
* every iteration's acceptance equals greedy's prefix in the tree, and the acceptance and trees
  equal those of the same loop on specmeta's pure-torch references; the status word stays 0
  (an id read through an evicted map entry would set ``BAD_KV_ID``);
* with ``topk = 1`` every drafted chain is the draft's greedy chain under the dense reference
  of draft decode (the draft window in the full layers, the sliding window in the window
  layers): the windowed draft attends to exactly what the window names; with ``topk > 1``
  (CPU tier) every draft forward's logits equal the dense reference of its branch;
* the sequences crossed the window, and window slots were evicted and reused.

Tiers: the CPU cases of :data:`CPU_CASES` (torch consumers, float64); the ``gpu`` set of
:data:`GPU_CASES` with FlashInfer's real kernels, bf16, checked as :mod:`test_lossless` checks
its GPU set (a step whose float32 reference lead is below the margin is a near-tie, counted).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmeta import SpecConfig
from specmeta.kernels.draft_cache_locs import prefix_tail_copy_pairs_ref
from specmeta.testing.spec_loop import SpeculativeLoop, make_requests
from specmeta.testing.tiny_model import DEFAULT_MARGIN, TinyConfig, TinyModel
from tests.testing.lossless_checks import (
    GPU_MODEL,
    PERTURBATION,
    Served,
    _check_cpu,
    _check_gpu,
    _draw,
    _real_attention,
)

BUCKETS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class HybridCase:
    """One configuration of the loop on a hybrid model."""

    topk: int
    steps: int
    draft_tokens: int
    page_size: int
    window: int  # w of the window layers
    draft_window: int = 0  # draft_window_size of the draft's full layers (0: none)
    draft_sink: int = 0
    form: str = "decode"  # FlashInfer's draft-decode form of the full layers
    mode: str = "auto"
    backend: str = "flashinfer"  # whose builders (full layers' and window layers') serve it
    ragged: bool = False  # each request verifies its first nodes only (design §2.9)

    @property
    def id(self) -> str:
        dw = f"-dw{self.draft_window}+{self.draft_sink}" if self.draft_window else ""
        form = "fa3" if self.backend == "fa3" else self.form
        return (f"{form}-k{self.topk}s{self.steps}n{self.draft_tokens}-ps{self.page_size}"
                f"-w{self.window}{dw}-{self.mode}{'-ragged' if self.ragged else ''}")  # fmt: skip


def _model_cfg(base: TinyConfig, window: int) -> TinyConfig:
    """``base`` with every other layer (1, 3, …) a window layer of window ``w``."""
    layers = tuple(range(1, base.num_layers, 2))
    return dataclasses.replace(base, window_layers=layers, sliding_window_size=window)


@dataclasses.dataclass
class HybridServed(Served):
    draft: TinyModel | None = None
    loop: SpeculativeLoop | None = None


def _serve(case: HybridCase, draft_kind: str, gen, device, *, base: TinyConfig, dtype,
           new_tokens: int, waves, spread: int, attention=None,
           dense_drafts: bool = False) -> HybridServed:  # fmt: skip
    """The workload through the loop on the kernels, then on specmeta's references (same modes,
    buckets and seeds: only the metadata's origin differs). ``dense_drafts`` (float64): every
    tree's draft forwards checked against the dense reference as the loop runs."""
    model_cfg = _model_cfg(base, case.window)
    target = TinyModel.random(model_cfg, _draw(gen), dtype=dtype, device=device)
    draft = target if draft_kind == "self" else target.perturbed(PERTURBATION, _draw(gen))
    requests = make_requests(waves, vocab_size=model_cfg.vocab_size, page_size=case.page_size,
                             max_new_tokens=new_tokens, generator=gen, spread=spread)  # fmt: skip
    longest = max(r.prompt.shape[0] + r.max_new_tokens for r in requests)
    cfg = SpecConfig(topk=case.topk, num_steps=case.steps, num_draft_tokens=case.draft_tokens,
                     page_size=case.page_size, max_bs=max(len(w) for w in waves),
                     max_context_len=longest, draft_window_size=case.draft_window,
                     draft_sink_size=case.draft_sink)  # fmt: skip
    common = dict(backend=case.backend, attention=attention, draft_form=case.form,
                  ragged_verify=case.ragged,
                  seed=_draw(gen), raise_on_status=False)  # fmt: skip
    buckets = tuple(b for b in BUCKETS if b < cfg.max_bs)
    buckets = (*buckets, cfg.max_bs) if case.mode == "graph" else buckets
    loop = SpeculativeLoop(cfg, target, draft, mode=case.mode, buckets=buckets, **common)
    tails = _watch_window_tails(loop)
    branches = _watch_draft_forwards(loop) if dense_drafts else [1]
    history = loop.run(requests)
    assert branches[0], "no tree draft forward was checked against the dense reference"
    twins = [dataclasses.replace(r, output=[], row=0, seq_len=0, root_logprobs=None)
             for r in requests]  # fmt: skip
    reference = SpeculativeLoop(cfg, target, draft, mode=case.mode, buckets=buckets,
                                reference=True, **common)  # fmt: skip
    reference_tails = _watch_window_tails(reference)
    reference_history = reference.run(twins)
    if cfg.layout_b and loop.window.page_size > 1:
        assert tails[0] and reference_tails[0], "no window-pool prefix tail was checked"

    def pools(run: SpeculativeLoop) -> list[torch.Tensor]:
        return [t for c in (run.target_cache, run.draft_cache) for t in (*c.k, *c.v)]

    return HybridServed(case, target, requests, history, reference_history,
                        (pools(loop), pools(reference)), draft=draft, loop=loop)  # fmt: skip


def _watch_window_tails(loop: SpeculativeLoop) -> list[int]:
    """Slot layout B with a map that pages like the full pool: after every draft stage, each
    branch ``t ≥ 1``'s copy of its prefix tail (its region's first positions) holds, in every
    window layer of the draft pool, the KV of the tail itself, both read through the page map
    (the tail's first positions may be out of the token map already, their page held). Returns
    ``[pairs checked]``, counted as the loop runs."""
    checked = [0]
    c, slots = loop.cfg, loop.window
    if not c.layout_b or slots is None or slots.page_size == 1:
        return checked
    draft, ps = loop._draft, c.page_size

    def watched(batch, rpi, draft_lens, *args):
        tree = draft(batch, rpi, draft_lens, *args)
        tgt, src = prefix_tail_copy_pairs_ref(rpi, loop.slots.req_to_token, draft_lens,
                                              topk=c.topk, num_steps=c.num_steps,
                                              page_size=ps)  # fmt: skip
        used = tgt > 0
        tgt, src = tgt[used].long(), src[used].long()
        wtgt = slots.page_map[tgt // ps].long() * ps + tgt % ps
        wsrc = slots.page_map[src // ps].long() * ps + src % ps
        assert bool((wtgt > 0).all() and (wsrc > 0).all()), "a tail pair's page is not held"
        cache = loop.draft_cache
        for i in cache.window_layers:
            for buf in (cache.k[i], cache.v[i]):
                pairs = list(zip(wtgt.tolist(), wsrc.tolist(), strict=True))[:4]
                assert torch.equal(buf[wtgt], buf[wsrc]), (
                    f"window layer {i}: a branch's prefix-tail copy differs from the tail in "
                    f"the window pool (pairs {pairs} …)")  # fmt: skip
        checked[0] += int(used.sum())
        return tree

    loop._draft = watched
    return checked


def _watch_draft_forwards(loop: SpeculativeLoop) -> list[int]:
    """Trees (``topk > 1``; chains: :func:`_check_draft_chains`), float64: every draft-decode
    forward's logits equal, to rounding, the dense reference of each branch, its request's
    committed sequence and root followed by the tokens its own slot chain holds (the loop's
    branch semantics; the draft window in the full layers, the sliding window in the window
    layers). Acceptance does not see a wrong draft tree (verification is exact whatever is
    drafted, and the reference loop shares the stages' code): this checks the window layers'
    tree metadata, draft slots and prefix-tail copies end to end. Returns ``[branches
    checked]``."""
    checked = [1]
    c = loop.cfg
    if c.topk == 1:
        return checked
    checked[0] = 0
    draft, forward, K = loop._draft, loop._forward, c.topk

    def watched(batch, *args):
        seen = []

        def recording(model, cache, meta, tokens, *rest):
            logits = forward(model, cache, meta, tokens, *rest)
            seen.append((tokens.cpu(), logits.double().cpu()))
            return logits

        loop._forward = recording
        try:
            tree = draft(batch, *args)
        finally:
            del loop._forward  # the class's own again
        for b, r in enumerate(batch):
            if not seen:
                break
            prefix = torch.cat([r.prompt, torch.tensor(r.output, dtype=torch.int64)])
            for t in range(K):
                chain = torch.stack([tokens[b * K + t] for tokens, _ in seen])
                got = torch.stack([logits[b * K + t] for _, logits in seen])
                want = loop.draft.draft_logits(prefix, chain, c.draft_window_size,
                                               c.draft_sink_size).double().cpu()  # fmt: skip
                err = float((got - want).abs().max())
                assert err < 1e-8, (f"request {r.rid}, branch {t}: the draft forwards of chain "
                                    f"{chain.tolist()} leave the dense reference by {err}")  # fmt: skip
                checked[0] += 1
        return tree

    loop._draft = watched
    return checked


def _check_window_crossed(s: HybridServed) -> None:
    """The workload crossed the window (a request's verify window reached past ``w``), and the
    window pool evicted slots (pages) and handed them out again; a paged map also cleared the
    first positions of a page it still held."""
    w = s.case.window
    prompt = {r.rid: r.prompt.shape[0] for r in s.requests}
    lengths = {prompt[n.rid] + n.start - 1 for it in s.history for n in it.requests}
    assert max(lengths) > w + 1, (w, sorted(lengths))  # a verify list clipped at f > 1
    slots = s.loop.window
    assert slots.evicted and slots.reused, (slots.evicted, slots.reused)
    assert slots.cleared or slots.page_size == 1, "no page was cleared token by token"


def _check_draft_chains(s: HybridServed, margin: float = 0.0) -> int:
    """``topk = 1``: every iteration's drafted chain is the draft's greedy chain over the
    committed sequence under the dense reference of draft decode (the draft window, if any, in
    the full layers; the sliding window in the window layers). The first draft token comes from
    the draft extend (or prefill) before the iteration, unwindowed; each later one from a
    draft-decode forward. ``margin`` excuses a chain token where the dense reference leads it by
    less (the GPU's near-ties); returns how many were excused."""
    case = s.case
    # The reference: float32 on the GPU's bf16 weights (as _check_gpu's), the draft itself on
    # the CPU (float64).
    draft = s.draft.to(dtype=torch.float32) if margin else s.draft
    outputs = {r.rid: (r.prompt, r.output) for r in s.requests}
    excused = 0
    for it in s.history:
        for n in it.requests:
            prompt, output = outputs[n.rid]
            prefix = torch.cat([prompt, torch.tensor(output[: n.start], dtype=torch.int64)])
            chain = list(n.tree_tokens[1:])
            logits = draft.logits(prefix.to(draft.device))[-1:]
            if chain[:-1]:
                logits = torch.cat([logits, draft.draft_logits(
                    prefix, torch.tensor(chain[:-1]), case.draft_window, case.draft_sink)])  # fmt: skip
            logits = logits.double().cpu()
            picked = logits.gather(1, torch.tensor(chain).view(-1, 1))[:, 0]
            lead = logits.max(-1).values - picked
            bad = lead > margin if margin else lead > 0
            assert not bool(bad.any()), (
                f"{case.id}: iteration {it.index}, request {n.rid} drafted {chain}; the dense "
                f"windowed draft leads by {lead.tolist()} (prefix of {prefix.shape[0]} tokens)"
            )
            excused += int((lead > 0).sum())
    return excused


# ------------------------------------------------------------------------------------------------
# CPU: the torch consumers, float64
# ------------------------------------------------------------------------------------------------
CPU_MODEL = TinyConfig()
CPU_WAVES = [(0, 0, 0), (0,)]  # B: 3 → … → 0 (idle) → 1
CPU_TOKENS, CPU_SPREAD = 6, 2
CPU_CASES = [
    # A chain the target drafts for itself: every draft token accepted, so the window layers'
    # draft decode reads exactly the rail (short prompts: windows not yet full, then full).
    (HybridCase(1, 3, 4, 1, window=6), "self"),
    # A tree over pages of 16 (slot layout B) with a windowed draft.
    (HybridCase(2, 3, 6, 16, window=8, draft_window=6, draft_sink=2), "perturbed"),
    # A windowed chain draft: its chains against the dense windowed draft.
    (HybridCase(1, 3, 4, 16, window=8, draft_window=4, draft_sink=1), "perturbed"),
    # A tree with token pages, no draft window, the shared-prefix cascade in the full layers.
    (HybridCase(2, 2, 5, 1, window=5, form="shared_prefix"), "perturbed"),
    # FA3's builders, a map that pages like the full pool: a chain on token pages the target
    # drafts for itself, its verify ragged (FA3's cascade split at a page boundary); a chain
    # and a tree (slot layout B, the prefix tails copied in the window pool) over pages of 16
    # with a window shorter than a page (the floor inside one).
    (HybridCase(1, 4, 5, 1, window=4, backend="fa3", ragged=True), "self"),
    (HybridCase(1, 3, 4, 16, window=8, backend="fa3"), "perturbed"),
    (HybridCase(2, 3, 6, 16, window=8, backend="fa3"), "perturbed"),
]


def _check_root_logprobs(s: HybridServed) -> None:
    """Each request's last draft extend (or prefill) gave the draft's log-probabilities after
    its whole committed sequence: they equal the dense reference's (the window layers
    windowed), to float64 rounding. Unlike the tokens, this does not depend on an argmax
    moving: every extend row past the first reads through the window layers' own window."""
    for r in s.requests:
        seq = torch.cat([r.prompt, torch.tensor(r.output, dtype=torch.int64)]).to(s.draft.device)
        want = torch.log_softmax(s.draft.logits(seq)[-1].double(), -1)
        got = r.root_logprobs.double().to(want.device)
        err = float((got - want).abs().max())
        assert err < 1e-8, (f"{s.case.id}: request {r.rid}'s draft log-probabilities after "
                            f"{seq.shape[0]} tokens leave the dense windowed draft's by {err}")


@pytest.mark.parametrize("case, draft_kind", CPU_CASES, ids=[f"{c.id}-{d}" for c, d in CPU_CASES])
def test_lossless_hybrid_cpu(case, draft_kind, gen, device):
    s = _serve(case, draft_kind, gen, device, base=CPU_MODEL, dtype=torch.float64,
               new_tokens=CPU_TOKENS, waves=CPU_WAVES, spread=CPU_SPREAD,
               dense_drafts=True)  # fmt: skip
    _check_cpu(s, draft_kind, CPU_TOKENS)
    _check_window_crossed(s)
    _check_root_logprobs(s)
    if case.topk == 1:
        _check_draft_chains(s)


def test_window_pool_map_is_maintained(gen):
    """The map as the loop keeps it: every mapped full slot has a distinct window slot, the
    sink maps to itself, evicted positions map to −1, and a released row's slots all return."""
    from specmeta.testing.window_pool import WindowSlots

    w, size = 4, 40
    slots = WindowSlots(64, size, w, "cpu", gen)
    full = (torch.randperm(63, generator=gen) + 1).tolist()
    a, b = full[:20], full[20:35]
    slots.map(1, a[:10])
    slots.map(2, b)
    slots.map(1, a)  # positions 10 … 19 of row 1 mapped now
    m = slots.full_to_swa
    live = m[torch.tensor(a + b)]
    assert int(m[0]) == 0 and bool((live > 0).all()) and live.unique().numel() == 35
    slots.evict(1, 12)  # committed 12: positions below 12 − 4 + 1 = 9 are read no more
    assert bool((m[torch.tensor(a[:9])] == -1).all()) and bool((m[torch.tensor(a[9:])] > 0).all())
    freed = size - 1 - 35 + 9
    assert len(slots.free) == freed and slots.evicted == 9
    slots.map(3, full[35:45])  # the most recently freed window slots go first
    assert slots.reused == 9
    slots.release(1)
    slots.release(2)
    slots.release(3)
    assert len(slots.free) == size - 1 and int((m >= 0).sum()) == 1
    with pytest.raises(ValueError, match="window pool is out of slots"):
        slots.map(4, full[:size])


def test_window_pool_pages_like_the_full_pool(gen):
    """``page_size = ps``: a full page's slots map to one window page at the same offsets (and
    ``page_map`` names it), window pages are handed out most recently freed first, a page goes
    back only once all its positions are below ``L − w + 1`` while the floor's page has its
    positions below the floor cleared one by one, and slots that are not whole pages are
    refused."""
    from specmeta.testing.window_pool import WindowSlots

    ps, w = 4, 6
    slots = WindowSlots(64, 40, w, "cpu", gen, page_size=ps)
    m, pm = slots.full_to_swa, slots.page_map

    def pages(*full):
        return [f * ps + i for f in full for i in range(ps)]

    slots.map(1, pages(3, 7))
    slots.map(1, pages(3, 7, 2))  # page 2 (positions 8 … 11) mapped now
    slots.map(2, pages(5, 9))
    held = [int(pm[f]) for f in (3, 7, 2, 5, 9)]
    assert len(set(held)) == 5 and min(held) > 0 and int(pm[0]) == 0 and int(m[0]) == 0
    for f in (3, 7, 2, 5, 9):
        assert m[f * ps : f * ps + ps].tolist() == [int(pm[f]) * ps + i for i in range(ps)], f
    slots.evict(1, 10)  # the floor 10 − 6 + 1 = 5: page 3 goes, position 4 of page 7 cleared
    assert int(pm[3]) == -1 and m[12:16].tolist() == [-1] * 4
    assert int(pm[7]) == held[1]
    assert m[28:32].tolist() == [-1, *(held[1] * ps + i for i in (1, 2, 3))]
    assert (slots.evicted, slots.cleared, len(slots.free)) == (1, 1, 40 // ps - 1 - 5 + 1)
    slots.evict(1, 11)  # the floor 6: position 5 cleared, page 7 still held
    assert int(pm[7]) == held[1] and int(m[29]) == -1 and int(m[30]) == held[1] * ps + 2
    assert (slots.evicted, slots.cleared) == (1, 2)
    slots.map(3, pages(11))  # the most recently freed window page first
    assert int(pm[11]) == held[0] and slots.reused == 1
    with pytest.raises(ValueError, match="not whole full pages"):
        slots.map(4, [5, 6, 7, 8])
    for row in (1, 2, 3):
        slots.release(row)
    assert len(slots.free) == 40 // ps - 1
    assert int((m >= 0).sum()) == 1 and int((pm >= 0).sum()) == 1
    with pytest.raises(ValueError, match="divide both pool sizes"):
        WindowSlots(64, 42, w, "cpu", gen, page_size=ps)


# ------------------------------------------------------------------------------------------------
# GPU: FlashInfer's real kernels (FlashAttention's CuTe kernel for the fa3 cases), bf16
# ------------------------------------------------------------------------------------------------
GPU_WAVES = [(0,) * 5 + (2,) * 3, (0, 0, 0)]
GPU_TOKENS = 256
GPU_CASES = [
    HybridCase(1, 5, 6, 1, window=32, mode="eager"),
    HybridCase(1, 3, 4, 16, window=24, mode="graph"),
    HybridCase(1, 4, 5, 16, window=32, draft_window=16, draft_sink=4, mode="auto"),
    HybridCase(2, 4, 8, 16, window=32, mode="auto"),
    HybridCase(2, 3, 6, 1, window=17, draft_window=8, draft_sink=0, mode="graph"),
    HybridCase(4, 3, 10, 16, window=40, draft_window=24, draft_sink=8, form="shared_prefix"),
    HybridCase(4, 5, 12, 1, window=24, form="decode", mode="auto"),
    HybridCase(2, 4, 8, 16, window=64, form="paged", mode="graph"),
    # FA3's builders (FlashAttention's CuTe kernel reads both kinds of layer, its own window in
    # the window layers), the map paging like the full pool.
    HybridCase(1, 5, 6, 1, window=32, mode="eager", backend="fa3"),
    HybridCase(1, 3, 4, 16, window=24, mode="graph", backend="fa3"),
    HybridCase(2, 4, 8, 16, window=32, mode="auto", backend="fa3"),
    HybridCase(2, 3, 6, 1, window=17, mode="graph", backend="fa3"),
    HybridCase(4, 3, 10, 16, window=12, mode="auto", backend="fa3"),
    # Ragged verifies (design §2.9) of the window layers: FA3's cascade, FlashInfer's lists.
    HybridCase(2, 4, 8, 16, window=32, mode="graph", backend="fa3", ragged=True),
    HybridCase(1, 5, 6, 1, window=24, mode="auto", backend="fa3", ragged=True),
    HybridCase(2, 3, 6, 16, window=24, mode="graph", ragged=True),
]


# A windowed draft attends to less than the target, so the target drafting for itself is not
# accepted whole there: those cases run with the perturbed draft only.
GPU_PARAMS = [(c, d) for c in GPU_CASES for d in ("self", "perturbed")
              if d == "perturbed" or not c.draft_window]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("draw", range(3))
@pytest.mark.parametrize("case, draft_kind", GPU_PARAMS, ids=[f"{c.id}-{d}" for c, d in GPU_PARAMS])
def test_lossless_hybrid_gpu(case, draft_kind, draw, seed, request):
    gen = torch.Generator().manual_seed(seed + draw)
    attention = _real_attention(case.backend, GPU_MODEL)
    s = _serve(case, draft_kind, gen, "cuda", base=GPU_MODEL, dtype=torch.bfloat16,
               new_tokens=GPU_TOKENS, waves=GPU_WAVES, spread=8,
               attention=attention)  # fmt: skip
    counts = _check_gpu(s, draft_kind, GPU_TOKENS, DEFAULT_MARGIN)
    _check_window_crossed(s)
    if case.topk == 1:
        counts["near_tie_draft_tokens"] = _check_draft_chains(s, DEFAULT_MARGIN)
    request.node.user_properties.append(("near_ties", counts))
    print(f"{case.id} {draft_kind} draw {draw}: {counts} (margin {DEFAULT_MARGIN})")

