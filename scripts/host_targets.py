"""The host targets of the bound-stage host path (design §2.8), measured beside their floors.

Usage (GPU): ``python3 scripts/host_targets.py --label after --out targets.json``. Run on an
older checkout (its own ``specmeta`` and ``bench`` on ``PYTHONPATH``), it measures the same
calls through that checkout's API: eager calls, and for a bound stage's rows the closest older
call (a builder call with the same persistent tensors; ``launch=False`` for the host part; the
runner's persistent replay), so both tables come from one machine in one visit.

Every row is a call timed in alternating rounds with the floors that judge it
(``bench.harness.paired_host_us``): ``floor_run`` (``CompiledKernel.run`` of an empty kernel
with the same argument counts) and ``floor_graph`` (a bare graph replay); ``floor_jit``
(Triton's own ``kernel[grid](...)`` of that kernel, what one eager launch through Triton's
specialization costs) is shown beside them. A call whose device
work sets its pace when called back to back is timed 3 calls a round after a synchronize
(``drained``). Targets:

* a bound stage's launch: ``launches × floor_run + 2``;
* a bound stage's host part from ``seq_lens_cpu``: 3 µs at ``B ≤ 64``, 8 µs at ``B = 256``
  (doubled without the compiled host ops);
* a persistent batch's runner replay: ``floor_graph + 3``, ``+ 5`` with ``seq_lens_cpu``;
* an eager builder call: ``launches × floor_run + 15``; an eager launcher: ``floor_run + 6``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import torch

S, N, CTX = 5, 16, 4096


def device_us(fn, calls: int = 20) -> float:
    """Device µs per call of ``fn``: events around ``calls`` calls queued behind a 50 ms sleep
    on the stream, so the host has queued them all before the first starts and the events
    time the device alone (back-to-back calls of a host-bound ``fn`` would time the host)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms at the H100/H200 clock
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


ROWS: list[dict] = []
ONLY: list = []  # --only: a compiled pattern; rows whose names it does not match are not timed


def measure(name: str, fn, *, kind: str, budget: float, launches: int | None = None,
            args=(8, 12), **extra) -> None:  # fmt: skip
    from bench.bench_host import count_launches
    from bench.harness import paired_host_us

    if ONLY and not ONLY[0].search(name):
        return
    n = count_launches(fn) if launches is None else launches
    dev = device_us(fn) if n or kind == "replay" else 0.0
    back = paired_host_us(fn, *args)
    paced = dev >= 0.8 * back["host_paired_us"]
    got = paired_host_us(fn, *args, rounds=200, calls=3) if paced else back
    if kind == "replay":
        target = got["floor_graph"] + budget
    elif kind == "host":
        target = budget
    else:
        target = n * got["floor_run"] + budget
    row = dict(name=name, kind=kind, us=got["host_paired_us"], target=round(target, 2),
               met=got["host_paired_us"] <= target, launches=n, device_us=round(dev, 2),
               floor_run=got["floor_run"], floor_graph=got["floor_graph"],
               floor_jit=got["floor_jit"], drained=bool(paced), **extra)  # fmt: skip
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def jit_target(row: dict) -> str:
    """An eager row's target against Triton's own dispatch, ``launches × floor_jit`` plus the
    same budget, as `` (jit: µs, met)``: an eager call launches through ``kernel[grid]``."""
    if row["kind"] != "eager" or "floor_jit" not in row:
        return ""
    budget = row["target"] - row["launches"] * row["floor_run"]
    target = row["launches"] * row["floor_jit"] + budget
    return f" (jit: {target:.2f}, {'met' if row['us'] <= target else 'missed'})"


def table(before_path: str, after_path: str) -> str:
    """Markdown: every row of the run ``after`` beside the same row of ``before`` (µs, each
    with its own floors and target from its own run)."""
    from pathlib import Path

    rows = json.loads(Path(before_path).read_text())["rows"]
    before = {(r["name"], r["bs"], r["topk"]): r for r in rows}
    after = json.loads(Path(after_path).read_text())
    meta = after["meta"]
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}; µs, each row with the floors of its own run.", "",
             "| call | B, K | before | after | device | floor_run | floor_jit | floor_graph | target "
             "| met |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in after["rows"]:
        b = before.get((r["name"], r["bs"], r["topk"]))
        old = f"{b['us']:.2f}" if b is not None else ""
        lines.append(f"| {r['name']}{' (drained)' if r['drained'] else ''} | {r['bs']}, "
                     f"{r['topk']} | {old} | {r['us']:.2f} | {r.get('device_us', 0):.2f} | "
                     f"{r['floor_run']:.2f} | {r.get('floor_jit', float('nan')):.2f} | "
                     f"{r['floor_graph']:.2f} | {r['target']:.2f}{jit_target(r)} | "
                     f"{'yes' if r['met'] else '**no**'} |")  # fmt: skip
    met = sum(r["met"] for r in after["rows"])
    lines.append(f"\n{met} of {len(after['rows'])} targets met.")
    return "\n".join(lines)


