"""RMSNorm then rope of attention rows in one launch, optionally also written to pool rows.

A layer normalises and rotates its query heads (q = rope(rms(q))) and its fresh KV row (kv =
rope(kv_norm(kv))), and writes the KV row to its staging row of the pool: as separate kernels
that is 2 launches on the step's main stream and 3 on its side stream per layer, each
latency-bound at decode sizes (a few microseconds each at batch 1 on the H200). Here one
program per (token, head) row loads it once, normalises (rounded as `rms_norm`: the normalised
row to the dtype, then the weighted one), rotates the trailing rope channels in fp32 from those
rounded values and rounds once more (as `apply_rope`), stores the row and, with `pool`, also
writes it to pool[rows[token]]. With an FP8 KV cache (`kv_format`) the row written to the pool (and returned)
is the packed FP8 row (sparseserve/kv_format.py), quantized in the same program.
Roofline: T*H*D*e read + T*H*D*e written (+ T*D*e to the pool); latency-bound at decode sizes.
The reference (the unfused functions in order) is the CPU path."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_format import KVFormat, quantize_kv_rows
from .dispatch import use_triton
from .kv_fp8 import fp8_block, store_kv_row
from .rmsnorm import rms_norm
from .rope import apply_rope
from .pdl import pdl_args, wait_for_prior_grid


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  pool: torch.Tensor | None = None, pool_rows: torch.Tensor | None = None,
                  kv_format: KVFormat | None = None) -> torch.Tensor:
    y = apply_rope(rms_norm(x, weight, eps), cos, sin)
    if kv_format is not None:
        packed = quantize_kv_rows(y, kv_format)
        pool.index_copy_(0, pool_rows, packed)
        return packed
    if pool is not None:
        y = y.to(pool.dtype)
        pool.index_copy_(0, pool_rows, y)
    return y


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, pool_ptr, rows_ptr, heads, dim, stride_t, stride_h,
                      eps, HAS_W: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, SCATTER: tl.constexpr,
                      FP8: tl.constexpr, NOPE: tl.constexpr, SCALE_OFF: tl.constexpr, ROW_BYTES: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    r = tl.program_id(0).to(tl.int64)
    token = r // heads
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + token * stride_t + (r % heads) * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)).to(dtype).to(tl.float32)
    if HAS_W:
        y = (y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    # Pairs (2p, 2p + 1); those from pair p0 on are the rope channels, rotated by angle p - p0.
    e, o = tl.split(tl.reshape(y, [BLOCK // 2, 2]))
    p = tl.arange(0, BLOCK // 2)
    p0 = dim // 2 - HALF
    is_rope = (p >= p0) & (p < dim // 2)
    i = tl.where(is_rope, p - p0, 0)
    c = tl.load(cos_ptr + token * HALF + i, mask=is_rope, other=1.0)
    s = tl.load(sin_ptr + token * HALF + i, mask=is_rope, other=0.0)
    rotated = tl.reshape(tl.join(e * c - o * s, o * c + e * s), [BLOCK])  # c = 1, s = 0: unchanged
    out = rotated.to(dtype)
    if FP8:
        # The packed row (to out, then to the pool row): quantized from the row in the model's dtype.
        v = out.to(tl.float32)
        store_kv_row(out_ptr + r * ROW_BYTES, v, dim, NOPE, SCALE_OFF, BLOCK)
        row = tl.load(rows_ptr + token).to(tl.int64)
        store_kv_row(pool_ptr + row * ROW_BYTES, v, dim, NOPE, SCALE_OFF, BLOCK)
    else:
        tl.store(out_ptr + r * dim + cols, out, mask=mask)
    if SCATTER and not FP8:
        row = tl.load(rows_ptr + token).to(tl.int64)
        tl.store(pool_ptr + row * dim + cols, out.to(pool_ptr.dtype.element_ty), mask=mask)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     pool: torch.Tensor | None = None, pool_rows: torch.Tensor | None = None,
                     kv_format: KVFormat | None = None) -> torch.Tensor:
    """x [T, D] or [T, H, D] (last dim contiguous, other strides free); pool (H = 1 only) [N, D], or packed FP8
    rows [N, kv_format.row_bytes] uint8 (then the result is the packed rows too)."""
    heads = x.shape[1] if x.dim() == 3 else 1
    dim = x.shape[-1]
    fp8 = kv_format is not None
    if fp8:
        out = torch.empty((x.shape[0], kv_format.row_bytes), dtype=torch.uint8, device=x.device)
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows:
        block = fp8_block(dim) if fp8 else triton.next_power_of_2(dim)
        _norm_rope_kernel[(rows,)](
            x, weight if weight is not None else x, cos.float().contiguous(), sin.float().contiguous(), out,
            pool if pool is not None else out, pool_rows.contiguous() if pool_rows is not None else out,
            heads, dim, x.stride(0), x.stride(1) if x.dim() == 3 else 0, eps,
            HAS_W=weight is not None, HALF=cos.shape[-1], BLOCK=block, SCATTER=pool is not None, FP8=fp8,
            NOPE=kv_format.nope_dim if fp8 else 0, SCALE_OFF=kv_format.scale_offset if fp8 else 0,
            ROW_BYTES=kv_format.row_bytes if fp8 else 0, num_warps=4 if block <= 2048 else 8, **pdl_args(x.device))
    return out


def _fusable(x: torch.Tensor, cos: torch.Tensor, pool: torch.Tensor | None, fp8: bool) -> bool:
    half = cos.shape[-1]
    return (use_triton("norm_rope", x) and use_triton("rope", x) and use_triton("rmsnorm", x)
            and x.dim() in (2, 3) and x.stride(-1) == 1 and half & (half - 1) == 0
            and x.shape[-1] % 2 == 0 and 2 * half <= x.shape[-1]
            and (pool is None or (x.dim() == 2 and (fp8 or pool.dtype == x.dtype) and pool.is_contiguous())))


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pool: torch.Tensor | None = None, pool_rows: torch.Tensor | None = None,
              kv_format: KVFormat | None = None) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps)) as a new tensor; with `pool`, each token's row is also written
    to pool[pool_rows[token]] (x 2-D), and the result is in the pool's dtype (`kv_format`: the packed FP8
    rows, as written)."""
    if _fusable(x, cos, pool, kv_format is not None):
        return norm_rope_triton(x, weight, eps, cos, sin, pool, pool_rows, kv_format)
    return norm_rope_ref(x, weight, eps, cos, sin, pool, pool_rows, kv_format)
