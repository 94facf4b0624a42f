"""What our own host checks cost in a bind, on the CPU (issue 37's eager target).

Usage: ``TRITON_INTERPRET=1 python3 scripts/bind_cost.py [--rounds R] [--calls N] [--profile]
[--only NAME ...]``. Under Triton's interpreter :meth:`specmeta.launch.Launcher.bind` returns
a ``functools.partial`` (no ``JITFunction.warmup``), so timing ``builder.bind_<mode>(...)`` or
``bind_<launcher>(...)`` without calling the stage it returns measures the checks, views and
packing that specmeta does itself: the part of an eager call this library owns. Prints, per
bind, µs per call (median of ``R`` rounds of ``N`` back-to-back binds) as JSON; with
``--profile``, the functions that take the most time under ``cProfile``. ``B = 64``, ``K =
8``, ``S = 5``, ``N = 16`` as in the GPU measurement of the brief (FA3 at page size 16, the
page-size-1 backends at 1); a TRT-LLM MLA tree verify at ``K = 8``, its chain form at ``K =
1``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

B, K, S, N, CTX = 64, 8, 5, 16, 4096


def _batch(cfg, ps: int, topk: int, seed: int):
    from specmeta.workloads import make_batch, random_tree_mask

    gen = torch.Generator().manual_seed(seed)
    batch = make_batch("random", batch_size=B, topk=topk, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cpu",
                       extra_tokens=N, max_len=CTX)  # fmt: skip
    tree = random_tree_mask(B, topk, S, N, gen) if topk > 1 else None
    return batch, tree


def cases() -> dict:
    """``name -> bind()``: each a bind whose stage is dropped uncalled."""
    from specmeta import SpecConfig, plan_buffers
    from specmeta.kernels.draft_cache_locs import bind_assign_draft_cache_locs
    from specmeta.kernels.draft_decode_kv_indices import bind_draft_decode_kv_indices
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder
    from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder

    out = {}
    for ps in (16, 1):
        cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=B,
                         max_context_len=CTX)  # fmt: skip
        batch, tree = _batch(cfg, ps, K, ps)
        t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
        slots = torch.zeros(B * K * S, dtype=torch.int64)
        if ps == 16:
            fa3 = FA3MetadataBuilder(cfg, "cpu", modes=("draft_decode", "target_verify"))
            out["fa3.draft_decode"] = lambda fa3=fa3, t=t, s=slots: fa3.bind_draft_decode(*t, s)
            out["fa3.target_verify"] = lambda fa3=fa3, t=t, m=tree: fa3.bind_target_verify(*t, m)
            out["assign_draft_cache_locs"] = lambda t=t, s=slots: bind_assign_draft_cache_locs(
                *t, topk=K, num_steps=S, page_size=16, out_cache_loc=s)  # fmt: skip
            continue
        fi = FlashInferBuilder(cfg, "cpu", modes=("draft_decode", "target_verify"))
        real = torch.full((B,), N, dtype=torch.int32)
        out["flashinfer.draft_decode"] = lambda fi=fi, t=t: fi.bind_draft_decode(*t)
        out["flashinfer.target_verify"] = lambda fi=fi, t=t, m=tree: fi.bind_target_verify(*t, m)
        out["flashinfer.target_verify ragged"] = (
            lambda fi=fi, t=t, m=tree, v=real: fi.bind_target_verify(
                *t, m, verify_lens=v, num_tokens=B * N))  # fmt: skip
        mla = FlashInferMLABuilder(cfg, "cpu", modes=("draft_decode",))
        out["flashinfer_mla.draft_decode"] = lambda mla=mla, t=t: mla.bind_draft_decode(*t)
        trt = TrtllmMlaBuilder(cfg, "cpu", modes=("draft_decode", "target_verify"))
        out["trtllm_mla.draft_decode"] = lambda trt=trt, t=t: trt.bind_draft_decode(*t)
        out["trtllm_mla.target_verify tree"] = (
            lambda trt=trt, t=t, m=tree: trt.bind_target_verify(*t, m))  # fmt: skip
        plan = plan_buffers(cfg)
        idx, ptr = (plan[f"draft_decode.{f}"].allocate("cpu") for f in ("kv_indices", "kv_indptr"))
        out["draft_decode_kv_indices"] = lambda t=t, i=idx, p=ptr: bind_draft_decode_kv_indices(
            *t, topk=K, num_steps=S, page_size=1, kv_indices=i, kv_indptr=p)  # fmt: skip
    chain = SpecConfig(topk=1, num_steps=S, num_draft_tokens=S + 1, page_size=16, max_bs=B,
                       max_context_len=CTX)  # fmt: skip
    batch, _ = _batch(chain, 16, 1, 3)
    t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    trt1 = TrtllmMlaBuilder(chain, "cpu", modes=("target_verify",))
    out["trtllm_mla.target_verify chain"] = lambda trt=trt1, t=t: trt.bind_target_verify(*t)
    return out


def per_call_us(fn, rounds: int, calls: int) -> float:
    """Median over ``rounds`` rounds of ``calls`` back-to-back calls, µs per call."""
    for _ in range(min(calls, 50)):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(sorted(times)[len(times) // 2], 1)


def top_functions(fn, calls: int, limit: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--only", nargs="*")
    a = p.parse_args()
    found = {name: fn for name, fn in cases().items() if not a.only or name in a.only}
    result = {}
    for name, fn in found.items():
        result[name] = per_call_us(fn, a.rounds, a.calls)
        if a.profile:
            print(f"== {name}: {result[name]} µs\n{top_functions(fn, a.calls)}")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
