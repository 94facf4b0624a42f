"""Ragged target verify (issue 40, design §3.2–§3.3): ``verify_lens`` in the three verify ops.

Request ``b`` verifies the first ``v_b ≤ N`` nodes of its tree. FlashInfer's lists read
``row_b[0 : L_b + v_b]`` (``verify_kv_indices``), its mask is one ``v_b × (L_b + v_b)`` block a
request (``tree_custom_mask``, bool and packed), and the FA3 expand pass keeps the ``B·N`` rows of
the uniform layout with empty lists for the nodes ``j ≥ v_b`` (``verify_expand_page_table``).

Each op is run into guarded, poisoned buffers and compared exactly, whole buffers, with its
reference run into poisoned buffers; then the rule is read directly (python loops over the
inputs, nothing from the code under test) on random and adversarial splits: ``v_b = 0`` for some
and for all, every ``v_b = N`` (which must equal the uniform call byte for byte), one request,
an empty batch, pad requests of a captured bucket, a ``v_b < 0`` (``POS_OOB`` alone, read as 0)
and a ``v_b`` past ``N`` (a bucket's leftover: filler rows in FlashInfer's masks, reported by the
FA3 expand pass). Three small examples are worked by hand.
"""

from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
import torch

from specmeta import Status, new_status
from specmeta.config import tree_custom_mask_need, verify_kv_indices_need
from specmeta.kernels.tree_custom_mask import (
    bind_tree_custom_mask,
    tree_custom_mask,
    tree_custom_mask_ref,
)
from specmeta.kernels.verify_expand_page_table import (
    bind_verify_expand_page_table,
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from specmeta.kernels.verify_kv_indices import (
    bind_verify_kv_indices,
    verify_kv_indices,
    verify_kv_indices_ref,
)
from specmeta.kernels.verify_lens import pad_verify_lens_to_bucket_ref
from specmeta.testing.masks import written_part
from specmeta.workloads import make_batch, random_tree_mask
from tests._support import row_width
from tests.guard_bands import POISON, Guarded, assert_equal

# The package re-exports functions of the modules' names: fetch the modules themselves.
KV_MODULE = importlib.import_module("specmeta.kernels.verify_kv_indices")
MASK_MODULE = importlib.import_module("specmeta.kernels.tree_custom_mask")

OPS = ("kv", "mask", "packed", "expand")
_BYTE_CANARY, _BYTE_POISON = 0xA5, 0x3C  # neither a bool (0/1) nor a byte the tests expect


class _Bytes:
    """A guarded byte buffer (tests.guard_bands.Guarded's values do not fit a byte)."""

    def __init__(self, width: int, device, margin: int = 64):
        self.storage = torch.full((width + 2 * margin,), _BYTE_CANARY, dtype=torch.uint8,
                                  device=device)  # fmt: skip
        self.view = self.storage[margin : margin + width]
        self.view.fill_(_BYTE_POISON)
        self.margin = margin

    def assert_intact(self, name: str) -> None:
        m = self.margin
        for part in (self.storage[:m], self.storage[-m:]):
            assert part.eq(_BYTE_CANARY).all(), f"{name}: canary overwritten"


# ------------------------------------------------------------------------------------ inputs
def _batch(gen, device, *, n, batch_size=None, shape="random", k=2, s=3, ps=1):
    """A batch with room for an ``n``-node window, and its random trees (``[B, N, N]`` bool)."""
    batch = make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                       row_width=row_width(k, s, ps, extra=n), generator=gen, device=device,
                       extra_tokens=n)  # fmt: skip
    tree = random_tree_mask(batch.batch_size, k, s, n, gen).to(device)
    return batch, tree


def _lens(values, device, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype).to(device)


