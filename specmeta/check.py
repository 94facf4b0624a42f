"""``specmeta check``: every kernel against its reference on fresh random workloads.

Each check draws inputs from the workload vocabulary (:mod:`specmeta.workloads`), runs the
kernel and its pure-torch reference on the same device, and compares integers exactly. A check
is a function ``(device, generator) -> CheckResult`` registered with :func:`register`: one per
op of :data:`specmeta.registry.OPS` (the op's own workloads, the same table the tests use),
then the CUDA-graph runner, the metadata builders and the lossless loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from .config import draft_decode_kv_indices_need
from .kernels.draft_cache_locs import assign_draft_cache_locs, assign_draft_cache_locs_ref
from .kernels.draft_decode_kv_indices import draft_decode_kv_indices_ref
from .registry import OPS, Op, batches, tree_width
from .status import new_status
from .workloads import SHAPES, Batch

__all__ = ["CheckResult", "CHECKS", "register", "run_checks"]


@dataclasses.dataclass
class CheckResult:
    name: str
    cases: int = 0
    mismatches: int = 0
    status_bits: int = 0
    seconds: float = 0.0
    first_failure: str = ""
    details: list[str] = dataclasses.field(default_factory=list)
    """Lines printed under the summary table (the lossless loop's per-backend figures)."""

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.status_bits == 0

    def compare(self, what: str, got: torch.Tensor, want: torch.Tensor, context: str) -> None:
        self.cases += 1
        if got.shape != want.shape or not torch.equal(got, want.to(got.device, got.dtype)):
            self.mismatches += 1
            if not self.first_failure:
                self.first_failure = f"{what} differs [{context}]"


CHECKS: dict[str, Callable[[torch.device, torch.Generator], CheckResult]] = {}


def register(name: str):
    def wrap(fn):
        CHECKS[name] = fn
        return fn

    return wrap


def _args(b: Batch):
    return (b.req_pool_indices, b.req_to_token, b.seq_lens)


def _op_check(op: Op) -> Callable[[torch.device, torch.Generator], CheckResult]:
    """The check of one registered op: its launcher against its reference on every case of the
    sweep, every written output compared exactly."""

    def check(device: torch.device, g: torch.Generator) -> CheckResult:
        res = CheckResult(op.name)
        status, ref_status = new_status(device), new_status(device)
        for case in op.workloads(device, g):
            got = op.run(op.launcher, case, status)
            want = op.run(op.reference, case, ref_status)
            for name, value in want.items():
                res.compare(name, got[name], value, case.describe)
        res.status_bits |= int(status.item())
        return res

    check.__doc__ = f"{op.name}: launcher against reference over the registry's workloads."
    return check


for _op in OPS:
    register(_op.name)(_op_check(_op))


@register("graph_runner")
def _check_graph_runner(device: torch.device, g: torch.Generator) -> CheckResult:
    """Draft slots and kv_indices built through a GraphRunner (garbage tails re-padded, graphs
    replayed on CUDA) against the references on the raw batch; padded slots on the sink; and
    copy_pad against its reference on each batch's seq_lens."""
    from .config import SpecConfig, allocate_buffers
    from .kernels.draft_cache_locs import bind_assign_draft_cache_locs
    from .kernels.draft_decode_kv_indices import bind_draft_decode_kv_indices
    from .runners import GraphRunner, padding
    from .runners.padding import copy_pad, copy_pad_ref
    from .stage import Stage

    res = CheckResult("graph_runner")
    status = new_status(device)
    buckets = (1, 2, 4, 8, 16)
    runners: dict[tuple, tuple] = {}
    for i, b in enumerate(batches(device, g)):
        # Two shapes per config, rotating with the config (empty, odd, long_short, mod1, random
        # and their partners): padded runs cost the interpreter more than plain launches.
        config, shape = divmod(i, len(SHAPES))
        if shape not in ((2 * config) % len(SHAPES), (2 * config + 5) % len(SHAPES)):
            continue
        k, s, ps, B = b.topk, b.num_steps, b.page_size, b.batch_size
        R, W = b.req_to_token.shape
        key = (k, s, ps, W)
        if key not in runners:
            cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=2, page_size=ps,
                             max_bs=buckets[-1], max_context_len=W)  # fmt: skip
            bufs = allocate_buffers(cfg, device)
            table = torch.zeros(buckets[-1] + 3, W, dtype=b.req_to_token.dtype, device=device)

            def stage(inp, bufs=bufs, table=table, k=k, s=s, ps=ps) -> Stage:
                # Free launchers only: the stage returns nothing, the caller cuts the buffers.
                args = (inp["req_pool_indices"], table, inp["seq_lens"])
                kw = dict(topk=k, num_steps=s, page_size=ps, status=status)
                return Stage([
                    bind_assign_draft_cache_locs(*args, out_cache_loc=bufs["draft.out_cache_loc"],
                                                 **kw),
                    bind_draft_decode_kv_indices(*args, kv_indices=bufs["draft_decode.kv_indices"],
                                                 kv_indptr=bufs["draft_decode.kv_indptr"], **kw),
                ])  # fmt: skip

            runner = GraphRunner(stage, batch_sizes=buckets, device=device)
            runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"],
                             pad=padding.SINK_ROW)  # fmt: skip
            runner.add_input("seq_lens", bufs["runner.seq_lens"], pad=padding.seq_lens_fill(k))
            runner.capture()
            runners[key] = (runner, bufs, table)
        runner, bufs, table = runners[key]
        if R > table.shape[0] or b.req_pool_indices.dtype != torch.int64:
            continue
        table.zero_()
        table[:R].copy_(b.req_to_token)
        bp = runner.bucket(B)
        for spec in runner.inputs.values():  # garbage tails: the run must re-pad them
            spec.buffer[B:bp] = 1
        runner.run(B, {"req_pool_indices": b.req_pool_indices, "seq_lens": b.seq_lens})
        # The outputs for B requests, cut here: the slots [:B·K·S], each step's offsets
        # [:B·K + 1], each step's list up to what the batch uses.
        slots, ptr_buf = bufs["draft.out_cache_loc"], bufs["draft_decode.kv_indptr"]
        kw = dict(topk=k, num_steps=s, page_size=ps)
        want = assign_draft_cache_locs_ref(*_args(b), **kw)
        res.compare("out_cache_loc", slots[: B * k * s], want, b.describe())
        pad = slots[B * k * s : bp * k * s]
        res.compare("padded out_cache_loc", pad, torch.zeros_like(pad), b.describe())
        idx, ptr = draft_decode_kv_indices_ref(*_args(b), **kw)
        res.compare("kv_indptr", ptr_buf[:, : B * k + 1], ptr, b.describe())
        for row in range(s):
            used = draft_decode_kv_indices_need(b.seq_lens_sum, B, k, row + 1)
            res.compare(f"kv_indices[{row}]", bufs["draft_decode.kv_indices"][row, :used],
                        idx[row, :used], b.describe())  # fmt: skip
        dst = torch.full((bp + 2,), -1, dtype=b.seq_lens.dtype, device=device)
        want_dst = dst.clone()
        copy_pad(b.seq_lens, dst[:bp], 7)
        copy_pad_ref(b.seq_lens, want_dst[:bp], 7)
        res.compare("copy_pad", dst, want_dst, b.describe())
    res.status_bits |= int(status.item())
    return res


