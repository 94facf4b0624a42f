"""The device cost of the ``seq_lens_cpu`` check in a draft-decode stage (GPU).

Usage: ``python3 scripts/check_cost.py``. For FlashInfer's and FA3's draft-decode stages at
``B = 64, K = 8`` and ``B = 1, K = 4`` (``S = 5``, page size 16), the CUDA-event time a graph
replay of 300 back-to-back replays takes, for the whole stage, for the stage without its last
launch (the check, ``kernels/host_lengths.py``) and for the check alone. Prints JSON.
"""

from __future__ import annotations

import json

import torch

from specmeta import SpecConfig
from specmeta.kernels import assign_draft_cache_locs
from specmeta.metadata.fa3 import FA3MetadataBuilder
from specmeta.metadata.flashinfer import FlashInferBuilder
from specmeta.stage import Stage
from specmeta.workloads import make_batch


def device_us(fn, replays: int = 300) -> float:
    """Device µs a replay of a graph that captured ``fn()`` (after a warm-up call)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        fn()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / replays, 2)


def main() -> None:
    out = {}
    for bs, k in ((64, 8), (1, 4)):
        cfg = SpecConfig(topk=k, num_steps=5, num_draft_tokens=16, page_size=16, max_bs=bs,
                         max_context_len=4096)  # fmt: skip
        batch = make_batch("random", batch_size=bs, topk=k, num_steps=5, page_size=16,
                           row_width=cfg.req_to_token_width, device="cuda", extra_tokens=16,
                           generator=torch.Generator().manual_seed(1), max_len=4096)  # fmt: skip
        t = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
        slots = assign_draft_cache_locs(*t, topk=k, num_steps=5, page_size=16)
        stages = {"flashinfer": FlashInferBuilder(cfg, "cuda").bind_draft_decode(*t),
                  "fa3": FA3MetadataBuilder(cfg, "cuda").bind_draft_decode(*t, slots)}  # fmt: skip
        for name, stage in stages.items():
            stage.host(batch.seq_lens_cpu)
            out[f"{name} B={bs} stage"] = device_us(stage.launch)
            out[f"{name} B={bs} without check"] = device_us(Stage(stage.launches[:-1]).launch)
            out[f"{name} B={bs} check alone"] = device_us(Stage(stage.launches[-1:]).launch)
    print(json.dumps(out, indent=0))


if __name__ == "__main__":
    main()
