"""The runner keyed by token bucket (issue 40, design §2.9, §4): one capture per ``(T, Bp)``
serves every split of up to ``T`` tokens over up to ``Bp`` requests.

A ragged FlashInfer target verify runs through :class:`RaggedGraphRunner` on a sequence of
batches of random sizes and splits. Each run must equal, byte for byte, an eager build on the
same inputs padded to the bucket (the pad requests' design §4 values, ``verify_lens`` 0), host
mirrors included, and FlashInfer's reading of it (the reference consumer) must give every
query row of the bucket the attention of its logical sequence. Graphs on the GPU; the same
path without graphs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import specmeta
from specmeta import SpecConfig
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.runners import RaggedGraphRunner, padding
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import ragged_tree_sequences
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import no_host_sync, padded_lengths
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
K, S, N, CTX = 2, 3, 6, 40
BUCKETS = [(5, 2), (12, 4), (20, 4), (30, 6)]


def _cfg():
    return SpecConfig(topk=K, num_steps=S, num_draft_tokens=N, page_size=1, max_bs=6,
                      max_context_len=CTX)  # fmt: skip


def _runner(cfg, device, req_to_token, graphs=None):
    fi = FlashInferBuilder(cfg, device, modes=("target_verify",))
    bufs = specmeta.allocate_buffers(cfg, device, [
        "runner.req_pool_indices", "runner.seq_lens", "runner.tree_mask", "runner.verify_lens"])  # fmt: skip

    def stage(inp, num_tokens):
        return fi.bind_target_verify(inp["req_pool_indices"], req_to_token, inp["seq_lens"],
                                     inp["tree_mask"], verify_lens=inp["verify_lens"],
                                     num_tokens=num_tokens)  # fmt: skip

    runner = RaggedGraphRunner(stage, buckets=BUCKETS, device=device, graphs=graphs)
    runner.add_input("req_pool_indices", bufs["runner.req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", bufs["runner.seq_lens"], pad=padding.seq_lens_fill(N),
                     host_mirror=True)  # fmt: skip
    runner.add_input("tree_mask", bufs["runner.tree_mask"], pad=padding.TREE_MASK)
    runner.add_input("verify_lens", bufs["runner.verify_lens"], pad=padding.NOT_VERIFIED,
                     host_mirror="verify_lens_cpu")  # fmt: skip
    runner.add_guard("req_to_token", req_to_token)
    runner.capture()
    return fi, runner


def _batch(gen, device, cfg, B, req_to_token=None):
    batch = make_batch("random", batch_size=B, topk=K, num_steps=S, page_size=1,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=N, max_len=CTX)  # fmt: skip
    if req_to_token is not None:  # one pool for every batch: the runner guards it
        batch.req_to_token = req_to_token
    return batch


def _pad_to(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def _fields(meta):
    """What a build writes that a consumer reads, used part only (kv_indices and masks to
    their offsets' ends)."""
    kv_end, mask_end = int(meta.kv_indptr_host[-1]), int(meta.mask_indptr_host[-1])
    return {
        "qo_indptr": meta.qo_indptr, "kv_indptr": meta.kv_indptr,
        "kv_indices": meta.kv_indices[:kv_end], "mask_indptr": meta.mask_indptr,
        "custom_mask": meta.custom_mask[:mask_end], "verify_lens": meta.verify_lens,
        "qo_indptr_host": meta.qo_indptr_host, "kv_indptr_host": meta.kv_indptr_host,
        "mask_indptr_host": meta.mask_indptr_host, "verify_lens_host": meta.verify_lens_host,
    }  # fmt: skip


def test_one_capture_per_bucket_serves_every_split(device, gen):
    cfg = _cfg()
    pool = _batch(gen, device, cfg, 6)
    r2t = pool.req_to_token
    fi, runner = _runner(cfg, device, r2t)
    eager = FlashInferBuilder(cfg, device, modes=("target_verify",))
    seen = set()
    for _ in range(6):
        B = int(torch.randint(0, 7, (1,), generator=gen))
        batch = _batch(gen, device, cfg, B, r2t)
        real = torch.randint(0, N + 1, (B,), generator=gen, dtype=torch.int32)
        tree = random_tree_mask(B, K, S, N, gen).to(device)
        t = int(real.sum())
        if t > BUCKETS[-1][0]:
            continue
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens,
                  "tree_mask": tree, "verify_lens": real.to(device)}  # fmt: skip
        res = runner.run(B, inputs, num_tokens=t,
                         host_inputs={"seq_lens": batch.seq_lens_cpu, "verify_lens": real})  # fmt: skip
        T, bp = runner.bucket(B, t)
        seen.add((T, bp))
        assert res.padded_batch_size == bp and res.batch_size == B
        # The eager build of the same bucket: every input padded with its design §4 pad.
        fill = padding.seq_lens_fill(N)
        lens_cpu = _pad_to(batch.seq_lens_cpu, bp, fill)
        want = eager.target_verify(
            _pad_to(batch.req_pool_indices, bp, padding.SINK_ROW), r2t,
            _pad_to(batch.seq_lens, bp, fill), _pad_to(tree, bp, padding.TREE_MASK),
            seq_lens_cpu=lens_cpu, verify_lens=_pad_to(real, bp, 0).to(device),
            verify_lens_cpu=_pad_to(real, bp, 0), num_tokens=T,
        )  # fmt: skip
        for name, got in _fields(res.results).items():
            assert_equal(got, _fields(want)[name], f"{name} (B={B}, real={real.tolist()}, T={T})")
        lens = padded_lengths(_pad_to(real, bp, 0).tolist(), T, bp)
        assert res.results.verify_lens.tolist() == lens
        padded = _batch(gen, device, cfg, 0)
        padded.req_pool_indices = _pad_to(batch.req_pool_indices, bp, padding.SINK_ROW)
        padded.seq_lens_cpu, padded.req_to_token = lens_cpu, r2t
        q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
        kc = torch.randn(pool.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
        vc = torch.randn(pool.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
        rows = ragged_tree_sequences(padded, _pad_to(tree, bp, True), lens)
        (o, lse), (o_ref, lse_ref) = consumer.prefill(q, kc, vc, res.results), dense_attention(
            q, kc, vc, rows)  # fmt: skip
        assert torch.allclose(o, o_ref, atol=1e-9, rtol=0), (B, real.tolist(), T)
        assert torch.allclose(lse, lse_ref, atol=1e-9, rtol=0), (B, real.tolist(), T)
    assert int(fi.status) == 0 and int(eager.status) == 0
    assert seen, "no batch fit a bucket"


def test_bucket_choice_and_refusals(device, gen):
    cfg = _cfg()
    r2t = _batch(gen, device, cfg, 6).req_to_token
    _, runner = _runner(cfg, device, r2t)
    assert runner.buckets == tuple(sorted(BUCKETS))
    assert [runner.bucket(b, t) for b, t in ((1, 5), (3, 5), (1, 6), (4, 20), (5, 1))] == [
        (5, 2), (12, 4), (12, 4), (20, 4), (30, 6)]  # fmt: skip
    with pytest.raises(ValueError, match=r"no captured bucket holds batch_size=7"):
        runner.bucket(7, 1)
    with pytest.raises(ValueError, match=r"num_tokens=31"):
        runner.bucket(1, 31)
    batch = _batch(gen, device, cfg, 2, r2t)
    tree = random_tree_mask(2, K, S, N, gen).to(device)
    real = torch.tensor([2, 1], dtype=torch.int32)
    inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens,
              "tree_mask": tree, "verify_lens": real.to(device)}  # fmt: skip
    with pytest.raises(ValueError, match=r"missing \['verify_lens'\]"):
        runner.run(2, inputs, num_tokens=3, host_inputs={"seq_lens": batch.seq_lens_cpu})
    with pytest.raises(ValueError, match=r"host_inputs\['verify_lens'\] must have shape \(2,\)"):
        runner.run(2, inputs, num_tokens=3, host_inputs={"seq_lens": batch.seq_lens_cpu,
                                                         "verify_lens": real[:1]})  # fmt: skip
    with pytest.raises(ValueError, match=r"verify_lens_cpu\[1\] = 7, outside \[0, N = 6\]"):
        runner.run(2, inputs, num_tokens=3, host_inputs={"seq_lens": batch.seq_lens_cpu,
                                                         "verify_lens": torch.tensor([2, 7])})  # fmt: skip


def test_a_persistent_batch_replays_as_a_run(device, gen):
    """A batch kept in the runner's own buffers: a larger batch first, then a smaller one
    written into :meth:`static_inputs` and replayed; the rows the larger batch left are padded
    again, and the result equals a run of the same inputs."""
    cfg = _cfg()
    r2t = _batch(gen, device, cfg, 6).req_to_token
    _, runner = _runner(cfg, device, r2t)
    _, other = _runner(cfg, device, r2t)
    for B in (4, 2):
        batch = _batch(gen, device, cfg, B, r2t)
        real = torch.randint(0, N + 1, (B,), generator=gen, dtype=torch.int32)
        tree = random_tree_mask(B, K, S, N, gen).to(device)
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens,
                  "tree_mask": tree, "verify_lens": real.to(device)}  # fmt: skip
        for name, view in runner.static_inputs(B).items():
            view.copy_(inputs[name])
        host = {"seq_lens": batch.seq_lens_cpu, "verify_lens": real}
        got = runner.replay(B, num_tokens=int(real.sum()), host_inputs=host)
        want = other.run(B, inputs, num_tokens=int(real.sum()), host_inputs=host).results
        for name, value in _fields(got).items():
            assert_equal(value, _fields(want)[name], f"{name} (B={B}, real={real.tolist()})")


