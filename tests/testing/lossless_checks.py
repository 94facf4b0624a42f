"""What the lossless-loop tests of every model check (tests/testing/test_lossless*.py): the
served workload, the CPU tier's exact checks and the GPU tier's margin checks against greedy
decoding of the target, and the real kernels the GPU cases run."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specmeta.testing.spec_loop import Iteration, Request
from specmeta.testing.tiny_model import TinyConfig, TinyModel

PERTURBATION = 0.1  # the draft's weights get noise of 10 % of each matrix's spread


@dataclasses.dataclass
class Served:
    """One served workload and what the checks need."""

    case: Any  # the test module's case: its ``id``, ``steps`` and configuration
    target: TinyModel
    requests: list[Request]
    history: list[Iteration]
    reference_history: list[Iteration]
    pools: tuple[list[torch.Tensor], list[torch.Tensor]] = ((), ())
    """Every K and V buffer of both models' pools after the run: (kernels', references')."""


def _draw(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def _accepted_on_greedy(tree_tokens, tree_parents, continuation) -> int:
    """1 + the number of leading tokens of ``continuation`` that a root-down path of the tree
    spells: what greedy verification must accept when the committed prefix is greedy's."""
    node, depth = 0, 0
    while depth < len(continuation):
        kids = [j for j, p in enumerate(tree_parents) if p == node]
        match = [j for j in kids if tree_tokens[j] == continuation[depth]]
        if not match:
            break
        node, depth = match[0], depth + 1
    return 1 + depth


def _schedule(history: list[Iteration]) -> list[tuple]:
    """Per iteration: the batch size and, per request, its accepted length and draft tree."""
    return [(it.batch_size, tuple((r.rid, r.accepted, r.tree_tokens, r.tree_parents)
                                  for r in it.requests)) for it in history]  # fmt: skip


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _check_acceptance(s: Served, draft_kind: str, continuation_of: dict[int, list[int]],
                      near_tie=None) -> int:  # fmt: skip
    """Accepted lengths: greedy's prefix in the tree, every draft token for a chain drafted by
    the target itself, the same (and the same trees) as the loop on specmeta's references;
    the status word 0.

    ``continuation_of[rid]`` is the request's greedy output (past its end too).
    ``near_tie(rid, position)`` (GPU) excuses a self-speculation rejection at a step whose
    reference lead is within the margin; returns how many were excused."""
    case = s.case
    S = case.steps
    rejected = excused = 0
    for it in s.history:
        assert it.status == 0, (
            f"{case.id} {draft_kind}: iteration {it.index} status 0x{it.status:x}"
        )
        for n in it.requests:
            # Every draft token of the deepest verified path, and the root (a ragged verify's
            # tree is its first verified nodes).
            deepest = min(S, len(n.tree_tokens) - 1) + 1
            g = continuation_of[n.rid][n.start : n.start + S + 1]
            want = _accepted_on_greedy(n.tree_tokens, n.tree_parents, g)
            assert n.accepted == want, (
                f"{case.id} {draft_kind}: iteration {it.index}, request {n.rid} accepted "
                f"{n.accepted}, the tree holds {want - 1} tokens of greedy's {g} (tree tokens "
                f"{n.tree_tokens}, parents {n.tree_parents})"
            )
            if draft_kind == "self" and case.topk == 1 and n.accepted < deepest:
                where = n.start + n.accepted - 1  # the first draft token not accepted
                assert near_tie is not None and near_tie(n.rid, where), (
                    f"{case.id}: the target drafting for itself had {n.accepted - 1} of "
                    f"{deepest - 1} tokens accepted at iteration {it.index}"
                )
                excused += 1
            rejected += n.accepted < deepest
    if draft_kind == "perturbed":
        assert rejected, "the perturbed draft was never rejected: the test lost its point"
    got, want = _schedule(s.history), _schedule(s.reference_history)
    first = _first_difference(got, want)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    assert first is None, (
        f"{case.id} {draft_kind}: acceptance or draft trees differ from the loop on specmeta's "
        f"references at iteration {first}: {got[first : first + 1]} vs {want[first : first + 1]}"
    )
    return excused


def _check_cpu(s: Served, draft_kind: str, new_tokens: int) -> None:
    """Exact: float64 on both sides, no tolerance anywhere."""
    case = s.case
    ps = case.page_size
    greedy = {}
    for r in s.requests:
        assert len(r.output) >= max(new_tokens, r.max_new_tokens), f"request {r.rid} stopped early"
        # S + 1 tokens past the output: the continuation the last iteration's tree is checked on.
        want = s.target.greedy(r.prompt, len(r.output) + case.steps + 1)[0].tolist()
        first = _first_difference(r.output, want)
        assert first is None, (
            f"{case.id} {draft_kind}: request {r.rid} (prompt {r.prompt.shape[0]}) leaves greedy "
            f"decoding at token {first}: {r.output[first : first + 8]} vs "
            f"{want[first : first + 8]}"
        )
        greedy[r.rid] = want
    _check_acceptance(s, draft_kind, greedy)
    # Same slots, same metadata, float64 on both sides: every K and V buffer of both pools ends
    # bit-identical. A KV move that skips V, say, changes no argmax here but changes the pools.
    for i, (mine, ref) in enumerate(zip(*s.pools, strict=True)):
        assert torch.equal(mine, ref), (
            f"{case.id} {draft_kind}: KV buffer {i} differs from the same loop on the references"
        )
    # The workload covered what it was drawn for: the batch grew, drained to an idle iteration
    # and refilled; target (L) and draft (L + 1) prefixes sat on page boundaries and one short.
    sizes = [it.batch_size for it in s.history]
    assert 0 in sizes and sizes[-1] > 0 and max(sizes) > 2, sizes
    prompt = {r.rid: r.prompt.shape[0] for r in s.requests}
    lengths = {prompt[n.rid] + n.start - 1 for it in s.history for n in it.requests}
    for residue in (0, ps - 1):
        assert any(L % ps == residue for L in lengths), (residue, sorted(lengths))
        assert any((L + 1) % ps == residue for L in lengths), (residue, sorted(lengths))
    if case.mode == "auto":
        assert {it.path for it in s.history} == {"eager", "graph"}


GPU_MODEL = TinyConfig(hidden_size=256, head_dim=128, intermediate_size=512)


def _real_attention(backend: str, model_cfg: TinyConfig):
    """The real kernels; importing them must succeed on the GPU machine (no silent skip)."""
    from specmeta.testing.attention import (
        CuteFlashAttention,
        FlashInferAttention,
        FlashInferMLAKernel,
    )

    if backend == "fa3":
        return CuteFlashAttention()
    if backend == "flashinfer_mla":  # an MLA model's latent pool
        return FlashInferMLAKernel(model_cfg.num_heads, model_cfg.ckv_dim, model_cfg.kpe_dim,
                                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    return FlashInferAttention(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim,
                               dtype=torch.bfloat16, device="cuda")  # fmt: skip


def _check_gpu(s: Served, draft_kind: str, new_tokens: int, margin: float) -> dict[str, int]:
    """Against the float32 reference (the same bf16-rounded weights, float32 arithmetic, dense
    attention): every emitted token must be the reference's argmax given the request's own
    output before it, unless the reference leads the emitted token by less than ``margin``
    (a near-tie: counted). By induction, with no near-tie that is greedy decoding exactly."""
    reference = s.target.to(dtype=torch.float32)
    counts = {"tokens": 0, "low_margin_steps": 0, "near_tie_tokens": 0, "near_tie_rejections": 0}
    margins, outputs = {}, {}
    for r in s.requests:
        assert len(r.output) >= new_tokens, f"request {r.rid} stopped early"
        P = r.prompt.shape[0]
        seq = torch.cat([r.prompt, torch.tensor(r.output)]).to(reference.device)
        logits = reference.logits(seq)[P - 1 : P - 1 + len(r.output)].double().cpu()
        top2 = logits.topk(2, -1).values
        lead = top2[:, 0] - logits.gather(1, torch.tensor(r.output).view(-1, 1))[:, 0]
        decisive = (lead > 0) & (lead >= margin)
        assert not bool(decisive.any()), (
            f"{s.case.id} {draft_kind}: request {r.rid} emitted tokens the float32 reference "
            f"trails by {margin} or more, at {decisive.nonzero().flatten().tolist()}"
        )
        margins[r.rid] = top2[:, 0] - top2[:, 1]
        counts["tokens"] += len(r.output)
        counts["low_margin_steps"] += int((margins[r.rid] < margin).sum())
        counts["near_tie_tokens"] += int((lead > 0).sum())
        outputs[r.rid] = r.output + [-1] * (s.case.steps + 1)

    def near_tie(rid: int, position: int) -> bool:
        return position < len(margins[rid]) and float(margins[rid][position]) < margin

    # The certified output is the continuation each tree is checked against.
    counts["near_tie_rejections"] = _check_acceptance(s, draft_kind, outputs, near_tie)
    return counts


def bf16_argmax_flips(model_cfg: TinyConfig, gen: torch.Generator, models: int,
                      tokens: int) -> tuple[list[float], int]:  # fmt: skip
    """Where bf16 arithmetic moves the argmax: ``models`` random models of ``model_cfg`` in
    bf16 (dense attention, on the CPU) against float32 on the same weights, teacher-forced on
    the float32 greedy output of ``tokens`` steps from a random prompt. Returns the float32
    lead over the bf16 argmax at every step where they differ, and the steps taken."""
    flips, steps = [], 0
    for _ in range(models):
        model = TinyModel.random(model_cfg, _draw(gen), dtype=torch.bfloat16)
        reference = model.to(dtype=torch.float32)
        prompt = torch.randint(0, model_cfg.vocab_size, (1 + _draw(gen) % 32,), generator=gen)
        out, _ = reference.greedy(prompt, tokens)
        seq, P = torch.cat([prompt, out]), prompt.shape[0]
        want = reference.logits(seq)[P - 1 : -1].double()
        got = model.logits(seq)[P - 1 : -1].double()
        emitted = got.argmax(-1, keepdim=True)
        lead = want.max(-1).values - want.gather(1, emitted)[:, 0]  # 0 where bf16 agrees
        flips += lead[lead > 0].tolist()
        steps += out.shape[0]
    return flips, steps
