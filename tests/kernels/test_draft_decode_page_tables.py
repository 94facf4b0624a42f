"""draft_decode_page_tables (both FA3 draft-decode passes in one launch) against its reference,
against the two separate ops it fuses, and against design §2.3 read directly."""

from __future__ import annotations

import importlib

import pytest
import torch

from specmeta import SpecConfig, Status, allocate_buffers, new_status
from specmeta.config import ROW_ALIGN, uses_layout_b
from specmeta.kernels._common import vector_widths as _vectors
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs
from specmeta.kernels.draft_decode_page_tables import (
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from specmeta.kernels.expand_page_table import expand_page_table
from specmeta.kernels.prefix_page_table import prefix_page_table
from specmeta.runners import collector_off
from specmeta.workloads import SHAPES, make_batch
from tests._support import check_expand_page_table_spec as _check_expand
from tests._support import check_prefix_page_table_spec as _check_normal
from tests._support import no_host_sync, row_width
from tests.guard_bands import POISON, Guarded, assert_equal

# (K, S, ps, exclude_last_partial): trees of 2 and 4 branches, page sizes 1, 4 and 16, the
# normal pass over whole pages (slot layout B) or over the whole prefix.
CONFIGS = [
    (k, s, ps, exclude)
    for k, s in ((2, 3), (4, 2))
    for ps in (1, 4, 16)
    for exclude in (False, True)
]
NAMES = ("page_table", "cache_seqlens", "cu_seqlens_k", "expand_page_table",
         "expand_cache_seqlens", "expand_cu_seqlens_k")  # fmt: skip


def _draw(shape, gen, device, k, s, ps, batch_size=None, prefix=40):
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, prefix=prefix), generator=gen, device=device)  # fmt: skip
    slots = assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token, batch.seq_lens,
                                    topk=k, num_steps=s, page_size=ps)  # fmt: skip
    return batch, slots


def _args(batch):
    return batch.req_pool_indices, batch.req_to_token, batch.seq_lens


def _buffers(B, k, rows, width, device, *, spare=2, dtype=torch.int32):
    """The six outputs as guarded, poisoned buffers with ``spare`` requests of padding (as planned
    ``Bp``-row buffers have); the expand table ``rows`` wide."""
    BK, sk = B * k, spare * k
    shapes = ((B + spare, width), (B + spare,), (B + 1 + spare,), (rows, BK + sk, rows),
              (rows, BK + sk), (rows, BK + 1 + sk))  # fmt: skip
    return [Guarded(shape, dtype, device) for shape in shapes]


