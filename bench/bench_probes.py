"""Cost of the async probes: host time of a disabled call (the budget is 1 µs), and host and
device time of an enabled one."""

from __future__ import annotations

import pytest
import torch

from bench.harness import graph_us, record
from specmeta import probes

N = 1 << 20


def _tensors(n: int):
    x = torch.randn(n, device="cuda")
    idx = torch.arange(n, device="cuda", dtype=torch.int64) * 16
    return {
        "detect_nan": (probes.detect_nan, (x,), {"label": "x"}),
        "detect_inf": (probes.detect_inf, (x,), {"label": "x"}),
        "detect_oob": (probes.detect_oob, (idx, 0, 16 * n), {"label": "idx"}),
        "detect_page_aligned": (probes.detect_page_aligned, (idx, 16), {"label": "idx"}),
    }


PROBES = ("detect_nan", "detect_inf", "detect_oob", "detect_page_aligned")


@pytest.mark.parametrize("probe", PROBES)
def bench_probe_disabled(benchmark, probe):
    fn, args, kwargs = _tensors(N)[probe]
    previous = probes.enable(False)
    try:
        fn(*args, **kwargs)
        benchmark(fn, *args, **kwargs)
    finally:
        probes.enable(previous)
    host_us = 1e6 * benchmark.stats.stats.median
    record(benchmark, device_us=0.0, probe=probe, enabled=False, host_us=round(host_us, 4))
    assert host_us < 1.0, f"a disabled {probe} costs {host_us:.3f} µs of host time (budget 1 µs)"


@pytest.mark.parametrize("n", [4096, N, 1 << 24])
@pytest.mark.parametrize("probe", PROBES)
def bench_probe_enabled(benchmark, probe, n):
    fn, args, kwargs = _tensors(n)[probe]
    previous = probes.enable(True)
    try:
        fn(*args, **kwargs)  # correctness first: clean inputs pass
        torch.cuda.synchronize()
        device_us = graph_us(lambda: fn(*args, **kwargs))
        benchmark.pedantic(lambda: fn(*args, **kwargs), setup=torch.cuda.synchronize, rounds=50,
                           warmup_rounds=3)  # fmt: skip
        torch.cuda.synchronize()
    finally:
        probes.enable(previous)
    nbytes = args[0].numel() * args[0].element_size()
    record(benchmark, device_us=device_us, bytes_moved=nbytes, probe=probe, enabled=True, n=n)
