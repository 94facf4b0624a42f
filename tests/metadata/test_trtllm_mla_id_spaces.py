"""The id spaces of design §2.10 through TRT-LLM MLA's builder: ``entry_page_size=`` and ``v2p=``
on draft decode (``K == 1`` chains and ``K > 1`` per-branch tables over slot layout B), target
verify (uniform and ragged chains, and trees: the cascade's prefix rows and ancestor lists)
and draft extend, eager and bound. Rows of page ids build, byte for
byte, what the token rows they stand for build; virtual rows through a page map build what
their physical rows build (an identity map what no map builds), in the kernel builder and the
reference builder alike; the host refuses a row too narrow in pages, and a bad map, naming the
call, before anything is written."""

from __future__ import annotations

import pytest
import torch

from specmeta import SpecConfig
from specmeta.metadata.trtllm_mla import TrtllmMlaBuilder
from specmeta.workloads import make_batch, random_tree_mask
from tests.guard_bands import assert_equal

S, N = 3, 4
# (mode, K, ps): draft decode and extend take trees, target verify chains (causal rows) and
# trees (the cascade).
CASES = [
    ("draft_decode", 1, 4),
    ("draft_decode", 3, 4),  # slot layout B
    ("draft_decode", 2, 1),  # layout A
    ("target_verify", 1, 4),
    ("ragged_verify", 1, 2),
    ("draft_extend", 2, 4),
    ("tree_verify", 2, 4),
]


def _fields(result):
    """Every tensor and host scalar of a result (a draft decode's steps)."""
    steps = result.steps if hasattr(result, "steps") else (result,)
    if hasattr(result, "ancestors"):  # a tree's verify: both passes
        steps = (result.prefix, result.ancestors)
    out = {}
    for i, step in enumerate(steps):
        for name, value in vars(step).items():
            if isinstance(value, torch.Tensor):
                out[f"{i}.{name}"] = value.clone()
            elif value is not None:
                out[f"{i}.{name}"] = torch.tensor(value)
    return out


def _setup(gen, device, *, k, ps, B=5):
    cfg = SpecConfig(topk=k, num_steps=S, num_draft_tokens=N, page_size=ps, max_bs=8,
                     max_context_len=40)  # fmt: skip
    batch = make_batch("random", batch_size=B, topk=k, num_steps=S, page_size=ps,
                       row_width=cfg.req_to_token_width, generator=gen, device=device,
                       extra_tokens=N, max_len=40)  # fmt: skip
    return cfg, batch


def _build(mla, mode, batch, rows, *, bound=False, **spaces):
    """One build of ``mode`` over ``rows``: the eager call, or (``bound``) the bound stage
    called with the lengths' host copy."""
    args = (batch.req_pool_indices, rows, batch.seq_lens)
    kw = dict(spaces)
    host = {}
    if mode == "ragged_verify":
        lens = torch.tensor([N, 0, 2, 1, N], device=rows.device)[: batch.batch_size]
        kw.update(verify_lens=lens, num_tokens=int(lens.sum()) + 2)
    if mode == "tree_verify":
        tree = random_tree_mask(batch.batch_size, 2, S, N, torch.Generator().manual_seed(1))
        args = (*args, tree.to(rows.device))
        host = dict(node_depths_cpu=tree.sum(-1) - 1)
    name = "target_verify" if mode.endswith("verify") else mode
    if bound:
        return mla.bind(name, *args, **kw)(batch.seq_lens_cpu, **host)
    return getattr(mla, name)(*args, seq_lens_cpu=batch.seq_lens_cpu, **kw, **host)


def _builds(cfg, mode, batch, device, runs):
    """``[fields]`` of each ``(rows, spaces, reference, bound)`` run, each on a fresh builder
    whose status must stay 0."""
    out = []
    for rows, spaces, reference, bound in runs:
        mla = TrtllmMlaBuilder(cfg, device, reference=reference)
        out.append(_fields(_build(mla, mode, batch, rows, bound=bound, **spaces)))
        assert int(mla.status) == 0, (mode, spaces.keys(), reference, int(mla.status))
    return out


def _compare(got, want, what):
    assert got.keys() == want.keys(), what
    for name, value in got.items():
        assert_equal(value, want[name], f"{what}: {name}")


def _token_rows(pages, E):
    """The token rows that rows of page ids of ``E`` positions stand for (design §2.10)."""
    return (pages.repeat_interleave(E, 1) * E
            + torch.arange(E, device=pages.device).repeat(pages.shape[1]))  # fmt: skip


