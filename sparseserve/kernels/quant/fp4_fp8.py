"""FP4 weights on the fp8 tensor cores: Triton building blocks of the routed-expert GEMMs' third FP4 form
(select.MoeQuantConfig.fp4_fp8_mma).

An e2m1 code (sign, two exponent bits, one mantissa bit) becomes an e4m3 code by moving its three magnitude
bits to e4m3's bits 4-2 and its sign to bit 7: the e4m3 value is then exactly the e2m1 value times 2^-6
(e2m1 0.5, its one subnormal, lands on e4m3's subnormal 2^-7). Four packed bytes (eight codes) take a handful
of 32-bit logic operations on the GPU (inline PTX), so a weight element costs about one instruction before
the mma, against a dozen for the scalar decode and a bf16 upcast for tl.dot_scaled.

The per-32 scales vary along K, so each 128-column group is four K = 32 fp8 dots, each partial times its
scale (times 2^6) in fp32; the activation side is the release's e4m3 codes of the group (quantized here
from 16-bit rows, or read from act_quant / a quantizing epilogue), so every product is exact and only the
fp32 summation order differs from the reference.

Under the Triton interpreter (the CPU tests) the logic runs as Triton byte operations and the dots in fp32
on the decoded values; the compiled form uses the inline PTX, which the interpreter cannot run.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import round_e4m3

_SUB: tl.constexpr = tl.constexpr(32)  # elements per FP4 scale


@triton.jit
def e2m1_bytes_to_e4m3(b, USE_ASM: tl.constexpr):
    """Packed e2m1 bytes (uint8; the low nibble the even element) -> (even, odd) elements as e4m3 codes
    (uint8) of value * 2^-6."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            shl.b32 t, $2, 2;
            and.b32 $0, t, 0x1C1C1C1C;
            shl.b32 t, $2, 4;
            and.b32 t, t, 0x80808080;
            or.b32 $0, $0, t;
            shr.b32 t, $2, 2;
            and.b32 $1, t, 0x1C1C1C1C;
            and.b32 t, $2, 0x80808080;
            or.b32 $1, $1, t;
            }""",
            constraints="=r,=r,r", args=[b], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        lo = ((b & 7) << 2) | ((b & 8) << 4)
        hi = ((b >> 2) & 0x1C) | (b & 0x80)
    return lo, hi


@triton.jit
def _as_operand(codes, FP32: tl.constexpr):
    """e4m3 codes (float8e4nv) -> the dot's operand: themselves, or their fp32 values (the interpreter)."""
    if FP32:
        return codes.to(tl.float32)
    else:
        return codes


@triton.jit
def act_subgroup(a_row, col0, row_ok, K, inv, s, QUANT_A: tl.constexpr, UE8M0: tl.constexpr, FP32: tl.constexpr):
    """Columns col0 .. col0 + 31 of the activation rows a_row [BM, 1] -> the dot's operand [BM, 32].
    QUANT_A: 16-bit rows quantized with their group's scale s (inv = 1 / s, exact for ue8m0) to e4m3;
    else e4m3 codes read as they are."""
    offs = col0 + tl.arange(0, _SUB)
    mask = row_ok[:, None] & (offs[None, :] < K)
    a = tl.load(a_row + offs[None, :], mask=mask, other=0.0)
    if QUANT_A:
        a = a.to(tl.float32)
        if UE8M0:
            q = a * inv[:, None]
        else:
            q = a / s[:, None]
        q = round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        return _as_operand(q.to(tl.float8e4nv), FP32)
    else:
        return _as_operand(a, FP32)


