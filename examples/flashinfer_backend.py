"""FlashInfer backend: tree draft decode and target verify metadata, eager and graphed.

A FlashInfer attention backend creates one :class:`FlashInferBuilder` per (config, device).
Each build writes the builder's planned buffers and returns dataclasses of views named after
``plan()``'s arguments, plus **host mirrors** (``*_host``) of the index pointers, computed from
the CPU ``seq_lens`` the engine already holds: ``plan()`` reads them without a device-to-host
copy. Draft decode gives each branch a page-size-1 token list (its prefix, then its own chain),
so the tree needs no mask; target verify gives each request its prefix plus the tree window and
a flat custom mask. Under a :class:`GraphRunner` the lists are built inside the graph, and the
stage's host part (``bind_draft_decode(...).host(seq_lens_cpu)``) writes the host mirrors of the
batch before each replay.

Run: ``python examples/flashinfer_backend.py [--device cuda] [--seed N]`` (exit status 0 on
success; on the CPU the kernels run in Triton's interpreter, switched on below before Triton is
imported).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from specmeta.testing.script_device import parse_device  # noqa: E402

if __name__ == "__main__":
    parse_device(__file__)  # before the imports below: they import Triton

import specmeta  # noqa: E402
from specmeta import SpecConfig, Stage  # noqa: E402
from specmeta.metadata.flashinfer import (  # noqa: E402
    FlashInferBuilder,
    FlashInferDraftDecode,
    FlashInferPrefill,
)
from specmeta.runners import GraphRunner, padding  # noqa: E402
from specmeta.workloads import Batch, make_batch, random_tree_mask  # noqa: E402

# A tree draft: 3 branches, 3 steps, a 6-node verify tree, pages of 16 tokens in the pool.
CFG = SpecConfig(topk=3, num_steps=3, num_draft_tokens=6, page_size=16, max_bs=8,
                 max_context_len=40)  # fmt: skip
H, H_KV, D = 8, 2, 16  # the model's attention heads (query, KV) and head size
# Planned buffers the example allocates itself (the builder allocates its own "flashinfer.*").
RUNNER = ["runner.req_pool_indices", "runner.seq_lens"]


@dataclasses.dataclass
class Result:
    """What :func:`main` built eagerly, for the tests to check against dense attention."""

    cfg: SpecConfig
    batch: Batch
    tree_mask: torch.Tensor  # [B, N, N] ancestor mask of the verified trees
    draft: FlashInferDraftDecode  # steps[s]: one per draft forward (S - 1)
    verify: FlashInferPrefill


class Wrapper:
    """Stand-in for a FlashInfer wrapper (not imported here): ``plan()`` prints its arguments."""

    def __init__(self, name: str):
        self.name = name

    def plan(self, **kwargs) -> None:
        def show(v):
            if torch.is_tensor(v):
                return f"{list(v.shape)}@{v.device.type}"
            return f"[{', '.join(map(show, v))}]" if isinstance(v, list) else str(v)

        print(f"  {self.name}.plan({', '.join(f'{k}={show(v)}' for k, v in kwargs.items())})")


def main(argv: list[str] | None = None) -> Result:
    device = parse_device(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(device))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg, gen = CFG, torch.Generator().manual_seed(args.seed)
    K, S, N = cfg.topk, cfg.num_steps, cfg.num_draft_tokens
    batch = make_batch("random", batch_size=5, topk=K, num_steps=S, page_size=cfg.page_size,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=N, max_len=cfg.max_context_len)  # fmt: skip
    rpi, r2t, lens, B = batch.req_pool_indices, batch.req_to_token, batch.seq_lens, batch.batch_size
    lens_cpu = batch.seq_lens_cpu  # the engine's host copy of seq_lens: no sync to get it
    status = specmeta.new_status(device)

    # Stand-ins of FlashInfer's wrappers: their plan() prints what it receives.
    decode = Wrapper("BatchDecodeWithPagedKVCacheWrapper")
    cascade = Wrapper("MultiLevelCascadeAttentionWrapper")
    prefill = Wrapper("BatchPrefillWithPagedKVCacheWrapper")

    # (a) Eager: the builder is created once; every build reuses its planned buffers.
    fi = FlashInferBuilder(cfg, device)
    draft = fi.draft_decode(rpi, r2t, lens, seq_lens_cpu=lens_cpu, status=status)
    print(f"draft decode, B={B}, forward 0 of {len(draft.steps)}: one query row per branch")
    step = draft.steps[0]  # draft forward s plans with steps[s]; *_host: CPU, no sync
    decode.plan(indptr=step.kv_indptr_host, indices=step.kv_indices,
                last_page_len=step.kv_last_page_len_host, num_qo_heads=H, num_kv_heads=H_KV,
                head_dim=D, page_size=step.page_size)  # fmt: skip
    # The same forwards as a two-level cascade: level 0 lists each prefix once for the K query
    # rows of its request, level 1 each branch's own draft slots; the wrapper merges the levels.
    shared = fi.draft_decode_shared_prefix(rpi, r2t, lens, seq_lens_cpu=lens_cpu, status=status)
    levels = shared.steps[0]
    cascade.plan(qo_indptr_arr=list(levels.qo_indptr_host_arr),
                 paged_kv_indptr_arr=list(levels.paged_kv_indptr_host_arr),
                 paged_kv_indices_arr=list(levels.paged_kv_indices_arr),
                 paged_kv_last_page_len=list(levels.paged_kv_last_page_len_host_arr),
                 num_qo_heads=H, num_kv_heads=H_KV, head_dim=D,
                 page_size=levels.page_size)  # fmt: skip
    tree = random_tree_mask(B, K, S, N, gen).to(device)
    verify = fi.target_verify(rpi, r2t, lens, tree, seq_lens_cpu=lens_cpu, status=status)
    print("target verify: one query row per tree node, the tree as a custom mask")
    prefill.plan(qo_indptr=verify.qo_indptr_host, paged_kv_indptr=verify.kv_indptr_host,
                 paged_kv_indices=verify.kv_indices,
                 paged_kv_last_page_len=verify.kv_last_page_len_host,
                 num_qo_heads=H, num_kv_heads=H_KV, head_dim_qk=D, page_size=verify.page_size,
                 custom_mask=verify.custom_mask, causal=verify.causal)  # fmt: skip

    # (b) Graphed: the runner owns its inputs (each with its pad) and binds the stage, one
    # builder mode, to its static views: once per bucket (the graph holds its launches) and
    # once per batch size (its host part writes the plan() mirrors from the CPU seq_lens
    # before each replay), so each run hands back the builder's own result for B.
    g_fi = FlashInferBuilder(cfg, device, modes=("draft_decode",))
    g_bufs = specmeta.allocate_buffers(cfg, device, RUNNER)

    def stage(inputs) -> Stage:
        return g_fi.bind_draft_decode(
            inputs["req_pool_indices"], r2t, inputs["seq_lens"], status=status
        )

    runner = GraphRunner(stage, batch_sizes=[4, 8], device=device)
    runner.add_input("req_pool_indices", g_bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", g_bufs["runner.seq_lens"], pad=padding.seq_lens_fill(K, N),
                     host_mirror=True)  # fmt: skip
    runner.add_guard("req_to_token", r2t)
    runner.capture()
    for b in (2, 0, B):  # two buckets, an idle rank (B = 0); the last eager build: the whole batch
        want = fi.draft_decode(rpi[:b], r2t, lens[:b], seq_lens_cpu=lens_cpu[:b], status=status)
        res = runner.run(b, {"req_pool_indices": rpi[:b], "seq_lens": lens[:b]},
                         host_inputs={"seq_lens": lens_cpu[:b]})  # fmt: skip
        for s, (got, mine) in enumerate(zip(res.results.steps, want.steps, strict=True)):
            used = int(mine.kv_indptr_host[-1])  # a host value: no sync
            if not (torch.equal(got.kv_indptr, mine.kv_indptr)
                    and torch.equal(got.kv_indices[:used], mine.kv_indices[:used])
                    and torch.equal(got.kv_indptr_host, mine.kv_indptr_host)):  # fmt: skip
                raise AssertionError(f"B={b}, step {s}: the runner's lists != the eager ones")
        print(f"runner, B={b} (bucket {res.padded_batch_size}): equal to the eager build")
    specmeta.check_status(status, where="flashinfer example")  # the one sync, once per iteration
    return Result(cfg, batch, tree, draft, verify)


if __name__ == "__main__":
    main()