def _builder_config(b: Batch, n: int):
    from .config import SpecConfig
    from .workloads import max_prefix_len

    # Capacity for any batch of this sweep: 16 requests, and the longest prefix whose draft
    # region and verify window fit the batch's rows (the builders check that on the host).
    width = b.req_to_token.shape[1]
    longest = max_prefix_len(width, b.topk, b.num_steps, b.page_size, n)
    return SpecConfig(topk=b.topk, num_steps=b.num_steps, num_draft_tokens=n,
                      page_size=b.page_size, max_bs=16, max_context_len=longest,
                      req_to_token_width=width)  # fmt: skip


@register("flashinfer_builder")
def _check_flashinfer_builder(device: torch.device, g: torch.Generator) -> CheckResult:
    """Every FlashInfer mode against the kernel references it is made of, host mirrors against
    the device values, on one builder per configuration."""
    from .kernels.shared_prefix_kv_indices import shared_prefix_kv_indices_ref
    from .kernels.tree_custom_mask import tree_custom_mask_ref
    from .kernels.verify_kv_indices import verify_kv_indices_ref
    from .metadata.flashinfer import FlashInferBuilder
    from .testing.masks import written_part
    from .workloads import random_tree_mask

    res = CheckResult("flashinfer_builder")
    builders: dict[tuple, FlashInferBuilder] = {}
    for b in batches(device, g, extra_tokens=8):
        if b.shape not in ("empty", "odd", "modm1", "near_row_end"):
            continue  # the kernels' own checks sweep every shape; this one checks the wiring
        K, S, n, d = b.topk, b.num_steps, tree_width(b.topk, b.num_steps), b.describe()
        key = (K, S, b.page_size, b.req_to_token.shape[1])
        if key not in builders:
            builders[key] = FlashInferBuilder(_builder_config(b, n), device)
        fi = builders[key]
        lens = dict(seq_lens_cpu=b.seq_lens_cpu)
        for step in fi.draft_decode(*_args(b), num_rows=S, **lens).steps:
            res.compare("draft_decode kv_indptr_host", step.kv_indptr_host, step.kv_indptr, d)
        casc = fi.draft_decode_shared_prefix(*_args(b), num_rows=S, **lens).steps
        want = shared_prefix_kv_indices_ref(*_args(b), topk=K, num_steps=S, page_size=b.page_size)
        for s, step in enumerate(casc):
            res.compare("cascade prefix kv_indptr", step.paged_kv_indptr_arr[0], want[1], d)
            res.compare("cascade chain kv_indices", step.paged_kv_indices_arr[1][: b.batch_size * K * (s + 1)],
                        want[2][s, : b.batch_size * K * (s + 1)], d)  # fmt: skip
            for host, dev in zip(
                step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True
            ):
                res.compare("cascade kv_indptr_host", host, dev, d)
        for step in fi.draft_decode_paged(*_args(b), num_rows=S, **lens).steps:
            res.compare("paged kv_indptr_host", step.kv_indptr_host, step.kv_indptr, d)
            res.compare("paged kv_last_page_len_host", step.kv_last_page_len_host,
                        step.kv_last_page_len, d)  # fmt: skip
        tree = random_tree_mask(b.batch_size, K, S, n, g).to(device)
        for packed in (False, True):
            meta = fi.target_verify(*_args(b), tree, packed=packed, **lens)
            idx, ptr = verify_kv_indices_ref(*_args(b), extra_tokens=n)
            mask, mptr = tree_custom_mask_ref(b.seq_lens, tree, packed=packed,
                                              seq_lens_sum=b.seq_lens_sum)  # fmt: skip
            used = int(ptr[-1])
            got_mask = meta.packed_custom_mask if packed else meta.custom_mask
            res.compare("verify kv_indptr", meta.kv_indptr, ptr, d)
            res.compare("verify kv_indices", meta.kv_indices[:used], idx[:used], d)
            res.compare("verify mask", written_part(got_mask, meta.mask_indptr, packed),
                        written_part(mask, mptr, packed), d)  # fmt: skip
            res.compare("verify mask_indptr_host", meta.mask_indptr_host, meta.mask_indptr, d)
            res.compare("verify kv_indptr_host", meta.kv_indptr_host, meta.kv_indptr, d)
        ext = fi.draft_extend(*_args(b), **lens)
        res.compare("extend kv_indptr", ext.kv_indptr, ptr, d)
        res.compare("extend qo_indptr", ext.qo_indptr, ext.qo_indptr_host, d)
    for fi in builders.values():
        res.status_bits |= int(fi.status.item())
    return res


