"""Does compute-sanitizer's initcheck see what FlashAttention's CuTe kernel writes?

Run it under ``compute-sanitizer --tool initcheck --check-api-memory-access no``. One paged
varlen call in which every request has keys and every query row is real, so the kernel writes
every element of its output and LSE; then one torch kernel reads each of them. Any initcheck
report on those reads means initcheck does not track the kernel's (TMA) stores: the reads
follow a complete write. A control reads a tensor written by a plain torch kernel.
"""

import torch
from flash_attn.cute import flash_attn_varlen_func


def main() -> None:
    torch.manual_seed(0)
    dev, heads, kv_heads, dim, ps = "cuda", 32, 8, 128, 16
    lens = [37, 64, 5, 128]  # keys a request; every one non-empty
    q_rows = [1, 4, 2, 3]
    pages = [(n + ps - 1) // ps for n in lens]
    pool_pages = sum(pages) + 1
    k = torch.randn(pool_pages, ps, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
    start = 1
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    cu_q = torch.tensor([0, *torch.tensor(q_rows).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(int(cu_q[-1]), heads, dim, device=dev, dtype=torch.bfloat16)
    seqused = torch.tensor(lens, dtype=torch.int32, device=dev)
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, seqused_k=seqused, page_table=table,
        max_seqlen_q=max(q_rows), causal=False, return_lse=True,
    )[:2]
    torch.cuda.synchronize()
    print("probe: reading the attention output", flush=True)
    a = out.float().sum()
    torch.cuda.synchronize()
    print("probe: reading the LSE", flush=True)
    b = lse.float().sum()
    torch.cuda.synchronize()
    print("probe: control, a tensor written by torch", flush=True)
    c = (q * 2).float().sum()
    torch.cuda.synchronize()
    print(f"probe: done, finite={bool(torch.isfinite(a + b + c))}", flush=True)


if __name__ == "__main__":
    main()
