"""FlashInfer builders: the metadata, read by a reference consumer the way FlashInfer reads it,
gives the attention of every branch's or tree node's logical sequence (design §1, §3.3)."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status, plan_buffers
from specmeta.kernels.draft_cache_locs import prefix_tail_copy_pairs
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.runners import collector_off
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.masks import written_part
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import branch_sequences, no_host_sync
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8  # query heads, KV heads (grouped-query), head dim
ATOL = 1e-9  # float64 oracle against float64 consumer: only summation order differs

CONFIGS = [(1, 3, 1), (4, 3, 1), (2, 4, 4), (3, 2, 16)]  # (K, S, ps)


def _setup(gen, device, k, s, ps, shape, *, n=None, batch_size=None, ctx=40):
    n = min(1 + k + (s - 1) * k * k, 8) if n is None else n
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=16,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    k_cache = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    return cfg, batch, k_cache, v_cache


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _close(got, want, what):
    (o, lse), (o_ref, lse_ref) = got, want
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"{what}: outputs differ"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"{what}: log-sum-exps differ"


@pytest.mark.parametrize("shape", ["one", "random", "modm1"])
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_draft_decode_token_lists(device, gen, k, s, ps, shape):
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    fi = FlashInferBuilder(cfg, device)
    meta = fi.draft_decode(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, num_rows=s)
    assert len(meta.steps) == s
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    for step, want in zip(meta.steps, branch_sequences(batch, s), strict=True):
        assert step.page_size == 1 and step.kv_last_page_len.eq(1).all()
        assert_equal(step.kv_indptr_host, step.kv_indptr, "kv_indptr_host")
        _close(consumer.decode(q, kc, vc, step), dense_attention(q, kc, vc, want), "decode")
    assert int(fi.status) == 0


@pytest.mark.parametrize("shape", ["empty", "odd", "mod1"])
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_draft_decode_shared_prefix_cascade(device, gen, k, s, ps, shape):
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    fi = FlashInferBuilder(cfg, device)
    meta = fi.draft_decode_shared_prefix(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu,
                                         num_rows=s)  # fmt: skip
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    for step, want in zip(meta.steps, branch_sequences(batch, s), strict=True):
        for host, dev in zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True):
            assert_equal(host, dev, "paged_kv_indptr_host")
        for host, dev in zip(step.qo_indptr_host_arr, step.qo_indptr_arr, strict=True):
            assert_equal(host, dev, "qo_indptr_host")
        _close(consumer.cascade(q, kc, vc, step), dense_attention(q, kc, vc, want), "cascade")
    assert int(fi.status) == 0


@pytest.mark.parametrize("shape", ["random", "mod0", "modm1", "near_row_end"])
@pytest.mark.parametrize("k,s,ps", [(2, 4, 4), (3, 2, 16), (4, 3, 2), (1, 3, 4)])
def test_draft_decode_paged_needs_the_prefix_tail_copies(device, gen, k, s, ps, shape):
    """Per-branch page lists with ps > 1 (layout B): right once the prefix-tail copies are
    applied to the cache, wrong without them whenever a branch t ≥ 1 has a partial page."""
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    fi = FlashInferBuilder(cfg, device)
    meta = fi.draft_decode_paged(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, num_rows=s)
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    tgt, src = prefix_tail_copy_pairs(*_args(batch), topk=k, num_steps=s, page_size=ps)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[tgt.cpu()], vc2[tgt.cpu()] = kc[src.cpu()], vc[src.cpu()]
    needs_copy = k > 1 and bool((batch.seq_lens_cpu % ps).any())
    for step, want in zip(meta.steps, branch_sequences(batch, s), strict=True):
        assert step.page_size == ps
        assert_equal(step.kv_indptr_host, step.kv_indptr, "kv_indptr_host")
        assert_equal(step.kv_last_page_len_host, step.kv_last_page_len, "kv_last_page_len_host")
        _close(consumer.decode(q, kc2, vc2, step), dense_attention(q, kc2, vc2, want), "paged")
        if needs_copy:
            o, _ = consumer.decode(q, kc, vc, step)
            assert not torch.allclose(o, dense_attention(q, kc, vc, want)[0], atol=1e-6)
    assert int(fi.status) == 0


def tree_sequences(batch, tree, n):
    """Node j of request i: its prefix, then the verify slots ``row_i[L_i + c]`` of its
    ancestors and itself (columns set in the tree mask)."""
    r2t = batch.req_to_token.cpu().long()
    out = []
    for i in range(batch.batch_size):
        L = int(batch.seq_lens_cpu[i])
        row = r2t[int(batch.req_pool_indices[i])]
        for j in range(n):
            out.append(torch.cat([row[:L], row[L : L + n][tree[i, j].cpu()]]))
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", ["empty", "odd", "near_row_end"])
@pytest.mark.parametrize("k,s,ps", CONFIGS)
def test_target_verify_tree(device, gen, k, s, ps, shape, packed):
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    n = cfg.num_draft_tokens
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    fi = FlashInferBuilder(cfg, device)
    meta = fi.target_verify(*_args(batch), tree, seq_lens_cpu=batch.seq_lens_cpu, packed=packed)
    B = batch.batch_size
    assert meta.qo_indptr.tolist() == [n * i for i in range(B + 1)] and meta.max_q_len == n
    assert (meta.custom_mask is None) == packed and (meta.packed_custom_mask is None) != packed
    assert_equal(meta.kv_indptr_host, meta.kv_indptr, "kv_indptr_host")
    assert_equal(meta.mask_indptr_host, meta.mask_indptr, "mask_indptr_host")
    assert_equal(meta.qo_indptr_host, meta.qo_indptr, "qo_indptr_host")
    q = torch.randn(B * n, H, D, generator=gen, dtype=torch.float64)
    want = dense_attention(q, kc, vc, tree_sequences(batch, tree, n))
    _close(consumer.prefill(q, kc, vc, meta), want, "verify")
    assert int(fi.status) == 0


@pytest.mark.parametrize("shape", ["empty", "one", "odd", "long_short"])
@pytest.mark.parametrize("k,s,ps", CONFIGS[:2])
def test_draft_extend_causal(device, gen, k, s, ps, shape):
    cfg, batch, kc, vc = _setup(gen, device, k, s, ps, shape)
    n = cfg.num_draft_tokens
    meta = FlashInferBuilder(cfg, device).draft_extend(
        *_args(batch), seq_lens_cpu=batch.seq_lens_cpu
    )
    assert meta.causal and meta.custom_mask is None and meta.max_q_len == n
    assert_equal(meta.kv_indptr_host, meta.kv_indptr, "kv_indptr_host")
    r2t = batch.req_to_token.cpu().long()
    want = []
    for i in range(batch.batch_size):
        L, row = int(batch.seq_lens_cpu[i]), r2t[int(batch.req_pool_indices[i])]
        want.extend(row[: L + j + 1] for j in range(n))
    q = torch.randn(batch.batch_size * n, H, D, generator=gen, dtype=torch.float64)
    _close(consumer.prefill(q, kc, vc, meta), dense_attention(q, kc, vc, want), "extend")


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
def test_host_mirrors_take_int32_and_int64_lengths_and_any_batch_in_turn(device, gen, host_ops,
                                                                          request):  # fmt: skip
    """Both host-mirror writers (metadata/host_ops.py) take int32 and int64 lengths alike:
    every mode's mirrors equal the device's offsets for either dtype, at batch sizes that grow
    and shrink between calls (each call's own lengths, not a stale view of an earlier
    batch's)."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    k, s, ps = 2, 3, 4
    cfg, batch, _, _ = _setup(gen, device, k, s, ps, "random", batch_size=6)
    fi = FlashInferBuilder(cfg, device, host_ops=host_ops)
    tree = random_tree_mask(6, k, s, cfg.num_draft_tokens, gen).to(device)
    for B, dtype in ((6, torch.int64), (2, torch.int32), (5, torch.int32), (1, torch.int64)):
        rpi, r2t, lens = batch.req_pool_indices[:B], batch.req_to_token, batch.seq_lens[:B]
        host = batch.seq_lens_cpu[:B].to(dtype)
        meta = fi.draft_decode(rpi, r2t, lens, seq_lens_cpu=host, num_rows=s)
        for step in meta.steps:
            assert_equal(step.kv_indptr_host, step.kv_indptr, f"B={B} {dtype} kv_indptr_host")
        meta = fi.draft_decode_shared_prefix(rpi, r2t, lens, seq_lens_cpu=host, num_rows=s)
        for step in meta.steps:
            for h, d in zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True):
                assert_equal(h, d, f"B={B} {dtype} paged_kv_indptr_host")
        meta = fi.draft_decode_paged(rpi, r2t, lens, seq_lens_cpu=host, num_rows=s)
        for step in meta.steps:
            assert_equal(step.kv_indptr_host, step.kv_indptr, f"B={B} {dtype} paged kv_indptr")
            assert_equal(step.kv_last_page_len_host, step.kv_last_page_len, f"B={B} last page")
        for meta in (fi.target_verify(rpi, r2t, lens, tree[:B], seq_lens_cpu=host),
                     fi.draft_extend(rpi, r2t, lens, seq_lens_cpu=host)):  # fmt: skip
            assert_equal(meta.kv_indptr_host, meta.kv_indptr, f"B={B} {dtype} prefill kv_indptr")
            if meta.mask_indptr_host is not None:
                assert_equal(meta.mask_indptr_host, meta.mask_indptr, f"B={B} mask_indptr")
    assert int(fi.status) == 0