@register("trtllm_mla_builder")
def _check_trtllm_mla_builder(device: torch.device, g: torch.Generator) -> CheckResult:
    """TRT-LLM MLA draft decode against the per-branch page-table reference, verify and extend
    against the request page-table reference (fill −1), query layout uniform."""
    from .kernels.branch_page_table import branch_page_table_ref
    from .kernels.prefix_page_table import prefix_page_table_ref
    from .metadata.trtllm_mla import TrtllmMlaBuilder

    res = CheckResult("trtllm_mla_builder")
    builders: dict[tuple, TrtllmMlaBuilder] = {}
    for b in batches(device, g, extra_tokens=8):
        K, S, ps, d = b.topk, b.num_steps, b.page_size, b.describe()
        n = S + 1 if K == 1 else tree_width(K, S)
        key = (K, S, ps, b.req_to_token.shape[1])
        if key not in builders:
            builders[key] = TrtllmMlaBuilder(_builder_config(b, n), device)
        mla = builders[key]
        B, W = b.batch_size, mla.max_blocks
        steps = mla.draft_decode(*_args(b), num_rows=S).steps
        table = torch.full((B * K, W), -7, dtype=torch.int32, device=device)
        want, lens = branch_page_table_ref(*_args(b), topk=K, num_steps=S, page_size=ps,
                                           fill_value=-1, page_table=table)  # fmt: skip
        for s, step in enumerate(steps):
            res.compare("draft_decode block_kv_indices", step.block_kv_indices, want, d)
            res.compare("draft_decode seq_lens_k", step.seq_lens_k, lens[s], d)
        modes = ("draft_extend",) if K > 1 else ("target_verify", "draft_extend")
        for mode in modes:
            meta = getattr(mla, mode)(*_args(b))
            table = torch.full((B, W), -7, dtype=torch.int32, device=device)
            want, lens = prefix_page_table_ref(*_args(b), page_size=ps, extra_tokens=n,
                                               fill_value=-1, page_table=table)  # fmt: skip
            res.compare(f"{mode} block_kv_indices", meta.block_kv_indices, want, d)
            res.compare(f"{mode} seq_lens_k", meta.seq_lens_k, lens, d)
            cu = torch.arange(B + 1, device=device) * n
            res.compare(f"{mode} cu_seqlens_q", meta.cu_seqlens_q, cu, d)
    for mla in builders.values():
        res.status_bits |= int(mla.status.item())
    return res


