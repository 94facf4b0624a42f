"""A synthetic EAGLE tree-draft loop with no model, built by specmeta eagerly and through runners.

Each iteration of a batch of requests:

1. **Draft decode.** A draft runner builds the draft KV slots (:func:`assign_draft_cache_locs`),
   the layout-B prefix-tail copy pairs and their KV move (:func:`move_kv_cache`), FlashInfer's
   draft-decode metadata in its three forms (page-size-1 lists, shared-prefix cascade,
   per-branch pages; :class:`FlashInferBuilder`) and FA3's cascade
   (:class:`FA3MetadataBuilder`), every step, all in one captured graph. Then ``S`` selection
   steps: random draft probabilities, top-``K`` per branch and top-``K`` of the ``K²``
   candidates per request (EAGLE's tree selection), the chosen tokens' KV written to their
   slots; each of the ``S − 1`` forwards is attended by every draft consumer, through its
   metadata.
2. **Verify.** A random draft tree of ``N`` nodes (:func:`random_tree_mask`), its window at row
   positions ``L … L + N − 1``, the nodes' KV written there; a verify runner builds FlashInfer's
   target-verify lists and tree mask and FA3's (the tree cascade when ``K > 1``), and every
   verify consumer attends.
3. **Accept.** A random root path of the tree is accepted; an accept runner compacts it into
   ``(tgt, src)`` pairs (:func:`accept_cache_locs`) and moves the accepted KV to the front of
   the window (:func:`move_kv_cache`), in one graph. The committed prefix grows by the path.

The "model" is a table: the KV of token ``x`` at position ``p`` in layer ``l`` is
``emb[l, x] + pos[l, p]``, so a test can rebuild every request's logical KV sequence and compare
attention over the metadata with dense attention over that sequence.

Each stage is one function ``inputs -> Stage`` (:class:`Metadata`): it binds the stage's work
(``bind_<op>`` of the launchers, ``bind_<mode>`` of the builders) to the tensors it is given and
returns a :class:`~specmeta.Stage`, whose ``launch()`` makes the launches and whose
``host(seq_lens_cpu)`` returns what the consumers read for that batch. The same function is
used three ways: bound once per batch size to an engine's persistent input tensors, then
launched and asked for its host part every iteration (:class:`BoundStages`: how the eager twin
the runners are compared with runs), called at once on a raw batch
(``meta.draft(inputs)(seq_lens_cpu)``, the eager call: ``DraftLoop(..., bind_once=False)``),
and bound by a :class:`~specmeta.runners.GraphRunner` to its static views (captured once per
bucket), so the runners return the builders' own results for ``B``. Another
backend (TRT-LLM MLA) slots in the same way: a builder in :class:`Metadata` and its result under
a consumer name in the stage's host part.

Run it: ``python examples/draft_loop.py [--device cuda] [--seed N]`` (on the CPU the kernels run
in Triton's interpreter, switched on below before Triton is imported).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
from collections.abc import Mapping

import torch

from specmeta.testing.script_device import parse_device  # noqa: E402

if __name__ == "__main__":
    parse_device(__file__)  # before the imports below: they import Triton

import specmeta  # noqa: E402
from specmeta import SpecConfig, Stage, allocate_buffers, probes  # noqa: E402
from specmeta.kernels.cache_loc_move import (  # noqa: E402
    KVPool,
    accept_cache_locs_ref,
    bind_accept_cache_locs,
    bind_move_kv_cache,
    move_kv_cache_ref,
)
from specmeta.kernels.draft_cache_locs import (  # noqa: E402
    assign_draft_cache_locs_ref,
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from specmeta.metadata.fa3 import FA3MetadataBuilder  # noqa: E402
from specmeta.metadata.flashinfer import FlashInferBuilder  # noqa: E402
from specmeta.runners import GraphRunner, padding  # noqa: E402
from specmeta.workloads import make_batch, random_tree_mask  # noqa: E402

__all__ = [
    "LoopShape",
    "Model",
    "Metadata",
    "BoundStages",
    "build_runners",
    "Request",
    "DraftLoop",
    "next_requests",
    "sequence",
]

SEQUENCE = (32, 12, 3, 1, 0, 32)
_DRAFT_CONSUMERS = ("flashinfer", "flashinfer_cascade", "flashinfer_paged", "fa3")
"""The issue's batch sizes: shrink to an idle rank (0), then a full batch of new requests."""


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """The synthetic model's sizes."""

    heads: int = 2
    head_dim: int = 8
    layers: int = 2
    vocab: int = 50
    iterations: int = len(SEQUENCE)