def test_buffers_come_from_the_plan_and_memory_shrinks(device):
    cfg = SpecConfig(topk=8, num_steps=5, num_draft_tokens=16, page_size=1, max_bs=4,
                     max_context_len=512)  # fmt: skip
    plan = plan_buffers(cfg)
    fi = FlashInferBuilder(cfg, device)
    for name, buf in fi.buffers.items():
        spec = plan["flashinfer." + name]
        assert tuple(buf.shape) == spec.shape and buf.dtype == spec.dtype, name
    per_branch = plan["flashinfer.draft_decode.kv_indices"].numel
    shared = sum(plan[f"flashinfer.draft_decode_shared.{f}_kv_indices"].numel
                 for f in ("prefix", "chain"))  # fmt: skip
    assert per_branch == 5 * (8 * 4 * 512 + 4 * 8 * 5)
    assert shared == 4 * 512 + 5 * 4 * 8 * 5
    assert per_branch > cfg.topk * shared


def test_padded_batch_rows_stay_consistent(device, gen):
    """Padded requests (row 0, seq_lens = a fill ≥ N) read only the sink (design §4)."""
    cfg, batch, _, _ = _setup(gen, device, 2, 3, 1, "odd", batch_size=5)
    n = cfg.num_draft_tokens
    pad = 3
    rpi = torch.cat([batch.req_pool_indices, torch.zeros(pad, dtype=torch.int64, device=device)])
    sl = torch.cat([batch.seq_lens, torch.full((pad,), n, dtype=torch.int64, device=device)])
    sl_cpu = torch.cat([batch.seq_lens_cpu, torch.full((pad,), n, dtype=torch.int64)])
    fi = FlashInferBuilder(cfg, device)
    tree = random_tree_mask(5 + pad, 2, 3, n, gen).to(device)
    meta = fi.target_verify(rpi, batch.req_to_token, sl, tree, seq_lens_cpu=sl_cpu)
    ptr = meta.kv_indptr.cpu()
    assert meta.kv_indices[int(ptr[5]) : int(ptr[-1])].eq(0).all()
    dec = fi.draft_decode(rpi, batch.req_to_token, sl, seq_lens_cpu=sl_cpu)
    for step in dec.steps:
        ptr = step.kv_indptr.cpu()
        assert step.kv_indices[int(ptr[5 * 2]) : int(ptr[-1])].eq(0).all()
    assert int(fi.status) == 0


