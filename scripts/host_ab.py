"""Host µs of the host benchmarks' calls, another commit's package against this one, in one
process on one GPU: each call of both and its ``floor_run`` in alternating rounds, so a host
whose speed drifts (the H100 hosts do, by up to 2x within a run) moves all three together.

Usage (on the GPU machine, from the repository root)::

    git archive <commit> specmeta | tar -x -C .before     # here, then carry .before
    python3 scripts/host_ab.py .before/specmeta [--rounds 15] [--calls 200]

The other package is imported as ``specmeta_before`` (its imports are relative). Both get the
same tensors. Printed: per call, the median µs of each package and of ``floor_run`` (an empty
kernel with the call's pointer and integer argument counts, as ``bench/bench_host.py``), and
each one's excess over its launches × ``floor_run`` against the target's (3 µs a launcher,
10 a builder, 15 an iteration).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import alternating_us, floor_calls  # noqa: E402
from specmeta.workloads import make_batch, random_tree_mask  # noqa: E402

S, N, CTX = 5, 16, 4096
CASES = [(64, 8, 16), (1, 4, 16)]


def load_before(path: str):
    """The package at ``path`` imported as ``specmeta_before``."""
    root = Path(tempfile.mkdtemp())
    shutil.copytree(path, root / "specmeta_before")
    sys.path.insert(0, str(root))
    return importlib.import_module("specmeta_before")


def _args_of(kernel) -> tuple[int, int]:
    params = [p for p in kernel.params if not p.is_constexpr]
    pointers = sum(p.name.endswith("_ptr") for p in params)
    return max(pointers, 1), len(params) - pointers


def calls(pkg, bs: int, k: int, ps: int, batch, tree) -> dict:
    """``name -> (fn, launches, budget, (pointers, ints))`` of one package."""
    sub = lambda name: importlib.import_module(f"{pkg.__name__}.{name}")  # noqa: E731
    dcl, ddk = sub("kernels.draft_cache_locs"), sub("kernels.draft_decode_kv_indices")
    move = sub("kernels.cache_loc_move")
    fa3, fi = sub("metadata.fa3"), sub("metadata.flashinfer")
    cfg = pkg.SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=bs,
                         max_context_len=CTX)  # fmt: skip
    a = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    lens = batch.seq_lens_cpu
    kw = dict(topk=k, num_steps=S, page_size=ps)
    status = pkg.new_status("cuda")
    slots = torch.empty(bs * k * S, dtype=torch.int64, device="cuda")
    pairs = (k - 1) * (ps - 1) * bs
    tgt = torch.empty(max(pairs, 1), dtype=torch.int64, device="cuda")
    src = torch.empty_like(tgt)
    pool = move.KVPool([torch.zeros(batch.pool_size, 8, 128, dtype=torch.bfloat16, device="cuda")
                        for _ in "kv"])  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(batch.pool_size - 1, device="cuda", generator=g)[: 2 * pairs] + 1
    mt, ms = perm[:pairs], perm[pairs:]
    plan = pkg.plan_buffers(cfg)
    idx = plan["draft_decode.kv_indices"].allocate("cuda")
    ptr = plan["draft_decode.kv_indptr"].allocate("cuda")
    dcl.assign_draft_cache_locs(*a, out_cache_loc=slots, status=status, **kw)
    out = {
        "assign_draft_cache_locs": (
            lambda: dcl.assign_draft_cache_locs(*a, out_cache_loc=slots, status=status, **kw),
            1, 3.0, _args_of(dcl._assign_draft_cache_locs_kernel)),
        "prefix_tail_copy_pairs": (
            lambda: dcl.prefix_tail_copy_pairs(*a, tgt=tgt, src=src, status=status, **kw),
            1, 3.0, _args_of(dcl._prefix_tail_copy_pairs_kernel)),
        "draft_decode_kv_indices": (
            lambda: ddk.draft_decode_kv_indices(*a, kv_indices=idx, kv_indptr=ptr,
                                                status=status, **kw),
            1, 3.0, _args_of(ddk._draft_decode_kv_indices_kernel)),
        "move_kv_cache": (
            lambda: move.move_kv_cache(pool, mt, ms, disjoint=True, status=status),
            1, 3.0, _args_of(move._move_kv_cache_kernel)),
    }  # fmt: skip
    f_dd = fa3.FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode",))
    f_tv = fa3.FA3MetadataBuilder(cfg, "cuda", modes=("target_verify",))
    i_dd = fi.FlashInferBuilder(cfg, "cuda", modes=("draft_decode",))
    i_sp = fi.FlashInferBuilder(cfg, "cuda", modes=("draft_decode_shared_prefix",))
    i_tv = fi.FlashInferBuilder(cfg, "cuda", modes=("target_verify",))
    builder = (8, 12)
    out.update({
        "fa3.draft_decode": (lambda: f_dd.draft_decode(*a, slots, seq_lens_cpu=lens), 1, 10.0,
                             builder),
        "fa3.target_verify": (lambda: f_tv.target_verify(*a, tree, seq_lens_cpu=lens), 3, 10.0,
                              builder),
        "flashinfer.draft_decode": (lambda: i_dd.draft_decode(*a, seq_lens_cpu=lens), 1, 10.0,
                                    builder),
        "flashinfer.draft_decode_shared_prefix": (
            lambda: i_sp.draft_decode_shared_prefix(*a, seq_lens_cpu=lens), 1, 10.0, builder),
        "flashinfer.target_verify": (lambda: i_tv.target_verify(*a, tree, seq_lens_cpu=lens),
                                     2, 10.0, builder),
    })  # fmt: skip
    # A new max L on every call, as in a decode loop whose lengths grow: two batches whose
    # lengths differ by a page, called in turn (bench_host_builder_new_max).
    f_nm = fa3.FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode",))
    shorter = (lens - ps).clamp(min=0)
    turns = [(a[2], lens), (shorter.cuda(), shorter)]
    turn = [0]

    def new_max():
        turn[0] = 1 - turn[0]
        d, c = turns[turn[0]]
        return f_nm.draft_decode(a[0], a[1], d, slots, seq_lens_cpu=c)

    out["fa3.draft_decode.new_max"] = (new_max, 1, 10.0, builder)
    it_fa3 = fa3.FA3MetadataBuilder(cfg, "cuda", modes=("draft_decode",))
    it_fi = fi.FlashInferBuilder(cfg, "cuda", modes=("draft_decode",))

    def iteration(b, with_slots):
        def run():
            dcl.assign_draft_cache_locs(*a, out_cache_loc=slots, status=status, **kw)
            if pairs:
                dcl.prefix_tail_copy_pairs(*a, tgt=tgt, src=src, status=status, **kw)
                move.move_kv_cache(pool, mt, ms, disjoint=True, status=status)
            if with_slots:
                return b.draft_decode(*a, slots, seq_lens_cpu=lens)
            return b.draft_decode(*a, seq_lens_cpu=lens)

        return run

    launches = 4 if pairs else 2
    out["iteration.fa3"] = (iteration(it_fa3, True), launches, 15.0, builder)
    out["iteration.flashinfer"] = (iteration(it_fi, False), launches, 15.0, builder)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="path of the other package's specmeta/ folder")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    opts = parser.parse_args()
    import specmeta

    before = load_before(opts.before)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | case | launches | floor_run | before µs (over) | now µs (over) | allowed over |")
    print("|---|---|---|---|---|---|---|")
    for bs, k, ps in CASES:
        cfg = specmeta.SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=ps,
                                  max_bs=bs, max_context_len=CTX)  # fmt: skip
        g = torch.Generator().manual_seed(bs * 100 + k * 10 + ps)
        batch = make_batch("random", batch_size=bs, topk=k, num_steps=S, page_size=ps,
                           row_width=cfg.req_to_token_width, generator=g, device="cuda",
                           extra_tokens=N, max_len=CTX)  # fmt: skip
        tree = random_tree_mask(bs, k, S, N, g).cuda()
        old, new = calls(before, bs, k, ps, batch, tree), calls(specmeta, bs, k, ps, batch, tree)
        for name, (fn, launches, budget, args) in new.items():
            floor = floor_calls(*args)["floor_run"]
            t = alternating_us({"floor": floor, "before": old[name][0], "now": fn},
                               rounds=opts.rounds, calls=opts.calls)  # fmt: skip
            over = {w: t[w] - launches * t["floor"] for w in ("before", "now")}
            print(f"| {name} | {bs}-{k}-{ps} | {launches} | {t['floor']:.2f} | "
                  f"{t['before']:.2f} ({over['before']:+.2f}) | {t['now']:.2f} "
                  f"({over['now']:+.2f}) | {budget:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
