"""Hopper (sm_90) kernel of gathered-row MQA with a sink, written in Gluon: the 64-head shapes of V4, unsplit calls.

Same contract as `reference.sparse_mqa_attention_ref` (the plain-PyTorch reference and CPU path); `select.py` sends
a call here when the shapes fit (`hopper_supported`: D = 512, heads in blocks of 64, 16-bit), there are enough
(token, 64-head) programs and the row list is not split (split calls take `hopper_split.py`); every other shape, GPUs other than Hopper and the CPU interpreter take the portable
Triton kernel (`triton_kernel.py`).

Why a kernel of its own. Triton's pipeliner leaves the indirect row gather of a 64-head tile as a synchronous load,
so every tile pays two dependent memory round trips, and its layout for the chained dots makes both warpgroups
compute the same QK^T (docs/performance.md). Gluon states copies and layouts explicitly, so here:
  * the work is cut into units (token x 64-head block x split of the row list); one persistent program per SM walks
    its units as one stream of 64-row tiles, so a unit's q and first rows load while the previous unit finishes;
  * the three warpgroups of a program take roles (FlashAttention-3's producer/consumer split, with the score side
    as the producer). The score warpgroup (the default partition) runs each tile's QK^T (m64n64 over q's two column
    halves), masks, keeps the running max and row sums, and hands the tile's 16-bit probabilities p and the
    rescale factor alpha to the others through a double-buffered shared tile, then starts the next tile. It loads
    the next unit's q once its last QK^T of a unit is done (by TMA where q is contiguous, else by cp.async) and
    writes a split's (max, sum). Two output warpgroups each own 256 of the 512 value columns
    (acc = acc * alpha + p v[:, own]) and regather their column half of a ring slot (two 64-row slots) by
    cp.async as soon as their PV on it is done;
  * a unit's output (or a split's normalised 16-bit partial) is written into the finished slot and leaves by TMA
    in four 64-column boxes; each box's columns are regathered as soon as the TMA engine has read it.
Barriers (mbarriers): kv_ready[slot] (256 cp.async arrivals, one per output-warpgroup thread), p_ready[buf] (1),
p_free[buf] (2), l_ready (1), l_free (2) and q_ready (the TMA's bytes); a barrier's phase parity is its use count.

FP8 form (FP8, packed FP8 KV rows of V4's 592-byte layout; `hopper_fp8.py`): the output warpgroups, instead of
cp.async, load their column half's e4m3 codes and scales (the upper half also the bf16 rope part), dequantize them
in registers and store the bf16 tile into their half of the slot, then arrive once each on kv_ready (count 2); the
score warpgroup and both products are the bf16 form's. The output warpgroups take FP8_WORKER_REGS. With FP8 False
the kernel compiles to the same code as without the switch.

Each unit walks its valid band [first, last + 1) from the band pre-pass of `triton_kernel.py` (BAND), except where
every split is one tile (small decode batches): those units walk their split's whole segment and tell an all-holes
split from its row ids, which saves the pre-pass launch. An empty split (all holes, split > 0) writes
(max -inf, sum 0), and no output where its span is empty: the merge gives it weight 0 and never reads it.

Resources: 4 + 4 + 4 warps, one program per SM, 214 KB of shared memory (q 64 KB, two 64 KB slots, two 8 KB p
tiles), 168 registers per warpgroup (setmaxnreg; `tools/kernel_resources.py` checks the spills offline).
Roofline: bytes = 2*L*D + 4*H*D per token, FLOPs = 4*H*L*D.
"""
from __future__ import annotations

import triton

from ..pdl import pdl_args
from .hopper_common import HEAD_BLOCK, HAVE_GLUON, out_descriptor, q_descriptor

