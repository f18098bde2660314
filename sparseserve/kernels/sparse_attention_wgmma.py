"""Hopper (sm_90) kernel for the 64-head path of gathered-row MQA with a sink, written in Gluon.

Same contract as `sparse_attention.sparse_mqa_attention_ref` (the plain-PyTorch reference beside
it, and the CPU path); only the programs that take 64 heads at once come here (big decode batches,
prefill). The Triton kernel in `sparse_attention.py` stays the path of every other shape, of the
CPU interpreter and of GPUs other than Hopper.

Why a second kernel. The Triton kernel's 64-head variant reaches 17-31% of the bf16 rate
(docs/performance.md, "What limits it"): Triton's pipeliner leaves the indirect row gather as a
synchronous load, so every tile pays two dependent memory round trips, and its layout for the
chained dots ([8, 1] warps for a 64-row product) makes both warpgroups compute the same QK^T.
Gluon states layouts and copies explicitly, so here:
  * rows are gathered with cp.async straight into a ring of STAGES shared-memory tiles, issued
    STAGES - 1 tiles ahead, and the row ids one tile further ahead still, so neither the ids nor
    the rows are waited for by the math of the current tile;
  * both products are wgmma on shared-memory operands with warps [4, 2]: QK^T splits the tile's
    rows between the two warpgroups (no duplicate), PV splits the 512 value columns; the
    probabilities pass from one to the other through a small shared tile.

Roofline: as in `sparse_attention.py` (bytes = 2*L*D + 4*H*D per token, FLOPs = 4*H*L*D).

Shapes it takes: D = 512 (V4), heads a multiple of 64, bf16 or fp16. One program per (token,
64-head block, split of the row list); splits write the same partials as the Triton kernel and its
merge kernel combines them. Every choice comes from static shapes (graph-safe); each program reads
its valid band [first, last + 1) from the band pre-pass of `sparse_attention.py`.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .pdl import pdl_args

try:  # Gluon ships with triton >= 3.5; the stacks we support (3.6, 3.9) have it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, warpgroup_mma, warpgroup_mma_wait)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves every shape
    _HAVE_GLUON = False

HEAD_BLOCK = 64  # heads per program: the M of both wgmma products
HEAD_DIM = 512


if _HAVE_GLUON:
    # Renamed between the supported versions (3.6 -> 3.9); both take (smem, pointers, mask).
    _async_gather = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def wait_for_prior_grid(PDL: gl.constexpr):
        """Gluon twin of kernels/pdl.py's wait (a Gluon kernel cannot call a @triton.jit function)."""
        if PDL >= 1:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @gluon.jit
    def _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, stage):
        """cp.async of rows r (ids in the gather layout) into ring slot `stage`; -1 rows are
        masked (no memory traffic) and land as zeros. One commit group per tile."""
        row_ptr = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        _async_gather(kv_smem.index(stage), row_ptr + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(r >= 0, 1))
        _cp.commit_group()

    @gluon.jit
    def _sparse_mqa_wgmma_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, head_blocks,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale,  # scale * log2(e): logits are kept in base 2
        NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        gather_layout: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
        tile_smem: gl.constexpr, p_smem_layout: gl.constexpr,
        PDL: gl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        BLOCK_H: gl.constexpr = 64
        D: gl.constexpr = 512
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        pid = gl.program_id(0)
        per_token = head_blocks * NUM_SPLITS
        tok = (pid // per_token).to(gl.int64)
        hb = (pid % per_token) // NUM_SPLITS
        split = pid % NUM_SPLITS

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D], tile_smem)
        kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], tile_smem)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_smem_layout)

        # q: one cp.async group ahead of the first rows (groups complete in order).
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, gather_layout))
        offs_qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gather_layout))
        q_rows = q_ptr + tok * stride_qt + gl.expand_dims(offs_qh.to(gl.int64) * stride_qh, 1)
        _async_gather(q_smem, q_rows + gl.expand_dims(offs_d, 0))
        _cp.commit_group()

        band = band_ptr + (tok * NUM_SPLITS + split) * 2
        row_start = gl.load(band)
        row_end = gl.load(band + 1)
        rows_base = rows_ptr + tok * stride_rt
        offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_layout))
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        # Prologue: tiles 0 .. STAGES-2 in flight; the ids of tile STAGES-1 in registers.
        for t in gl.static_range(STAGES - 1):
            offs = row_start + t * BLOCK_N + offs_g
            r = gl.load(rows_base + offs, mask=offs < row_end, other=-1)
            _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, t)
        offs = row_start + (STAGES - 1) * BLOCK_N + offs_g
        r_ahead = gl.load(rows_base + offs, mask=offs < row_end, other=-1)

        # The running max starts at the sink logit and the sum at exp(sink - max) = 1, so the sink
        # is in the denominator from the start; only split 0 counts it (the merge adds the rest).
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        m_sink = gl.load(sinks_ptr + offs_h).to(gl.float32) * 1.4426950408889634
        m_i = m_sink
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout)) + (split == 0).to(gl.float32)
        acc = gl.zeros([BLOCK_H, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        l_cols = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)

        num_tiles = gl.cdiv(row_end - row_start, BLOCK_N)
        for i in range(num_tiles):
            stage = i % STAGES
            # Tile i has landed once at most STAGES - 2 younger groups are pending; the barrier
            # makes every thread's copies visible and tells us all warps are done with tile i - 1
            # (its ring slot and the probabilities tile are free again).
            _cp.wait_group(STAGES - 2)
            _cta_barrier()
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
            k_tile = kv_smem.index(stage)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # While the tensor cores run QK^T: refill the slot tile i - 1 left, fetch ids ahead.
            _issue_gather(kv_smem, kv_ptr, stride_kv, r_ahead, offs_d, (i + STAGES - 1) % STAGES)
            offs = row_start + (i + STAGES) * BLOCK_N + offs_g
            r_ahead = gl.load(rows_base + offs, mask=offs < row_end, other=-1)
            offs_t = row_start + i * BLOCK_N + offs_s
            r_s = gl.load(rows_base + offs_t, mask=offs_t < row_end, other=-1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))  # the one cross-warpgroup reduction per tile
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            # The row sums stay per column until the end (no second reduction per tile).
            l_cols = l_cols * gl.expand_dims(alpha, 1) + p
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()  # both warpgroups' halves of p are in place before either multiplies
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            acc = warpgroup_mma(p_smem, k_tile, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        l_i = l_i * gl.exp2(m_sink - m_i) + gl.sum(l_cols, 1)
        _cp.wait_group(0)  # nothing may still write shared memory when the program exits

        offs_oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        offs_od = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        if NUM_SPLITS == 1:
            out = acc / gl.expand_dims(l_o, 1)
            out_rows = out_ptr + tok * stride_ot + gl.expand_dims(offs_oh.to(gl.int64) * stride_oh, 1)
            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(dtype))
        else:
            # Partials as the Triton kernel writes them: acc [T, S, H, D], (max, sum) [T, S, 2, H], fp32.
            part = tok * NUM_SPLITS + split
            acc_rows = part_acc_ptr + (part * num_heads + gl.expand_dims(offs_oh, 1)) * D
            gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc)
            gl.store(part_ml_ptr + part * 2 * num_heads + offs_h, m_i)
            gl.store(part_ml_ptr + part * 2 * num_heads + num_heads + offs_h, l_i)


