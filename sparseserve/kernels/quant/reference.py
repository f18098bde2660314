"""Plain-PyTorch references of the quantized kernels: the CPU path and the tests' oracle.

Activation quantization follows the DeepSeek-V4 release's inference code (``act_quant``): per token and per
128-column group, ``amax = max(max |x|, 1e-4)`` in fp32, ``s = amax * (1/448)``; with ``scale_fmt="ue8m0"`` the
scale is rounded up to a power of two, ``s = 2^ceil(log2(s))``; the codes are ``e4m3(clamp(x / s, -448, 448))``
(round to nearest even). A last group shorter than 128 columns (K not a multiple of 128; the release requires
one) takes its amax over the columns it has.

The release's linear layer is ``y = fp8_gemm(act_quant(x), W) -> bf16`` with fp32 accumulation and the scales
applied per 128-column block of K. Its routed expert is::

    gate = w1(x).float(); up = w3(x).float()            # each GEMM's output rounded to x's dtype first
    up = clamp(up, -L, L); gate = clamp(gate, max=L)    # L = swiglu_limit (> 0)
    h = silu(gate) * up * route_weight                  # fp32; the routing weight before w2
    y = w2(h.to(x.dtype))                               # w2 quantizes h per token and 128 columns again

and the MoE sums the experts' rows in fp32 (rounded once at the end).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import (BLOCK, FP4_GROUP, FP8_MAX, ONE_DOT_MAX_SHIFT, ONE_DOT_TOP, QuantWeight, check_scale_fmt,
                      scale_exponents)

# The 8 non-negative e2m1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()  # the fp32 constant the release multiplies by


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """An fp32 or e8m0 scale tensor as fp32 values."""
    return scale.float()


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(s)) of positive normal fp32 values, exactly (frexp: s = m * 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(s)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(s), e)


def act_quant_ref(x: torch.Tensor, scale_fmt: str | None = "ue8m0", block: int = BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K/block)] fp32), as the module docstring says."""
    check_scale_fmt(scale_fmt)
    m, k = x.shape
    groups = -(-k // block)
    xf = x.float()
    pad = F.pad(xf, (0, groups * block - k)).view(m, groups, block)
    amax = pad.abs().amax(dim=2).clamp_min(1e-4)
    s = amax * _INV_FP8_MAX
    if scale_fmt == "ue8m0":
        s = pow2_ceil(s)
    s_cols = s.repeat_interleave(block, dim=1)[:, :k]
    q = (xf / s_cols).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def act_dequant_ref(q: torch.Tensor, s: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """codes [M, K] and scales [M, G] -> fp32 [M, K]."""
    return q.float() * s.float().repeat_interleave(block, dim=1)[:, : q.shape[1]]


def act_fake_quant_ref(x: torch.Tensor, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """The values the kernels multiply: act_quant_ref then dequantized, fp32."""
    return act_dequant_ref(*act_quant_ref(x, scale_fmt))


def dequant_fp8_block(data: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """e4m3 [..., N, K] with block scales [..., ceil(N/b), ceil(K/b)] -> fp32 [..., N, K]."""
    n, k = data.shape[-2:]
    s = scale_to_float(scale).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return data.float() * s[..., :n, :k]


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] (uint8 or int8) -> fp32 values [..., N, K]; element 2j is byte j's low nibble."""
    b = data.view(torch.uint8).to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # [..., K]: low nibble first
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    mag = table[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def dequant_fp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] with scales [..., N, K/32] -> fp32 [..., N, K]."""
    return unpack_fp4(data) * scale_to_float(scale).repeat_interleave(FP4_GROUP, dim=-1)


def fp4_one_dot_operands(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-dot form's operands of an fp4 weight (formats.py's docstring; kernels/quant/fp4_one_dot.py):
    (e4m3 codes [..., N, K] of value x 2^(6 - d_q), fp32 group scales [..., N, ceil(K/128)] = 2^(e_max - 133)),
    as the kernel computes them: e_max over a group's sub-groups (a last group may have fewer), d_q clamped to
    14. codes * scale is the weight's values wherever formats.fp4_one_dot_exact holds."""
    e, _ = scale_exponents(w.scale)
    k32 = e.shape[-1]
    groups = -(-k32 // 4)
    e_pad = F.pad(e, (0, 4 * groups - k32)).unflatten(-1, (groups, 4))
    e_max = e_pad.amax(dim=-1)  # [..., N, G]
    shift = (e_max.repeat_interleave(4, dim=-1)[..., :k32] - e).clamp(max=ONE_DOT_MAX_SHIFT)
    factor = torch.ldexp(torch.ones_like(shift, dtype=torch.float32), ONE_DOT_TOP - shift)
    codes = (unpack_fp4(w.data) * factor.repeat_interleave(FP4_GROUP, dim=-1)).to(torch.float8_e4m3fn)
    scale = torch.ldexp(torch.ones_like(e_max, dtype=torch.float32), e_max - 127 - ONE_DOT_TOP)
    return codes, scale


def dequant_weight(w: QuantWeight) -> torch.Tensor:
    """A QuantWeight's values, fp32."""
    return dequant_fp8_block(w.data, w.scale) if w.fmt == "fp8_block" else dequant_fp4(w.data, w.scale)


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, scale_fmt: str | None = "ue8m0",
                     out_dtype: torch.dtype | None = None, weight_f32: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = act_quant(x) @ W^T with W a 2-D QuantWeight, accumulated in fp32, rounded to out_dtype
    (default: x's dtype). `weight_f32`: W already dequantized (saves the decode when called per expert)."""
    wf = dequant_weight(w) if weight_f32 is None else weight_f32
    y = act_fake_quant_ref(x, scale_fmt) @ wf.t()
    return y.to(out_dtype or x.dtype)


def _expert_weight(w: QuantWeight, e: int) -> QuantWeight:
    return QuantWeight(w.data[e], w.scale[e], w.fmt)


def fused_moe_quant_ref(
    x: torch.Tensor,
    w_gate_up: QuantWeight,
    w_down: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    scale_fmt: str | None = "ue8m0",
) -> torch.Tensor:
    """The routed experts on quantized weights, as the release computes them (module docstring).

    x [T, D]; w_gate_up [E, 2I, D] (w1 rows, then w3 rows); w_down [E, D, I]; topk_weights [T, k] fp32;
    topk_ids [T, k]. Returns [T, D] in x's dtype (fp32 sum of the bf16 expert rows, rounded once)."""
    num_tokens, hidden = x.shape
    inter = w_gate_up.shape[-2] // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:  # skipped (kernels/moe_align.py)
            continue
        sel = flat_ids == expert
        tokens = flat_tokens[sel]
        gate_up = quant_linear_ref(x[tokens], _expert_weight(w_gate_up, expert), scale_fmt).float()
        gate = gate_up[:, :inter].clamp(max=swiglu_limit)
        up = gate_up[:, inter:].clamp(min=-swiglu_limit, max=swiglu_limit)
        h = (F.silu(gate) * up * flat_weights[sel].unsqueeze(1)).to(x.dtype)
        y = quant_linear_ref(h, _expert_weight(w_down, expert), scale_fmt)
        out.index_add_(0, tokens, y.float())
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------
# Quantizers (tests and benchmarks build checkpoint-like weights with them; the loader decodes real ones)
# ----------------------------------------------------------------------------------------


def quantize_fp8_block(w: torch.Tensor, e8m0: bool = True, block: int = BLOCK) -> QuantWeight:
    """fp32/bf16 [..., N, K] -> fp8_block QuantWeight: per 128 x 128 block amax / 448, rounded up to a power of
    two when `e8m0` (scale stored as float8_e8m0fnu), else an fp32 scale."""
    *lead, n, k = w.shape
    gn, gk = -(-n // block), -(-k // block)
    wf = F.pad(w.float(), (0, gk * block - k, 0, gn * block - n)).reshape(*lead, gn, block, gk, block)
    amax = wf.abs().amax(dim=(-3, -1)).clamp_min(1e-12)
    s = amax / FP8_MAX
    if e8m0:
        s = pow2_ceil(s)
    s_full = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    data = (w.float() / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantWeight(data.contiguous(), (s.to(torch.float8_e8m0fnu) if e8m0 else s).contiguous(), "fp8_block")


def quantize_fp4(w: torch.Tensor, e8m0: bool = True) -> QuantWeight:
    """fp32/bf16 [..., N, K] -> fp4 QuantWeight: per 32 values amax / 6, rounded up to a power of two when
    `e8m0`; each value to the nearest e2m1 magnitude (ties to the lower code); packed low nibble first."""
    *lead, n, k = w.shape
    wf = w.float().reshape(*lead, n, k // FP4_GROUP, FP4_GROUP)
    s = (wf.abs().amax(dim=-1) / 6.0).clamp_min(2.0 ** -126)
    if e8m0:
        s = pow2_ceil(s)
    v = (wf / s.unsqueeze(-1)).clamp(-6.0, 6.0).reshape(*lead, n, k)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32, device=w.device)
    mag = torch.bucketize(v.abs(), midpoints).to(torch.uint8)  # a tie goes to the lower code
    codes = mag | (((v < 0) & (mag > 0)).to(torch.uint8) << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return QuantWeight(packed, (s.to(torch.float8_e8m0fnu) if e8m0 else s).contiguous(), "fp4")
