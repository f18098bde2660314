"""RMS normalisation with a learned weight, computed in fp32."""
from __future__ import annotations

import torch
from torch import nn

from ...kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
