"""Activation quantization per token and 128-column group (the release's ``act_quant``; formula in
reference.py): one program per (BLOCK_M rows, one group), codes stored as float8_e4m3fn, scales as fp32.

Roofline: bytes = 2 M K (read) + M K + 4 M ceil(K/128) (write); no FLOPs to speak of. The prefill GEMMs read
its output; decode-sized GEMMs quantize their few rows themselves (no launch)."""
from __future__ import annotations

import torch

from ..dispatch import enabled_on
from ..pdl import pdl_args, wait_for_prior_grid
from .formats import BLOCK, QuantFormatError, check_scale_fmt
from .reference import act_quant_ref

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    from .triton_common import quant_group

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

ACT_BLOCK_M = 32

if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                          BLOCK_M: tl.constexpr, UE8M0: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_grid(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.program_id(1)
        cols = g * 128 + tl.arange(0, 128)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, s = quant_group(x, UE8M0)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows64 * stride_sm + g, s, mask=row_ok)


def act_quant_triton(x: torch.Tensor, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16- or 32-bit, contiguous rows) -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K/128)] fp32)."""
    check_scale_fmt(scale_fmt)
    if x.dim() != 2 or x.stride(1) != 1:
        raise QuantFormatError(f"act_quant needs a 2-D x with contiguous rows, got shape {tuple(x.shape)} and "
                               f"strides {x.stride()}")
    m, k = x.shape
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        _act_quant_kernel[(triton.cdiv(m, ACT_BLOCK_M), groups)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
            BLOCK_M=ACT_BLOCK_M, UE8M0=scale_fmt == "ue8m0", num_warps=4, **pdl_args(x.device))
    return q, s


def act_quant(x: torch.Tensor, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA (`SPARSESERVE_DISABLE_KERNELS=quant`: the reference), the reference on the CPU."""
    if HAS_TRITON and enabled_on("quant", x.device):
        return act_quant_triton(x, scale_fmt)
    return act_quant_ref(x, scale_fmt)
