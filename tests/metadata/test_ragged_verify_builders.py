"""Ragged target verify in the builders (issue 40, design §2.9): FlashInfer's
``target_verify(verify_lens=, verify_lens_cpu=, num_tokens=)``.

The batch is a captured bucket of ``Bp`` requests and ``T`` query tokens; ``B' ≤ Bp`` real
requests verify ``v_b ≤ N`` nodes each. The metadata, read by the reference consumer the way
FlashInfer reads it, must give every query row of the bucket the attention of its logical
sequence: real request ``b``'s row ``j < v_b`` sees its prefix and its tree ancestors, and the
bucket's leftover rows (the pad requests', or the last request's without one) follow the
padding rule of the issue, rows past ``N`` seeing the request's whole window. The expected
rows are written here from the rule, not from the code under test; the host mirrors must equal
the device metadata, and a fault is refused on the host, naming it, or reported by its bit.
"""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig, Status
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.testing.consumers import flashinfer as consumer
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import ragged_tree_sequences
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import padded_lengths, verify_split
from tests.guard_bands import assert_equal

H, H_KV, D = 4, 2, 8
ATOL = 1e-9


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _setup(gen, device, *, k=2, s=3, n=6, ps=1, batch_size=5, ctx=40, shape="random"):
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=ctx)  # fmt: skip
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=ctx)  # fmt: skip
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    return cfg, batch, tree


def _call(fi, batch, tree, real, T, *, packed=False, launch=True, cpu=None):
    dev = torch.tensor(real, dtype=torch.int32, device=batch.seq_lens.device)
    return fi.target_verify(
        batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
        seq_lens_cpu=batch.seq_lens_cpu, packed=packed, launch=launch, verify_lens=dev,
        verify_lens_cpu=torch.tensor(real, dtype=torch.int32) if cpu is None else cpu,
        num_tokens=T,
    )  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
def test_flashinfer_ragged_verify_reads_as_the_rule(device, gen, how, packed):
    cfg, batch, tree = _setup(gen, device)
    n, Bp = cfg.num_draft_tokens, batch.batch_size
    real, T = verify_split(gen, Bp, n, how)
    fi = FlashInferBuilder(cfg, device)
    meta = _call(fi, batch, tree, real, T, packed=packed)
    lens = padded_lengths(real, T, Bp)
    assert meta.verify_lens.tolist() == lens, (real, T)
    assert meta.qo_indptr.tolist() == [sum(lens[:i]) for i in range(Bp + 1)]
    assert meta.max_q_len == T and not meta.causal
    for host, dev, name in ((meta.qo_indptr_host, meta.qo_indptr, "qo_indptr"),
                            (meta.kv_indptr_host, meta.kv_indptr, "kv_indptr"),
                            (meta.mask_indptr_host, meta.mask_indptr, "mask_indptr"),
                            (meta.verify_lens_host, meta.verify_lens, "verify_lens")):  # fmt: skip
        assert_equal(host, dev, f"{name}_host")
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    (o, lse), (o_ref, lse_ref) = (consumer.prefill(q, kc, vc, meta),
                                  dense_attention(q, kc, vc, ragged_tree_sequences(batch, tree, lens)))  # fmt: skip
    assert torch.allclose(o, o_ref, atol=ATOL, rtol=0), f"outputs differ ({real}, T={T})"
    assert torch.allclose(lse, lse_ref, atol=ATOL, rtol=0), f"lse differ ({real}, T={T})"
    assert int(fi.status) == 0


def test_a_bound_ragged_stage_follows_new_lengths_and_mirrors_turn(device, gen):
    cfg, batch, tree = _setup(gen, device)
    n, Bp = cfg.num_draft_tokens, batch.batch_size
    fi = FlashInferBuilder(cfg, device, mirror_depth=2)
    verify = torch.zeros(3, dtype=torch.int32, device=device)
    stage = fi.bind_target_verify(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                  tree, verify_lens=verify, num_tokens=Bp * n - 1)  # fmt: skip
    results = []
    for _ in range(3):
        real = torch.randint(0, n + 1, (3,), generator=gen, dtype=torch.int32)
        verify.copy_(real)
        meta = stage(batch.seq_lens_cpu, verify_lens_cpu=real)
        assert meta.verify_lens.tolist() == padded_lengths(real.tolist(), Bp * n - 1, Bp)
        assert_equal(meta.qo_indptr_host, meta.qo_indptr, "qo_indptr_host")
        assert_equal(meta.mask_indptr_host, meta.mask_indptr, "mask_indptr_host")
        results.append(meta)
    assert results[0] is results[2] and results[0] is not results[1]  # the ring's two sets
    assert int(fi.status) == 0


