"""Host cost of the calls an engine makes on every draft step, beside the floors of the same run.

Production case (B = 64, K = 8, S = 5, page size 16, L = 4096, ``seq_lens_cpu`` given) and the
small batch where the host bounds the loop (B = 1). Each row records:

* ``host_us``: pytest-benchmark's median over rounds of 200 back-to-back calls;
* ``host_paired_us``, ``floor_run``, ``floor_graph``: the call and the floors of an empty kernel
  timed in alternating rounds (``bench.harness.paired_host_us``), so that a host whose speed
  drifts moves them together; ``target_us`` and ``met`` are judged on these. A round is 200
  back-to-back calls, or 3 calls after a synchronize (``calls_per_round``) for a call whose
  device time is at least 0.8 of pytest-benchmark's host median: back to back, the device
  would set that call's pace;
* ``device_us``: the same call's device time from graph replay;
* ``launches``: Triton launches per call (counted through Triton's launch hook);
* the floors' kernel: for a launcher, an empty kernel with the launcher kernel's own pointer
  and integer argument counts; for a builder, the default 8-pointer, 12-integer kernel;
* ``target_us`` and ``met``: launchers ``floor_run + 3``; builders
  ``launches × floor_run + 10`` (design §2.8).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

from bench.harness import graph_us, paired_host_us, record
from specmeta import SpecConfig, new_status
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.workloads import make_batch, random_tree_mask

# The op modules (specmeta.kernels re-exports each launcher under its module's name).
draft_cache_locs = importlib.import_module("specmeta.kernels.draft_cache_locs")
draft_decode_kv_indices = importlib.import_module("specmeta.kernels.draft_decode_kv_indices")

S, N, CTX = 5, 16, 4096
CASES = [(64, 8, 16), (1, 4, 16)]  # (B, K, ps)


def _ids(v):
    return str(v)


def production_batch(bs, k, ps):
    """``(cfg, batch, tree_mask)`` of the host benchmarks' case (``S``, ``N``, ``CTX`` above)."""
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=bs,
                     max_context_len=CTX)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 100 + k * 10 + ps)
    batch = make_batch("random", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       extra_tokens=N, max_len=CTX)  # fmt: skip
    tree = random_tree_mask(bs, k, S, N, g).cuda()
    return cfg, batch, tree


def count_launches(fn) -> int:
    """Triton launches made by one ``fn()`` call."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    count = [0]

    def hook(*_):
        count[0] += 1

    chain = getattr(runtime, "launch_enter_hook", None)
    if hasattr(chain, "add"):  # Triton 3.6+: a HookChain
        chain.add(hook)
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            chain.remove(hook)
        return count[0]
    if runtime is not None:
        old, runtime.launch_enter_hook = runtime.launch_enter_hook, hook
    else:
        from triton.compiler import CompiledKernel

        old, CompiledKernel.launch_enter_hook = CompiledKernel.launch_enter_hook, hook
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        if runtime is not None:
            runtime.launch_enter_hook = old
        else:
            CompiledKernel.launch_enter_hook = old
    return count[0]


def _args_of(kernel) -> tuple[int, int]:
    """``(pointers, ints)``: ``kernel``'s runtime argument counts, for its floors."""
    params = [p for p in kernel.params if not p.is_constexpr]
    pointers = sum(p.name.endswith("_ptr") for p in params)
    return max(pointers, 1), len(params) - pointers


def _measure(benchmark, fn, *, args: tuple[int, int] = (8, 12), budget: float, device_fn=None,
             **extra) -> None:  # fmt: skip
    """``device_fn``: the same launches without host mirrors, for the graph-replay timing (a
    mirror ring waits on events, which a capture cannot). The call and the floors that judge it
    are timed in alternating rounds (``bench.harness.paired_host_us``), beside
    pytest-benchmark's median."""
    launches = count_launches(fn)
    device_us = graph_us(device_fn or fn)
    benchmark.pedantic(fn, rounds=30, iterations=200, warmup_rounds=2)
    # A call whose device time nears its host time is paced by the device when called back to
    # back (the launch queue fills; a FlashInfer build's mirror ring waits for the plan()
    # copies of half a ring ago): its rounds are then 3 calls after a synchronize, so the host
    # figure is the host's own work.
    paced = device_us >= 0.8 * benchmark.stats.stats.median * 1e6
    paired = paired_host_us(fn, *args, **(dict(rounds=200, calls=3) if paced else {}))
    target = launches * paired["floor_run"] + budget
    record(benchmark, device_us=device_us, launches=launches, target_us=round(target, 1),
           met=paired["host_paired_us"] <= target, calls_per_round=3 if paced else 200,
           **paired, **extra)  # fmt: skip


