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

Steps 2–5 run specmeta's builds either eagerly on the batch or through a typed
:class:`~specmeta.runners.GraphRunner` per stage, which builds on the batch padded to its bucket
(the same builders on the same planned buffers; CUDA graphs on the GPU, the same path without
capture on the CPU) and hands back each builder's own result for the batch. The forwards read
those results for the ``B`` requests only. With ``mode="auto"`` a batch that fits a bucket takes
the runner, a larger one runs eagerly, as engines do.

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
import dataclasses
import time
from collections.abc import Iterator, Sequence

import torch

from ..config import SpecConfig, allocate_buffers, draft_row_need
from ..kernels.cache_loc_move import (
    accept_cache_locs,
    accept_cache_locs_ref,
    move_kv_cache,
    move_kv_cache_ref,
)
from ..kernels.draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from ..metadata.fa3 import FA3MetadataBuilder
from ..metadata.flashinfer import FlashInferBuilder
from ..metadata.trtllm_mla import TrtllmMlaBuilder
from ..runners import GraphRunner, StageBatch, padding
from ..status import SpecmetaStatusError, decode_status, new_status
from .attention import TorchAttention
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


# ------------------------------------------------------------------------------------------------
# Requests and what an iteration records
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    """One generation request and its decoding state.

    Attributes
    ----------
    rid : int
        Request id.
    prompt : torch.Tensor
        ``[P]`` int64 token ids (CPU).
    max_new_tokens : int
        The request finishes once it has generated at least this many tokens (an iteration
        can overshoot by up to ``S``).
    wave, delay : int
        Scheduling (:meth:`SpeculativeLoop.run`): the request joins ``delay`` iterations after
        its wave opens; wave ``w + 1`` opens after every request of wave ``w`` finished and one
        idle iteration (``B = 0``) ran.
    row : int
        Its ``req_to_token`` row (0 until admitted).
    output : list of int
        Generated tokens; ``output[-1]`` is the root of the next draft tree.
    seq_len : int
        ``L``: positions whose target KV is committed (prompt plus accepted tokens); the root
        sits at position ``L``. The draft's KV is committed one position further (``L + 1``).
    root_logprobs : torch.Tensor or None
        ``[V]`` the draft's log-probabilities of the token after the root.
    """

    rid: int
    prompt: torch.Tensor
    max_new_tokens: int
    wave: int = 0
    delay: int = 0
    row: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    seq_len: int = 0
    root_logprobs: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """One request's part of an iteration.

    Attributes
    ----------
    rid : int
        The request.
    start : int
        ``len(output)`` before the iteration: the root is ``output[start − 1]`` and the
        iteration's first new token is ``output[start]``.
    tree_tokens, tree_parents : tuple of int
        The verify tree: node 0 is the root (parent −1); every other node's parent has a
        smaller id.
    accepted : int
        Accepted length, root included (``1`` … ``S + 1``); the iteration appends this many
        tokens (the accepted draft tokens and the bonus token).
    """

    rid: int
    start: int
    tree_tokens: tuple[int, ...]
    tree_parents: tuple[int, ...]
    accepted: int


@dataclasses.dataclass(frozen=True)
class Iteration:
    """What one :meth:`SpeculativeLoop.step` did.

    Attributes
    ----------
    index : int
        Iteration number within :meth:`SpeculativeLoop.run`.
    batch_size : int
        ``B`` (0 for an idle iteration).
    path : str
        ``"eager"`` or ``"graph"`` (the runners).
    padded_batch_size : int
        ``Bp``: the bucket (the graph path) or ``B``.
    requests : tuple of NodeRecord
        Per request, in batch order.
    status : int
        The status word after the iteration (0: no kernel masked anything).
    seconds : dict of str to float
        ``total``, ``metadata`` (specmeta's builds and KV moves), ``attention`` (the
        backend's planning and calls) and ``rest``; filled when the loop was built with
        ``timing=True``.
    """

    index: int
    batch_size: int
    path: str
    padded_batch_size: int
    requests: tuple[NodeRecord, ...]
    status: int
    seconds: dict[str, float]

    @property
    def tokens(self) -> int:
        """Tokens the iteration generated, over the batch."""
        return sum(r.accepted for r in self.requests)


