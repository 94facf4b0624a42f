"""specmeta's part of one speculative-decoding iteration as four stage functions (design §4):
draft, verify, accept and extend, each binding its work to the tensors it is given, the raw
batch of an eager iteration or a runner's static views (:mod:`specmeta.testing.spec_loop`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch

from ..config import SpecConfig, allocate_buffers
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
from ..metadata.flashinfer_mla import FlashInferMLABuilder
from ..metadata.trtllm_mla import TrtllmMlaBuilder
from ..runners import GraphRunner, RaggedGraphRunner, padding
from ..stage import Stage
from .tiny_model import KVCache, LatentCache

__all__ = ["BACKENDS", "DRAFT_FORMS", "STAGES", "WINDOW_MODES", "MetadataStages"]

BACKENDS = ("fa3", "flashinfer", "trtllm_mla", "flashinfer_mla")
DRAFT_FORMS = ("decode", "shared_prefix", "paged")
"""FlashInfer's draft-decode forms: per-branch token lists, the shared-prefix cascade, per-branch
pages (:class:`~specmeta.FlashInferBuilder`)."""
STAGES = ("draft", "verify", "accept", "extend")
"""specmeta's stages of an iteration, in order (:class:`MetadataStages`)."""
WINDOW_MODES = ("draft_decode", "target_verify", "draft_extend")
"""The window layers' builder modes: token lists in window-pool ids (design §2.10)."""