LAUNCHERS = ["assign_draft_cache_locs", "prefix_tail_copy_pairs", "draft_decode_kv_indices",
             "move_kv_cache"]


@pytest.mark.parametrize("op", LAUNCHERS)
@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_host_launcher(benchmark, op, bs, k, ps):
    cfg, batch, _ = production_batch(bs, k, ps)
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=k, num_steps=S, page_size=ps)
    status = new_status("cuda")
    if op == "assign_draft_cache_locs":
        out = torch.empty(bs * k * S, dtype=torch.int64, device="cuda")
        kernel = draft_cache_locs._assign_draft_cache_locs_kernel

        def fn():
            draft_cache_locs.assign_draft_cache_locs(*a, out_cache_loc=out, status=status, **kw)
    elif op == "prefix_tail_copy_pairs":
        kernel = draft_cache_locs._prefix_tail_copy_pairs_kernel
        tgt = torch.empty(max((k - 1) * (ps - 1) * bs, 1), dtype=torch.int64, device="cuda")
        src = torch.empty_like(tgt)

        def fn():  # into the engine's own pair buffers, as a draft step calls it
            draft_cache_locs.prefix_tail_copy_pairs(*a, tgt=tgt, src=src, status=status, **kw)
    elif op == "move_kv_cache":
        from specmeta.kernels.cache_loc_move import KVPool, _move_kv_cache_kernel, move_kv_cache

        kernel = _move_kv_cache_kernel
        n = max((k - 1) * (ps - 1) * bs, 1)
        pool = KVPool([torch.zeros(batch.pool_size, 8, 128, dtype=torch.bfloat16, device="cuda")
                       for _ in "kv"])  # fmt: skip
        perm = torch.randperm(batch.pool_size - 1, device="cuda")[: 2 * n] + 1
        tgt, src = perm[:n], perm[n:]  # disjoint pairs, one layer's K and V

        def fn():
            move_kv_cache(pool, tgt, src, disjoint=True, status=status)
    else:
        from specmeta import plan_buffers

        plan = plan_buffers(cfg)
        idx = plan["draft_decode.kv_indices"].allocate("cuda")
        ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
        kernel = draft_decode_kv_indices._draft_decode_kv_indices_kernel

        def fn():
            draft_decode_kv_indices.draft_decode_kv_indices(*a, kv_indices=idx, kv_indptr=ptr,
                                                            status=status, **kw)  # fmt: skip

    _measure(benchmark, fn, args=_args_of(kernel), budget=3.0, op=op, bs=bs, topk=k,
             page_size=ps)  # fmt: skip
    assert int(status) == 0


BUILDS = [
    ("fa3", "draft_decode"),
    ("fa3", "target_verify"),
    ("flashinfer", "draft_decode"),
    ("flashinfer", "draft_decode_shared_prefix"),
    ("flashinfer", "target_verify"),
]


@pytest.mark.parametrize("backend,mode", BUILDS, ids=_ids)
@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_host_builder(benchmark, backend, mode, bs, k, ps):
    cfg, batch, tree = production_batch(bs, k, ps)
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    if backend == "fa3":
        b = FA3MetadataBuilder(cfg, "cuda", modes=(mode,))
        slots = draft_cache_locs.assign_draft_cache_locs(*a, topk=k, num_steps=S, page_size=ps)
        if mode == "draft_decode":

            def call(lens):
                return b.draft_decode(*a, slots, seq_lens_cpu=lens)
        else:

            def call(lens):
                return b.target_verify(*a, tree, seq_lens_cpu=lens)
    else:
        b = FlashInferBuilder(cfg, "cuda", modes=(mode,))
        if mode == "target_verify":

            def call(lens):
                return b.target_verify(*a, tree, seq_lens_cpu=lens)
        else:
            method = getattr(b, mode)

            def call(lens):
                return method(*a, seq_lens_cpu=lens)

    def fn():
        return call(batch.seq_lens_cpu)

    _measure(benchmark, fn, budget=10.0, device_fn=lambda: call(None),
             op=f"{backend}.{mode}", bs=bs, topk=k, page_size=ps)  # fmt: skip


