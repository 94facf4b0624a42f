"""Every kernel op in one table: its launcher, its reference, its kernels and its workloads.

One :class:`Op` per op of :mod:`specmeta.kernels`. ``specmeta check`` runs each op's launcher
and reference on the op's cases and compares what they write; the cross-op CPU test does the
same at small shapes; the GPU tier counts the op's compiled kernels over several batch sizes
and runs it under ``torch.cuda.set_sync_debug_mode("error")``. Adding an op here puts it under
all of them.

A case is drawn from a :class:`~specmeta.workloads.Batch` (the workload vocabulary, style §12):
an op's ``cases`` function turns one batch into the arguments of one or more calls, with every
``out=`` buffer poisoned so an unwritten element shows. Each run gets fresh copies of those
buffers, so the launcher and the reference never share one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from .config import draft_decode_kv_indices_need, uses_layout_b
from .kernels.accept_cache_locs import accept_cache_locs, accept_cache_locs_ref
from .kernels.branch_kv_indices import (
    branch_kv_indices,
    branch_kv_indices_ref,
)
from .kernels.branch_page_table import (
    branch_page_table,
    branch_page_table_ref,
)
from .kernels.cache_loc_move import KVPool, move_kv_cache, move_kv_cache_ref
from .kernels.draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from .kernels.draft_decode_kv_indices import (
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from .kernels.draft_decode_page_tables import (
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from .kernels.expand_page_table import (
    expand_page_table,
    expand_page_table_ref,
)
from .kernels.host_lengths import check_host_lengths, check_host_lengths_ref
from .kernels.host_list_lengths import (
    check_host_list_lengths,
    check_host_list_lengths_ref,
    host_list_slot,
    publish_host_list_lengths,
)
from .kernels.prefix_page_table import (
    prefix_page_table,
    prefix_page_table_ref,
)
from .kernels.shared_prefix_kv_indices import (
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from .kernels.tree_ancestor_kv_indices import (
    tree_ancestor_kv_indices,
    tree_ancestor_kv_indices_ref,
)
from .kernels.tree_custom_mask import (
    tree_custom_mask,
    tree_custom_mask_ref,
)
from .kernels.verify_expand_page_table import (
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from .kernels.verify_expand_ragged import verify_expand_ragged, verify_expand_ragged_ref
from .kernels.verify_kv_indices import (
    verify_kv_indices,
    verify_kv_indices_ref,
)
from .kernels.verify_lens import (
    pad_verify_lens_to_bucket,
    pad_verify_lens_to_bucket_ref,
)
from .testing.masks import written_part
from .workloads import SHAPES, Batch, make_batch, random_accept, random_tree_mask

__all__ = ["CONFIGS", "GPU_CONFIG", "OPS", "Case", "Op", "batches", "tree_width"]

# (K, S, ps) configurations ``specmeta check`` sweeps: chains, trees, and both slot layouts.
CONFIGS = ((1, 3, 1), (4, 3, 1), (2, 4, 4), (8, 2, 16), (3, 5, 64))
# (K, S, ps) of the GPU tier's compile and no-sync tests: a tree in slot layout B, the
# production page size, rows of 4096 positions (prefixes up to ~4000 tokens).
GPU_CONFIG = (4, 5, 16)
GPU_ROW_WIDTH = 4096


def batches(device: torch.device | str, g: torch.Generator, extra_tokens: int = 0, *,
            configs=CONFIGS, shapes=SHAPES, batch_size: int | None = None,
            row_width: int | None = None) -> Iterator[Batch]:  # fmt: skip
    """One batch per (config, workload shape); rows sized for a 40-token prefix plus the drafts,
    ``extra_tokens`` verify tokens and two spare pages unless ``row_width`` is given."""
    for k, s, ps in configs:
        width = row_width or -(-(40 + k * (s + ps) + extra_tokens + 2 * ps) // ps) * ps
        for shape in shapes:
            yield make_batch(shape, batch_size=batch_size, topk=k, num_steps=s, page_size=ps,
                             row_width=width, generator=g, device=device,
                             extra_tokens=extra_tokens)  # fmt: skip


def tree_width(k: int, s: int) -> int:
    """Verify-window width of the checks' trees: up to 8 nodes, never more than K and S allow."""
    return min(1 + k + (s - 1) * k * k, 8)