@pytest.mark.parametrize("writers", ["compiled", "torch"])
def test_a_stale_verify_lens_cpu_sets_its_bit_alone(device, gen, writers, request):
    """Published by the compiled ragged writer (after ``warmup()``) and by the torch checks."""
    if writers == "compiled":
        request.getfixturevalue("compiled_host_ops")
    cfg, batch, tree = _setup(gen, device)
    fi = FlashInferBuilder(cfg, device, host_ops=writers == "compiled")
    _call(fi, batch, tree, [2, 1], 9)
    assert int(fi.status) == 0
    # The device lengths changed, the host copy is the one before: valid values, stale.
    dev = torch.tensor([3, 1], dtype=torch.int32, device=device)
    fi.target_verify(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
                     seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev,
                     verify_lens_cpu=torch.tensor([2, 1]), num_tokens=9)  # fmt: skip
    assert int(fi.status) == int(Status.STALE_HOST_LENGTHS)


@pytest.mark.parametrize("bad", ["over_n", "negative"])
def test_a_device_length_the_host_did_not_see_is_reported(device, gen, bad):
    cfg, batch, tree = _setup(gen, device)
    fi = FlashInferBuilder(cfg, device, check_host_lengths=False)
    n = cfg.num_draft_tokens
    dev = torch.tensor([n + 1 if bad == "over_n" else -1, 1], dtype=torch.int32, device=device)
    fi.target_verify(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
                     seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev,
                     verify_lens_cpu=torch.tensor([1, 1]), num_tokens=2 * n)  # fmt: skip
    assert int(fi.status) == int(Status.POS_OOB)


def _refusal(fi, batch, tree, **kw):
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree)
    with pytest.raises((ValueError, TypeError)) as err:
        fi.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu, **kw)
    return str(err.value)


def test_bad_ragged_inputs_are_refused_naming_the_call_argument_and_value(device, gen):
    cfg, batch, tree = _setup(gen, device)
    fi = FlashInferBuilder(cfg, device)
    n, Bp = cfg.num_draft_tokens, batch.batch_size
    dev = torch.tensor([2, 1], dtype=torch.int32, device=device)
    where = "FlashInferBuilder.target_verify"
    cases = [
        (dict(verify_lens=dev, num_tokens=9), "verify_lens_cpu is None"),
        (dict(verify_lens=dev, verify_lens_cpu=torch.tensor([2, 1])), "num_tokens must be"),
        (dict(verify_lens=dev, verify_lens_cpu=torch.tensor([2, 1]), num_tokens=Bp * n + 1),
         f"num_tokens = {Bp * n + 1}"),
        (dict(verify_lens=dev, verify_lens_cpu=torch.tensor([2, n + 1]), num_tokens=9),
         f"verify_lens_cpu[1] = {n + 1}"),
        (dict(verify_lens=dev, verify_lens_cpu=torch.tensor([2, 1]), num_tokens=2),
         "sums to 3, over num_tokens = 2"),
        (dict(verify_lens=dev, verify_lens_cpu=torch.tensor([2]), num_tokens=9),
         "verify_lens_cpu has 1 entries but verify_lens has 2"),
        (dict(verify_lens=torch.zeros(Bp + 1, dtype=torch.int32, device=device),
              verify_lens_cpu=torch.zeros(Bp + 1, dtype=torch.int32), num_tokens=9),
         f"verify_lens has {Bp + 1} entries"),
        (dict(verify_lens_cpu=torch.tensor([2, 1])), "verify_lens_cpu was given"),
        (dict(num_tokens=9), "num_tokens=9 was given without verify_lens"),
    ]  # fmt: skip
    for kw, words in cases:
        status_before = fi.status.clone()
        message = _refusal(fi, batch, tree, **kw)
        assert message.startswith(where) and words in message, (kw.keys(), message)
        assert_equal(fi.status, status_before, "nothing reported for a refused call")