def test_bad_inputs_are_reported_or_raise(device, gen):
    cfg, batch, _, _ = _setup(gen, device, 2, 3, 4, "random", batch_size=5)
    fi = FlashInferBuilder(cfg, device)
    n = cfg.num_draft_tokens
    tree = random_tree_mask(5, 2, 3, n, gen).to(device)
    with pytest.raises(ValueError, match="max_bs"):
        big = torch.ones(17, dtype=torch.int64, device=device)
        fi.draft_decode(big, batch.req_to_token, big)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        fi.target_verify(*_args(batch), tree[:, :-1, :-1])
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        fi.draft_extend(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu[:3])
    with pytest.raises(ValueError, match="num_rows"):
        fi.draft_decode(*_args(batch), num_rows=4)
    with pytest.raises(TypeError, match="cfg"):
        FlashInferBuilder({"topk": 2}, device)
    # A row index out of range is masked and reported, never dereferenced.
    batch.req_pool_indices[1] = batch.req_to_token.shape[0] + 7
    fi.target_verify(*_args(batch), tree, seq_lens_cpu=batch.seq_lens_cpu)
    assert int(fi.status) & int(Status.ROW_OOB)


def test_launch_false_refreshes_only_the_host_mirrors(device, gen):
    """The CUDA-graph split: kernels replay inside the graph, plan()'s host mirrors are computed
    outside it from the next batch's CPU lengths, with no launch and no device read."""
    cfg, first, _, _ = _setup(gen, device, 2, 3, 4, "random", batch_size=5)
    second = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=4,
                        row_width=cfg.req_to_token_width, generator=gen, device=device,
                        extra_tokens=cfg.num_draft_tokens, max_len=40)  # fmt: skip
    fi = FlashInferBuilder(cfg, device)
    built = fi.draft_decode_paged(*_args(first), seq_lens_cpu=first.seq_lens_cpu)
    device_before = built.steps[0].kv_indptr.clone()
    fresh = fi.draft_decode_paged(*_args(second), seq_lens_cpu=second.seq_lens_cpu, launch=False)
    assert_equal(fresh.steps[0].kv_indptr, device_before, "device values untouched")
    want = fi.draft_decode_paged(*_args(second), seq_lens_cpu=second.seq_lens_cpu)
    assert_equal(fresh.steps[0].kv_indptr_host, want.steps[0].kv_indptr, "host mirror")
    ext = fi.draft_extend(*_args(second), seq_lens_cpu=second.seq_lens_cpu, launch=False)
    lens = second.seq_lens_cpu + cfg.num_draft_tokens
    assert ext.kv_indptr_host.tolist() == [0] + torch.cumsum(lens, 0).tolist()


