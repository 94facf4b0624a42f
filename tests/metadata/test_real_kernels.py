"""The builders' metadata read by the real attention kernels (GPU tier).

FlashAttention's CuTe kernels (``flash-attn-4``) read every FA3 builder mode and, as plain paged
attention, TRT-LLM MLA's block tables; FlashInfer's wrappers read every FlashInfer builder mode,
planned from the builder's host mirrors. Each result is compared with float64 dense attention
over the logical sequences of :mod:`specmeta.testing.sequences`, built from the contract alone.
Then: a CUDA graph that captures the metadata build and the attention together, replayed at
several batch sizes through the :class:`~specmeta.GraphRunner`; the whole build-plan-attend path
under ``torch.cuda.set_sync_debug_mode("error")``; and host mirrors that stay right while the
host runs a build ahead of the device.

The kernels are imported, never skipped: where they are missing these tests fail
(``scripts/gpu_kernels.sh`` installs them on the GPU machine). ``SPECMETA_REAL_KERNEL_LOG``
names a JSON file that receives every case's largest error.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from specmeta import SpecConfig, new_status
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.runners import GraphRunner, padding
from specmeta.stage import Stage
from specmeta.testing.attention import CuteFlashAttention, FlashInferAttention
from specmeta.testing.consumers.dense import dense_attention
from specmeta.testing.sequences import (
    branch_sequences,
    extend_sequences,
    ragged_tree_sequences,
    tree_sequences,
    window_sequences,
)
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import no_host_sync, padded_lengths, verify_split

pytestmark = pytest.mark.gpu

H, H_KV, D = 8, 2, 128  # grouped-query attention, one head dim: few compiled variants
S = 3
DTYPE = torch.bfloat16
TOL = 2e-2  # bf16 attention against a float64 oracle
TOPKS = [1, 2, 4, 8]
PAGE_SIZES = [1, 16, 64]
BATCHES = [0, 1, 5]
_ERRORS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    path = os.environ.get("SPECMETA_REAL_KERNEL_LOG")
    if path and _ERRORS:
        log = pathlib.Path(path)
        old = json.loads(log.read_text()) if log.exists() else {}
        log.write_text(json.dumps({**old, **_ERRORS}, indent=1))


@pytest.fixture(scope="module")
def cute():
    return CuteFlashAttention()


@pytest.fixture(scope="module")
def flashinfer_attn():
    return FlashInferAttention(H, H_KV, D, DTYPE, "cuda")


class _Case:
    """A batch, a bf16 KV pool with the draft slots' prefix-tail copies in place (slot layout
    B), a verify tree, and the float64 copies of the pool for the oracle."""

    def __init__(self, gen, k, ps, batch_size, *, n=None, min_len=0, window=(0, 0)):
        self.n = n if n is not None else (S + 1 if k == 1 else 8)
        self.cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=self.n, page_size=ps,
                              max_bs=8, max_context_len=3 * ps + 150,
                              draft_window_size=window[0], draft_sink_size=window[1])  # fmt: skip
        self.batch = make_batch("random", batch_size=batch_size, topk=k, num_steps=S,
                                page_size=ps, row_width=self.cfg.req_to_token_width,
                                generator=gen, device="cuda", extra_tokens=self.n,
                                max_len=self.cfg.max_context_len)  # fmt: skip
        if min_len:
            self.batch.seq_lens.clamp_(min=min_len)
            self.batch.seq_lens_cpu = self.batch.seq_lens.cpu()
        P = self.batch.pool_size
        self.k_pool = torch.randn(P, H_KV, D, generator=gen).to("cuda", DTYPE)
        self.v_pool = torch.randn(P, H_KV, D, generator=gen).to("cuda", DTYPE)
        kw = dict(topk=k, num_steps=S, page_size=ps)
        self.slots = assign_draft_cache_locs(*self.args, **kw)
        tgt, src = prefix_tail_copy_pairs(*self.args, **kw)
        for pool in (self.k_pool, self.v_pool):
            pool[tgt.long()] = pool[src.long()].clone()
        self.tree = random_tree_mask(batch_size, k, S, self.n, gen).cuda()
        self.k64, self.v64 = self.k_pool.double().cpu(), self.v_pool.double().cpu()
        self.gen = gen

    @property
    def args(self):
        return self.batch.req_pool_indices, self.batch.req_to_token, self.batch.seq_lens

    def query(self, rows):
        return torch.randn(rows, H, D, generator=self.gen).to("cuda", DTYPE)

    def check(self, attention, meta, lists, what):
        q = self.query(len(lists))
        out = attention(attention.prepare(meta), q, self.k_pool, self.v_pool)
        assert out.shape == q.shape, f"{what}: output shape {tuple(out.shape)}"
        want, _ = dense_attention(q.double().cpu(), self.k64, self.v64, lists)
        got = out.double().cpu()
        err = float((got - want).abs().max()) if got.numel() else 0.0
        _ERRORS[what] = err
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def _page_map(gen, pages: int) -> torch.Tensor:
    """A shuffled virtual → physical page map (CPU) that keeps the sink page 0 in place, as a
    pool that never hands its sink out."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(pages - 1, generator=gen)])


