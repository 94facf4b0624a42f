"""A synthetic EAGLE tree-draft loop with no model, built by specmeta eagerly and through runners.

Each iteration of a batch of requests:

1. **Draft decode.** A draft runner builds the draft KV slots (:func:`assign_draft_cache_locs`),
   the layout-B prefix-tail copy pairs and the page-size-1 draft-decode lists of every step, all
   in one captured graph. The prefix tails are copied with :func:`move_kv_cache`. Then ``S``
   selection steps: random draft probabilities, top-``K`` per branch and top-``K`` of the ``K²``
   candidates per request (EAGLE's tree selection), the chosen tokens' KV written to their
   slots; the ``S − 1`` forwards attend through the lists.
2. **Verify.** A random draft tree of ``N`` nodes (:func:`random_tree_mask`), its window at row
   positions ``L … L + N − 1``, the nodes' KV written there.
3. **Accept.** A random root path of the tree is accepted; an accept runner compacts it into
   ``(tgt, src)`` pairs (:func:`accept_cache_locs`) and :func:`move_kv_cache` moves the accepted
   KV to the front of the window. The request's committed prefix grows by the path.

The "model" is a table: the KV of token ``x`` at position ``p`` in layer ``l`` is
``emb[l, x] + pos[l, p]``, so a test can rebuild every request's logical KV sequence and compare
attention over the metadata with dense attention over that sequence.

Stages still to slot in (their builders are other issues): the FA3 draft-decode and verify
metadata (``specmeta.metadata.fa3``) and the FlashInfer ones (``specmeta.metadata.flashinfer``)
belong in :meth:`Metadata.draft` and in a verify build next to :meth:`Metadata.accept`, each
with its outputs declared in the matching ``*_OUTPUTS`` table.

Run it: ``python examples/draft_loop.py [--device cuda] [--seed N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random

import torch

import specmeta
from specmeta import SpecConfig, allocate_buffers, probes
from specmeta.kernels.cache_loc_move import KVPool, accept_cache_locs, move_kv_cache
from specmeta.kernels.draft_cache_locs import assign_draft_cache_locs, prefix_tail_copy_pairs
from specmeta.kernels.draft_decode_kv_indices import draft_decode_kv_indices
from specmeta.runners import GraphRunner, padding
from specmeta.workloads import make_batch, random_tree_mask

__all__ = ["LoopShape", "Model", "Metadata", "Request", "DraftLoop", "next_requests", "sequence"]

SEQUENCE = (32, 12, 3, 1, 0, 32)
"""The issue's batch sizes: shrink to an idle rank (0), then a full batch of new requests."""


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """The synthetic model's sizes."""

    heads: int = 2
    head_dim: int = 8
    layers: int = 2
    vocab: int = 50
    iterations: int = len(SEQUENCE)


