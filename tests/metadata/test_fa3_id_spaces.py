"""The id spaces of design §2.10 through FA3's builder: ``entry_page_size=`` and ``v2p=`` on
draft decode (``K == 1`` and the cascade), target verify (``K == 1``, the cascade, the ragged
cascade) and draft extend. Rows of page ids build, byte for byte, what the token rows they
stand for build; virtual rows through a page map build what their physical rows build (an
identity map what no map builds); the host refuses a row too narrow in pages, and a bad map,
before anything is written."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import assert_equal

MODES = ["draft_decode", "target_verify", "ragged_verify", "draft_extend"]


def _fields(result):
    """Every tensor and host scalar of a result (a draft decode's steps, a cascade's passes)."""
    steps = result.steps if hasattr(result, "steps") else (result,)
    out = {}
    for i, step in enumerate(steps):
        passes = {"": step} if not hasattr(step, "normal") else {
            "normal": step.normal, "expand": step.expand}  # fmt: skip
        for name, meta in passes.items():
            if meta is None:
                continue
            for field in ("cache_seqlens", "page_table", "cu_seqlens_q", "cu_seqlens_k_new"):
                out[f"{i}.{name}.{field}"] = getattr(meta, field).clone()
            out[f"{i}.{name}.max_seqlen_k"] = torch.tensor(meta.max_seqlen_k)
    return out


def _setup(gen, device, *, k, ps, n=4, s=3, B=5):
    cfg = SpecConfig(topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=8,
                     max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=B, topk=k, num_steps=s, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=n, max_len=40)  # fmt: skip
    return cfg, batch


def _build(fa3, mode, batch, rows, *, k, s, n, tree, slots, **spaces):
    args = (batch.req_pool_indices, rows, batch.seq_lens)
    kw = dict(seq_lens_cpu=batch.seq_lens_cpu, **spaces)
    if mode == "draft_decode":
        return fa3.draft_decode(*args, slots if k > 1 else None, num_rows=s, **kw)
    if mode == "target_verify":
        return fa3.target_verify(*args, tree, **kw)
    if mode == "ragged_verify":
        lens = torch.tensor([n, 0, 2, 1, n], device=rows.device)[: batch.batch_size]
        return fa3.target_verify(*args, tree, verify_lens=lens, num_tokens=int(lens.sum()) + 2,
                                 **kw)  # fmt: skip
    return fa3.draft_extend(*args, **kw)


def _compare(got, want, what):
    a, b = _fields(got), _fields(want)
    assert a.keys() == b.keys(), what
    for name, value in a.items():
        assert_equal(value, b[name], f"{what}: {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k,ps,E", [(1, 4, 4), (2, 4, 8), (4, 1, 2)])
def test_page_rows_build_what_token_rows_build(mode, k, ps, E, gen, device):
    s, n = 3, 4
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    pages = torch.div(batch.req_to_token[:, ::E], E, rounding_mode="floor")  # [R, W / E]
    tokens = (pages.repeat_interleave(E, 1) * E
              + torch.arange(E, device=device).repeat(pages.shape[1]))  # fmt: skip
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    slots = assign_draft_cache_locs(batch.req_pool_indices, tokens, batch.seq_lens, topk=k,
                                    num_steps=s, page_size=ps)  # fmt: skip
    built = {}
    for rows, e in ((tokens, 1), (pages, E)):
        fa3 = FA3MetadataBuilder(cfg, device)
        built[e] = _fields(_build(fa3, mode, batch, rows, k=k, s=s, n=n, tree=tree, slots=slots,
                                  entry_page_size=e))  # fmt: skip
        assert int(fa3.status) == 0, (e, int(fa3.status))
    for name, value in built[E].items():
        assert_equal(value, built[1][name], f"{mode} E={E}: {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k,ps,E", [(1, 4, 1), (2, 4, 4), (4, 1, 1)])
def test_virtual_rows_build_what_their_physical_rows_build(mode, k, ps, E, gen, device):
    """A random page map: the build over virtual rows (of token ids, or of page ids) equals the
    build over the physical token rows; an identity map builds what no map builds."""
    s, n = 3, 4
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    virtual = batch.req_to_token
    P = batch.pool_size // ps
    v2p = torch.randperm(2 * P, generator=gen)[:P].to(device)
    phys = v2p[virtual // ps] * ps + virtual % ps
    rows = torch.div(virtual[:, ::E], E, rounding_mode="floor") if E > 1 else virtual
    if E > 1:  # the virtual token rows these page rows stand for
        virtual = (rows.repeat_interleave(E, 1) * E
                   + torch.arange(E, device=device).repeat(rows.shape[1]))  # fmt: skip
        phys = v2p[virtual // ps] * ps + virtual % ps
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    slots = assign_draft_cache_locs(batch.req_pool_indices, phys, batch.seq_lens, topk=k,
                                    num_steps=s, page_size=ps)  # fmt: skip
    kw = dict(k=k, s=s, n=n, tree=tree, slots=slots)
    builds = []
    for r, spaces in ((rows, dict(v2p=v2p, entry_page_size=E)), (phys, {}),
                      (rows, dict(v2p=torch.arange(P, device=device), entry_page_size=E)),
                      (rows, dict(entry_page_size=E))):  # fmt: skip
        fa3 = FA3MetadataBuilder(cfg, device)
        builds.append(_build(fa3, mode, batch, r, **kw, **spaces))
        assert int(fa3.status) == 0, (spaces.keys(), int(fa3.status))
        builds[-1] = _fields(builds[-1])
    for name, value in builds[0].items():
        assert_equal(value, builds[1][name], f"{mode}: v2p against physical rows: {name}")
    for name, value in builds[2].items():
        assert_equal(value, builds[3][name], f"{mode}: identity map against none: {name}")


@pytest.mark.parametrize("mode", MODES)
def test_a_row_too_narrow_in_pages_or_a_bad_map_is_refused_before_any_write(mode, gen,
                                                                             device):  # fmt: skip
    k, s, n, ps, E = 2, 3, 4, 4, 4
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    pages = torch.div(batch.req_to_token[:, ::E], E, rounding_mode="floor")
    need = -(-cfg.row_width_need // E)
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    fa3 = FA3MetadataBuilder(cfg, device)
    for buf in fa3.buffers.values():
        buf.fill_(-7) if buf.dtype != torch.bool else None
    kw = dict(k=k, s=s, n=n, tree=tree, slots=slots)
    name = "target_verify" if mode == "ragged_verify" else mode
    cases = [
        (pages[:, : need - 1], dict(entry_page_size=E), ValueError,
         f"FA3MetadataBuilder.{name}: req_to_token is {need - 1} page ids wide"),
        (pages[:, :need], dict(entry_page_size=0), ValueError, "entry_page_size=0"),
        (pages[:, :need], dict(entry_page_size=E, v2p=torch.zeros(4, device=device)), TypeError,
         f"FA3MetadataBuilder.{name}: v2p"),
        (pages[:, :need], dict(entry_page_size=E,
                               v2p=torch.zeros((2, 2), dtype=torch.int64, device=device)),
         ValueError, f"FA3MetadataBuilder.{name}: v2p"),
    ]  # fmt: skip
    for rows, spaces, error, words in cases:
        with pytest.raises(error) as info:
            _build(fa3, mode, batch, rows, **kw, **spaces)
        assert words in str(info.value), str(info.value)
    for key, buf in fa3.buffers.items():
        if buf.dtype != torch.bool and "cu_seqlens_q" not in key:
            assert bool((buf == -7).all()), f"{key} was written"
    # Just wide enough in pages: built, nothing reported.
    _build(fa3, mode, batch, pages[:, :need], **kw, entry_page_size=E)
    assert int(fa3.status) == 0