def _virtual_case(gen, k: int, ps: int):
    """A case of 5 requests over virtual ids: the case, its page map on the GPU (the prefix
    tails of slot layout B copied at physical slots) and ``phys(ids)``, the physical ids of
    virtual ones on either device."""
    c = _Case(gen, k, ps, 5)
    v2p = _page_map(gen, c.batch.pool_size // ps)
    maps = {"cpu": v2p, "cuda": v2p.cuda()}
    _copy_prefix_tails(c, maps["cuda"])

    def phys(ids):
        return maps[ids.device.type][ids // ps] * ps + ids % ps

    return c, maps["cuda"], phys


def _copy_prefix_tails(c: _Case, v2p: torch.Tensor) -> None:
    """The case's pools with the prefix-tail copies of slot layout B made at physical slots
    (``prefix_tail_copy_pairs(v2p=)``), and the oracle's float64 copies read again."""
    tgt, src = prefix_tail_copy_pairs(*c.args, topk=c.cfg.topk, num_steps=S,
                                      page_size=c.cfg.page_size, v2p=v2p)  # fmt: skip
    for pool in (c.k_pool, c.v_pool):
        pool[tgt.long()] = pool[src.long()].clone()
    c.k64, c.v64 = c.k_pool.double().cpu(), c.v_pool.double().cpu()


@pytest.mark.parametrize("batch_size", BATCHES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
@pytest.mark.parametrize("mode", ["draft_decode", "target_verify", "draft_extend"])
def test_gpu_fa3_metadata_through_flash_attn_cute(gen, cute, mode, k, ps, batch_size):
    c = _Case(gen, k, ps, batch_size)
    fa3 = FA3MetadataBuilder(c.cfg, "cuda")
    status = new_status("cuda")
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu, status=status)
    what = f"fa3 {mode} k={k} ps={ps} B={batch_size}"
    if mode == "draft_decode":
        steps = fa3.draft_decode(*c.args, c.slots, num_rows=S, **kw)
        for s, cascade in enumerate(steps):
            c.check(cute, cascade, branch_sequences(c.batch, c.slots, s), f"{what} step {s}")
    elif mode == "target_verify":
        verify = fa3.target_verify(*c.args, c.tree, **kw)
        c.check(cute, verify, tree_sequences(c.batch, c.tree), what)
    else:
        c.check(cute, fa3.draft_extend(*c.args, **kw), extend_sequences(c.batch, c.n), what)
    assert int(status) == 0


@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_fa3_ragged_verify_through_flash_attn_cute(gen, cute, k, ps, how):
    """A ragged target verify over a bucket of 5 requests (design §2.9): the cascade of every
    K, its query offsets on the device only (no host copy of the lengths)."""
    c = _Case(gen, k, ps, 5)
    real, T = verify_split(gen, 5, c.n, how)
    fa3 = FA3MetadataBuilder(c.cfg, "cuda", modes=("target_verify",))
    meta = fa3.target_verify(*c.args, c.tree if k > 1 else None,
                             seq_lens_cpu=c.batch.seq_lens_cpu, num_tokens=T,
                             verify_lens=torch.tensor(real, dtype=torch.int32, device="cuda"))  # fmt: skip
    tree = c.tree if k > 1 else torch.ones(c.n, c.n, dtype=torch.bool).tril().expand(5, -1, -1)
    want = ragged_tree_sequences(c.batch, tree, padded_lengths(real, T, 5))
    c.check(cute, meta, want, f"fa3 ragged verify k={k} ps={ps} {how} {real} T={T}")
    assert int(fa3.status) == 0


_FI_MODES = ["draft_decode", "draft_decode_paged", "draft_decode_shared_prefix",
             "target_verify", "target_verify_packed", "draft_extend"]  # fmt: skip


@pytest.mark.parametrize("batch_size", BATCHES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
@pytest.mark.parametrize("mode", _FI_MODES)
def test_gpu_flashinfer_metadata_through_flashinfer(gen, flashinfer_attn, mode, k, ps, batch_size):
    # MultiLevelCascadeAttentionWrapper (FlashInfer 0.7.2) gave wrong rows in batches with an
    # empty first level (L = 0, on an H100); a request being drafted has L >= 1.
    c = _Case(gen, k, ps, batch_size, min_len=1 if mode.endswith("shared_prefix") else 0)
    fi = FlashInferBuilder(c.cfg, "cuda")
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu)
    what = f"flashinfer {mode} k={k} ps={ps} B={batch_size}"
    if mode.startswith("draft_decode"):
        build = getattr(fi, mode)
        for s, step in enumerate(build(*c.args, num_rows=S, **kw).steps):
            c.check(flashinfer_attn, step, branch_sequences(c.batch, c.slots, s), f"{what} [{s}]")
    elif mode.startswith("target_verify"):
        verify = fi.target_verify(*c.args, c.tree, packed=mode.endswith("packed"), **kw)
        c.check(flashinfer_attn, verify, tree_sequences(c.batch, c.tree), what)
    else:
        c.check(flashinfer_attn, fi.draft_extend(*c.args, **kw), extend_sequences(c.batch, c.n),
                what)  # fmt: skip
    assert int(fi.status) == 0


@pytest.mark.parametrize("translate", [False, True], ids=["token_ids", "virtual_ids"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_draft_window_through_flashinfer(gen, flashinfer_attn, k, ps, translate):
    """A config's draft window (sink 4 + the 37 most recent prefix tokens), over token ids or
    over virtual ids and a shuffled page map (design §2.10): what FlashInfer's decode reads."""
    c = _Case(gen, k, ps, 5, window=(37, 4))
    pages = c.batch.pool_size // ps
    v2p = torch.randperm(pages, generator=gen).cuda() if translate else None
    fi = FlashInferBuilder(c.cfg, "cuda", modes=("draft_decode",))
    what = f"flashinfer draft window k={k} ps={ps} {'v2p' if translate else 'token ids'}"
    steps = fi.draft_decode(*c.args, num_rows=S, seq_lens_cpu=c.batch.seq_lens_cpu, v2p=v2p)
    for s, step in enumerate(steps.steps):
        want = window_sequences(c.batch, c.slots, s, 37, 4, v2p)
        c.check(flashinfer_attn, step, want, f"{what} [{s}]")
    assert int(fi.status) == 0


@pytest.mark.parametrize("mode", ["target_verify_packed", "draft_extend"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_virtual_ids_through_flashinfer(gen, flashinfer_attn, mode, k, ps):
    """Target verify and draft extend over virtual ids and a shuffled page map, design §2.10:
    FlashInfer reads the physical slots of every logical sequence."""
    c = _Case(gen, k, ps, 5)
    v2p = torch.randperm(c.batch.pool_size // ps, generator=gen)
    fi = FlashInferBuilder(c.cfg, "cuda", modes=(mode.removesuffix("_packed"),))
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu, v2p=v2p.cuda())
    if mode == "draft_extend":
        meta, virtual = fi.draft_extend(*c.args, **kw), extend_sequences(c.batch, c.n)
    else:
        meta = fi.target_verify(*c.args, c.tree, packed=True, **kw)
        virtual = tree_sequences(c.batch, c.tree)
    want = [v2p[ids // ps] * ps + ids % ps for ids in virtual]
    c.check(flashinfer_attn, meta, want, f"flashinfer {mode} v2p k={k} ps={ps}")
    assert int(fi.status) == 0


@pytest.mark.parametrize("translate", [False, True], ids=["token_ids", "virtual_ids"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_shared_prefix_window_through_flashinfer(gen, flashinfer_attn, k, ps,
                                                                translate):  # fmt: skip
    """The shared-prefix cascade of a config's draft window (design §2.10): each request's
    sink and recent tokens listed once at the prefix level, over token ids or virtual ids and a
    shuffled page map; FlashInfer's cascade reads each branch's window and chain (every
    ``L ≥ 1``: the cascade wrapper gives wrong rows for an empty prefix, design §8)."""
    c = _Case(gen, k, ps, 5, min_len=1, window=(37, 4))
    v2p = _page_map(gen, c.batch.pool_size // ps).cuda() if translate else None
    fi = FlashInferBuilder(c.cfg, "cuda", modes=("draft_decode_shared_prefix",))
    steps = fi.draft_decode_shared_prefix(*c.args, num_rows=S, v2p=v2p,
                                          seq_lens_cpu=c.batch.seq_lens_cpu)  # fmt: skip
    what = f"flashinfer shared-prefix window k={k} ps={ps} {'v2p' if translate else 'tokens'}"
    for s, step in enumerate(steps.steps):
        want = window_sequences(c.batch, c.slots, s, 37, 4, v2p)
        c.check(flashinfer_attn, step, want, f"{what} [{s}]")
    assert int(fi.status) == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_paged_draft_over_virtual_ids_through_flashinfer(gen, flashinfer_attn,
                                                                        k, ps):  # fmt: skip
    """FlashInfer's paged draft form over virtual ids and a shuffled page map (design §2.10):
    each page list holds the physical pages of its branch's logical sequence."""
    c = _Case(gen, k, ps, 5)
    v2p = _page_map(gen, c.batch.pool_size // ps)
    _copy_prefix_tails(c, v2p.cuda())
    fi = FlashInferBuilder(c.cfg, "cuda", modes=("draft_decode_paged",))
    steps = fi.draft_decode_paged(*c.args, num_rows=S, v2p=v2p.cuda(),
                                  seq_lens_cpu=c.batch.seq_lens_cpu)  # fmt: skip
    for s, step in enumerate(steps.steps):
        want = [v2p[ids // ps] * ps + ids % ps for ids in branch_sequences(c.batch, c.slots, s)]
        c.check(flashinfer_attn, step, want, f"flashinfer paged draft v2p k={k} ps={ps} [{s}]")
    assert int(fi.status) == 0


@pytest.mark.parametrize("mode", ["draft_decode", "target_verify", "ragged_verify",
                                  "draft_extend"])  # fmt: skip
@pytest.mark.parametrize("k,ps", [(1, 1), (1, 16), (2, 1), (2, 16), (4, 64), (8, 1)])
def test_gpu_fa3_virtual_ids_through_flash_attn_cute(gen, cute, mode, k, ps):
    """FA3's page tables and expand passes over virtual ids and a shuffled page map
    (design §2.10): CuTe reads the physical slots of every logical sequence. A cascade's draft slots
    are physical already (assign_draft_cache_locs(v2p=) gives them): the expand pass reads
    them as they are, and the prefix tails of slot layout B are copied at physical slots."""
    c, v2p, phys = _virtual_case(gen, k, ps)

    fa3 = FA3MetadataBuilder(c.cfg, "cuda")
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu, v2p=v2p)
    what = f"fa3 {mode} v2p k={k} ps={ps}"
    if mode == "draft_decode":
        steps = fa3.draft_decode(*c.args, phys(c.slots), num_rows=S, **kw)
        for s, cascade in enumerate(steps):
            want = [phys(ids) for ids in branch_sequences(c.batch, c.slots, s)]
            c.check(cute, cascade, want, f"{what} step {s}")
    elif mode == "target_verify":
        meta = fa3.target_verify(*c.args, c.tree, **kw)
        c.check(cute, meta, [phys(ids) for ids in tree_sequences(c.batch, c.tree)], what)
    elif mode == "ragged_verify":
        real, T = verify_split(gen, 5, c.n, "no_pad_leftover")
        meta = fa3.target_verify(*c.args, c.tree if k > 1 else None, num_tokens=T,
                                 verify_lens=torch.tensor(real, dtype=torch.int32,
                                                          device="cuda"), **kw)  # fmt: skip
        tree = c.tree if k > 1 else torch.ones(c.n, c.n, dtype=torch.bool).tril().expand(5, -1, -1)
        want = ragged_tree_sequences(c.batch, tree, padded_lengths(real, T, 5))
        c.check(cute, meta, [phys(ids) for ids in want], f"{what} {real} T={T}")
    else:
        meta = fa3.draft_extend(*c.args, **kw)
        c.check(cute, meta, [phys(ids) for ids in extend_sequences(c.batch, c.n)], what)
    assert int(fa3.status) == 0


@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_flashinfer_ragged_verify_through_flashinfer(gen, flashinfer_attn, k, ps, packed,
                                                         how):  # fmt: skip
    """A ragged target verify over a bucket of 5 requests (design §2.9): FlashInfer planned
    from the host mirrors of verify_lens_cpu reads every row of the bucket, filler rows too."""
    c = _Case(gen, k, ps, 5)
    real, T = verify_split(gen, 5, c.n, how)
    fi = FlashInferBuilder(c.cfg, "cuda", modes=("target_verify",))
    meta = fi.target_verify(
        *c.args, c.tree, seq_lens_cpu=c.batch.seq_lens_cpu, packed=packed,
        verify_lens=torch.tensor(real, dtype=torch.int32, device="cuda"),
        verify_lens_cpu=torch.tensor(real, dtype=torch.int32), num_tokens=T,
    )  # fmt: skip
    want = ragged_tree_sequences(c.batch, c.tree, padded_lengths(real, T, 5))
    what = f"flashinfer ragged verify k={k} ps={ps} {how} {real} T={T}"
    c.check(flashinfer_attn, meta, want, what)
    assert int(fi.status) == 0


@pytest.mark.parametrize("batch_size", BATCHES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("k", TOPKS)
def test_gpu_trtllm_mla_block_tables_through_flash_attn_cute(gen, k, ps, batch_size):
    """TRT-LLM MLA's own kernels need Blackwell: its per-branch block tables and lengths are
    read here by the CuTe kernel as plain paged attention (draft decode, and a chain's verify
    and extend)."""
    c = _Case(gen, k, ps, batch_size)
    cute = CuteFlashAttention(page_size=ps)
    mla = TrtllmMlaBuilder(c.cfg, "cuda")
    top = int(c.batch.seq_lens_cpu.max()) if batch_size else 0
    what = f"trtllm_mla k={k} ps={ps} B={batch_size}"
    for s, step in enumerate(mla.draft_decode(*c.args, num_rows=S, max_seq_len=top).steps):
        c.check(cute, step, branch_sequences(c.batch, c.slots, s), f"{what} draft [{s}]")
    c.check(cute, mla.draft_extend(*c.args, max_seq_len=top), extend_sequences(c.batch, c.n),
            f"{what} extend")  # fmt: skip
    if k == 1:
        verify = mla.target_verify(*c.args, max_seq_len=top)
        c.check(cute, verify, extend_sequences(c.batch, c.n), f"{what} verify")
    assert int(mla.status) == 0


@pytest.mark.parametrize("how", ["random", "zeros", "one_takes_all", "full", "no_pad_leftover"])
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_gpu_trtllm_mla_ragged_verify_through_flash_attn_cute(gen, ps, how):
    """A ragged chain verify over a bucket of 5 requests in TRT-LLM MLA's dense query layout
    (lengths capped at N): the bucket's tokens scattered into the dense rows, read by the CuTe
    kernel as plain paged causal attention, gathered back; uncovered tokens read 0."""
    c = _Case(gen, 1, ps, 5)
    real, T = verify_split(gen, 5, c.n, how)
    mla = TrtllmMlaBuilder(c.cfg, "cuda", modes=("target_verify",))
    meta = mla.target_verify(*c.args, seq_lens_cpu=c.batch.seq_lens_cpu, num_tokens=T,
                             verify_lens=torch.tensor(real, dtype=torch.int32, device="cuda"))  # fmt: skip
    capped = [min(v, c.n) for v in padded_lengths(real, T, 5)]
    chain = torch.ones(c.n, c.n, dtype=torch.bool).tril().expand(5, -1, -1)
    want = ragged_tree_sequences(c.batch, chain, capped)
    want += [torch.zeros(0, dtype=torch.int64)] * (T - sum(capped))
    c.check(CuteFlashAttention(page_size=ps), meta, want,
            f"trtllm_mla ragged verify ps={ps} {how} {real} T={T}")  # fmt: skip
    assert int(mla.status) == 0


# CuTe reads TRT-LLM MLA's chain verify (a tree's is a cascade with FlashInfer MLA's ancestor
# pass, test_trtllm_mla_real.py): its verify modes over virtual ids take K = 1.
_MLA_VIRTUAL = [(mode, k, ps)
                for mode in ("draft_decode", "target_verify", "ragged_verify", "draft_extend")
                for k, ps in ((1, 1), (1, 16), (2, 1), (2, 16), (4, 64), (8, 1))
                if k == 1 or mode in ("draft_decode", "draft_extend")]  # fmt: skip


@pytest.mark.parametrize("mode,k,ps", _MLA_VIRTUAL)
def test_gpu_trtllm_mla_virtual_ids_through_flash_attn_cute(gen, mode, k, ps):
    """TRT-LLM MLA's block tables over virtual ids and a shuffled page map (design §2.10),
    read by the CuTe kernel as plain paged attention: every logical sequence's physical slots.
    A branch's region is read through the row, so its draft slots are virtual there and the
    table translates them; the prefix tails of slot layout B are copied at physical slots."""
    c, v2p, phys = _virtual_case(gen, k, ps)

    cute = CuteFlashAttention(page_size=ps)
    mla = TrtllmMlaBuilder(c.cfg, "cuda")
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu, v2p=v2p)
    what = f"trtllm_mla {mode} v2p k={k} ps={ps}"
    if mode == "draft_decode":
        for s, step in enumerate(mla.draft_decode(*c.args, num_rows=S, **kw).steps):
            want = [phys(ids) for ids in branch_sequences(c.batch, c.slots, s)]
            c.check(cute, step, want, f"{what} step {s}")
    elif mode == "target_verify":
        meta = mla.target_verify(*c.args, **kw)
        c.check(cute, meta, [phys(ids) for ids in extend_sequences(c.batch, c.n)], what)
    elif mode == "ragged_verify":
        real, T = verify_split(gen, 5, c.n, "random")
        meta = mla.target_verify(*c.args, num_tokens=T, **kw,
                                 verify_lens=torch.tensor(real, dtype=torch.int32, device="cuda"))  # fmt: skip
        capped = [min(v, c.n) for v in padded_lengths(real, T, 5)]
        chain = torch.ones(c.n, c.n, dtype=torch.bool).tril().expand(5, -1, -1)
        want = [phys(ids) for ids in ragged_tree_sequences(c.batch, chain, capped)]
        want += [torch.zeros(0, dtype=torch.int64)] * (T - sum(capped))
        c.check(cute, meta, want, f"{what} {real} T={T}")
    else:
        meta = mla.draft_extend(*c.args, **kw)
        c.check(cute, meta, [phys(ids) for ids in extend_sequences(c.batch, c.n)], what)
    assert int(mla.status) == 0


# --------------------------------------------------------------------------------------------
# One CUDA graph per bucket captures the metadata build and the attention together.
# --------------------------------------------------------------------------------------------
def _check_graphed_draft(gen, k, ps, backend):
    """Draft decode of every step, build + attention in one graph per bucket, replayed at
    batch sizes that move between buckets, every result against dense attention."""
    buckets, seen = [4, 8], []
    cfg_case = _Case(gen, k, ps, 8)
    cfg = cfg_case.cfg
    r2t, kp, vp = cfg_case.batch.req_to_token, cfg_case.k_pool, cfg_case.v_pool
    bp_max, K = max(buckets), k
    static = {
        "req_pool_indices": torch.zeros(bp_max, dtype=torch.int64, device="cuda"),
        "seq_lens": torch.zeros(bp_max, dtype=torch.int64, device="cuda"),
        "out_cache_loc": torch.zeros(bp_max * K * S, dtype=torch.int64, device="cuda"),
        "q": torch.zeros(bp_max * K, H, D, dtype=DTYPE, device="cuda"),
    }
    status = new_status("cuda")
    if backend == "fa3":
        builder, attn = FA3MetadataBuilder(cfg, "cuda"), CuteFlashAttention()
    else:
        builder = FlashInferBuilder(cfg, "cuda")
        fi, ws = attn_module(), torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        # One graph-mode wrapper per (bucket, step). Its indices buffer *is* the builder's
        # kv_indices row, so the indices the graph writes are the ones its kernel reads.
        wrappers = {
            (bp, s): fi.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bp * K + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=builder.buffers["draft_decode.kv_indices"][s],
                paged_kv_last_page_len_buffer=torch.zeros(bp * K, dtype=torch.int32, device="cuda"),
            )  # fmt: skip
            for bp in buckets
            for s in range(S)
        }

    def plan(bp, lens_cpu):
        rpi, sl = static["req_pool_indices"][:bp], static["seq_lens"][:bp]
        res = builder.draft_decode(rpi, r2t, sl, seq_lens_cpu=lens_cpu, num_rows=S, launch=False)
        for s, step in enumerate(res.steps):
            used = int(step.kv_indptr_host[-1])  # host value: no sync
            wrappers[(bp, s)].plan(step.kv_indptr_host, step.kv_indices[:used],
                                   step.kv_last_page_len_host, H, H_KV, D, 1,
                                   q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip

    outs: dict[int, dict] = {}  # bucket -> the attention outputs its graph writes
    fill = padding.seq_lens_fill(K, cfg.num_draft_tokens)

    def stage(inp):
        """Bound on the views of n requests: the build and the attention of every step (the
        graph of a bucket), and a host part that plans FlashInfer's wrappers of n's bucket on
        the padded lengths and returns that bucket's outputs cut to n."""
        n = inp["seq_lens"].shape[0]
        q = inp["q"]
        if backend == "fa3":
            build = builder.bind_draft_decode(
                inp["req_pool_indices"],
                r2t,
                inp["seq_lens"],
                inp["out_cache_loc"],
                num_rows=S,
                status=status,
            )
            steps = build.host(None)  # the planned bounds: what a graph may hold

            def attend():
                outs[n] = {s: attn(attn.prepare(m), q, kp, vp) for s, m in enumerate(steps)}
        else:
            build = builder.bind_draft_decode(inp["req_pool_indices"], r2t, inp["seq_lens"],
                                              num_rows=S, status=status)  # fmt: skip

            def attend():
                outs[n] = {s: wrappers[(n, s)].run(q, (kp.view(-1, 1, H_KV, D),
                                                       vp.view(-1, 1, H_KV, D)))
                           for s in range(S)}  # fmt: skip

        def host(lens_cpu):
            bp = runner.bucket(n)
            if backend != "fa3":
                pad = torch.full((bp - n,), fill, dtype=lens_cpu.dtype)
                plan(bp, torch.cat([lens_cpu, pad]))
            return {s: out[: n * K] for s, out in outs[bp].items()}

        return Stage([build, attend], host=host)

    runner = GraphRunner(stage, batch_sizes=buckets, device="cuda")
    runner.add_input("req_pool_indices", static["req_pool_indices"], pad=padding.SINK_ROW)
    runner.add_input("seq_lens", static["seq_lens"], pad=fill, host_mirror=True)
    runner.add_input("out_cache_loc", static["out_cache_loc"], pad=padding.SINK_SLOT,
                     per_request=K * S)  # fmt: skip
    runner.add_input("q", static["q"], pad=padding.FLOAT, per_request=K)
    if backend != "fa3":
        for bp in buckets:  # a graph-mode wrapper is planned before its capture
            plan(bp, torch.full((bp,), fill))
    runner.capture()
    rows = r2t.shape[0]
    for B in (8, 5, 3, 1, 0, 6):
        # A new batch on the graphs' own table: fresh lengths, other rows, its prefix-tail
        # copies moved into the pool the graphs read.
        c = _Case(gen, k, ps, B)
        c.batch.req_to_token, c.k_pool, c.v_pool = r2t, kp, vp
        c.batch.req_pool_indices = (torch.randperm(rows - 1, generator=gen)[:B] + 1).cuda()
        kw = dict(topk=K, num_steps=S, page_size=ps)
        slots = assign_draft_cache_locs(*c.args, **kw)
        tgt, src = prefix_tail_copy_pairs(*c.args, **kw)
        for pool in (kp, vp):
            pool[tgt.long()] = pool[src.long()].clone()
        inputs = {"req_pool_indices": c.batch.req_pool_indices, "seq_lens": c.batch.seq_lens}
        q = c.query(B * K)
        res = runner.run(B, {**inputs, "out_cache_loc": slots, "q": q},
                         host_inputs={"seq_lens": c.batch.seq_lens_cpu})  # fmt: skip
        seen.append(res.padded_batch_size)
        for s in range(S):
            out = res.results[s]
            assert out.shape == (B * K, H, D)
            want, _ = dense_attention(q.double().cpu(), kp.double().cpu(), vp.double().cpu(),
                                      branch_sequences(c.batch, slots, s))  # fmt: skip
            torch.testing.assert_close(out.double().cpu(), want, rtol=TOL, atol=TOL,
                                       msg=lambda m, s=s, B=B: f"{backend} B={B} step {s}: {m}")  # fmt: skip
    assert set(seen) == set(buckets), f"replays used buckets {seen}"
    assert int(status) == 0


def attn_module():
    import flashinfer

    return flashinfer


@pytest.mark.parametrize("k,ps", [(1, 16), (4, 16), (8, 1)])
def test_gpu_fa3_build_and_attention_in_one_graph(gen, k, ps):
    _check_graphed_draft(gen, k, ps, "fa3")


@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16)])
def test_gpu_flashinfer_build_and_attention_in_one_graph(gen, k, ps):
    _check_graphed_draft(gen, k, ps, "flashinfer")


# --------------------------------------------------------------------------------------------
# No host sync from the build to the attention; mirrors that survive a host running ahead.
# --------------------------------------------------------------------------------------------
def test_gpu_build_plan_and_attention_make_no_host_sync(gen, cute, flashinfer_attn):
    c = _Case(gen, 4, 16, 5)
    fa3, fi = FA3MetadataBuilder(c.cfg, "cuda"), FlashInferBuilder(c.cfg, "cuda")
    status = new_status("cuda")
    kw = dict(seq_lens_cpu=c.batch.seq_lens_cpu)
    q = c.query(5 * c.n)

    def iteration():
        outs = []
        for cascade in fa3.draft_decode(*c.args, c.slots, num_rows=S, status=status, **kw):
            outs.append(cute(cute.prepare(cascade), q[: 5 * 4], c.k_pool, c.v_pool))
        outs.append(cute(cute.prepare(fa3.target_verify(*c.args, c.tree, status=status, **kw)),
                         q, c.k_pool, c.v_pool))  # fmt: skip
        outs.append(cute(cute.prepare(fa3.draft_extend(*c.args, status=status, **kw)),
                         q, c.k_pool, c.v_pool))  # fmt: skip
        for mode in ("draft_decode", "draft_decode_paged", "draft_decode_shared_prefix"):
            for step in getattr(fi, mode)(*c.args, num_rows=S, **kw).steps:
                h = flashinfer_attn.prepare(step)
                outs.append(flashinfer_attn(h, q[: 5 * 4], c.k_pool, c.v_pool))
        for meta in (
            fi.target_verify(*c.args, c.tree, packed=True, **kw),
            fi.draft_extend(*c.args, **kw),
        ):
            outs.append(flashinfer_attn(flashinfer_attn.prepare(meta), q, c.k_pool, c.v_pool))
        return outs

    iteration()  # compile and plan once outside the check
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(2):
            iteration()
    torch.cuda.synchronize()
    assert int(status) == 0 and int(fi.status) == 0


def _busy(ms: float = 200.0):
    """Hold the current stream for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(ms * 1e6))  # about 1 GHz or more: at least ``ms``


@pytest.mark.parametrize(
    "mode", ["draft_decode", "target_verify_packed", "draft_decode_shared_prefix"]
)
def test_gpu_flashinfer_mirrors_survive_a_host_running_one_build_ahead(gen, flashinfer_attn, mode):
    """Build i, plan(i), build i + 1 (other lengths) while plan(i)'s copies still wait behind
    a busy stream, then run(i): attention of batch i, because build i + 1 wrote the other set
    of mirrors."""
    # FlashInfer's cascade gives wrong rows for an empty first level (see the cascade test
    # above): a drafting request has L >= 1.
    min_len = 1 if mode == "draft_decode_shared_prefix" else 0
    first, second = _Case(gen, 4, 16, 5, min_len=min_len), _Case(gen, 4, 16, 5, min_len=min_len)
    second.batch.req_to_token = first.batch.req_to_token
    fi = FlashInferBuilder(first.cfg, "cuda")

    def build(case):
        kw = dict(seq_lens_cpu=case.batch.seq_lens_cpu)
        if mode == "target_verify_packed":
            return fi.target_verify(*case.args, first.tree, packed=True, **kw)
        return getattr(fi, mode)(*case.args, num_rows=S, **kw).steps[S - 1]

    q = first.query(5 * (first.n if mode.startswith("target") else 4))
    _busy()
    handle = flashinfer_attn.prepare(build(first))
    out = flashinfer_attn(handle, q, first.k_pool, first.v_pool).clone()
    build(second)  # the host runs ahead: i + 1's mirrors are written before plan(i)'s copy ran
    lists = (tree_sequences(first.batch, first.tree) if mode.startswith("target")
             else branch_sequences(first.batch, first.slots, S - 1))  # fmt: skip
    want, _ = dense_attention(q.double().cpu(), first.k64, first.v64, lists)
    torch.testing.assert_close(out.double().cpu(), want, rtol=TOL, atol=TOL)