# ------------------------------------------------------------------------------------ FA3
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
def test_fa3_ragged_verify_cascade_reads_as_the_rule(device, gen, how, k, ps):
    """FA3's ragged verify is a cascade for every K: the normal pass lists each prefix for the
    request's rows at the padded offsets, the expand pass one row a query token; merged by LSE
    they give every row of the bucket its logical sequence. No host copy is needed."""
    from specmeta.metadata.fa3 import FA3MetadataBuilder
    from specmeta.testing.consumers import fa3 as fa3_consumer

    cfg, batch, tree = _setup(gen, device, k=k, ps=ps, n=6 if k > 1 else 4, s=3 if k > 1 else 5)
    n, Bp = cfg.num_draft_tokens, batch.batch_size
    real, T = verify_split(gen, Bp, n, how)
    fa3 = FA3MetadataBuilder(cfg, device, modes=("target_verify",))
    dev = torch.tensor(real, dtype=torch.int32, device=device)
    meta = fa3.target_verify(*_args(batch), tree if k > 1 else None,
                             seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev, num_tokens=T)  # fmt: skip
    lens = padded_lengths(real, T, Bp)
    assert meta.normal.cu_seqlens_q.tolist() == [sum(lens[:i]) for i in range(Bp + 1)]
    assert meta.normal.max_seqlen_q == T and meta.expand.cu_seqlens_q.tolist() == list(range(T + 1))
    assert meta.normal.max_seqlen_k == int(batch.seq_lens_cpu.max())
    chain = torch.ones(n, n, dtype=torch.bool).tril().expand(Bp, n, n)
    want_rows = ragged_tree_sequences(batch, tree if k > 1 else chain, lens)
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    got = fa3_consumer.run_cascade(q, kc, vc, meta)
    want, _ = dense_attention(q, kc, vc, want_rows)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), f"outputs differ ({real}, T={T})"
    assert int(fa3.status) == 0


def test_fa3_ragged_verify_checks_a_host_copy_and_reports_it_stale(device, gen):
    from specmeta.metadata.fa3 import FA3MetadataBuilder

    cfg, batch, tree = _setup(gen, device)
    fa3 = FA3MetadataBuilder(cfg, device, modes=("target_verify",))
    dev = torch.tensor([2, 1], dtype=torch.int32, device=device)
    args = (*_args(batch), tree)
    fa3.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev,
                      verify_lens_cpu=torch.tensor([2, 1]), num_tokens=9)  # fmt: skip
    assert int(fa3.status) == 0
    fa3.target_verify(
        *args,
        seq_lens_cpu=batch.seq_lens_cpu,
        verify_lens=dev,
        verify_lens_cpu=torch.tensor([3, 1]),
        num_tokens=9,
    )  # a stale copy
    assert int(fa3.status) == int(Status.STALE_HOST_LENGTHS)
    with pytest.raises(ValueError, match=r"FA3MetadataBuilder.target_verify: verify_lens_cpu\[0\]"):
        fa3.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev,
                          verify_lens_cpu=torch.tensor([9, 1]), num_tokens=9)  # fmt: skip
    with pytest.raises(ValueError, match=r"FA3MetadataBuilder.target_verify: verify_lens_cpu was"):
        fa3.target_verify(*args, seq_lens_cpu=batch.seq_lens_cpu,
                          verify_lens_cpu=torch.tensor([2, 1]))  # fmt: skip


