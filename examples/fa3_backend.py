"""FlashAttention-3 backend: tree draft decode and target verify metadata, eager and graphed.

An FA3 backend creates one :class:`FA3MetadataBuilder` per (config, device); every build writes
its planned buffers and returns :class:`FA3Cascade` objects whose passes' ``kwargs()`` are
``flash_attn_with_kvcache``'s keywords. With ``topk > 1`` each attention is a cascade: a
*normal* pass over the shared prefix and an *expand* pass over each branch's own tokens (or each
tree node's ancestors) on the same query rows, merged by log-sum-exp. A typed
:class:`GraphRunner` runs the same build in one CUDA graph per bucket (on CPU: the same path
without capture) and returns the builder's own result for the batch.

Run: ``python examples/fa3_backend.py [--device cuda] [--seed N]`` (exit status 0 on success).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import specmeta
from specmeta import SpecConfig
from specmeta.kernels.cache_loc_move import KVPool, move_kv_cache
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.kernels.merge_state import merge_state
from specmeta.metadata.fa3 import FA3Cascade, FA3Metadata, FA3MetadataBuilder
from specmeta.runners import GraphRunner, StageBatch, padding
from specmeta.workloads import Batch, make_batch, random_tree_mask

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


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device, cfg, gen = torch.device(args.device), CFG, torch.Generator().manual_seed(args.seed)
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

    # (b) Graphed: the runner owns its inputs (each with its pad); the stage's build is the
    # eager draft with the builder's own launch switch, so the runner hands back the builder's
    # typed result for B — nothing named by string, nothing to cut.
    g_fa3 = FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
    g_bufs = specmeta.allocate_buffers(cfg, device, DRAFT + RUNNER)

    def stage(batch: StageBatch) -> tuple[FA3Cascade, ...]:
        rpi_, lens_ = batch.inputs["req_pool_indices"], batch.inputs["seq_lens"]
        if batch.launch:  # captured once per bucket on the static views [:Bp]
            return draft(g_fa3, g_bufs, rpi_, lens_)
        slots = g_bufs[DRAFT[0]][: rpi_.shape[0] * K * S]  # after a replay: describe [:B]
        return g_fa3.draft_decode(rpi_, r2t, lens_, slots, num_rows=S - 1, launch=False)

    runner = GraphRunner(stage, batch_sizes=[4, 8], device=device, typed=True)
    runner.add_input("req_pool_indices", g_bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", g_bufs["runner.seq_lens"], pad=padding.seq_lens_fill(K, N))
    runner.add_guard("req_to_token", r2t)
    runner.capture()
    for b in (2, 0, B):  # two buckets, an idle rank (B = 0); the last eager build: the whole batch
        want = draft(fa3, bufs, rpi[:b], lens[:b])
        res = runner.run(b, {"req_pool_indices": rpi[:b], "seq_lens": lens[:b]}, copy=False)
        for s, (got, mine) in enumerate(zip(res.results, want, strict=True)):
            pairs = ((got.normal.page_table, mine.normal.page_table),
                     (got.normal.cache_seqlens, mine.normal.cache_seqlens),
                     (got.expand.page_table, mine.expand.page_table),
                     (got.expand.cache_seqlens, mine.expand.cache_seqlens))  # fmt: skip
            if not all(torch.equal(g, m) for g, m in pairs):
                raise AssertionError(f"B={b}, forward {s}: the runner's metadata != the eager one")
        print(f"runner, B={b} (bucket {res.padded_batch_size}): equal to the eager build")
    specmeta.check_status(status, where="fa3 example")  # the one sync, once per iteration
    return Result(cfg, batch, bufs[DRAFT[0]][: B * K * S], tree, kv_cache, steps, verify)


if __name__ == "__main__":
    main()