# ------------------------------------------------------------------------------------ runner
def _run(op, batch, tree, verify_lens, device, what, *, idx_dtype=torch.int32):
    """``op`` (kernel) into guarded, poisoned buffers and its reference into poisoned ones:
    whole buffers, canaries and status words compared exactly. Returns the kernel's outputs
    (CPU) by name and its status."""
    B, N = tree.shape[0], tree.shape[1]
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    total = int(batch.seq_lens.clamp_min(0).sum()) if B else 0
    status, ref_status = new_status(device), new_status(device)
    if op == "kv":
        width = verify_kv_indices_need(total, B, N) + 5
        idx, ptr = Guarded((width,), idx_dtype, device), Guarded((B + 1,), torch.int32, device)
        kw = dict(extra_tokens=N, seq_lens_sum=total, verify_lens=verify_lens)
        got = verify_kv_indices(*args, kv_indices=idx.view, kv_indptr=ptr.view, status=status,
                                **kw)  # fmt: skip
        assert got[0] is idx.view and got[1] is ptr.view
        ref = {"kv_indices": idx.view.clone().fill_(POISON),
               "kv_indptr": ptr.view.clone().fill_(POISON)}  # fmt: skip
        verify_kv_indices_ref(*args, **ref, status=ref_status, **kw)
        guarded = {"kv_indices": idx, "kv_indptr": ptr}
    elif op in ("mask", "packed"):
        packed = op == "packed"
        # A padded length past N (filler rows, design §2.9) can need more than the uniform
        # bound: Σ rows·(L + nodes) elements hold every segment, packed ones included.
        rows = verify_lens.cpu().long().clamp_min(0) if verify_lens is not None else None
        filler = 0 if rows is None else int(
            (rows * (batch.seq_lens.cpu().long().clamp_min(0) + rows.clamp_max(N))).sum()
        )  # fmt: skip
        buf = _Bytes(max(tree_custom_mask_need(total, B, N, packed), filler) + 9, device)
        out = buf.view if packed else buf.view.view(torch.bool)
        ptr = Guarded((B + 1,), torch.int64, device)
        kw = dict(packed=packed, seq_lens_sum=total, verify_lens=verify_lens)
        tree_custom_mask(batch.seq_lens, tree, custom_mask=out, mask_indptr=ptr.view,
                         status=status, **kw)  # fmt: skip
        ref_mask = torch.full_like(buf.view, _BYTE_POISON)  # packed: gaps stay poisoned in both
        ref = {"custom_mask": ref_mask, "mask_indptr": ptr.view.clone().fill_(POISON)}
        tree_custom_mask_ref(batch.seq_lens, tree, custom_mask=ref_mask.view(out.dtype),
                             mask_indptr=ref["mask_indptr"], status=ref_status, **kw)  # fmt: skip
        guarded = {"custom_mask": buf, "mask_indptr": ptr}
    else:
        spare = 3  # rows past B·N: must stay poisoned
        pt = Guarded((B * N + spare, N + 2), torch.int32, device)
        cs = Guarded((B * N + spare,), torch.int32, device)
        cu = Guarded((B * N + 1 + spare,), torch.int64, device)
        outs = dict(page_table=pt.view, cache_seqlens=cs.view, cu_seqlens_k=cu.view)
        verify_expand_page_table(*args, tree, verify_lens=verify_lens, status=status, **outs)
        ref = {name: t.clone() for name, t in outs.items()}
        verify_expand_page_table_ref(*args, tree, verify_lens=verify_lens, status=ref_status,
                                     **ref)  # fmt: skip
        guarded = {"page_table": pt, "cache_seqlens": cs, "cu_seqlens_k": cu}
        for name in guarded:
            rows = B * N + (name == "cu_seqlens_k")
            assert (guarded[name].view[rows:] == POISON).all(), f"{name} past its rows [{what}]"
    got = {}
    for name, g in guarded.items():
        g.assert_intact(f"{name} [{what}]")
        assert_equal(g.view, ref[name], f"{name} ({op}) [{what}]")
        got[name] = g.view.cpu()
    assert_equal(status, ref_status, f"status ({op}) [{what}]")
    return got, Status(int(status))