# ------------------------------------------------------------------------------------------------
# Slot allocation
# ------------------------------------------------------------------------------------------------
class SlotAllocator:
    """``req_to_token`` rows and page-aligned KV slots, handed out and taken back.

    Row 0 and page 0 (slots ``0 … ps − 1``) are reserved sinks: never handed out, every unused
    ``req_to_token`` entry points there. Pages come from a shuffled free list, so a request's
    pages are not contiguous and a finished request's pages are reused (stale KV included).

    Parameters
    ----------
    num_rows, row_width : int
        ``req_to_token``'s shape ``[R, W_row]``.
    num_pages, page_size : int
        The KV pool: ``num_pages · page_size`` slots.
    device : torch.device or str
        Where ``req_to_token`` lives (the builders read it there).
    generator : torch.Generator
        Shuffles the free pages.
    """

    def __init__(self, num_rows: int, row_width: int, num_pages: int, page_size: int, device,
                 generator: torch.Generator):  # fmt: skip
        if row_width % page_size:
            raise ValueError(f"row_width={row_width} must be a multiple of page_size={page_size}")
        self.page_size = page_size
        self.req_to_token = torch.zeros(num_rows, row_width, dtype=torch.int32, device=device)
        self.free_rows = list(range(num_rows - 1, 0, -1))
        self.free_pages = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
        self.pages: dict[int, list[int]] = {}

    def alloc_row(self) -> int:
        """A free row (never row 0), with no pages yet."""
        if not self.free_rows:
            raise ValueError("no free req_to_token row: raise max_bs or finish a request first")
        row = self.free_rows.pop()
        self.pages[row] = []
        return row

    def ensure(self, row: int, positions: int) -> None:
        """Map row positions ``[0, positions)`` to pages, allocating the missing ones."""
        ps, have = self.page_size, self.pages[row]
        need = -(-positions // ps)
        if need * ps > self.req_to_token.shape[1]:
            raise ValueError(f"row {row} needs {positions} positions, req_to_token rows hold "
                             f"{self.req_to_token.shape[1]}: raise max_context_len")  # fmt: skip
        if need <= len(have):
            return
        if need - len(have) > len(self.free_pages):
            raise ValueError(f"the KV pool is out of pages ({len(self.free_pages)} free, "
                             f"{need - len(have)} needed): raise pool_size")  # fmt: skip
        new = [self.free_pages.pop() for _ in range(need - len(have))]
        slots = (torch.tensor(new).view(-1, 1) * ps + torch.arange(ps)).view(-1)
        start = len(have) * ps
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.req_to_token)
        have.extend(new)

    def free(self, row: int) -> None:
        """Return the row and its pages; the row points at the sink again."""
        self.free_pages.extend(self.pages.pop(row))
        self.req_to_token[row].zero_()
        self.free_rows.append(row)


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
    """specmeta's part of an iteration as four build functions over the batch's inputs: the same
    code runs eagerly on the raw batch and inside a :class:`GraphRunner` per stage on the padded
    one.

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
        Run specmeta's pure-torch references (``*_ref`` ops, builders with
        ``reference=True``) instead of the kernels; eager only (they synchronise).
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
        if reference:
            self._assign, self._tail_pairs = assign_draft_cache_locs_ref, prefix_tail_copy_pairs_ref
            self._accept, self._move = accept_cache_locs_ref, move_kv_cache_ref
        else:
            self._assign, self._tail_pairs = assign_draft_cache_locs, prefix_tail_copy_pairs
            self._accept, self._move = accept_cache_locs, move_kv_cache
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
    # The builds (run eagerly, or by a runner on its static views)
    # --------------------------------------------------------------------------------------------
    def draft(self, batch: StageBatch):
        """Draft slots, prefix-tail copies (layout B) and the draft-decode metadata per step."""
        c, b, r2t, st = self.cfg, self.bufs, self.req_to_token, self.status
        rpi, lens = batch.inputs["req_pool_indices"], batch.inputs["seq_lens"]
        slots = b["draft.out_cache_loc"][: rpi.shape[0] * c.topk * c.num_steps]
        if batch.launch:
            kw = dict(topk=c.topk, num_steps=c.num_steps, page_size=c.page_size, status=st)
            self._assign(rpi, r2t, lens, out_cache_loc=b["draft.out_cache_loc"],
                         positions=b["draft.positions"], **kw)  # fmt: skip
            if c.layout_b:
                # Branch t >= 1 reads its region's first page whole: the prefix tail goes there
                # first. Unused pairs are (0, 0), self-moves of the sink; targets sit past L,
                # sources before it, so the pairs are disjoint.
                tgt, src = self._tail_pairs(rpi, r2t, lens, tgt=b["draft.prefix_tail_tgt"],
                                            src=b["draft.prefix_tail_src"], **kw)  # fmt: skip
                n = rpi.shape[0] * (c.topk - 1) * (c.page_size - 1)
                self._move(self.draft_cache.pool, tgt[:n], src[:n], disjoint=True, status=st)
        return self._draft_decode(rpi, lens, slots, batch.host.get("seq_lens"), batch.launch)

    def verify(self, batch: StageBatch):
        """Target-verify metadata of the tree over the window ``L … L + N − 1``."""
        inp = batch.inputs
        return self._target_verify(inp["req_pool_indices"], inp["seq_lens"], inp["tree_mask"],
                                   batch.host.get("seq_lens"), batch.launch)  # fmt: skip

    def accept(self, batch: StageBatch) -> None:
        """Move pairs of the accepted nodes and their move, all layers of the target pool."""
        if not batch.launch:
            return None  # free launchers only: nothing for a builder to describe
        b, inp = self.bufs, batch.inputs
        tgt, src = self._accept(inp["accept_index"], inp["accept_lens"],
                                inp["verify_out_cache_loc"],
                                num_draft_tokens=self.cfg.num_draft_tokens,
                                tgt=b["verify.tgt_cache_loc"], src=b["verify.src_cache_loc"],
                                status=self.status)  # fmt: skip
        # Accepted paths list node ids in increasing order: no pair reads a slot that an
        # earlier pair writes.
        self._move(self.target_cache.pool, tgt, src, ordered=True, status=self.status)
        return None

    def extend(self, batch: StageBatch):
        """Draft-extend metadata: ``N`` query rows a request after the draft's prefix."""
        inp = batch.inputs
        return self._draft_extend(inp["req_pool_indices"], inp["seq_lens"],
                                  batch.host.get("seq_lens"), batch.launch)  # fmt: skip

    # --------------------------------------------------------------------------------------------
    # Per backend
    # --------------------------------------------------------------------------------------------
    def _draft_decode(self, rpi, lens, slots, lens_cpu, launch: bool = True):
        """Per draft forward ``s < S − 1``: the metadata the attention backend reads, the
        builder's own result (indexed by step), so a runner describes later batches from the
        builder's host steps (design §4). Every builder takes the same keywords
        (:mod:`specmeta.metadata.contract`); FA3 also reads the draft slots."""
        kw = dict(seq_lens_cpu=lens_cpu, num_rows=self.cfg.num_steps - 1, status=self.status,
                  launch=launch)  # fmt: skip
        args = (rpi, self.req_to_token, lens)
        if self.backend == "fa3":
            return self.builder.draft_decode(*args, slots, **kw)
        if self.backend == "flashinfer":
            build = {"decode": self.builder.draft_decode,
                     "shared_prefix": self.builder.draft_decode_shared_prefix,
                     "paged": self.builder.draft_decode_paged}[self.draft_form]  # fmt: skip
            return build(*args, **kw)
        return self.builder.draft_decode(*args, **kw)

    def _target_verify(self, rpi, lens, tree_mask, lens_cpu, launch: bool = True):
        kw = dict(seq_lens_cpu=lens_cpu, status=self.status, launch=launch)
        if self.backend == "trtllm_mla":  # a chain (topk == 1): causal, no mask
            return self.builder.target_verify(rpi, self.req_to_token, lens, **kw)
        return self.builder.target_verify(rpi, self.req_to_token, lens, tree_mask, **kw)

    def _draft_extend(self, rpi, lens, lens_cpu, launch: bool = True):
        kw = dict(seq_lens_cpu=lens_cpu, status=self.status, launch=launch)
        return self.builder.draft_extend(rpi, self.req_to_token, lens, **kw)

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
        for stage in ("draft", "verify", "accept", "extend"):
            # Typed: each stage returns its builder's own result, cut to B by the builder.
            runner = GraphRunner(getattr(self, stage), batch_sizes=buckets, device=device,
                                 graphs=graphs, typed=True)  # fmt: skip
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
        """Build ``stage`` for the batch, through its runner or eagerly on the raw inputs: the
        stage's metadata for the ``batch_size`` requests (``None`` for accept)."""
        host = {"seq_lens": seq_lens_cpu} if seq_lens_cpu is not None else {}
        if graph:
            res = self.runners[stage].run(batch_size, inputs, host_inputs=host or None,
                                          copy=False)  # fmt: skip
            return res.results
        return getattr(self, stage)(StageBatch(inputs, host, True))


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
            extend_tokens = _extend_tokens(tree.tokens, path, accept_lens, bonus,
                                           c.num_draft_tokens)  # fmt: skip
            next_logprobs = self._extend(rpi, draft_lens, draft_lens_cpu, extend_tokens,
                                         accept_lens, graph)  # fmt: skip

            # Commit on the host: the iteration's only read-back, the sampled tokens.
            records = []
            acc_cpu, tokens_cpu = accept_lens.cpu().tolist(), extend_tokens.cpu().tolist()
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


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyAgreement:
    """How a request's output compares with greedy decoding of a reference model.

    Attributes
    ----------
    tokens : int
        Tokens compared.
    mismatches : int
        Tokens that are not the reference's argmax given the output before them, with the
        reference leading the emitted token by at least the margin.
    near_ties : int
        Such tokens within the margin (bf16 kernels against a float32 reference).
    first_mismatch : int or None
        Index of the first mismatch.
    """

    tokens: int
    mismatches: int
    near_ties: int
    first_mismatch: int | None

    @property
    def lossless(self) -> bool:
        return self.mismatches == 0