def _stage_batches(gen, device, cfg, count, batch_size=5):
    """``count`` draws of one batch size on one table shape: new lengths, rows and pages each."""
    return [make_batch("random", batch_size=batch_size, topk=cfg.topk, num_steps=cfg.num_steps,
                       page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                       device=device, num_rows=batch_size + 4, extra_tokens=cfg.num_draft_tokens,
                       max_len=cfg.max_context_len) for _ in range(count)]  # fmt: skip


_MODES = ("draft_decode", "draft_decode_shared_prefix", "draft_decode_paged", "target_verify",
          "target_verify_packed", "draft_extend")  # fmt: skip


def _bind_or_call(fi, mode, args, tree, rows, **kw):
    """``bind_<mode>`` (no keywords) or the eager ``<mode>`` (``seq_lens_cpu``, ``launch``)."""
    name = mode.removesuffix("_packed")
    method = getattr(fi, name) if kw else getattr(fi, f"bind_{name}")
    if name == "target_verify":
        return method(*args, tree, packed=mode.endswith("packed"), **kw)
    if name.startswith("draft_decode"):
        return method(*args, num_rows=rows, **kw)
    return method(*args, **kw)


def _host_pairs(result):
    """Every host mirror of a result, with the device tensor it mirrors."""
    if hasattr(result, "steps"):
        pairs = []
        for step in result.steps:
            if hasattr(step, "paged_kv_indptr_host_arr"):
                pairs += zip(step.paged_kv_indptr_host_arr, step.paged_kv_indptr_arr, strict=True)
                pairs += zip(step.qo_indptr_host_arr, step.qo_indptr_arr, strict=True)
            else:
                pairs += [(step.kv_indptr_host, step.kv_indptr),
                          (step.kv_last_page_len_host, step.kv_last_page_len)]  # fmt: skip
        return pairs
    pairs = [(result.kv_indptr_host, result.kv_indptr), (result.qo_indptr_host, result.qo_indptr)]
    if result.mask_indptr_host is not None:
        pairs.append((result.mask_indptr_host, result.mask_indptr))
    return pairs


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (1, 3, 1), (3, 2, 16)])
def test_a_bound_stage_follows_new_inputs_launch_after_launch(device, gen, k, s, ps, host_ops,
                                                              request):  # fmt: skip
    """Every mode bound once to the engine's own tensors, then run twice with new device
    values copied into them (lengths, rows, pages, tree) and the new ``seq_lens_cpu``: each
    run gives, integer for integer, what the reference builder gives for that batch, and its
    host mirrors equal the device offsets."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(1 + k + (s - 1) * k * k, 8),
                     page_size=ps, max_bs=8, max_context_len=40)  # fmt: skip
    n = cfg.num_draft_tokens
    draws = _stage_batches(gen, device, cfg, 3)
    trees = [random_tree_mask(5, k, s, n, gen).to(device) for _ in draws]
    rpi, r2t, sl = (t.clone() for t in _args(draws[0]))
    tree = trees[0].clone()
    fi = FlashInferBuilder(cfg, device, host_ops=host_ops)
    ref = FlashInferBuilder(cfg, device, reference=True, host_ops=False)
    stages = {mode: _bind_or_call(fi, mode, (rpi, r2t, sl), tree, s) for mode in _MODES}
    for i, (batch, t) in enumerate(zip(draws[1:], trees[1:], strict=True)):
        for dst, src in zip((rpi, r2t, sl, tree), (*_args(batch), t), strict=True):
            dst.copy_(src)
        for mode, stage in stages.items():
            got = stage(batch.seq_lens_cpu.clone())
            want = _bind_or_call(ref, mode, _args(batch), t, s, seq_lens_cpu=batch.seq_lens_cpu)
            _assert_build_equal(got, want, f"{mode} run {i}")
            for j, (host, dev) in enumerate(_host_pairs(got)):
                assert_equal(host, dev, f"{mode} run {i}: host mirror {j}")
    assert int(fi.status) == 0 and int(ref.status) == 0


def test_a_stage_takes_the_compiled_writers_once_warmup_built_them(device, gen, monkeypatch,
                                                                   compiled_host_ops):  # fmt: skip
    """The builders never build the host ops: a stage bound before ``warmup()`` writes its
    mirrors with the torch writers, and with the compiled ones once they are built; a builder
    whose ``host_ops`` is switched off goes back to torch. Every call's mirrors are right."""
    from specmeta.metadata import host_ops

    made = []
    real = host_ops.prefix_writer

    def spy(*args, use_compiled=True, **kw):
        made.append(use_compiled and host_ops.compiled() is not None)
        return real(*args, use_compiled=use_compiled, **kw)

    monkeypatch.setattr(host_ops, "prefix_writer", spy)
    monkeypatch.setattr(host_ops, "_module", None)  # this process before warmup()
    cfg, batch, _, _ = _setup(gen, device, 2, 3, 4, "random", batch_size=5)
    fi = FlashInferBuilder(cfg, device, modes=("draft_extend",), mirror_depth=4)
    stage = fi.bind_draft_extend(*_args(batch))
    n = cfg.num_draft_tokens

    def check(result, lens):
        want = [0, *torch.cumsum(lens + n, 0).tolist()]
        assert result.kv_indptr_host.tolist() == want

    for module, switch, compiled in ((None, True, False), (compiled_host_ops, True, True),
                                     (compiled_host_ops, False, False)):  # fmt: skip
        monkeypatch.setattr(host_ops, "_module", module)
        fi.host_ops = switch
        lens = torch.randint(0, 41, (5,), generator=gen)
        check(stage.host(lens), lens)
        assert made[-1] is compiled, (module, switch)