def _run(batch, slots, device, *, k, s, ps, exclude, rows=None, width=None, separate=False,
         dtype=torch.int32):  # fmt: skip
    """The fused kernel into guarded, poisoned buffers; the reference (and, with ``separate``,
    the two ops it fuses) into copies of them; all compared exactly, status included. Returns
    the outputs cut to ``[:B]`` / ``[:rows, :B·K]`` and the status."""
    B, BK = batch.batch_size, batch.batch_size * k
    rows = s if rows is None else rows
    width = -(-batch.req_to_token.shape[1] // ps) if width is None else width
    bufs = _buffers(B, k, rows, width, device, dtype=dtype)
    views = [g.view for g in bufs]
    kw = dict(topk=k, num_steps=s, page_size=ps, exclude_last_partial=exclude, num_rows=rows)
    status = new_status(device)
    draft_decode_page_tables(*_args(batch), slots, **dict(zip(NAMES, views, strict=True)),
                             status=status, **kw)  # fmt: skip
    for g, name in zip(bufs, NAMES, strict=True):
        g.assert_intact(name)
    ref = [v.clone() for v in views]
    ref_status = new_status(device)
    draft_decode_page_tables_ref(*_args(batch), slots, **dict(zip(NAMES, ref, strict=True)),
                                 status=ref_status, **kw)  # fmt: skip
    wants = [(ref, ref_status, "reference")]
    if separate:
        sep = [v.clone() for v in views]
        sep_status = new_status(device)
        prefix_page_table(*_args(batch), page_size=ps, exclude_last_partial=exclude,
                          page_table=sep[0], cache_seqlens=sep[1], cu_seqlens_k=sep[2],
                          status=sep_status)  # fmt: skip
        expand_page_table(slots, batch.seq_lens, topk=k, num_steps=s, page_size=ps,
                          num_rows=rows, page_table=sep[3], cache_seqlens=sep[4],
                          cu_seqlens_k=sep[5], status=sep_status)  # fmt: skip
        wants.append((sep, sep_status, "prefix_page_table + expand_page_table"))
    for want, want_status, what in wants:
        for got, exp, name in zip(views, want, NAMES, strict=True):
            assert_equal(got, exp, f"{name} vs {what} [{batch.describe()}]")
        assert_equal(status, want_status, f"status vs {what}")
    # Nothing at or past request B (branch row B·K) of any output: the padding keeps its poison.
    for v, name, end in zip(views, NAMES, (B, B, B + 1, BK, BK, BK + 1), strict=True):
        pad = v[end:] if name in NAMES[:3] else v[:, end:]
        assert (pad == POISON).all(), f"{name} written past its batch"
    pt, cs, cu, ept, ecs, ecu = views
    return pt[:B], cs[:B], cu[: B + 1], ept[:, :BK], ecs[:, :BK], ecu[:, : BK + 1], status


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps,exclude", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps, exclude):
    batch, slots = _draw(shape, gen, device, k, s, ps)
    *out, status = _run(batch, slots, device, k=k, s=s, ps=ps, exclude=exclude)
    assert int(status) == 0
    pt, cs, cu, ept, ecs, ecu = out
    _check_normal(batch, pt, cs, cu, extra=0, exclude=exclude, rows=None, fill=0)
    _check_expand(batch, slots, ept, ecs, ecu, s)


@pytest.mark.parametrize("k,s", [(2, 3), (4, 2)])
def test_vector_gather_uses_only_the_slots_it_covers(device, gen, k, s):
    """Page size 1 with rows of whole 16-position lines (SpecConfig's default width): the normal
    pass loads whole 16-byte vectors, up to 3 slots past a request's prefix. Those slots (the
    draft region, here overwritten with junk once the draft slots are assigned) are neither
    written nor reported, by the fused kernel as by the standalone op."""
    width = -(-row_width(k, s, 1) // ROW_ALIGN) * ROW_ALIGN
    batch = make_batch("random", batch_size=7, topk=k, num_steps=s, page_size=1,
                       row_width=width, generator=gen, device=device)  # fmt: skip
    slots = assign_draft_cache_locs(*_args(batch), topk=k, num_steps=s, page_size=1)
    for b in range(batch.batch_size):
        L = int(batch.seq_lens_cpu[b])
        for pos, junk in zip(range(L, min(L + 3, width)), (-6, 7777, -6), strict=False):
            batch.req_to_token[int(batch.req_pool_indices[b]), pos] = junk
    table = torch.empty(batch.batch_size, width, dtype=torch.int32, device=device)
    assert _vectors(batch.req_to_token, table, 1) == dict(VEC_IN=4, VEC_OUT=4)
    *out, status = _run(batch, slots, device, k=k, s=s, ps=1, exclude=False, width=width,
                        separate=True)  # fmt: skip
    assert int(status) == 0
    _check_normal(batch, *out[:3], extra=0, exclude=False, rows=None, fill=0)
    _check_expand(batch, slots, *out[3:], s)


@pytest.mark.parametrize("k,s,ps,exclude", [(2, 4, 4, True), (4, 3, 1, False)])
@pytest.mark.parametrize("rows", [0, 1, 2])
def test_fewer_rows_than_steps_equals_the_two_ops(device, gen, k, s, ps, exclude, rows):
    """``num_rows < S`` (the engine builds ``S − 1`` forwards); ``num_rows = 0`` builds the
    normal pass alone. Bit-identical to the two separate launches it replaces."""
    batch, slots = _draw("odd", gen, device, k, s, ps)
    *out, status = _run(batch, slots, device, k=k, s=s, ps=ps, exclude=exclude, rows=rows,
                        separate=True)  # fmt: skip
    assert int(status) == 0
    _check_normal(batch, *out[:3], extra=0, exclude=exclude, rows=None, fill=0)
    if rows:
        _check_expand(batch, slots, *out[3:], rows)


@pytest.mark.parametrize("ps,exclude", [(1, False), (16, True)])
def test_prefix_sums_past_one_block(device, gen, monkeypatch, ps, exclude):
    """cu_seqlens_k of both passes sums seq_lens[:b] in blocks of BLOCK_B (1024): the first
    block with the request's own loads, the rest in a loop. A 4-wide block runs the loop with
    13 requests."""
    # The package re-exports a function of the module's name: fetch the module itself.
    module = importlib.import_module("specmeta.kernels.draft_decode_page_tables")
    monkeypatch.setattr(module, "_BLOCK_B", 4)
    batch, slots = _draw("odd", gen, device, 2, 3, ps, batch_size=13)
    *out, status = _run(batch, slots, device, k=2, s=3, ps=ps, exclude=exclude)
    assert int(status) == 0
    _check_normal(batch, *out[:3], extra=0, exclude=exclude, rows=None, fill=0)
    _check_expand(batch, slots, *out[3:], 3)


def test_spec_example(device):
    r2t = torch.zeros(2, 16, dtype=torch.int32, device=device)
    r2t[1, :8] = torch.tensor([40, 41, 42, 43, 12, 13, 14, 15])
    args = (torch.tensor([1], device=device), r2t, torch.tensor([7], device=device))
    ocl = torch.tensor([15, 20, 63, 36], device=device)
    pt = torch.full((1, 2), -1, dtype=torch.int32, device=device)
    _, cs, ept, ecs = draft_decode_page_tables(*args, ocl, topk=2, num_steps=2, page_size=4,
                                               exclude_last_partial=True, page_table=pt)  # fmt: skip
    assert pt.tolist() == [[10, 0]] and cs.tolist() == [4]
    assert ept.tolist() == [[[3, 0], [15, 0]], [[3, 5], [15, 9]]]
    assert ecs.tolist() == [[4, 4], [5, 5]]


def test_int64_outputs_and_wide_tables(device, gen):
    """int64 buffers, a normal table wider than the row needs (its tail is filled with 0)."""
    batch, slots = _draw("long_short", gen, device, 4, 3, 16, batch_size=5)
    width = -(-batch.req_to_token.shape[1] // 16) + 3
    *out, status = _run(batch, slots, device, k=4, s=3, ps=16, exclude=True, width=width,
                        dtype=torch.int64)  # fmt: skip
    assert int(status) == 0 and not out[0][:, width - 3 :].any()


def test_empty_batch(device, gen):
    batch, slots = _draw("empty", gen, device, 4, 3, 16)
    pt, cs, cu, ept, ecs, ecu, status = _run(batch, slots, device, k=4, s=3, ps=16, exclude=True)
    assert cu.tolist() == [0] and ecu.tolist() == [[0], [0], [0]] and int(status) == 0
    assert pt.numel() == cs.numel() == ept.numel() == ecs.numel() == 0
    out = draft_decode_page_tables(*_args(batch), slots, topk=4, num_steps=3, page_size=16,
                                   exclude_last_partial=True)  # fmt: skip
    assert [tuple(t.shape) for t in out] == [(0, batch.req_to_token.shape[1] // 16), (0,),
                                             (3, 0, 3), (3, 0)]  # fmt: skip


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_adversarial_inputs_report_what_the_reference_reports(device, gen, ps):
    """Both passes' bad inputs in one launch — a row index out of range, negative lengths and
    slot ids, a normal table too narrow, draft slots all over the pool — stay inside every
    buffer and set the status bits of the reference (and of the two separate ops)."""
    K, S = 4, 3
    batch, slots = _draw("random", gen, device, K, S, ps, batch_size=6)
    R = batch.req_to_token.shape[0]
    batch.req_pool_indices[0] = R  # ROW_OOB: the row reads as the sink
    batch.seq_lens[1] = -5  # POS_OOB in both passes: read as L = 0
    batch.seq_lens[2:4] = 2 * ps + 1  # OUT_OF_CAPACITY: 2 whole pages in a table 1 page wide
    batch.req_to_token[int(batch.req_pool_indices[2]), 0] = -4  # POOL_OOB (normal pass)
    slots = torch.randint(-3, 50 * ps, (slots.numel(),), generator=gen).to(device)
    slots[1] = -1  # POOL_OOB (expand pass); random slots break the layout: BAD_PAGE if ps > 1
    *_, status = _run(batch, slots, device, k=K, s=S, ps=ps, exclude=ps > 1, width=1,
                      separate=True)  # fmt: skip
    want = Status.ROW_OOB | Status.POS_OOB | Status.POOL_OOB | Status.OUT_OF_CAPACITY
    assert int(status) == int(want | (Status.BAD_PAGE if ps > 1 else 0))


def test_bad_arguments_raise_before_launch(device, gen):
    """Either pass's bad argument raises before anything is written: the normal pass's buffers,
    valid, still hold their poison when the expand pass's are rejected."""
    batch, slots = _draw("random", gen, device, 2, 3, 4, batch_size=4)
    args = (*_args(batch), slots)
    kw = dict(topk=2, num_steps=3, page_size=4, exclude_last_partial=True)

    def i32(*shape):
        return torch.full(shape, POISON, dtype=torch.int32, device=device)

    pt, cs = i32(4, 8), i32(4)
    with pytest.raises(ValueError, match="expand_page_table is too small: need 3 columns"):
        draft_decode_page_tables(*args, page_table=pt, cache_seqlens=cs,
                                 expand_page_table=i32(3, 8, 2), **kw)  # fmt: skip
    assert (pt == POISON).all() and (cs == POISON).all(), "written before the check failed"
    with pytest.raises(ValueError, match="page_table is too small: need 4 rows"):
        draft_decode_page_tables(*args, page_table=i32(3, 8), **kw)
    with pytest.raises(ValueError, match="cache_seqlens must have rank 1"):
        draft_decode_page_tables(*args, cache_seqlens=i32(1, 4), **kw)
    with pytest.raises(ValueError, match="cu_seqlens_k is too small: need 5"):
        draft_decode_page_tables(*args, cu_seqlens_k=i32(4), **kw)
    with pytest.raises(ValueError, match="expand_cache_seqlens is too small: need 8"):
        draft_decode_page_tables(*args, expand_cache_seqlens=i32(3, 7), **kw)
    with pytest.raises(ValueError, match="expand_cu_seqlens_k is too small: need 9"):
        draft_decode_page_tables(*args, expand_cu_seqlens_k=i32(3, 8), **kw)
    with pytest.raises(ValueError, match="out_cache_loc is too small: need 24"):
        draft_decode_page_tables(*_args(batch), slots[:23], **kw)
    with pytest.raises(ValueError, match="num_rows must be <= num_steps=3"):
        draft_decode_page_tables(*args, num_rows=4, **kw)
    with pytest.raises(TypeError, match="exclude_last_partial"):
        draft_decode_page_tables(*args, **dict(kw, exclude_last_partial=1))
    with pytest.raises(ValueError, match="topk must be >= 1"):
        draft_decode_page_tables(*args, **dict(kw, topk=0))
    with pytest.raises(ValueError, match="status"):
        draft_decode_page_tables(*args, status=i32(2), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("k,ps", [(2, 1), (4, 16), (8, 64)])
def test_gpu_graph_replay_equals_eager_and_never_syncs(gen, k, ps):
    """The fused build into the planned buffers: no host sync on the eager path, and a graph
    captured once, replayed on new inputs (lengths, rows, pages, draft slots), equals the
    reference on those inputs."""
    Bp, S, ctx = 32, 5, 2048
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=S + 1, page_size=ps, max_bs=Bp,
                     max_context_len=ctx)  # fmt: skip
    names = [f"fa3.draft_decode.{name}" for name in NAMES]
    bufs = allocate_buffers(cfg, "cuda", names)
    outs = dict(zip(NAMES, (bufs[n] for n in names), strict=True))
    outs["cache_seqlens"] = outs["cache_seqlens"][0]  # the normal pass has one row
    outs["cu_seqlens_k"] = outs["cu_seqlens_k"][0]
    draws = []
    for shape in ("random", "long_short", "modm1", "max", "mod0"):
        b = make_batch(shape, batch_size=Bp, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device="cuda",
                       num_rows=Bp + 8, max_len=ctx)  # fmt: skip
        draws.append((b, assign_draft_cache_locs(*_args(b), topk=k, num_steps=S, page_size=ps)))
    kw = dict(topk=k, num_steps=S, page_size=ps, exclude_last_partial=uses_layout_b(k, ps))
    static = [t.clone() for t in (*_args(draws[0][0]), draws[0][1])]
    status = new_status("cuda")

    def build():
        draft_decode_page_tables(*static, **outs, status=status, **kw)

    build()  # compiles
    torch.cuda.synchronize()
    with no_host_sync():
        for _ in range(3):
            build()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(graph):
        build()
    for batch, slots in draws[1:] + draws[:1]:
        for dst, src in zip(static, (*_args(batch), slots), strict=True):
            dst.copy_(src)
        for buf in outs.values():
            buf.fill_(-7)  # stale values must not survive a replay
        graph.replay()
        torch.cuda.synchronize()
        ref = {name: torch.full_like(buf, -7) for name, buf in outs.items()}
        draft_decode_page_tables_ref(*_args(batch), slots, **ref, **kw)
        for name, buf in outs.items():
            assert_equal(buf, ref[name], f"{name} [{batch.shape}]")
        assert int(status) == 0