class Model:
    """KV pool (K and V of every layer, ``[P, H, D]`` float32) and the table the KV comes from."""

    def __init__(self, shape: LoopShape, pool_size: int, max_pos: int, device, gen):
        def rand(*size):
            return torch.randn(*size, generator=gen).to(device)

        L, H, D = shape.layers, shape.heads, shape.head_dim
        self.shape = shape
        self.emb_k, self.emb_v = rand(L, shape.vocab, H, D), rand(L, shape.vocab, H, D)
        self.pos_k, self.pos_v = rand(L, max_pos, H, D), rand(L, max_pos, H, D)
        self.k = [torch.zeros(pool_size, H, D, device=device) for _ in range(L)]
        self.v = [torch.zeros(pool_size, H, D, device=device) for _ in range(L)]
        self.pool = KVPool([*self.k, *self.v])  # one move_kv_cache launch for every layer

    def kv(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Per layer ``(k, v)`` of ``tokens`` at ``positions`` (same shape) → ``[*, H, D]``."""
        t, p = tokens.long(), positions.long()
        return [(self.emb_k[i][t] + self.pos_k[i][p], self.emb_v[i][t] + self.pos_v[i][p])
                for i in range(self.shape.layers)]  # fmt: skip

    def write(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the KV of ``tokens`` at ``positions`` into pool ``slots`` (the forward's write)."""
        for layer, (k, v) in enumerate(self.kv(tokens, positions)):
            self.k[layer][slots.reshape(-1)] = k.reshape(-1, *k.shape[-2:])
            self.v[layer][slots.reshape(-1)] = v.reshape(-1, *v.shape[-2:])


class Metadata:
    """Every planned buffer of one iteration and the builds that fill them: the same functions
    run eagerly and inside the runners' graphs.

    With a ``kv_pool`` the builds also move KV (the layout-B prefix tails, the accepted nodes)
    inside the same launch sequence, so a graph holds the whole stage and the move's pair count
    is the bucket's, fixed at capture. Without one (the eager comparison) they only build.
    """

    @staticmethod
    def outputs(stage: str, cfg: SpecConfig) -> dict[str, tuple[str, int | None, int, int]]:
        """``name: (planned buffer, per_request, extra, dim)`` of each output of ``stage``; the
        last three are :meth:`GraphRunner.add_output`'s cut to ``B``."""
        pairs = (cfg.topk - 1) * (cfg.page_size - 1) if cfg.layout_b else 0
        if stage == "draft":
            return {
                "out_cache_loc": ("draft.out_cache_loc", cfg.topk * cfg.num_steps, 0, 0),
                "positions": ("draft.positions", cfg.topk, 0, 0),
                "prefix_tail_tgt": ("draft.prefix_tail_tgt", pairs, 0, 0),
                "prefix_tail_src": ("draft.prefix_tail_src", pairs, 0, 0),
                "kv_indptr": ("draft_decode.kv_indptr", cfg.topk, 1, 1),
                "kv_indices": ("draft_decode.kv_indices", None, 0, 0),
            }
        if stage == "accept":
            c = cfg.num_steps + 1
            return {
                "tgt": ("verify.tgt_cache_loc", c, 0, 0),
                "src": ("verify.src_cache_loc", c, 0, 0),
            }
        raise ValueError(f"unknown stage {stage!r}")

    def _outputs(self, stage: str) -> dict[str, torch.Tensor]:
        return {name: self.bufs[key] for name, (key, *_) in self.outputs(stage, self.cfg).items()}

    def __init__(self, cfg: SpecConfig, device, req_to_token: torch.Tensor,
                 kv_pool: KVPool | None = None):  # fmt: skip
        self.cfg = cfg
        self.bufs = allocate_buffers(cfg, device)
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool

    @property
    def status(self) -> torch.Tensor:
        return self.bufs["status"]

    def draft(self, inp) -> dict[str, torch.Tensor]:
        """Draft-decode metadata of every step from ``req_pool_indices`` and ``seq_lens``."""
        c, b = self.cfg, self.bufs
        args = (inp["req_pool_indices"], self.req_to_token, inp["seq_lens"])
        kw = dict(topk=c.topk, num_steps=c.num_steps, page_size=c.page_size, status=b["status"])
        assign_draft_cache_locs(*args, out_cache_loc=b["draft.out_cache_loc"],
                                positions=b["draft.positions"], **kw)  # fmt: skip
        tgt, src = prefix_tail_copy_pairs(*args, tgt=b["draft.prefix_tail_tgt"],
                                          src=b["draft.prefix_tail_src"], **kw)  # fmt: skip
        if self.kv_pool is not None and c.layout_b:
            # Each prefix tail into branches 1 … K−1, before any page-granular reader; unused
            # pairs are (0, 0) self-moves of the sink. Targets sit past L, sources before it.
            n = self.outputs("draft", c)["prefix_tail_tgt"][1] * inp["seq_lens"].shape[0]
            move_kv_cache(self.kv_pool, tgt[:n], src[:n], disjoint=True, status=b["status"])
        draft_decode_kv_indices(*args, kv_indices=b["draft_decode.kv_indices"],
                                kv_indptr=b["draft_decode.kv_indptr"], **kw)  # fmt: skip
        return self._outputs("draft")

    def draft_host(self, mirrors) -> dict[str, object]:
        """Host scalars of the padded batch; a too-small plan fails here, before any launch."""
        seq_lens = mirrors["seq_lens"]
        total, bp = int(seq_lens.sum()), seq_lens.shape[0]
        need = specmeta.config.draft_decode_kv_indices_need(
            total, bp, self.cfg.topk, self.cfg.num_steps
        )
        have = self.bufs["draft_decode.kv_indices"].shape[1]
        if need > have:
            raise ValueError(f"draft_decode.kv_indices is too small: need {need}, have {have}")
        return {"seq_lens_sum": total}

    def accept(self, inp) -> dict[str, torch.Tensor]:
        """Move pairs of the accepted nodes (SPEC §2.4)."""
        b = self.bufs
        tgt, src = accept_cache_locs(inp["accept_index"], inp["accept_lens"],
                                     inp["verify_out_cache_loc"],
                                     num_draft_tokens=self.cfg.num_draft_tokens,
                                     tgt=b["verify.tgt_cache_loc"], src=b["verify.src_cache_loc"],
                                     status=b["status"])  # fmt: skip
        if self.kv_pool is not None:
            # The accepted KV to the front of each verify window (pairs may chain: the move
            # reads every source before it writes a target).
            move_kv_cache(self.kv_pool, tgt, src, status=b["status"])
        return self._outputs("accept")


@dataclasses.dataclass
class Request:
    """One request's row and its logical KV sequence (per layer, ``[L, H, D]``)."""

    row: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[0])


