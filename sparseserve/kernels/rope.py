"""Interleaved rope on the trailing rope dims, in place, one launch.

Pairs (2i, 2i+1) of the last `rope_dim = 2 * cos.shape[-1]` channels rotate as
(e*c - o*s, o*c + e*s) in fp32 (inverse: by the negative angle); the other channels are
untouched, so only the rope slice is read and written. Roofline: 2 * T * H * rope_dim * bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Out of place; x is [T, D] or [T, H, D], cos/sin [T, rope_dim/2] fp32."""
    rope_dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, dim, half, sign, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // heads
    i = tl.arange(0, BLOCK)
    mask = i < half
    base = x_ptr + pid * dim + (dim - 2 * half)
    e = tl.load(base + 2 * i, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(base + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * half + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * half + i, mask=mask, other=0.0) * sign
    tl.store(base + 2 * i, (e * c - o * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + 2 * i + 1, (o * c + e * s).to(x_ptr.dtype.element_ty), mask=mask)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """In place on a contiguous x; returns x."""
    half = cos.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows:
        _rope_kernel[(rows,)](x, cos.float().contiguous(), sin.float().contiguous(), heads, x.shape[-1], half,
                              -1.0 if inverse else 1.0, BLOCK=max(16, triton.next_power_of_2(half)), num_warps=1)
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x's rope dims. On CUDA this is done in place on x (callers pass fresh tensors)."""
    if use_triton("rope", x) and x.is_contiguous():
        return apply_rope_(x, cos, sin, inverse)
    return apply_rope_ref(x, cos, sin, inverse)
