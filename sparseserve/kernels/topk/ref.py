"""The plain-PyTorch top-k: the CPU path and the tests' oracle (same tie rule as the kernels)."""
from __future__ import annotations

import torch


def topk_indices_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path)."""
    num_rows, width = scores.shape
    columns = torch.arange(width, device=scores.device)
    valid = columns.unsqueeze(0) < lengths.long().unsqueeze(1)
    masked = scores.float().masked_fill(~valid, float("-inf"))
    k_eff = min(k, width)
    # A stable descending sort keeps the lower index first among equal scores.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k_eff]
    slot = torch.arange(k_eff, device=scores.device).unsqueeze(0)
    order = torch.where(slot < lengths.long().clamp(max=k_eff).unsqueeze(1), order, torch.full_like(order, -1))
    out = torch.full((num_rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :k_eff] = order.to(torch.int32)
    return out