@pytest.mark.parametrize("mode", ["draft_decode", "target_verify"])
@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_host_builder_new_max(benchmark, mode, bs, k, ps):
    """FA3's builder when every call brings a new ``max L``, as in a decode loop whose lengths
    grow: two batches that differ in their longest request, called in turn (the rows above
    repeat one batch, whose result object is found again)."""
    cfg, batch, tree = production_batch(bs, k, ps)
    b = FA3MetadataBuilder(cfg, "cuda", modes=(mode,))
    a = (batch.req_pool_indices, batch.req_to_token)
    # Every length a page shorter (still valid prefixes): max L moves by a whole page.
    lens_cpu = [batch.seq_lens_cpu, (batch.seq_lens_cpu - ps).clamp(min=0)]
    lens = [t.cuda() for t in lens_cpu]
    slots = draft_cache_locs.assign_draft_cache_locs(*a, lens[0], topk=k, num_steps=S,
                                                     page_size=ps)  # fmt: skip
    turn = [0]

    def fn():
        i = turn[0] = 1 - turn[0]
        if mode == "draft_decode":
            return b.draft_decode(*a, lens[i], slots, seq_lens_cpu=lens_cpu[i])
        return b.target_verify(*a, lens[i], tree, seq_lens_cpu=lens_cpu[i])

    want = [fn().normal.max_seqlen_k if mode == "target_verify" else fn()[0].normal.max_seqlen_k
            for _ in range(2)]  # fmt: skip
    assert want[0] != want[1], "the two batches must differ in max L"
    _measure(benchmark, fn, budget=10.0, op=f"fa3.{mode}.new_max", bs=bs, topk=k, page_size=ps)
    assert int(b.status) == 0


@pytest.mark.parametrize("backend", ["fa3", "flashinfer"])
@pytest.mark.parametrize("bs,k,ps", CASES, ids=_ids)
def bench_host_draft_iteration(benchmark, backend, bs, k, ps):
    """A whole eager draft iteration's metadata: draft slots, prefix-tail pairs, their KV move
    (one layer's K and V), and the backend's draft decode."""
    from specmeta.kernels.cache_loc_move import KVPool, move_kv_cache

    cfg, batch, _ = production_batch(bs, k, ps)
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(topk=k, num_steps=S, page_size=ps)
    status = new_status("cuda")
    slots = torch.empty(bs * k * S, dtype=torch.int64, device="cuda")
    pairs = (k - 1) * (ps - 1) * bs
    tgt = torch.empty(max(pairs, 1), dtype=torch.int64, device="cuda")
    src = torch.empty_like(tgt)
    pool = KVPool([torch.zeros(batch.pool_size, 8, 128, dtype=torch.bfloat16, device="cuda")
                   for _ in "kv"])  # fmt: skip
    if backend == "fa3":
        b = FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode",))
    else:
        b = FlashInferBuilder(cfg, "cuda", modes=("draft_decode",))

    move_tgt, move_src = tgt[:pairs], src[:pairs]  # the engine's views, made once

    def iteration(lens):
        draft_cache_locs.assign_draft_cache_locs(*a, out_cache_loc=slots, status=status, **kw)
        if pairs:
            draft_cache_locs.prefix_tail_copy_pairs(*a, tgt=tgt, src=src, status=status, **kw)
            move_kv_cache(pool, move_tgt, move_src, disjoint=True, status=status)
        if backend == "fa3":
            return b.draft_decode(*a, slots, seq_lens_cpu=lens)
        return b.draft_decode(*a, seq_lens_cpu=lens)

    _measure(benchmark, lambda: iteration(batch.seq_lens_cpu), budget=15.0,
             device_fn=lambda: iteration(None), op=f"iteration.{backend}", bs=bs,
             topk=k, page_size=ps)  # fmt: skip
    assert int(status) == 0 and int(b.status) == 0
