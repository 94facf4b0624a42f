"""EAGLE-style speculative decoding over paged KV caches, end to end, with specmeta building every
piece of attention metadata: the loop an engine runs, on a tiny real model.

One iteration of a batch of ``B`` requests (:meth:`SpeculativeLoop.step`):

1. **Allocate.** Every request's ``req_to_token`` row gets the pages its draft region, verify
   window and draft extend will write (page aligned; row 0 and page 0 are never handed out).
2. **Draft decode** (draft model, draft KV pool). :func:`~specmeta.assign_draft_cache_locs`
   gives every (request, branch, step) its KV slot; in slot layout B
   :func:`~specmeta.prefix_tail_copy_pairs` + :func:`~specmeta.move_kv_cache` copy each
   prefix's last partial page into the branches' regions; the builder's ``draft_decode`` gives
   the metadata of the ``S − 1`` forwards. Then EAGLE's tree selection: top-``K`` from the
   root, and at every later step each of the ``K`` branches proposes its top-``K`` children,
   the ``K²`` candidates are scored by cumulative log-probability and the best ``K`` become the
   next step's branches. Finally every draft node is ranked by score: the ``N − 1`` best plus
   the root form the verify tree (node ids in candidate order, so a parent precedes its
   children).
3. **Target verify** (target model, target KV pool). The tree's ``N`` tokens sit at row
   positions ``L … L + N − 1``; the builder's ``target_verify`` gives the tree-masked metadata;
   greedy acceptance walks the tree from the root while the target's argmax is a child.
4. **Accept.** :func:`~specmeta.accept_cache_locs` + :func:`~specmeta.move_kv_cache` move the
   accepted nodes' target KV to the front of the window; the committed prefix grows by the
   accepted length (root included), and the target's argmax after the last accepted node is
   the bonus token, the next root.
5. **Draft extend** (draft model). The builder's ``draft_extend`` gives the metadata of a forward
   over the accepted draft tokens and the bonus token (``N`` query rows a request, padded),
   which writes their draft KV and yields the draft's log-probabilities after the new root.

Each of steps 2–5 is a stage (:class:`MetadataStages`): a function that binds the step's work
(builder modes through their ``bind_<mode>``, launchers through their ``bind_<op>``) to the
tensors it is given and returns the :class:`~specmeta.stage.Stage`. An eager iteration binds it
to the raw batch and calls it at once (the host part on ``seq_lens_cpu``, then the launches); a
graphed one goes through a :class:`~specmeta.runners.GraphRunner` per stage, which binds the
same function once per bucket on its static views (CUDA graphs on the GPU, the same path without
capture on the CPU) and once per batch size for the host part, and hands back each builder's
own result for the batch. The forwards read those results for the ``B`` requests only. With
``mode="auto"`` a batch that fits a bucket takes the runner, a larger one runs eagerly, as
engines do.

Two choices that differ from SGLang's EAGLE worker, and why:

* **The draft model is a standalone language model**, so its KV-ready prefix includes the root:
  the draft extend that produced the root's log-probabilities also stored its KV. Draft decode
  therefore gets ``seq_lens = L + 1`` (``L`` is the target's committed length, the root sits at
  position ``L``), and draft token ``j`` sits at position ``L + 1 + j``. (EAGLE's draft pairs
  token ``i + 1`` with the target's hidden state ``i``, so its prefix is ``L``.) With the target
  as its own draft and ``topk = 1``, every draft forward then computes exactly what the target
  would, and every draft token is accepted.
* **A reselected branch keeps its own slot chain.** After the ``K²`` re-rank, branch ``t``'s new
  token may be the child of another branch; as in SGLang, the next forward still lets branch
  ``t`` attend to its prefix plus *its own* chain slots (what specmeta's draft-decode metadata
  describes), not to its new parent's chain. The drafted tree is then approximate; verification
  is exact whatever the draft proposes, so this changes only how much is accepted.

Prompt prefill is outside specmeta's scope: :meth:`TinyModel.prefill` stores a prompt's KV into
the pools with dense attention. Every decode-time forward (draft decode, target verify, draft
extend) reads its keys through a builder's metadata and an attention backend of
:mod:`specmeta.testing.attention`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from ..config import SpecConfig, allocate_buffers, draft_row_need
from ..kernels.accept_cache_locs import accept_cache_locs_ref, bind_accept_cache_locs
from ..kernels.cache_loc_move import bind_move_kv_cache, move_kv_cache_ref
from ..kernels.draft_cache_locs import (
    assign_draft_cache_locs_ref,
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from ..metadata.fa3 import FA3MetadataBuilder
from ..metadata.flashinfer import FlashInferBuilder
from ..metadata.trtllm_mla import TrtllmMlaBuilder
from ..runners import GraphRunner, padding
from ..stage import Stage
from ..status import SpecmetaStatusError, decode_status, new_status
from .attention import TorchAttention
from .speculation import (
    DraftTree,
    GreedyAgreement,
    Iteration,
    NodeRecord,
    Request,
    SlotAllocator,
    TreeSelection,
    boundary_prompt_lengths,
    extend_tokens,
    greedy_accept,
    greedy_agreement,
    make_requests,
)
from .tiny_model import KVCache, PagedAttention, TinyModel

__all__ = [
    "BACKENDS",
    "DRAFT_FORMS",
    "Request",
    "NodeRecord",
    "Iteration",
    "SlotAllocator",
    "MetadataStages",
    "SpeculativeLoop",
    "StageTimer",
    "GreedyAgreement",
    "greedy_agreement",
    "greedy_accept",
    "TreeSelection",
    "DraftTree",
    "boundary_prompt_lengths",
    "make_requests",
]

BACKENDS = ("fa3", "flashinfer", "trtllm_mla")
DRAFT_FORMS = ("decode", "shared_prefix", "paged")
"""FlashInfer's draft-decode forms: per-branch token lists, the shared-prefix cascade, per-branch
pages (:class:`~specmeta.FlashInferBuilder`)."""
STAGES = ("draft", "verify", "accept", "extend")
"""specmeta's stages of an iteration, in order (:class:`MetadataStages`)."""