def test_a_host_call_without_seq_lens_cpu_is_refused_naming_the_fix(device, gen):
    """FlashInfer's plan() reads the host mirrors, so every host call needs ``seq_lens_cpu``:
    without it the eager call (``launch`` or not) and a bound stage's host part raise, naming
    the call, the argument, the mirrors and the fix, before anything is launched or written
    and before the ring's turn."""
    cfg, batch, _, _ = _setup(gen, device, 2, 3, 4, "random", batch_size=5)
    fi = FlashInferBuilder(cfg, device)
    tree = random_tree_mask(5, 2, 3, cfg.num_draft_tokens, gen).to(device)
    fields = {
        "draft_decode": "kv_indptr_host",
        "draft_decode_shared_prefix": "paged_kv_indptr_host_arr",
        "draft_decode_paged": "kv_indptr_host, kv_last_page_len_host",
        "target_verify": "kv_indptr_host, mask_indptr_host",
        "target_verify_packed": "kv_indptr_host, mask_indptr_host",
        "draft_extend": "kv_indptr_host",
    }
    for buf in fi.buffers.values():
        buf.fill_(-7)  # poison: an unwritten buffer keeps it
    before_all = {key: buf.clone() for key, buf in fi.buffers.items()}
    for mode in _MODES:
        name = mode.removesuffix("_packed")
        want = (f"FlashInferBuilder.{name}: seq_lens_cpu is None, but FlashInfer's plan() reads "
                f"the host mirrors ({fields[mode]}) that are written from it; pass "
                "seq_lens_cpu=, the CPU copy of seq_lens the engine already holds (a copy of "
                "seq_lens made here would sync with the device)")  # fmt: skip
        ring = fi._mirrors[fi.plan_groups.get(name, name)]
        before = ring.builds
        for launch in (True, False):
            with pytest.raises(ValueError) as info:
                _bind_or_call(fi, mode, _args(batch), tree, 3, seq_lens_cpu=None, launch=launch)
            assert str(info.value) == want
        stage = _bind_or_call(fi, mode, _args(batch), tree, 3)
        for call in (stage.host, stage):
            with pytest.raises(ValueError) as info:
                call(None)
            assert str(info.value) == want
        assert ring.builds == before, f"{mode}: a refused call took a turn of the ring"
    for key, buf in fi.buffers.items():
        assert torch.equal(buf, before_all[key]), f"{key} was written by a refused call"
    for ring in fi._mirrors.values():
        assert not any(t.any() for mirrors in ring.sets for t in mirrors.values()), "mirrors"
    assert int(fi.status) == 0


