"""Hardware ceilings measured in the benchmark's own process (CUDA)."""
from __future__ import annotations

import time

import torch


def hbm_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) over a 1 GiB bf16 buffer."""
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)
