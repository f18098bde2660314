"""Triton pieces of the FP8 KV cache (layout: sparseserve/kv_format.py, docs/kv-cache.md): quantizing a row where
a kernel writes it (the fresh window rows in `norm_rope`, the compressed entries in the compressor) and
dequantizing a gathered tile where a kernel reads it (attention, the indexer scores).

Rounding is done on the fp32 bits (`quant/triton_common.py`), so the interpreter and the GPU produce the codes the
plain-PyTorch reference (`kv_format.quantize_kv_rows`) produces, bit for bit. Packed rows are addressed through
one uint8 pointer with the row stride in bytes (a multiple of 16): the rope half and the scales are reached by
casting that pointer, so every part of a row comes from the same 16-byte-aligned row.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .quant.triton_common import INV_FP8_MAX, e8m0_to_f32, pow2_ceil, round_e4m3, round_to

GROUP = tl.constexpr(64)  # kv_format.FP8_KV_GROUP
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def _pow2_exponent(amax):
    """ue8m0 exponent bytes (int32) of 2^ceil(log2(max(amax, 1e-4) / 448))."""
    s = pow2_ceil(tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX)
    return (s.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _inv_pow2(e):
    """2^(127 - e) for exponent bytes e (the exact inverse of the scale)."""
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def store_kv_row(row_ptr, v, DIM, NOPE: tl.constexpr, SCALE_OFF: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Quantize one KV row v (fp32 [BLOCK], its values already rounded to the unquantized cache's dtype;
    BLOCK a power of two >= 64) and store it packed at row_ptr (uint8): e4m3 codes of the nope channels, one
    ue8m0 scale byte per 64 of them, the rope channels in bf16."""
    cols = tl.arange(0, BLOCK)
    nope = tl.where(cols < NOPE, v, 0.0)
    groups = tl.reshape(tl.abs(nope), [BLOCK // GROUP, GROUP])
    exps = _pow2_exponent(tl.max(groups, axis=1))  # [BLOCK // GROUP]
    inv = tl.reshape(tl.broadcast_to(_inv_pow2(exps)[:, None], [BLOCK // GROUP, GROUP]), [BLOCK])
    codes = round_e4m3(tl.minimum(tl.maximum(nope * inv, -448.0), 448.0))
    tl.store(row_ptr.to(tl.pointer_type(tl.float8e4nv)) + cols, codes.to(tl.float8e4nv), mask=cols < NOPE)
    rope = round_to(v, tl.bfloat16).to(tl.bfloat16)
    rope_ptr = (row_ptr + NOPE).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr + (cols - NOPE), rope, mask=(cols >= NOPE) & (cols < DIM))
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(row_ptr + SCALE_OFF + g, exps.to(tl.uint8), mask=g * GROUP < NOPE)


@triton.jit
def load_kv_tile(kv_ptr, rows, valid, stride, offs_d, DIM, NOPE: tl.constexpr,
                 SCALE_OFF: tl.constexpr, DTYPE: tl.constexpr):
    """Gathered packed rows -> their values in DTYPE [BN, BD] (0 where not valid or past DIM), exact. rows:
    int64 [BN] row ids, stride: the row stride in bytes. The product is taken per element in fp32 (the
    interpreter's 16-bit arithmetic is wrong) and rounded to DTYPE, exactly."""
    base = kv_ptr + rows[:, None] * stride
    cols = offs_d[None, :]
    is_nope = valid[:, None] & (cols < NOPE)
    codes = tl.load(base.to(tl.pointer_type(tl.float8e4nv)) + cols, mask=is_nope, other=0.0)
    exps = tl.load(base + SCALE_OFF + cols // GROUP, mask=is_nope, other=127)
    rope = tl.load((base + NOPE).to(tl.pointer_type(tl.bfloat16)) + (cols - NOPE),
                   mask=valid[:, None] & (cols >= NOPE) & (cols < DIM), other=0.0)
    return tl.where(cols < NOPE, codes.to(tl.float32) * e8m0_to_f32(exps), rope.to(tl.float32)).to(DTYPE)


@triton.jit
def quant_index_row(v, mask):
    """One indexer key (fp32 [BLOCK], masked channels ignored) -> (codes on the e4m3 grid as fp32, the scale: a
    power of two, fp32)."""
    x = tl.where(mask, v, 0.0)
    e = _pow2_exponent(tl.max(tl.abs(x), axis=0))
    codes = round_e4m3(tl.minimum(tl.maximum(x * _inv_pow2(e), -448.0), 448.0))
    return codes, (e << 23).to(tl.float32, bitcast=True)


def fp8_block(block: int) -> int:
    """A row block that holds whole scale groups (the packed-row helpers need BLOCK >= 64)."""
    return max(block, 64, triton.next_power_of_2(block))