def wgmma_supported(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether this kernel can serve the call: Hopper, D = 512, heads in blocks of 64, 16-bit."""
    if not _HAVE_GLUON or q.device.type != "cuda" or q.dim() != 3:
        return False
    _, num_heads, head_dim = q.shape
    return (_is_hopper(q.device) and head_dim == HEAD_DIM and num_heads % HEAD_BLOCK == 0
            and q.dtype in (torch.bfloat16, torch.float16) and kv_pool.dtype == q.dtype
            and kv_pool.shape[-1] == HEAD_DIM)


def _is_hopper(device: torch.device) -> bool:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _layouts(block_n: int):
    gather = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # 16-byte cp.async per thread
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 16])
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    tile = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p = gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n * 2), element_bitwidth=16, rank=2)
    return gather, s, o, tile, p


def launch_wgmma_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                           block_n: int, stages: int, num_splits: int) -> None:
    """Launch the kernel. The caller (`sparse_attention.sparse_mqa_attention_triton`) has checked
    `wgmma_supported`, made the last dims contiguous and run the band pre-pass for rows cut into
    `num_splits` pieces; with splits, its merge kernel combines the partials."""
    num_tokens, num_heads, _ = q.shape
    head_blocks = num_heads // HEAD_BLOCK
    gather, s, o, tile, p = _layouts(block_n)
    _sparse_mqa_wgmma_kernel[(num_tokens * head_blocks * num_splits,)](
        q, kv_pool, rows, band, sinks, out, part_acc, part_ml,
        num_heads, head_blocks,
        q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1),
        qk_scale,
        NUM_SPLITS=num_splits, BLOCK_N=block_n, STAGES=stages,
        gather_layout=gather, s_layout=s, o_layout=o, tile_smem=tile, p_smem_layout=p,
        num_warps=8, **pdl_args(q.device),
    )