# ---------------------------------------------------------------------------------------------
# GPU tier: production shapes, CUDA-graph replay against eager builds, no host sync, and a real
# FlashInfer kernel when one is importable.
# ---------------------------------------------------------------------------------------------
def _gpu_batch(gen, cfg, shape, batch_size):
    return make_batch(shape, batch_size=batch_size, topk=cfg.topk, num_steps=cfg.num_steps,
                      page_size=cfg.page_size, row_width=cfg.req_to_token_width, generator=gen,
                      device="cuda", extra_tokens=cfg.num_draft_tokens,
                      max_len=cfg.max_context_len, num_rows=batch_size + 8)  # fmt: skip


def _used(ptr_row):
    return int(ptr_row[-1])


def _assert_build_equal(got, want, what):
    """Two builds of the same batch: every index a consumer reads is equal (decode steps,
    cascade levels, prefill lists and masks)."""
    if hasattr(got, "steps"):
        for s, (a, b) in enumerate(zip(got.steps, want.steps, strict=True)):
            if hasattr(a, "qo_indptr_arr"):
                for lvl in range(2):
                    ptr = b.paged_kv_indptr_arr[lvl]
                    assert_equal(a.paged_kv_indptr_arr[lvl], ptr, f"{what}[{s}] level {lvl}")
                    n = _used(ptr)
                    assert_equal(a.paged_kv_indices_arr[lvl][:n], b.paged_kv_indices_arr[lvl][:n],
                                 f"{what}[{s}] level {lvl} kv_indices")  # fmt: skip
            else:
                assert_equal(a.kv_indptr, b.kv_indptr, f"{what}[{s}] kv_indptr")
                n = _used(b.kv_indptr)
                assert_equal(a.kv_indices[:n], b.kv_indices[:n], f"{what}[{s}] kv_indices")
                assert_equal(a.kv_last_page_len, b.kv_last_page_len, f"{what}[{s}] last_page_len")
        return
    assert_equal(got.qo_indptr, want.qo_indptr, f"{what} qo_indptr")
    assert_equal(got.kv_indptr, want.kv_indptr, f"{what} kv_indptr")
    n = _used(want.kv_indptr)
    assert_equal(got.kv_indices[:n], want.kv_indices[:n], f"{what} kv_indices")
    for field in ("custom_mask", "packed_custom_mask"):
        a, b = getattr(got, field), getattr(want, field)
        if b is not None:
            assert_equal(got.mask_indptr, want.mask_indptr, f"{what} mask_indptr")
            _assert_masks_equal(a, b, want.mask_indptr, field.startswith("packed"),
                                f"{what} {field}")  # fmt: skip


