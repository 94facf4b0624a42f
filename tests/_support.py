"""What several test modules share: row widths of test batches, compile counts, the GPU tier's
proof that a build path never syncs, and the direct readings of design §1 and §2.3 that more
than one op's tests apply.

One definition each, imported where needed (tests import from here, never from each other).
"""

from __future__ import annotations

import contextlib

import torch

from specmeta.config import draft_pages_per_branch, uses_layout_b
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs


@contextlib.contextmanager
def no_host_sync():
    """Inside, any host sync raises (``torch.cuda.set_sync_debug_mode("error")``): a build path
    run here is proved sync-free. The default mode is restored on the way out, raise or not."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def row_width(k: int, s: int, ps: int, *, extra: int = 0, prefix: int = 40) -> int:
    """A ``req_to_token`` width for test batches of prefixes up to ``prefix`` tokens: room for
    ``k`` branches of ``s`` draft steps each on their own pages, ``extra`` more tokens (a verify
    window) and two spare pages, rounded up to whole pages."""
    return -(-(prefix + k * (s + ps) + extra + 2 * ps) // ps) * ps


def compiled_variants(fn) -> int:
    """Compiled specialisations of one Triton kernel (Triton 3.x keeps them per device)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in fn.cache.values())


def all_compiled_variants() -> int:
    """Compiled specialisations of every specmeta Triton kernel imported so far."""
    import sys

    import triton

    total = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("specmeta."):
            for obj in vars(module).values():
                if isinstance(obj, triton.runtime.JITFunction):
                    total += compiled_variants(obj)
    return total