WORKER_REGS = 168  # registers of each output warpgroup (setmaxnreg); the score warpgroup gets the rest, also 168
# FP8 form: the dequantizing gather's loads and conversions live beside the [64, 256] fp32 accumulator. Under
# Triton 3.9 the output warpgroups then take 184 (at 168 they spill 40 B of loop-invariant addresses; the score
# warpgroup gets the rest, 136); Triton 3.6 (the H200's stack) fits them in 168, and at 184 spills in the score
# warpgroup. `tools/kernel_resources.py --hopper-fp8` measures both (16 B of stack each).
FP8_WORKER_REGS = 184 if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9) else WORKER_REGS

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .hopper_common import (
        async_gather, cta_barrier, issue_q, next_tile, rows_scaled, store_ml, tile_ids, tma_load_async,
        tma_store_async, unit_row_sum, unit_sink, unit_span, wait_for_prior_grid)
    from .hopper_fp8 import FP8_CHUNK_LAYOUT, gather_cols_fp8

    @gluon.jit
    def _unit_empty(rows_ptr, stride_rt, unit, start, end, units_per_token, BLOCK_N: gl.constexpr,
                    BAND: gl.constexpr):
        """Whether a unit has no valid row: an empty band, or (no band: one tile) only holes. Without a band every
        thread of the 4-warp partition reads all BLOCK_N ids itself, 16 at a time (the same addresses across a warp:
        L1 hits), so no warp waits for another and few registers are held: a cross-warp reduction of the ids, or all
        64 at once, made ptxas spill."""
        if BAND:
            return end <= start
        else:
            chunk: gl.constexpr = gl.BlockedLayout([16], [32], [4], [0])
            offs = gl.arange(0, 16, layout=chunk)
            top = gl.max(tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token, offs, BLOCK_N), 0)
            for c in gl.static_range(1, BLOCK_N // 16):
                ids = tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token, offs + c * 16, BLOCK_N)
                top = gl.maximum(top, gl.max(ids, 0))
            return top < 0

    @gluon.jit
    def _store_unit(out_ptr, part_acc_ptr, acc, l_i, tok, split, heads, num_heads, stride_ot, stride_oh, empty,
                    offs_oh, offs_od, NUM_SPLITS: gl.constexpr):
        """A finished unit's result stored from registers (where no TMA descriptor fits): the normalised output of
        its heads' columns offs_od (one split), or its split's normalised partial [T, S, H, 512] (none where its span
        is empty)."""
        if NUM_SPLITS == 1:
            out = rows_scaled(acc, l_i, offs_oh)
            out_rows = out_ptr + tok * stride_ot + gl.expand_dims((heads + offs_oh).to(gl.int64) * stride_oh, 1)
            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))
        else:
            if not (empty & (split > 0)):
                part = tok * NUM_SPLITS + split
                acc_rows = part_acc_ptr + (part * num_heads + heads + gl.expand_dims(offs_oh, 1)) * 512
                acc = rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
                gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc.to(part_acc_ptr.dtype.element_ty))

    @gluon.jit
    def _load_q(q_desc, q_lo, q_hi, q_ready, q_ptr, unit, num_heads, units_per_token, stride_qt, stride_qh, offs_qh,
                offs_lo, NUM_SPLITS: gl.constexpr, Q_TMA: gl.constexpr):
        """The unit's 64 query heads into q_lo / q_hi: by TMA (eight 64 x 64 boxes, one issuing thread, landing on
        q_ready) where q is contiguous, else by cp.async from every thread (one commit group)."""
        if Q_TMA:
            tok = unit // units_per_token
            row0 = tok * num_heads + ((unit % units_per_token) // NUM_SPLITS) * 64
            mbarrier.expect(q_ready, 64 * 512 * 2)
            for c in gl.static_range(4):
                tma_load_async(q_desc, [row0, c * 64], q_ready, q_lo.slice(c * 64, 64, dim=1))
                tma_load_async(q_desc, [row0, 256 + c * 64], q_ready, q_hi.slice(c * 64, 64, dim=1))
        else:
            issue_q(q_lo, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo, NUM_SPLITS)
            issue_q(q_hi, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo + 256, NUM_SPLITS)

    @gluon.jit
    def _score_partition(
        q_ptr, rows_ptr, band_ptr, sinks_ptr, part_ml_ptr, num_heads, num_units, units_per_token, num_rows,
        stride_qt, stride_qh, stride_rt, qk_scale, q_desc,
        q_lo, q_hi, kv_lo, kv_hi, p_smem, alpha_smem, l_smem,
        kv_ready, p_ready, p_free, l_ready, l_free, q_ready,
        NUM_SPLITS: gl.constexpr, Q_TMA: gl.constexpr, BAND: gl.constexpr,
    ):
        BLOCK_H: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 64
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        vec_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        num_programs = gl.num_programs(0)
        offs_lo = gl.arange(0, 256, layout=gl.SliceLayout(0, gather_layout))
        offs_qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gather_layout))
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        offs_sh = gl.arange(0, BLOCK_H, layout=vec_layout)

        cu = gl.program_id(0)
        ct = 0
        c_start, c_end = unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        _load_q(q_desc, q_lo, q_hi, q_ready, q_ptr, cu, num_heads, units_per_token, stride_qt, stride_qh, offs_qh,
                offs_lo, NUM_SPLITS, Q_TMA)
        hb, m_sink = unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
        m_i = m_sink
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        r_s = tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_s, BLOCK_N)

        j = 0  # tiles done: ring slot and p buffer j % 2, use count j // 2
        uc = 0  # units done: the parity of l_ready / l_free
        while cu < num_units:
            b = j % 2
            if ct == 0:  # the unit's q has landed
                if Q_TMA:
                    mbarrier.wait(q_ready, uc & 1)
                else:  # (this partition's only cp.async)
                    _cp.wait_group(0)
                    cta_barrier()
            mbarrier.wait(kv_ready.index(b), (j // 2) & 1)
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
            s = warpgroup_mma(q_lo, kv_lo.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_hi, kv_hi.index(b).permute((1, 0)), s, is_async=True)
            n_tiles = gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            last = ct + 1 >= n_tiles
            nu = cu + num_programs
            # The next tile's ids (for its mask), fetched under this QK^T.
            nt_u = gl.where(last, nu, cu)
            nt_t = gl.where(last, 0, ct + 1)
            nt_start, nt_end = unit_span(band_ptr, nt_u, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                          BAND)
            nt_start = gl.where(last, nt_start, c_start)
            nt_end = gl.where(last, nt_end, c_end)
            r_next = tile_ids(rows_ptr, stride_rt, nt_u, nt_t, nt_start, nt_end, units_per_token, offs_s, BLOCK_N)
            hb_next, m_sink_next = unit_sink(sinks_ptr, nu, units_per_token, offs_sh, NUM_SPLITS)  # (cached reads)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            if last & (nu < num_units):  # q is free: load the next unit's, under this softmax
                cta_barrier()  # every warp's QK^T is done with q
                _load_q(q_desc, q_lo, q_hi, q_ready, q_ptr, nu, num_heads, units_per_token, stride_qt, stride_qh,
                        offs_qh, offs_lo, NUM_SPLITS, Q_TMA)

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # p buffer b was last read by the PV of tile j - 2.
            mbarrier.wait(p_free.index(b), ((j // 2) + 1) & 1, pred=j >= 2)
            p_smem.index(b).store(p.to(dtype))
            alpha_smem.index(b).store(alpha)
            fence_async_shared()  # p is read by wgmma (async proxy)
            cta_barrier()  # every warp's part is written before the one arrival
            mbarrier.arrive(p_ready.index(b))

            if last:
                split = cu % NUM_SPLITS
                l_fin = unit_row_sum(l_i, m_i, m_sink, split)
                if NUM_SPLITS > 1:
                    tok = (cu // units_per_token).to(gl.int64)
                    store_ml(part_ml_ptr, tok * NUM_SPLITS + split, hb * BLOCK_H, num_heads, offs_sh, m_i, l_fin,
                              _unit_empty(rows_ptr, stride_rt, cu, c_start, c_end, units_per_token, BLOCK_N, BAND)
                              & (split > 0))
                mbarrier.wait(l_free, (uc + 1) & 1, pred=uc >= 1)
                l_smem.store(l_fin)
                cta_barrier()
                mbarrier.arrive(l_ready)
                cu = nu
                ct = 0
                c_start = nt_start
                c_end = nt_end
                hb = hb_next
                m_sink = m_sink_next
                m_i = m_sink
                l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
                uc = uc + 1
            else:
                ct = ct + 1
            r_s = r_next
            j = j + 1
        _cp.wait_group(0)

    @gluon.jit
    def _gather_cols(dst, kv_ptr, stride_kv, r, offs_d, ready):
        """cp.async of one column half ([64 rows, 256]) of rows r into dst; -1 rows masked (no traffic, land as
        zeros). Each thread's copies arrive on `ready` when they have landed."""
        row_ptr = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        async_gather(dst, row_ptr + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(r >= 0, 1))
        _cp.mbarrier_arrive(ready, increment_count=False)
        _cp.commit_group()  # also a group, so that the program's last wait_group covers it

    @gluon.jit
    def _gather_cols_after_store(slot, kv_ptr, stride_kv, r, offs_d, ready):
        """The regather of a slot half that a unit's output is leaving by TMA (four 64-column boxes, issued in order):
        each 64-column chunk is copied as soon as the TMA engine has read that chunk's box, so the copies overlap
        the later boxes' reads. r: the rows, offs_d: 64 column offsets, both in a [64, 64] gather layout."""
        row_ptr = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        for c in gl.static_range(4):
            tma.store_wait(3 - c)
            cta_barrier()  # the issuing thread has seen box c read
            async_gather(slot.slice(c * 64, 64, dim=1), row_ptr + gl.expand_dims(offs_d + c * 64, 0),
                          mask=gl.expand_dims(r >= 0, 1))
        _cp.mbarrier_arrive(ready, increment_count=False)
        _cp.commit_group()

    @gluon.jit
    def _output_partition(
        kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads, num_units, units_per_token,
        num_rows, stride_kv, stride_rt, stride_ot, stride_oh, out_desc,
        kv_mine, p_smem, alpha_smem, l_smem,
        kv_ready, p_ready, p_free, l_ready, l_free,
        NUM_SPLITS: gl.constexpr, HALF: gl.constexpr, OUT_TMA: gl.constexpr, BAND: gl.constexpr,
        FP8: gl.constexpr,
    ):
        BLOCK_H: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 64
        DH: gl.constexpr = 256
        if FP8:
            dtype: gl.constexpr = gl.bfloat16  # the dequantized values' (hopper_fp8.py)
        else:
            dtype: gl.constexpr = kv_ptr.dtype.element_ty
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        chunk_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] pieces
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DH, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        num_programs = gl.num_programs(0)
        offs_d = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, gather_layout))
        if FP8:  # row ids in the dequantizing gather's layout (hopper_fp8.py)
            offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, FP8_CHUNK_LAYOUT))
        else:
            offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_layout))
            offs_gc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, chunk_layout))
        offs_dc = HALF * DH + gl.arange(0, 64, layout=gl.SliceLayout(0, chunk_layout))
        offs_oh = gl.arange(0, BLOCK_H, layout=row_layout)
        offs_od = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))

        cu = gl.program_id(0)
        ct = 0
        c_start, c_end = unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        # The stream's first two tiles, one per ring slot; `g*` is the next tile to gather.
        gu = cu
        gt = 0
        g_start = c_start
        g_end = c_end
        for slot in gl.static_range(2):
            r = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            if FP8:
                gather_cols_fp8(kv_mine.index(slot), kv_ptr, stride_kv, r, kv_ready.index(slot), HALF, False)
            else:
                _gather_cols(kv_mine.index(slot), kv_ptr, stride_kv, r, offs_d, kv_ready.index(slot))
            gu, gt, g_start, g_end = next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
        r_ahead = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
        acc = gl.zeros([BLOCK_H, DH], gl.float32, layout=o_layout)

        j = 0
        uc = 0
        while cu < num_units:
            b = j % 2
            mbarrier.wait(p_ready.index(b), (j // 2) & 1)
            alpha = alpha_smem.index(b).load(row_layout)
            acc = acc * gl.expand_dims(alpha, 1)
            # A unit's first tile overwrites acc (use_acc false).
            acc = warpgroup_mma(p_smem.index(b), kv_mine.index(b), acc, use_acc=ct > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            cta_barrier()  # every warp's PV is done with p and with my columns of the slot
            mbarrier.arrive(p_free.index(b))
            n_tiles = gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            last = ct + 1 >= n_tiles
            regathered = False
            if last:
                mbarrier.wait(l_ready, uc & 1)
                l_fin = l_smem.load(row_layout)
                cta_barrier()
                mbarrier.arrive(l_free)
                tok = (cu // units_per_token).to(gl.int64)
                split = cu % NUM_SPLITS
                hb = (cu % units_per_token) // NUM_SPLITS
                if OUT_TMA:
                    # My columns of the output leave by TMA from my half of the slot (no other reader: the score
                    # warpgroup's QK^T on it is done); the slot's regather below waits for the TMA read.
                    if NUM_SPLITS == 1:
                        row0 = (tok * num_heads + hb * BLOCK_H).to(gl.int32)
                        skip = False
                    else:
                        row0 = ((tok * NUM_SPLITS + split) * num_heads + hb * BLOCK_H).to(gl.int32)
                        # An empty span skips its store (its (max, sum) says so); an all-holes split found from its
                        # row ids (no band) stores zeros, which the merge, seeing max -inf, never reads.
                        skip = (c_end <= c_start) & (split > 0)
                    if not skip:
                        out = rows_scaled(acc, gl.where(l_fin > 0, l_fin, 1.0), offs_oh)
                        kv_mine.index(b).store(out.to(dtype))
                        fence_async_shared()  # generic-proxy writes, read by the TMA engine
                        cta_barrier()
                        for c in gl.static_range(DH // 64):
                            tma_store_async(out_desc, [row0, HALF * DH + c * 64], kv_mine.index(b).slice(c * 64, 64, dim=1))
                        if FP8:  # (r_ahead is already in the dequantizing gather's layout)
                            gather_cols_fp8(kv_mine.index(b), kv_ptr, stride_kv, r_ahead, kv_ready.index(b), HALF,
                                            True)
                        else:
                            r_c = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_gc,
                                           BLOCK_N)
                            _gather_cols_after_store(kv_mine.index(b), kv_ptr, stride_kv, r_c, offs_dc,
                                                     kv_ready.index(b))
                        regathered = True
                else:
                    _store_unit(out_ptr, part_acc_ptr, acc, l_fin, tok, split, hb * BLOCK_H, num_heads, stride_ot,
                                stride_oh,
                                c_end <= c_start, offs_oh, offs_od, NUM_SPLITS)
            # The score warpgroup finished this slot's QK^T before p_ready: my columns of it are free.
            if not regathered:
                if FP8:
                    gather_cols_fp8(kv_mine.index(b), kv_ptr, stride_kv, r_ahead, kv_ready.index(b), HALF, False)
                else:
                    _gather_cols(kv_mine.index(b), kv_ptr, stride_kv, r_ahead, offs_d, kv_ready.index(b))
            gu, gt, g_start, g_end = next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
            r_ahead = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            if last:
                cu = cu + num_programs
                ct = 0
                c_start, c_end = unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                            BAND)
                uc = uc + 1
            else:
                ct = ct + 1
            j = j + 1
        _cp.wait_group(0)  # the gathers past the stream's end must land before the program exits

    @gluon.jit(do_not_specialize=["num_units", "num_rows", "stride_rt"])
    def _sparse_mqa_hopper_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token, num_rows,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale,  # scale * log2(e): logits are kept in base 2
        out_desc, q_desc,
        NUM_SPLITS: gl.constexpr, WORKER_REGS: gl.constexpr, OUT_TMA: gl.constexpr, Q_TMA: gl.constexpr,
        BAND: gl.constexpr, FP8: gl.constexpr, PDL: gl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_lo = gl.allocate_shared_memory(dtype, [64, 256], tile)
        q_hi = gl.allocate_shared_memory(dtype, [64, 256], tile)
        kv_lo = gl.allocate_shared_memory(dtype, [2, 64, 256], tile)  # ring slots, columns 0-255
        kv_hi = gl.allocate_shared_memory(dtype, [2, 64, 256], tile)  # columns 256-511
        p_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], tile)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec)
        l_smem = gl.allocate_shared_memory(gl.float32, [64], vec)
        kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        l_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            if FP8:
                mbarrier.init(kv_ready.index(i), count=2)  # one arrival per output warpgroup (hopper_fp8.py)
            else:
                mbarrier.init(kv_ready.index(i), count=256)  # every thread of both output warpgroups
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=2)
        mbarrier.init(l_ready, count=1)
        mbarrier.init(l_free, count=2)
        mbarrier.init(q_ready, count=1)  # Q_TMA: the issuing thread's expect; the bytes complete the phase
        fence_async_shared()
        cta_barrier()
        gl.warp_specialize([
            (_score_partition, (q_ptr, rows_ptr, band_ptr, sinks_ptr, part_ml_ptr, num_heads, num_units,
                                units_per_token, num_rows, stride_qt, stride_qh, stride_rt, qk_scale, q_desc,
                                q_lo, q_hi, kv_lo, kv_hi, p_smem, alpha_smem, l_smem,
                                kv_ready, p_ready, p_free, l_ready, l_free, q_ready, NUM_SPLITS, Q_TMA, BAND)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, num_rows, stride_kv, stride_rt, stride_ot, stride_oh,
                                 out_desc, kv_lo, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, NUM_SPLITS, 0, OUT_TMA, BAND, FP8)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, num_rows, stride_kv, stride_rt, stride_ot, stride_oh,
                                 out_desc, kv_hi, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, NUM_SPLITS, 1, OUT_TMA, BAND, FP8)),
        ], [4, 4], [WORKER_REGS, WORKER_REGS])


