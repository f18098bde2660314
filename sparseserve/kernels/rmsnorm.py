"""RMS normalisation in one launch: y = (x / rms(x)) [* weight], computed in fp32.

It rounds as the reference does: the normalised value to x's dtype first, then the product
with the (fp32) weight to x's dtype again. Roofline: 2 * N * D * bytes; memory-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton
from .pdl import pdl_args, wait_for_prior_grid


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else (weight * y).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, dim, inner, stride_outer, stride_inner, eps,
                     HAS_W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    # Row (a, b) of x [outer, inner, dim] sits at a * stride_outer + b * stride_inner, so column
    # slices of a packed projection's output are read in place instead of copied first.
    row = tl.program_id(0).to(tl.int64)
    src = (row // inner) * stride_outer + (row % inner) * stride_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + src + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x or a contiguous copy, inner, stride_outer, stride_inner): x's rows addressed as [outer, inner]."""
    if x.stride(-1) == 1 and x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.stride(-1) == 1 and x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.contiguous()
    return x, 1, x.shape[-1], 0


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Output contiguous, shaped like x; x may be a strided view (2-D or 3-D, last dim contiguous)."""
    dim = x.shape[-1]
    src, inner, stride_outer, stride_inner = _rows_view(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // dim if dim else 0
    if rows:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows,)](src, weight if weight is not None else src, y, dim, inner, stride_outer,
                                  stride_inner, eps, HAS_W=weight is not None, BLOCK=block,
                                  num_warps=4 if block <= 4096 else 8, **pdl_args(x.device))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if use_triton("rmsnorm", x) and x.shape[-1] <= 32768:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)