# ------------------------------------------------------------------------------------------
# design §1 and §2.3 read directly, for the ops that build these tables (and the fused build)
# ------------------------------------------------------------------------------------------
def check_prefix_page_table_spec(batch, pt, cs, cu, *, extra, exclude, rows, fill):
    """design §2.3: page_table[b, c] = row_b[c·ps] // ps for the pages covering the longest row's
    tokens, ``fill`` beyond; cache_seqlens = len + s; cu_seqlens_k its exclusive prefix sum."""
    ps = batch.page_size
    pt, r2t = pt.cpu().long(), batch.req_to_token.cpu().long()
    cs = cs.cpu().long().view(rows or 1, batch.batch_size)
    cu = cu.cpu().long().view(cs.shape[0], batch.batch_size + 1)
    for b in range(batch.batch_size):
        row = r2t[int(batch.req_pool_indices[b])]
        L = int(batch.seq_lens_cpu[b])
        length = (L - L % ps if exclude else L) + extra
        longest = length + (rows or 1) - 1
        n = -(-longest // ps)
        want = torch.full((pt.shape[1],), fill, dtype=torch.long)
        want[:n] = row[torch.arange(n) * ps] // ps
        assert torch.equal(pt[b], want), f"request {b}: {pt[b].tolist()} != {want.tolist()}"
        for s in range(cs.shape[0]):
            assert int(cs[s, b]) == length + s
    assert torch.equal(cu[:, 1:], cs.cumsum(1)) and not cu[:, 0].any()


def check_expand_page_table_spec(batch, slots, pt, cs, cu, rows):
    """Read design §1 and §2.3 directly: token ``k`` of the expand sequence of branch ``t`` at
    step ``s`` lives at slot ``page_table[s, r, k // ps]·ps + k % ps``; the tokens before
    ``lpl`` are the start of the branch's region (layout B) — for ``t = 0`` the prefix's own
    last partial page — and token ``lpl + j`` is draft slot ``j``."""
    B, K, S, ps = batch.batch_size, batch.topk, batch.num_steps, batch.page_size
    pt, cs, cu = pt.cpu().long(), cs.cpu().long(), cu.cpu().long()
    r2t, slots = batch.req_to_token.cpu().long(), slots.cpu().long().view(B * K, S)
    for b in range(B):
        row = r2t[int(batch.req_pool_indices[b])]
        L = int(batch.seq_lens_cpu[b])
        lpl = L % ps if ps > 1 else 0
        nnp = draft_pages_per_branch(L, S, ps)
        for t in range(K):
            r = b * K + t
            region = L - lpl + (t * nnp * ps if uses_layout_b(K, ps) else 0)
            for s in range(rows):
                n = lpl + s + 1
                assert int(cs[s, r]) == n, f"cache_seqlens[{s}, {r}]"
                u = -(-n // ps)
                read = pt[s, r, torch.arange(n) // ps] * ps + torch.arange(n) % ps
                want = torch.cat([row[region : region + lpl], slots[r, : s + 1]])
                assert torch.equal(read, want), f"step {s} branch {r}: {read} != {want}"
                assert not pt[s, r, u:].any(), f"stale columns after {u} in [{s}, {r}]"
    assert torch.equal(cu[:, 1:], cs.cumsum(1)) and not cu[:, 0].any()


def branch_sequences(batch, rows):
    """``[s][b·K + t]``: the slots of branch (b, t)'s logical sequence at step s: its prefix
    ``row_b[0:L_b]``, then its own first ``s + 1`` draft slots (design §1)."""
    B, K, S = batch.batch_size, batch.topk, batch.num_steps
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    slots = assign_draft_cache_locs(*args, topk=K, num_steps=S, page_size=batch.page_size)
    slots = slots.cpu().view(B, K, S)
    r2t = batch.req_to_token.cpu().long()
    return [
        [
            torch.cat(
                [
                    r2t[int(batch.req_pool_indices[b])][: int(batch.seq_lens_cpu[b])],
                    slots[b, t, : s + 1],
                ]
            )  # fmt: skip
            for b in range(B)
            for t in range(K)
        ]
        for s in range(rows)
    ]


def draft_stage_runner(build, bufs, cfg, device, req_to_token, buckets, *, graphs=None):
    """A captured runner of a draft stage, ``build(inputs) -> Stage``: ``req_pool_indices`` and
    ``seq_lens`` (with its CPU mirror) registered with their design §4 pads, ``req_to_token``
    guarded."""
    from specmeta.runners import padding
    from specmeta.runners.graph_runner import GraphRunner

    runner = GraphRunner(build, batch_sizes=buckets, device=device, graphs=graphs)
    runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", bufs["runner.seq_lens"],
                     pad=padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens),
                     host_mirror=True)  # fmt: skip
    runner.add_guard("req_to_token", req_to_token)
    runner.capture()
    return runner


# Ragged target verify (design §2.9): the padding rule and the splits the tests draw.
def padded_lengths(real: list[int], T: int, Bp: int) -> list[int]:
    """The issue's padding rule, read directly: real requests keep ``v_b``; the leftover goes
    to the pads, ``⌊leftover / pads⌋`` each and one more for the first ``leftover mod pads``;
    without a pad the last request takes it."""
    leftover, pads = T - sum(real), Bp - len(real)
    if pads == 0:
        return real[:-1] + [real[-1] + leftover] if real else []
    return real + [leftover // pads + (j < leftover % pads) for j in range(pads)]


def verify_split(gen, Bp: int, n: int, how: str) -> tuple[list[int], int]:
    """Real lengths and a bucket ``T``: random, or one of the adversarial splits."""
    draw = lambda hi: int(torch.randint(0, hi + 1, (1,), generator=gen))  # noqa: E731
    if how == "random":
        real = [draw(n) for _ in range(draw(Bp))]
        return real, sum(real) + draw(Bp * n - sum(real))
    if how == "zeros":  # every real request verifies nothing
        return [0] * draw(Bp), draw(Bp * n)
    if how == "one_takes_all":  # one real request, the whole window; T exactly its length
        return [n], n
    if how == "full":  # B' = Bp, Σv = T exactly: no leftover
        real = [draw(n) for _ in range(Bp)]
        return real, sum(real)
    if how == "no_pad_leftover":  # B' = Bp and a leftover: the last request's filler rows
        real = [draw(n) for _ in range(Bp)]
        return real, Bp * n
    raise AssertionError(how)


def emitted_id(row, p: int, v2p, *, E: int, ps: int) -> int:
    """The id row ``row`` names at position ``p`` as a kernel emits it (design §2.10), read from
    the rules: a token entry, or a page entry's token; then through the page map ``v2p``; 0
    (the sink) where it does not map."""
    tid = int(row[p]) if E == 1 else int(row[p // E]) * E + p % E
    if E > 1 and tid < 0:
        return 0
    if v2p is None:
        return tid
    page = tid // ps
    if tid < 0 or page >= v2p.shape[0] or int(v2p[page]) < 0:
        return 0
    return int(v2p[page]) * ps + tid % ps


def physical_rows(rows, v2p, *, E: int, ps: int) -> torch.Tensor:
    """The plain rows (one token id a position) that ``rows`` of entry size ``E`` through the
    page map ``v2p`` stand for."""
    R, W = rows.shape
    return torch.tensor([[emitted_id(rows[r], p, v2p, E=E, ps=ps) for p in range(W * E)]
                         for r in range(R)], dtype=torch.int64)  # fmt: skip


def sink_keeping_map(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random injection of ``[0, n)`` into ``[0, 2n)`` that keeps the sink: entry 0 is 0 and
    no other entry is (a page map ``v2p`` or a window map with room to spare, design §2.10)."""
    ids = torch.randperm(2 * n, generator=gen)[:n]
    ids[ids == 0] = ids[0].clone()
    ids[0] = 0
    return ids


# ------------------------------------------------------------------------------------------------
# FlashInfer MLA's real kernel (GPU tier): the latent widths it serves, one wrapper's backend,
# one pass's plan() from its host mirrors, and the float64 oracle over a latent pool
# ------------------------------------------------------------------------------------------------
MLA_HEADS, MLA_CKV, MLA_KPE = 16, 512, 64  # query heads (a tensor-parallel shard of DeepSeek's
MLA_SCALE = (MLA_CKV + MLA_KPE) ** -0.5  # 128), the kernel's latent widths


def mla_wrapper(workspace: torch.Tensor, **kwargs):
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on ``workspace`` (its ``fa3`` backend
    on sm_90, ``fa2`` elsewhere); ``kwargs`` as the wrapper takes them (a graph's reserved
    offsets)."""
    import flashinfer.mla

    backend = "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    return flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend, **kwargs)


def plan_mla_pass(wrapper, p, dtype: torch.dtype = torch.bfloat16) -> None:
    """``plan()`` of one FlashInfer MLA pass from its host mirrors (the device ``kv_indices``
    cut to the entries the mirror says are used: a host value, no sync), natural-log LSE."""
    import flashinfer.mla

    used = int(p.kv_indptr_host[-1])
    metadata = flashinfer.mla.MLAPlanMetadata.csr(
        qo_indptr=p.qo_indptr_host, kv_indptr=p.kv_indptr_host, kv_indices=p.kv_indices[:used],
        kv_len_arr=p.kv_len_arr_host)  # fmt: skip
    wrapper.plan(metadata=metadata, num_heads=MLA_HEADS, head_dim_ckv=MLA_CKV,
                 head_dim_kpe=MLA_KPE, page_size=p.page_size, causal=p.causal,
                 sm_scale=MLA_SCALE, q_data_type=dtype, kv_data_type=dtype,
                 query_layout="split", kv_cache_layout="split", lse_mode="basee")  # fmt: skip


def latent_oracle(qn: torch.Tensor, qp: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                  lists) -> torch.Tensor:  # fmt: skip
    """Dense MLA attention in float64 over each row's key list (``lists``: pool slots per
    query row), keys ``[ckv, kpe]`` and values ``ckv`` of the same values the kernel read."""
    from specmeta.testing.consumers.dense import dense_attention

    q = torch.cat([qn, qp], -1).double().cpu()
    ckv64 = ckv.double().cpu()
    k = torch.cat([ckv64, kpe.double().cpu()], -1).unsqueeze(1)
    return dense_attention(q, k, ckv64.unsqueeze(1), lists, softmax_scale=MLA_SCALE)[0]