# ------------------------------------------------------------------------------- TRT-LLM MLA
def _trtllm_call(mla, batch, real, T, **kw):
    dev = torch.tensor(real, dtype=torch.int32, device=batch.seq_lens.device)
    return mla.target_verify(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu, verify_lens=dev,
                             num_tokens=T, **kw)  # fmt: skip


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
def test_trtllm_mla_ragged_verify_keeps_the_dense_kernel_layout(device, gen, how, ps):
    """TRT-LLM MLA's kernel reads a dense [B, N] query over L + N keys: a ragged verify keeps
    that layout, its lengths padded and capped at N (seq_lens_q) with their offsets among the
    bucket's tokens (cu_seqlens_q). Read as an engine runs it (the tokens scattered into the
    dense rows, the output gathered back), every covered token gets its chain's attention and
    a token no request covers reads 0."""
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
    from specmeta.testing.consumers import trtllm_mla as mla_consumer

    cfg, batch, _ = _setup(gen, device, k=1, s=5, n=4, ps=ps)
    n, Bp = cfg.num_draft_tokens, batch.batch_size
    real, T = verify_split(gen, Bp, n, how)
    mla = TrtllmMlaBuilder(cfg, device, modes=("target_verify",))
    uniform = mla.target_verify(*_args(batch), seq_lens_cpu=batch.seq_lens_cpu)
    tables = uniform.block_kv_indices.clone(), uniform.seq_lens_k.clone()
    meta = _trtllm_call(mla, batch, real, T)
    capped = [min(v, n) for v in padded_lengths(real, T, Bp)]
    what = f"verify_lens={real} T={T}"
    assert meta.seq_lens_q.tolist() == capped, what
    assert meta.cu_seqlens_q.tolist() == [sum(capped[:i]) for i in range(Bp + 1)], what
    assert (meta.max_seq_len_q, meta.sum_seq_lens_q) == (n, T), what
    assert_equal(meta.block_kv_indices, tables[0], f"block_kv_indices [{what}]")
    assert_equal(meta.seq_lens_k, tables[1], f"seq_lens_k [{what}]")
    chain = torch.ones(n, n, dtype=torch.bool).tril().expand(Bp, n, n)
    want_rows = ragged_tree_sequences(batch, chain, capped)
    want_rows += [torch.zeros(0, dtype=torch.int64)] * (T - sum(capped))  # uncovered: 0
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    kc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    vc = torch.randn(batch.pool_size, H_KV, D, generator=gen, dtype=torch.float64)
    got, _ = mla_consumer.prefill(q, kc, vc, meta, ps)
    want, _ = dense_attention(q, kc, vc, want_rows)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), f"outputs differ [{what}]"
    assert int(mla.status) == 0


def test_trtllm_mla_ragged_verify_checks_a_host_copy_when_given(device, gen):
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder

    cfg, batch, _ = _setup(gen, device, k=1, s=5, n=4)
    mla = TrtllmMlaBuilder(cfg, device, modes=("target_verify",))
    _trtllm_call(mla, batch, [2, 1], 9, verify_lens_cpu=torch.tensor([2, 1]))
    assert int(mla.status) == 0
    _trtllm_call(mla, batch, [2, 1], 9, verify_lens_cpu=torch.tensor([3, 1]))  # a stale copy
    assert int(mla.status) == int(Status.STALE_HOST_LENGTHS)
    where = "TrtllmMlaBuilder.target_verify"
    with pytest.raises(ValueError, match=rf"{where}: verify_lens_cpu\[0\] = 9"):
        _trtllm_call(mla, batch, [2, 1], 9, verify_lens_cpu=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match=rf"{where}: verify_lens_cpu was given"):
        mla.target_verify(*_args(batch), verify_lens_cpu=torch.tensor([2, 1]))
    with pytest.raises(ValueError, match=rf"{where}: num_tokens=9 was given without"):
        mla.target_verify(*_args(batch), num_tokens=9)
    with pytest.raises(TypeError, match=rf"{where}: num_tokens must be a host int"):
        mla.target_verify(*_args(batch), verify_lens=torch.tensor([2, 1], device=device))


def test_trtllm_mla_ragged_verify_reports_a_length_past_n(device, gen):
    """A device length the host never saw (past N): read as N, reported by its bit alone."""
    from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder

    cfg, batch, _ = _setup(gen, device, k=1, s=5, n=4)
    mla = TrtllmMlaBuilder(cfg, device, modes=("target_verify",), check_host_lengths=False)
    meta = _trtllm_call(mla, batch, [5, 1], 9)
    assert int(mla.status) == int(Status.POS_OOB)
    assert meta.seq_lens_q.tolist()[:2] == [4, 1]
