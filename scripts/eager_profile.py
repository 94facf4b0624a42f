"""Where an eager call's host time goes (issue 37's eager target), on a GPU.

Usage: ``python3 scripts/eager_profile.py [--calls N]``. Prints, in one process: the floors of
an empty kernel (``floor_jit``, ``floor_run``) beside Triton's ``JITFunction.warmup`` of it
(what a bind pays per kernel to find its compiled handle), then for an eager FA3 and FlashInfer
draft decode and the ``draft_decode_kv_indices`` launcher the split of one call into its bind
(host checks and one ``warmup`` per kernel), its host part and its launch, and the functions
that take the most time under ``cProfile``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

S, N, CTX, PS = 5, 16, 4096, 16


def per_call_us(fn, calls: int) -> float:
    """Median over 7 rounds of ``calls`` back-to-back calls, µs per call."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[3]


def top_functions(fn, calls: int, limit: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    calls = p.parse_args().calls
    from bench.harness import _empty_kernel_with, floor_calls

    floors = floor_calls(8, 12)
    kernel = _empty_kernel_with(8, 12)
    buf = torch.zeros(16, dtype=torch.int32, device="cuda")
    args = [buf] * 8 + [7] * 12
    print("floors (8 pointers, 12 ints), µs per call:")
    for name in ("floor_jit", "floor_run"):
        print(f"  {name:<22} {per_call_us(floors[name], calls):7.2f}")
    print(f"  {'warmup (no launch)':<22} "
          f"{per_call_us(lambda: kernel.warmup(*args, grid=(1,)), calls):7.2f}")  # fmt: skip

    for bs, k in ((64, 8), (1, 4)):
        profile_case(bs, k, calls)


def profile_case(bs: int, k: int, calls: int) -> None:
    """The eager calls of one (B, K) case: their split and their top functions."""
    import specmeta
    from specmeta import SpecConfig
    from specmeta.kernels import assign_draft_cache_locs, draft_decode_kv_indices
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder
    from specmeta.workloads import make_batch

    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=PS, max_bs=bs,
                     max_context_len=CTX)  # fmt: skip
    g = torch.Generator().manual_seed(bs)
    batch = make_batch("random", batch_size=bs, topk=k, num_steps=S, page_size=PS,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       extra_tokens=N, max_len=CTX)  # fmt: skip
    t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    lens = batch.seq_lens_cpu
    slots = assign_draft_cache_locs(*t, topk=k, num_steps=S, page_size=PS)
    fa3 = FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode",))
    fi = FlashInferBuilder(cfg, "cuda", modes=("draft_decode",))
    plan = specmeta.plan_buffers(cfg)
    idx = plan["draft_decode.kv_indices"].allocate("cuda")
    ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
    cases = {
        "fa3.draft_decode": (lambda: fa3.draft_decode(*t, slots, seq_lens_cpu=lens),
                             lambda: fa3.bind_draft_decode(*t, slots)),
        "flashinfer.draft_decode": (lambda: fi.draft_decode(*t, seq_lens_cpu=lens),
                                    lambda: fi.bind_draft_decode(*t)),
        "draft_decode_kv_indices": (
            lambda: draft_decode_kv_indices(*t, topk=k, num_steps=S, page_size=PS,
                                            kv_indices=idx, kv_indptr=ptr),
            None),
    }  # fmt: skip
    for name, (eager, bind) in cases.items():
        print(f"\n== {name}, B = {bs}, K = {k}")
        print(f"  eager call            {per_call_us(eager, calls):7.2f}")
        if bind is not None:
            stage = bind()
            print(f"  bind alone            {per_call_us(bind, calls):7.2f}")
            host = per_call_us(lambda s=stage: s.host(lens), calls)
            print(f"  host(seq_lens_cpu)    {host:7.2f}")
            print(f"  launch()              {per_call_us(stage.launch, calls):7.2f}"
                  f"   ({len(stage.launches)} launches)")  # fmt: skip
        print(top_functions(eager, calls))


if __name__ == "__main__":
    main()
