"""A config's draft window and a pool's virtual ids through the builders (design §2.10): what
FlashInfer's draft decode, target verify and draft extend attend to, read from the rules; the
capacity plan of a window; and the builders' modes that do not build a window yet refuse a
config with one."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, plan_buffers
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import (
    branch_sequences,
    extend_sequences,
    tree_sequences,
    window_sequences,
)
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
ATOL = 1e-9


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps", [(1, 3, 1), (2, 3, 4), (4, 2, 1)])
@pytest.mark.parametrize("translate", [False, True], ids=["token_ids", "virtual_ids"])
def test_flashinfer_draft_decode_attends_to_the_window(k, s, ps, translate, host_ops, gen,
                                                       device, request):  # fmt: skip
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    window = int(torch.randint(3, 12, (1,), generator=gen))
    sink = int(torch.randint(0, 4, (1,), generator=gen))
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(1 + k, 4), page_size=ps,
                     max_bs=8, max_context_len=40, draft_window_size=window,
                     draft_sink_size=sink)  # fmt: skip
    batch = make_batch("random", batch_size=6, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       max_len=40)  # fmt: skip
    pages = batch.pool_size // ps
    v2p = torch.randperm(pages, generator=gen) if translate else None
    fi = FlashInferBuilder(cfg, device, modes=("draft_decode",), host_ops=host_ops)
    meta = fi.draft_decode(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                           seq_lens_cpu=batch.seq_lens_cpu, num_rows=s,
                           v2p=v2p.to(device) if translate else None)  # fmt: skip
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    for i, step in enumerate(meta.steps):
        want = window_sequences(batch, slots, i, window, sink, v2p)
        assert_equal(step.kv_indptr_host, step.kv_indptr, "kv_indptr_host")
        o, lse = consumer.decode(q, kc, vc, step)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), "outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), "log-sum-exps"
    assert int(fi.status) == 0


@pytest.mark.parametrize("mode", ["target_verify", "target_verify_packed", "draft_extend"])
@pytest.mark.parametrize("k,ps", [(1, 4), (4, 16)])
def test_flashinfer_verify_and_extend_read_physical_ids(mode, k, ps, gen, device):
    """``v2p=`` on target verify and draft extend: every query row attends to the physical
    slots of its logical sequence (the virtual ones through the page map)."""
    n = 1 + k if k > 1 else 4
    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=5, topk=k, num_steps=3, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=40)  # fmt: skip
    v2p = torch.randperm(batch.pool_size // ps, generator=gen)
    fi = FlashInferBuilder(cfg, device)
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(seq_lens_cpu=batch.seq_lens_cpu, v2p=v2p.to(device))
    if mode.startswith("target_verify"):
        tree = random_tree_mask(5, k, 3, n, gen).to(device)
        meta = fi.target_verify(*args, tree, packed=mode.endswith("packed"), **kw)
        virtual = tree_sequences(batch, tree)
    else:
        meta = fi.draft_extend(*args, **kw)
        virtual = extend_sequences(batch, n)
    want = [v2p[ids // ps] * ps + ids % ps for ids in virtual]
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    q = torch.randn(len(want), H, D, generator=gen, dtype=torch.float64)
    o, lse = consumer.prefill(q, kc, vc, meta)
    o_ref, lse_ref = dense_attention(q, kc, vc, want)
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), "outputs"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), "log-sum-exps"
    assert int(fi.status) == 0


def test_the_plan_sizes_the_draft_lists_for_the_window():
    """K·B·min(ctx, window + sink) + B·K·S entries a step row, against K·B·ctx without."""
    kw = dict(topk=4, num_steps=3, num_draft_tokens=8, max_bs=16, max_context_len=4096)
    plain = plan_buffers(SpecConfig(**kw))
    windowed = plan_buffers(SpecConfig(**kw, draft_window_size=500, draft_sink_size=12))
    for key in ("flashinfer.draft_decode.kv_indices", "draft_decode.kv_indices"):
        assert plain[key].shape == (3, 4 * 16 * 4096 + 16 * 4 * 3), key
        assert windowed[key].shape == (3, 4 * 16 * 512 + 16 * 4 * 3), key
    # A window wider than the context bounds nothing.
    wide = plan_buffers(SpecConfig(**kw, draft_window_size=9000))
    assert wide["draft_decode.kv_indices"].shape == plain["draft_decode.kv_indices"].shape


@pytest.mark.parametrize(
    "builder,mode",
    [
        (FA3MetadataBuilder, "draft_decode"),
        (TrtllmMlaBuilder, "draft_decode"),
        (FlashInferBuilder, "draft_decode_paged"),
    ],
)
def test_a_mode_that_builds_no_window_refuses_a_config_with_one(builder, mode, device):
    cfg = SpecConfig(topk=2, num_steps=2, num_draft_tokens=3, page_size=4, max_bs=4,
                     max_context_len=64, draft_window_size=16, draft_sink_size=4)  # fmt: skip
    built = ("draft_decode, draft_decode_shared_prefix" if builder is FlashInferBuilder
             else "none of its modes")  # fmt: skip
    with pytest.raises(ValueError) as info:
        builder(cfg, device, modes=(mode,))
    assert str(info.value) == (
        f"{builder.__name__}: {mode} does not build a draft window yet (draft_window_size=16); "
        f"it is built by {built}; drop {mode!r} from modes, or use a backend whose capabilities "
        "have it "
        "(specmeta.metadata.capabilities.CAPABILITIES)"
    )
    # Without modes= the builder serves what it can: every mode but the draft ones.
    served = builder(cfg, device).modes
    assert mode not in served and "draft_extend" in served


@pytest.mark.parametrize("name,value", [("draft_window_size", -1), ("draft_sink_size", -3)])
def test_a_negative_window_is_refused_by_the_config(name, value):
    with pytest.raises(ValueError, match=f"SpecConfig.{name} must be >= 0 \\(0: no window\\)"):
        SpecConfig(topk=1, num_steps=1, num_draft_tokens=1, **{name: value})


def _fields(meta):
    """What a FlashInfer build writes that plan() and the kernels read: every step's offsets
    and the used part of its lists (and of a verify's mask), host mirrors included."""
    steps = meta.steps if hasattr(meta, "steps") else (meta,)
    out = {}
    for i, step in enumerate(steps):
        if hasattr(step, "paged_kv_indptr_arr"):  # the cascade: both levels
            for lvl, (ptr, host, idx) in enumerate(zip(step.paged_kv_indptr_arr,
                                                       step.paged_kv_indptr_host_arr,
                                                       step.paged_kv_indices_arr, strict=True)):  # fmt: skip
                out |= {f"{i}.{lvl}.kv_indptr": ptr, f"{i}.{lvl}.kv_indptr_host": host,
                        f"{i}.{lvl}.kv_indices": idx[: int(host[-1])]}  # fmt: skip
            continue
        end = int(step.kv_indptr_host[-1])
        out |= {f"{i}.kv_indptr": step.kv_indptr, f"{i}.kv_indptr_host": step.kv_indptr_host,
                f"{i}.kv_indices": step.kv_indices[:end]}  # fmt: skip
        mask = getattr(step, "custom_mask", None)
        if mask is not None:
            out[f"{i}.custom_mask"] = mask[: int(step.mask_indptr_host[-1])]
    return out


@pytest.mark.parametrize("mode", ["draft_decode", "draft_decode_shared_prefix",
                                  "draft_decode_paged", "target_verify", "draft_extend"])  # fmt: skip
@pytest.mark.parametrize("E", [4, 16])
def test_flashinfer_page_rows_build_what_token_rows_build(mode, E, gen, device):
    """``entry_page_size=E`` (design §2.10): rows of page ids build, byte for byte, what the
    rows of token ids they stand for (position ``p`` at ``row[p // E]·E + p mod E``) build;
    the host counts a row's width in pages, and refuses one too narrow, naming it."""
    k, s, n = 2, 3, 4
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=E, max_bs=8,
                     max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=5, topk=k, num_steps=s, page_size=E,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=40)  # fmt: skip
    pages = torch.div(batch.req_to_token[:, ::E], E, rounding_mode="floor")  # [R, W / E]
    tokens = (pages.repeat_interleave(E, 1) * E
              + torch.arange(E, device=device).repeat(pages.shape[1]))  # fmt: skip
    tree = random_tree_mask(5, k, s, n, gen).to(device)
    got = {}
    for rows, e in ((tokens, 1), (pages, E)):
        fi = FlashInferBuilder(cfg, device, modes=(mode,))
        args = (batch.req_pool_indices, rows, batch.seq_lens)
        kw = dict(seq_lens_cpu=batch.seq_lens_cpu, entry_page_size=e)
        if mode == "target_verify":
            got[e] = fi.target_verify(*args, tree, **kw)
        else:
            got[e] = getattr(fi, mode)(*args, **kw)
        assert int(fi.status) == 0
    want = _fields(got[1])
    for name, value in _fields(got[E]).items():
        assert_equal(value, want[name], f"{mode} E={E}: {name}")
    narrow = pages[:, : -(-cfg.row_width_need // E) - 1]
    with pytest.raises(
        ValueError, match=rf"FlashInferBuilder.{mode}: req_to_token is \d+ page ids"
    ):
        fi.target_verify(batch.req_pool_indices, narrow, batch.seq_lens, tree,
                         seq_lens_cpu=batch.seq_lens_cpu, entry_page_size=E) if (
            mode == "target_verify") else getattr(fi, mode)(
            batch.req_pool_indices, narrow, batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
            entry_page_size=E)  # fmt: skip


@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (4, 2, 1)])
def test_flashinfer_shared_prefix_reads_physical_ids(k, s, ps, gen, device):
    """``v2p=`` on the shared-prefix cascade: every branch attends, over both levels merged,
    to the physical slots of its logical sequence."""
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(1 + k, 4), page_size=ps,
                     max_bs=8, max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=5, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       max_len=40)  # fmt: skip
    batch.seq_lens.clamp_(min=1)  # a request being drafted has a prefix
    batch.seq_lens_cpu = batch.seq_lens.cpu()
    v2p = torch.randperm(batch.pool_size // ps, generator=gen)
    fi = FlashInferBuilder(cfg, device, modes=("draft_decode_shared_prefix",))
    meta = fi.draft_decode_shared_prefix(batch.req_pool_indices, batch.req_to_token,
                                         batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
                                         num_rows=s, v2p=v2p.to(device))  # fmt: skip
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    for i, step in enumerate(meta.steps):
        want = [v2p[ids // ps] * ps + ids % ps for ids in branch_sequences(batch, slots, i)]
        o, lse = consumer.cascade(q, kc, vc, step)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"step {i}: outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"step {i}: log-sum-exps"
    assert int(fi.status) == 0


@pytest.mark.parametrize("host_ops", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("k,s,ps", [(1, 3, 1), (2, 3, 4), (4, 2, 1)])
@pytest.mark.parametrize("translate", [False, True], ids=["token_ids", "virtual_ids"])
def test_flashinfer_shared_prefix_attends_to_the_window(k, s, ps, translate, host_ops, gen,
                                                        device, request):  # fmt: skip
    """The config's draft window in the shared-prefix cascade: every branch attends, over both
    levels merged, to its window (sink, then the most recent tokens) and its chain, the prefix
    level's plan() mirror equal to the device's offsets."""
    if host_ops:
        request.getfixturevalue("compiled_host_ops")
    window = int(torch.randint(3, 12, (1,), generator=gen))
    sink = int(torch.randint(0, 4, (1,), generator=gen))
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(1 + k, 4), page_size=ps,
                     max_bs=8, max_context_len=40, draft_window_size=window,
                     draft_sink_size=sink)  # fmt: skip
    batch = make_batch("random", batch_size=6, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       max_len=40)  # fmt: skip
    batch.seq_lens.clamp_(min=1)  # a request being drafted has a prefix
    batch.seq_lens_cpu = batch.seq_lens.cpu()
    v2p = torch.randperm(batch.pool_size // ps, generator=gen) if translate else None
    fi = FlashInferBuilder(cfg, device, modes=("draft_decode_shared_prefix",),
                           host_ops=host_ops)  # fmt: skip
    meta = fi.draft_decode_shared_prefix(batch.req_pool_indices, batch.req_to_token,
                                         batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
                                         num_rows=s,
                                         v2p=v2p.to(device) if translate else None)  # fmt: skip
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    q = torch.randn(batch.batch_size * k, H, D, generator=gen, dtype=torch.float64)
    kept = batch.seq_lens_cpu.clamp_max(window + sink)
    want_ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
    for i, step in enumerate(meta.steps):
        want = window_sequences(batch, slots, i, window, sink, v2p)
        for lvl in (0, 1):
            assert_equal(step.paged_kv_indptr_host_arr[lvl], step.paged_kv_indptr_arr[lvl],
                         f"level {lvl} kv_indptr_host")  # fmt: skip
        assert_equal(step.paged_kv_indptr_host_arr[0], want_ptr, "prefix level: cumsum(Lw)")
        o, lse = consumer.cascade(q, kc, vc, step)
        o_ref, lse_ref = dense_attention(q, kc, vc, want)
        assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"step {i}: outputs"
        assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"step {i}: log-sum-exps"
    assert int(fi.status) == 0


@pytest.mark.parametrize("k,s,ps", [(2, 3, 4), (4, 2, 16), (1, 3, 4)])
def test_flashinfer_paged_draft_lists_physical_pages(k, s, ps, gen, device):
    """``v2p=`` on the paged draft form builds, byte for byte, what the same rows already
    translated (every id ``v2p[id // ps]·ps + id mod ps``) build without it; an identity map
    builds what no map builds."""
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=min(1 + k, 4), page_size=ps,
                     max_bs=8, max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=5, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       max_len=40)  # fmt: skip
    pages = batch.pool_size // ps
    v2p = torch.randperm(pages, generator=gen).to(device)
    r2t = batch.req_to_token
    physical = v2p[torch.div(r2t, ps, rounding_mode="floor")] * ps + r2t % ps
    identity = torch.arange(pages, device=device)
    got = {}
    for name, rows, table in (("mapped", r2t, v2p), ("translated", physical, None),
                              ("plain", r2t, None), ("identity", r2t, identity)):  # fmt: skip
        fi = FlashInferBuilder(cfg, device, modes=("draft_decode_paged",))
        got[name] = _fields(fi.draft_decode_paged(batch.req_pool_indices, rows, batch.seq_lens,
                                                  seq_lens_cpu=batch.seq_lens_cpu, num_rows=s,
                                                  v2p=table))  # fmt: skip
        assert int(fi.status) == 0, name
    for a, b in (("mapped", "translated"), ("identity", "plain")):
        for field, value in got[a].items():
            assert_equal(value, got[b][field], f"{a} vs {b}: {field}")
