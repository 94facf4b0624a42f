"""What FlashInfer MLA's tree cascade saves (issue 39's production case), on a GPU.

Usage: ``python3 scripts/mla_cascade.py [--out mla_cascade.json] [--heads 16]``.

One draft-decode step of a DeepSeek-shaped MLA model (latent keys ``ckv`` 512 and ``kpe`` 64,
bf16) for ``B = 64`` requests of 4096 committed tokens, ``topk = 8``, 5 steps, page size 64,
through ``flashinfer.mla.BatchMLAPagedAttentionWrapper``, two ways over the same keys:

* **cascade** (``FlashInferMLABuilder``, design §3.5): each request's prefix read once for its
  ``K`` rows, then each branch's own chain, merged by ``specmeta.merge_state``;
* **per branch**: one list a branch holding its prefix copy and its chain
  (``draft_decode_kv_indices``, design §2.2), one pass, no merge.

Each is timed on the device (``host_targets.device_us``: CUDA events around 50 runs queued
behind a sleep, plans made before), for every
step ``s`` of the forwards; the builder's own device and host time are
``scripts/host_targets.py``'s. Prints a table; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from host_targets import device_us  # scripts/: the same device timing as the host targets'

B, K, S, CTX, PS = 64, 8, 5, 4096, 64
CKV, KPE = 512, 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16, help="query heads (16: DeepSeek-V3 at TP 8)")
    p.add_argument("--out")
    a = p.parse_args()
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    import specmeta
    from specmeta import SpecConfig, draft_decode_kv_indices
    from specmeta.kernels.merge_state import bind_merge_state
    from specmeta.metadata.flashinfer_mla import FlashInferMLABuilder

    dev, dt, h = torch.device("cuda"), torch.bfloat16, a.heads
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=S + 1, page_size=PS, max_bs=B,
                     max_context_len=CTX)  # fmt: skip
    width = cfg.req_to_token_width
    pool = B * width + PS
    # Request b owns row b + 1 (row 0 is the reserved sink row): slots b·width + position + PS.
    rows = torch.zeros(B + 1, width, dtype=torch.int32, device=dev)
    rows[1:] = (torch.arange(B, device=dev)[:, None] * width + torch.arange(width, device=dev)
                + PS).int()  # fmt: skip
    rpi = torch.arange(1, B + 1, dtype=torch.int64, device=dev)
    lens = torch.full((B,), CTX, dtype=torch.int64, device=dev)
    lens_cpu = lens.cpu()
    ckv = torch.randn(pool, CKV, dtype=dt, device=dev) * 0.5
    kpe = torch.randn(pool, KPE, dtype=dt, device=dev) * 0.5
    q_nope = torch.randn(B * K, h, CKV, dtype=dt, device=dev)
    q_pe = torch.randn(B * K, h, KPE, dtype=dt, device=dev)
    scale = (CKV + KPE) ** -0.5
    workspace = torch.empty(128 << 20, dtype=torch.int8, device=dev)

    def wrapper(pass_, page_size):
        w = BatchMLAPagedAttentionWrapper(workspace)
        w.plan(**{**pass_, "page_size": page_size}, num_heads=h, head_dim_ckv=CKV,
               head_dim_kpe=KPE, sm_scale=scale, q_data_type=dt, kv_data_type=dt)  # fmt: skip
        return w

    o = [torch.empty_like(q_nope) for _ in range(2)]
    lse = [torch.empty(B * K, h, dtype=torch.float32, device=dev) for _ in range(2)]

    def run(w, page_size, i=0, with_lse=False):
        c = ckv.view(-1, page_size, CKV)
        k = kpe.view(-1, page_size, KPE)
        if with_lse:
            w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=c, kpe_cache=k, out=o[i], lse=lse[i],
                  return_lse=True, return_lse_base_on_e=True)  # fmt: skip
        else:
            w.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=c, kpe_cache=k, out=o[i])

    merge = bind_merge_state(o[0], lse[0], o[1], lse[1], out=o[0])  # bound once: launch()

    mla = FlashInferMLABuilder(cfg, dev, modes=("draft_decode",))
    steps = mla.draft_decode(rpi, rows, lens, seq_lens_cpu=lens_cpu, num_rows=S)
    flat = draft_decode_kv_indices(rpi, rows, lens, topk=K, num_steps=S, page_size=PS,
                                   num_rows=S, seq_lens_sum=int(lens_cpu.sum()))  # fmt: skip
    kv_indices, kv_indptr = flat[0], flat[1]
    torch.cuda.synchronize()
    out_rows = []
    for s in range(S):
        att = steps[s]
        cascade = [(wrapper(pp.plan_kwargs(), pp.page_size), pp.page_size) for pp in att.passes]

        def cascade_step(cascade=cascade):
            (w1, p1), (w2, p2) = cascade
            run(w1, p1, 0, True)
            run(w2, p2, 1, True)
            merge.launch()

        it = s + 1
        qo = torch.arange(B * K + 1, dtype=torch.int32)
        ptr = kv_indptr[s].cpu().int()
        kv_len = torch.full((B * K,), CTX + it, dtype=torch.int32)
        single = wrapper(dict(qo_indptr=qo, kv_indptr=ptr, kv_indices=kv_indices[s].int(),
                              kv_len_arr=kv_len, causal=False), 1)  # fmt: skip
        t_cascade = device_us(cascade_step, calls=50) / 1000
        t_single = device_us(lambda w=single: run(w, 1), calls=50) / 1000
        keys_single = B * K * (CTX + it)
        keys_cascade = B * CTX + B * K * it
        out_rows.append(dict(step=s, cascade_ms=t_cascade, per_branch_ms=t_single,
                             keys_cascade=keys_cascade, keys_per_branch=keys_single))  # fmt: skip
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                specmeta=specmeta.__version__, B=B, topk=K, steps=S, context=CTX, page_size=PS,
                heads=h)  # fmt: skip
    print(f"{meta['device']}: B={B} topk={K} S={S} L={CTX} heads={h}, bf16, ckv {CKV} kpe {KPE}")
    print("| step | cascade ms | per-branch ms | speed-up | keys read, cascade / per branch |")
    print("|---|---|---|---|---|")
    for r in out_rows:
        print(f"| {r['step']} | {r['cascade_ms']:.3f} | {r['per_branch_ms']:.3f} | "
              f"{r['per_branch_ms'] / r['cascade_ms']:.2f}x | "
              f"{r['keys_cascade']:,} / {r['keys_per_branch']:,} |")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": out_rows}, f, indent=1)


if __name__ == "__main__":
    main()
