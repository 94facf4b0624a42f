"""TRT-LLM MLA builders: block tables, KV lengths and uniform query rows, read by a reference
consumer the way TRT-LLM MLA reads them, give the attention of every branch's or token's logical
sequence (design §1, §3.1, §3.4), trees included through per-branch page tables."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, plan_buffers
from specmeta.config import trtllm_mla_max_blocks
from specmeta.kernels.draft_cache_locs import prefix_tail_copy_pairs
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.runners import collector_off
from specmeta.testing.consumers import trtllm_mla as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.workloads import make_batch
from tests._support import branch_sequences, no_host_sync

H, H_KV, D = 4, 1, 8  # MLA: every query head reads the one latent KV head
ATOL = 1e-9


def _setup(gen, device, k, s, ps, shape, *, n=None, batch_size=None, ctx=40):
    n = s + 1 if n is None else n
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=16,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    return cfg, batch, kc, vc


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _close(got, want, what):
    assert torch.allclose(got[0], want[0], atol=ATOL, rtol=0), f"{what}: outputs differ"
    assert torch.allclose(got[1], want[1], atol=ATOL, rtol=0), f"{what}: log-sum-exps differ"


@pytest.mark.parametrize("shape", ["empty", "one", "random", "mod0", "modm1", "near_row_end"])
@pytest.mark.parametrize("k,s,ps", [(1, 3, 1), (1, 4, 16), (2, 4, 4), (4, 3, 2), (3, 2, 16)])
def test_draft_decode_per_branch_tables(device, gen, k, s, ps, shape):
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    mla = TrtllmMlaBuilder(cfg, device)
    max_len = int(batch.seq_lens_cpu.max()) if batch.batch_size else None
    meta = mla.draft_decode(*_args(batch), num_rows=s, max_seq_len=max_len)
    # Layout B: the prefix tail must be copied into branches t >= 1 before they are read.
    tgt, src = prefix_tail_copy_pairs(*_args(batch), topk=k, num_steps=s, page_size=ps)
    kc[tgt.cpu()], vc[tgt.cpu()] = kc[src.cpu()], vc[src.cpu()]
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    maxblk = trtllm_mla_max_blocks(cfg.max_context_len + max(s, cfg.num_draft_tokens), ps)
    for row, (step, want) in enumerate(zip(meta.steps, branch_sequences(batch, s), strict=True)):
        assert step.block_kv_indices.shape == (batch.batch_size * k, maxblk)
        assert step.block_kv_indices.dtype == torch.int32
        lens = batch.seq_lens_cpu.repeat_interleave(k) + row + 1
        assert step.seq_lens_k.cpu().tolist() == lens.tolist()  # L + s + 1, not L
        assert all(step.max_seq_len_k >= x for x in lens.tolist())
        _close(consumer.decode(q, kc, vc, step, ps), dense_attention(q, kc, vc, want), "decode")
    table = meta.steps[0].block_kv_indices.cpu() if meta.steps else None
    for r in range(batch.batch_size * k):
        used = -(-(int(batch.seq_lens_cpu[r // k]) + s) // ps)
        assert table[r, used:].eq(-1).all() and table[r, :used].ge(0).all()
    assert int(mla.status) == 0


def _causal_sequences(batch, n):
    r2t = batch.req_to_token.cpu().long()
    out = []
    for i in range(batch.batch_size):
        L, row = int(batch.seq_lens_cpu[i]), r2t[int(batch.req_pool_indices[i])]
        out.extend(row[: L + j + 1] for j in range(n))
    return out


@pytest.mark.parametrize("mode", ["target_verify", "draft_extend"])
@pytest.mark.parametrize("shape", ["empty", "one", "odd", "long_short", "near_row_end"])
@pytest.mark.parametrize("s,ps", [(3, 1), (4, 16), (2, 64)])
def test_verify_and_extend_uniform_rows(device, gen, s, ps, shape, mode):
    cfg, batch, kc, vc = _setup(gen, device, 1, s, ps, shape)
    n, B = cfg.num_draft_tokens, batch.batch_size
    mla = TrtllmMlaBuilder(cfg, device)
    meta = getattr(mla, mode)(*_args(batch))
    assert meta.seq_lens_k.cpu().tolist() == (batch.seq_lens_cpu + n).tolist()
    assert meta.cu_seqlens_q.cpu().tolist() == [n * i for i in range(B + 1)]
    assert meta.max_seq_len_q == n and meta.sum_seq_lens_q == B * n
    maxblk = meta.block_kv_indices.shape[1]
    assert maxblk % max(1, 128 // ps) == 0 and maxblk * ps >= cfg.max_context_len + n
    q = torch.randn(B * n, H, D, generator=gen, dtype=torch.float64)
    want = dense_attention(q, kc, vc, _causal_sequences(batch, n))
    _close(consumer.prefill(q, kc, vc, meta, ps), want, mode)
    assert int(mla.status) == 0


def test_query_layout_is_the_same_at_capture_and_replay(device, gen):
    """Seed 004: a capture at Bp and a replay at B < Bp see the same uniform cu_seqlens_q."""
    cfg, batch, _, _ = _setup(gen, device, 1, 3, 16, "random", batch_size=16)
    mla = TrtllmMlaBuilder(cfg, device)
    captured = mla.draft_extend(*_args(batch))
    cu_capture = captured.cu_seqlens_q.clone()
    small = make_batch("random", batch_size=5, topk=1, num_steps=3, page_size=16,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=4, max_len=40)  # fmt: skip
    replay = mla.draft_extend(*_args(small))
    # The same memory a graph captured at Bp reads, holding the same values.
    assert replay.cu_seqlens_q.data_ptr() == captured.cu_seqlens_q.data_ptr()
    assert torch.equal(replay.cu_seqlens_q, cu_capture[:6])
    assert replay.max_seq_len_q == captured.max_seq_len_q == 4


def test_buffers_come_from_the_plan(device):
    cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=32, max_bs=4,
                     max_context_len=1000)  # fmt: skip
    plan = plan_buffers(cfg)
    mla = TrtllmMlaBuilder(cfg, device)
    for name, buf in mla.buffers.items():
        spec = plan["trtllm_mla." + name]
        assert tuple(buf.shape) == spec.shape and buf.dtype == spec.dtype, name
    # ceil(1008 / 32) = 32 pages, a multiple of 128 / 32 = 4 already; pages of 256 need none.
    assert mla.max_blocks == 32
    assert trtllm_mla_max_blocks(1008, 256) == 4 and trtllm_mla_max_blocks(1025, 32) == 36


def test_bad_inputs_are_reported_or_raise(device, gen):
    cfg, batch, _, _ = _setup(gen, device, 2, 3, 4, "random", batch_size=5)
    mla = TrtllmMlaBuilder(cfg, device)
    with pytest.raises(ValueError, match="tree_mask is required with topk=2"):
        mla.target_verify(*_args(batch))  # a tree's verify is a cascade over the tree's mask
    with pytest.raises(ValueError, match="max_bs"):
        big = torch.ones(17, dtype=torch.int64, device=device)
        mla.draft_decode(big, batch.req_to_token, big)
    with pytest.raises(ValueError, match="max_context_len"):
        mla.draft_decode(*_args(batch), max_seq_len=41)
    with pytest.raises(TypeError, match="max_seq_len"):
        mla.draft_extend(*_args(batch), max_seq_len=torch.tensor(3))
    batch.req_pool_indices[0] = -1
    mla.draft_decode(*_args(batch))
    assert int(mla.status) & int(Status.ROW_OOB)


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps", [(1, 3, 4), (2, 4, 4), (3, 2, 16)])
def test_a_bound_stage_follows_new_inputs_launch_after_launch(device, gen, k, s, ps, host_ops,
                                                              request):  # fmt: skip
    """Every mode bound once to the engine's own tensors, then run twice with new device
    values copied into them and the new ``seq_lens_cpu``: each run's block tables and lengths
    equal, integer for integer, what the reference builder gives for that batch; and a
    refused ``seq_lens_cpu`` raises the eager call's message from the stage too."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=s + 1, page_size=ps, max_bs=8,
                     max_context_len=40)  # fmt: skip
    draws = [make_batch("random", batch_size=5, topk=k, num_steps=s, page_size=ps,
                        row_width=cfg.req_to_token_width, generator=gen, device=device,
                        num_rows=9, extra_tokens=cfg.num_draft_tokens, max_len=40)
             for _ in range(3)]  # fmt: skip
    rpi, r2t, sl = (t.clone() for t in _args(draws[0]))
    mla = TrtllmMlaBuilder(cfg, device, host_ops=host_ops)
    ref = TrtllmMlaBuilder(cfg, device, reference=True, host_ops=False)
    modes = ["draft_decode", "draft_extend"] + (["target_verify"] if k == 1 else [])
    kw = {"draft_decode": {"num_rows": s}}
    stages = {m: mla.bind(m, rpi, r2t, sl, **kw.get(m, {})) for m in modes}
    for i, batch in enumerate(draws[1:]):
        for dst, src in zip((rpi, r2t, sl), _args(batch), strict=True):
            dst.copy_(src)
        for mode, stage in stages.items():
            got = stage(batch.seq_lens_cpu.clone())
            want = getattr(ref, mode)(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu,
                                      **kw.get(mode, {}))  # fmt: skip
            _assert_same(got, want, f"{mode} run {i}")
            if hasattr(want, "steps"):
                assert [x.max_seq_len_k for x in got] == [x.max_seq_len_k for x in want]
            else:
                assert got.max_seq_len_k == want.max_seq_len_k
    bad = batch.seq_lens_cpu.clone()
    bad[2] = 41
    for mode, stage in stages.items():
        with pytest.raises(ValueError) as want:
            getattr(mla, mode)(rpi, r2t, sl, seq_lens_cpu=bad, **kw.get(mode, {}))
        with pytest.raises(ValueError) as got:
            stage(bad)
        assert str(got.value) == str(want.value) and "seq_lens_cpu holds 41" in str(got.value)
    assert int(mla.status) == 0 and int(ref.status) == 0


