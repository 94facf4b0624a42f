"""Start-up cost of a fresh process with empty caches (design §2.8): import specmeta, construct
the FA3 and FlashInfer builders and make their first draft-decode builds, then the same builds
again; the difference, less the time Triton spends compiling the kernels (counted by wrapping
``triton.compiler.compile``), is what specmeta's own host path adds to a start-up.

Usage: ``python3 scripts/startup.py [--device cuda|cpu] [--warmup]``: it re-runs itself in a
child process with ``XDG_CACHE_HOME`` and ``TRITON_CACHE_DIR`` pointed at new empty folders and
prints one JSON line. ``--warmup`` also calls ``specmeta.warmup()`` (the compiled host ops)
and reports its time apart. On the CPU the kernels run under Triton's interpreter (no compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def child(device: str, warm: bool) -> dict:
    t0 = time.perf_counter()
    import triton.compiler

    compiled = [0.0]
    original = triton.compiler.compile

    def timed_compile(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            compiled[0] += time.perf_counter() - start

    triton.compiler.compile = timed_compile
    import torch

    t_torch = time.perf_counter() - t0
    start = time.perf_counter()
    import specmeta
    from specmeta.kernels import assign_draft_cache_locs
    from specmeta.workloads import make_batch

    t_import = time.perf_counter() - start
    out = {"device": device, "import_torch_triton_s": round(t_torch, 2),
           "import_specmeta_s": round(t_import, 2)}  # fmt: skip
    if warm and hasattr(specmeta, "warmup"):
        start = time.perf_counter()
        out["warmup"] = specmeta.warmup()
        out["warmup_s"] = round(time.perf_counter() - start, 2)
    cfg = specmeta.SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                              max_context_len=256)  # fmt: skip
    start = time.perf_counter()
    fa3 = specmeta.FA3MetadataBuilder(cfg, device, modes=("draft_decode",))
    fi = specmeta.FlashInferBuilder(cfg, device, modes=("draft_decode",))
    out["construct_s"] = round(time.perf_counter() - start, 2)
    batch = make_batch("random", batch_size=4, topk=4, num_steps=3, page_size=16,
                       row_width=cfg.req_to_token_width, device=device, max_len=200,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)

    def builds():
        slots = assign_draft_cache_locs(*t, topk=4, num_steps=3, page_size=16)
        fa3.draft_decode(*t, slots, seq_lens_cpu=batch.seq_lens_cpu)
        fi.draft_decode(*t, seq_lens_cpu=batch.seq_lens_cpu)
        if device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    builds()
    first = time.perf_counter() - start
    start = time.perf_counter()
    builds()
    again = time.perf_counter() - start
    out.update(first_builds_s=round(first, 2), again_s=round(again, 3),
               triton_compile_s=round(compiled[0], 2))  # fmt: skip
    # What importing specmeta, constructing the builders and the first builds cost beyond the
    # same builds made again and Triton's own compiles (torch's and Triton's imports apart).
    out["excess_s"] = round(t_import + out["construct_s"] + first - again - compiled[0], 2)
    return out


def main() -> None:
    args = sys.argv[1:]
    device = args[args.index("--device") + 1] if "--device" in args else "cpu"
    warm = "--warmup" in args
    if "--child" in args:
        print(json.dumps(child(device, warm)))
        return
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as triton_cache:
        # The package of the working directory (a checkout's root), as ``python3 -m`` would see.
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, XDG_CACHE_HOME=cache, TRITON_CACHE_DIR=triton_cache,
                   PYTHONPATH=path)  # fmt: skip
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", *args], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            sys.stderr.write(done.stderr)
            sys.exit(done.returncode)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["process_s"] = round(time.perf_counter() - start, 2)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