@register("flashinfer_mla_builder")
def _check_flashinfer_mla_builder(device: torch.device, g: torch.Generator) -> CheckResult:
    """Every FlashInfer MLA mode (design §3.5) against the same builder running the torch
    references, and each pass's host mirrors against its device offsets."""
    from .metadata.flashinfer_mla import FlashInferMLABuilder
    from .workloads import random_tree_mask

    res = CheckResult("flashinfer_mla_builder")
    builders: dict[tuple, tuple] = {}
    for b in batches(device, g, extra_tokens=8):
        if b.shape not in ("empty", "odd", "modm1", "near_row_end"):
            continue  # the kernels' own checks sweep every shape; this one checks the wiring
        K, S, d = b.topk, b.num_steps, b.describe()
        key = (K, S, b.page_size, b.req_to_token.shape[1])
        if key not in builders:
            cfg = _builder_config(b, S + 1 if K == 1 else tree_width(K, S))
            builders[key] = (FlashInferMLABuilder(cfg, device),
                             FlashInferMLABuilder(cfg, device, reference=True))  # fmt: skip
        lens, tree = dict(seq_lens_cpu=b.seq_lens_cpu), ()
        for mode in builders[key][0].modes:
            kw = dict(num_rows=S, **lens) if mode == "draft_decode" else dict(lens)
            if mode == "target_verify" and K > 1:  # a tree: the depths its host part reads
                mask = random_tree_mask(b.batch_size, K, S, tree_width(K, S), g)
                tree, kw["node_depths_cpu"] = (mask.to(device),), mask.sum(-1) - 1
            args = (*_args(b), *tree) if mode == "target_verify" else _args(b)
            got, want = (getattr(mla, mode)(*args, **kw) for mla in builders[key])
            got, want = (r.steps if mode == "draft_decode" else (r,) for r in (got, want))
            for one, ref in zip(got, want, strict=True):
                for p, q in zip(one.passes, ref.passes, strict=True):
                    used = int(p.kv_indptr_host[-1])
                    res.compare(f"{mode} kv_indices", p.kv_indices[:used], q.kv_indices[:used], d)
                    res.compare(f"{mode} kv_indptr_host", p.kv_indptr_host, p.kv_indptr, d)
                    res.compare(f"{mode} qo_indptr_host", p.qo_indptr_host, p.qo_indptr, d)
    for pair in builders.values():
        res.status_bits |= int(pair[0].status.item()) | int(pair[1].status.item())
    return res