@dataclasses.dataclass
class DraftResult:
    seq_lens: list[int]  # L_b at draft time (the committed prefix the branches attend to)
    out_cache_loc: torch.Tensor  # [B, K, S]
    tokens: torch.Tensor  # [B, K, S] chosen draft tokens
    queries: list[torch.Tensor]  # per forward step s < S-1: [B*K, H, D]
    attention: list[torch.Tensor]  # per forward step: the consumer's output over the lists
    kv_indptr: torch.Tensor  # [S, B*K + 1]
    kv_indices: torch.Tensor  # [S, W]
    eager: dict[str, torch.Tensor]
    runner: dict[str, torch.Tensor]


@dataclasses.dataclass
class VerifyResult:
    tree_mask: torch.Tensor  # [B, N, N]
    tokens: torch.Tensor  # [B, N]
    window: torch.Tensor  # [B*N] verify-window slots
    depth: torch.Tensor  # [B, N]


@dataclasses.dataclass
class AcceptResult:
    accept_index: torch.Tensor  # [B, S+1]
    accept_lens: torch.Tensor  # [B]
    paths: list[list[int]]
    eager: dict[str, torch.Tensor]
    runner: dict[str, torch.Tensor]


class DraftLoop:
    """The loop's state: config, model, static tables, metadata (runner and eager) and runners.

    Parameters
    ----------
    cfg : SpecConfig
        ``max_bs`` is the largest bucket; ``max_context_len`` bounds every request, growth by
        accepted tokens included.
    buckets : sequence of int
        The runners' captured batch sizes.
    attend : callable
        The page-size-1 consumer of a draft forward:
        ``attend(q [T, H, D], k_cache, v_cache, kv_indptr [T + 1], kv_indices) → [T, H, D]``,
        run on layer 0's cache right after the step's KV is written.
    poison : callable, optional
        ``poison(stage, runner, metadata, B, Bp)``, called before every runner call (tests
        fill the padding tails and the stage's outputs with garbage there).
    """

    def __init__(self, cfg: SpecConfig, shape: LoopShape, buckets, device, gen, attend,
                 poison=None, num_rows: int | None = None):  # fmt: skip
        self.cfg, self.shape, self.device, self.gen = cfg, shape, torch.device(device), gen
        self.attend, self.poison = attend, poison
        self.num_rows = num_rows or cfg.max_bs + 3
        first = self._draw_batch(cfg.max_bs)
        self.req_to_token = first.req_to_token.clone()  # persistent: the graphs read it
        self.pool_size = first.pool_size
        self.model = Model(shape, self.pool_size, cfg.req_to_token_width, device, gen)
        # Written by the runners, whose graphs also move the KV; the eager twin only builds.
        self.meta = Metadata(cfg, device, self.req_to_token, self.model.pool)
        self.eager = Metadata(cfg, device, self.req_to_token)  # the eager build on raw inputs
        self.fill = padding.seq_lens_fill(cfg.topk, cfg.num_draft_tokens)
        self.runners = self._runners(buckets)
        self._first = first

    # ----------------------------------------------------------------------------------------
    # Set-up
    # ----------------------------------------------------------------------------------------
    def _draw_batch(self, B: int):
        c = self.cfg
        # Leave room for every iteration's accepted tokens (at most S + 1 each).
        room = c.max_context_len - self.shape.iterations * (c.num_steps + 1)
        return make_batch("random", batch_size=B, topk=c.topk, num_steps=c.num_steps,
                          page_size=c.page_size, row_width=c.req_to_token_width,
                          generator=self.gen, device=self.device, num_rows=self.num_rows,
                          max_len=max(room, 0))  # fmt: skip

    def _runners(self, buckets) -> dict[str, GraphRunner]:
        c, m, b = self.cfg, self.meta, self.meta.bufs
        rows = self.req_to_token.shape[0]
        draft = GraphRunner(m.draft, batch_sizes=buckets, device=self.device, host=m.draft_host)
        draft.add_input("req_pool_indices", b["runner.req_pool_indices"], pad=padding.SINK_ROW,
                        probe=functools.partial(probes.detect_oob, lo=1, hi=rows))  # fmt: skip
        draft.add_input("seq_lens", b["runner.seq_lens"], pad=self.fill, host_mirror=True,
                        probe=functools.partial(probes.detect_oob, lo=0,
                                                hi=c.max_context_len + 1))  # fmt: skip
        for name, (_, per, extra, dim) in Metadata.outputs("draft", c).items():
            draft.add_output(name, per_request=per, extra=extra, dim=dim)

        accept = GraphRunner(m.accept, batch_sizes=buckets, device=self.device)
        window = c.max_bs * c.num_draft_tokens
        accept.add_input("accept_index", b["runner.accept_index"], pad=padding.NO_ACCEPT,
                         probe=functools.partial(probes.detect_oob, lo=-1, hi=window))  # fmt: skip
        accept.add_input("accept_lens", b["runner.accept_lens"], pad=padding.NOTHING_ACCEPTED,
                         probe=functools.partial(probes.detect_oob, lo=0,
                                                 hi=c.num_steps + 2))  # fmt: skip
        accept.add_input("verify_out_cache_loc", b["runner.verify_out_cache_loc"],
                         pad=padding.SINK_SLOT, per_request=c.num_draft_tokens,
                         probe=functools.partial(probes.detect_oob, lo=0,
                                                 hi=self.pool_size))  # fmt: skip
        for name, (_, per, extra, dim) in Metadata.outputs("accept", c).items():
            accept.add_output(name, per_request=per, extra=extra, dim=dim)
        for r in (draft, accept):
            r.capture()
        return {"draft": draft, "accept": accept}

    def new_requests(self, B: int) -> list[Request]:
        """``B`` new requests on fresh rows: a new table, their prefixes' KV written."""
        batch = self._first if self._first is not None else self._draw_batch(B)
        self._first = None
        batch_rows = batch.req_pool_indices.tolist()[:B]
        self.req_to_token.copy_(batch.req_to_token)
        reqs = []
        for row, length in zip(batch_rows, batch.seq_lens_cpu.tolist()[:B], strict=True):
            tokens = torch.randint(0, self.shape.vocab, (length,), generator=self.gen)
            pos = torch.arange(length)
            kv = self.model.kv(tokens.to(self.device), pos.to(self.device))
            self.model.write(self.req_to_token[row, :length].long(), tokens.to(self.device),
                             pos.to(self.device))  # fmt: skip
            reqs.append(Request(row, [k for k, _ in kv], [v for _, v in kv]))
        return reqs

    # ----------------------------------------------------------------------------------------
    # Stages
    # ----------------------------------------------------------------------------------------
    def _run(self, name: str, B: int, inputs, host_inputs=None):
        runner = self.runners[name]
        meta = self.meta
        if self.poison is not None:
            self.poison(name, runner, meta, B, runner.bucket(B))
        res = runner.run(B, inputs, host_inputs=host_inputs, copy=False)
        build = getattr(self.eager, name)
        eager = build(inputs)
        return res, eager

    def draft(self, reqs: list[Request]) -> DraftResult:
        c, dev, g = self.cfg, self.device, self.gen
        B, K, S, V = len(reqs), c.topk, c.num_steps, self.shape.vocab
        rpi = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        seq_lens = torch.tensor([r.length for r in reqs], dtype=torch.int64)
        inputs = {"req_pool_indices": rpi.to(dev), "seq_lens": seq_lens.to(dev)}
        res, eager = self._run("draft", B, inputs, {"seq_lens": seq_lens})
        out = res.outputs
        slots = out["out_cache_loc"].view(B, K, S)
        first_pos = out["positions"].view(B, K)
        # Selection: top-K of the root, then top-K of the K² children of the K branches.
        probs = torch.softmax(torch.randn(B, V, generator=g), -1).to(dev)
        probes.detect_nan(probs, label="draft probs")
        score, tok = probs.topk(K, dim=-1)
        tokens = torch.zeros(B, K, S, dtype=torch.int64, device=dev)
        queries, attention = [], []
        H, D = self.shape.heads, self.shape.head_dim
        for j in range(S):
            probes.detect_oob(tok, 0, V, label="draft token ids")
            tokens[:, :, j] = tok
            self.model.write(slots[:, :, j], tok, first_pos + j)
            if j == S - 1:
                break
            # The forward of step j: every branch attends to its prefix and chain 0 … j.
            q = torch.randn(B * K, H, D, generator=g).to(dev)
            queries.append(q)
            attention.append(self.attend(q, self.model.k[0], self.model.v[0],
                                         out["kv_indptr"][j], out["kv_indices"][j]))  # fmt: skip
            child = torch.softmax(torch.randn(B, K, V, generator=g), -1).to(dev)
            probes.detect_nan(child, label="draft probs")
            p, t = child.topk(K, dim=-1)  # [B, K, K]
            cand = (score.unsqueeze(-1) * p).view(B, K * K)
            score, pick = cand.topk(K, dim=-1)
            tok = t.view(B, K * K).gather(1, pick)
        return DraftResult(seq_lens.tolist(), slots, tokens, queries, attention,
                           out["kv_indptr"], out["kv_indices"], eager, out)  # fmt: skip

    def verify(self, reqs: list[Request]) -> VerifyResult:
        c, dev = self.cfg, self.device
        B, N = len(reqs), c.num_draft_tokens
        mask = random_tree_mask(B, c.topk, c.num_steps, N, self.gen).to(dev)
        depth = mask.sum(-1) - 1
        lengths = torch.tensor([r.length for r in reqs], dtype=torch.int64, device=dev)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev)
        pos = lengths.view(-1, 1) + torch.arange(N, device=dev)  # the window: row positions L + j
        window = self.req_to_token[rows.view(-1, 1), pos].long().reshape(-1)
        tokens = torch.randint(0, self.shape.vocab, (B, N), generator=self.gen).to(dev)
        self.model.write(window, tokens, lengths.view(-1, 1) + depth)
        return VerifyResult(mask, tokens, window, depth)

    def accept(self, reqs: list[Request], ver: VerifyResult) -> AcceptResult:
        c, dev = self.cfg, self.device
        B, N, C = len(reqs), c.num_draft_tokens, c.num_steps + 1
        mask = ver.tree_mask.cpu()
        depth = ver.depth.cpu()
        rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        paths = []
        index = torch.full((B, C), -1, dtype=torch.int32)
        for i in range(B):
            path = [0]
            while True:
                here = path[-1]
                kids = [
                    j for j in range(N) if mask[i, j, here] and depth[i, j] == depth[i, here] + 1
                ]
                if not kids or rng.random() < 0.3:
                    break
                path.append(rng.choice(kids))
            paths.append(path)
            index[i, : len(path)] = torch.tensor(path, dtype=torch.int32) + i * N
        lens = torch.tensor([len(p) for p in paths], dtype=torch.int32)
        inputs = {"accept_index": index.to(dev), "accept_lens": lens.to(dev),
                  "verify_out_cache_loc": ver.window}  # fmt: skip
        res, eager = self._run("accept", B, inputs)  # the runner's build moved the KV
        # Commit: the accepted nodes' KV now sits at positions L … L + acc − 1.
        for i, (r, path) in enumerate(zip(reqs, paths, strict=True)):
            node = torch.tensor(path, device=dev)
            kv = self.model.kv(ver.tokens[i, node], r.length + depth[i, path].to(dev))
            r.keys = [torch.cat([k0, k]) for k0, (k, _) in zip(r.keys, kv, strict=True)]
            r.values = [torch.cat([v0, v]) for v0, (_, v) in zip(r.values, kv, strict=True)]
        return AcceptResult(index, lens, paths, eager, res.outputs)


