"""Speculative decoding of a tiny real model, every piece of attention metadata from specmeta.

The loop an engine runs (:class:`specmeta.testing.spec_loop.SpeculativeLoop`): requests join
and finish (the batch grows, drains to an idle iteration, refills); each iteration drafts an
EAGLE tree with the draft model (draft decode), verifies it with the target model (target
verify, greedy acceptance), moves the accepted KV (accept) and runs the draft over the accepted
tokens (draft extend). Every decode-time forward reads its keys through one backend's metadata:
on the CPU the torch models of the attention kernels, on the GPU the real kernels
(FlashAttention's CuTe kernels for FA3 metadata, FlashInfer's wrappers for FlashInfer metadata)
in bf16. Batches that fit a bucket go through the CUDA-graph runners, larger ones run eagerly.

It prints the accepted length of every request in every iteration and, at the end, whether the
output equals plain greedy decoding of the target ("lossless: yes"), and exits 0 if so.

Run it: ``python examples/speculative_loop.py [--backend fa3|flashinfer|trtllm_mla]
[--device cuda] [--draft perturbed|self] [--seed N]`` (on the CPU the kernels run in Triton's
interpreter, switched on below before Triton is imported).
"""

from __future__ import annotations

import argparse
import sys

import torch

from specmeta.testing.script_device import parse_device  # noqa: E402

if __name__ == "__main__":
    parse_device(__file__)  # before the imports below: they import Triton

from specmeta import SpecConfig  # noqa: E402
from specmeta.testing.attention import (  # noqa: E402
    CuteFlashAttention,
    FlashInferAttention,
    TorchAttention,
)
from specmeta.testing.spec_loop import (  # noqa: E402
    SpeculativeLoop,
    greedy_agreement,
    make_requests,
)
from specmeta.testing.tiny_model import DEFAULT_MARGIN, TinyConfig, TinyModel  # noqa: E402

# Per backend: topk, draft steps, verify-window width (tree nodes, root included). TRT-LLM MLA
# has no custom mask: it verifies chains (topk = 1).
SHAPES = {"fa3": (2, 3, 6), "flashinfer": (2, 3, 6), "trtllm_mla": (1, 3, 4)}


def attention_backend(backend: str, model_cfg: TinyConfig, page_size: int,
                      device: torch.device):  # fmt: skip
    """The attention that reads the builder's metadata: torch models of the kernels on the CPU,
    the real kernels on the GPU (TRT-LLM MLA: the torch model there too)."""
    if device.type != "cuda" or backend == "trtllm_mla":
        return TorchAttention(page_size=page_size)
    if backend == "fa3":
        return CuteFlashAttention()
    return FlashInferAttention(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim,
                               dtype=torch.bfloat16, device=device)  # fmt: skip


def main(argv=None) -> int:
    device = parse_device(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(SHAPES), default="fa3")
    parser.add_argument("--device", default=str(device))
    parser.add_argument("--draft", choices=("perturbed", "self"), default="perturbed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a request, at least")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gpu = device.type == "cuda"

    # The models: float64 on the CPU; bf16 with head_dim 128 on the GPU (what the kernels take).
    model_cfg = TinyConfig(hidden_size=256, head_dim=128, intermediate_size=512) if gpu \
        else TinyConfig()  # fmt: skip
    dtype = torch.bfloat16 if gpu else torch.float64
    target = TinyModel.random(model_cfg, args.seed, dtype=dtype, device=device)
    draft = target if args.draft == "self" else target.perturbed(0.1, seed=args.seed + 1)

    # Requests: three, then (after the batch drained and one idle iteration) two more.
    gen = torch.Generator().manual_seed(args.seed)
    requests = make_requests([(0, 0, 1), (0, 0)], vocab_size=model_cfg.vocab_size,
                             page_size=args.page_size, max_new_tokens=args.tokens,
                             generator=gen)  # fmt: skip
    longest = max(r.prompt.shape[0] + r.max_new_tokens for r in requests)

    # The speculative config, its planned buffers (inside the loop) and the loop itself.
    topk, steps, width = SHAPES[args.backend]
    cfg = SpecConfig(topk=topk, num_steps=steps, num_draft_tokens=width,
                     page_size=args.page_size, max_bs=3, max_context_len=longest)  # fmt: skip
    attention = attention_backend(args.backend, model_cfg, args.page_size, device)
    loop = SpeculativeLoop(cfg, target, draft, backend=args.backend, attention=attention,
                           mode="auto", buckets=(1, 2), timing=gpu)  # fmt: skip
    layout = "B" if cfg.layout_b else "A"
    print(
        f"{args.backend} on {device} ({attention.name}): topk={topk}, {steps} steps, "
        f"{width}-node trees, page size {args.page_size} (slot layout {layout}), "
        f"draft = {'the target itself' if args.draft == 'self' else 'a perturbed copy'}"
    )

    print(f"{'iter':>4} {'B':>2} {'path':<5}  accepted per request (root included)")
    for it in loop.iterate(requests):
        accepted = " ".join(f"{r.rid}:{r.accepted}" for r in it.requests) or "(idle)"
        line = f"{it.index:>4} {it.batch_size:>2} {it.path:<5}  {accepted}"
        if it.seconds:
            ms = {k: 1e3 * v for k, v in it.seconds.items()}
            line += (f"   {ms['total']:.2f} ms: metadata {ms['metadata']:.2f}, attention "
                     f"{ms['attention']:.2f}, rest {ms['rest']:.2f}")  # fmt: skip
        print(line)

    # Lossless: every output equals greedy decoding of the target (float32 on the GPU, where a
    # bf16 near-tie may go either way and is counted, not failed).
    reference = target.to(dtype=torch.float32) if gpu else target
    margin = DEFAULT_MARGIN if gpu else 0.0
    results = [greedy_agreement(r, reference, margin) for r in requests]
    for r, res in zip(requests, results, strict=True):
        note = f", {res.near_ties} near-ties" if res.near_ties else ""
        print(
            f"request {r.rid}: prompt {r.prompt.shape[0]}, {res.tokens} tokens, greedy: "
            f"{'yes' if res.lossless else f'no (first at token {res.first_mismatch})'}{note}"
        )
    ok = all(res.lossless for res in results)
    print(f"lossless: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