# -------------------------------------------------------------------- the rule, read directly
def _clamped(verify_lens, N):
    return [min(max(int(v), 0), N) for v in verify_lens.cpu().tolist()]


def _check_rule(op, batch, tree, verify_lens, got, what):
    """The rules of design §2.9 and §3.2–§3.3 read directly, request by request: ``v_b``
    clamped to ``[0, N]`` for the lists and the FA3 rows; the masks keep ``max(v_b, 0)`` rows,
    those past ``N`` filler rows (1 in every column)."""
    B, N = tree.shape[0], tree.shape[1]
    V = _clamped(verify_lens, N)
    R = [max(int(v), 0) for v in verify_lens.cpu().tolist()]
    Ls = [max(int(x), 0) for x in batch.seq_lens.cpu().tolist()]
    r2t, rpi = batch.req_to_token.cpu().long(), batch.req_pool_indices.cpu().tolist()
    m = tree.cpu().bool()
    if op == "kv":
        idx, ptr = got["kv_indices"].long(), got["kv_indptr"].long()
        assert int(ptr[0]) == 0, what
        for b in range(B):
            lo, hi = int(ptr[b]), int(ptr[b + 1])
            assert hi - lo == Ls[b] + V[b], f"request {b}: list of {hi - lo} [{what}]"
            want = r2t[rpi[b], : Ls[b] + V[b]]
            assert idx[lo:hi].tolist() == want.tolist(), f"request {b} [{what}]"
        used = sum(L + v for L, v in zip(Ls, V, strict=True))
        assert (idx[used:] == POISON).all(), f"written past Σ(L + v) = {used} [{what}]"
    elif op in ("mask", "packed"):
        out, ptr = got["custom_mask"], got["mask_indptr"].long()
        start = 0
        assert int(ptr[0]) == 0, what
        for b in range(B):
            v, L, r = V[b], Ls[b], R[b]
            block = torch.cat([torch.ones(v, L, dtype=torch.bool), m[b, :v, :v]], 1)
            fillers = torch.ones(r - v, L + v, dtype=torch.bool)  # rows past N: every column
            block = torch.cat([block, fillers], 0).reshape(-1)
            assert int(ptr[b + 1]) - int(ptr[b]) == r * (L + v), f"request {b} [{what}]"
            assert int(ptr[b]) == start, f"request {b} starts at Σ r·(L + v) [{what}]"
            if op == "packed":  # at the element offset, read as a byte offset
                want = torch.from_numpy(np.packbits(block.numpy(), bitorder="little"))
                assert torch.equal(out[start : start + want.numel()], want), f"{b} [{what}]"
            else:
                assert torch.equal(out[start : start + block.numel()], block.to(torch.uint8)), (
                    f"request {b} [{what}]"
                )
            start += block.numel()
    else:
        pt, cs, cu = got["page_table"].long(), got["cache_seqlens"].long(), got["cu_seqlens_k"]
        for b in range(B):
            v, L = V[b], Ls[b]
            window = r2t[rpi[b], L : L + N]
            for j in range(N):
                r = b * N + j
                if j >= v:
                    assert int(cs[r]) == 0 and not pt[r].any(), f"node {j} of {b} [{what}]"
                    continue
                anc = [c for c in range(v) if m[b, j, c]]
                rest = [c for c in range(v) if not m[b, j, c]]
                want = window[anc + rest].tolist() + [0] * (N + 2 - v)
                assert int(cs[r]) == len(anc), f"node {j} of request {b} [{what}]"
                assert pt[r].tolist() == want, f"node {j} of request {b} [{what}]"
        counts = cs[: B * N].long()
        assert int(cu[0]) == 0 and torch.equal(cu[1 : B * N + 1].long(), counts.cumsum(0)), what


def _uniform(op, batch, tree, device, what):
    """The same call without ``verify_lens`` (the uniform layout), for byte comparisons."""
    return _run(op, batch, tree, None, device, what)