def _both(full: Stage, window: Stage | None, launches: Sequence = ()) -> Stage:
    """``full``'s stage, and ``window``'s beside it when there is one: one host part returning
    both results, ``(full, window)``, and every launch."""
    if window is None:
        return Stage([*launches, full], host=full.host) if launches else full

    def host(seq_lens_cpu, **host_inputs):
        return full.host(seq_lens_cpu, **host_inputs), window.host(seq_lens_cpu, **host_inputs)

    return Stage([*launches, full, window], host=host)

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
                                                                     ``tree_mask`` (FlashInfer
                                                                     MLA's trees: and
                                                                     ``node_depths``)
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
        ``"fa3"``, ``"flashinfer"``, ``"trtllm_mla"`` (``topk == 1``, or trees over an MLA
        model's latent pool: their verify is a cascade whose ancestor pass is FlashInfer
        MLA's, design §3.4) or ``"flashinfer_mla"`` (an MLA model's latent pool; a tree's
        verify also takes the nodes' depths on the host, ``node_depths_cpu``, as TRT-LLM MLA's
        does; no ragged verify).
    draft_form : str
        FlashInfer's draft-decode form, one of :data:`DRAFT_FORMS`.
    device : torch.device
        Where the metadata lives.
    req_to_token : torch.Tensor
        The persistent table (the graphs read it).
    draft_cache, target_cache : KVCache or LatentCache
        The models' pools (the KV moves run on them).
    status : torch.Tensor
        The status word every launch reports into.
    reference : bool
        Bind specmeta's pure-torch references (``*_ref`` ops as the launches, builders with
        ``reference=True``) instead of the kernels; they synchronise, so their runners never
        capture graphs.
    full_to_swa : torch.Tensor, optional
        A hybrid model's full → window pool map (``[P_full]``, updated in place by the engine,
        :class:`~specmeta.testing.window_pool.WindowSlots`): with it every stage also builds the
        window layers' metadata (a second builder of the backend, ``sliding_window_size``:
        FlashInfer's or FA3's), in window-pool ids: draft slots, draft decode, target verify,
        draft extend, and the accepted KV moved in the window pool too. A stage's result is
        then ``(full layers', window layers')``.
    sliding_window_size : int
        ``w`` of the window layers (with ``full_to_swa``).
    window_page_map : torch.Tensor, optional
        The same map a page at a time (``[P_full / ps]``, the window page of each full page),
        where the window pool pages like the full pool (FA3 needs one, design §2.10): in slot
        layout B the prefix-tail copies are then made in the window pool too, their pairs
        through it.
    """

    def __init__(self, cfg: SpecConfig, backend: str, draft_form: str, device: torch.device,
                 req_to_token: torch.Tensor, draft_cache: KVCache | LatentCache,
                 target_cache: KVCache | LatentCache,
                 status: torch.Tensor, reference: bool = False,
                 ragged_verify: bool = False, full_to_swa: torch.Tensor | None = None,
                 sliding_window_size: int = 0,
                 window_page_map: torch.Tensor | None = None):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if draft_form not in DRAFT_FORMS:
            raise ValueError(f"draft_form must be one of {DRAFT_FORMS}, got {draft_form!r}")
        latent = isinstance(target_cache, LatentCache)
        if backend == "trtllm_mla" and cfg.topk > 1 and not latent:
            raise ValueError(f"backend 'trtllm_mla' verifies trees of an MLA model only (its "
                             f"cascade's ancestor pass is FlashInfer MLA's, over a latent "
                             f"pool): use topk=1 or an MLA model, got topk={cfg.topk}")  # fmt: skip
        if backend == "flashinfer_mla" and ragged_verify:
            raise ValueError("backend 'flashinfer_mla' builds a uniform verify (N rows a "
                             "request): use ragged_verify=False")  # fmt: skip
        self.cfg, self.backend, self.draft_form = cfg, backend, draft_form
        self.req_to_token, self.status = req_to_token, status
        self.draft_cache, self.target_cache = draft_cache, target_cache
        self.reference = reference
        self.ragged_verify = ragged_verify
        builder = {"fa3": FA3MetadataBuilder, "flashinfer": FlashInferBuilder,
                   "trtllm_mla": TrtllmMlaBuilder,
                   "flashinfer_mla": FlashInferMLABuilder}[backend]  # fmt: skip
        self.builder = builder(cfg, device, reference=reference)
        # FlashInfer MLA plans a tree's ancestor lists on the host: its verify's host part also
        # reads the nodes' depths (design §3.5), TRT-LLM MLA's cascade too (design §3.4).
        self.node_depths = backend in ("flashinfer_mla", "trtllm_mla") and cfg.topk > 1
        self.bufs = allocate_buffers(cfg, device, [
            "draft.out_cache_loc", "draft.positions", "draft.prefix_tail_tgt",
            "draft.prefix_tail_src", "verify.tgt_cache_loc", "verify.src_cache_loc",
            "runner.req_pool_indices", "runner.seq_lens", "runner.tree_mask",
            "runner.accept_index", "runner.accept_lens", "runner.verify_out_cache_loc",
            "runner.verify_lens",
        ])  # fmt: skip
        self.runners: dict[str, GraphRunner] = {}
        self.full_to_swa, self.window_page_map = full_to_swa, window_page_map
        self.window_builder = None
        if full_to_swa is not None:
            if backend not in ("flashinfer", "fa3") or sliding_window_size < 1:
                raise ValueError(f"a hybrid model's window layers are served by FlashInfer's or "
                                 f"FA3's builder with sliding_window_size >= 1, got "
                                 f"backend={backend!r}, "
                                 f"sliding_window_size={sliding_window_size}")  # fmt: skip
            if backend == "fa3" and cfg.page_size > 1 and window_page_map is None:
                raise ValueError("FA3's window tables read the window pool a page at a time: "
                                 "pass window_page_map, a map that pages like the full pool "
                                 "(WindowSlots(..., page_size=ps), design §2.10)")  # fmt: skip
            # The draft window bounds the draft's full layers; a window layer reads its own
            # window in every mode (design §2.10).
            plain = dataclasses.replace(cfg, draft_window_size=0, draft_sink_size=0)
            window_builder = FA3MetadataBuilder if backend == "fa3" else FlashInferBuilder
            self.window_builder = window_builder(plain, device, reference=reference,
                                                 modes=WINDOW_MODES,
                                                 sliding_window_size=sliding_window_size)  # fmt: skip
            self.window_bufs = allocate_buffers(cfg, device, [
                "draft.out_cache_loc", "verify.tgt_cache_loc", "verify.src_cache_loc",
                "draft.prefix_tail_tgt", "draft.prefix_tail_src",
            ])  # fmt: skip

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
        if c.layout_b and self.backend != "flashinfer_mla":
            # Branch t >= 1 reads its region's first page whole: the prefix tail goes there
            # first (FlashInfer MLA's passes read each prefix where it is: design §3.5).
            # Unused pairs are (0, 0), self-moves of the sink; targets sit past L, sources
            # before it, so the pairs are disjoint.
            tgt, src = b["draft.prefix_tail_tgt"], b["draft.prefix_tail_src"]
            n = B * (c.topk - 1) * (c.page_size - 1)
            launches.append(self._bind("prefix_tail_copy_pairs", rpi, r2t, lens, tgt=tgt,
                                       src=src, **kw))  # fmt: skip
            launches.append(self._bind("move_kv_cache", self.draft_cache.pool, tgt[:n], src[:n],
                                       disjoint=True, status=st))  # fmt: skip
        slots = b["draft.out_cache_loc"][: B * c.topk * c.num_steps]
        decode = self._draft_decode(rpi, lens, slots)
        window = None
        if self.window_builder is not None:
            # The window layers' draft slots: the same positions' window-pool ids.
            wb = self.window_bufs
            launches.append(self._bind("assign_draft_cache_locs", rpi, r2t, lens,
                                       out_cache_loc=wb["draft.out_cache_loc"],
                                       full_to_swa=self.full_to_swa, **kw))  # fmt: skip
            if c.layout_b and self.window_page_map is not None:
                # The window layers' branches read their region's first page whole too: the
                # prefix tails copied in the window pool, the pairs through the page map
                # (design §2.10). A tail position below the read floor may be out of the
                # token map already; its page is held (it holds L), so the copy is defined.
                wtgt, wsrc = wb["draft.prefix_tail_tgt"], wb["draft.prefix_tail_src"]
                n = B * (c.topk - 1) * (c.page_size - 1)
                launches.append(self._bind("prefix_tail_copy_pairs", rpi, r2t, lens, tgt=wtgt,
                                           src=wsrc, v2p=self.window_page_map, **kw))  # fmt: skip
                launches.append(self._bind("move_kv_cache", self.draft_cache.window_pool,
                                           wtgt[:n], wsrc[:n], disjoint=True, status=st))  # fmt: skip
            wkw = dict(num_rows=c.num_steps - 1, status=st, full_to_swa=self.full_to_swa)
            if self.backend == "fa3":  # its tree's expand pass reads the window draft slots
                wslots = wb["draft.out_cache_loc"][: B * c.topk * c.num_steps]
                window = self.window_builder.bind_draft_decode(rpi, r2t, lens, wslots, **wkw)
            else:
                window = self.window_builder.bind_draft_decode(rpi, r2t, lens, **wkw)
        return _both(decode, window, launches)

    def verify(self, inputs: Mapping[str, torch.Tensor], num_tokens: int | None = None) -> Stage:
        """Target-verify metadata of the tree over the window ``L … L + N − 1``; with a ragged
        verify, of each request's first ``verify_lens`` nodes in a bucket of ``num_tokens``."""
        kw = dict(status=self.status)
        if self.ragged_verify:
            kw.update(verify_lens=inputs["verify_lens"], num_tokens=num_tokens)
        args = (inputs["req_pool_indices"], self.req_to_token, inputs["seq_lens"])
        if self.backend in ("trtllm_mla", "flashinfer_mla") and self.cfg.topk == 1:
            # a chain: causal, no mask
            return self.builder.bind_target_verify(*args, **kw)
        # FA3 reads no mask for a chain
        mask = None if self.backend == "fa3" and self.cfg.topk == 1 else inputs["tree_mask"]
        full = self.builder.bind_target_verify(*args, mask, **kw)
        window = None
        if self.window_builder is not None:
            window = self.window_builder.bind_target_verify(*args, mask, **kw,
                                                            full_to_swa=self.full_to_swa)  # fmt: skip
        return _both(full, window)

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
        if self.window_builder is None:
            return Stage([pairs, move])
        # The window layers' KV moves between the same slots' window-pool ids: the map read as
        # a page map of page size 1 (design §2.10), the pairs in window-pool ids.
        wtgt, wsrc = self.window_bufs["verify.tgt_cache_loc"], self.window_bufs["verify.src_cache_loc"]
        wpairs = self._bind("accept_cache_locs", inputs["accept_index"], inputs["accept_lens"],
                            inputs["verify_out_cache_loc"], num_draft_tokens=c.num_draft_tokens,
                            tgt=wtgt, src=wsrc, status=self.status, v2p=self.full_to_swa,
                            page_size=1)  # fmt: skip
        wmove = self._bind("move_kv_cache", self.target_cache.window_pool, wtgt[:n], wsrc[:n],
                           ordered=True, status=self.status)  # fmt: skip
        return Stage([pairs, move, wpairs, wmove])

    def extend(self, inputs: Mapping[str, torch.Tensor]) -> Stage:
        """Draft-extend metadata: ``N`` query rows a request after the draft's prefix."""
        args = (inputs["req_pool_indices"], self.req_to_token, inputs["seq_lens"])
        full = self.builder.bind_draft_extend(*args, status=self.status)
        window = None
        if self.window_builder is not None:
            window = self.window_builder.bind_draft_extend(*args, status=self.status,
                                                           full_to_swa=self.full_to_swa)  # fmt: skip
        return _both(full, window)

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
            # Each stage returns its builder's own result for the batch (accept: None). A
            # ragged verify: one graph a bucket of Bp requests and Bp·N tokens, every split.
            if stage == "verify" and self.ragged_verify:
                runner = RaggedGraphRunner(self.verify, device=device, graphs=graphs,
                                           buckets=[(b * c.num_draft_tokens, b) for b in buckets])  # fmt: skip
            else:
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
            if stage == "verify" and self.node_depths:
                # Read by the host part only (the device reads the mask); the runner takes a
                # host value through a registered input. A padded node's depth is never read.
                depths = torch.zeros(c.max_bs, c.num_draft_tokens, dtype=torch.int64,
                                     device=device)  # fmt: skip
                runner.add_input("node_depths", depths, pad=0, host_mirror="node_depths_cpu")
            if stage == "verify" and self.ragged_verify:
                # FlashInfer plans on the host: its host part reads the lengths' CPU copy.
                host = "verify_lens_cpu" if self.backend == "flashinfer" else False
                runner.add_input("verify_lens", b["runner.verify_lens"],
                                 pad=padding.NOT_VERIFIED, host_mirror=host)  # fmt: skip
            # What the graphs read and write beyond the runner's inputs: a replay after one of
            # them was reallocated or reshaped raises instead of touching stale memory.
            runner.add_guard("req_to_token", lambda: self.req_to_token)
            if self.full_to_swa is not None:
                runner.add_guard("full_to_swa", self.full_to_swa)
            if self.window_page_map is not None:
                runner.add_guard("window_page_map", self.window_page_map)
            for which, cache in (("draft", self.draft_cache), ("target", self.target_cache)):
                for i, layer in enumerate((*cache.k, *cache.v)):
                    runner.add_guard(f"{which} KV buffer {i}", layer)
            runner.capture()
            self.runners[stage] = runner

    def run(self, stage: str, batch_size: int, inputs: dict[str, torch.Tensor],
            seq_lens_cpu: torch.Tensor | None, graph: bool,
            verify_lens_cpu: torch.Tensor | None = None,
            node_depths_cpu: torch.Tensor | None = None) -> object:  # fmt: skip
        """Run ``stage`` for the batch, through its runner or eagerly (bound to the raw inputs
        and called at once: host part, then launches): the stage's metadata for the
        ``batch_size`` requests (``None`` for accept). A ragged verify takes the bucket of
        ``B·N`` tokens (the host does not read the lengths to pick it), and the result is the
        whole bucket's. ``node_depths_cpu``: a FlashInfer MLA tree's (:attr:`node_depths`),
        with ``inputs["node_depths"]`` for the runner."""
        host = {"seq_lens": seq_lens_cpu} if seq_lens_cpu is not None else None
        if node_depths_cpu is not None:
            if graph:
                return self.runners[stage].run(batch_size, inputs, host_inputs={
                    **(host or {}), "node_depths": node_depths_cpu}).results  # fmt: skip
            return getattr(self, stage)(inputs)(seq_lens_cpu, node_depths_cpu=node_depths_cpu)
        if stage == "verify" and self.ragged_verify:
            T = batch_size * self.cfg.num_draft_tokens
            if graph:
                if verify_lens_cpu is not None:
                    host = {**(host or {}), "verify_lens": verify_lens_cpu}
                return self.runners[stage].run(batch_size, inputs, num_tokens=T,
                                               host_inputs=host).results  # fmt: skip
            return self.verify(inputs, T)(seq_lens_cpu, verify_lens_cpu=verify_lens_cpu)
        if graph:
            return self.runners[stage].run(batch_size, inputs, host_inputs=host).results
        return getattr(self, stage)(inputs)(seq_lens_cpu)
