"""The requests a speculative loop serves, their rows and pages, EAGLE's tree selection, greedy
acceptance, and the check that a loop's output is greedy decoding of its target
(:mod:`.spec_loop` runs them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .tiny_model import TinyModel

__all__ = [
    "Request",
    "NodeRecord",
    "Iteration",
    "GreedyAgreement",
    "greedy_agreement",
    "greedy_accept",
    "TreeSelection",
    "DraftTree",
    "extend_tokens",
    "boundary_prompt_lengths",
    "make_requests",
    "SlotAllocator",
]


# ------------------------------------------------------------------------------------------------
# Requests and what an iteration records
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    """One generation request and its decoding state.

    Attributes
    ----------
    rid : int
        Request id.
    prompt : torch.Tensor
        ``[P]`` int64 token ids (CPU).
    max_new_tokens : int
        The request finishes once it has generated at least this many tokens (an iteration
        can overshoot by up to ``S``).
    wave, delay : int
        Scheduling (:meth:`.spec_loop.SpeculativeLoop.run`): the request joins ``delay`` iterations after
        its wave opens; wave ``w + 1`` opens after every request of wave ``w`` finished and one
        idle iteration (``B = 0``) ran.
    row : int
        Its ``req_to_token`` row (0 until admitted).
    output : list of int
        Generated tokens; ``output[-1]`` is the root of the next draft tree.
    seq_len : int
        ``L``: positions whose target KV is committed (prompt plus accepted tokens); the root
        sits at position ``L``. The draft's KV is committed one position further (``L + 1``).
    root_logprobs : torch.Tensor or None
        ``[V]`` the draft's log-probabilities of the token after the root.
    """

    rid: int
    prompt: torch.Tensor
    max_new_tokens: int
    wave: int = 0
    delay: int = 0
    row: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    seq_len: int = 0
    root_logprobs: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """One request's part of an iteration.

    Attributes
    ----------
    rid : int
        The request.
    start : int
        ``len(output)`` before the iteration: the root is ``output[start − 1]`` and the
        iteration's first new token is ``output[start]``.
    tree_tokens, tree_parents : tuple of int
        The verify tree: node 0 is the root (parent −1); every other node's parent has a
        smaller id.
    accepted : int
        Accepted length, root included (``1`` … ``S + 1``); the iteration appends this many
        tokens (the accepted draft tokens and the bonus token).
    """

    rid: int
    start: int
    tree_tokens: tuple[int, ...]
    tree_parents: tuple[int, ...]
    accepted: int


@dataclasses.dataclass(frozen=True)
class Iteration:
    """What one :meth:`.spec_loop.SpeculativeLoop.step` did.

    Attributes
    ----------
    index : int
        Iteration number within :meth:`.spec_loop.SpeculativeLoop.run`.
    batch_size : int
        ``B`` (0 for an idle iteration).
    path : str
        ``"eager"`` or ``"graph"`` (the runners).
    padded_batch_size : int
        ``Bp``: the bucket (the graph path) or ``B``.
    requests : tuple of NodeRecord
        Per request, in batch order.
    status : int
        The status word after the iteration (0: no kernel masked anything).
    seconds : dict of str to float
        ``total``, ``metadata`` (specmeta's builds and KV moves), ``attention`` (the
        backend's planning and calls) and ``rest``; filled when the loop was built with
        ``timing=True``.
    """

    index: int
    batch_size: int
    path: str
    padded_batch_size: int
    requests: tuple[NodeRecord, ...]
    status: int
    seconds: dict[str, float]

    @property
    def tokens(self) -> int:
        """Tokens the iteration generated, over the batch."""
        return sum(r.accepted for r in self.requests)


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyAgreement:
    """How a request's output compares with greedy decoding of a reference model.

    Attributes
    ----------
    tokens : int
        Tokens compared.
    mismatches : int
        Tokens that are not the reference's argmax given the output before them, with the
        reference leading the emitted token by at least the margin.
    near_ties : int
        Such tokens within the margin (bf16 kernels against a float32 reference).
    first_mismatch : int or None
        Index of the first mismatch.
    """

    tokens: int
    mismatches: int
    near_ties: int
    first_mismatch: int | None

    @property
    def lossless(self) -> bool:
        return self.mismatches == 0


@torch.no_grad()
def greedy_agreement(req: Request, reference: TinyModel, margin: float = 0.0) -> GreedyAgreement:
    """Whether ``req.output`` is greedy decoding of ``reference``, checked in one dense forward
    over prompt and output: every token must be the argmax given the tokens before it (by
    induction, the output is then exactly the greedy continuation). A token the reference
    leads by less than ``margin`` counts as a near-tie, not a mismatch (``margin=0``: exact).
    """
    P = req.prompt.shape[0]
    seq = torch.cat([req.prompt, torch.tensor(req.output, dtype=torch.int64)])
    logits = reference.logits(seq.to(reference.device))[P - 1 : P - 1 + len(req.output)].double()
    emitted = seq[P:].to(logits.device).view(-1, 1)
    lead = (logits.max(-1).values - logits.gather(1, emitted)[:, 0]).cpu()
    behind = lead > 0
    hard = behind & (lead >= margin)
    first = int(hard.nonzero()[0, 0]) if bool(hard.any()) else None
    return GreedyAgreement(len(req.output), int(hard.sum()), int((behind & ~hard).sum()), first)


# ------------------------------------------------------------------------------------------------
# Tree selection and acceptance
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """The verify tree of every request: node 0 the root, nodes in candidate order.

    Attributes
    ----------
    tokens, parents, depth : torch.Tensor
        ``[B, N]`` int64: token, parent node (−1 for the root) and depth (root 0).
    mask : torch.Tensor
        ``[B, N, N]`` bool, ``mask[i, j, c]`` iff ``c == j`` or ``c`` is an ancestor of ``j``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor


class TreeSelection:
    """EAGLE's draft-tree selection, step by step, batched over requests (as SGLang's EAGLE
    worker: step 0 takes the root's top-``K``; each later step takes every branch's top-``K``
    children and keeps the ``K`` best of the ``K²`` by cumulative log-probability).

    Every proposed candidate is recorded (``K`` at step 0, ``K²`` after), with its score, token
    and parent candidate; :meth:`tree` ranks them all.

    Parameters
    ----------
    root_tokens : torch.Tensor
        ``[B]`` each request's root (its last generated token), node 0 of its tree.
    root_logprobs : torch.Tensor
        ``[B, V]`` the draft's log-probabilities after each root.
    topk : int
        ``K``.
    """

    def __init__(self, root_tokens: torch.Tensor, root_logprobs: torch.Tensor, topk: int):
        B = root_logprobs.shape[0]
        self.K, self.root_tokens = topk, root_tokens
        self.score, tok = root_logprobs.topk(topk, dim=-1)  # [B, K]
        dev = root_logprobs.device
        self.scores, self.tokens = [self.score], [tok]
        self.parents = [torch.full((B, topk), -1, dtype=torch.int64, device=dev)]
        self.branch_tokens = tok  # [B, K]: each branch's newest token
        self.branch_node = torch.arange(topk, device=dev).expand(B, topk)  # their candidate ids
        self.count = topk

    def expand(self, logprobs: torch.Tensor) -> None:
        """One more step from the branches' log-probs ``[B, K, V]``."""
        B, K = logprobs.shape[0], self.K
        child_lp, child_tok = logprobs.topk(K, dim=-1)  # [B, K, K]
        cand = (self.score.unsqueeze(-1) + child_lp).reshape(B, K * K)
        parent = self.branch_node.unsqueeze(-1).expand(B, K, K).reshape(B, K * K)
        self.scores.append(cand)
        self.tokens.append(child_tok.reshape(B, K * K))
        self.parents.append(parent)
        self.score, pick = cand.topk(K, dim=-1)
        self.branch_tokens = child_tok.reshape(B, K * K).gather(1, pick)
        self.branch_node = self.count + pick
        self.count += K * K

    def tree(self, num_nodes: int) -> DraftTree:
        """The ``N − 1`` best candidates and the root. A child never outscores its parent
        (log-probs are ≤ 0) and ties keep candidate order, so every chosen node's parent is
        chosen too."""
        scores, tokens = torch.cat(self.scores, 1), torch.cat(self.tokens, 1)
        parents = torch.cat(self.parents, 1)
        B, dev = scores.shape[0], scores.device
        n = num_nodes - 1
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
        chosen = torch.sort(order, dim=1).values  # [B, N - 1] candidate ids, ascending
        node_of = torch.zeros(B, scores.shape[1] + 1, dtype=torch.int64, device=dev)
        # candidate id c -> node id (c + 1 column; column 0 is "no parent" -> the root)
        node_of.scatter_(1, chosen + 1, torch.arange(1, n + 1, device=dev).expand(B, n))
        tree_tokens = torch.cat([self.root_tokens.view(B, 1), tokens.gather(1, chosen)], 1)
        tree_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev),
                                  node_of.gather(1, parents.gather(1, chosen) + 1)], 1)  # fmt: skip
        mask = torch.eye(num_nodes, dtype=torch.bool, device=dev).repeat(B, 1, 1)
        depth = torch.zeros(B, num_nodes, dtype=torch.int64, device=dev)
        for j in range(1, num_nodes):  # parents precede children: one pass suffices
            p = tree_parents[:, j]
            mask[:, j] |= mask[torch.arange(B, device=dev), p]
            depth[:, j] = depth[torch.arange(B, device=dev), p] + 1
        return DraftTree(tree_tokens, tree_parents, depth, mask)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                  num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Greedy verification: from the root, follow the child whose token is the target's argmax
    at the current node, while there is one.

    Parameters
    ----------
    tokens, parents : torch.Tensor
        ``[B, N]`` the tree (node 0 the root, parent −1).
    logits : torch.Tensor
        ``[B, N, V]`` the target's logits at every node.
    num_steps : int
        ``S``, the deepest a path can go.

    Returns
    -------
    (path, accept_lens, bonus) : tuple of torch.Tensor
        ``path [B, S + 1]`` node ids of the accepted path (root first, then −1),
        ``accept_lens [B]`` its length, ``bonus [B]`` the target's argmax after its last node.
    """
    B, dev = tokens.shape[0], tokens.device
    pred = logits.argmax(-1)  # [B, N]
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, num_steps + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    for d in range(1, num_steps + 1):
        want = pred.gather(1, cur.view(-1, 1))
        match = (parents == cur.view(-1, 1)) & (tokens == want) & alive.view(-1, 1)
        found = match.any(1)
        cur = torch.where(found, match.to(torch.int32).argmax(1), cur)
        path[:, d] = torch.where(found, cur, -1)
        alive &= found
    accept_lens = (path >= 0).sum(1)
    return path, accept_lens, pred.gather(1, cur.view(-1, 1))[:, 0]


def extend_tokens(tree_tokens, path, accept_lens, bonus, num_draft_tokens):
    """``[B, N]``: the accepted draft tokens (the path without its root), the bonus token, then
    padding (0)."""
    B, dev = tree_tokens.shape[0], tree_tokens.device
    N = num_draft_tokens
    on_path = tree_tokens.gather(1, path.clamp_min(0))[:, 1:]  # [B, S]
    out = torch.zeros(B, N, dtype=torch.int64, device=dev)
    w = min(N, on_path.shape[1])
    out[:, :w] = on_path[:, :w]
    k = torch.arange(N, device=dev).view(1, -1)
    out = torch.where(k < (accept_lens - 1).view(-1, 1), out, 0)
    return out.scatter(1, (accept_lens - 1).view(-1, 1), bonus.view(-1, 1))


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------
def boundary_prompt_lengths(count: int, page_size: int, generator: torch.Generator) -> list[int]:
    """``count`` prompt lengths that put the first iteration's target prefix ``L`` and draft
    prefix ``L + 1`` on a page boundary and one short of it: ``L ≡ 0, ps − 1, ps − 2, 1
    (mod ps)`` in turn, one to three pages long, the rest random."""
    if page_size < 1 or count < 0:
        raise ValueError(f"page_size must be >= 1 and count >= 0, got {page_size} and {count}")
    ps = page_size
    out = []
    for i in range(count):
        pages = 1 + int(torch.randint(0, 3, (1,), generator=generator))
        residue = (
            (0, -1, -2, 1)[i % 4] if i < 4 else int(torch.randint(0, ps, (1,), generator=generator))
        )
        out.append(max(1, pages * ps + residue))
    return out


def make_requests(waves: Sequence[Sequence[int]], *, vocab_size: int, page_size: int,
                  max_new_tokens: int, generator: torch.Generator,
                  spread: int = 8) -> list[Request]:  # fmt: skip
    """Requests in waves; ``waves[w]`` lists each request's join delay (iterations after wave
    ``w`` opens). Prompt lengths come from :func:`boundary_prompt_lengths`, prompt tokens at
    random; ``max_new_tokens`` grows by ``spread`` per request of a wave, so requests finish at
    different iterations.

    Examples
    --------
    ``waves=[(0, 0, 0, 0, 0, 2, 2, 2), (0, 0, 0)]``: five requests, three more two iterations
    later, the batch shrinks to 0 as they finish, an idle iteration, then three new ones.
    """
    reqs, rid = [], 0
    for w, delays in enumerate(waves):
        lengths = boundary_prompt_lengths(len(delays), page_size, generator)
        for i, (delay, P) in enumerate(zip(delays, lengths, strict=True)):
            prompt = torch.randint(0, vocab_size, (P,), generator=generator)
            reqs.append(Request(rid, prompt, max_new_tokens + spread * i, wave=w, delay=delay))
            rid += 1
    return reqs


# ------------------------------------------------------------------------------------------------
# Slot allocation
# ------------------------------------------------------------------------------------------------
class SlotAllocator:
    """``req_to_token`` rows and page-aligned KV slots, handed out and taken back.

    Row 0 and page 0 (slots ``0 … ps − 1``) are reserved sinks: never handed out, every unused
    ``req_to_token`` entry points there. Pages come from a shuffled free list, so a request's
    pages are not contiguous and a finished request's pages are reused (stale KV included).

    Parameters
    ----------
    num_rows, row_width : int
        ``req_to_token``'s shape ``[R, W_row]``.
    num_pages, page_size : int
        The KV pool: ``num_pages · page_size`` slots.
    device : torch.device or str
        Where ``req_to_token`` lives (the builders read it there).
    generator : torch.Generator
        Shuffles the free pages.
    """

    def __init__(self, num_rows: int, row_width: int, num_pages: int, page_size: int, device,
                 generator: torch.Generator):  # fmt: skip
        if row_width % page_size:
            raise ValueError(f"row_width={row_width} must be a multiple of page_size={page_size}")
        self.page_size = page_size
        self.req_to_token = torch.zeros(num_rows, row_width, dtype=torch.int32, device=device)
        self.free_rows = list(range(num_rows - 1, 0, -1))
        self.free_pages = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
        self.pages: dict[int, list[int]] = {}

    def alloc_row(self) -> int:
        """A free row (never row 0), with no pages yet."""
        if not self.free_rows:
            raise ValueError("no free req_to_token row: raise max_bs or finish a request first")
        row = self.free_rows.pop()
        self.pages[row] = []
        return row

    def ensure(self, row: int, positions: int) -> None:
        """Map row positions ``[0, positions)`` to pages, allocating the missing ones."""
        ps, have = self.page_size, self.pages[row]
        need = -(-positions // ps)
        if need * ps > self.req_to_token.shape[1]:
            raise ValueError(f"row {row} needs {positions} positions, req_to_token rows hold "
                             f"{self.req_to_token.shape[1]}: raise max_context_len")  # fmt: skip
        if need <= len(have):
            return
        if need - len(have) > len(self.free_pages):
            raise ValueError(f"the KV pool is out of pages ({len(self.free_pages)} free, "
                             f"{need - len(have)} needed): raise pool_size")  # fmt: skip
        new = [self.free_pages.pop() for _ in range(need - len(have))]
        slots = (torch.tensor(new).view(-1, 1) * ps + torch.arange(ps)).view(-1)
        start = len(have) * ps
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.req_to_token)
        have.extend(new)

    def free(self, row: int) -> None:
        """Return the row and its pages; the row points at the sink again."""
        self.free_pages.extend(self.pages.pop(row))
        self.req_to_token[row].zero_()
        self.free_rows.append(row)
