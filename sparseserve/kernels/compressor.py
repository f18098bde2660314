"""Compressor: pools a closed window of projected tokens into one compressed entry.

For a token that closes window w (position p = (w + 1) * rate - 1), the entry is
    kv_norm( sum_j softmax_j(gate_j + position_bias_j) * kv_j )  (per channel, over the window)
then rotated with rope at position w * rate and written to its pool row. CSA ("overlap")
pools 2*rate slots: the first half of each source token's features from window w-1 and
the second half from window w. Sources before position 0 get zero weight.
The token's projections live in a position-addressed state buffer (kv || gate).

Roofline (per emitted entry, S slots, width Wd): bytes = S * 2 * Wd * 2 + out; FLOPs ~ 6 * S * Wd.
"""
from __future__ import annotations

import torch

from ..model.layers.norm import rms_normalize
from ..model.layers.rope import apply_rope


def compress_windows_ref(
    state: torch.Tensor,
    src_rows: torch.Tensor,
    position_bias: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_pool: torch.Tensor,
    out_rows: torch.Tensor,
) -> None:
    """Plain-PyTorch reference (and CPU path).

    state: [N, 2 * Wd] rows of kv || gate; src_rows: [M, S] (S = 2*rate with overlap, else rate;
    -1 = no source); position_bias: [rate, Wd]; cos/sin: [M, rope_dim/2] at the entry positions;
    out_pool: [P, head_dim]; out_rows: [M] destination rows.
    """
    if src_rows.shape[0] == 0:
        return
    width = state.shape[1] // 2
    rate = position_bias.shape[0]
    valid = src_rows >= 0
    gathered = state[src_rows.clamp(min=0)].float()  # [M, S, 2*Wd]
    kv, gate = gathered[..., :width], gathered[..., width:]
    bias = position_bias.float()
    if overlap:
        head_dim = width // 2
        kv = torch.cat([kv[:, :rate, :head_dim], kv[:, rate:, head_dim:]], dim=1)
        gate = torch.cat([gate[:, :rate, :head_dim] + bias[:, :head_dim], gate[:, rate:, head_dim:] + bias[:, head_dim:]], dim=1)
    else:
        gate = gate + bias
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    pooled = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
    entry = (norm_weight.float() * rms_normalize(pooled, norm_eps)).to(out_pool.dtype)
    entry = apply_rope(entry, cos, sin)
    out_pool.index_copy_(0, out_rows.long(), entry)


def compress_windows(
    state: torch.Tensor,
    src_rows: torch.Tensor,
    position_bias: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_pool: torch.Tensor,
    out_rows: torch.Tensor,
) -> None:
    """Dispatch: the Triton kernel on CUDA (when written), the reference elsewhere."""
    compress_windows_ref(state, src_rows, position_bias, overlap, norm_weight, norm_eps, cos, sin, out_pool, out_rows)
