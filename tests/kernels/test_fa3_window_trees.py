"""A window layer's tree cascade at the kernels (design §2.10): ``tree_depth`` on
``prefix_page_table`` and ``draft_decode_page_tables``, the rail and the map on
``verify_expand_page_table`` and ``verify_expand_ragged``.

Each kernel is compared exactly with its torch reference (tables, lengths, offsets and the
status word) on random rows, maps with holes (some read: ``BAD_KV_ID``) and windows inside a
page, across pages, shorter than the tree and past every prefix; the normal pass's start
``P0`` is checked against the rule it must keep (a page boundary at or past what the deepest
row reads, at most ``k`` whole pages before ``L − lpl``), and every listed page against the
ids read from the rows. The attention these tables give is checked in
``tests/metadata/test_fa3_window_builders.py`` (torch model) and ``test_fa3_window_real.py``
(FlashAttention's kernel).
"""

from __future__ import annotations

import pytest
import torch

from specmeta import Status, new_status
from specmeta.kernels.draft_decode_page_tables import draft_decode_page_tables
from specmeta.kernels.prefix_page_table import prefix_page_table, prefix_page_table_ref
from specmeta.kernels.verify_expand_page_table import (
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from specmeta.kernels.verify_expand_ragged import verify_expand_ragged, verify_expand_ragged_ref
from specmeta.workloads import random_tree_mask
from tests.guard_bands import Guarded, assert_equal


def _draw(gen, *, B, ps, lengths, holes=0.1):
    """Rows of whole shuffled pages and a full → window map paging like the full pool (each
    full page to a random window page, same offsets), ``holes`` of it ``−1``, sink kept."""
    W_row = max(lengths) + 16 + ps
    W_row += -W_row % ps
    R = B + 2
    pages = R * W_row // ps + 1
    perm = (torch.randperm(pages - 1, generator=gen) + 1).view(R, -1)
    r2t = (perm.view(R, -1, 1) * ps + torch.arange(ps)).view(R, -1).to(torch.int32)
    window = torch.randperm(2 * pages, generator=gen)[:pages]
    window[window == 0] = window[0].clone()
    window[0] = 0
    f2s = (window.view(-1, 1) * ps + torch.arange(ps)).flatten()
    f2s[torch.rand(f2s.shape[0], generator=gen) < holes] = -1
    f2s[0] = 0
    rpi = torch.randperm(R - 1, generator=gen)[:B] + 1
    return rpi, r2t, torch.tensor(lengths), f2s


@pytest.mark.parametrize("ps,depth", [(1, 3), (16, 5)])
def test_tree_normal_pass_starts_where_every_row_reads(ps, depth, gen, device):
    lengths = [0, 3, ps + 1, 4 * ps + 3, 9 * ps]
    rpi, r2t, L, f2s = _draw(gen, B=5, ps=ps, lengths=lengths)
    B, W = 5, r2t.shape[1] // ps
    for w in (1, depth + ps, depth + 2 * ps + 1, 20 * ps):
        k = (w - depth - ps) // ps
        for exclude in (False, True):
            kw = dict(page_size=ps, exclude_last_partial=exclude, sliding_window_size=w,
                      full_to_swa=f2s.to(device), tree_depth=depth)  # fmt: skip
            got = [Guarded(s, torch.int32, device) for s in ((B, W), (B,), (B + 1,))]
            status = new_status(device)
            prefix_page_table(rpi.to(device), r2t.to(device), L.to(device), status=status,
                              page_table=got[0].view, cache_seqlens=got[1].view,
                              cu_seqlens_k=got[2].view, **kw)  # fmt: skip
            ref = [torch.full(s, -3, dtype=torch.int32, device=device)
                   for s in ((B, W), (B,), (B + 1,))]  # fmt: skip
            ref_status = new_status(device)
            prefix_page_table_ref(rpi.to(device), r2t.to(device), L.to(device),
                                  status=ref_status, page_table=ref[0], cache_seqlens=ref[1],
                                  cu_seqlens_k=ref[2], **kw)  # fmt: skip
            for g, want, name in zip(got, ref, ("page_table", "cache_seqlens", "cu_seqlens_k"),
                                     strict=True):  # fmt: skip
                g.assert_intact(name)
                assert_equal(g.view, want, f"{name} (w={w}, ps={ps}, exclude={exclude})")
            assert_equal(status, ref_status, "status")
            bad = False
            for b, Lb in enumerate(lengths):
                end = Lb - Lb % ps if exclude else Lb
                n = int(got[1].view[b])
                start = end - n
                if n:  # a page boundary every row reads, at most k pages before L − lpl
                    assert start % ps == 0 and start >= Lb + depth - w + 1, (b, w)
                    assert k >= 0 and start >= Lb - Lb % ps - k * ps, (b, w)
                else:
                    assert k < 0 or Lb - Lb % ps - k * ps >= end or end == 0, (b, w)
                row = r2t[int(rpi[b])]
                for c in range(-(-n // ps)):
                    full = int(f2s[int(row[start + c * ps])])
                    bad |= full < 0
                    want = 0 if full < 0 else full // ps
                    assert int(got[0].view[b, c]) == want, (b, c, w)
            assert int(status) == (int(Status.BAD_KV_ID) if bad else 0)


@pytest.mark.parametrize("ps,n", [(1, 5), (4, 6)])
def test_tree_expand_rows_equal_the_reference(ps, n, gen, device):
    """Both verify expand kernels of a window layer against their references, faults (map
    holes among the band and the nodes) included, for windows shorter than the tree, inside
    and across pages, and past every prefix."""
    B, k, s = 4, 2, 3
    lengths = [0, 5, 2 * ps + 3, 5 * ps + 1]
    rpi, r2t, L, f2s = (x.to(device) for x in _draw(gen, B=B, ps=ps, lengths=lengths))
    mask = random_tree_mask(B, k, s, n, gen).to(device)
    v = torch.tensor([n, 1, 0, n - 1], device=device)
    qo = torch.tensor([0, n, n + 1, n + 1, 2 * n + 2], device=device)  # 3 filler rows last
    T = 2 * n + 3  # one row of no request
    for w in (2, ps + 3, 50 * ps):
        width = n - 1 + 2 * ps - 1
        out = []
        for fn in (verify_expand_page_table, verify_expand_page_table_ref):
            status = new_status(device)
            pt = torch.full((B * n, width), -3, dtype=torch.int32, device=device)
            cs = torch.full((B * n,), -3, dtype=torch.int32, device=device)
            cu = torch.full((B * n + 1,), -3, dtype=torch.int32, device=device)
            fn(rpi, r2t, L, mask, page_table=pt, cache_seqlens=cs, cu_seqlens_k=cu,
               status=status, page_size=ps, sliding_window_size=w, full_to_swa=f2s,
               verify_lens=v if w == 2 else None)  # fmt: skip
            out.append((pt, cs, cu, int(status)))
        for fn in (verify_expand_ragged, verify_expand_ragged_ref):
            status = new_status(device)
            pt = Guarded((T, width), torch.int32, device) if fn is verify_expand_ragged else None
            pt = pt.view if pt is not None else torch.full((T, width), -3, dtype=torch.int32,
                                                           device=device)  # fmt: skip
            cs = torch.full((T,), -3, dtype=torch.int32, device=device)
            fn(rpi, r2t, L, mask, qo, num_rows=T, page_table=pt, cache_seqlens=cs,
               status=status, page_size=ps, sliding_window_size=w, full_to_swa=f2s)  # fmt: skip
            out.append((pt, cs, int(status)))
        for got, want, what in ((out[0], out[1], "uniform"), (out[2], out[3], "ragged")):
            for x, y in zip(got, want, strict=True):
                if isinstance(x, torch.Tensor):
                    assert_equal(x, y, f"{what} (w={w}, ps={ps})")
                else:
                    assert x == y, f"{what} status (w={w}, ps={ps})"
        # every row's keys: its band below P0 and its ancestors within the window, at most
        # D + 2·ps − 1 with D = N − 1
        assert int(out[0][1].max()) <= width and int(out[2][1].max()) <= width


def test_refusals_name_the_call_and_the_fix(device):
    r2t = torch.zeros((2, 16), dtype=torch.int32, device=device)
    rpi = torch.ones(1, dtype=torch.int32, device=device)
    L = torch.ones(1, dtype=torch.int32, device=device)
    mask = torch.ones(1, 3, 3, dtype=torch.bool, device=device).tril()
    with pytest.raises(ValueError, match=r"prefix_page_table: tree_depth=2 was given without "
                                         r"sliding_window_size"):  # fmt: skip
        prefix_page_table(rpi, r2t, L, page_size=1, tree_depth=2)
    with pytest.raises(ValueError, match=r"prefix_page_table: tree_depth=2 builds .* no "
                                         r"extra_tokens \(got 3\)"):  # fmt: skip
        prefix_page_table(rpi, r2t, L, page_size=1, extra_tokens=3, sliding_window_size=4,
                          tree_depth=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"verify_expand_page_table: tree_depth=1 is below the "
                                         r"deepest node's depth 2"):  # fmt: skip
        verify_expand_page_table(rpi, r2t, L, mask, sliding_window_size=4, tree_depth=1)
    with pytest.raises(ValueError, match=r"verify_expand_ragged: full_to_swa was given without "
                                         r"sliding_window_size"):  # fmt: skip
        verify_expand_ragged(rpi, r2t, L, mask, torch.tensor([0, 3], device=device),
                             num_rows=3, full_to_swa=torch.zeros(8, dtype=torch.int32,
                                                                 device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"verify_expand_page_table: page_table has 3 columns; "
                                         r".* pass at least 9"):  # N − 1 + 2·ps − 1 columns
        verify_expand_page_table(rpi, r2t, L, mask, sliding_window_size=4, page_size=4,
                                 page_table=torch.zeros(3, 3, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match=r"draft_decode_page_tables: expand_page_table has 2 "
                                         r"columns; .* pass at least 3"):  # fmt: skip
        draft_decode_page_tables(rpi, r2t, L, torch.ones(4, dtype=torch.int32, device=device),
                                 topk=2, num_steps=2, page_size=1, exclude_last_partial=False,
                                 sliding_window_size=3, tree_depth=1,
                                 expand_page_table=torch.zeros(2, 2, 2, dtype=torch.int32,
                                                               device=device))  # fmt: skip