# ---------------------------------------------------------------------------------------------
# GPU tier: production shapes against the references, CUDA-graph replay against eager builds
# (the query layout identical at capture and replay, seed 004), no host sync.
# ---------------------------------------------------------------------------------------------
def _gpu_batch(gen, cfg, shape, batch_size):
    return make_batch(shape, batch_size=batch_size, topk=cfg.topk, num_steps=cfg.num_steps,
                      page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                      device="cuda", extra_tokens=cfg.num_draft_tokens,
                      max_len=cfg.max_context_len, num_rows=batch_size + 8)  # fmt: skip


def _modes(mla, rpi, r2t, sl, rows):
    out = {"draft_decode": mla.draft_decode(rpi, r2t, sl, num_rows=rows)}
    if mla.cfg.topk == 1:
        out["target_verify"] = mla.target_verify(rpi, r2t, sl)
    out["draft_extend"] = mla.draft_extend(rpi, r2t, sl)
    return out


def _assert_same(got, want, what):
    from tests.guard_bands import assert_equal

    if hasattr(got, "steps"):
        for s, (a, b) in enumerate(zip(got.steps, want.steps, strict=True)):
            assert_equal(a.block_kv_indices, b.block_kv_indices, f"{what}[{s}] block_kv_indices")
            assert_equal(a.seq_lens_k, b.seq_lens_k, f"{what}[{s}] seq_lens_k")
        return
    for field in ("block_kv_indices", "seq_lens_k", "cu_seqlens_q"):
        assert_equal(getattr(got, field), getattr(want, field), f"{what} {field}")
    assert (got.max_seq_len_q, got.sum_seq_lens_q) == (want.max_seq_len_q, want.sum_seq_lens_q)


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(1, 32), (1, 64), (8, 64), (4, 32)])
def test_gpu_production_shape_matches_references(gen, k, ps):
    from specmeta.kernels.branch_page_table import branch_page_table_ref
    from specmeta.kernels.prefix_page_table import prefix_page_table_ref
    from tests.guard_bands import assert_equal

    B, S, ctx = 256, 5, 32768
    n = S + 1 if k == 1 else 16
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=B,
                     max_context_len=ctx)  # fmt: skip
    batch = _gpu_batch(gen, cfg, "long_short", B)
    batch.seq_lens[1::2] = torch.randint(ctx // 2, ctx, (B // 2,), device="cuda")
    mla = TrtllmMlaBuilder(cfg, "cuda")
    got = _modes(mla, *_args(batch), S)
    W = mla.max_blocks
    table = torch.empty(B * k, W, dtype=torch.int32, device="cuda")
    want, lens = branch_page_table_ref(*_args(batch), topk=k, num_steps=S, page_size=ps,
                                       fill_value=-1, page_table=table)  # fmt: skip
    for s, step in enumerate(got["draft_decode"].steps):
        assert_equal(step.block_kv_indices, want, "draft_decode block_kv_indices")
        assert_equal(step.seq_lens_k, lens[s], "draft_decode seq_lens_k")
    for mode in [m for m in got if m != "draft_decode"]:
        table = torch.empty(B, W, dtype=torch.int32, device="cuda")
        want, lens = prefix_page_table_ref(*_args(batch), page_size=ps, extra_tokens=n,
                                           fill_value=-1, page_table=table)  # fmt: skip
        assert_equal(got[mode].block_kv_indices, want, f"{mode} block_kv_indices")
        assert_equal(got[mode].seq_lens_k, lens, f"{mode} seq_lens_k")
    assert int(mla.status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(1, 64), (4, 32)])