# ------------------------------------------------------------------------------------ random
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "k,s,ps,n,batch_size,dtype",
    [(2, 3, 1, 6, 7, torch.int32), (4, 2, 16, 8, 5, torch.int64), (1, 4, 4, 5, 1, torch.int64)],
)
def test_random_splits_match_reference_and_rule(device, seed, gen, op, k, s, ps, n, batch_size,
                                                dtype):  # fmt: skip
    batch, tree = _batch(gen, device, n=n, batch_size=batch_size, k=k, s=s, ps=ps)
    vl = torch.randint(0, n + 1, (batch_size,), generator=gen, dtype=dtype).to(device)
    what = f"seed={seed} verify_lens={vl.tolist()} {batch.describe()}"
    got, status = _run(op, batch, tree, vl, device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, vl, got, what)


# ------------------------------------------------------------------------------- adversarial
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("split", ["some_zero", "all_zero", "all_n", "one_request", "empty"])
def test_adversarial_splits(device, seed, gen, op, split):
    n = 5
    B = {"one_request": 1, "empty": 0}.get(split, 6)
    batch, tree = _batch(gen, device, n=n, batch_size=B, shape="empty" if B == 0 else "random")
    v = torch.randint(0, n + 1, (B,), generator=gen)
    if split == "some_zero":
        v[torch.tensor([0, 2, 5])] = 0  # the first, a middle and the last request
    elif split == "all_zero":
        v.zero_()
    elif split in ("all_n", "one_request"):
        v.fill_(n)
    vl = v.to(torch.int32).to(device)
    what = f"seed={seed} split={split} verify_lens={vl.tolist()}"
    got, status = _run(op, batch, tree, vl, device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, vl, got, what)
    if split in ("all_n", "one_request", "empty"):  # v_b = N: the uniform call, byte for byte
        uniform, _ = _uniform(op, batch, tree, device, what)
        for name, value in uniform.items():
            assert_equal(got[name], value, f"{name}: ragged with v = N vs uniform [{what}]")
    if split == "all_zero" and op != "expand":
        ptr = got["kv_indptr" if op == "kv" else "mask_indptr"]
        want = batch.seq_lens.cpu().cumsum(0) if op == "kv" else torch.zeros(B, dtype=torch.long)
        assert ptr.tolist() == [0, *want.tolist()], f"{ptr.tolist()} [{what}]"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad,dtype", [(-1, torch.int32), (-(2**40), torch.int64)])
def test_negative_length_sets_pos_oob_alone(device, seed, gen, op, bad, dtype):
    """A ``v_b < 0``: ``POS_OOB`` alone, the length read as 0 (the outputs equal those of
    ``v_b = 0``, which report nothing), nothing written outside the buffers (the guard bands)."""
    n = 5
    batch, tree = _batch(gen, device, n=n, batch_size=4)
    v = torch.randint(0, n + 1, (4,), generator=gen, dtype=dtype)
    v[1] = bad
    what = f"seed={seed} verify_lens={v.tolist()}"
    got, status = _run(op, batch, tree, v.to(device), device, what)
    assert status == Status.POS_OOB, f"{status!r} [{what}]"
    clamped, ok = _run(op, batch, tree, v.clamp(0, n).to(device), device, what)
    assert ok == Status.OK
    for name, value in clamped.items():
        assert_equal(got[name], value, f"{name}: negative vs 0 [{what}]")
    _check_rule(op, batch, tree, v, got, what)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("over,dtype", [(6, torch.int32), (13, torch.int64)])
