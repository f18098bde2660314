"""Triton building blocks shared by the quantized kernels: scale decoding, the release's activation
quantization of one 128-column group, e2m1 decoding, and the per-group partial products.

Rounding to e4m3 is done on the fp32 bits (round to nearest even; multiples of 2^-9 below 2^-6), not by the
fp32 -> float8e4nv cast: the Triton interpreter's cast mis-rounds values whose mantissa carries into the exponent
(31.3 -> 16 instead of 32, triton 3.6 and 3.9), and the bit rounding gives the same codes on the GPU. A value on
the e4m3 grid then converts exactly to float8e4nv, bf16 or fp32.

Dot modes (constexpr DOT, named in select.py): 0 = float8e4nv x float8e4nv tensor-core dot (Hopper), 1 = bf16 dot
(e4m3 and scaled e2m1 values are exact in bf16), 2 = fp32 dot (the interpreter, whose 16-bit dot is wrong),
3 = fp16 dot (e4m3 values are exact in fp16 and convert from e4m3 in one packed step; the linear only: scaled
e2m1 values can leave fp16's range).

FP4 partials come in two forms (constexpr SCALED_DOT, select.MoeQuantConfig.fp4_scaled_dot): `fp4_scaled_partial`
hands the packed bytes and their ue8m0 scale bytes to `tl.dot_scaled` (Triton's MX upcast: on Hopper the compiler
turns it into a packed e2m1 -> bf16 conversion, the scale multiply and the bf16 mma), `fp4_weight_partial`
decodes each nibble with scalar ops and works for fp32 scales too. Both multiply exact bf16 values.
"""
from __future__ import annotations

import triton
import triton.language as tl

INV_FP8_MAX = tl.constexpr(1.0 / 448.0)