def test_gpu_graph_replay_equals_eager_with_changing_inputs(gen, k, ps):
    B, S, ctx = 32, 4, 4096
    n = S + 1 if k == 1 else 8
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=B,
                     max_context_len=ctx)  # fmt: skip
    draws = [_gpu_batch(gen, cfg, shape, B) for shape in ("random", "long_short", "modm1", "max")]
    rpi, r2t, sl = (x.clone() for x in _args(draws[0]))
    mla, eager = TrtllmMlaBuilder(cfg, "cuda"), TrtllmMlaBuilder(cfg, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _modes(mla, rpi, r2t, sl, S)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        captured = _modes(mla, rpi, r2t, sl, S)
    for batch in draws[1:] + draws[:1]:
        rpi.copy_(batch.req_pool_indices)
        r2t.copy_(batch.req_to_token)
        sl.copy_(batch.seq_lens)
        graph.replay()
        want = _modes(eager, *_args(batch), S)
        torch.cuda.synchronize()
        for key in want:
            _assert_same(captured[key], want[key], f"{key} [{batch.shape}]")
    assert int(mla.status) == 0 and int(eager.status) == 0


@pytest.mark.gpu
def test_gpu_no_host_sync_on_the_build_path(gen):
    cfg = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=64, max_bs=16,
                     max_context_len=2048)  # fmt: skip
    batch = _gpu_batch(gen, cfg, "random", 16)
    mla = TrtllmMlaBuilder(cfg, "cuda")
    _modes(mla, *_args(batch), 3)
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            _modes(mla, *_args(batch), 3)
    torch.cuda.synchronize()
    assert int(mla.status) == 0
