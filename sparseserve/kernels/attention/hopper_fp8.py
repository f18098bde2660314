"""Packed FP8 KV rows in the role-split Hopper kernel (`hopper.py`, FP8=True): the loading role's dequantizing
gather, and whether the kernel can serve a call on FP8 rows.

Layout (sparseserve/kv_format.py, docs/kv-cache.md), V4 only (head_dim 512, rope 64): one 592-byte row, codes of
channels 0..447 (e4m3) at bytes 0..447, the rope channels 448..511 in bf16 at bytes 448..575, one ue8m0 scale per
64 nope channels at bytes 576..582. Every 64-column chunk of a row is then one scale group or the rope part, which
is what the gather below walks.

In the bf16 form each output warpgroup regathers its 256-column half of a ring slot by cp.async. In the FP8 form it
loads the half's codes (and, for the upper half, the rope part) and their scales into registers, 64 columns at a
time, multiplies code by scale in fp32 (exact: an e4m3 code times a power of two), packs to bf16 and stores the
chunk into the slot in the slot's own (128-byte swizzled) layout. The slot then holds exactly the dequantized row,
so the score warpgroup's QK^T and the PV products are the bf16 kernel's. The same arithmetic as
`kv_fp8.load_kv_tile` (a Gluon kernel cannot call a @triton.jit function, so this is its twin), checked against
`kv_format.dequantize_kv_rows` through the attention reference (tests/test_kv_fp8_gpu.py).
"""
from __future__ import annotations

import torch

from ...kv_format import KVFormat
from .hopper_common import HAVE_GLUON, HEAD_BLOCK, HEAD_DIM, hopper_enabled

FP8_FORMAT = KVFormat(HEAD_DIM, 64)  # the one layout this form reads
FP8_NOPE = FP8_FORMAT.nope_dim  # 448
FP8_SCALE_OFF = FP8_FORMAT.scale_offset  # 576

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from .hopper_common import cta_barrier

    # [64 rows, 64 columns] of a 4-warp partition: 16 consecutive codes (one 16-byte load) per thread, 4 threads a
    # row, 32 rows a pass; a row's scale byte is then one load per (thread, row).
    FP8_CHUNK_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 32], [16, 2], [4, 1], [1, 0]))
    _NOPE = gl.constexpr(FP8_NOPE)
    _SCALE_OFF = gl.constexpr(FP8_SCALE_OFF)

    @gluon.jit
    def _dequant_chunk(row_base, valid, offs_c, col0: gl.constexpr, NOPE: gl.constexpr, SCALE_OFF: gl.constexpr):
        """Columns col0..col0 + 63 of the rows at row_base ([64, 1] uint8 pointers) in bf16, 0 where not valid: a
        scale group (codes x 2^(scale - 127)) or, past NOPE, the rope part as stored."""
        if col0 < NOPE:
            codes = gl.load(row_base.to(gl.pointer_type(gl.float8e4nv)) + col0 + offs_c, mask=valid, other=0.0)
            e = gl.load(row_base + SCALE_OFF + col0 // 64, mask=valid, other=127)  # [64, 1] ue8m0 bytes
            scale = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)
            return (codes.to(gl.float32) * scale).to(gl.bfloat16)
        else:
            rope = (row_base + NOPE).to(gl.pointer_type(gl.bfloat16))
            return gl.load(rope + (col0 - NOPE) + offs_c, mask=valid, other=0.0)

    @gluon.jit
    def gather_cols_fp8(dst, kv_ptr, stride_kv, r, ready, HALF: gl.constexpr, AFTER_STORE: gl.constexpr):
        """Dequantize columns HALF * 256 .. + 255 of the packed rows r (ids [64] in FP8_CHUNK_LAYOUT's row slice; -1
        rows are not read and land as zeros) into dst ([64, 256] bf16, swizzled), in four 64-column chunks, then
        arrive once on `ready` (this partition's stores made visible to the async proxy first). AFTER_STORE: dst's
        columns are leaving by TMA (four 64-column boxes, in order): chunk c is stored only once box c has been read,
        its loads issued before that wait."""
        layout: gl.constexpr = FP8_CHUNK_LAYOUT
        offs_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
        row_base = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        valid = gl.expand_dims(r >= 0, 1)
        for c in gl.static_range(4):
            v = _dequant_chunk(row_base, valid, offs_c, HALF * 256 + c * 64, _NOPE, _SCALE_OFF)
            if AFTER_STORE:
                tma.store_wait(3 - c)
                cta_barrier()  # the issuing thread has seen box c read
            dst.slice(c * 64, 64, dim=1).store(v)
        fence_async_shared()  # generic-proxy writes, read by wgmma (async proxy)
        cta_barrier()  # every warp's chunks are written before the one arrival
        mbarrier.arrive(ready)


def hopper_fp8_supported(q: torch.Tensor, kv_pool: torch.Tensor, kv_format: KVFormat | None) -> bool:
    """Whether the role-split kernel's FP8 form can serve the call: Hopper, bf16 q [T, 64k heads, 512], packed rows
    of V4's layout (`FP8_FORMAT`) in a uint8 pool whose rows start 16-byte aligned; and not turned off
    (SPARSESERVE_DISABLE_KERNELS=attention_hopper). bf16 q only: the dequantized values are exact in bf16, not
    always in fp16."""
    if kv_format != FP8_FORMAT or not hopper_enabled(q) or q.dim() != 3:
        return False
    _, num_heads, head_dim = q.shape
    return (head_dim == HEAD_DIM and num_heads % HEAD_BLOCK == 0 and q.dtype == torch.bfloat16
            and kv_pool.dtype == torch.uint8 and kv_pool.dim() == 2 and kv_pool.shape[1] == FP8_FORMAT.row_bytes
            and kv_pool.stride(1) == 1 and kv_pool.stride(0) % 16 == 0 and kv_pool.data_ptr() % 16 == 0
            and q.stride(-1) == 1 and q.data_ptr() % 16 == 0
            and all(stride % 16 == 0 for size, stride in zip(q.shape[:-1], q.stride()[:-1]) if size > 1))
