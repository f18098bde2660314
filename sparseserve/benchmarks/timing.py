"""GPU timing shared by the benchmarks."""
from __future__ import annotations

import statistics

import torch


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