@triton.jit
def e8m0_to_f32(b):
    """ue8m0 exponent bytes (uint8) -> 2^(b - 127) as fp32 (b = 0: 2^-127, a subnormal)."""
    bits = b.to(tl.int32) << 23
    bits = tl.where(b == 0, 0x400000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_scale(ptrs, mask, E8M0: tl.constexpr):
    """Scales as fp32 from an fp32 tensor or from e8m0 exponent bytes; 1.0 where masked."""
    if E8M0:
        return e8m0_to_f32(tl.load(ptrs, mask=mask, other=127))
    else:
        return tl.load(ptrs, mask=mask, other=1.0)


@triton.jit
def round_e4m3(v):
    """fp32 values in [-448, 448] -> the nearest e4m3 value (ties to even), still fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bias = 0x7FFFF + ((bits >> 20) & 1)
    normal = ((bits + bias) & -1048576).to(tl.float32, bitcast=True)  # clear the low 20 mantissa bits
    mag = tl.abs(v)
    sub = (mag + 24576.0) - 24576.0  # 1.5 * 2^14: the fp32 add rounds to a multiple of 2^-9
    return tl.where(mag >= 0.015625, normal, tl.where(v < 0, -sub, sub))  # the sign kept, zeros too


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """fp32 -> the nearest DTYPE value (ties to even), as fp32. bf16 on the bits: the interpreter's cast
    truncates."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(DTYPE).to(tl.float32)


@triton.jit
def pow2_ceil(s):
    """2^ceil(log2(s)) of positive normal fp32 values (the release's fast_round_scale)."""
    bits = s.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def quant_group(x, UE8M0: tl.constexpr):
    """One 128-column group of activation rows x [BM, 128] (fp32, masked columns 0) -> (codes on the e4m3
    grid as fp32 [BM, 128], scales [BM]) as the release's act_quant computes them."""
    q, s = scale_group(x, UE8M0)
    return round_e4m3(q), s


@triton.jit
def scale_group(x, UE8M0: tl.constexpr):
    """quant_group before the rounding: (x / s clamped to [-448, 448] as fp32, scales [BM])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    s = amax * INV_FP8_MAX
    if UE8M0:
        s = pow2_ceil(s)
        inv = ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)
        q = x * inv[:, None]  # exact: a power of two
    else:
        q = x / s[:, None]
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q, s


@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int32, 0..15; bit 3 the sign) -> fp32 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    mag = code & 7
    bits = (mag << 22) + (126 << 23)
    v = tl.where(mag >= 2, bits.to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
    return tl.where(code >= 8, -v, v)


@triton.jit
def as_dot_operand(v, DOT: tl.constexpr):
    """Values exact in the dot's input type -> that type."""
    if DOT == 0:
        return v.to(tl.float8e4nv)
    elif DOT == 1:
        return v.to(tl.bfloat16)
    elif DOT == 3:
        return v.to(tl.float16)
    else:
        return v.to(tl.float32)


@triton.jit
def activation_group(a_ptrs, as_ptrs, mask, row_mask, QUANT_A: tl.constexpr, UE8M0: tl.constexpr,
                     DOT: tl.constexpr, HW_ROUND: tl.constexpr):
    """One K group of the A operand -> (dot operand [BM, 128], scales [BM]).

    QUANT_A: a_ptrs point at 16-bit activations, quantized here (the decode path: no separate launch);
    else at e4m3 codes with their fp32 scales at as_ptrs (from act_quant or a quantizing epilogue).
    HW_ROUND (QUANT_A, compiled kernels only): the codes from the fp32 -> float8e4nv conversion (on sm_90 one
    packed round-to-nearest-even instruction for two values, F2FP.SATFINITE.E4M3.F32; the values are clamped
    to +-448 first) instead of round_e4m3's dozen scalar ops per value; the interpreter's conversion
    mis-rounds (module docstring)."""
    if QUANT_A:
        a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HW_ROUND:
            q, sa = scale_group(a, UE8M0)
            q8 = q.to(tl.float8e4nv)
            if DOT == 0:
                return q8, sa
            elif DOT == 3:
                return q8.to(tl.float16), sa
            else:
                return as_dot_operand(q8.to(tl.float32), DOT), sa
        q, sa = quant_group(a, UE8M0)
        return as_dot_operand(q, DOT), sa
    else:
        a = tl.load(a_ptrs, mask=mask, other=0.0)
        sa = tl.load(as_ptrs, mask=row_mask, other=0.0)
        if DOT == 0:
            return a, sa
        else:
            return as_dot_operand(a.to(tl.float32), DOT), sa


@triton.jit
def fp8_weight_partial(a_op, w_ptrs, w_mask, DOT: tl.constexpr):
    """a_op [BM, 128] times one K group of an e4m3 weight, w_ptrs [128, BN] (W^T) -> fp32 [BM, BN]
    (scales not applied)."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if DOT == 3:
        w = w.to(tl.float16)
    elif DOT != 0:
        w = as_dot_operand(w.to(tl.float32), DOT)
    return tl.dot(a_op, w)


@triton.jit
def fp4_weight_partial(a_op, w_ptrs, ws_ptrs, w_mask, W_E8M0: tl.constexpr, DOT: tl.constexpr):
    """a_op [BM, 128] times one K group of a packed e2m1 weight -> fp32 [BM, BN], the weight's per-32
    scales applied (folded into the bf16 weight values: exact), the activation's not.

    w_ptrs [BN, 64]: the group's bytes per output row; ws_ptrs [BN, 64]: each byte's scale (byte j holds
    elements 2j and 2j + 1, which share scale j // 16). The activation is split into its even and odd
    columns to meet the low and the high nibbles, so no interleave of the weight is needed."""
    b = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
    s = load_scale(ws_ptrs, w_mask, W_E8M0)
    lo = as_dot_operand(e2m1_to_f32(b & 0xF) * s, DOT)
    hi = as_dot_operand(e2m1_to_f32(b >> 4) * s, DOT)
    a_even, a_odd = tl.split(tl.reshape(a_op, (a_op.shape[0], a_op.shape[1] // 2, 2)))
    acc = tl.dot(a_even, tl.trans(lo))
    return tl.dot(a_odd, tl.trans(hi), acc)


@triton.jit
def e8m0_bytes_of_words(word):
    """int32 words [BN] holding 4 consecutive ue8m0 scale bytes (little-endian) -> uint8 [BN, 4]."""
    return ((word[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF).to(tl.uint8)


@triton.jit
def fp4_scaled_partial(a_op, b, bs):
    """a_op [BM, 128] times one K group of a packed e2m1 weight through tl.dot_scaled -> fp32 [BM, BN], the
    weight's ue8m0 scales applied, the activation's not.

    b [64, BN] uint8: the group's bytes K-major (dot_scaled takes rhs packed along K as [K/2, N], the low
    nibble the even element, as formats.py stores it); bs [BN, 4] uint8: the group's scale exponents per
    output row (rhs_scale is [N, K/32], not transposed). a_op holds e4m3-grid values (fp8, bf16 or fp32 by
    DOT), exact in bf16, so every product is exact and the sum fp32. Scale bytes 0 (2^-127) and 255 (NaN)
    are outside what this form is tested on."""
    return tl.dot_scaled(a_op.to(tl.bfloat16), None, "bf16", b, bs, "e2m1")


@triton.jit
def weight_group_partial(a_op, g, w_base, ws_base, ws_row0, offs_n, n_ok, K, stride_wn, stride_wsn,
                         FP4: tl.constexpr, W_E8M0: tl.constexpr, DOT: tl.constexpr, SCALED_DOT: tl.constexpr,
                         EVEN_K: tl.constexpr):
    """a_op [BM, 128] (K group g of the activation) times group g of the weight rows offs_n -> fp32
    [BM, BN] with the weight's scales applied. w_base/ws_base: the weight's and its scales' first row (an
    expert's, or its up half's); fp8_block scales of row n are in block row ws_row0 + n // 128.
    SCALED_DOT (FP4 with ue8m0 scales only): the tl.dot_scaled form, else the scalar decode.
    EVEN_K (FP4: K a multiple of 128, scale rows and base 4-byte aligned): loads masked by row only, and the
    dot_scaled form reads a group's 4 scale bytes of a row as one int32 word. Loaded as [BN, 4] bytes
    (BN = 64: 2 bytes a thread), the scales stay a synchronous load inside the loop on sm_90 (Triton's
    pipeliner copies ahead only loads of >= 4 bytes a thread); as words they are copied ahead with the weight."""
    rows = offs_n.to(tl.int64)
    if FP4:
        j = g * 64 + tl.arange(0, 64)
        ks = g * 4 + tl.arange(0, 4)
        w_mask = n_ok[:, None]  # [BN, 1]: broadcast by the loads
        ws_mask = n_ok[:, None]
        if not EVEN_K:  # K is a multiple of 32, so K // 2 one of 16: written so, 16-byte vectors stay provable
            w_mask = w_mask & (j[None, :] < (K // 32) * 16)
            ws_mask = ws_mask & (ks[None, :] < K // 32)
        if SCALED_DOT:
            tl.static_assert(W_E8M0, "the dot_scaled FP4 form needs ue8m0 weight scales")
            # The transpose of the [N, K/2] rows by pointer arithmetic: dot_scaled's rhs is [K/2, N].
            b = tl.load(w_base + rows[None, :] * stride_wn + j[:, None], mask=tl.trans(w_mask), other=0)
            if EVEN_K:  # the group's 4 scale bytes of a row as one word: the pipeliner copies them ahead
                words = ws_base.to(tl.pointer_type(tl.int32)) + rows * (stride_wsn // 4) + g
                bs = e8m0_bytes_of_words(tl.load(words, mask=n_ok, other=0x7F7F7F7F))
            else:  # masked scales are 2^0
                bs = tl.load(ws_base + rows[:, None] * stride_wsn + ks[None, :], mask=ws_mask, other=127)
            return fp4_scaled_partial(a_op, b, bs)
        else:
            w_ptrs = w_base + rows[:, None] * stride_wn + j[None, :]
            ws_ptrs = ws_base + rows[:, None] * stride_wsn + (j // 16)[None, :]
            return fp4_weight_partial(a_op, w_ptrs, ws_ptrs, w_mask, W_E8M0, DOT)
    else:
        offs_k = g * 128 + tl.arange(0, 128)
        mask = (offs_k[:, None] < K) & n_ok[None, :]
        part = fp8_weight_partial(a_op, w_base + rows[None, :] * stride_wn + offs_k[:, None], mask, DOT)
        sb = load_scale(ws_base + (ws_row0 + offs_n // 128) * stride_wsn + g, n_ok, W_E8M0)
        return part * sb[None, :]
