"""The workload vocabulary shared by tests, benchmarks and ``specmeta check`` (style §12).

A :class:`Batch` is a complete, self-consistent set of inputs: a ``req_to_token`` table whose
rows map to shuffled, page-aligned, non-contiguous pages of a pool (row 0 and page 0 reserved),
the rows owned by the batch, and prefix lengths drawn from one of the named :data:`SHAPES`.
Everything is drawn from a ``torch.Generator``, so a failing case is reproduced from its seed.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import draft_row_need

__all__ = ["SHAPES", "Batch", "make_batch", "max_prefix_len", "random_tree_mask", "random_accept"]

SHAPES = (
    "empty",  # B = 0: an idle data-parallel rank
    "one",  # a single request
    "odd",  # odd batch sizes (7, 13) or the requested B
    "max",  # every request at the row's limit
    "long_short",  # one long request and many short ones
    "mod0",  # every prefix ≡ 0 (mod ps)
    "mod1",  # every prefix ≡ 1 (mod ps)
    "modm1",  # every prefix ≡ ps − 1 (mod ps)
    "random",  # uniform lengths
    "near_row_end",  # lengths whose draft region ends within a page of W_row
)


def max_prefix_len(
    row_width: int, topk: int, num_steps: int, page_size: int, extra: int = 0
) -> int:
    """The longest prefix whose draft region (and ``extra`` verify tokens) fits a row of
    ``row_width`` positions, whatever its residue mod ``page_size``."""
    best = 0
    hi = row_width
    lo, length = 0, 0
    while lo <= hi:  # binary search on a monotone envelope: need(L') for all L' ≤ L fits
        length = (lo + hi) // 2
        worst = max(
            max(draft_row_need(x, topk, num_steps, page_size), x + extra)
            for x in range(max(0, length - 2 * page_size), length + 1)
        )
        if worst <= row_width:
            best, lo = length, length + 1
        else:
            hi = length - 1
    return best


@dataclasses.dataclass
class Batch:
    """Inputs of one draft iteration. CPU mirrors are what an engine holds on the host."""

    req_pool_indices: torch.Tensor  # [B] int64 (or int32)
    req_to_token: torch.Tensor  # [R, W_row] int32
    seq_lens: torch.Tensor  # [B] int64 (or int32)
    seq_lens_cpu: torch.Tensor  # [B] int64 on the CPU
    topk: int
    num_steps: int
    page_size: int
    pool_size: int
    shape: str

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def seq_lens_sum(self) -> int:
        return int(self.seq_lens_cpu.sum())

    def describe(self) -> str:
        return (
            f"{self.shape}: B={self.batch_size} K={self.topk} S={self.num_steps} "
            f"ps={self.page_size} W_row={self.req_to_token.shape[1]} "
            f"L={self.seq_lens_cpu.tolist()[:16]}"
        )


def _lengths(shape: str, batch: int, max_len: int, ps: int, g: torch.Generator) -> list[int]:
    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, max(hi, lo) + 1, (1,), generator=g))

    def with_residue(r: int) -> int:
        pages = rand(0, max(0, (max_len - r) // ps))
        return min(pages * ps + r % ps, max_len)

    if shape == "max":
        return [max_len] * batch
    if shape == "long_short":
        return ([max_len] + [rand(1, min(8, max_len)) for _ in range(batch - 1)])[:batch]
    if shape in ("mod0", "mod1", "modm1"):
        r = {"mod0": 0, "mod1": 1, "modm1": ps - 1}[shape]
        return [with_residue(r) for _ in range(batch)]
    if shape == "near_row_end":
        return [rand(max(0, max_len - ps), max_len) for _ in range(batch)]
    return [rand(0, max_len) for _ in range(batch)]


def make_batch(
    shape: str,
    *,
    batch_size: int | None = None,
    topk: int,
    num_steps: int,
    page_size: int,
    row_width: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    num_rows: int | None = None,
    extra_tokens: int = 0,
    index_dtype: torch.dtype = torch.int64,
    max_len: int | None = None,
) -> Batch:
    """Draw a :class:`Batch` of the named ``shape``.

    ``row_width`` is ``W_row``; lengths stay within :func:`max_prefix_len` (plus ``extra_tokens``
    verify tokens) and ``max_len`` when given (a config's ``max_context_len``); shape ``"max"``
    sits exactly on that bound. ``num_rows`` defaults
    to the batch plus a few unused rows, so pool rows are not simply ``1 … B``.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; expected one of {SHAPES}")
    g = generator
    if batch_size is None:
        batch_size = {
            "empty": 0,
            "one": 1,
            "odd": (7, 13)[int(torch.randint(0, 2, (1,), generator=g))],
        }.get(shape, 5)
    if shape == "empty":
        batch_size = 0
    if shape == "one":
        batch_size = 1
    ps = page_size
    if row_width % ps:
        raise ValueError(f"row_width={row_width} must be a multiple of page_size={ps}")
    fit = max_prefix_len(row_width, topk, num_steps, ps, extra_tokens)
    max_len = fit if max_len is None else min(max_len, fit)
    lengths = _lengths(shape, batch_size, max_len, ps, g)

    rows = num_rows if num_rows is not None else batch_size + 3
    pages_per_row = row_width // ps
    # Every row's positions map to distinct, shuffled pages; page 0 stays the sink.
    num_pages = 1 + (rows - 1) * pages_per_row
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    page_of = torch.zeros(rows, pages_per_row, dtype=torch.int64)
    page_of[1:] = perm.view(rows - 1, pages_per_row)
    offsets = torch.arange(ps).view(1, 1, ps)
    req_to_token = (page_of.unsqueeze(-1) * ps + offsets).view(rows, row_width).to(torch.int32)
    req_to_token[0] = 0
    owned = torch.randperm(rows - 1, generator=g)[:batch_size] + 1

    seq_lens_cpu = torch.tensor(lengths, dtype=torch.int64)
    return Batch(
        req_pool_indices=owned.to(index_dtype).to(device),
        req_to_token=req_to_token.to(device),
        seq_lens=seq_lens_cpu.to(index_dtype).to(device),
        seq_lens_cpu=seq_lens_cpu,
        topk=topk,
        num_steps=num_steps,
        page_size=ps,
        pool_size=num_pages * ps,
        shape=shape,
    )


def random_tree_mask(batch_size: int, topk: int, num_steps: int, num_draft_tokens: int,
                     generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """A ``[B, N, N]`` bool ancestor mask of random draft trees (``m[i, j, c]`` is 1 iff
    ``c == j`` or ``c`` is an ancestor of ``j``). Node 0 is the root; every other node's parent
    is an earlier node, at most ``S`` deep, at most ``K`` children per node."""
    n = num_draft_tokens
    mask = torch.zeros(batch_size, n, n, dtype=torch.bool)
    for i in range(batch_size):
        depth = [0] * n
        children = [0] * n
        for j in range(n):
            mask[i, j, j] = True
            if j == 0:
                continue
            candidates = [p for p in range(j) if depth[p] < num_steps and children[p] < topk]
            parent = candidates[int(torch.randint(0, len(candidates), (1,), generator=generator))]
            depth[j] = depth[parent] + 1
            children[parent] += 1
            mask[i, j] = mask[i, parent]
            mask[i, j, j] = True
    return mask


def random_accept(tree_mask: torch.Tensor, num_steps: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Accepted paths through the trees of ``tree_mask`` (see :func:`random_tree_mask`): per
    request, the root-to-node path of a random node cut to a random length in ``[0, depth+1]``
    (empty, partial and full acceptances; paths that leave the first branch).

    Returns ``accept_index`` ``[B, S+1]`` int32 (global node ids ``i·N + node``, then ``-1``)
    and ``accept_lens`` ``[B]`` int32, the number of valid entries of each row."""
    B, N, _ = tree_mask.shape
    accept_index = torch.full((B, num_steps + 1), -1, dtype=torch.int32)
    accept_lens = torch.zeros(B, dtype=torch.int32)
    for i in range(B):
        node = int(torch.randint(0, N, (1,), generator=generator))
        path = tree_mask[i, node].nonzero().flatten()  # ancestors have smaller ids: root first
        k = int(torch.randint(0, path.numel() + 1, (1,), generator=generator))
        accept_index[i, :k] = (path[:k] + i * N).to(torch.int32)
        accept_lens[i] = k
    return accept_index, accept_lens
