"""RMS normalisation, weighted and unweighted, computed in fp32."""
from __future__ import annotations

import torch
from torch import nn

from ...kernels.rmsnorm import rms_norm


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, returned in x's dtype."""
    return rms_norm(x, None, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