@pytest.mark.gpu
def test_gpu_graph_replays_every_split_without_sync_or_recapture(gen):
    cfg = _cfg()
    r2t = _batch(gen, "cuda", cfg, 6).req_to_token
    fi, runner = _runner(cfg, "cuda", r2t, graphs=True)
    graphs = dict(runner._graphs)
    eager = FlashInferBuilder(cfg, "cuda", modes=("target_verify",))
    for _ in range(8):
        B = int(torch.randint(1, 5, (1,), generator=gen))
        batch = _batch(gen, "cuda", cfg, B, r2t)
        real = torch.randint(0, N + 1, (B,), generator=gen, dtype=torch.int32)
        tree = random_tree_mask(B, K, S, N, gen).cuda()
        t = int(real.sum())
        inputs = {"req_pool_indices": batch.req_pool_indices, "seq_lens": batch.seq_lens,
                  "tree_mask": tree, "verify_lens": real.cuda()}  # fmt: skip
        host = {"seq_lens": batch.seq_lens_cpu, "verify_lens": real}
        with no_host_sync():
            res = runner.run(B, inputs, num_tokens=t, host_inputs=host)
        T, bp = runner.bucket(B, t)
        fill = padding.seq_lens_fill(N)
        want = eager.target_verify(
            _pad_to(batch.req_pool_indices, bp, padding.SINK_ROW), r2t,
            _pad_to(batch.seq_lens, bp, fill), _pad_to(tree, bp, padding.TREE_MASK),
            seq_lens_cpu=_pad_to(batch.seq_lens_cpu, bp, fill),
            verify_lens=_pad_to(real, bp, 0).cuda(), verify_lens_cpu=_pad_to(real, bp, 0),
            num_tokens=T,
        )  # fmt: skip
        for name, got in _fields(res.results).items():
            assert_equal(got, _fields(want)[name], f"{name} (B={B}, real={real.tolist()}, T={T})")
    assert runner._graphs == graphs  # the same graphs, none captured again
    assert int(fi.status) == 0