def test_length_past_n(device, seed, gen, op, over, dtype):
    """A ``v_b`` past ``N`` (N = 5), as a bucket's leftover gives a pad or the last request:
    FlashInfer's lists keep the request's ``N`` window slots (those of ``v_b = N``) and its
    mask ``v_b`` rows, the rows past ``N`` filler rows, and nothing is reported; the FA3
    expand pass has no rows past ``N`` (its ``B·N`` layout), so there it is read clamped and
    reported (``POS_OOB``)."""
    n = 5
    batch, tree = _batch(gen, device, n=n, batch_size=4)
    v = torch.randint(0, n + 1, (4,), generator=gen, dtype=dtype)
    v[1] = over
    what = f"seed={seed} verify_lens={v.tolist()}"
    got, status = _run(op, batch, tree, v.to(device), device, what)
    assert status == (Status.POS_OOB if op == "expand" else Status.OK), f"{status!r} [{what}]"
    _check_rule(op, batch, tree, v, got, what)
    if op in ("kv", "expand"):
        clamped, _ = _run(op, batch, tree, v.clamp(0, n).to(device), device, what)
        for name, value in clamped.items():
            assert_equal(got[name], value, f"{name}: past N vs N [{what}]")


@pytest.mark.parametrize("op", ["mask", "packed"])
def test_a_garbage_length_is_caught_by_capacity(device, seed, gen, op):
    """``v_b = 2**31 − 1``: its filler rows pass any buffer; the stores past the buffer are
    dropped and reported (``OUT_OF_CAPACITY`` alone), nothing written outside it."""
    n = 5
    batch, tree = _batch(gen, device, n=n, batch_size=3)
    v = torch.tensor([2, 2**31 - 1, 1], dtype=torch.int64)
    batch.seq_lens[:] = 4
    batch.seq_lens_cpu[:] = 4
    width = 64
    buf = _Bytes(width, device)
    out = buf.view if op == "packed" else buf.view.view(torch.bool)
    status = new_status(device)
    tree_custom_mask(batch.seq_lens, tree, custom_mask=out, packed=op == "packed",
                     verify_lens=v.to(device), status=status)  # fmt: skip
    buf.assert_intact(f"custom_mask seed={seed}")
    assert Status(int(status)) == Status.OUT_OF_CAPACITY, f"{Status(int(status))!r}"


@pytest.mark.parametrize("op", OPS)
def test_bucket_with_pad_requests(device, seed, gen, op):
    """A captured bucket: 4 real requests and 3 pads (design §4 pads: row 0, the all-zero sink
    row; ``seq_lens`` = N; a full tree mask), lengths from ``pad_verify_lens_to_bucket``. The
    pads' slots all read the sink."""
    n, B, Bp = 6, 4, 7
    batch, tree = _batch(gen, device, n=n, batch_size=Bp)
    batch.req_pool_indices[B:] = 0
    batch.seq_lens[B:] = n
    batch.seq_lens_cpu[B:] = n
    tree[B:] = True
    real = torch.randint(0, n + 1, (B,), generator=gen, dtype=torch.int32)
    T = int(real.sum()) + int(torch.randint(0, 3 * n + 1, (1,), generator=gen))  # pads ≤ N
    lens, _ = pad_verify_lens_to_bucket_ref(real.to(device), T, Bp)
    what = f"seed={seed} verify_lens={lens.tolist()} T={T}"
    got, status = _run(op, batch, tree, lens, device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, lens, got, what)
    if op == "kv":
        ptr = got["kv_indptr"]
        assert not got["kv_indices"][int(ptr[B]) : int(ptr[Bp])].any(), what
    elif op == "expand":
        assert not got["page_table"][B * n : Bp * n].any(), what