# The free launchers a stage binds: the kernels' bound launches, or (a reference build) the
# pure-torch references called as launches.
_BINDS = {
    "assign_draft_cache_locs": bind_assign_draft_cache_locs,
    "prefix_tail_copy_pairs": bind_prefix_tail_copy_pairs,
    "accept_cache_locs": bind_accept_cache_locs,
    "move_kv_cache": bind_move_kv_cache,
}
_REFERENCES = {
    "assign_draft_cache_locs": assign_draft_cache_locs_ref,
    "prefix_tail_copy_pairs": prefix_tail_copy_pairs_ref,
    "accept_cache_locs": accept_cache_locs_ref,
    "move_kv_cache": move_kv_cache_ref,
}


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
class StageTimer:
    """Accumulates time per category: CUDA events on the GPU (nothing synchronises until
    :meth:`totals`), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._spans.setdefault(name, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._spans.setdefault(name, []).append(time.perf_counter() - t0)

    def totals(self) -> dict[str, float]:
        """Seconds per category since the last call (synchronises on the GPU), then reset."""
        if self.cuda:
            torch.cuda.synchronize()
            out = {k: sum(s.elapsed_time(e) for s, e in v) / 1e3 for k, v in self._spans.items()}
        else:
            out = {k: sum(v) for k, v in self._spans.items()}
        self._spans = {}
        return out


# ------------------------------------------------------------------------------------------------
# specmeta's part of an iteration
# ------------------------------------------------------------------------------------------------
class MetadataStages:
    """specmeta's part of an iteration as four stage functions, ``inputs -> Stage``: each binds
    its work to the tensors it is given, the raw batch (an eager iteration calls the stage at
    once) or a :class:`GraphRunner`'s static views (the runner captures and replays it).

    ========  =====================================================  ==========================
    stage     builds                                                 inputs
    ========  =====================================================  ==========================
    draft     draft slots, layout-B prefix-tail KV copies (draft     ``req_pool_indices``,
              pool), draft-decode metadata of the ``S − 1`` forwards  ``seq_lens`` (``L + 1``)
    verify    target-verify metadata of the tree                     ``req_pool_indices``,
                                                                     ``seq_lens`` (``L``),
                                                                     ``tree_mask``
    accept    accepted-KV move pairs, their move (target pool)       ``accept_index``,
                                                                     ``accept_lens``,
                                                                     ``verify_out_cache_loc``
    extend    draft-extend metadata                                  ``req_pool_indices``,
                                                                     ``seq_lens`` (``L + 1``)
    ========  =====================================================  ==========================

    Parameters
    ----------
    cfg : SpecConfig
        ``K, S, N, ps``, ``max_bs`` and the capacity every buffer is planned for.
    backend : str
        ``"fa3"``, ``"flashinfer"`` or ``"trtllm_mla"`` (``topk == 1`` only: it verifies
        chains).
    draft_form : str
        FlashInfer's draft-decode form, one of :data:`DRAFT_FORMS`.
    device : torch.device
        Where the metadata lives.
    req_to_token : torch.Tensor
        The persistent table (the graphs read it).
    draft_cache, target_cache : KVCache
        The models' pools (the KV moves run on them).
    status : torch.Tensor
        The status word every launch reports into.
    reference : bool
        Bind specmeta's pure-torch references (``*_ref`` ops as the launches, builders with
        ``reference=True``) instead of the kernels; they synchronise, so their runners never
        capture graphs.
    """

    def __init__(self, cfg: SpecConfig, backend: str, draft_form: str, device: torch.device,
                 req_to_token: torch.Tensor, draft_cache: KVCache, target_cache: KVCache,
                 status: torch.Tensor, reference: bool = False):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if draft_form not in DRAFT_FORMS:
            raise ValueError(f"draft_form must be one of {DRAFT_FORMS}, got {draft_form!r}")
        if backend == "trtllm_mla" and cfg.topk > 1:
            raise ValueError(f"backend 'trtllm_mla' verifies chains only (no custom mask): "
                             f"use topk=1, got topk={cfg.topk}")  # fmt: skip
        self.cfg, self.backend, self.draft_form = cfg, backend, draft_form
        self.req_to_token, self.status = req_to_token, status
        self.draft_cache, self.target_cache = draft_cache, target_cache
        self.reference = reference
        builder = {"fa3": FA3MetadataBuilder, "flashinfer": FlashInferBuilder,
                   "trtllm_mla": TrtllmMlaBuilder}[backend]  # fmt: skip
        self.builder = builder(cfg, device, reference=reference)
        self.bufs = allocate_buffers(cfg, device, [
            "draft.out_cache_loc", "draft.positions", "draft.prefix_tail_tgt",
            "draft.prefix_tail_src", "verify.tgt_cache_loc", "verify.src_cache_loc",
            "runner.req_pool_indices", "runner.seq_lens", "runner.tree_mask",
            "runner.accept_index", "runner.accept_lens", "runner.verify_out_cache_loc",
        ])  # fmt: skip
        self.runners: dict[str, GraphRunner] = {}

    # --------------------------------------------------------------------------------------------
    # The stages: each binds its work to the tensors it is given (a runner's static views, or
    # the raw batch of an eager iteration)
    # --------------------------------------------------------------------------------------------
    def _bind(self, op: str, *args, **kwargs) -> Stage:
        """One launcher's work bound to its arguments: ``bind_<op>`` of the kernels, or the
        pure-torch ``<op>_ref`` as the launch of a reference build."""
        if self.reference:
            return Stage([functools.partial(_REFERENCES[op], *args, **kwargs)])
        return _BINDS[op](*args, **kwargs)

    def draft(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Draft slots, prefix-tail copies (layout B) and the draft-decode metadata per step;
        the host part is the draft-decode mode's (it returns the builder's result)."""
        c, b, r2t, st = self.cfg, self.bufs, self.req_to_token, self.status
        rpi, lens = inputs["req_pool_indices"], inputs["seq_lens"]
        B = rpi.shape[0]
        kw = dict(topk=c.topk, num_steps=c.num_steps, page_size=c.page_size, status=st)
        launches = [self._bind("assign_draft_cache_locs", rpi, r2t, lens,
                               out_cache_loc=b["draft.out_cache_loc"],
                               positions=b["draft.positions"], **kw)]  # fmt: skip
        if c.layout_b:
            # Branch t >= 1 reads its region's first page whole: the prefix tail goes there
            # first. Unused pairs are (0, 0), self-moves of the sink; targets sit past L,
            # sources before it, so the pairs are disjoint.
            tgt, src = b["draft.prefix_tail_tgt"], b["draft.prefix_tail_src"]
            n = B * (c.topk - 1) * (c.page_size - 1)
            launches.append(self._bind("prefix_tail_copy_pairs", rpi, r2t, lens, tgt=tgt,
                                       src=src, **kw))  # fmt: skip
            launches.append(self._bind("move_kv_cache", self.draft_cache.pool, tgt[:n], src[:n],
                                       disjoint=True, status=st))  # fmt: skip
        slots = b["draft.out_cache_loc"][: B * c.topk * c.num_steps]
        decode = self._draft_decode(rpi, lens, slots)
        return Stage([*launches, decode], host=decode.host)

    def verify(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Target-verify metadata of the tree over the window ``L … L + N − 1``."""
        kw = dict(status=self.status)
        rpi, lens = inputs["req_pool_indices"], inputs["seq_lens"]
        if self.backend == "trtllm_mla":  # a chain (topk == 1): causal, no mask
            return self.builder.bind_target_verify(rpi, self.req_to_token, lens, **kw)
        return self.builder.bind_target_verify(rpi, self.req_to_token, lens,
                                               inputs["tree_mask"], **kw)  # fmt: skip

    def accept(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Move pairs of the accepted nodes and their move, all layers of the target pool: free
        launchers only, so no host part (the stage's result is ``None``)."""
        b, c = self.bufs, self.cfg
        tgt, src = b["verify.tgt_cache_loc"], b["verify.src_cache_loc"]
        n = inputs["accept_index"].numel()  # B·(S + 1) pairs
        pairs = self._bind("accept_cache_locs", inputs["accept_index"], inputs["accept_lens"],
                           inputs["verify_out_cache_loc"], num_draft_tokens=c.num_draft_tokens,
                           tgt=tgt, src=src, status=self.status)  # fmt: skip
        # Accepted paths list node ids in increasing order: no pair reads a slot that an
        # earlier pair writes.
        move = self._bind("move_kv_cache", self.target_cache.pool, tgt[:n], src[:n],
                          ordered=True, status=self.status)  # fmt: skip
        return Stage([pairs, move])

    def extend(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Draft-extend metadata: ``N`` query rows a request after the draft's prefix."""
        return self.builder.bind_draft_extend(inputs["req_pool_indices"], self.req_to_token,
                                              inputs["seq_lens"], status=self.status)  # fmt: skip

    # --------------------------------------------------------------------------------------------
    # Per backend
    # --------------------------------------------------------------------------------------------
    def _draft_decode(self, rpi, lens, slots) -> Stage:
        """Per draft forward ``s < S − 1``: the metadata the attention backend reads, the
        builder's own result (indexed by step). Every builder takes the same keywords
        (:mod:`specmeta.metadata.contract`); FA3 also reads the draft slots."""
        kw = dict(num_rows=self.cfg.num_steps - 1, status=self.status)
        args = (rpi, self.req_to_token, lens)
        if self.backend == "fa3":
            return self.builder.bind_draft_decode(*args, slots, **kw)
        if self.backend == "flashinfer":
            bind = {"decode": self.builder.bind_draft_decode,
                    "shared_prefix": self.builder.bind_draft_decode_shared_prefix,
                    "paged": self.builder.bind_draft_decode_paged}[self.draft_form]  # fmt: skip
            return bind(*args, **kw)
        return self.builder.bind_draft_decode(*args, **kw)

    # --------------------------------------------------------------------------------------------
    # The runners
    # --------------------------------------------------------------------------------------------
    def build_runners(self, buckets: Sequence[int], device: torch.device,
                      graphs: bool | None = None) -> None:  # fmt: skip
        """One captured :class:`GraphRunner` per stage; every static input with its design §4 pad
        (padded requests read and write only the sinks). ``graphs``: as the runner's (default:
        CUDA graphs on a CUDA device); the references synchronise, so they never capture."""
        graphs = False if self.reference else graphs
        c, b = self.cfg, self.bufs
        fill = padding.seq_lens_fill(c.topk, c.num_draft_tokens)
        for stage in STAGES:
            # Each stage returns its builder's own result for the batch (accept: None).
            runner = GraphRunner(getattr(self, stage), batch_sizes=buckets, device=device,
                                 graphs=graphs)  # fmt: skip
            if stage == "accept":
                runner.add_input("accept_index", b["runner.accept_index"], pad=padding.NO_ACCEPT)
                runner.add_input("accept_lens", b["runner.accept_lens"],
                                 pad=padding.NOTHING_ACCEPTED)  # fmt: skip
                runner.add_input("verify_out_cache_loc", b["runner.verify_out_cache_loc"],
                                 pad=padding.SINK_SLOT, per_request=c.num_draft_tokens)  # fmt: skip
            else:
                runner.add_input("req_pool_indices", b["runner.req_pool_indices"],
                                 pad=padding.SINK_ROW)  # fmt: skip
                runner.add_input("seq_lens", b["runner.seq_lens"], pad=fill, host_mirror=True)
            if stage == "verify":
                runner.add_input("tree_mask", b["runner.tree_mask"], pad=padding.TREE_MASK)
            # What the graphs read and write beyond the runner's inputs: a replay after one of
            # them was reallocated or reshaped raises instead of touching stale memory.
            runner.add_guard("req_to_token", lambda: self.req_to_token)
            for which, cache in (("draft", self.draft_cache), ("target", self.target_cache)):
                for i, layer in enumerate((*cache.k, *cache.v)):
                    runner.add_guard(f"{which} KV buffer {i}", layer)
            runner.capture()
            self.runners[stage] = runner

    def run(self, stage: str, batch_size: int, inputs: dict[str, torch.Tensor],
            seq_lens_cpu: torch.Tensor | None, graph: bool) -> object:  # fmt: skip
        """Run ``stage`` for the batch, through its runner or eagerly (bound to the raw inputs
        and called at once: host part, then launches): the stage's metadata for the
        ``batch_size`` requests (``None`` for accept)."""
        if graph:
            host = {"seq_lens": seq_lens_cpu} if seq_lens_cpu is not None else None
            return self.runners[stage].run(batch_size, inputs, host_inputs=host).results
        return getattr(self, stage)(inputs)(seq_lens_cpu)


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------
class SpeculativeLoop:
    """Speculative decoding of a target model with a draft model over paged KV pools, every piece
    of attention metadata built by specmeta (see the module for one iteration, step by step).

    Parameters
    ----------
    cfg : SpecConfig
        ``topk``, ``num_steps``, ``num_draft_tokens``, ``page_size``; ``max_bs`` bounds the
        batch; ``max_context_len`` bounds every request's prompt plus generated tokens.
    target, draft : TinyModel
        The models (same vocabulary, dtype and device); ``draft`` may be ``target`` itself.
    backend : str
        ``"fa3"``, ``"flashinfer"`` or ``"trtllm_mla"``: whose metadata the forwards read.
    attention : object, optional
        The attention backend of :mod:`specmeta.testing.attention` that reads that metadata;
        default :class:`~specmeta.testing.attention.TorchAttention` (the CPU tier).
    draft_form : str
        FlashInfer's draft-decode form (:data:`DRAFT_FORMS`).
    mode : str
        ``"eager"``, ``"graph"`` (every iteration through the runners) or ``"auto"`` (the
        runners when the batch fits the largest bucket, eager beyond).
    buckets : sequence of int
        The runners' batch sizes.
    reference : bool
        Build with specmeta's pure-torch references: the baseline a test compares the kernels'
        acceptance with. They synchronise, so their runners run the padded path without
        capturing graphs (the forwards see the same padded batches as the kernels' loop).
    seed : int
        Shuffles the free pages.
    timing : bool
        Record each iteration's time split (:attr:`Iteration.seconds`); on the GPU that waits
        for the device at the end of every iteration.
    raise_on_status : bool
        Raise :class:`~specmeta.SpecmetaStatusError` when an iteration leaves the status word
        non-zero (otherwise it is only recorded in :attr:`Iteration.status`).
    """

    def __init__(self, cfg: SpecConfig, target: TinyModel, draft: TinyModel, *,
                 backend: str = "fa3", attention=None, draft_form: str = "decode",
                 mode: str = "auto", buckets: Sequence[int] = (1, 2, 4),
                 reference: bool = False, seed: int = 0, timing: bool = False,
                 raise_on_status: bool = True):  # fmt: skip
        if mode not in ("eager", "graph", "auto"):
            raise ValueError(f"mode must be 'eager', 'graph' or 'auto', got {mode!r}")
        if mode != "eager" and (not buckets or max(buckets) > cfg.max_bs):
            raise ValueError(f"buckets must be non-empty and at most max_bs={cfg.max_bs} (the "
                             f"planned buffers' batch), got {tuple(buckets)}")  # fmt: skip
        if mode == "graph" and max(buckets) < cfg.max_bs:
            raise ValueError(f"mode='graph' needs a bucket of max_bs={cfg.max_bs}, "
                             f"got buckets={tuple(buckets)}")  # fmt: skip
        if target.cfg.vocab_size != draft.cfg.vocab_size or target.device != draft.device:
            raise ValueError("target and draft must share the vocabulary and the device")
        if cfg.topk > target.cfg.vocab_size:
            raise ValueError(f"topk={cfg.topk} exceeds the vocabulary ({target.cfg.vocab_size})")
        self.cfg, self.target, self.draft = cfg, target, draft
        self.device = target.device
        self.mode, self.raise_on_status = mode, raise_on_status
        self.attention = attention or TorchAttention(page_size=cfg.page_size)
        self.timer = StageTimer(self.device) if timing else None
        # Rows: max_bs requests plus the reserved row 0 and two spare ones (rows are reused
        # out of order, so row ids do not follow the batch).
        self.slots = SlotAllocator(cfg.max_bs + 3, cfg.req_to_token_width,
                                   cfg.pool_size // cfg.page_size, cfg.page_size, self.device,
                                   torch.Generator().manual_seed(seed))  # fmt: skip
        self.target_cache = target.new_cache(cfg.pool_size)
        self.draft_cache = draft.new_cache(cfg.pool_size)
        self.status = new_status(self.device)
        self.stages = MetadataStages(cfg, backend, draft_form, self.device,
                                     self.slots.req_to_token, self.draft_cache, self.target_cache,
                                     self.status, reference=reference)  # fmt: skip
        if mode != "eager":
            self.stages.build_runners(buckets, self.device)
        self.max_bucket = max(buckets, default=0)

    # --------------------------------------------------------------------------------------------
    # Requests
    # --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, req: Request) -> None:
        """A new request: a row, its prompt's pages, prefill of both models (dense, outside
        specmeta), the first token (the target's greedy choice) and the draft's log-probs
        after it."""
        P = req.prompt.shape[0]
        if P < 1 or req.max_new_tokens < 1:
            raise ValueError(f"request {req.rid}: needs a prompt and max_new_tokens >= 1, got "
                             f"{P} prompt tokens and max_new_tokens={req.max_new_tokens}")  # fmt: skip
        if P + req.max_new_tokens > self.cfg.max_context_len:
            raise ValueError(f"request {req.rid}: prompt ({P}) + max_new_tokens "
                             f"({req.max_new_tokens}) exceeds max_context_len="
                             f"{self.cfg.max_context_len}")  # fmt: skip
        req.row = self.slots.alloc_row()
        self.slots.ensure(req.row, P + 1)
        slots = self.slots.req_to_token[req.row, : P + 1].long()
        prompt = req.prompt.to(self.device)
        first = int(self.target.prefill(prompt, self.target_cache, slots[:P])[-1].argmax())
        with_root = torch.cat([prompt, torch.tensor([first], device=self.device)])
        draft_logits = self.draft.prefill(with_root, self.draft_cache, slots)
        req.output, req.seq_len = [first], P
        req.root_logprobs = torch.log_softmax(draft_logits[-1], -1)

    def retire(self, req: Request) -> None:
        """A finished request: its row and pages go back to the allocator."""
        self.slots.free(req.row)
        req.row = 0

    # --------------------------------------------------------------------------------------------
    # One iteration
    # --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: list[Request], index: int = 0) -> Iteration:
        """One draft / verify / accept / extend iteration of ``batch`` (may be empty)."""
        c, dev = self.cfg, self.device
        B = len(batch)
        graph = self.mode == "graph" or (self.mode == "auto" and B <= self.max_bucket)
        timing = self.timer(".total") if self.timer else contextlib.nullcontext()
        with timing:
            # 1. Pages for everything this iteration writes: the draft region (prefix L + 1),
            #    the verify window and the draft extend.
            for r in batch:
                Ld = r.seq_len + 1
                need = max(draft_row_need(Ld, c.topk, c.num_steps, c.page_size),
                           r.seq_len + c.num_draft_tokens, Ld + c.num_draft_tokens)  # fmt: skip
                self.slots.ensure(r.row, need)
            rows = torch.tensor([r.row for r in batch], dtype=torch.int64)
            seq_lens_cpu = torch.tensor([r.seq_len for r in batch], dtype=torch.int64)
            draft_lens_cpu = seq_lens_cpu + 1
            rpi, seq_lens, draft_lens = (t.to(dev) for t in (rows, seq_lens_cpu, draft_lens_cpu))

            # 2. Draft decode: the tree.
            tree = self._draft(batch, rpi, draft_lens, draft_lens_cpu, graph)
            # 3. Target verify and greedy acceptance.
            window, logits = self._verify(rpi, seq_lens, seq_lens_cpu, tree, graph)
            bp = self.stages.runners["verify"].bucket(B) if graph else B
            path, accept_lens, bonus = greedy_accept(tree.tokens, tree.parents, logits,
                                                     c.num_steps)  # fmt: skip
            # 4. Move the accepted nodes' target KV to the front of the window.
            index_global = torch.where(path >= 0, path + c.num_draft_tokens *
                                       torch.arange(B, device=dev).view(-1, 1), -1)  # fmt: skip
            inputs = {"accept_index": index_global.to(torch.int32),
                      "accept_lens": accept_lens.to(torch.int32),
                      "verify_out_cache_loc": window.reshape(-1)}  # fmt: skip
            self._specmeta("accept", B, inputs, None, graph)
            # 5. Draft extend over the accepted draft tokens and the bonus token.
            tokens = extend_tokens(tree.tokens, path, accept_lens, bonus,
                                   c.num_draft_tokens)  # fmt: skip
            next_logprobs = self._extend(rpi, draft_lens, draft_lens_cpu, tokens,
                                         accept_lens, graph)  # fmt: skip

            # Commit on the host: the iteration's only read-back, the sampled tokens.
            records = []
            acc_cpu, tokens_cpu = accept_lens.cpu().tolist(), tokens.cpu().tolist()
            tree_tokens, tree_parents = tree.tokens.cpu().tolist(), tree.parents.cpu().tolist()
            for i, r in enumerate(batch):
                acc = acc_cpu[i]
                records.append(NodeRecord(r.rid, len(r.output), tuple(tree_tokens[i]),
                                          tuple(tree_parents[i]), acc))  # fmt: skip
                r.output.extend(tokens_cpu[i][:acc])
                r.seq_len += acc
                r.root_logprobs = next_logprobs[i]
        # The status word, read once an iteration (the only other sync is the commit above).
        bits = int(self.status.item())
        self.status.zero_()
        if bits and self.raise_on_status:
            raise SpecmetaStatusError(decode_status(bits), where=f"iteration {index} (B={B})")
        seconds = {}
        if self.timer is not None:
            t = self.timer.totals()
            seconds = {"total": t[".total"], "metadata": t.get("metadata", 0.0),
                       "attention": t.get("attention", 0.0)}  # fmt: skip
            seconds["rest"] = seconds["total"] - seconds["metadata"] - seconds["attention"]
        return Iteration(index, B, "graph" if graph else "eager", bp, tuple(records), bits,
                         seconds)  # fmt: skip

    def _specmeta(self, stage, B, inputs, lens_cpu, graph):
        """specmeta's build of ``stage`` (timed as ``metadata``)."""
        ctx = self.timer("metadata") if self.timer else contextlib.nullcontext()
        with ctx:
            return self.stages.run(stage, B, inputs, lens_cpu, graph)

    def _forward(self, model: TinyModel, cache: KVCache, meta, tokens, positions, slots):
        """One decode-time forward: the backend plans once, then every layer stores its KV at
        ``slots`` and attends through ``meta``."""
        ctx = self.timer("attention") if self.timer else contextlib.nullcontext()
        with ctx:
            handle = self.attention.prepare(meta)
        attn = PagedAttention(cache, slots, self.attention, handle, self.timer)
        return model.forward(tokens, positions, attn)

    def _draft(self, batch, rpi, draft_lens, draft_lens_cpu, graph) -> DraftTree:
        """Draft decode: slots and metadata from specmeta, ``S − 1`` forwards, the tree."""
        c, dev = self.cfg, self.device
        B, K, S, N = len(batch), c.topk, c.num_steps, c.num_draft_tokens
        inputs = {"req_pool_indices": rpi, "seq_lens": draft_lens}
        steps = self._specmeta("draft", B, inputs, draft_lens_cpu, graph)
        slots = self.stages.bufs["draft.out_cache_loc"][: B * K * S].view(B, K, S)
        positions = self.stages.bufs["draft.positions"][: B * K]
        if B:
            root = torch.stack([r.root_logprobs for r in batch]).to(dev)
        else:
            root = torch.zeros(0, self.target.cfg.vocab_size, device=dev)
        roots = torch.tensor([r.output[-1] for r in batch], dtype=torch.int64, device=dev)
        selection = TreeSelection(roots, root, K)
        for s in range(S - 1):
            # Forward s: every branch's step-s token at position L + 1 + s, attending to its
            # prefix and its own chain 0 … s.
            tokens = selection.branch_tokens.reshape(-1)
            logits = self._forward(self.draft, self.draft_cache, steps[s], tokens,
                                   positions + s, slots[:, :, s].reshape(-1))  # fmt: skip
            vocab = logits.shape[-1]
            selection.expand(torch.log_softmax(logits, -1).view(B, K, vocab))
        return selection.tree(N)

    def _verify(self, rpi, seq_lens, seq_lens_cpu, tree: DraftTree, graph):
        """Target verify of the tree; returns the window's slots and the logits."""
        c, dev = self.cfg, self.device
        B, N = rpi.shape[0], c.num_draft_tokens
        pos = seq_lens.view(-1, 1) + torch.arange(N, device=dev)
        window = self.slots.req_to_token[rpi.view(-1, 1), pos].long()  # [B, N], node j at L + j
        inputs = {"req_pool_indices": rpi, "seq_lens": seq_lens, "tree_mask": tree.mask}
        meta = self._specmeta("verify", B, inputs, seq_lens_cpu, graph)
        logits = self._forward(self.target, self.target_cache, meta, tree.tokens.reshape(-1),
                               (seq_lens.view(-1, 1) + tree.depth).reshape(-1),
                               window.reshape(-1))  # fmt: skip
        return window, logits.view(B, N, logits.shape[-1])

    def _extend(self, rpi, draft_lens, draft_lens_cpu, tokens, accept_lens, graph):
        """Draft extend: ``N`` rows a request at positions ``L + 1 …``; returns the draft's
        log-probs after the new root (row ``accepted − 1``)."""
        c, dev = self.cfg, self.device
        B, N = rpi.shape[0], c.num_draft_tokens
        pos = draft_lens.view(-1, 1) + torch.arange(N, device=dev)
        slots = self.slots.req_to_token[rpi.view(-1, 1), pos].long()
        inputs = {"req_pool_indices": rpi, "seq_lens": draft_lens}
        meta = self._specmeta("extend", B, inputs, draft_lens_cpu, graph)
        logits = self._forward(self.draft, self.draft_cache, meta, tokens.reshape(-1),
                               pos.reshape(-1), slots.reshape(-1))  # fmt: skip
        last = (accept_lens - 1).view(-1, 1, 1).expand(B, 1, logits.shape[-1])
        picked = logits.view(B, N, logits.shape[-1]).gather(1, last)[:, 0]
        return torch.log_softmax(picked, -1)

    # --------------------------------------------------------------------------------------------
    # Many iterations
    # --------------------------------------------------------------------------------------------
    def iterate(self, requests: Sequence[Request]) -> Iterator[Iteration]:
        """Serve ``requests`` to the end, yielding every iteration: admit each request when its
        wave and delay say so, run iterations (idle ones included) until every request
        finished, free each as it finishes."""
        pending = sorted(requests, key=lambda r: (r.wave, r.delay, r.rid))
        active: list[Request] = []
        wave, opened, index = 0, 0, 0
        while pending or active:
            while pending and pending[0].wave == wave and opened + pending[0].delay <= index:
                req = pending.pop(0)
                self.admit(req)
                active.append(req)
            yield self.step(active, index)
            for r in [r for r in active if r.finished]:
                self.retire(r)
                active.remove(r)
            index += 1
            if not active and not any(r.wave == wave for r in pending):
                # The wave drained: one idle iteration (B = 0), then the next wave.
                wave, opened = wave + 1, index + 1

    def run(self, requests: Sequence[Request]) -> list[Iteration]:
        """:meth:`iterate` to the end; every iteration."""
        return list(self.iterate(requests))
