"""Partial interleaved rotary embedding (V4): rotates the trailing `rope_dim` channels
in consecutive pairs. Two bases: "main" (sliding layers) and "compress" (CSA/HCA layers,
YaRN-scaled when the config asks; its attention factor is 1)."""
from __future__ import annotations

import math

import torch

from ...kernels import rope as rope_kernel


def rope_inv_freq(rope_params: dict, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] for one rope type ("default" or "yarn")."""
    base = float(rope_params["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = base**exponents
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type == "default":
        return 1.0 / pos_freqs
    if rope_type != "yarn":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; use 'default' or 'yarn'")
    factor = float(rope_params["factor"])
    original_max = float(rope_params["original_max_position_embeddings"])
    beta_fast = float(rope_params.get("beta_fast") or 32)
    beta_slow = float(rope_params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim // 2] (fp32) for absolute positions [T]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device).unsqueeze(0)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x ([T, D] or [T, H, D]) pairwise
    (inverse=True: by the negative angle, to undo rope on the attention output). On CUDA the
    rotation happens in place on x."""
    return rope_kernel.apply_rope(x, cos, sin, inverse)