@pytest.mark.parametrize("op", ["kv", "mask", "packed"])
@pytest.mark.parametrize("pads", [0, 1])
def test_a_bucket_leftover_past_n_is_filler_rows(device, seed, gen, op, pads):
    """A bucket of ``T = Bp·N`` tokens over short real lengths: the leftover gives the pad
    (``pads = 1``) or, without one, the last real request more than ``N`` rows. Every token of
    the bucket is a query row of some request (the masks' rows sum to ``T``), nothing is
    reported, and the rules hold with the filler rows."""
    n, B = 4, 3
    Bp = B + pads
    batch, tree = _batch(gen, device, n=n, batch_size=Bp)
    if pads:
        batch.req_pool_indices[B:] = 0
        batch.seq_lens[B:] = n
        batch.seq_lens_cpu[B:] = n
        tree[B:] = True
    real = torch.randint(0, 3, (B,), generator=gen, dtype=torch.int32)
    T = Bp * n
    lens, _ = pad_verify_lens_to_bucket_ref(real.to(device), T, Bp)
    assert int(lens.max()) > n and int(lens.sum()) == T, f"{lens.tolist()}: no row past N"
    what = f"seed={seed} verify_lens={lens.tolist()} T={T}"
    got, status = _run(op, batch, tree, lens, device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, lens, got, what)


@pytest.mark.parametrize("op", ["kv", "mask", "packed"])
def test_offsets_sum_over_several_blocks(device, seed, gen, monkeypatch, op):
    """Blocks of 4 requests in the segment-start sums (13 requests: the sums cross 3 block
    boundaries), with zeros among the lengths."""
    module = KV_MODULE if op == "kv" else MASK_MODULE
    monkeypatch.setattr(module, "_BLOCK_B", 4)
    n = 4
    batch, tree = _batch(gen, device, n=n, batch_size=13)
    vl = torch.randint(0, n + 1, (13,), generator=gen)
    vl[torch.tensor([3, 4, 8])] = 0
    what = f"seed={seed} verify_lens={vl.tolist()}"
    got, status = _run(op, batch, tree, vl.to(device), device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, vl, got, what)


@pytest.mark.parametrize("op", ["mask", "packed", "expand"])
def test_any_mask_bits(device, seed, gen, op):
    """Any bit pattern (not a tree: a node "sees" later nodes): only the columns ``c < v_b`` of
    the rows ``j < v_b`` are read; the bits past them change nothing."""
    n = 6
    batch, _ = _batch(gen, device, n=n, batch_size=5)
    tree = torch.randint(0, 2, (5, n, n), generator=gen).bool().to(device)
    vl = _lens([0, 3, n, 1, 4], device)
    what = f"seed={seed}"
    got, status = _run(op, batch, tree, vl, device, what)
    assert status == Status.OK, f"{status!r} [{what}]"
    _check_rule(op, batch, tree, vl, got, what)
    outside = tree.clone()
    for b, v in enumerate(vl.tolist()):
        outside[b, v:, :] = True  # rows and columns past v_b: read by nothing
        outside[b, :, v:] = True
    again, _ = _run(op, batch, outside, vl, device, what)
    for name, value in got.items():
        assert_equal(again[name], value, f"{name}: bits past v_b changed the output [{what}]")


@pytest.mark.parametrize("op", ["kv", "expand"])
@pytest.mark.parametrize("v", [2, 3])
def test_window_reads_stop_at_v(device, op, v):
    """A window that runs past the row (``L + N > W_row``) is read only to ``L + v``: request 1
    (``L = 14`` in a row of 16, ``N = 4``) fits with ``v = 2`` and reports nothing; with
    ``v = 3`` its third slot is past the row (``POS_OOB``, read as the sink)."""
    batch = types.SimpleNamespace(
        req_pool_indices=_lens([1, 2], device), req_to_token=_rows(device),
        seq_lens=_lens([3, 14], device),
    )  # fmt: skip
    tree = torch.ones(2, 4, 4, dtype=torch.bool, device=device).tril()  # chains
    vl = _lens([4, v], device)
    got, status = _run(op, batch, tree, vl, device, f"v={v}")
    assert status == (Status.OK if v == 2 else Status.POS_OOB), f"{status!r} v={v}"
    window = [214, 215, 0][:v]
    if op == "kv":
        assert got["kv_indices"][7 : 7 + 14 + v].tolist() == list(range(200, 214)) + window
    else:
        assert got["page_table"][4 + v - 1, :v].tolist() == window  # the last node: its chain


