"""The block-scaled FP8 linear: y [M, N] = act_quant(x) @ dequant(W)^T, W e4m3 [N, K] with a scale per
128 x 128 block (formats.py), fp32 accumulation, the output in x's dtype.

One kernel, two forms (select.py's table picks by M); x goes through act_quant (its own launch) in both:
  * tensor-core form (prefill-sized M): each program computes a BLOCK_M x BLOCK_N tile: per 128-column group
    of K one fp8 x fp8 dot into a fresh fp32 partial, added to the fp32 accumulator times (x scale per row) x
    (W scale per column's block). Promoting every group, as the release's kernel does, keeps the tensor
    core's short accumulation to 128 products.
  * weight-streaming form (M <= 16): one 16-row M tile, so W is read once, narrow N tiles and four groups a
    pipeline stage. Benchmarked alternatives (select.linear_variants): 8 warps, and QUANT_A: 16-bit x rows
    quantized inside the kernel per group (act_quant's codes and scales, no launch, but every N tile
    quantizes the row again) through the bf16 or fp16 mma (e4m3 codes are exact in both), or the fp8 mma
    on the codes of the hardware fp32 -> e4m3 conversion (GemmConfig.hw_round, compiled kernels only).
Both compute sum_g (q_x[m, g] . q_W[n, g]) s_x[m, g] s_W[n / 128, g] in fp32; they differ from the
reference only in the order of the fp32 sums.

Roofline: bytes = N K (codes) + 4 ceil(N/128) ceil(K/128) (scales) + M K (2 bytes quantized in-kernel, 1 + act_quant's
3 otherwise) + 2 M N; FLOPs = 2 M N K (fp8 tensor cores).

Graph-safe: no host sync, the grid depends on shapes only; M is not a specialisation key.
"""
from __future__ import annotations

import torch

from ... import envs
from ..dispatch import enabled_on, num_sms
from ..pdl import pdl_args, wait_for_prior_grid
from .act_quant import act_quant_triton
from .formats import QuantFormatError, QuantWeight, check_scale_fmt
from .reference import quant_linear_ref
from .select import GemmConfig, linear_config

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    from .triton_common import activation_group, fp8_weight_partial, load_scale

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

_INTERPRET = envs.triton_interpret()

if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _fp8_linear_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr,
        M, N, K,
        stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        QUANT_A: tl.constexpr, UE8M0: tl.constexpr, W_E8M0: tl.constexpr, DOT: tl.constexpr,
        K_STEP: tl.constexpr, HW_ROUND: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # L2 swizzle: GROUP_M M tiles share each W tile while it is in L2.
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 128)
        m_ok = offs_m < M
        n_ok = offs_n < N
        rows = offs_m.to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        as_ptrs = as_ptr + rows * stride_asm
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
        ws_ptrs = ws_ptr + (offs_n // 128) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        num_groups = (K + 127) // 128
        for g0 in range(0, num_groups, K_STEP):
            # K_STEP groups per iteration: more weight bytes in flight per pipeline stage (the streaming form).
            for gi in tl.static_range(K_STEP):
                g = g0 + gi
                g_scale = tl.minimum(g, num_groups - 1)  # a group past K: loads masked, its partial 0
                k_ok = g * 128 + offs_k < K
                a_op, sa = activation_group(a_ptrs + g * 128, as_ptrs + g_scale, m_ok[:, None] & k_ok[None, :],
                                            m_ok, QUANT_A, UE8M0, DOT, HW_ROUND)
                part = fp8_weight_partial(a_op, w_ptrs + g * 128, k_ok[:, None] & n_ok[None, :], DOT)
                sb = load_scale(ws_ptrs + g_scale, n_ok, W_E8M0)
                acc += part * (sa[:, None] * sb[None, :])
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check_linear(x: torch.Tensor, w: QuantWeight) -> None:
    if w.fmt != "fp8_block" or w.data.dim() != 2:
        raise QuantFormatError(f"quant_linear needs a 2-D fp8_block weight, got {w.fmt} {tuple(w.data.shape)}")
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise QuantFormatError(f"quant_linear: x has shape {tuple(x.shape)} and W is {tuple(w.shape)}: x needs "
                               f"[M, {w.shape[1]}]")
    if x.stride(1) != 1:
        raise QuantFormatError("quant_linear needs x with a contiguous last dimension")


def quant_linear_triton(x: torch.Tensor, w: QuantWeight, scale_fmt: str | None = "ue8m0",
                        config: GemmConfig | None = None) -> torch.Tensor:
    """The kernel (on CUDA, or on CPU tensors under TRITON_INTERPRET=1); config: select.linear_config by
    default (tests pass others to reach both forms at any M)."""
    check_scale_fmt(scale_fmt)
    _check_linear(x, w)
    m, k = x.shape
    n = w.shape[0]
    cfg = config or linear_config(m, n, k, num_sms(x.device), _INTERPRET)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if cfg.quant_a:
        a, a_s = x, x.new_empty(1, dtype=torch.float32)
    else:
        a, a_s = act_quant_triton(x, scale_fmt)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_linear_kernel[grid](
        a, a_s, w.codes, w.scale_bits, y,
        m, n, k,
        a.stride(0), a_s.stride(0), w.data.stride(0), w.scale.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        QUANT_A=cfg.quant_a, UE8M0=scale_fmt == "ue8m0", W_E8M0=w.scale_is_e8m0, DOT=cfg.dot,
        K_STEP=cfg.k_step, HW_ROUND=cfg.hw_round and cfg.quant_a and not _INTERPRET, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(x.device))
    return y


def quant_linear(x: torch.Tensor, w: QuantWeight, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """F.linear(x, dequant(W)) as the release computes it (activations quantized per 128 columns): the Triton
    kernel on CUDA (`SPARSESERVE_DISABLE_KERNELS=quant`: the reference), the reference on the CPU (tests call
    quant_linear_triton under the interpreter)."""
    if HAS_TRITON and enabled_on("quant", x.device):
        return quant_linear_triton(x, w, scale_fmt)
    _check_linear(x, w)
    return quant_linear_ref(x, w, scale_fmt)
