"""TRT-LLM MLA backend: tree draft decode, draft extend and (chain) target verify metadata.

A TRT-LLM MLA attention backend creates one :class:`TrtllmMlaBuilder` per (config, device).
TRT-LLM MLA reads one block-table row per query sequence (``block_kv_indices``, page ids, −1
beyond use) and its KV length (``seq_lens_k``); it has no cascade and no custom mask. So a tree
draft (``topk > 1``) is served by **per-branch block tables**: each branch row lists the
request's whole prefix pages, then the pages of its own region (slot layout B), whose first
slots must hold a copy of the prefix tail (``prefix_tail_copy_pairs`` + ``move_kv_cache``).
For the same reason a tree cannot be *verified* with TRT-LLM MLA (verify trees with the FA3 or
FlashInfer builders); a chain (MTP, ``topk == 1``) can, and draft extend always can.

Run: ``python examples/trtllm_mla_backend.py [--device cuda] [--seed N]`` (exit status 0 on
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
from specmeta.kernels.cache_loc_move import KVPool, bind_move_kv_cache, move_kv_cache  # noqa: E402
from specmeta.kernels.draft_cache_locs import (  # noqa: E402
    assign_draft_cache_locs,
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
    prefix_tail_copy_pairs,
)
from specmeta.metadata.trtllm_mla import (  # noqa: E402
    TrtllmMlaBuilder,
    TrtllmMlaDraftDecode,
    TrtllmMlaPrefill,
)
from specmeta.runners import GraphRunner, padding  # noqa: E402
from specmeta.workloads import Batch, make_batch  # noqa: E402

# A tree draft: 2 branches, 3 steps, a 6-node verify tree, pages of 16 tokens (slot layout B).
CFG = SpecConfig(topk=2, num_steps=3, num_draft_tokens=6, page_size=16, max_bs=8,
                 max_context_len=40)  # fmt: skip
# The same engine with an MTP chain (topk = 1, N = S + 1): what TRT-LLM MLA can verify.
CHAIN = dataclasses.replace(CFG, topk=1, num_draft_tokens=CFG.num_steps + 1)
H, LATENT = 16, 32  # query heads; MLA's compressed KV (ckv + k_pe) a token, one KV "head"
# Planned buffers the example allocates itself (each builder allocates its own "<backend>.*").
DRAFT = ["draft.out_cache_loc", "draft.prefix_tail_tgt", "draft.prefix_tail_src"]
RUNNER = ["runner.req_pool_indices", "runner.seq_lens"]


@dataclasses.dataclass
class Result:
    """What :func:`main` built eagerly, for the tests to check against dense attention."""

    cfg: SpecConfig
    batch: Batch
    ckv_cache: torch.Tensor  # [P, 1, LATENT] one layer's latent cache, prefix tails copied
    draft: TrtllmMlaDraftDecode  # steps[s]: one per draft forward (S - 1), one row per branch
    extend: TrtllmMlaPrefill  # draft extend, N query rows a request
    verify: TrtllmMlaPrefill  # target verify of the CHAIN config, S + 1 query rows a request


def trtllm_batch_decode_with_kv_cache_mla(**kwargs) -> None:
    """Stand-in for FlashInfer's TRT-LLM MLA kernel (not imported here): prints its arguments."""
    args = (f"{k}={list(v.shape)}" if torch.is_tensor(v) else f"{k}={v}" for k, v in kwargs.items())
    print(f"  trtllm_batch_decode_with_kv_cache_mla({', '.join(args)}, ...)")


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
    top = int(batch.seq_lens_cpu.max())  # host max L: checked against the plan before launch
    # One layer's latent cache (random: the prefixes' KV, written at prefill).
    ckv_cache = torch.randn(batch.pool_size, 1, LATENT, generator=gen).to(device)
    ckv = KVPool([ckv_cache])  # move_kv_cache's table of the cache's buffers, built once
    status = specmeta.new_status(device)

    def draft(mla: TrtllmMlaBuilder, bufs: dict, rpi, lens, **kw) -> TrtllmMlaDraftDecode:
        """Draft slots (the draft KV goes there), prefix-tail copies, per-branch block tables."""
        common = dict(topk=K, num_steps=S, page_size=ps, status=status)
        assign_draft_cache_locs(rpi, r2t, lens, out_cache_loc=bufs[DRAFT[0]], **common)
        tgt, src = prefix_tail_copy_pairs(rpi, r2t, lens, tgt=bufs[DRAFT[1]], src=bufs[DRAFT[2]],
                                          **common)  # fmt: skip
        n = rpi.shape[0] * (K - 1) * (ps - 1)  # branch t >= 1 reads its first page whole
        move_kv_cache(ckv, tgt[:n], src[:n], disjoint=True, status=status)
        return mla.draft_decode(rpi, r2t, lens, status=status, **kw)

    # (a) Eager: the builder is created once; every build reuses its planned buffers.
    mla = TrtllmMlaBuilder(cfg, device)
    bufs = specmeta.allocate_buffers(cfg, device, DRAFT)
    meta = draft(mla, bufs, rpi, lens, max_seq_len=top)
    steps = meta.steps  # draft forward s reads steps[s]
    print(f"draft decode, B={B}, forward 0 of {len(steps)}: one query sequence per branch")
    kv_pages = ckv_cache.view(-1, ps, LATENT)
    trtllm_batch_decode_with_kv_cache_mla(
        query=torch.zeros(B * K, 1, H, LATENT, device=device), kv_cache=kv_pages,
        block_tables=steps[0].block_kv_indices, seq_lens=steps[0].seq_lens_k,
        max_seq_len=steps[0].max_seq_len_k)  # fmt: skip
    extend = mla.draft_extend(rpi, r2t, lens, max_seq_len=top, status=status)
    chain = TrtllmMlaBuilder(CHAIN, device)  # verify a chain: a tree would need a custom mask
    verify = chain.target_verify(rpi, r2t, lens, max_seq_len=top, status=status)
    for mode, m in (("draft extend", extend), ("target verify (chain)", verify)):
        # cu_seqlens_q = n·arange(B + 1), the same at capture and replay: request i owns query
        # rows [n·i, n·(i + 1)), so the sum_seq_lens_q rows view as [B, n] without a pad step.
        n = m.max_seq_len_q
        print(f"{mode}: cu_seqlens_q={list(m.cu_seqlens_q.shape)} = {n}·arange, causal")
        q = torch.zeros(m.sum_seq_lens_q, H, LATENT, device=device)
        trtllm_batch_decode_with_kv_cache_mla(
            query=q.view(B, n, H, LATENT), kv_cache=kv_pages,
            block_tables=m.block_kv_indices, seq_lens=m.seq_lens_k,
            max_seq_len=m.max_seq_len_k)  # fmt: skip

    # (b) Graphed: the runner owns its inputs (each with its pad) and binds draft()'s work
    # (bind_<op>, bind_<mode>) to its static views: once per bucket (the graph) and once per
    # batch size (the host part, which checks seq_lens_cpu against the plan), so each run
    # hands back the builder's typed result for B.
    g_mla = TrtllmMlaBuilder(cfg, device, modes=("draft_decode",))
    g_bufs = specmeta.allocate_buffers(cfg, device, DRAFT + RUNNER)

    def stage(inputs) -> Stage:
        """draft(), bound to the runner's static views."""
        rpi_, lens_ = inputs["req_pool_indices"], inputs["seq_lens"]
        common = dict(topk=K, num_steps=S, page_size=ps, status=status)
        tgt, src = g_bufs[DRAFT[1]], g_bufs[DRAFT[2]]
        n = rpi_.shape[0] * (K - 1) * (ps - 1)
        decode = g_mla.bind_draft_decode(rpi_, r2t, lens_, status=status)
        return Stage([bind_assign_draft_cache_locs(rpi_, r2t, lens_,
                                                   out_cache_loc=g_bufs[DRAFT[0]], **common),
                      bind_prefix_tail_copy_pairs(rpi_, r2t, lens_, tgt=tgt, src=src, **common),
                      bind_move_kv_cache(ckv, tgt[:n], src[:n], disjoint=True, status=status),
                      decode], host=decode.host)  # fmt: skip

    runner = GraphRunner(stage, batch_sizes=[4, 8], device=device)
    runner.add_input("req_pool_indices", g_bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", g_bufs["runner.seq_lens"], pad=padding.seq_lens_fill(K, N),
                     host_mirror=True)  # fmt: skip
    runner.add_guard("req_to_token", r2t)
    runner.capture()
    for b in (2, 0, B):  # two buckets, an idle rank (B = 0); the last eager build: the whole batch
        want = draft(mla, bufs, rpi[:b], lens[:b], seq_lens_cpu=batch.seq_lens_cpu[:b]).steps
        res = runner.run(b, {"req_pool_indices": rpi[:b], "seq_lens": lens[:b]},
                         host_inputs={"seq_lens": batch.seq_lens_cpu[:b]})  # fmt: skip
        for s, (got, mine) in enumerate(zip(res.results.steps, want, strict=True)):
            if not (torch.equal(got.block_kv_indices, mine.block_kv_indices)
                    and torch.equal(got.seq_lens_k, mine.seq_lens_k)
                    and got.max_seq_len_k == mine.max_seq_len_k):  # fmt: skip
                raise AssertionError(f"B={b}, step {s}: the runner's tables != the eager ones")
        print(f"runner, B={b} (bucket {res.padded_batch_size}): equal to the eager build")
    specmeta.check_status(status, where="trtllm_mla example")  # the one sync, once per iteration
    return Result(cfg, batch, ckv_cache, meta, extend, verify)


if __name__ == "__main__":
    main()