# -------------------------------------------------------------------------- worked by hand
def _rows(device):
    """``req_to_token``: row 0 the sink, row 1 = 100…115, row 2 = 200…215, row 3 = 300…315."""
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    for r in (1, 2, 3):
        r2t[r] = torch.arange(100 * r, 100 * r + 16)
    return r2t.to(device)


@pytest.mark.parametrize("fn", [verify_kv_indices, verify_kv_indices_ref])
def test_hand_worked_kv_lists(device, fn):
    """seq_lens [3, 1, 2], N = 3, verify_lens [1, 0, 3]: lists of 3 + 1, 1 + 0, 2 + 3 entries."""
    status = new_status(device)
    idx, ptr = fn(_lens([1, 2, 3], device), _rows(device), _lens([3, 1, 2], device),
                  extra_tokens=3, verify_lens=_lens([1, 0, 3], device), status=status)  # fmt: skip
    assert ptr.tolist() == [0, 4, 5, 10]
    assert idx[:10].tolist() == [100, 101, 102, 103, 200, 300, 301, 302, 303, 304]
    assert int(status) == 0


@pytest.mark.parametrize("fn", [tree_custom_mask, tree_custom_mask_ref])
def test_hand_worked_mask(device, fn):
    """seq_lens [1, 3, 2], N = 3, verify_lens [1, 0, 3]; request 2's tree: nodes 1 and 2 both
    children of the root. Request 0: one row [1 | 1]; request 1: nothing; request 2: rows
    [1 1 | 1 0 0], [1 1 | 1 1 0], [1 1 | 1 0 1]. Packed, request 2 starts at byte 2 (its
    element offset): elements 11100111 → 231, then 1011101 → 93."""
    tree = torch.zeros(3, 3, 3, dtype=torch.bool)
    tree[:, 0, 0] = True
    tree[2] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    args = (_lens([1, 3, 2], device), tree.to(device))
    kw = dict(seq_lens_sum=6, verify_lens=_lens([1, 0, 3], device))
    status = new_status(device)
    mask, ptr = fn(*args, status=status, **kw)
    assert ptr.tolist() == [0, 2, 2, 17]
    assert mask[:17].int().tolist() == [1, 1] + [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1]
    packed = torch.full((60,), 7, dtype=torch.uint8, device=device)
    _, ptr = fn(*args, packed=True, custom_mask=packed, status=status, **kw)
    assert ptr.tolist() == [0, 2, 2, 17]
    assert packed[:5].tolist() == [3, 7, 231, 93, 7], "byte 1 and bytes past 3 are not written"
    assert int(status) == 0


@pytest.mark.parametrize("fn", [verify_expand_page_table, verify_expand_page_table_ref])
def test_hand_worked_expand(device, fn):
    """N = 3, both trees: nodes 1 and 2 children of the root. Request 0 (row 1, L = 5, slots
    105 106 107) verifies 2 nodes: node 2 has no keys. Request 1 (row 2) verifies none.
    Request 2 (row 3, L = 0, slots 300 301 302) verifies all 3."""
    star = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    cu = torch.full((10,), -1, dtype=torch.int32, device=device)
    status = new_status(device)
    pt, cs = fn(_lens([1, 2, 3], device), _rows(device), _lens([5, 4, 0], device),
                star.expand(3, 3, 3).to(device), verify_lens=_lens([2, 0, 3], device),
                cu_seqlens_k=cu, status=status)  # fmt: skip
    assert pt.tolist() == [
        [105, 106, 0], [105, 106, 0], [0, 0, 0],
        [0, 0, 0], [0, 0, 0], [0, 0, 0],
        [300, 301, 302], [300, 301, 302], [300, 302, 301],
    ]  # fmt: skip
    assert cs.tolist() == [1, 2, 0, 0, 0, 0, 1, 2, 2]
    assert cu.tolist() == [0, 1, 3, 3, 3, 3, 3, 4, 6, 8]
    assert int(status) == 0


