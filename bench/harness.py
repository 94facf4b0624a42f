"""How benchmarks measure the device (style §14).

Device time is the median over CUDA-graph replays (``triton.testing.do_bench_cudagraph``), so
launch gaps between Python calls do not count; the ceilings it is compared with — the device's
copy bandwidth and the launch floor of an empty kernel in a graph — are measured in the same
run, on the same GPU. Host time of a launcher is pytest-benchmark's own figure; a host target
is judged on :func:`paired_host_us`, the call and its floors timed in alternating rounds.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specmeta.runners import collector_off


def graph_us(fn, *, rep_ms: int = 100) -> float:
    """Median device µs of one ``fn()`` call, from replays of a CUDA graph of repeated calls."""
    fn()  # warm-up: compile, autotune and allocate outside the graph
    torch.cuda.synchronize()
    with collector_off():  # its captures, as GraphRunner.capture's
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@functools.lru_cache(maxsize=1)
def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth by the multiprocessors, counting bytes read plus bytes
    written (GB/s). A plain ``dst.copy_(src)`` captured in a graph becomes a memcpy node that
    the copy engines serve, about a third slower on an H200, so it would flatter every ratio;
    a streaming Triton copy is the ceiling our kernels actually compete with."""
    n = nbytes // 4
    src = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    block = 8192
    us = graph_us(
        lambda: _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=8)
    )
    if not torch.equal(src, dst):
        raise RuntimeError("copy-bandwidth kernel copied wrongly")
    return 2 * nbytes / (us * 1e-6) / 1e9


@functools.lru_cache(maxsize=1)
def write_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device write-only bandwidth (a fill), GB/s: the ceiling of kernels that mostly write."""
    dst = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
    us = graph_us(lambda: dst.fill_(7))
    return nbytes / (us * 1e-6) / 1e9


@triton.jit
def _empty_kernel(ptr):
    tl.store(ptr, 1)


@functools.lru_cache(maxsize=1)
def launch_floor_us() -> float:
    """Device µs of the smallest kernel in a graph: the floor under any one launch."""
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    return graph_us(lambda: _empty_kernel[(1,)](buf))


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def record(benchmark, *, device_us: float, bytes_moved: int = 0, **extra) -> None:
    """Store the device figures in pytest-benchmark's ``extra_info``: µs, MB, GB/s and the
    share of the copy bandwidth and the launch floor measured in this run."""
    info = benchmark.extra_info
    info.update(device_info())
    info["device_us"] = round(device_us, 3)
    info["launch_floor_us"] = round(launch_floor_us(), 3)
    info.update(host_floors())
    if bytes_moved:
        gbs = bytes_moved / (device_us * 1e-6) / 1e9
        bw = copy_bandwidth_gbs()
        info["MB"] = round(bytes_moved / 1e6, 3)
        info["GB/s"] = round(gbs, 1)
        info["copy_GB/s"] = round(bw, 1)
        info["pct_copy_bw"] = round(100 * gbs / bw, 1)
        info["write_GB/s"] = round(write_bandwidth_gbs(), 1)
    info.update(extra)


# --------------------------------------------------------------------------------------------
# Host floors (design §2.8): what one launch of an empty kernel costs the host, three ways.
# --------------------------------------------------------------------------------------------
def _empty_kernel_with(pointers: int, ints: int):
    """An empty ``@triton.jit`` kernel with ``pointers`` pointer and ``ints`` integer arguments
    (written to a file: Triton reads a kernel's source)."""
    import importlib.util
    import pathlib
    import tempfile

    names = [f"p{i}" for i in range(pointers)] + [f"n{i}" for i in range(ints)]
    src = (
        "import triton\nimport triton.language as tl\n\n\n"
        f"@triton.jit(do_not_specialize={[f'n{i}' for i in range(ints)]!r})\n"
        f"def empty({', '.join(names)}):\n"
        "    tl.store(p0 + tl.program_id(0) * 0, 1)\n"
    )
    path = pathlib.Path(tempfile.mkdtemp()) / f"_empty_{pointers}_{ints}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.empty


def host_us(fn, *, calls: int = 2000, repeats: int = 5) -> float:
    """Median host µs per call of ``fn()`` called back to back (the device keeps up: each call's
    device work is far shorter than its host time)."""
    import statistics
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(1e6 * (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


@functools.cache
def floor_calls(pointers: int, ints: int) -> dict:
    """The three floor launches of an empty kernel with this many pointer and integer
    arguments, as callables (see :func:`host_floors`)."""
    kernel = _empty_kernel_with(pointers, ints)
    buf = torch.zeros(16, dtype=torch.int32, device="cuda")
    args = [buf] * pointers + [7] * ints
    compiled = kernel[(1,)](*args)
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    device = torch.cuda.current_device()

    def direct():
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(1, 1, 1, stream, function, metadata, None, None, None, *args)

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel[(1,)](*args)
        with collector_off(), torch.cuda.graph(graph, stream=stream):
            kernel[(1,)](*args)
    torch.cuda.synchronize()
    return {"floor_jit": lambda: kernel[(1,)](*args), "floor_run": direct,
            "floor_graph": graph.replay}  # fmt: skip


@functools.cache
def host_floors(pointers: int = 8, ints: int = 12) -> dict:
    """``floor_jit``, ``floor_run`` and ``floor_graph`` (host µs) of an empty kernel with this
    many pointer and integer arguments, measured now:

    * ``floor_jit``: ``kernel[grid](*args)``, Triton's usual launch;
    * ``floor_run``: the compiled handle, ``CompiledKernel.run`` with its metadata packed once
      and the raw stream fetched by one C call;
    * ``floor_graph``: a bare CUDA graph replay of one such launch.
    """
    floors = {name: round(host_us(fn), 2) for name, fn in floor_calls(pointers, ints).items()}
    return {**floors, "floor_args": f"{pointers}p+{ints}i"}


def alternating_us(fns: dict, *, rounds: int = 15, calls: int = 200) -> dict:
    """Median host µs per call of each of ``fns`` (name -> callable), timed in alternating
    rounds of ``calls`` back-to-back calls: a host whose speed drifts during a run moves them
    all together, so their ratios hold."""
    import statistics
    import time

    for f in fns.values():
        for _ in range(50):
            f()
    torch.cuda.synchronize()
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append(1e6 * (time.perf_counter() - start) / calls)
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def paired_host_us(fn, pointers: int = 8, ints: int = 12, *, rounds: int = 15,
                   calls: int = 200) -> dict:  # fmt: skip
    """``host_paired_us`` of ``fn()`` and the ``floor_run`` and ``floor_graph`` of an empty kernel
    with this many arguments, timed in alternating rounds (:func:`alternating_us`).
    ``floor_jit`` comes from :func:`host_floors`."""
    timed = {"host_paired_us": fn, **{k: v for k, v in floor_calls(pointers, ints).items()
                               if k != "floor_jit"}}  # fmt: skip
    medians = alternating_us(timed, rounds=rounds, calls=calls)
    out = {name: round(t, 2) for name, t in medians.items()}
    out["floor_jit"] = host_floors(pointers, ints)["floor_jit"]
    out["floor_args"] = f"{pointers}p+{ints}i"
    return out