@register("fa3_builder")
def _check_fa3_builder(device: torch.device, g: torch.Generator) -> CheckResult:
    """Every FA3 mode's metadata against the same builder running the torch references."""
    from .metadata.fa3 import FA3MetadataBuilder
    from .workloads import random_tree_mask

    res = CheckResult("fa3_builder")
    status = new_status(device)
    builders: dict[tuple, tuple[FA3MetadataBuilder, FA3MetadataBuilder]] = {}
    for b in batches(device, g, extra_tokens=8):
        if b.shape not in ("empty", "odd", "modm1", "near_row_end"):
            continue  # the kernels' own checks sweep every shape; this one checks the wiring
        K, S, ps, d = b.topk, b.num_steps, b.page_size, b.describe()
        n = S + 1 if K == 1 else tree_width(K, S)
        key = (K, S, ps, b.req_to_token.shape[1])
        if key not in builders:
            cfg = _builder_config(b, n)
            builders[key] = (FA3MetadataBuilder(cfg, device),
                             FA3MetadataBuilder(cfg, device, reference=True))  # fmt: skip
        slots = assign_draft_cache_locs(*_args(b), topk=K, num_steps=S, page_size=ps)
        tree = random_tree_mask(b.batch_size, K, S, n, g).to(device)
        results = []
        for fa3 in builders[key]:
            passes = []
            steps = fa3.draft_decode(*_args(b), slots, seq_lens_cpu=b.seq_lens_cpu, num_rows=S,
                                     status=status)  # fmt: skip
            for step in steps:
                passes += [
                    ("draft_decode normal", step.normal),
                    ("draft_decode expand", step.expand),
                ]
            verify = fa3.target_verify(*_args(b), tree, status=status)
            passes += [("target_verify normal", verify.normal), ("target_verify expand", verify.expand),
                       ("draft_extend", fa3.draft_extend(*_args(b), status=status))]  # fmt: skip
            results.append(passes)
        for (what, got), (_, want) in zip(*results, strict=True):
            if got is None or want is None:
                res.compare(
                    f"{what} present", torch.tensor(got is None), torch.tensor(want is None), d
                )
                continue
            for name, value in got.kwargs().items():
                other = getattr(want, name)
                if isinstance(value, torch.Tensor):
                    res.compare(f"{what} {name}", value, other, d)
                else:
                    res.compare(f"{what} {name}", torch.tensor(value), torch.tensor(other), d)
    res.status_bits |= int(status.item())
    return res


# The end-to-end check: (topk, steps, verify-window width) per backend, page size 4 (slot layout
# B for trees). TRT-LLM MLA's chains are served to the plain model; FlashInfer MLA's trees to a
# latent one (MLA: one latent KV head, `ckv` and `kpe` widths; on a GPU the kernel's 512 and 64).
_LOOP_SHAPES = {"fa3": (2, 3, 6), "flashinfer": (2, 3, 6), "trtllm_mla": (1, 3, 4),
                "flashinfer_mla": (2, 3, 6)}  # fmt: skip