def measure_case(bs: int, k: int, new: bool) -> None:
    """Every row of one (B, K) case (page size 16, S, N, CTX above; a chain's tree has at
    most S + 1 nodes)."""
    import specmeta
    from specmeta import SpecConfig, new_status
    from specmeta.kernels import assign_draft_cache_locs, draft_decode_kv_indices
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.metadata.flashinfer import FlashInferBuilder
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
    from specmeta.runners import GraphRunner, padding
    from specmeta.workloads import make_batch, random_tree_mask

    ps, n = 16, N if k > 1 else S + 1
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=bs,
                     max_context_len=CTX)  # fmt: skip
    g = torch.Generator().manual_seed(bs * 100 + k)
    batch = make_batch("random", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=g, device="cuda",
                       extra_tokens=n, max_len=CTX)  # fmt: skip
    tree = random_tree_mask(bs, k, S, n, g).cuda()
    t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    lens = batch.seq_lens_cpu
    case = dict(bs=bs, topk=k, page_size=ps)
    slots = assign_draft_cache_locs(*t, topk=k, num_steps=S, page_size=ps)
    fa3 = FA3MetadataBuilder(cfg, "cuda")
    fi = FlashInferBuilder(cfg, "cuda", modes=("draft_decode", "target_verify"))
    mla = TrtllmMlaBuilder(cfg, "cuda", modes=("draft_decode",))
    calls = {
        "fa3.draft_decode": (fa3, "draft_decode", (*t, slots), {}),
        "fa3.target_verify": (fa3, "target_verify", (*t, tree), {}),
        "flashinfer.draft_decode": (fi, "draft_decode", t, {}),
        "flashinfer.target_verify": (fi, "target_verify", (*t, tree), {"packed": True}),
        "trtllm_mla.draft_decode": (mla, "draft_decode", t, {}),
    }
    try:  # FlashInfer MLA (design §3.5); an older checkout has no such builder
        from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder
    except ImportError:
        FlashInferMLABuilder = None
    if FlashInferMLABuilder is not None:
        fmla = FlashInferMLABuilder(cfg, "cuda", modes=("draft_decode",))
        calls["flashinfer_mla.draft_decode"] = (fmla, "draft_decode", t, {})
    host_kw = {name: {} for name in calls}
    if "verify_lens" in inspect.signature(FlashInferBuilder.target_verify).parameters:
        # A ragged verify (design §2.9): B − 1 real requests of random lengths, a full bucket.
        real_cpu = torch.randint(0, n + 1, (bs - 1,), generator=g, dtype=torch.int32)
        ragged = {"packed": True, "verify_lens": real_cpu.cuda(), "num_tokens": bs * n}
        calls["flashinfer.target_verify.ragged"] = (fi, "target_verify", (*t, tree), ragged)
        host_kw["flashinfer.target_verify.ragged"] = {"verify_lens_cpu": real_cpu}
        # FA3 reads the query offsets on the device: no host copy of the lengths.
        fa3_ragged = {"verify_lens": ragged["verify_lens"], "num_tokens": bs * n}
        calls["fa3.target_verify.ragged"] = (fa3, "target_verify", (*t, tree), fa3_ragged)
        host_kw["fa3.target_verify.ragged"] = {}
    if k == 1:  # the chain verifies of the MLA builders (a tree's is a two-kernel cascade)
        mla_tv = TrtllmMlaBuilder(cfg, "cuda", modes=("target_verify",))
        calls = {"trtllm_mla.target_verify": (mla_tv, "target_verify", t, {})}
        if FlashInferMLABuilder is not None:  # verifies chains in one causal pass
            fmla_tv = FlashInferMLABuilder(cfg, "cuda", modes=("target_verify",))
            calls["flashinfer_mla.target_verify"] = (fmla_tv, "target_verify", t, {})
        host_kw = {name: {} for name in calls}
        if "verify_lens" in inspect.signature(TrtllmMlaBuilder.target_verify).parameters:
            real_cpu = torch.randint(0, n + 1, (bs - 1,), generator=g, dtype=torch.int32)
            mla_ragged = {"verify_lens": real_cpu.cuda(), "num_tokens": bs * n}
            calls["trtllm_mla.target_verify.ragged"] = (mla_tv, "target_verify", t, mla_ragged)
            host_kw["trtllm_mla.target_verify.ragged"] = {}
    for name, (b, mode, args, kw) in calls.items():
        eager, hk = getattr(b, mode), host_kw[name]
        if bs != 256:
            measure(f"eager.{name}", lambda e=eager, a=args, k=kw, h=hk: e(*a, seq_lens_cpu=lens,
                                                                            **k, **h),
                    kind="eager", budget=15.0, **case)  # fmt: skip
        if new:
            stage = b.bind(mode, *args, **kw)
            if bs != 256:
                measure(f"launch.{name}", stage.launch, kind="launch", budget=2.0, **case)
            for compiled in (True, False):
                b.host_ops = compiled
                budget = (3.0 if bs <= 64 else 8.0) * (1 if compiled else 2)
                measure(f"host.{name}" + ("" if compiled else ".python"),
                        lambda s=stage, h=hk: s.host(lens, **h), kind="host", budget=budget,
                        launches=0, **case)  # fmt: skip
            b.host_ops = True
        else:
            if bs != 256:
                measure(f"launch.{name}", lambda e=eager, a=args, k=kw: e(*a, **k),
                        kind="launch", budget=2.0, **case)  # fmt: skip
            measure(
                f"host.{name}",
                lambda e=eager, a=args, k=kw: e(*a, seq_lens_cpu=lens, launch=False, **k),
                kind="host",
                budget=3.0 if bs <= 64 else 8.0,
                launches=0,
                **case,
            )
    if bs == 256 or k == 1:
        return
    status = new_status("cuda")
    kw = dict(topk=k, num_steps=S, page_size=ps, status=status)
    out = torch.empty(bs * k * S, dtype=torch.int64, device="cuda")
    measure("eager.assign_draft_cache_locs",
            lambda: assign_draft_cache_locs(*t, out_cache_loc=out, **kw), kind="eager",
            budget=6.0, args=(6, 5), **case)  # fmt: skip
    plan = specmeta.plan_buffers(cfg)
    idx = plan["draft_decode.kv_indices"].allocate("cuda")
    ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
    measure("eager.draft_decode_kv_indices",
            lambda: draft_decode_kv_indices(*t, kv_indices=idx, kv_indptr=ptr, **kw),
            kind="eager", budget=6.0, args=(7, 11), **case)  # fmt: skip
    # A persistent batch through the runner: FA3 draft decode (K > 1 reads the slots).
    bufs = specmeta.allocate_buffers(cfg, "cuda", ["runner.req_pool_indices",
                                                   "runner.seq_lens"])  # fmt: skip
    r2t = batch.req_to_token
    for backend, b in (("fa3", fa3), ("flashinfer", fi)):
        for host in (False, True):
            if backend == "flashinfer" and not host:
                continue  # plan() needs the mirrors: FlashInfer always has host inputs
            if new:

                def stage_fn(inp, b=b, backend=backend):
                    extra = (slots,) if backend == "fa3" else ()
                    return b.bind_draft_decode(inp["req_pool_indices"], r2t,
                                               inp["seq_lens"], *extra)  # fmt: skip

                runner = GraphRunner(stage_fn, batch_sizes=[bs], device="cuda")
            else:

                def stage_fn(batch_, b=b, backend=backend):
                    inp = batch_.inputs
                    extra = (slots,) if backend == "fa3" else ()
                    return b.draft_decode(inp["req_pool_indices"], r2t, inp["seq_lens"],
                                          *extra, seq_lens_cpu=batch_.host.get("seq_lens"),
                                          launch=batch_.launch)  # fmt: skip

                runner = GraphRunner(stage_fn, batch_sizes=[bs], device="cuda", typed=True)
            runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"],
                             pad=padding.SINK_ROW)  # fmt: skip
            runner.add_input("seq_lens", bufs["runner.seq_lens"],
                             pad=padding.seq_lens_fill(k, n), host_mirror=host)  # fmt: skip
            runner.capture()
            views = runner.static_inputs(bs)
            views["req_pool_indices"].copy_(batch.req_pool_indices)
            views["seq_lens"].copy_(batch.seq_lens)
            hi = {"seq_lens": lens} if host else None
            measure(f"replay.{backend}" + (".seq_lens_cpu" if host else ""),
                    lambda r=runner, h=hi: r.replay(bs, host_inputs=h), kind="replay",
                    budget=5.0 if host else 3.0, launches=0, **case)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label")
    p.add_argument("--out")
    p.add_argument("--only", help="time only the rows whose names match this regular expression")
    p.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="print the two runs' rows side by side, and exit")  # fmt: skip
    a = p.parse_args()
    if a.table:
        print(table(*a.table))
        return
    if not a.label or not a.out:
        p.error("--label and --out are required to measure")
    import specmeta
    from specmeta.metadata.fa3 import FA3MetadataBuilder

    new = hasattr(FA3MetadataBuilder, "bind_draft_decode")
    if new:
        built = specmeta.warmup()
        print("warmup:", built, flush=True)
    if a.only:
        import re

        ONLY.append(re.compile(a.only))
    import triton

    meta = dict(label=a.label, device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d"))  # fmt: skip
    for bs, k in ((64, 8), (1, 4), (256, 8), (64, 1)):
        measure_case(bs, k, new)
        with open(a.out, "w") as f:  # after every case: a later failure keeps these rows
            json.dump({"meta": meta, "rows": ROWS}, f, indent=1)
    print(f"{sum(r['met'] for r in ROWS)} of {len(ROWS)} met", file=sys.stderr)


if __name__ == "__main__":
    main()
