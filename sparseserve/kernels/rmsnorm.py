"""RMS normalisation in one launch: y = (x / rms(x)) [* weight], computed in fp32.

It rounds as the reference does: the normalised value to x's dtype first, then the product
with the (fp32) weight to x's dtype again. Roofline: 2 * N * D * bytes; memory-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else (weight * y).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, dim, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, dim, eps,
                                         HAS_W=weight is not None, BLOCK=block,
                                         num_warps=4 if block <= 4096 else 8)
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if use_triton("rmsnorm", x) and x.shape[-1] <= 32768:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)