def _assert_masks_equal(got, want, mask_indptr, packed, what):
    """The written part of two masks (:func:`written_part`: packed gaps are never written)."""
    assert_equal(written_part(got, mask_indptr, packed), written_part(want, mask_indptr, packed),
                 what)  # fmt: skip


def _all_modes(fi, rpi, r2t, sl, tree, rows, lens=None):
    kw = dict(seq_lens_cpu=lens)
    return {
        "draft_decode": fi.draft_decode(rpi, r2t, sl, num_rows=rows, **kw),
        "shared_prefix": fi.draft_decode_shared_prefix(rpi, r2t, sl, num_rows=rows, **kw),
        "paged": fi.draft_decode_paged(rpi, r2t, sl, num_rows=rows, **kw),
        "verify": fi.target_verify(rpi, r2t, sl, tree, **kw),
        "verify_packed": fi.target_verify(rpi, r2t, sl, tree, packed=True, **kw),
        "extend": fi.draft_extend(rpi, r2t, sl, **kw),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [1, 16])
def test_gpu_production_shape_matches_references(gen, ps):
    """B = 256, K = 8, S = 5, N = 16, contexts to 32k: every mode against the references."""
    from specmeta.kernels.branch_kv_indices import branch_kv_indices_ref
    from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indices_ref
    from specmeta.kernels.shared_prefix_kv_indices import shared_prefix_kv_indices_ref
    from specmeta.kernels.tree_custom_mask import tree_custom_mask_ref
    from specmeta.kernels.verify_kv_indices import verify_kv_indices_ref

    B, K, S, N, ctx = 256, 8, 5, 16, 32768
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=B,
                     max_context_len=ctx)  # fmt: skip
    batch = _gpu_batch(gen, cfg, "long_short", B)
    batch.seq_lens[1::2] = torch.randint(ctx // 2, ctx, (B // 2,), device="cuda")
    batch.seq_lens_cpu = batch.seq_lens.cpu()
    tree = random_tree_mask(B, K, S, N, gen).cuda()
    fi = FlashInferBuilder(cfg, "cuda")
    got = _all_modes(fi, *_args(batch), tree, S, batch.seq_lens_cpu)
    a = _args(batch)
    kw = dict(topk=K, num_steps=S, page_size=ps)
    idx, ptr = draft_decode_kv_indices_ref(*a, **kw)
    for s, step in enumerate(got["draft_decode"].steps):
        assert_equal(step.kv_indptr, ptr[s], "draft_decode kv_indptr")
        assert_equal(step.kv_indices[: _used(ptr[s])], idx[s, : _used(ptr[s])], "kv_indices")
        assert_equal(step.kv_indptr_host, ptr[s], "kv_indptr_host")
    pi, pp, ci, cp = shared_prefix_kv_indices_ref(*a, **kw)
    for s, step in enumerate(got["shared_prefix"].steps):
        assert_equal(step.paged_kv_indptr_arr[0], pp, "prefix kv_indptr")
        assert_equal(step.paged_kv_indices_arr[0][: _used(pp)], pi[: _used(pp)], "prefix")
        assert_equal(step.paged_kv_indptr_arr[1], cp[s], "chain kv_indptr")
        assert_equal(step.paged_kv_indices_arr[1][: _used(cp[s])], ci[s, : _used(cp[s])], "chain")
    bi, bp, bl = branch_kv_indices_ref(*a, **kw)
    for s, step in enumerate(got["paged"].steps):
        assert_equal(step.kv_indptr, bp[s], "paged kv_indptr")
        assert_equal(step.kv_indices[: _used(bp[s])], bi[s, : _used(bp[s])], "paged kv_indices")
        assert_equal(step.kv_last_page_len, bl[s], "paged kv_last_page_len")
    vi, vp = verify_kv_indices_ref(*a, extra_tokens=N)
    for key, packed in (("verify", False), ("verify_packed", True)):
        meta = got[key]
        assert_equal(meta.kv_indptr, vp, "verify kv_indptr")
        assert_equal(meta.kv_indices[: _used(vp)], vi[: _used(vp)], "verify kv_indices")
        mask, mptr = tree_custom_mask_ref(batch.seq_lens, tree, packed=packed,
                                          seq_lens_sum=batch.seq_lens_sum)  # fmt: skip
        got_mask = meta.packed_custom_mask if packed else meta.custom_mask
        assert_equal(meta.mask_indptr, mptr, "mask_indptr")
        _assert_masks_equal(got_mask, mask, mptr, packed, "mask")
    assert int(fi.status) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16), (8, 64)])