_LATENT = ("flashinfer_mla",)
_LOOP_PAGE_SIZE = 4
_LOOP_TOKENS = 12  # new tokens a request, at least: small and CPU-fast


def loop_attention(backend: str, gpu: bool, model_cfg, dtype: torch.dtype,
                   device: torch.device, page_size: int) -> tuple[object, str | None]:  # fmt: skip
    """The attention the lossless loop reads ``backend``'s metadata with, and why it is not the
    real kernel when it is not. On a GPU: FA3 metadata through FlashAttention's CuTe kernels
    (``flash-attn-4``), FlashInfer's through its wrappers and FlashInfer MLA's through its MLA
    kernel (``flashinfer-python``); where that
    package is not installed, the torch consumer, and the reason is returned to be printed
    (an engine that serves one backend need not install the other's kernels to run the
    check). On the CPU, and for TRT-LLM MLA (whose kernels need Blackwell), the torch
    consumer."""
    from .testing.attention import (
        CuteFlashAttention,
        FlashInferAttention,
        FlashInferMLAKernel,
        TorchAttention,
    )

    package = {"fa3": "flash-attn-4", "flashinfer": "flashinfer-python",
               "flashinfer_mla": "flashinfer-python"}.get(backend)  # fmt: skip
    if gpu and package is not None:
        try:
            if backend == "fa3":
                return CuteFlashAttention(), None
            if backend == "flashinfer_mla":
                return FlashInferMLAKernel(model_cfg.num_heads, model_cfg.ckv_dim,
                                           model_cfg.kpe_dim, dtype=dtype, device=device), None  # fmt: skip
            return FlashInferAttention(model_cfg.num_heads, model_cfg.num_kv_heads,
                                       model_cfg.head_dim, dtype=dtype, device=device), None  # fmt: skip
        except ImportError as exc:
            why = (f"the real kernel is not installed here ({exc}): read by the torch consumer; "
                   f"pip install {package} to check through it")  # fmt: skip
            return TorchAttention(page_size=page_size), why
    return TorchAttention(page_size=page_size), None