@dataclasses.dataclass
class Case:
    """One call of an op: positional inputs, keywords, and the ``out=`` buffers (poisoned)."""

    describe: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def fresh_outputs(self) -> dict[str, torch.Tensor]:
        """Copies of the outputs (pinned host buffers stay pinned: a kernel reads them)."""
        return {name: t.clone().pin_memory() if t.device.type == "cpu" and t.is_pinned()
                else t.clone() for name, t in self.outputs.items()}  # fmt: skip


def _call(fn: Callable, case: Case, outputs: dict, status: torch.Tensor | None):
    return fn(*case.args, **case.kwargs, **outputs, status=status)


@dataclasses.dataclass(frozen=True)
class Op:
    """One kernel op.

    ``cases(batch, generator)`` yields the op's :class:`Case` objects for a batch drawn with
    ``extra_tokens`` verify tokens (none when the batch's config does not apply to the op);
    ``call(fn, case, outputs, status)`` launches ``fn`` (the launcher or the reference) on a
    case without reading anything back; ``written(case, result, outputs)`` cuts what the call
    wrote, by name (it may sync). ``compile_batch_sizes``: batch sizes that must share one set
    of compiled kernels at :data:`GPU_CONFIG`.
    """

    name: str
    launcher: Callable
    reference: Callable
    kernels: tuple
    cases: Callable[[Batch, torch.Generator], Iterator[Case]]
    written: Callable[[Case, object, dict], dict[str, torch.Tensor]]
    extra_tokens: int = 0
    call: Callable = _call
    compile_batch_sizes: tuple[int, ...] = (7, 13, 1, 64, 200)

    def workloads(self, device: torch.device | str, g: torch.Generator, **sweep) -> Iterator[Case]:
        """The op's cases over :func:`batches` (``sweep``: its keyword arguments)."""
        for b in batches(device, g, self.extra_tokens, **sweep):
            yield from self.cases(b, g)

    def gpu_workloads(self, device: torch.device | str, g: torch.Generator,
                      batch_size: int) -> list[Case]:  # fmt: skip
        """The cases of one random batch of ``batch_size`` requests at :data:`GPU_CONFIG`."""
        sweep = dict(configs=(GPU_CONFIG,), shapes=("random",), batch_size=batch_size,
                     row_width=GPU_ROW_WIDTH)  # fmt: skip
        return list(self.workloads(device, g, **sweep))

    def run(self, fn: Callable, case: Case, status: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``fn`` on ``case`` with fresh output buffers; what it wrote, by name."""
        outputs = case.fresh_outputs()
        return self.written(case, self.call(fn, case, outputs, status), outputs)


# ------------------------------------------------------------------------------------ helpers
def _args(b: Batch) -> tuple:
    return (b.req_pool_indices, b.req_to_token, b.seq_lens)


def _draft(b: Batch) -> dict:
    return dict(topk=b.topk, num_steps=b.num_steps, page_size=b.page_size)


def _poison(*shape: int, device, value: int = -7, dtype=torch.int32) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)


def _named(*names: str) -> Callable:
    """``written`` for an op whose result is a tuple of whole tensors, named in order."""

    def written(case, result, outputs):
        return {**dict(zip(names, result, strict=True)), **outputs}

    return written


def _window_map(b: Batch, g: torch.Generator) -> torch.Tensor:
    """A hybrid model's full → window pool map of a batch's pool (design §2.10): a shuffled
    injection into a window pool twice its size, the sink in place, no slot evicted (the
    checks' cases are valid input)."""
    P = b.pool_size
    rest = 1 + torch.randperm(2 * P - 1, generator=g)[: P - 1]
    return torch.cat([rest.new_zeros(1), rest]).to(b.seq_lens.device)


def _verify_window(b: Batch, n: int) -> torch.Tensor:
    """``[B·N]`` verify-window slots ``row_b[L_b + j]`` of a batch drawn with ``N`` extra tokens."""
    pos = b.seq_lens.to(torch.int64).view(-1, 1) + torch.arange(n, device=b.seq_lens.device)
    rows = b.req_pool_indices.to(torch.int64).view(-1, 1)
    return b.req_to_token[rows, pos].reshape(-1).to(torch.int64)


# Accepted paths run through trees of N = min(1 + K·S, 16) nodes; batches leave room for 16.
_ACCEPT_WINDOW = 16


def _accept_inputs(b: Batch, g: torch.Generator):
    n = min(1 + b.topk * b.num_steps, _ACCEPT_WINDOW)
    mask = random_tree_mask(b.batch_size, b.topk, b.num_steps, n, g)
    accept_index, accept_lens = random_accept(mask, b.num_steps, g)
    device = b.seq_lens.device
    return n, (accept_index.to(device), accept_lens.to(device), _verify_window(b, n))


# ---------------------------------------------------------------------------- the draft slots
def _assign_cases(b, g):
    n = b.batch_size * b.topk
    yield Case(b.describe(), _args(b), _draft(b), {
        "out_cache_loc": _poison(n * b.num_steps, device=b.seq_lens.device, dtype=torch.int64),
        "positions": _poison(n, device=b.seq_lens.device, value=-1, dtype=torch.int64),
    })  # fmt: skip
    # A window layer's draft slots, in window-pool ids (design §2.10).
    out = _poison(n * b.num_steps, device=b.seq_lens.device, dtype=torch.int64)
    kw = dict(_draft(b), full_to_swa=_window_map(b, g))
    yield Case(f"full_to_swa {b.describe()}", _args(b), kw, {"out_cache_loc": out})


def _pairs_cases(b, g):
    if uses_layout_b(b.topk, b.page_size):
        yield Case(b.describe(), _args(b), _draft(b))


def _kv_indices_cases(b, g):
    need = draft_decode_kv_indices_need(b.seq_lens_sum, b.batch_size, b.topk, b.num_steps)
    kw = dict(_draft(b), seq_lens_sum=b.seq_lens_sum)
    out = {"kv_indices": _poison(b.num_steps, need, device=b.seq_lens.device, value=-1)}
    yield Case(b.describe(), _args(b), kw, out)
    # The id-space form (design §2.10): a draft window over virtual ids, mapped onto a
    # shuffled pool twice the size.
    pages = int(b.req_to_token.max()) // b.page_size + 1
    v2p = torch.randperm(2 * pages, generator=g)[:pages].to(b.seq_lens.device)
    window = int(torch.randint(1, 3 * b.page_size + 8, (1,), generator=g))
    kw = dict(kw, window_size=window, sink_size=window % 5, v2p=v2p)
    out = {"kv_indices": _poison(b.num_steps, need, device=b.seq_lens.device, value=-1)}
    yield Case(f"window={window} sink={window % 5} v2p {b.describe()}", _args(b), kw, out)
    # A window layer (design §2.10): the read rail, ids through the window pool map.
    rail = int(torch.randint(1, 2 * b.page_size + 6, (1,), generator=g))
    kw = dict(_draft(b), seq_lens_sum=b.seq_lens_sum, sliding_window_size=rail,
              full_to_swa=_window_map(b, g))  # fmt: skip
    out = {"kv_indices": _poison(b.num_steps, need, device=b.seq_lens.device, value=-1)}
    yield Case(f"sliding_window_size={rail} full_to_swa {b.describe()}", _args(b), kw, out)


def _kv_indices_written(case, result, outputs):
    B, K, total = case.args[0].shape[0], case.kwargs["topk"], case.kwargs["seq_lens_sum"]
    if case.kwargs.get("window_size"):
        cap = case.kwargs["window_size"] + case.kwargs["sink_size"]
        total = int(case.args[2].clamp(0, cap).sum())
    got = {"kv_indptr": result[1]}
    for s in range(case.kwargs["num_steps"]):
        used = draft_decode_kv_indices_need(total, B, K, s + 1)
        if case.kwargs.get("sliding_window_size"):  # the rail's lists end where kv_indptr says
            used = int(result[1][s, B * K])
        got[f"kv_indices[{s}]"] = outputs["kv_indices"][s, :used]
    return got


# ------------------------------------------------------------------ accepting and moving slots
def _accept_cases(b, g):
    n, inputs = _accept_inputs(b, g)
    size = inputs[0].numel()
    out = {k: _poison(size, device=b.seq_lens.device, value=-1, dtype=torch.int64)
           for k in ("tgt", "src")}  # fmt: skip
    yield Case(f"N={n} {b.describe()}", inputs, dict(num_draft_tokens=n), out)
    # Virtual verify slots (design §2.10): the pairs through a shuffled page map.
    pages = (int(inputs[2].max()) if inputs[2].numel() else 0) // b.page_size + 1
    v2p = torch.randperm(2 * pages, generator=g)[:pages].to(b.seq_lens.device)
    kw = dict(num_draft_tokens=n, v2p=v2p, page_size=b.page_size)
    out = {k: _poison(size, device=b.seq_lens.device, value=-1, dtype=torch.int64)
           for k in ("tgt", "src")}  # fmt: skip
    yield Case(f"N={n} v2p {b.describe()}", inputs, kw, out)
    # A ragged verify (design §2.9): the same paths over windows packed at qo_indptr.
    qo_indptr, inputs = _ragged_accept(n, inputs, g)
    out = {k: _poison(size, device=b.seq_lens.device, value=-1, dtype=torch.int64)
           for k in ("tgt", "src")}  # fmt: skip
    kw = dict(num_draft_tokens=n, qo_indptr=qo_indptr)
    yield Case(f"N={n} ragged {b.describe()}", inputs, kw, out)


def _ragged_accept(n: int, inputs: tuple, g: torch.Generator) -> tuple[torch.Tensor, tuple]:
    """``qo_indptr`` and the accept inputs of the same accepted paths in a ragged verify: request
    ``i`` verifies a random ``v_i`` of its ``N`` nodes, never fewer than its path needs, and the
    last request two filler rows past ``N`` (their slots the sink)."""
    accept_index, accept_lens, window = (t.cpu().to(torch.int64) for t in inputs)
    B = accept_index.shape[0]
    node = torch.where(accept_index >= 0, accept_index - n * torch.arange(B).view(-1, 1), -1)
    need = node.max(1).values + 1  # the rows a path needs: 0 for an empty one
    lens = need + (torch.rand(B, generator=g) * (n + 1 - need)).to(torch.int64)
    lens[-1:] = n + 2
    qo_indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    rows = [window[i * n : i * n + min(int(lens[i]), n)] for i in range(B)]
    slots = torch.cat(rows + [window.new_zeros(2 if B else 0)])
    index = torch.where(node >= 0, node + qo_indptr[:-1].view(-1, 1), -1)
    device = inputs[0].device
    return qo_indptr.to(device), (index.to(inputs[0].dtype).to(device), inputs[1],
                                  slots.to(device))  # fmt: skip


def _move_cases(b, g):
    """Accept pairs (overlapping chains; ordered, then through the general path), layout-B
    prefix-tail pairs (disjoint) and a shuffled cycle through random slots (correct only if
    every read comes first), moved over a bf16 pool and a byte pool with padded rows."""
    device = b.seq_lens.device
    n, inputs = _accept_inputs(b, g)
    accept = accept_cache_locs_ref(*inputs, num_draft_tokens=n)
    moves = [(accept, dict(ordered=True)), (accept, {})]
    if uses_layout_b(b.topk, b.page_size):
        moves.append((prefix_tail_copy_pairs_ref(*_args(b), **_draft(b)), dict(disjoint=True)))
    P = b.pool_size
    cycle = (torch.randperm(P - 1, generator=g)[:48] + 1).to(device)
    order = torch.randperm(cycle.numel(), generator=g).to(device)
    moves.append(((cycle[order], cycle.roll(-1)[order]), {}))
    raw = torch.randint(0, 256, (P * (128 + 12),), generator=g, dtype=torch.uint8).to(device)
    # Both addressing paths over the sweep, alternating with the workload shape.
    addressing = ("table", "direct")[SHAPES.index(b.shape) % 2]
    kw = dict(moves=moves, pool_size=P, addressing=addressing)
    yield Case(f"{addressing} {b.describe()}", (), kw, {"pool_bytes": raw})


def _move_call(fn, case, outputs, status):
    raw, P = outputs["pool_bytes"], case.kwargs["pool_size"]
    buffers = [raw[: P * 128].view(torch.bfloat16).view(P, 64), raw[P * 128 :].view(P, 12)[:, :9]]
    pool = KVPool(buffers, addressing=case.kwargs["addressing"])
    for (tgt, src), promise in case.kwargs["moves"]:
        fn(pool, tgt, src, status=status, **promise)


def _move_written(case, result, outputs):
    return {"pool bytes": outputs["pool_bytes"]}  # bytes: NaN-safe, and the row padding too


# ------------------------------------------------------------- FlashInfer and TRT-LLM MLA ops
def _verify_lens(b: Batch, n: int, g: torch.Generator) -> torch.Tensor:
    """Random per-request verify lengths in ``[0, N]`` (a ragged target verify, design §3.3),
    in the batch's index dtype, on its device."""
    v = torch.randint(0, n + 1, (b.batch_size,), generator=g, dtype=b.seq_lens.dtype)
    return v.to(b.seq_lens.device)


def _verify_kv_cases(b, g):
    """The uniform lists, then a ragged verify into a poisoned buffer of the uniform size
    (entries past Σ(L + v) must be left alone)."""
    n = tree_width(b.topk, b.num_steps)
    kw = dict(extra_tokens=n, seq_lens_sum=b.seq_lens_sum)
    yield Case(b.describe(), _args(b), kw)
    need = b.seq_lens_sum + b.batch_size * n
    out = {"kv_indices": _poison(max(need, 1), device=b.seq_lens.device,
                                 dtype=b.req_to_token.dtype)}  # fmt: skip
    kw = dict(kw, verify_lens=_verify_lens(b, n, g))
    yield Case(f"ragged {b.describe()}", _args(b), kw, out)
    # A window layer (design §2.10): lists from max(0, L - w + 1), in window-pool ids.
    rail = int(torch.randint(1, 12, (1,), generator=g))
    kw = dict(extra_tokens=n, seq_lens_sum=b.seq_lens_sum, sliding_window_size=rail,
              full_to_swa=_window_map(b, g))  # fmt: skip
    out = {"kv_indices": _poison(max(need, 1), device=b.seq_lens.device,
                                 dtype=b.req_to_token.dtype)}  # fmt: skip
    yield Case(f"sliding_window_size={rail} {b.describe()}", _args(b), kw, out)


def _verify_kv_written(case, result, outputs):
    B = case.args[0].shape[0]
    used = case.kwargs["seq_lens_sum"] + B * case.kwargs["extra_tokens"]
    if case.kwargs.get("sliding_window_size"):  # the clipped lists end where kv_indptr says
        used = int(result[1][B]) if B else 0
    return {"kv_indptr": result[1], "kv_indices": result[0][:used]}


def _mask_cases(b, g):
    n = tree_width(b.topk, b.num_steps)
    tree = random_tree_mask(b.batch_size, b.topk, b.num_steps, n, g).to(b.seq_lens.device)
    for packed in (False, True):
        kw = dict(packed=packed, seq_lens_sum=b.seq_lens_sum)
        yield Case(f"packed={packed} {b.describe()}", (b.seq_lens, tree), kw)
    for packed in (False, True):  # a ragged verify: v × (L + v) blocks
        kw = dict(packed=packed, seq_lens_sum=b.seq_lens_sum, verify_lens=_verify_lens(b, n, g))
        yield Case(f"packed={packed} ragged {b.describe()}", (b.seq_lens, tree), kw)
    for packed in (False, True):  # a window layer: blocks over the clipped lists (design §2.10)
        rail = int(torch.randint(1, 12, (1,), generator=g))
        kw = dict(packed=packed, seq_lens_sum=b.seq_lens_sum, sliding_window_size=rail)
        yield Case(f"packed={packed} sliding_window_size={rail} {b.describe()}",
                   (b.seq_lens, tree), kw)  # fmt: skip


def _mask_written(case, result, outputs):
    mask, indptr = result
    return {"mask_indptr": indptr, "custom_mask": written_part(mask, indptr, case.kwargs["packed"])}


def _shared_prefix_cases(b, g):
    yield Case(b.describe(), _args(b), dict(_draft(b), seq_lens_sum=b.seq_lens_sum))


def _shared_prefix_written(case, result, outputs):
    B, K, total = case.args[0].shape[0], case.kwargs["topk"], case.kwargs["seq_lens_sum"]
    got = {"prefix_kv_indptr": result[1], "prefix_kv_indices": result[0][:total],
           "chain_kv_indptr": result[3]}  # fmt: skip
    for s in range(case.kwargs["num_steps"]):
        got[f"chain_kv_indices[{s}]"] = result[2][s, : B * K * (s + 1)]
    return got


def _branch_table_cases(b, g):
    yield Case(b.describe(), _args(b), dict(_draft(b), fill_value=-1))


def _branch_kv_cases(b, g):
    if b.page_size > 1:  # page lists serve ps > 1 (ps == 1 is draft_decode_kv_indices)
        yield Case(b.describe(), _args(b), dict(_draft(b), seq_lens_sum=b.seq_lens_sum))


def _branch_kv_written(case, result, outputs):
    indices, indptr, last = result
    got = {"kv_indptr": indptr, "kv_last_page_len": last}
    for s in range(case.kwargs["num_steps"]):
        got[f"kv_indices[{s}]"] = indices[s, : int(indptr[s, -1])]
    return got


# -------------------------------------------------------------------------- FlashAttention-3
def _prefix_table_cases(b, g):
    """Two of three variants per batch, rotating with the shape: the FA3 normal pass, the
    K == 1 draft decode, and verify/extend with TRT-LLM's fill."""
    variants = (
        dict(exclude_last_partial=uses_layout_b(b.topk, b.page_size)),
        dict(extra_tokens=1, num_rows=b.num_steps),
        dict(extra_tokens=8, fill_value=-1),
    )
    i = SHAPES.index(b.shape) % 3
    for kw in (variants * 2)[i : i + 2]:
        rows = kw.get("num_rows")
        shape = (b.batch_size + 1,) if rows is None else (rows, b.batch_size + 1)
        out = {"cu_seqlens_k": _poison(*shape, device=b.seq_lens.device)}
        yield Case(f"{kw} {b.describe()}", _args(b), dict(kw, page_size=b.page_size), out)
    # A window layer's table (design §2.10): the read floor, window-pool pages through the map.
    rail = int(torch.randint(1, 2 * b.page_size + 6, (1,), generator=g))
    kw = dict(extra_tokens=8, page_size=b.page_size, sliding_window_size=rail,
              full_to_swa=_window_map(b, g))  # fmt: skip
    out = {"cu_seqlens_k": _poison(b.batch_size + 1, device=b.seq_lens.device)}
    yield Case(f"sliding_window_size={rail} full_to_swa {b.describe()}", _args(b), kw, out)


def _expand_cases(b, g):
    slots = assign_draft_cache_locs_ref(*_args(b), **_draft(b))
    out = {"cu_seqlens_k": _poison(b.num_steps, b.batch_size * b.topk + 1,
                                   device=b.seq_lens.device)}  # fmt: skip
    yield Case(b.describe(), (slots, b.seq_lens), _draft(b), out)


def _fused_cases(b, g):
    """Both FA3 draft-decode passes in one launch."""
    slots = assign_draft_cache_locs_ref(*_args(b), **_draft(b))
    kw = dict(_draft(b), exclude_last_partial=uses_layout_b(b.topk, b.page_size))
    device, BK = b.seq_lens.device, b.batch_size * b.topk
    out = {"cu_seqlens_k": _poison(b.batch_size + 1, device=device),
           "expand_cu_seqlens_k": _poison(b.num_steps, BK + 1, device=device)}  # fmt: skip
    yield Case(b.describe(), (*_args(b), slots), kw, out)
    # A window layer's normal pass (design §2.10).
    rail = int(torch.randint(1, 2 * b.page_size + 6, (1,), generator=g))
    kw = dict(kw, sliding_window_size=rail, full_to_swa=_window_map(b, g))
    out = {"cu_seqlens_k": _poison(b.batch_size + 1, device=device),
           "expand_cu_seqlens_k": _poison(b.num_steps, BK + 1, device=device)}  # fmt: skip
    yield Case(f"sliding_window_size={rail} full_to_swa {b.describe()}", (*_args(b), slots), kw,
               out)  # fmt: skip


def _verify_expand_cases(b, g):
    n = tree_width(b.topk, b.num_steps)
    tree = random_tree_mask(b.batch_size, b.topk, b.num_steps, n, g).to(b.seq_lens.device)
    out = {"cu_seqlens_k": _poison(b.batch_size * n + 1, device=b.seq_lens.device)}
    yield Case(b.describe(), (*_args(b), tree), {}, out)
    kw = dict(verify_lens=_verify_lens(b, n, g))  # a ragged verify: nodes j ≥ v_b get no keys
    yield Case(f"ragged {b.describe()}", (*_args(b), tree), kw,
               {name: t.clone() for name, t in out.items()})  # fmt: skip


def _verify_expand_ragged_cases(b, g):
    """A ragged verify's expand pass: the batch's random verify lengths padded to a bucket with
    room to spare (the last request's filler rows), over the tree, then over a chain."""
    from .kernels.verify_lens import pad_verify_lens_to_bucket_ref

    n, B, device = tree_width(b.topk, b.num_steps), b.batch_size, b.seq_lens.device
    tree = random_tree_mask(B, b.topk, b.num_steps, n, g).to(device)
    lens = torch.randint(0, n + 1, (B,), generator=g, dtype=torch.int64)
    T = int(lens.sum()) + (2 if B else 0)
    _, qo = pad_verify_lens_to_bucket_ref(lens, T, B)
    out = {"cu_seqlens_k": _poison(T + 1, device=device)}
    for mask in (tree, None):
        kw = dict(num_rows=T, num_draft_tokens=n)
        yield Case(f"T={T} {'tree' if mask is not None else 'chain'} {b.describe()}",
                   (*_args(b), mask, qo.to(device)), kw,
                   {name: t.clone() for name, t in out.items()})  # fmt: skip


# ------------------------------------------------------------------------- the verify bucket
# Verify lengths are drawn in [0, _VERIFY_WIDTH] (a tree of up to 8 nodes, as tree_width).
_VERIFY_WIDTH = 8


def _pad_lens_cases(b, g):
    """Random verify lengths of the batch's requests (its index dtype) in a bucket with room
    to spare: three pad requests, then none (the last request takes the leftover)."""
    B, device = b.batch_size, b.seq_lens.device
    lens = torch.randint(0, _VERIFY_WIDTH + 1, (B,), generator=g, dtype=b.seq_lens.dtype)
    for pads in (3, 0):
        bp = B + pads
        spare = int(torch.randint(0, 2 * _VERIFY_WIDTH + 1, (1,), generator=g)) if bp else 0
        T = int(lens.sum()) + spare
        out = {"out": _poison(bp + 2, device=device),
               "qo_indptr": _poison(bp + 3, device=device)}  # fmt: skip
        yield Case(f"T={T} Bp={bp} {b.describe()}", (lens.to(device), T, bp), {}, out)


# --------------------------------------------------------------------- the host's seq_lens copy
def _host_lengths_cases(b, g):
    """What a host part sends for the batch's first ``n`` requests (its own lengths: valid
    input, no fault; tests/metadata/test_stale_host_lengths.py plants the stale ones), and
    nothing (``n = −1``)."""
    lens, device = b.seq_lens_cpu.long(), b.seq_lens.device
    n = int(torch.randint(0, b.batch_size + 1, (1,), generator=g))
    for what, seen, read in ((f"n={n}", 0, n), ("nothing new", 1, n), ("n=-1", 0, -1)):
        top = int(lens[:n].max()) if n else 0
        slot = torch.tensor([1, read, int(lens[:n].sum()), top, 0, 0, 0, 0])
        pinned = slot.pin_memory() if device.type == "cuda" else slot  # host memory, as built
        seen_t = torch.tensor([seen], device=device)
        yield Case(f"{what} {b.describe()}", (b.seq_lens,), {}, {"slot": pinned, "seen": seen_t})


def _ancestor_cases(b, g):
    """The verify tree's per-node ancestor lists (FlashInfer MLA), into a poisoned buffer of
    the planned B*N*N entries (entries past the lists must be left alone)."""
    n, device = tree_width(b.topk, b.num_steps), b.seq_lens.device
    tree = random_tree_mask(b.batch_size, b.topk, b.num_steps, n, g).to(device)
    out = {"kv_indices": _poison(max(b.batch_size * n * n, 1), device=device,
                                 dtype=b.req_to_token.dtype)}  # fmt: skip
    yield Case(b.describe(), (*_args(b), tree), {}, out)


def _ancestor_written(case, result, outputs):
    indices, indptr, lens = result
    BN = lens.shape[0]
    return {"kv_len": lens, "kv_indptr": indptr, "kv_indices": indices[: int(indptr[BN])],
            "kv_indices past the lists": indices[int(indptr[BN]) :]}  # fmt: skip


def _host_list_cases(b, g):
    """What a host part publishes of its lists' lengths, entry by entry (here the batch's own
    lengths: valid input, no fault; tests/kernels/test_tree_ancestor_kv_indices.py plants the
    stale ones), then nothing new, then nothing (``n = −1``)."""
    lens, device = b.seq_lens_cpu.long(), b.seq_lens.device
    n = int(torch.randint(0, b.batch_size + 1, (1,), generator=g))
    for what, seen, read in ((f"n={n}", 0, n), ("nothing new", 1, n), ("n=-1", 0, -1)):
        slot = host_list_slot(b.batch_size, device)  # host memory, pinned for CUDA, as built
        publish_host_list_lengths(slot, lens[:n])
        slot[1] = read
        seen_t = torch.tensor([seen], device=device)
        yield Case(f"{what} {b.describe()}", (b.seq_lens,), {}, {"slot": slot, "seen": seen_t})


_TABLES = ("page_table", "cache_seqlens")

#: Every kernel op, in the order ``specmeta check`` runs them.
OPS: tuple[Op, ...] = (
    Op("assign_draft_cache_locs", assign_draft_cache_locs, assign_draft_cache_locs_ref,
       assign_draft_cache_locs.kernels, _assign_cases,
       lambda case, result, outputs: outputs),
    Op("prefix_tail_copy_pairs", prefix_tail_copy_pairs, prefix_tail_copy_pairs_ref,
       prefix_tail_copy_pairs.kernels, _pairs_cases, _named("tgt", "src")),
    Op("draft_decode_kv_indices", draft_decode_kv_indices, draft_decode_kv_indices_ref,
       draft_decode_kv_indices.kernels, _kv_indices_cases, _kv_indices_written),
    Op("accept_cache_locs", accept_cache_locs, accept_cache_locs_ref,
       accept_cache_locs.kernels, _accept_cases, lambda case, result, outputs: outputs,
       extra_tokens=_ACCEPT_WINDOW),
    # n = B·(S + 1) accept pairs in (64, 128] at GPU_CONFIG: move_kv_cache buckets n to a
    # power of two on its overlapping paths, so these batch sizes share one bucket.
    Op("move_kv_cache", move_kv_cache, move_kv_cache_ref,
       move_kv_cache.kernels, _move_cases, _move_written,
       extra_tokens=_ACCEPT_WINDOW, call=_move_call, compile_batch_sizes=(11, 13, 16, 21)),
    Op("verify_kv_indices", verify_kv_indices, verify_kv_indices_ref,
       verify_kv_indices.kernels, _verify_kv_cases, _verify_kv_written, extra_tokens=8),
    Op("tree_custom_mask", tree_custom_mask, tree_custom_mask_ref,
       tree_custom_mask.kernels, _mask_cases, _mask_written, extra_tokens=8),
    Op("shared_prefix_kv_indices", shared_prefix_kv_indices,
       shared_prefix_kv_indices_ref, shared_prefix_kv_indices.kernels,
       _shared_prefix_cases, _shared_prefix_written),
    Op("branch_page_table", branch_page_table, branch_page_table_ref,
       branch_page_table.kernels, _branch_table_cases, _named("page_table", "seq_lens_k")),
    Op("branch_kv_indices", branch_kv_indices, branch_kv_indices_ref,
       branch_kv_indices.kernels, _branch_kv_cases, _branch_kv_written),
    Op("prefix_page_table", prefix_page_table, prefix_page_table_ref,
       prefix_page_table.kernels, _prefix_table_cases, _named(*_TABLES), extra_tokens=8),
    Op("expand_page_table", expand_page_table, expand_page_table_ref,
       expand_page_table.kernels, _expand_cases, _named(*_TABLES)),
    Op("draft_decode_page_tables", draft_decode_page_tables,
       draft_decode_page_tables_ref, draft_decode_page_tables.kernels, _fused_cases,
       _named(*_TABLES, "expand_page_table", "expand_cache_seqlens")),
    Op("verify_expand_page_table", verify_expand_page_table,
       verify_expand_page_table_ref, verify_expand_page_table.kernels,
       _verify_expand_cases, _named(*_TABLES), extra_tokens=8),
    Op("verify_expand_ragged", verify_expand_ragged, verify_expand_ragged_ref,
       verify_expand_ragged.kernels, _verify_expand_ragged_cases, _named(*_TABLES),
       extra_tokens=8),
    Op("check_host_lengths", check_host_lengths, check_host_lengths_ref,
       check_host_lengths.kernels, _host_lengths_cases, lambda case, result, outputs: outputs),
    # Whole buffers compared: the poisoned entries past Bp and Bp + 1 must be left alone.
    Op("pad_verify_lens_to_bucket", pad_verify_lens_to_bucket, pad_verify_lens_to_bucket_ref,
       pad_verify_lens_to_bucket.kernels, _pad_lens_cases, _named("out", "qo_indptr")),
    Op("tree_ancestor_kv_indices", tree_ancestor_kv_indices, tree_ancestor_kv_indices_ref,
       tree_ancestor_kv_indices.kernels, _ancestor_cases, _ancestor_written, extra_tokens=8),
    Op("check_host_list_lengths", check_host_list_lengths, check_host_list_lengths_ref,
       check_host_list_lengths.kernels, _host_list_cases,
       lambda case, result, outputs: outputs),
)  # fmt: skip