class Model:
    """KV pool (K and V of every layer, ``[P, H, D]`` float32) and the table the KV comes from."""

    def __init__(self, shape: LoopShape, pool_size: int, max_pos: int, device, gen):
        def rand(*size):
            return torch.randn(*size, generator=gen).to(device)

        L, H, D = shape.layers, shape.heads, shape.head_dim
        self.shape = shape
        self.emb_k, self.emb_v = rand(L, shape.vocab, H, D), rand(L, shape.vocab, H, D)
        self.pos_k, self.pos_v = rand(L, max_pos, H, D), rand(L, max_pos, H, D)
        self.k = [torch.zeros(pool_size, H, D, device=device) for _ in range(L)]
        self.v = [torch.zeros(pool_size, H, D, device=device) for _ in range(L)]
        self.pool = KVPool([*self.k, *self.v])  # one move_kv_cache launch for every layer

    def kv(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Per layer ``(k, v)`` of ``tokens`` at ``positions`` (same shape) → ``[*, H, D]``."""
        t, p = tokens.long(), positions.long()
        return [(self.emb_k[i][t] + self.pos_k[i][p], self.emb_v[i][t] + self.pos_v[i][p])
                for i in range(self.shape.layers)]  # fmt: skip

    def write(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the KV of ``tokens`` at ``positions`` into pool ``slots`` (the forward's write)."""
        for layer, (k, v) in enumerate(self.kv(tokens, positions)):
            self.k[layer][slots.reshape(-1)] = k.reshape(-1, *k.shape[-2:])
            self.v[layer][slots.reshape(-1)] = v.reshape(-1, *v.shape[-2:])


# The launchers a stage binds: their bound launches, or (a reference build) the pure-torch
# references called as launches.
_BINDS = {
    "assign_draft_cache_locs": (bind_assign_draft_cache_locs, assign_draft_cache_locs_ref),
    "prefix_tail_copy_pairs": (bind_prefix_tail_copy_pairs, prefix_tail_copy_pairs_ref),
    "accept_cache_locs": (bind_accept_cache_locs, accept_cache_locs_ref),
    "move_kv_cache": (bind_move_kv_cache, move_kv_cache_ref),
}


class Metadata:
    """Every planned buffer of one iteration and the stages that fill them (design §4).

    Each stage is a function ``inputs -> Stage`` of the batch's input tensors (a runner's static
    views, an engine's persistent tensors, or a raw batch): it binds the stage's launches to
    them, and the stage's host part returns, for that batch, what each consumer reads — the
    builders' own results (their host side from ``seq_lens_cpu``), and the free launchers'
    outputs cut to the batch. With a ``kv_pool`` the stages also move KV (the layout-B prefix
    tails, the accepted nodes) inside the same launch sequence, so a graph holds the whole
    stage. ``reference=True`` binds the pure-torch references of specmeta's ops as the launches
    and builds with the builders' references (they may sync): the baseline the runners' kernels
    are compared with.
    """

    def __init__(self, cfg: SpecConfig, device, req_to_token: torch.Tensor,
                 kv_pool: KVPool | None = None, reference: bool = False):  # fmt: skip
        self.cfg, self.reference = cfg, reference
        plan = specmeta.plan_buffers(cfg)
        # The backend builders allocate their own planned buffers; the rest are ours.
        self.fa3 = FA3MetadataBuilder(cfg, device, reference=reference)
        self.fi = FlashInferBuilder(cfg, device, reference=reference)
        ours = [n for n in plan if n.split(".")[0] not in ("fa3", "flashinfer", "trtllm_mla")]
        self.bufs = {
            **allocate_buffers(cfg, device, ours),
            **{"fa3." + name: t for name, t in self.fa3.buffers.items()},
            **{"flashinfer." + name: t for name, t in self.fi.buffers.items()},
        }
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool

    @property
    def status(self) -> torch.Tensor:
        return self.bufs["status"]

    def _bind(self, op: str, *args, **kwargs) -> Stage:
        """``bind_<op>(*args, **kwargs)``, or the reference called as a launch."""
        bind, reference = _BINDS[op]
        if self.reference:
            return Stage([functools.partial(reference, *args, **kwargs)])
        return bind(*args, **kwargs)

    def draft(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Draft slots, prefix-tail copies and every backend's draft-decode metadata."""
        c, b = self.cfg, self.bufs
        rpi, seq_lens = inputs["req_pool_indices"], inputs["seq_lens"]
        B, K, S = rpi.shape[0], c.topk, c.num_steps
        pairs = (K - 1) * (c.page_size - 1) if c.layout_b else 0
        args = (rpi, self.req_to_token, seq_lens)
        st = dict(status=b["status"])
        kw = dict(topk=K, num_steps=S, page_size=c.page_size, **st)
        tgt, src = b["draft.prefix_tail_tgt"], b["draft.prefix_tail_src"]
        launches = [
            self._bind("assign_draft_cache_locs", *args, out_cache_loc=b["draft.out_cache_loc"],
                       positions=b["draft.positions"], **kw),
            self._bind("prefix_tail_copy_pairs", *args, tgt=tgt, src=src, **kw),
        ]  # fmt: skip
        if self.kv_pool is not None and c.layout_b:
            # Each prefix tail into branches 1 … K−1, before any page-granular reader (the
            # FA3 expand pass, FlashInfer's per-branch pages); unused pairs are (0, 0)
            # self-moves of the sink. Targets sit past L, sources before it: disjoint.
            n = pairs * B
            launches.append(self._bind("move_kv_cache", self.kv_pool, tgt[:n], src[:n],
                                       disjoint=True, **st))  # fmt: skip
        slots = b["draft.out_cache_loc"][: B * K * S]
        # Every step row is built (the engine reads S − 1 of them), as in the plan.
        rows = dict(num_rows=S, **st)
        modes = {
            "flashinfer": self.fi.bind_draft_decode(*args, **rows),
            "flashinfer_cascade": self.fi.bind_draft_decode_shared_prefix(*args, **rows),
            "flashinfer_paged": self.fi.bind_draft_decode_paged(*args, **rows),
            "fa3": self.fa3.bind_draft_decode(*args, slots, **rows),
        }
        views = {
            "out_cache_loc": slots,
            "positions": b["draft.positions"][: B * K],
            "prefix_tail_tgt": tgt[: B * pairs],
            "prefix_tail_src": src[: B * pairs],
        }
        return _stage(launches, views, modes)

    def verify(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Target-verify metadata over each request's ``N``-token window."""
        args = (inputs["req_pool_indices"], self.req_to_token, inputs["seq_lens"],
                inputs["tree_mask"])  # fmt: skip
        st = dict(status=self.bufs["status"])
        modes = {"flashinfer": self.fi.bind_target_verify(*args, **st),
                 "fa3": self.fa3.bind_target_verify(*args, **st)}  # fmt: skip
        return _stage([], {}, modes)

    def accept(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Move pairs of the accepted nodes (design §2.4) and, with a pool, their move: free
        launchers only, no host part."""
        b = self.bufs
        n = inputs["accept_lens"].shape[0] * (self.cfg.num_steps + 1)
        tgt, src = b["verify.tgt_cache_loc"][:n], b["verify.src_cache_loc"][:n]
        launches = [self._bind("accept_cache_locs", inputs["accept_index"], inputs["accept_lens"],
                               inputs["verify_out_cache_loc"],
                               num_draft_tokens=self.cfg.num_draft_tokens,
                               tgt=b["verify.tgt_cache_loc"], src=b["verify.src_cache_loc"],
                               status=b["status"])]  # fmt: skip
        if self.kv_pool is not None:
            # The accepted KV to the front of each verify window (pairs may chain: the move
            # reads every source before it writes a target).
            launches.append(self._bind("move_kv_cache", self.kv_pool, tgt, src,
                                       status=b["status"]))  # fmt: skip
        return Stage(launches, result={"tgt": tgt, "src": src})


def _stage(launches: list, views: dict, modes: dict[str, Stage]) -> Stage:
    """A stage of ``launches`` and every builder mode of ``modes`` (bound stages), whose host
    part returns ``views`` and each mode's result under its consumer's name."""

    def host(seq_lens_cpu: torch.Tensor | None) -> dict:
        return {**views, **{name: mode.host(seq_lens_cpu) for name, mode in modes.items()}}

    return Stage([*launches, *modes.values()], host=host)


class BoundStages:
    """An engine's path without graphs: each stage bound once per batch size to the engine's
    persistent input tensors, then, every iteration, the batch written into them, the host part
    run (``stage.host(seq_lens_cpu)``) and the bound launches made (``stage.launch()``).

    The persistent tensors are ``meta``'s ``runner.*`` planned buffers (``[:B·per_request]``
    of each); binding checks every tensor and looks every kernel up once, so an iteration costs
    the copies, the launches and the host part only.
    """

    def __init__(self, meta: Metadata):
        self.meta = meta
        self._bound: dict[tuple[str, int], tuple[dict, Stage]] = {}

    def __call__(self, stage: str, batch_size: int, inputs: Mapping[str, torch.Tensor],
                 seq_lens_cpu: torch.Tensor | None = None):  # fmt: skip
        entry = self._bound.get((stage, batch_size))
        if entry is None:  # the first iteration of this batch size: bind
            views = {name: self.meta.bufs[f"runner.{name}"][: t.shape[0]]
                     for name, t in inputs.items()}  # fmt: skip
            entry = self._bound[(stage, batch_size)] = (views, getattr(self.meta, stage)(views))
        views, bound = entry
        for name, t in inputs.items():
            views[name].copy_(t)
        result = bound.host(seq_lens_cpu)
        bound.launch()
        return result


def build_runners(meta: Metadata, buckets, device, *, pool_size: int) -> dict[str, GraphRunner]:
    """The three runners of an iteration over ``meta``'s stages, captured.

    Every static input is registered with its design §4 pad and a probe of its range (run when
    :mod:`specmeta.probes` are enabled); ``seq_lens`` keeps a CPU mirror for the builders' host
    checks and FlashInfer's ``plan()`` mirrors. Each run returns its stage's results for ``B``.
    """
    c, b = meta.cfg, meta.bufs
    rows = meta.req_to_token.shape[0]
    fill = padding.seq_lens_fill(c.topk, c.num_draft_tokens)
    rows_probe = functools.partial(probes.detect_oob, lo=1, hi=rows)  # row 0 is reserved
    lens_probe = functools.partial(probes.detect_oob, lo=0, hi=c.max_context_len + 1)
    runners = {
        stage: GraphRunner(getattr(meta, stage), batch_sizes=buckets, device=device)
        for stage in ("draft", "verify", "accept")
    }
    for stage in ("draft", "verify"):
        r = runners[stage]
        r.add_input("req_pool_indices", b["runner.req_pool_indices"], pad=padding.SINK_ROW,
                    probe=rows_probe)  # fmt: skip
        r.add_input("seq_lens", b["runner.seq_lens"], pad=fill, host_mirror=True,
                    probe=lens_probe)  # fmt: skip
    runners["verify"].add_input("tree_mask", b["runner.tree_mask"], pad=padding.TREE_MASK)
    accept = runners["accept"]
    window = c.max_bs * c.num_draft_tokens
    accept.add_input("accept_index", b["runner.accept_index"], pad=padding.NO_ACCEPT,
                     probe=functools.partial(probes.detect_oob, lo=-1, hi=window))  # fmt: skip
    accept.add_input("accept_lens", b["runner.accept_lens"], pad=padding.NOTHING_ACCEPTED,
                     probe=functools.partial(probes.detect_oob, lo=0, hi=c.num_steps + 2))  # fmt: skip
    accept.add_input("verify_out_cache_loc", b["runner.verify_out_cache_loc"],
                     pad=padding.SINK_SLOT, per_request=c.num_draft_tokens,
                     probe=functools.partial(probes.detect_oob, lo=0, hi=pool_size))  # fmt: skip
    for r in runners.values():
        r.add_guard("req_to_token", meta.req_to_token)
        if meta.kv_pool is not None:
            for i, buf in enumerate(meta.kv_pool.buffers):
                r.add_guard(f"KV buffer {i}", buf)
        r.capture()
    return runners


@dataclasses.dataclass
class Request:
    """One request's row and its logical KV sequence (per layer, ``[L, H, D]``)."""

    row: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[0])


@dataclasses.dataclass
class DraftResult:
    seq_lens: list[int]  # L_b at draft time (the committed prefix the branches attend to)
    out_cache_loc: torch.Tensor  # [B, K, S]
    tokens: torch.Tensor  # [B, K, S] chosen draft tokens
    padded_batch_size: int  # Bp: the bucket the runner replayed
    queries: list[torch.Tensor]  # per forward step s < S-1: [B*K, H, D]
    attention: dict[str, list[torch.Tensor]]  # per consumer, per forward step: [B*K, H, D]
    eager: dict[str, object]  # the eager stage's results on the raw batch
    runner: dict[str, object]  # the runner's results for B (what the consumers read)


@dataclasses.dataclass
class VerifyResult:
    seq_lens: list[int]
    tree_mask: torch.Tensor  # [B, N, N]
    tokens: torch.Tensor  # [B, N]
    window: torch.Tensor  # [B*N] verify-window slots
    depth: torch.Tensor  # [B, N]
    padded_batch_size: int
    queries: torch.Tensor  # [B*N, H, D], one row per tree node
    attention: dict[str, torch.Tensor]  # per consumer: [B*N, H, D]
    eager: dict[str, object]
    runner: dict[str, object]


@dataclasses.dataclass
class AcceptResult:
    accept_index: torch.Tensor  # [B, S+1]
    accept_lens: torch.Tensor  # [B]
    paths: list[list[int]]
    eager: dict[str, torch.Tensor]
    runner: dict[str, torch.Tensor]  # move pairs, cut to B·(S + 1)


class DraftLoop:
    """The loop's state: config, model, static tables, metadata (runner and eager) and runners.

    Parameters
    ----------
    cfg : SpecConfig
        ``max_bs`` is the largest bucket; ``max_context_len`` bounds every request, growth by
        accepted tokens included.
    buckets : sequence of int
        The runners' captured batch sizes.
    consumers : mapping of str to callable
        The attention consumers, ``fn(q [T, H, D], k_cache, v_cache, meta) → [T, H, D]``, run
        on layer 0's cache right after a forward's KV is written, for the whole padded batch
        (as the attention inside a graph would: padded rows read the sink), keyed
        ``"<stage>.<name>"``. Draft decode (``meta`` per step): ``draft.flashinfer``
        (``FlashInferDecodeStep``, page-size-1 lists), ``draft.flashinfer_cascade``
        (``FlashInferCascadeStep``), ``draft.flashinfer_paged`` (``FlashInferDecodeStep`` of
        per-branch pages), ``draft.fa3`` (``FA3Cascade``). Target verify: ``verify.flashinfer``
        (``FlashInferPrefill`` with the tree mask), ``verify.fa3`` (``FA3Cascade``).
    poison : callable, optional
        ``poison(stage, runner, metadata, B, Bp)``, called before every runner call (tests
        fill the padding tails and the stage's outputs with garbage there).
    bind_once : bool
        How the eager twin runs its stages: bound once per batch size to its persistent inputs
        (:class:`BoundStages`, the default), or the eager call, bound to the raw batch and
        called at once on every iteration.
    """

    def __init__(self, cfg: SpecConfig, shape: LoopShape, buckets, device, gen, consumers,
                 poison=None, num_rows: int | None = None, bind_once: bool = True):  # fmt: skip
        self.cfg, self.shape, self.device, self.gen = cfg, shape, torch.device(device), gen
        self.consumers, self.poison = dict(consumers), poison
        self.num_rows = num_rows or cfg.max_bs + 3
        first = self._draw_batch(cfg.max_bs)
        self.req_to_token = first.req_to_token.clone()  # persistent: the graphs read it
        self.pool_size = first.pool_size
        self.model = Model(shape, self.pool_size, cfg.req_to_token_width, device, gen)
        # Written by the runners, whose graphs also move the KV; the eager twin only builds.
        self.meta = Metadata(cfg, device, self.req_to_token, self.model.pool)
        # The eager twin, with the library's references: its stages bound once per batch size
        # to its own persistent inputs.
        self.eager = Metadata(cfg, device, self.req_to_token, reference=True)
        self.bound = BoundStages(self.eager) if bind_once else None
        self.fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
        self.runners = build_runners(self.meta, buckets, self.device, pool_size=self.pool_size)
        self._first = first

    # ----------------------------------------------------------------------------------------
    # Set-up
    # ----------------------------------------------------------------------------------------
    def _draw_batch(self, B: int):
        c = self.cfg
        # Leave room for every iteration's accepted tokens (at most S + 1 each).
        room = c.max_context_len - self.shape.iterations * (c.num_steps + 1)
        return make_batch("random", batch_size=B, topk=c.topk, num_steps=c.num_steps,
                          page_size=c.page_size, row_width=c.req_to_token_width,
                          generator=self.gen, device=self.device, num_rows=self.num_rows,
                          max_len=max(room, 0))  # fmt: skip

    def new_requests(self, B: int) -> list[Request]:
        """``B`` new requests on fresh rows: a new table, their prefixes' KV written."""
        batch = self._first if self._first is not None else self._draw_batch(B)
        self._first = None
        batch_rows = batch.req_pool_indices.tolist()[:B]
        self.req_to_token.copy_(batch.req_to_token)
        reqs = []
        for row, length in zip(batch_rows, batch.seq_lens_cpu.tolist()[:B], strict=True):
            tokens = torch.randint(0, self.shape.vocab, (length,), generator=self.gen)
            pos = torch.arange(length)
            kv = self.model.kv(tokens.to(self.device), pos.to(self.device))
            self.model.write(self.req_to_token[row, :length].long(), tokens.to(self.device),
                             pos.to(self.device))  # fmt: skip
            reqs.append(Request(row, [k for k, _ in kv], [v for _, v in kv]))
        return reqs

    # ----------------------------------------------------------------------------------------
    # Stages
    # ----------------------------------------------------------------------------------------
    def _run(self, name: str, B: int, inputs, host_inputs=None):
        runner = self.runners[name]
        if self.poison is not None:
            self.poison(name, runner, self.meta, B, runner.bucket(B))
        res = runner.run(B, inputs, host_inputs=host_inputs)
        lens_cpu = (host_inputs or {}).get("seq_lens")
        if self.bound is not None:  # bound once per batch size: the host part, then launch
            eager = self.bound(name, B, inputs, lens_cpu)
        else:  # the eager call: bound to this batch's tensors and called at once
            eager = getattr(self.eager, name)(inputs)(lens_cpu)
        return res, eager

    def _attend(self, stage: str, q, metas: dict) -> dict[str, torch.Tensor]:
        """Every consumer of ``stage``, on layer 0's cache."""
        k, v = self.model.k[0], self.model.v[0]
        out = {}
        for key, fn in self.consumers.items():
            where, name = key.split(".", 1)
            if where == stage:
                out[name] = fn(q, k, v, metas[name])
        return out

    def _batch_inputs(self, reqs):
        rpi = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        seq_lens = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        return rpi, seq_lens

    def _queries(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.shape.heads, self.shape.head_dim, generator=self.gen).to(
            self.device
        )

    def draft(self, reqs: list[Request]) -> DraftResult:
        c, dev, g = self.cfg, self.device, self.gen
        B, K, S, V = len(reqs), c.topk, c.num_steps, self.shape.vocab
        rpi, seq_lens = self._batch_inputs(reqs)
        inputs = {"req_pool_indices": rpi.to(dev), "seq_lens": seq_lens.to(dev)}
        res, eager = self._run("draft", B, inputs, {"seq_lens": seq_lens})
        out, bp = res.results, res.padded_batch_size
        slots = out["out_cache_loc"].view(B, K, S)
        first_pos = out["positions"].view(B, K)
        # Selection: top-K of the root, then top-K of the K² children of the K branches.
        probs = torch.softmax(torch.randn(B, V, generator=g), -1).to(dev)
        probes.detect_nan(probs, label="draft probs")
        score, tok = probs.topk(K, dim=-1)
        tokens = torch.zeros(B, K, S, dtype=torch.int64, device=dev)
        queries, attention = [], {}
        for j in range(S):
            probes.detect_oob(tok, 0, V, label="draft token ids")
            tokens[:, :, j] = tok
            self.model.write(slots[:, :, j], tok, first_pos + j)
            if j == S - 1:
                break
            # The forward of step j: every branch attends to its prefix and chain 0 … j.
            q = self._queries(B * K)
            queries.append(q)
            step = {name: out[name][j] for name in _DRAFT_CONSUMERS}
            for name, o in self._attend("draft", q, step).items():
                attention.setdefault(name, []).append(o)
            child = torch.softmax(torch.randn(B, K, V, generator=g), -1).to(dev)
            probes.detect_nan(child, label="draft probs")
            p, t = child.topk(K, dim=-1)  # [B, K, K]
            cand = (score.unsqueeze(-1) * p).view(B, K * K)
            score, pick = cand.topk(K, dim=-1)
            tok = t.view(B, K * K).gather(1, pick)
        return DraftResult(seq_lens.tolist(), slots, tokens, bp, queries, attention, eager, out)

    def verify(self, reqs: list[Request]) -> VerifyResult:
        c, dev = self.cfg, self.device
        B, N = len(reqs), c.num_draft_tokens
        mask = random_tree_mask(B, c.topk, c.num_steps, N, self.gen).to(dev)
        depth = mask.sum(-1) - 1
        rpi, seq_lens = self._batch_inputs(reqs)
        lengths, rows = seq_lens.to(dev), rpi.to(dev)
        pos = lengths.view(-1, 1) + torch.arange(N, device=dev)  # the window: row positions L + j
        window = self.req_to_token[rows.view(-1, 1), pos].long().reshape(-1)
        tokens = torch.randint(0, self.shape.vocab, (B, N), generator=self.gen).to(dev)
        self.model.write(window, tokens, lengths.view(-1, 1) + depth)
        inputs = {"req_pool_indices": rows, "seq_lens": lengths, "tree_mask": mask}
        res, eager = self._run("verify", B, inputs, {"seq_lens": seq_lens})
        q = self._queries(B * N)  # one row per tree node
        attention = self._attend("verify", q, res.results)
        return VerifyResult(seq_lens.tolist(), mask, tokens, window, depth,
                            res.padded_batch_size, q, attention, eager, res.results)  # fmt: skip

    def accept(self, reqs: list[Request], ver: VerifyResult) -> AcceptResult:
        c, dev = self.cfg, self.device
        B, N, C = len(reqs), c.num_draft_tokens, c.num_steps + 1
        mask = ver.tree_mask.cpu()
        depth = ver.depth.cpu()
        rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        paths = []
        index = torch.full((B, C), -1, dtype=torch.int32)
        for i in range(B):
            path = [0]
            while True:
                here = path[-1]
                kids = [
                    j for j in range(N) if mask[i, j, here] and depth[i, j] == depth[i, here] + 1
                ]
                if not kids or rng.random() < 0.3:
                    break
                path.append(rng.choice(kids))
            paths.append(path)
            index[i, : len(path)] = torch.tensor(path, dtype=torch.int32) + i * N
        lens = torch.tensor([len(p) for p in paths], dtype=torch.int32)
        inputs = {"accept_index": index.to(dev), "accept_lens": lens.to(dev),
                  "verify_out_cache_loc": ver.window}  # fmt: skip
        res, eager = self._run("accept", B, inputs)  # the runner's build moved the KV
        # Commit: the accepted nodes' KV now sits at positions L … L + acc − 1.
        for i, (r, path) in enumerate(zip(reqs, paths, strict=True)):
            node = torch.tensor(path, device=dev)
            kv = self.model.kv(ver.tokens[i, node], r.length + depth[i, path].to(dev))
            r.keys = [torch.cat([k0, k]) for k0, (k, _) in zip(r.keys, kv, strict=True)]
            r.values = [torch.cat([v0, v]) for v0, (_, v) in zip(r.values, kv, strict=True)]
        return AcceptResult(index, lens, paths, eager, res.results)


def next_requests(loop: DraftLoop, reqs: list[Request], B: int) -> list[Request]:
    """The batch of the next iteration: the first ``B`` requests go on (the others finished);
    after an idle iteration a full batch of new requests arrives."""
    if B == 0:
        return []
    return reqs[:B] if B <= len(reqs) else loop.new_requests(B)


def sequence(loop: DraftLoop, sizes=SEQUENCE):
    """Yield ``(reqs, draft, verify, accept)`` per iteration over the batch ``sizes``."""
    reqs: list[Request] = []
    for B in sizes:
        reqs = next_requests(loop, reqs, B)
        d = loop.draft(reqs)
        v = loop.verify(reqs)
        a = loop.accept(reqs, v)
        yield reqs, d, v, a


# --------------------------------------------------------------------------------------------
# The script
# --------------------------------------------------------------------------------------------
def _attention(q, k, v, lists):
    """Plain softmax attention of row ``i`` of ``q`` over rows ``lists[i]`` of ``k``/``v``."""
    out = []
    for i, idx in enumerate(lists):
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k[idx].double()) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v[idx].double()))
    return torch.stack(out) if out else q.new_zeros(0, *q.shape[1:]).double()