@register("lossless_loop")
def _check_lossless_loop(device: torch.device, g: torch.Generator) -> CheckResult:
    """Speculative decoding of a tiny model through each backend's metadata, end to end: every
    output equals greedy decoding of the target and every iteration drafts the same tree and
    accepts as many tokens as the same loop on specmeta's references. CPU: the torch models of the attention kernels,
    float64. GPU: the real kernels (FlashAttention's CuTe kernels for FA3, FlashInfer's
    wrappers; the torch model where one is not installed, said in its line:
    :func:`loop_attention`) in bf16, against a float32 reference; near-ties within
    :data:`~specmeta.testing.tiny_model.DEFAULT_MARGIN` are counted, not failed."""
    from .config import SpecConfig
    from .testing.spec_loop import SpeculativeLoop, greedy_agreement, make_requests
    from .testing.tiny_model import DEFAULT_MARGIN, TinyConfig, TinyModel

    res = CheckResult("lossless_loop")
    gpu = device.type == "cuda"
    plain = TinyConfig(hidden_size=256, head_dim=128, intermediate_size=512) if gpu \
        else TinyConfig()  # fmt: skip
    latent = TinyConfig(hidden_size=256, num_heads=16, num_kv_heads=1, ckv_dim=512, kpe_dim=64,
                        intermediate_size=512) if gpu \
        else TinyConfig(num_heads=4, num_kv_heads=1, ckv_dim=32, kpe_dim=16)  # fmt: skip
    dtype = torch.bfloat16 if gpu else torch.float64
    margin = DEFAULT_MARGIN if gpu else 0.0
    models = {}  # per kind of model: its config, target, perturbed draft, reference weights
    for kind, model_cfg in (("plain", plain), ("latent", latent)):
        target = TinyModel.random(model_cfg, int(torch.randint(0, 2**31 - 1, (1,), generator=g)),
                                  dtype=dtype, device=device)  # fmt: skip
        draft = target.perturbed(0.1, int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        reference = target.to(dtype=torch.float32) if gpu else target
        models[kind] = (model_cfg, target, draft, reference)
    for backend, (k, s, n) in _LOOP_SHAPES.items():
        model_cfg, target, draft, reference = models["latent" if backend in _LATENT else "plain"]
        ps = _LOOP_PAGE_SIZE
        attention, missing = loop_attention(backend, gpu, model_cfg, dtype, device, ps)
        requests = make_requests([(0, 0, 1), (0,)], vocab_size=model_cfg.vocab_size,
                                 page_size=ps, max_new_tokens=_LOOP_TOKENS, generator=g)  # fmt: skip
        longest = max(r.prompt.shape[0] + r.max_new_tokens for r in requests)
        cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=3,
                         max_context_len=longest)  # fmt: skip
        runs = {}
        for reference_build in (False, True):
            twins = [dataclasses.replace(r, output=[]) for r in requests]
            loop = SpeculativeLoop(cfg, target, draft, backend=backend, attention=attention,
                                   mode="auto", buckets=(1, 2), reference=reference_build,
                                   timing=gpu and not reference_build,
                                   raise_on_status=False)  # fmt: skip
            runs[reference_build] = (twins, loop.run(twins))
        (served, history), (_, ref_history) = runs[False], runs[True]
        agreement = [greedy_agreement(r, reference, margin) for r in served]
        res.cases += sum(a.tokens for a in agreement) + len(history)
        res.mismatches += sum(a.mismatches for a in agreement)
        for it in history:
            res.status_bits |= it.status

        def accepted(hist):  # per iteration: each request's accepted length and draft tree
            return [[(r.rid, r.accepted, r.tree_tokens, r.tree_parents) for r in it.requests]
                    for it in hist]  # fmt: skip

        same = accepted(history) == accepted(ref_history)
        res.mismatches += 0 if same else 1
        lossless = all(a.lossless for a in agreement)
        for a, r in zip(agreement, served, strict=True):
            if not a.lossless and not res.first_failure:
                res.first_failure = (f"{backend}: request {r.rid} leaves greedy decoding at "
                                     f"token {a.first_mismatch}")  # fmt: skip
        if not same and not res.first_failure:
            res.first_failure = (f"{backend}: acceptance or draft trees differ from the loop "
                                 f"on the references")  # fmt: skip
        per_iteration = " ".join(str(it.tokens) for it in history)
        near = sum(a.near_ties for a in agreement)
        res.details.append(
            f"{backend:<11} ({attention.name}, topk={k}, {s} steps, page size {ps}): tokens per "
            f"iteration {per_iteration}; lossless: {'yes' if lossless else 'no'}"
            + (f" ({near} near-ties within {margin})" if near else "")
            + ("" if same else "; acceptance or trees differ from the references' loop")
            + (f"; {missing}" if missing else "")
        )
        timed = [it.seconds for it in history if it.seconds and it.batch_size]
        if timed:
            mean = {key: 1e3 * sum(t[key] for t in timed) / len(timed) for key in timed[0]}
            res.details.append(
                f"{'':<11} iteration {mean['total']:.2f} ms: metadata {mean['metadata']:.2f}, "
                f"attention {mean['attention']:.2f}, rest {mean['rest']:.2f} (mean of "
                f"{len(timed)})"
            )
    return res


def run_checks(device: torch.device, seed: int, names: list[str] | None = None,
               on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:  # fmt: skip
    """Run the named checks (default: all) with one generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    results = []
    for name in names or list(CHECKS):
        start = time.perf_counter()
        res = CHECKS[name](device, g)
        res.seconds = time.perf_counter() - start
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results
