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

A hybrid target (and draft; :class:`~specmeta.testing.tiny_model.TinyConfig`'s window layers)
keeps its window layers' KV in a window pool: the loop maps every full slot it hands out to a
window slot and takes it back once no window reads its position
(:class:`~specmeta.testing.window_pool.WindowSlots`), and every stage also builds the window
layers' metadata in window-pool ids (:class:`MetadataStages`); each forward writes a window
layer's KV at its slots' window-pool ids. FlashInfer's window builder reads a token-granular
map; FA3's (``backend="fa3"``) reads page tables, so its map pages like the full pool
(design §2.10: whole window pages, a full page's slots at the same offsets of one window
page, the layout-B prefix-tail copies made in the window pool too) and its results run
FlashAttention's own window.

An MLA target and draft (:class:`~specmeta.testing.tiny_model.TinyConfig`'s ``ckv_dim`` and
``kpe_dim``) keep a latent pool (:class:`~specmeta.testing.tiny_model.LatentCache`), served
by FlashInfer MLA's builder (``backend="flashinfer_mla"``, design §3.5): a tree's verify is a
cascade whose ancestor lists ``plan()`` sizes on the host, so the verify also hands the builder
the tree's node depths (``node_depths_cpu``; the device checks them against the mask).

Prompt prefill is outside specmeta's scope: :meth:`TinyModel.prefill` stores a prompt's KV into
the pools with dense attention. Every decode-time forward (draft decode, target verify, draft
extend) reads its keys through a builder's metadata and an attention backend of
:mod:`specmeta.testing.attention`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from ..config import SpecConfig, draft_row_need
from ..metadata.flashinfer_results import FlashInferPrefill
from ..status import SpecmetaStatusError, decode_status, new_status
from .attention import TorchAttention
from .consumers.flashinfer import windowed
from .loop_stages import BACKENDS, DRAFT_FORMS, MetadataStages
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
from .window_pool import WindowSlots, window_pool_size

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
        ``"fa3"``, ``"flashinfer"``, ``"trtllm_mla"`` or ``"flashinfer_mla"`` (MLA models:
        their latent pools): whose metadata the forwards read.
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
    ragged_verify : bool
        Each request verifies its first nodes only (design §2.9).
    window_pool_size : int, optional
        A hybrid model's window-pool slots (default: enough for ``max_bs`` requests,
        :func:`~specmeta.testing.window_pool.window_pool_size`).
    """

    def __init__(self, cfg: SpecConfig, target: TinyModel, draft: TinyModel, *,
                 backend: str = "fa3", attention=None, draft_form: str = "decode",
                 mode: str = "auto", buckets: Sequence[int] = (1, 2, 4),
                 reference: bool = False, seed: int = 0, timing: bool = False,
                 raise_on_status: bool = True, ragged_verify: bool = False,
                 window_pool_size: int | None = None):  # fmt: skip
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
        # FA3's window tables read the window pool a page at a time: its map pages like the
        # full pool (design §2.10); FlashInfer's lists read it token by token.
        self.window = self._window_slots(cfg, seed, window_pool_size, paged=backend == "fa3")
        wsize = self.window_pool_size if self.window else None
        self.target_cache = target.new_cache(cfg.pool_size, wsize)
        self.draft_cache = draft.new_cache(cfg.pool_size, wsize)
        self.status = new_status(self.device)
        self.stages = MetadataStages(cfg, backend, draft_form, self.device,
                                     self.slots.req_to_token, self.draft_cache, self.target_cache,
                                     self.status, reference=reference,
                                     ragged_verify=ragged_verify,
                                     full_to_swa=self.window.full_to_swa if self.window else None,
                                     sliding_window_size=self.window.window if self.window else 0,
                                     window_page_map=self._window_page_map())  # fmt: skip
        if mode != "eager":
            self.stages.build_runners(buckets, self.device)
        self.max_bucket = max(buckets, default=0)

    def _window_slots(self, cfg: SpecConfig, seed: int, size: int | None,
                      paged: bool = False) -> WindowSlots | None:  # fmt: skip
        """A hybrid model's window pool map (both models' window layers share one window, so
        one map serves both pools), or ``None``; ``paged``: one that pages like the full pool
        (:class:`~specmeta.testing.window_pool.WindowSlots` with ``page_size``)."""
        windows = {m.cfg.sliding_window_size for m in (self.target, self.draft) if m.cfg.hybrid}
        if not windows:
            return None
        if len(windows) > 1:
            raise ValueError(f"target and draft window layers must share one window, got "
                             f"{sorted(windows)}")  # fmt: skip
        w = windows.pop()
        if size is None:
            ps, K, S, N = cfg.page_size, cfg.topk, cfg.num_steps, cfg.num_draft_tokens
            need = max(draft_row_need(r + 1, K, S, ps) - r for r in range(ps)) + N + 1
            size = window_pool_size(w, cfg.max_bs, cfg.max_context_len, need, ps, paged)
        self.window_pool_size = size
        return WindowSlots(cfg.pool_size, size, w, self.device,
                           torch.Generator().manual_seed(seed + 1),
                           page_size=cfg.page_size if paged else 1)  # fmt: skip

    def _window_page_map(self) -> torch.Tensor | None:
        """The window map a page at a time, where it pages like the full pool, or ``None``."""
        paged = self.window is not None and self.window.page_size > 1
        return self.window.page_map if paged else None

    def _map_window(self, req: Request) -> None:
        """Window slots for every full slot ``req``'s row was given."""
        if self.window is not None:
            ps = self.cfg.page_size
            pages = self.slots.pages[req.row]
            self.window.map(req.row, [p * ps + i for p in pages for i in range(ps)])

    def _window_slots_of(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The window-pool ids of full slots (where a window layer writes), or ``None``."""
        if self.window is None:
            return None
        return self.window.full_to_swa[slots.long()].long()

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
        self._map_window(req)
        slots = self.slots.req_to_token[req.row, : P + 1].long()
        wslots = self._window_slots_of(slots)
        prompt = req.prompt.to(self.device)
        first = int(self.target.prefill(prompt, self.target_cache, slots[:P],
                                        None if wslots is None else wslots[:P])[-1].argmax())  # fmt: skip
        with_root = torch.cat([prompt, torch.tensor([first], device=self.device)])
        draft_logits = self.draft.prefill(with_root, self.draft_cache, slots, wslots)
        req.output, req.seq_len = [first], P
        req.root_logprobs = torch.log_softmax(draft_logits[-1], -1)
        if self.window is not None:
            self.window.evict(req.row, P)

    def retire(self, req: Request) -> None:
        """A finished request: its row and pages go back to the allocator."""
        if self.window is not None:
            self.window.release(req.row)
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
                self._map_window(r)
            rows = torch.tensor([r.row for r in batch], dtype=torch.int64)
            seq_lens_cpu = torch.tensor([r.seq_len for r in batch], dtype=torch.int64)
            draft_lens_cpu = seq_lens_cpu + 1
            rpi, seq_lens, draft_lens = (t.to(dev) for t in (rows, seq_lens_cpu, draft_lens_cpu))

            # 2. Draft decode: the tree.
            tree = self._draft(batch, rpi, draft_lens, draft_lens_cpu, graph)
            # 3. Target verify and greedy acceptance.
            window, logits, verified = self._verify(rpi, seq_lens, seq_lens_cpu, tree, graph,
                                                    index)  # fmt: skip
            bp = B
            if graph and self.stages.ragged_verify:
                bp = self.stages.runners["verify"].bucket(B, B * c.num_draft_tokens)[1]
            elif graph:
                bp = self.stages.runners["verify"].bucket(B)
            # Only the verified nodes (a ragged verify's first ones) can be accepted.
            node = torch.arange(c.num_draft_tokens, device=dev).view(1, -1)
            tokens_verified = torch.where(node < verified.view(-1, 1), tree.tokens, -1)
            path, accept_lens, bonus = greedy_accept(tokens_verified, tree.parents, logits,
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
            verified_cpu = verified.cpu().tolist()
            for i, r in enumerate(batch):
                acc, v = acc_cpu[i], verified_cpu[i]  # the record's tree: the verified nodes
                records.append(NodeRecord(r.rid, len(r.output), tuple(tree_tokens[i][:v]),
                                          tuple(tree_parents[i][:v]), acc))  # fmt: skip
                r.output.extend(tokens_cpu[i][:acc])
                r.seq_len += acc
                r.root_logprobs = next_logprobs[i]
                if self.window is not None:  # positions no window reads any more
                    self.window.evict(r.row, r.seq_len)
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

    def _specmeta(self, stage, B, inputs, lens_cpu, graph, verify_lens_cpu=None,
                  node_depths_cpu=None):  # fmt: skip
        """specmeta's build of ``stage`` (timed as ``metadata``)."""
        ctx = self.timer("metadata") if self.timer else contextlib.nullcontext()
        with ctx:
            return self.stages.run(stage, B, inputs, lens_cpu, graph, verify_lens_cpu,
                                   node_depths_cpu)  # fmt: skip

    def _forward(self, model: TinyModel, cache: KVCache, meta, tokens, positions, slots,
                 window_slots=None):  # fmt: skip
        """One decode-time forward: the backend plans once, then every layer stores its KV at
        ``slots`` and attends through ``meta``. With a window pool ``meta`` is ``(full layers',
        window layers')``, and a window layer stores its KV at ``window_slots`` (default: the
        slots' window-pool ids, translated through the map)."""
        ctx = self.timer("attention") if self.timer else contextlib.nullcontext()
        window = None
        if self.window is not None:
            meta, wmeta = meta
            with ctx:
                if window_slots is None:
                    window_slots = self._window_slots_of(slots)
                if isinstance(wmeta, FlashInferPrefill) and wmeta.causal:
                    # A causal prefill over the clipped list (draft extend): the kernel's own
                    # window hides from each row what its window dropped (design §2.10).
                    wmeta = windowed(wmeta, self.window.window - 1)
                window = (window_slots, self.attention.prepare(wmeta))
        with ctx:
            handle = self.attention.prepare(meta)
        attn = PagedAttention(cache, slots, self.attention, handle, self.timer, window)
        return model.forward(tokens, positions, attn)

    def _draft(self, batch, rpi, draft_lens, draft_lens_cpu, graph) -> DraftTree:
        """Draft decode: slots and metadata from specmeta, ``S − 1`` forwards, the tree."""
        c, dev = self.cfg, self.device
        B, K, S, N = len(batch), c.topk, c.num_steps, c.num_draft_tokens
        inputs = {"req_pool_indices": rpi, "seq_lens": draft_lens}
        steps = self._specmeta("draft", B, inputs, draft_lens_cpu, graph)
        wslots = None
        if self.window is not None:  # per step, the full layers' and the window layers'
            steps = [(steps[0][s], steps[1][s]) for s in range(S - 1)]
            # The window layers write at the draft slots' window-pool ids, as specmeta gave them.
            wslots = self.stages.window_bufs["draft.out_cache_loc"][: B * K * S].view(B, K, S)
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
                                   positions + s, slots[:, :, s].reshape(-1),
                                   None if wslots is None else wslots[:, :, s].reshape(-1))  # fmt: skip
            vocab = logits.shape[-1]
            selection.expand(torch.log_softmax(logits, -1).view(B, K, vocab))
        return selection.tree(N)

    def _verify(self, rpi, seq_lens, seq_lens_cpu, tree: DraftTree, graph, index: int = 0):
        """Target verify of the tree; returns the window's slots, the logits at every node and
        the nodes verified per request (``N``, or a ragged verify's first ones)."""
        c, dev = self.cfg, self.device
        B, N = rpi.shape[0], c.num_draft_tokens
        pos = seq_lens.view(-1, 1) + torch.arange(N, device=dev)
        window = self.slots.req_to_token[rpi.view(-1, 1), pos].long()  # [B, N], node j at L + j
        inputs = {"req_pool_indices": rpi, "seq_lens": seq_lens, "tree_mask": tree.mask}
        if self.stages.ragged_verify:
            return self._verify_ragged(inputs, window, seq_lens_cpu, tree, graph, index)
        depths_cpu = None
        if self.stages.node_depths:
            # FlashInfer MLA plans each node's ancestor list on the host: the tree's depths'
            # CPU copy, one more read-back here (the device checks it against the mask).
            depths_cpu = tree.depth.cpu()
            inputs["node_depths"] = tree.depth
        meta = self._specmeta("verify", B, inputs, seq_lens_cpu, graph,
                              node_depths_cpu=depths_cpu)  # fmt: skip
        logits = self._forward(self.target, self.target_cache, meta, tree.tokens.reshape(-1),
                               (seq_lens.view(-1, 1) + tree.depth).reshape(-1),
                               window.reshape(-1))  # fmt: skip
        return window, logits.view(B, N, logits.shape[-1]), torch.full((B,), N, device=dev)

    def _verify_ragged(self, inputs, window, seq_lens_cpu, tree: DraftTree, graph, index):
        """A ragged target verify: request ``b`` verifies its first ``v_b`` nodes, decided on
        the device (a stand-in for a draft-confidence rule: ``1 + (Σ tree tokens + iteration)
        mod N``, the root always), in a bucket of ``B·N`` tokens (``Bp·N`` through a runner).
        Query row ``qo_indptr[b] + j`` is node ``j`` while ``j < min(v_b, N)`` (its KV at the
        window slot, as in the uniform verify), a filler row past ``N`` (its KV at the sink
        slot 0), or a pad request's row (the sink)."""
        c, dev = self.cfg, self.device
        B, N = window.shape[0], c.num_draft_tokens
        seq_lens = inputs["seq_lens"]
        v = (1 + (tree.tokens.sum(1) + index) % N).to(torch.int32)
        inputs = {**inputs, "verify_lens": v}
        # FlashInfer plans on the host: its lengths' CPU copy is one more read-back there.
        v_cpu = v.cpu() if self.stages.backend == "flashinfer" else None
        meta = self._specmeta("verify", B, inputs, seq_lens_cpu, graph, v_cpu)
        # Each request's rows among the bucket's tokens (TRT-LLM MLA's dense layout covers
        # at most N a request: the tokens past its last offset are filler of no request); a
        # hybrid model's window layers read the same rows.
        full = meta[0] if self.window is not None else meta
        qo = {"flashinfer": lambda: full.qo_indptr, "trtllm_mla": lambda: full.cu_seqlens_q,
              "fa3": lambda: full.normal.cu_seqlens_q}[self.stages.backend]().long()  # fmt: skip
        T = (qo.shape[0] - 1) * N  # the bucket: B·N eager, Bp·N through the runner
        r = torch.arange(T, device=dev)
        owner = torch.searchsorted(qo[1:], r, right=True)  # the request of each row
        real = owner < B
        b = owner.clamp_max(max(B - 1, 0))
        j = r - qo[owner.clamp_max(qo.shape[0] - 2)]
        node = real & (j < N)
        jc = j.clamp(0, N - 1)
        if B:
            tokens = torch.where(node, tree.tokens[b, jc], torch.where(real, tree.tokens[b, 0], 0))
            positions = torch.where(real, seq_lens[b] + torch.where(node, tree.depth[b, jc], 0), 0)
            slots = torch.where(node, window[b, jc], 0)
        else:
            tokens = positions = slots = torch.zeros(T, dtype=torch.int64, device=dev)
        logits = self._forward(self.target, self.target_cache, meta, tokens, positions, slots)
        verified = (qo[1 : B + 1] - qo[:B]).clamp_max(N)
        rows = (qo[:B].view(-1, 1) + torch.arange(N, device=dev)).clamp_max(max(T - 1, 0))
        return window, logits[rows], verified

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