@triton.jit
def act_group_scale(a_row, g, row_ok, as_ptrs, K, QUANT_A: tl.constexpr, UE8M0: tl.constexpr):
    """Group g's activation scale per row [BM] and its inverse (QUANT_A: from the rows' amax, as
    triton_common.scale_group; else read from as_ptrs, inverse unused)."""
    if QUANT_A:
        offs = g * 128 + tl.arange(0, 128)
        x = tl.load(a_row + offs[None, :], mask=row_ok[:, None] & (offs[None, :] < K), other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
        s = amax * (1.0 / 448.0)
        if UE8M0:
            bits = s.to(tl.int32, bitcast=True)
            exp = ((bits >> 23) & 0xFF) + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
            s = (exp << 23).to(tl.float32, bitcast=True)
            inv = ((254 - exp) << 23).to(tl.float32, bitcast=True)
        else:
            inv = 1.0 / s
        return s, inv
    else:
        s = tl.load(as_ptrs + g, mask=row_ok, other=0.0)
        return s, s


@triton.jit
def act_group_operands(a_row, g, row_ok, as_ptrs, K, QUANT_A: tl.constexpr, UE8M0: tl.constexpr,
                       FP32: tl.constexpr):
    """Group g of the activation rows as its scale per row [BM] and its four sub-groups' dot operands
    a0..a3 [BM, 32] (act_group_scale, act_subgroup)."""
    sa, inv = act_group_scale(a_row, g, row_ok, as_ptrs, K, QUANT_A, UE8M0)
    a0 = act_subgroup(a_row, g * 128, row_ok, K, inv, sa, QUANT_A, UE8M0, FP32)
    a1 = act_subgroup(a_row, g * 128 + 32, row_ok, K, inv, sa, QUANT_A, UE8M0, FP32)
    a2 = act_subgroup(a_row, g * 128 + 64, row_ok, K, inv, sa, QUANT_A, UE8M0, FP32)
    a3 = act_subgroup(a_row, g * 128 + 96, row_ok, K, inv, sa, QUANT_A, UE8M0, FP32)
    return sa, a0, a1, a2, a3


@triton.jit
def _sub_scale(ws_row, word, g, q: tl.constexpr, n_ok, K, W_E8M0: tl.constexpr, EVEN_K: tl.constexpr):
    """Scale of sub-group q of group g per weight row, times 2^6 (the e4m3 codes' offset), fp32 [BN]."""
    sub = g * 4 + q + tl.zeros_like(n_ok.to(tl.int32))  # [BN]: the mask stays a tensor
    if W_E8M0:
        if EVEN_K:
            e = (word >> (8 * q)) & 0xFF
        else:
            e = tl.load(ws_row + sub, mask=n_ok & (sub < K // _SUB), other=127).to(tl.int32)
        # 2^(e - 127 + 6); e = 0 is 2^-127 (here 2^-121, normal), e >= 249 saturates to inf (no real scale)
        return (tl.minimum(e + 6, 255) << 23).to(tl.float32, bitcast=True)
    else:
        return tl.load(ws_row + sub, mask=n_ok & (sub < K // _SUB), other=1.0) * 64.0


@triton.jit
def _sub_partial(a_q, w_row, g, q: tl.constexpr, n_ok, K, scale, USE_ASM: tl.constexpr, FP32: tl.constexpr):
    """a_q [BM, 32] times sub-group q of group g of the weight rows (w_row [BN, 1], packed bytes) -> fp32
    [BM, BN], its scale applied."""
    j = g * 64 + q * 16 + tl.arange(0, 16)
    b = tl.load(w_row + j[None, :], mask=n_ok[:, None] & (j[None, :] < K // 2), other=0)
    lo, hi = e2m1_bytes_to_e4m3(b, USE_ASM)
    w = tl.reshape(tl.join(lo, hi), (b.shape[0], _SUB)).to(tl.float8e4nv, bitcast=True)  # K order restored
    return tl.dot(a_q, tl.trans(_as_operand(w, FP32))) * scale[None, :]


@triton.jit
def fp4_fp8_group_partial(a0, a1, a2, a3, g, w_base, ws_base, offs_n, n_ok, K, stride_wn, stride_wsn,
                          W_E8M0: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, FP32: tl.constexpr):
    """Group g (128 columns) of the activation, as its four sub-groups' operands a0..a3 [BM, 32], times
    group g of the FP4 weight rows offs_n -> fp32 [BM, BN] with the weight's scales applied, the
    activation's not. EVEN_K (ue8m0): the group's 4 scale bytes of a row read as one int32 word."""
    rows = offs_n.to(tl.int64)
    w_row = w_base + rows[:, None] * stride_wn
    ws_row = ws_base + rows * stride_wsn
    word = 0
    if W_E8M0 and EVEN_K:
        word = tl.load(ws_base.to(tl.pointer_type(tl.int32)) + rows * (stride_wsn // 4) + g, mask=n_ok,
                       other=0x7F7F7F7F)
    acc = _sub_partial(a0, w_row, g, 0, n_ok, K, _sub_scale(ws_row, word, g, 0, n_ok, K, W_E8M0, EVEN_K),
                       USE_ASM, FP32)
    acc += _sub_partial(a1, w_row, g, 1, n_ok, K, _sub_scale(ws_row, word, g, 1, n_ok, K, W_E8M0, EVEN_K),
                        USE_ASM, FP32)
    acc += _sub_partial(a2, w_row, g, 2, n_ok, K, _sub_scale(ws_row, word, g, 2, n_ok, K, W_E8M0, EVEN_K),
                        USE_ASM, FP32)
    acc += _sub_partial(a3, w_row, g, 3, n_ok, K, _sub_scale(ws_row, word, g, 3, n_ok, K, W_E8M0, EVEN_K),
                        USE_ASM, FP32)
    return acc
