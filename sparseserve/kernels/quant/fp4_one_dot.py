"""FP4 weights as ONE K = 128 fp8 dot per group: Triton building blocks of the routed-expert GEMMs' one-dot form
(select.MoeQuantConfig.fp4_one_dot; the math and its exactness bound in formats.py's docstring).

The four-dot form (fp4_fp8.py) runs a 128-column group as four K = 32 dots, each waited for and scaled by its
sub-group's scale in fp32. Here the four sub-scales of a (row, group) become one: with e_max the group's largest
exponent and d_q = e_max - e_q, sub-group q's e2m1 values are written as the e4m3 codes of value x 2^(6 - d_q),
exact while d_q <= 14 (formats.ONE_DOT_MAX_SHIFT), and the group's partial is scaled once by 2^(e_max - 133): the
FP8 experts' loop (one dot, one scale a group) on half the weight bytes. A tensor with a wider group
(QuantWeight.fp4_one_dot_exact False, decided once at load) runs the four-dot form instead.

The codes come from an 8-entry table per (row, sub-group): entry m (an e2m1 magnitude code) is the e4m3 code of
E2M1[m] x 2^(k - 6), k = 12 - d_q, as two 32-bit words (`shift_lut`). Compiled, one `prmt` byte permute per
packed byte looks up both of its nibbles in that byte's own table (so the result never depends on which elements
Triton packs together: it need not pack neighbours), four more `prmt`s put the even and odd codes in place and
the sign bits are or-ed in: 17 logic instructions per 8 codes, against 10 for the four-dot form's fixed bit move.
Under the interpreter (USE_ASM off) the table is read with shifts and selects.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import activation_group, e8m0_to_f32


# The compiled lookup of e2m1_bytes_to_shifted_e4m3 (pack = 4): $2 four packed bytes (element j in byte j), $3..$6
# and $7..$10 the four elements' tables (lo, hi words); $0 / $1 the even / odd codes. prmt d, a, b, sel: result
# byte i is byte sel[4i+2:4i] of {b, a} (0-3 from a); selector bit 3 (sign replicate) stays clear after the mask.
# p_j: byte j's two nibbles looked up in element j's own table; q0, q1 and the last two prmts gather the even and
# odd codes; the sign bits (bit 3 and 7 of each byte) are or-ed into bit 7.
LUT_PTX: tl.constexpr = tl.constexpr("""{
            .reg .b32 m, s, p0, p1, p2, p3, q0, q1, t;
            and.b32 m, $2, 0x77777777;
            prmt.b32 p0, $3, $7, m;
            shr.b32 s, m, 8;
            prmt.b32 p1, $4, $8, s;
            shr.b32 s, m, 16;
            prmt.b32 p2, $5, $9, s;
            shr.b32 s, m, 24;
            prmt.b32 p3, $6, $10, s;
            prmt.b32 q0, p0, p1, 0x5140;
            prmt.b32 q1, p2, p3, 0x5140;
            prmt.b32 $0, q0, q1, 0x5410;
            prmt.b32 $1, q0, q1, 0x7632;
            shl.b32 t, $2, 4;
            and.b32 t, t, 0x80808080;
            or.b32 $0, $0, t;
            and.b32 t, $2, 0x80808080;
            or.b32 $1, $1, t;
            }""")


@triton.jit
def shift_lut(k):
    """k = 12 - d_q (int32, >= -2: callers clamp) -> (lo, hi) int32 words whose byte m (lo: m = 0..3, hi:
    m - 4) is the e4m3 code of E2M1[m] x 2^(k - 6), E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6.

    Where every entry of a word is normal its bytes are an arithmetic progression in k (exponent field + k):
    lo = [0, 8k, 8k + 8, 8k + 12] for k >= 1, hi = [8k + 16, 8k + 20, 8k + 24, 8k + 28] for k >= -1. The few
    subnormal entries (multiples of 2^-9) are spelled out: k = 0, -1, -2 for lo, k = -2 for hi. Entry 0 is 0 for
    every k; k < -2 gives k = -2's words (used only on all-zero sub-groups, whose codes all read entry 0)."""
    lo = tl.where(k >= 1, 0x0C080000 + k * 0x08080800,
                  tl.where(k == 0, 0x0C080400, tl.where(k == -1, 0x06040200, 0x03020100)))
    hi = tl.where(k >= -1, 0x1C181410 + k * 0x08080808, 0x0C080604)
    return lo, hi


@triton.jit
def _lut_code(nib, lut_lo, lut_hi):
    """One e2m1 code (int32 0..15) -> its table's e4m3 code with the sign bit (int32 0..255)."""
    mag = nib & 7
    word = tl.where(mag >= 4, lut_hi, lut_lo)
    return ((word >> ((mag & 3) * 8)) & 0xFF) | ((nib & 8) << 4)