@pytest.mark.parametrize("mode,k,ps", CASES)
@pytest.mark.parametrize("E", [2, 8])
def test_page_rows_build_what_token_rows_build(mode, k, ps, E, gen, device):
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    pages = torch.div(batch.req_to_token[:, ::E], E, rounding_mode="floor")  # [R, W / E]
    tokens = _token_rows(pages, E)
    built = _builds(cfg, mode, batch, device, [
        (tokens, {}, False, False),
        (pages, dict(entry_page_size=E), False, False),
        (pages, dict(entry_page_size=E), False, True),
        (pages, dict(entry_page_size=E), True, False),
    ])  # fmt: skip
    for i, what in ((1, "eager"), (2, "bound"), (3, "reference builder")):
        _compare(built[i], built[0], f"{mode} E={E} {what} against token rows")


@pytest.mark.parametrize("mode,k,ps", CASES)
@pytest.mark.parametrize("E", [1, 4])
def test_virtual_rows_build_what_their_physical_rows_build(mode, k, ps, E, gen, device):
    """A random page map: the build over virtual rows (of token ids, or of page ids) equals the
    build over the physical token rows, in the kernel and the reference builder; an identity
    map builds what no map builds."""
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    rows = batch.req_to_token
    if E > 1:
        rows = torch.div(rows[:, ::E], E, rounding_mode="floor")
    virtual = _token_rows(rows, E) if E > 1 else rows
    P = int(virtual.max()) // ps + 1  # every virtual page the rows name maps
    v2p = torch.randperm(2 * P, generator=gen)[:P].to(device)
    phys = v2p[virtual // ps] * ps + virtual % ps
    identity = torch.arange(P, device=device)
    built = _builds(cfg, mode, batch, device, [
        (phys, {}, False, False),
        (rows, dict(v2p=v2p, entry_page_size=E), False, False),
        (rows, dict(v2p=v2p, entry_page_size=E), True, False),
        (rows, dict(v2p=identity, entry_page_size=E), False, True),
        (rows, dict(entry_page_size=E), False, True),
    ])  # fmt: skip
    _compare(built[1], built[0], f"{mode}: v2p against physical rows")
    _compare(built[2], built[0], f"{mode}: reference builder, v2p against physical rows")
    _compare(built[3], built[4], f"{mode}: identity map against none")


@pytest.mark.parametrize("mode,k,ps", CASES)
def test_a_row_too_narrow_in_pages_or_a_bad_map_is_refused_before_any_write(mode, k, ps, gen,
                                                                            device):  # fmt: skip
    E = 4
    cfg, batch = _setup(gen, device, k=k, ps=ps)
    pages = torch.div(batch.req_to_token[:, ::E], E, rounding_mode="floor")
    need = -(-cfg.row_width_need // E)
    mla = TrtllmMlaBuilder(cfg, device)
    for buf in mla.buffers.values():
        buf.fill_(-7)
    name = "target_verify" if mode.endswith("verify") else mode
    where = f"TrtllmMlaBuilder.{name}"
    cases = [
        (pages[:, : need - 1], dict(entry_page_size=E), ValueError,
         f"{where}: req_to_token is {need - 1} page ids wide"),
        (pages[:, :need], dict(entry_page_size=0), ValueError, f"{where}: entry_page_size=0"),
        (pages[:, :need], dict(entry_page_size=E, v2p=torch.zeros(4, device=device)), TypeError,
         f"{where}: v2p"),
        (pages[:, :need], dict(entry_page_size=E,
                               v2p=torch.zeros((2, 2), dtype=torch.int64, device=device)),
         ValueError, f"{where}: v2p"),
    ]  # fmt: skip
    for bound in (False, True):
        for rows, spaces, error, words in cases:
            with pytest.raises(error) as info:
                _build(mla, mode, batch, rows, bound=bound, **spaces)
            message = str(info.value)
            assert words in message, message
            assert "v2p" not in spaces or "design §2.10" in message, message
    for key, buf in mla.buffers.items():
        if "cu_seqlens_q" not in key:
            assert bool((buf == -7).all()), f"{key} was written"
    assert int(mla.status) == 0
    # Just wide enough in pages: built, nothing reported.
    _build(mla, mode, batch, pages[:, :need], entry_page_size=E)
    assert int(mla.status) == 0