def csr_attention(q, k_cache, v_cache, step):
    """A page-size-1 paged consumer: row ``i`` reads ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]``
    of a FlashInfer draft-decode step."""
    ptr, idx = step.kv_indptr.long().tolist(), step.kv_indices.long()
    return _attention(q, k_cache, v_cache, [idx[ptr[i] : ptr[i + 1]] for i in range(q.shape[0])])


def main(argv=None) -> int:
    device = parse_device(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(device))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=4, page_size=4, max_bs=32,
                     max_context_len=40)  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    loop = DraftLoop(cfg, LoopShape(), (1, 4, 16, 32), device, gen,
                     {"draft.flashinfer": csr_attention})  # fmt: skip
    K = cfg.topk
    for reqs, d, _, a in sequence(loop):
        B = len(reqs)
        worst = 0.0
        for s, (q, got) in enumerate(zip(d.queries, d.attention["flashinfer"], strict=True)):
            q, got = q[: B * K], got[: B * K]  # the real requests' rows
            # Dense truth: the logical prefix plus the branch's own chain, from the table.
            want = []
            for z in range(B * K):
                b, t = divmod(z, K)
                L = d.seq_lens[b]
                pos = L + torch.arange(s + 1, device=loop.device)
                chain_k, chain_v = loop.model.kv(d.tokens[b, t, : s + 1], pos)[0]
                keys = torch.cat([reqs[b].keys[0][:L], chain_k])
                vals = torch.cat([reqs[b].values[0][:L], chain_v])
                want.append(_attention(q[z : z + 1], keys, vals, [torch.arange(len(keys))]))
            if want:
                worst = max(worst, float((got - torch.cat(want)).abs().max()))
        specmeta.check_status(loop.eager.status, where=f"eager B={B}")
        specmeta.check_status(loop.meta.status, where=f"runner B={B}")
        accepted = sum(len(p) for p in a.paths)
        print(f"B={B:2d} bucket={loop.runners['draft'].bucket(B):2d} accepted={accepted:3d} "
              f"max |attention - dense| = {worst:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