def test_gpu_graph_replay_equals_eager_with_changing_inputs(gen, k, ps):
    B, S, ctx = 32, 4, 2048
    n = min(1 + k + (S - 1) * k * k, 16)
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=n, page_size=ps, max_bs=B,
                     max_context_len=ctx)  # fmt: skip
    draws = [_gpu_batch(gen, cfg, shape, B) for shape in ("random", "long_short", "modm1", "max")]
    trees = [random_tree_mask(B, k, S, n, gen).cuda() for _ in draws]
    rpi, r2t, sl = (x.clone() for x in _args(draws[0]))
    tree = trees[0].clone()
    fi, eager = FlashInferBuilder(cfg, "cuda"), FlashInferBuilder(cfg, "cuda")
    stages = {mode: _bind_or_call(fi, mode, (rpi, r2t, sl), tree, S) for mode in _MODES}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for stage in stages.values():
            stage.launch()  # run once outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        for stage in stages.values():
            stage.launch()
    for batch, t in zip(draws[1:] + draws[:1], trees[1:] + trees[:1], strict=True):
        rpi.copy_(batch.req_pool_indices)
        r2t.copy_(batch.req_to_token)
        sl.copy_(batch.seq_lens)
        tree.copy_(t)
        # The host mirrors for plan() come from the CPU lengths, outside the graph.
        captured = {mode: stage.host(batch.seq_lens_cpu) for mode, stage in stages.items()}
        graph.replay()
        want = {mode: _bind_or_call(eager, mode, _args(batch), t, S,
                                    seq_lens_cpu=batch.seq_lens_cpu) for mode in _MODES}  # fmt: skip
        torch.cuda.synchronize()
        for key in want:
            _assert_build_equal(captured[key], want[key], f"{key} [{batch.shape}]")
            for j, (host, dev) in enumerate(_host_pairs(captured[key])):
                assert_equal(host, dev, f"{key}: host mirror {j} after replay")
    assert int(fi.status) == 0 and int(eager.status) == 0


@pytest.mark.gpu
def test_gpu_no_host_sync_on_the_build_path(gen):
    B, K, S, ps = 16, 4, 3, 16
    cfg = SpecConfig(topk=K, num_steps=S, num_draft_tokens=8, page_size=ps, max_bs=B,
                     max_context_len=1024)  # fmt: skip
    batch = _gpu_batch(gen, cfg, "random", B)
    tree = random_tree_mask(B, K, S, 8, gen).cuda()
    fi = FlashInferBuilder(cfg, "cuda")
    _all_modes(fi, *_args(batch), tree, S, batch.seq_lens_cpu)  # compile first
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            _all_modes(fi, *_args(batch), tree, S, batch.seq_lens_cpu)
    torch.cuda.synchronize()
    assert int(fi.status) == 0
