"""Interleaved rope on the trailing rope dims, in place, one launch; and a step's rope tables.

Pairs (2i, 2i+1) of the last `rope_dim = 2 * cos.shape[-1]` channels rotate as
(e*c - o*s, o*c + e*s) in fp32 (inverse: by the negative angle); the other channels are
untouched, so only the rope slice is read and written. Roofline: 2 * T * H * rope_dim * bytes.

`rope_tables` computes every cos/sin table a step needs (each a position offset and a set of
inverse frequencies) in one launch: a decode step needs four (main and compress bases at the
token positions, and one per compress rate at the emitted entries' positions), which the
plain-PyTorch path builds with four kernels each.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton
from .pdl import pdl_args, wait_for_prior_grid


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


@triton.jit(do_not_specialize=["rows"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, rows, heads, dim, stride_t, stride_h, sign,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    # A tile of BLOCK_R rows (token, head) x the 2 * HALF rope channels, loaded contiguously and
    # split into (even, odd) pairs in registers: one program per row of 32 pairs left the loads
    # stride-2 and the grid at T * H tiny programs (~7x the memory floor at 8192 tokens x 64 heads).
    wait_for_prior_grid(PDL)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = (r < rows)[:, None]
    token = r // heads
    channel = tl.arange(0, 2 * HALF)
    # Row (token, head) at token * stride_t + head * stride_h: a head-split slice of a packed
    # projection's output is rotated where it lies.
    base = token * stride_t + (r % heads) * stride_h + (dim - 2 * HALF)
    ptrs = x_ptr + base[:, None] + channel[None, :]
    x = tl.load(ptrs, mask=row_ok, other=0.0).to(tl.float32)
    e, o = tl.split(tl.reshape(x, [BLOCK_R, HALF, 2]))
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + token[:, None] * HALF + i[None, :], mask=row_ok, other=0.0)
    s = tl.load(sin_ptr + token[:, None] * HALF + i[None, :], mask=row_ok, other=0.0) * sign
    out = tl.reshape(tl.join(e * c - o * s, o * c + e * s), [BLOCK_R, 2 * HALF])
    tl.store(ptrs, out.to(x_ptr.dtype.element_ty), mask=row_ok)


def _strided_ok(x: torch.Tensor) -> bool:
    return x.dim() in (2, 3) and x.stride(-1) == 1


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """In place on x ([T, D] or [T, H, D], last dim contiguous, any other strides); returns x.
    The rope half-width must be a power of two (V4: 32)."""
    half = cos.shape[-1]
    if half & (half - 1):
        raise ValueError(f"the rope kernel needs a power-of-two rope half-width, got {half}")
    if not _strided_ok(x):
        raise ValueError(f"the rope kernel needs a 2-D or 3-D x with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    rows = x.shape[0] * heads
    if rows:
        block_r = max(1, min(64, 4096 // (2 * half), triton.next_power_of_2(rows)))
        _rope_kernel[(triton.cdiv(rows, block_r),)](
            x, cos.float().contiguous(), sin.float().contiguous(), rows, heads, x.shape[-1], x.stride(0), stride_h,
            -1.0 if inverse else 1.0, HALF=half, BLOCK_R=block_r, num_warps=4, **pdl_args(x.device))
    return x


def rope_tables_ref(positions: torch.Tensor, offsets: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[n, 2, T, half] fp32: cos (index 0) and sin (1) of (positions + offsets[i]) * inv_freq[i].
    positions [T] int64, offsets [n] int64, inv_freq [n, half] fp32 (the angle in fp32, as
    `positions.float() * inv_freq`)."""
    shifted = positions.unsqueeze(0) + offsets.to(positions.dtype).unsqueeze(1)  # [n, T]
    angles = shifted.float().unsqueeze(-1) * inv_freq.float().unsqueeze(1)  # [n, T, half]
    return torch.stack((angles.cos(), angles.sin()), dim=1)


@triton.jit(do_not_specialize=["T"])
def _rope_tables_kernel(pos_ptr, off_ptr, freq_ptr, out_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                        PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    table = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (t < T)[:, None]
    shifted = tl.load(pos_ptr + t, mask=t < T, other=0) + tl.load(off_ptr + table)
    i = tl.arange(0, HALF)
    angle = shifted.to(tl.float32)[:, None] * tl.load(freq_ptr + table * HALF + i)[None, :]
    # tl.cos/tl.sin compile to the accurate libdevice routines (no .approx), like torch's.
    cell = table.to(tl.int64) * 2 * T * HALF + t[:, None].to(tl.int64) * HALF + i[None, :]
    tl.store(out_ptr + cell, tl.cos(angle), mask=ok)
    tl.store(out_ptr + cell + T * HALF, tl.sin(angle), mask=ok)


def rope_tables(positions: torch.Tensor, offsets: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """`rope_tables_ref`, in one launch on CUDA (when the rope half-width is a power of two)."""
    half = inv_freq.shape[1]
    if use_triton("rope", positions) and half & (half - 1) == 0:
        return rope_tables_triton(positions, offsets, inv_freq)
    return rope_tables_ref(positions, offsets, inv_freq)


def rope_tables_triton(positions: torch.Tensor, offsets: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The Triton path of `rope_tables` (on the CPU under TRITON_INTERPRET=1, for tests)."""
    n, half = inv_freq.shape
    if half & (half - 1):
        raise ValueError(f"the rope-tables kernel needs a power-of-two rope half-width, got {half}")
    T = positions.shape[0]
    out = torch.empty((n, 2, T, half), dtype=torch.float32, device=positions.device)
    if T and n:
        block_t = max(1, min(64, triton.next_power_of_2(T)))
        _rope_tables_kernel[(n, triton.cdiv(T, block_t))](
            positions.contiguous(), offsets.contiguous(), inv_freq.float().contiguous(), out, T,
            HALF=half, BLOCK_T=block_t, num_warps=4, **pdl_args(positions.device))
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x's rope dims. On CUDA this is done in place on x (callers pass fresh tensors, or
    views of one that nothing else reads)."""
    half = cos.shape[-1]
    if use_triton("rope", x) and _strided_ok(x) and half & (half - 1) == 0:
        return apply_rope_(x, cos, sin, inverse)
    return apply_rope_ref(x, cos, sin, inverse)
