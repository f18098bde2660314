"""GPU timing shared by the benchmarks."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's return value in the capture): fn called `warmup` times on a side stream (Triton
    compiles and the allocator warms up outside the capture), then captured and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        value = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, value


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int, groups: int = 5) -> float:
    """Median ms per replay over `groups` groups of `reps` back-to-back replays, each group timed
    between two CUDA events (the host queues a replay while the GPU runs the previous one, so this
    is the graph's GPU time without the host's launch latency)."""
    times = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)
