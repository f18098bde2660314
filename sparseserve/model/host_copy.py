"""Small host -> device copies that do not stall the stream.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy first waits
for the stream to drain: in a speculative step that made the host wait for the drafter's graph
several times per step. Staging through pinned memory (PyTorch's caching host allocator reuses
the blocks and keeps each alive until its copy has run) lets the copy queue behind the work
already launched instead."""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor on `device`, without a stream sync on CUDA."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_host(values: torch.Tensor) -> torch.Tensor:
    """Queue a device -> host copy of `values` into pinned memory without waiting for it (read the
    result only after an event recorded later on the stream has completed); on the CPU, `values`."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host
