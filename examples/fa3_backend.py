"""FlashAttention-3 backend: tree draft decode and target verify metadata, eager, bound and graphed.

An FA3 backend creates one :class:`FA3MetadataBuilder` per (config, device); every build writes
its planned buffers and returns :class:`FA3Cascade` objects whose passes' ``kwargs()`` are
``flash_attn_with_kvcache``'s keywords. With ``topk > 1`` each attention is a cascade: a
*normal* pass over the shared prefix and an *expand* pass over each branch's own tokens (or each
tree node's ancestors) on the same query rows, merged by log-sum-exp.

Three ways to build the same draft-decode metadata:

* **eager**: ``fa3.draft_decode(...)`` checks its tensors, launches and returns the result;
* **bound once**: ``fa3.bind_draft_decode(...)`` (and ``bind_<op>`` of every launcher) checks
  the tensors and binds the launches to them once; every step then calls ``stage.launch()``
  and ``stage.host(seq_lens_cpu)`` (the result, its exact ``max_seqlen_k``), and nothing else;
* **graphed**: a :class:`GraphRunner` binds the same stage function once per bucket to its
  static inputs and captures it in one CUDA graph per bucket (on CPU: the same path without
  capture); each run returns the builder's own result for the batch.

Run: ``python examples/fa3_backend.py [--device cuda] [--seed N]`` (exit status 0 on success;
on the CPU the kernels run in Triton's interpreter, switched on below before Triton is imported).
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
from specmeta.kernels.cache_loc_move import KVPool, bind_move_kv_cache, move_kv_cache  # noqa: E402
from specmeta.kernels.draft_cache_locs import (  # noqa: E402
    assign_draft_cache_locs,
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
    prefix_tail_copy_pairs,
)
from specmeta.kernels.merge_state import merge_state  # noqa: E402
from specmeta.metadata.fa3 import FA3Cascade, FA3Metadata, FA3MetadataBuilder  # noqa: E402
from specmeta.runners import GraphRunner, padding  # noqa: E402
from specmeta.workloads import Batch, make_batch, random_tree_mask  # noqa: E402

# A tree draft: 4 branches, 3 steps, an 8-node verify tree, pages of 4 tokens (slot layout B).
CFG = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=4, max_bs=8,
                 max_context_len=32)  # fmt: skip
H, H_KV, D = 8, 2, 16  # the model's attention heads (query, KV) and head size
# Planned buffers the example allocates itself (each builder allocates its own "<backend>.*").
DRAFT = ["draft.out_cache_loc", "draft.prefix_tail_tgt", "draft.prefix_tail_src"]
RUNNER = ["runner.req_pool_indices", "runner.seq_lens"]


@dataclasses.dataclass
class Result:
    """What :func:`main` built eagerly, for the tests to check against dense attention."""

    cfg: SpecConfig
    batch: Batch
    out_cache_loc: torch.Tensor  # [B*K*S] draft slots, laid out [B, K, S]
    tree_mask: torch.Tensor  # [B, N, N] ancestor mask of the verified trees
    kv_cache: list[torch.Tensor]  # [K, V] of one layer, [P, H_KV, D], prefix tails copied
    draft: tuple[FA3Cascade, ...]  # one per draft forward (S - 1)
    verify: FA3Cascade


def flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs):
    """Stand-in for FA3's kernel (not imported here): prints the arguments it receives and
    returns zeros of the kernel's shapes: ``out [T, H, D]`` and, with ``return_softmax_lse``,
    ``lse [H, T]`` float32."""
    args = [f"{k}={list(v.shape) if torch.is_tensor(v) else v}" for k, v in kwargs.items()]
    print(f"  flash_attn_with_kvcache(q={list(q.shape)}, k_cache={list(k_cache.shape)}, v_cache, "
          f"{', '.join(args)})")  # fmt: skip
    out = torch.zeros_like(q)
    if not kwargs["return_softmax_lse"]:
        return out
    return out, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)


def same_tables(got: tuple[FA3Cascade, ...], want: tuple[FA3Cascade, ...]) -> bool:
    """Whether two draft-decode results hold the same tables, forward by forward."""
    for g, w in zip(got, want, strict=True):
        pairs = ((g.normal.page_table, w.normal.page_table),
                 (g.normal.cache_seqlens, w.normal.cache_seqlens),
                 (g.expand.page_table, w.expand.page_table),
                 (g.expand.cache_seqlens, w.expand.cache_seqlens))  # fmt: skip
        if not all(torch.equal(a, b) for a, b in pairs):
            return False
    return True


def main(argv: list[str] | None = None) -> Result:
    device = parse_device(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(device))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg, gen = CFG, torch.Generator().manual_seed(args.seed)
    K, S, N, ps = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, cfg.page_size
    batch = make_batch("random", batch_size=5, topk=K, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=N, max_len=cfg.max_context_len)  # fmt: skip
    rpi, r2t, lens, B = batch.req_pool_indices, batch.req_to_token, batch.seq_lens, batch.batch_size
    # One layer's K and V cache (random: the prefixes' KV) and its table for move_kv_cache.
    kv_cache = [torch.randn(batch.pool_size, H_KV, D, generator=gen).to(device) for _ in "kv"]
    kv_pool, status = KVPool(kv_cache), specmeta.new_status(device)

    def draft(fa3: FA3MetadataBuilder, bufs: dict, rpi, lens) -> tuple[FA3Cascade, ...]:
        """Draft slots, prefix-tail copies (layout B), then the FA3 metadata of every forward."""
        kw = dict(topk=K, num_steps=S, page_size=ps, status=status)
        slots = assign_draft_cache_locs(rpi, r2t, lens, out_cache_loc=bufs[DRAFT[0]], **kw)
        tgt, src = prefix_tail_copy_pairs(rpi, r2t, lens, tgt=bufs[DRAFT[1]], src=bufs[DRAFT[2]],
                                          **kw)  # fmt: skip
        n = rpi.shape[0] * (K - 1) * (ps - 1)  # the expand pass reads whole pages of branch t >= 1
        move_kv_cache(kv_pool, tgt[:n], src[:n], disjoint=True, status=status)
        return fa3.draft_decode(rpi, r2t, lens, slots, num_rows=S - 1, status=status)

    def attend(q: torch.Tensor, cascade: FA3Cascade) -> torch.Tensor:
        """The attention of the backend's forward: one pass, or a cascade's two passes over
        disjoint keys (the shared prefix; each row's own chain or tree ancestors) merged by
        their log-sum-exp. An empty pass has LSE −inf and weight 0 in the merge."""

        def run(meta: FA3Metadata):
            k_cache, v_cache = (c.view(-1, meta.page_size, H_KV, D) for c in kv_cache)
            return flash_attn_with_kvcache(q, k_cache, v_cache, **meta.kwargs())

        if not cascade.is_cascade:
            return run(cascade.normal)
        o, lse = run(cascade.normal)
        o_expand, lse_expand = run(cascade.expand)
        merge_state(o, lse.t(), o_expand, lse_expand.t(), out=o)  # LSEs come as [H, T]
        return o

    # (a) Eager: the builder is created once; every build reuses its planned buffers.
    fa3, bufs = FA3MetadataBuilder(cfg, device), specmeta.allocate_buffers(cfg, device, DRAFT)
    steps = draft(fa3, bufs, rpi, lens)
    print(f"draft decode, B={B}, forward 0 of {len(steps)}: one query row per branch")
    attend(torch.zeros(B * K, H, D, device=device), steps[0])
    tree = random_tree_mask(B, K, S, N, gen).to(device)
    verify = fa3.target_verify(rpi, r2t, lens, tree, seq_lens_cpu=batch.seq_lens_cpu,
                               status=status)  # fmt: skip
    print("target verify: one query row per tree node (expand pass: token slots, page size 1)")
    attend(torch.zeros(B * N, H, D, device=device), verify)

    def bind_draft(fa3: FA3MetadataBuilder, bufs: dict, rpi, lens) -> Stage:
        """draft() bound once to these tensors: every check and every kernel lookup happens
        here. The stage's launches are draft()'s, in order; its host part is draft decode's
        (from seq_lens_cpu: the exact max_seqlen_k), which returns the result."""
        kw = dict(topk=K, num_steps=S, page_size=ps, status=status)
        n = rpi.shape[0] * (K - 1) * (ps - 1)
        tgt, src = bufs[DRAFT[1]], bufs[DRAFT[2]]
        decode = fa3.bind_draft_decode(rpi, r2t, lens, bufs[DRAFT[0]], num_rows=S - 1,
                                       status=status)  # fmt: skip
        return Stage([bind_assign_draft_cache_locs(rpi, r2t, lens, out_cache_loc=bufs[DRAFT[0]],
                                                   **kw),
                      bind_prefix_tail_copy_pairs(rpi, r2t, lens, tgt=tgt, src=src, **kw),
                      bind_move_kv_cache(kv_pool, tgt[:n], src[:n], disjoint=True, status=status),
                      decode], host=decode.host)  # fmt: skip

    # (b) Bound once: an engine keeps its batch in persistent tensors, binds the stage to them
    # once, and every step writes the step's batch into them, runs the host part on the step's
    # seq_lens_cpu, which returns the metadata, then makes the launches (stage.launch(), or the
    # replay of a graph that captured them). Here: the batch, then reversed.
    b_fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
    b_bufs = specmeta.allocate_buffers(cfg, device, DRAFT)
    rpi_now, lens_now, lens_cpu_now = rpi.clone(), lens.clone(), batch.seq_lens_cpu.clone()
    stage = bind_draft(b_fa3, b_bufs, rpi_now, lens_now)  # once
    for order in (torch.arange(B), torch.arange(B - 1, -1, -1)):
        rpi_now.copy_(rpi[order.to(device)])
        lens_now.copy_(lens[order.to(device)])
        lens_cpu_now.copy_(batch.seq_lens_cpu[order])
        got = stage.host(lens_cpu_now)  # every step: the exact max_seqlen_k, and the result
        stage.launch()  # every step: the bound launches, nothing checked again
        top = int(lens_cpu_now.max())
        exact = got[0].normal.max_seqlen_k == top - top % ps  # layout B: whole pages of max L
        if not (exact and same_tables(got, draft(fa3, bufs, rpi_now, lens_now))):
            raise AssertionError("the bound stage's metadata != the eager one")
    print(f"bound stage, B={B}, two steps: equal to the eager build")

    # (c) Graphed: the runner owns its inputs (each with its pad) and binds the same stage
    # function to its static views, once per bucket (the graph) and once per batch size (the
    # host part), so each run hands back the builder's typed result for B: nothing named by
    # string, nothing to cut.
    g_fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
    g_bufs = specmeta.allocate_buffers(cfg, device, DRAFT + RUNNER)

    def draft_stage(inputs) -> Stage:
        return bind_draft(g_fa3, g_bufs, inputs["req_pool_indices"], inputs["seq_lens"])

    runner = GraphRunner(draft_stage, batch_sizes=[4, 8], device=device)
    runner.add_input("req_pool_indices", g_bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", g_bufs["runner.seq_lens"], pad=padding.seq_lens_fill(K, N),
                     host_mirror=True)  # fmt: skip
    runner.add_guard("req_to_token", r2t)
    runner.capture()
    for b in (2, 0, B):  # two buckets, an idle rank (B = 0); the last eager build: the whole batch
        want = draft(fa3, bufs, rpi[:b], lens[:b])
        res = runner.run(b, {"req_pool_indices": rpi[:b], "seq_lens": lens[:b]},
                         host_inputs={"seq_lens": batch.seq_lens_cpu[:b]})  # fmt: skip
        if not same_tables(res.results, want):
            raise AssertionError(f"B={b}: the runner's metadata != the eager one")
        print(f"runner, B={b} (bucket {res.padded_batch_size}): equal to the eager build")
    specmeta.check_status(status, where="fa3 example")  # the one sync, once per iteration
    return Result(cfg, batch, bufs[DRAFT[0]][: B * K * S], tree, kv_cache, steps, verify)


if __name__ == "__main__":
    main()