# ------------------------------------------------------------------ binding and host checks
def _bind(op, batch, tree, vl):
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    total = batch.seq_lens_sum
    if op == "kv":
        return bind_verify_kv_indices(*args, extra_tokens=tree.shape[1], seq_lens_sum=total,
                                      verify_lens=vl)  # fmt: skip
    if op in ("mask", "packed"):
        return bind_tree_custom_mask(batch.seq_lens, tree, packed=op == "packed",
                                     seq_lens_sum=total, verify_lens=vl)  # fmt: skip
    return bind_verify_expand_page_table(*args, tree, verify_lens=vl)


@pytest.mark.parametrize("op", OPS)
def test_a_bound_stage_reads_verify_lens_on_every_call(device, seed, gen, op):
    """The lengths are device values each launch reads, not values baked in when bound."""
    n = 4
    batch, tree = _batch(gen, device, n=n, batch_size=3)
    vl = _lens([n, 1, 0], device)
    stage = _bind(op, batch, tree, vl)
    first = [t.clone() for t in stage()]
    vl.copy_(_lens([0, 2, n], device))
    second = stage()
    ref = {"kv": verify_kv_indices_ref, "expand": verify_expand_page_table_ref}.get(op)
    if ref is None:
        want = tree_custom_mask_ref(batch.seq_lens, tree, packed=op == "packed",
                                    seq_lens_sum=batch.seq_lens_sum, verify_lens=vl)  # fmt: skip
    elif op == "kv":
        want = ref(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, extra_tokens=n,
                   seq_lens_sum=batch.seq_lens_sum, verify_lens=vl)  # fmt: skip
    else:
        want = ref(batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree,
                   verify_lens=vl)  # fmt: skip
    what = f"seed={seed} {op}"
    assert_equal(second[1], want[1], f"offsets after the change [{what}]")
    if op in ("mask", "packed"):  # the written segments (the buffers were not poisoned)
        got_v, want_v = (written_part(*r, op == "packed") for r in (second, want))
    else:
        used = int(want[1][-1]) if op == "kv" else None
        got_v, want_v = second[0][:used], want[0][:used]
    assert_equal(got_v, want_v, f"values after the change [{what}]")
    assert not torch.equal(first[1], second[1]), f"the second call changed nothing [{what}]"


@pytest.mark.parametrize(
    "fn",
    [verify_kv_indices, verify_kv_indices_ref, tree_custom_mask, tree_custom_mask_ref,
     verify_expand_page_table, verify_expand_page_table_ref],
)  # fmt: skip
def test_bad_verify_lens_name_the_call_argument_and_value(device, gen, fn):
    call = fn.__name__
    batch, tree = _batch(gen, device, n=4, batch_size=3)
    if fn in (verify_kv_indices, verify_kv_indices_ref):
        args, kw = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens), {"extra_tokens": 4}
    elif fn in (tree_custom_mask, tree_custom_mask_ref):
        args, kw = (batch.seq_lens, tree), {"seq_lens_sum": batch.seq_lens_sum}
    else:
        args, kw = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens, tree), {}
    v = _lens([1, 2, 3], device)
    cases = [
        (TypeError, v.float(), ["verify_lens", "float32", "verify_lens.to("]),
        (TypeError, [1, 2, 3], ["verify_lens", "torch.Tensor", "list"]),
        (ValueError, v.view(1, 3), ["verify_lens", "rank 1", "(1, 3)"]),
        (ValueError, v[:2], ["verify_lens", "B = 3", "(2,)", "one entry per request"]),
        (ValueError, _lens([1, 2, 3, 4], device), ["verify_lens", "B = 3", "(4,)"]),
    ]
    for exc, bad, words in cases:
        with pytest.raises(exc) as info:
            fn(*args, verify_lens=bad, **kw)
        text = str(info.value)
        assert text.startswith(f"{call}: "), text
        missing = [w for w in words if w not in text]
        assert not missing, f"{missing} not in {text!r}"