def launch_hopper_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                            num_splits: int, max_programs: int, fp8: bool = False) -> None:
    """Launch the kernel. The caller (`triton_kernel.sparse_mqa_attention_triton`) has checked `hopper_supported`,
    made the last dims contiguous and run the band pre-pass for rows cut into `num_splits` pieces, or passes band
    None where every split is one 64-row tile; with splits, its merge kernel combines the normalised partials
    (`PARTS_NORMALISED`). At most `max_programs` persistent programs (one per SM: each holds 214 KB of shared
    memory). fp8: kv_pool holds packed FP8 rows (`hopper_fp8.hopper_fp8_supported` checked), dequantized by the
    output warpgroups as they gather (stride in bytes)."""
    num_tokens, num_heads, _ = q.shape
    units_per_token = num_heads // HEAD_BLOCK * num_splits
    num_units = num_tokens * units_per_token
    out_desc, out_tma = out_descriptor(out, part_acc, num_splits)
    q_desc, q_tma = q_descriptor(q)
    _sparse_mqa_hopper_kernel[(min(num_units, max_programs),)](
        q, kv_pool, rows, rows if band is None else band, sinks, out, part_acc, part_ml,
        num_heads, num_units, units_per_token, rows.shape[1],
        q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1), qk_scale,
        out_desc, q_desc, NUM_SPLITS=num_splits, WORKER_REGS=FP8_WORKER_REGS if fp8 else WORKER_REGS,
        OUT_TMA=out_tma, Q_TMA=q_tma,
        BAND=band is not None, FP8=fp8, num_warps=4, **pdl_args(q.device))