@torch.no_grad()
def greedy_agreement(req: Request, reference: TinyModel, margin: float = 0.0) -> GreedyAgreement:
    """Whether ``req.output`` is greedy decoding of ``reference``, checked in one dense forward
    over prompt and output: every token must be the argmax given the tokens before it (by
    induction, the output is then exactly the greedy continuation). A token the reference
    leads by less than ``margin`` counts as a near-tie, not a mismatch (``margin=0``: exact).
    """
    P = req.prompt.shape[0]
    seq = torch.cat([req.prompt, torch.tensor(req.output, dtype=torch.int64)])
    logits = reference.logits(seq.to(reference.device))[P - 1 : P - 1 + len(req.output)].double()
    emitted = seq[P:].to(logits.device).view(-1, 1)
    lead = (logits.max(-1).values - logits.gather(1, emitted)[:, 0]).cpu()
    behind = lead > 0
    hard = behind & (lead >= margin)
    first = int(hard.nonzero()[0, 0]) if bool(hard.any()) else None
    return GreedyAgreement(len(req.output), int(hard.sum()), int((behind & ~hard).sum()), first)


# ------------------------------------------------------------------------------------------------
# Tree selection and acceptance
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """The verify tree of every request: node 0 the root, nodes in candidate order.

    Attributes
    ----------
    tokens, parents, depth : torch.Tensor
        ``[B, N]`` int64: token, parent node (−1 for the root) and depth (root 0).
    mask : torch.Tensor
        ``[B, N, N]`` bool, ``mask[i, j, c]`` iff ``c == j`` or ``c`` is an ancestor of ``j``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor


class TreeSelection:
    """EAGLE's draft-tree selection, step by step, batched over requests (as SGLang's EAGLE
    worker: step 0 takes the root's top-``K``; each later step takes every branch's top-``K``
    children and keeps the ``K`` best of the ``K²`` by cumulative log-probability).

    Every proposed candidate is recorded (``K`` at step 0, ``K²`` after), with its score, token
    and parent candidate; :meth:`tree` ranks them all.

    Parameters
    ----------
    root_tokens : torch.Tensor
        ``[B]`` each request's root (its last generated token), node 0 of its tree.
    root_logprobs : torch.Tensor
        ``[B, V]`` the draft's log-probabilities after each root.
    topk : int
        ``K``.
    """

    def __init__(self, root_tokens: torch.Tensor, root_logprobs: torch.Tensor, topk: int):
        B = root_logprobs.shape[0]
        self.K, self.root_tokens = topk, root_tokens
        self.score, tok = root_logprobs.topk(topk, dim=-1)  # [B, K]
        dev = root_logprobs.device
        self.scores, self.tokens = [self.score], [tok]
        self.parents = [torch.full((B, topk), -1, dtype=torch.int64, device=dev)]
        self.branch_tokens = tok  # [B, K]: each branch's newest token
        self.branch_node = torch.arange(topk, device=dev).expand(B, topk)  # their candidate ids
        self.count = topk

    def expand(self, logprobs: torch.Tensor) -> None:
        """One more step from the branches' log-probs ``[B, K, V]``."""
        B, K = logprobs.shape[0], self.K
        child_lp, child_tok = logprobs.topk(K, dim=-1)  # [B, K, K]
        cand = (self.score.unsqueeze(-1) + child_lp).reshape(B, K * K)
        parent = self.branch_node.unsqueeze(-1).expand(B, K, K).reshape(B, K * K)
        self.scores.append(cand)
        self.tokens.append(child_tok.reshape(B, K * K))
        self.parents.append(parent)
        self.score, pick = cand.topk(K, dim=-1)
        self.branch_tokens = child_tok.reshape(B, K * K).gather(1, pick)
        self.branch_node = self.count + pick
        self.count += K * K

    def tree(self, num_nodes: int) -> DraftTree:
        """The ``N − 1`` best candidates and the root. A child never outscores its parent
        (log-probs are ≤ 0) and ties keep candidate order, so every chosen node's parent is
        chosen too."""
        scores, tokens = torch.cat(self.scores, 1), torch.cat(self.tokens, 1)
        parents = torch.cat(self.parents, 1)
        B, dev = scores.shape[0], scores.device
        n = num_nodes - 1
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
        chosen = torch.sort(order, dim=1).values  # [B, N - 1] candidate ids, ascending
        node_of = torch.zeros(B, scores.shape[1] + 1, dtype=torch.int64, device=dev)
        # candidate id c -> node id (c + 1 column; column 0 is "no parent" -> the root)
        node_of.scatter_(1, chosen + 1, torch.arange(1, n + 1, device=dev).expand(B, n))
        tree_tokens = torch.cat([self.root_tokens.view(B, 1), tokens.gather(1, chosen)], 1)
        tree_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev),
                                  node_of.gather(1, parents.gather(1, chosen) + 1)], 1)  # fmt: skip
        mask = torch.eye(num_nodes, dtype=torch.bool, device=dev).repeat(B, 1, 1)
        depth = torch.zeros(B, num_nodes, dtype=torch.int64, device=dev)
        for j in range(1, num_nodes):  # parents precede children: one pass suffices
            p = tree_parents[:, j]
            mask[:, j] |= mask[torch.arange(B, device=dev), p]
            depth[:, j] = depth[torch.arange(B, device=dev), p] + 1
        return DraftTree(tree_tokens, tree_parents, depth, mask)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                  num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Greedy verification: from the root, follow the child whose token is the target's argmax
    at the current node, while there is one.

    Parameters
    ----------
    tokens, parents : torch.Tensor
        ``[B, N]`` the tree (node 0 the root, parent −1).
    logits : torch.Tensor
        ``[B, N, V]`` the target's logits at every node.
    num_steps : int
        ``S``, the deepest a path can go.

    Returns
    -------
    (path, accept_lens, bonus) : tuple of torch.Tensor
        ``path [B, S + 1]`` node ids of the accepted path (root first, then −1),
        ``accept_lens [B]`` its length, ``bonus [B]`` the target's argmax after its last node.
    """
    B, dev = tokens.shape[0], tokens.device
    pred = logits.argmax(-1)  # [B, N]
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, num_steps + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    for d in range(1, num_steps + 1):
        want = pred.gather(1, cur.view(-1, 1))
        match = (parents == cur.view(-1, 1)) & (tokens == want) & alive.view(-1, 1)
        found = match.any(1)
        cur = torch.where(found, match.to(torch.int32).argmax(1), cur)
        path[:, d] = torch.where(found, cur, -1)
        alive &= found
    accept_lens = (path >= 0).sum(1)
    return path, accept_lens, pred.gather(1, cur.view(-1, 1))[:, 0]


def _extend_tokens(tree_tokens, path, accept_lens, bonus, num_draft_tokens):
    """``[B, N]``: the accepted draft tokens (the path without its root), the bonus token, then
    padding (0)."""
    B, dev = tree_tokens.shape[0], tree_tokens.device
    N = num_draft_tokens
    on_path = tree_tokens.gather(1, path.clamp_min(0))[:, 1:]  # [B, S]
    out = torch.zeros(B, N, dtype=torch.int64, device=dev)
    w = min(N, on_path.shape[1])
    out[:, :w] = on_path[:, :w]
    k = torch.arange(N, device=dev).view(1, -1)
    out = torch.where(k < (accept_lens - 1).view(-1, 1), out, 0)
    return out.scatter(1, (accept_lens - 1).view(-1, 1), bonus.view(-1, 1))


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------
def boundary_prompt_lengths(count: int, page_size: int, generator: torch.Generator) -> list[int]:
    """``count`` prompt lengths that put the first iteration's target prefix ``L`` and draft
    prefix ``L + 1`` on a page boundary and one short of it: ``L ≡ 0, ps − 1, ps − 2, 1
    (mod ps)`` in turn, one to three pages long, the rest random."""
    if page_size < 1 or count < 0:
        raise ValueError(f"page_size must be >= 1 and count >= 0, got {page_size} and {count}")
    ps = page_size
    out = []
    for i in range(count):
        pages = 1 + int(torch.randint(0, 3, (1,), generator=generator))
        residue = (
            (0, -1, -2, 1)[i % 4] if i < 4 else int(torch.randint(0, ps, (1,), generator=generator))
        )
        out.append(max(1, pages * ps + residue))
    return out


def make_requests(waves: Sequence[Sequence[int]], *, vocab_size: int, page_size: int,
                  max_new_tokens: int, generator: torch.Generator,
                  spread: int = 8) -> list[Request]:  # fmt: skip
    """Requests in waves; ``waves[w]`` lists each request's join delay (iterations after wave
    ``w`` opens). Prompt lengths come from :func:`boundary_prompt_lengths`, prompt tokens at
    random; ``max_new_tokens`` grows by ``spread`` per request of a wave, so requests finish at
    different iterations.

    Examples
    --------
    ``waves=[(0, 0, 0, 0, 0, 2, 2, 2), (0, 0, 0)]``: five requests, three more two iterations
    later, the batch shrinks to 0 as they finish, an idle iteration, then three new ones.
    """
    reqs, rid = [], 0
    for w, delays in enumerate(waves):
        lengths = boundary_prompt_lengths(len(delays), page_size, generator)
        for i, (delay, P) in enumerate(zip(delays, lengths, strict=True)):
            prompt = torch.randint(0, vocab_size, (P,), generator=generator)
            reqs.append(Request(rid, prompt, max_new_tokens + spread * i, wave=w, delay=delay))
            rid += 1
    return reqs
