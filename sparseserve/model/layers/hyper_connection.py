"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams.

Each sub-block collapses the streams with `pre` weights, and writes back its output with
`post` weights plus a Sinkhorn-projected (doubly stochastic) `comb` mix of the streams.
All mixing coefficients are computed in fp32. The math lives in `kernels/mhc.py`: fused
Triton kernels for bf16/fp16 streams on CUDA, the plain-PyTorch references elsewhere."""
from __future__ import annotations

import torch
from torch import nn

from ...kernels.mhc import hc_expand
from ...kernels.mhc_fused import hc_collapse_norm, hc_expand_collapse_norm, hc_head_collapse_norm
from .norm import RMSNorm


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mix, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty(mix))
        self.scale = nn.Parameter(torch.empty(3))

    def collapse_norm(self, streams: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> (post [T, hc] fp32, comb [T, hc, hc] fp32, the block's input
        norm(collapsed) [T, D])."""
        return hc_collapse_norm(streams, self.fn, self.base, self.scale, self.hc_mult, self.sinkhorn_iters,
                                self.hc_eps, self.norm_eps, norm.weight, norm.eps)

    def expand_collapse_norm(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                             comb: torch.Tensor, norm: RMSNorm
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous block's output into the streams (its post and comb), then this collapse and
        the next block's norm: (new streams, post, comb, the next block's input)."""
        return hc_expand_collapse_norm(streams, block_out, post, comb, self.fn, self.base, self.scale, self.hc_mult,
                                       self.sinkhorn_iters, self.hc_eps, self.norm_eps, norm.weight, norm.eps)

    @staticmethod
    def expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """new[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]."""
        return hc_expand(streams, block_out, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the streams before the shared norm and the LM head."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def collapse_norm(self, streams: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm(collapse(streams)): the LM head's input."""
        return hc_head_collapse_norm(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps,
                                     norm.weight, norm.eps)