@triton.jit
def e2m1_bytes_to_shifted_e4m3(b, lut_lo, lut_hi, USE_ASM: tl.constexpr):
    """Packed e2m1 bytes (uint8; the low nibble the even element) and each byte's table (int32 words, broadcast
    to b's shape) -> (even, odd) elements as e4m3 codes (uint8)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=LUT_PTX,
            constraints="=r,=r,r,r,r,r,r,r,r,r,r", args=[b, lut_lo, lut_hi], dtype=(tl.uint8, tl.uint8),
            is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        lo = _lut_code(bi & 0xF, lut_lo, lut_hi).to(tl.uint8)
        hi = _lut_code(bi >> 4, lut_lo, lut_hi).to(tl.uint8)
    return lo, hi


@triton.jit
def _max_byte(word):
    """The largest of the 4 bytes of int32 words (elementwise)."""
    return tl.maximum(tl.maximum(word & 0xFF, (word >> 8) & 0xFF), tl.maximum((word >> 16) & 0xFF, (word >> 24) & 0xFF))


@triton.jit
def group_exponents(g, ws_base, rows, n_ok, K, stride_wsn, W_E8M0: tl.constexpr, EVEN_K: tl.constexpr):
    """Group g's four sub-scale exponent fields e_q per weight row and the group's largest, each int32 [BN, 4]
    (e_max repeated along the 4): e8m0 bytes or fp32 bits 30-23. Sub-groups past K read 0, so they never raise
    e_max (their codes are masked to 0). EVEN_K with e8m0: a row's 4 bytes of the group are one int32 word, read
    by each of its (row, sub-group) elements, so e_max is a byte max in place (no reduction) and the read is
    [BN, 4] (sm_90's pipeliner copies it ahead; as a [BN] read Triton would repeat it, unpipelined, in the dot's
    layout for the scale)."""
    q = tl.arange(0, 4)
    if W_E8M0 and EVEN_K:
        words = ws_base.to(tl.pointer_type(tl.int32)) + rows * (stride_wsn // 4) + g
        word = tl.load(words[:, None] + 0 * q[None, :], mask=n_ok[:, None], other=0x7F7F7F7F)
        return (word >> (q * 8)[None, :]) & 0xFF, _max_byte(word)
    ks = g * 4 + q
    mask = n_ok[:, None] & (ks[None, :] < K // 32)
    ptrs = ws_base + rows[:, None] * stride_wsn + ks[None, :]
    if W_E8M0:
        e = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    else:
        e = (tl.load(ptrs, mask=mask, other=0.0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    return e, tl.broadcast_to(tl.max(e, axis=1)[:, None], e.shape)


@triton.jit
def one_dot_weight_group(g, w_base, ws_base, offs_n, n_ok, K, stride_wn, stride_wsn, W_E8M0: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
    """Group g (128 columns) of the FP4 weight rows offs_n -> (e4m3 codes [BN, 128] as float8e4nv, the group's
    scale 2^(e_max - 127 - 6) per row, fp32 [BN]). Exact where the tensor passes formats.fp4_one_dot_exact."""
    rows = offs_n.to(tl.int64)
    e, e_max = group_exponents(g, ws_base, rows, n_ok, K, stride_wsn, W_E8M0, EVEN_K)
    lut_lo, lut_hi = shift_lut(tl.maximum(e - e_max + 12, -2))
    scale = e8m0_to_f32(tl.max(e_max, axis=1)) * 0.015625  # 2^(e_max - 133): exact, subnormal below e_max = 7
    # The group's 64 bytes of a row as [BN, 4, 16]: sub-group q's 16 bytes meet its table [BN, 4, 1].
    j = g * 64 + tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]
    w_ptrs = w_base + rows[:, None, None] * stride_wn + j[None, :, :]
    if EVEN_K:
        b = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0)
    else:  # K is a multiple of 32: whole sub-groups in or out
        b = tl.load(w_ptrs, mask=n_ok[:, None, None] & (j[None, :, :] < (K // 32) * 16), other=0)
    lo, hi = e2m1_bytes_to_shifted_e4m3(b, lut_lo[:, :, None], lut_hi[:, :, None], USE_ASM)
    w = tl.reshape(tl.join(lo, hi), (b.shape[0], 128)).to(tl.float8e4nv, bitcast=True)  # K order restored
    return w, scale


@triton.jit
def one_dot_act_group(a_ptrs, as_ptrs, mask, row_ok, QUANT_A: tl.constexpr, UE8M0: tl.constexpr,
                      FP32: tl.constexpr):
    """One 128-column activation group as the dot's operand (e4m3 codes; FP32: their values, the interpreter)
    and its scales [BM] (triton_common.activation_group)."""
    if FP32:
        return activation_group(a_ptrs, as_ptrs, mask, row_ok, QUANT_A, UE8M0, 2, False)
    else:
        return activation_group(a_ptrs, as_ptrs, mask, row_ok, QUANT_A, UE8M0, 0, False)


@triton.jit
def fp4_one_dot_partial(a_op, g, w_base, ws_base, offs_n, n_ok, K, stride_wn, stride_wsn, W_E8M0: tl.constexpr,
                        EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, FP32: tl.constexpr):
    """a_op [BM, 128] (group g of the activation, one_dot_act_group) times group g of the FP4 weight rows offs_n
    -> fp32 [BM, BN], the weight's scale applied, the activation's not: one dot, one scale."""
    w, scale = one_dot_weight_group(g, w_base, ws_base, offs_n, n_ok, K, stride_wn, stride_wsn, W_E8M0, EVEN_K,
                                    USE_ASM)
    if FP32:
        w_op = w.to(tl.float32)
    else:
        w_op = w
    return tl.dot(a_op, tl.trans(w_op)) * scale[None, :]