def next_requests(loop: DraftLoop, reqs: list[Request], B: int) -> list[Request]:
    """The batch of the next iteration: the first ``B`` requests go on (the others finished);
    after an idle iteration a full batch of new requests arrives."""
    if B == 0:
        return []
    return reqs[:B] if B <= len(reqs) else loop.new_requests(B)


def sequence(loop: DraftLoop, sizes=SEQUENCE):
    """Yield ``(reqs, draft, verify, accept)`` per iteration over the batch ``sizes``."""
    reqs: list[Request] = []
    for B in sizes:
        reqs = next_requests(loop, reqs, B)
        d = loop.draft(reqs)
        v = loop.verify(reqs)
        a = loop.accept(reqs, v)
        yield reqs, d, v, a


# --------------------------------------------------------------------------------------------
# The script
# --------------------------------------------------------------------------------------------
def _attention(q, k, v, lists):
    """Plain softmax attention of row ``i`` of ``q`` over rows ``lists[i]`` of ``k``/``v``."""
    out = []
    for i, idx in enumerate(lists):
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k[idx].double()) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v[idx].double()))
    return torch.stack(out) if out else q.new_zeros(0, *q.shape[1:]).double()


def csr_attention(q, k_cache, v_cache, kv_indptr, kv_indices):
    """A page-size-1 paged consumer: row ``i`` reads ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]``."""
    ptr, idx = kv_indptr.long().tolist(), kv_indices.long()
    return _attention(q, k_cache, v_cache, [idx[ptr[i] : ptr[i + 1]] for i in range(q.shape[0])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=4, page_size=4, max_bs=32,
                     max_context_len=40)  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    loop = DraftLoop(cfg, LoopShape(), (1, 4, 16, 32), args.device, gen, csr_attention)
    K = cfg.topk
    for reqs, d, _, a in sequence(loop):
        B = len(reqs)
        worst = 0.0
        for s, (q, got) in enumerate(zip(d.queries, d.attention, strict=True)):
            # Dense truth: the logical prefix plus the branch's own chain, from the table.
            want = []
            for z in range(B * K):
                b, t = divmod(z, K)
                L = d.seq_lens[b]
                pos = L + torch.arange(s + 1, device=loop.device)
                chain_k, chain_v = loop.model.kv(d.tokens[b, t, : s + 1], pos)[0]
                keys = torch.cat([reqs[b].keys[0][:L], chain_k])
                vals = torch.cat([reqs[b].values[0][:L], chain_v])
                want.append(_attention(q[z : z + 1], keys, vals, [torch.arange(len(keys))]))
            if want:
                worst = max(worst, float((got - torch.cat(want)).abs().max()))
        specmeta.check_status(loop.meta.status, where=f"B={B}")
        accepted = sum(len(p) for p in a.paths)
        print(f"B={B:2d} bucket={loop.runners['draft'].bucket(B):2d} accepted={accepted:3d} "
              f"max |attention - dense| = {worst:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
