"""Hopper (sm_90) attention kernel, written in Gluon, in which the warpgroups take roles: one computes scores,
two accumulate the output.

Same contract, units, bands, partials and merge as `sparse_attention_wgmma.py`. There both warpgroups work
on every tile in lockstep: QK^T (m64n32 per warpgroup, each reading all of q), then the softmax on both while
the tensor cores idle, then PV, then the next tile. Here the three warpgroups of a program pipeline the tile
stream (FlashAttention-3's producer/consumer split, with the score side as the producer):
  * the score warpgroup (the default partition) runs each tile's whole QK^T (m64n64 over q's two column halves),
    masks, keeps the running max and the row sums, and hands the tile's 16-bit probabilities p and the rescale
    factor alpha to the others through a double-buffered shared tile; then it starts the next tile while they
    multiply. It loads q for the next unit once its last QK^T of a unit is done (by TMA, one issuing thread,
    where q is contiguous; by cp.async from all its threads otherwise), and writes a split's (max, sum);
  * two output warpgroups (worker partitions) each own 256 of the 512 value columns: acc = acc * alpha +
    p v[:, own]. Each regathers its own column half of a ring slot (two 64-row slots) as soon as its PV on that
    slot is done, by cp.async whose completion arrives on the slot's barrier (its column half is read by no one
    else then: the score warpgroup's QK^T on it finished before p existed). At a unit's end it writes its
    columns of the output (or of the split's normalised partial) into its half of the slot and stores them by
    TMA in four 64-column boxes, and regathers each 64 columns of the slot as soon as the TMA engine has read
    that box.
Barriers (mbarriers): kv_ready[slot] (256 cp.async arrivals, one per output-warpgroup thread), p_ready[buf]
(1), p_free[buf] (2), l_ready (1), l_free (2) and q_ready (the TMA's bytes); a barrier's phase parity is its use
count.

Resources: 4 + 4 + 4 warps, one program per SM, 214 KB of shared memory (q 64 KB, two 64 KB slots, two 8 KB p
tiles), 168 registers per warpgroup (setmaxnreg; `tools/kernel_resources.py --wgmma`: 0-24 B of scalars spilled
by the score warpgroup with q by TMA, up to 72 B with q by cp.async). Shapes: those of `sparse_attention_wgmma.py`
with 64-row tiles and a band pre-pass.

Measured (H200, docs/performance.md): session 23, a steady tile took ~5,000 cycles (QK^T 2,600, softmax 1,100,
waiting for its rows 600, the hand-over 300), the same as the lockstep kernel's tile, but a unit's epilogue
and q load ran beside the other warpgroups' work, and V4-Pro's 128 heads no longer needed the tile-pair
kernel: prefill 1.04-1.20x the kernels it replaced, V4-Pro decode at batch 64-256 1.05-1.18x. Session 24: with q
by TMA (the score warpgroup had spent ~1,500 cycles per unit issuing q's cp.async) and the regather behind the
output's boxes, a short (HCA 4K) unit's tile period fell from 5,970 to 5,030 cycles: prefill 1.12-1.25x the
wgmma / tile-pair kernels (V4-Flash HCA 4K 1.20x session 23's version), V4-Flash decode at batch 256 1.03-1.08x
the wgmma kernel, which it now replaces there. Tried and dropped
(same probe, `tools/roles_probe.py`): the output stored from registers (a unit's epilogue 9,700-13,000 cycles),
the next tile's QK^T issued before this tile's softmax (slower: its QK^T then took 3,640-5,390 cycles), and q held in
registers as the A operand (ptxas spills it). Session 25 measured and dropped a 32-row tail tile, earlier q loads,
half of q in registers and TMA loads of consecutive rows (none faster by more than the run-to-run spread), and split
a unit's epilogue with trace marks 13-15: staging the output and issuing its TMA stores wait on shared memory.
Session 26 (branch `ring-slots`): two score warpgroups taking turns do not build (ptxas compiles every partition
within 65536 / 512 threads = 128 registers, and PV's m64n256 accumulator needs 154); four 32-row slots were
1.01-1.35x slower (each tile's fixed costs, paid twice per 64 rows); the exponentials moved to the output
warpgroups, 1.21-1.56x slower (they were already busy with PV and the regather). Session 27 (branch `qstream`):
q streamed into QK^T as wgmma's A operand from registers (ldmatrix, 64 or 128 columns at a time, at most two
products in flight) left QK^T at 2,635-2,845 cycles a tile and prefill 1.03-1.07x slower.
"""
from __future__ import annotations

from .pdl import pdl_args
from .sparse_attention_wgmma import _HAVE_GLUON, box_descriptor, out_descriptor, unit_launch_args

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .sparse_attention_wgmma import (
        _async_gather, _cp, _cta_barrier, _issue_q, _next_tile, _rows_scaled, _store_ml, _store_unit, _tile_ids,
        _tma_store, _unit_band, _unit_row_sum, _unit_sink, wait_for_prior_grid)

    # Renamed between the supported versions (3.6 -> 3.9); both take (desc, coord, barrier, smem).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _trace_mark(trace_ptr, offs, j, k: gl.constexpr, TRACE: gl.constexpr, value=None):
        """TRACE: one thread of the partition writes %clock64 (or `value`) into slot k of tile j of this program
        (a [programs, TRACE_TILES = 512, TRACE_SLOTS = 16] int64 buffer; tiles past 512 are not traced)."""
        if TRACE:
            if value is None:
                v = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [offs], dtype=gl.int64, is_pure=False,
                                              pack=1)
            else:
                v = value + (offs * 0).to(gl.int64)
            slot = (gl.program_id(0).to(gl.int64) * 512 + j) * 16 + k + offs * 0
            gl.store(trace_ptr + slot, v, mask=(offs == 0) & (j < 512))

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
                _tma_load(q_desc, [row0, c * 64], q_ready, q_lo.slice(c * 64, 64, dim=1))
                _tma_load(q_desc, [row0, 256 + c * 64], q_ready, q_hi.slice(c * 64, 64, dim=1))
        else:
            _issue_q(q_lo, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo, NUM_SPLITS)
            _issue_q(q_hi, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo + 256, NUM_SPLITS)

    @gluon.jit
    def _score_partition(
        q_ptr, rows_ptr, band_ptr, sinks_ptr, part_ml_ptr, num_heads, num_units, units_per_token,
        stride_qt, stride_qh, stride_rt, qk_scale, q_desc,
        q_lo, q_hi, kv_lo, kv_hi, p_smem, alpha_smem, l_smem,
        kv_ready, p_ready, p_free, l_ready, l_free, q_ready, trace_ptr,
        NUM_SPLITS: gl.constexpr, TRACE: gl.constexpr, Q_TMA: gl.constexpr,
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
        c_start, c_end = _unit_band(band_ptr, cu, num_units, units_per_token, NUM_SPLITS)
        _load_q(q_desc, q_lo, q_hi, q_ready, q_ptr, cu, num_heads, units_per_token, stride_qt, stride_qh, offs_qh,
                offs_lo, NUM_SPLITS, Q_TMA)
        hb, m_sink = _unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
        m_i = m_sink
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        r_s = _tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_s, BLOCK_N)

        j = 0  # tiles done: ring slot and p buffer j % 2, use count j // 2
        uc = 0  # units done: the parity of l_ready / l_free
        while cu < num_units:
            b = j % 2
            _trace_mark(trace_ptr, offs_sh, j, 0, TRACE)
            if ct == 0:  # the unit's q has landed
                if Q_TMA:
                    mbarrier.wait(q_ready, uc & 1)
                else:  # (this partition's only cp.async)
                    _cp.wait_group(0)
                    _cta_barrier()
            mbarrier.wait(kv_ready.index(b), (j // 2) & 1)
            _trace_mark(trace_ptr, offs_sh, j, 1, TRACE)
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
            s = warpgroup_mma(q_lo, kv_lo.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_hi, kv_hi.index(b).permute((1, 0)), s, is_async=True)
            n_tiles = gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            last = ct + 1 >= n_tiles
            nu = cu + num_programs
            # The next tile's ids (for its mask), fetched under this QK^T.
            nt_u = gl.where(last, nu, cu)
            nt_t = gl.where(last, 0, ct + 1)
            nt_start, nt_end = _unit_band(band_ptr, nt_u, num_units, units_per_token, NUM_SPLITS)
            nt_start = gl.where(last, nt_start, c_start)
            nt_end = gl.where(last, nt_end, c_end)
            r_next = _tile_ids(rows_ptr, stride_rt, nt_u, nt_t, nt_start, nt_end, units_per_token, offs_s, BLOCK_N)
            hb_next, m_sink_next = _unit_sink(sinks_ptr, nu, units_per_token, offs_sh, NUM_SPLITS)  # (cached reads)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            _trace_mark(trace_ptr, offs_sh, j, 2, TRACE)
            if last & (nu < num_units):  # q is free: load the next unit's, under this softmax
                _cta_barrier()  # every warp's QK^T is done with q
                _load_q(q_desc, q_lo, q_hi, q_ready, q_ptr, nu, num_heads, units_per_token, stride_qt, stride_qh,
                        offs_qh, offs_lo, NUM_SPLITS, Q_TMA)

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # p buffer b was last read by the PV of tile j - 2.
            _trace_mark(trace_ptr, offs_sh, j, 3, TRACE)
            mbarrier.wait(p_free.index(b), ((j // 2) + 1) & 1, pred=j >= 2)
            p_smem.index(b).store(p.to(dtype))
            alpha_smem.index(b).store(alpha)
            fence_async_shared()  # p is read by wgmma (async proxy)
            _cta_barrier()  # every warp's part is written before the one arrival
            mbarrier.arrive(p_ready.index(b))
            _trace_mark(trace_ptr, offs_sh, j, 4, TRACE)
            _trace_mark(trace_ptr, offs_sh, j, 9, TRACE, cu)
            _trace_mark(trace_ptr, offs_sh, j, 10, TRACE, ct)

            if last:
                split = cu % NUM_SPLITS
                l_fin = _unit_row_sum(l_i, m_i, m_sink, split)
                if NUM_SPLITS > 1:
                    tok = (cu // units_per_token).to(gl.int64)
                    _store_ml(part_ml_ptr, tok * NUM_SPLITS + split, hb * BLOCK_H, num_heads, offs_sh, m_i, l_fin,
                              (c_end <= c_start) & (split > 0))
                mbarrier.wait(l_free, (uc + 1) & 1, pred=uc >= 1)
                l_smem.store(l_fin)
                _cta_barrier()
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
        _async_gather(dst, row_ptr + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(r >= 0, 1))
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
            _cta_barrier()  # the issuing thread has seen box c read
            _async_gather(slot.slice(c * 64, 64, dim=1), row_ptr + gl.expand_dims(offs_d + c * 64, 0),
                          mask=gl.expand_dims(r >= 0, 1))
        _cp.mbarrier_arrive(ready, increment_count=False)
        _cp.commit_group()

    @gluon.jit
    def _output_partition(
        kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads, num_units, units_per_token,
        stride_kv, stride_rt, stride_ot, stride_oh, out_desc,
        kv_mine, p_smem, alpha_smem, l_smem,
        kv_ready, p_ready, p_free, l_ready, l_free, trace_ptr,
        NUM_SPLITS: gl.constexpr, HALF: gl.constexpr, OUT_TMA: gl.constexpr, TRACE: gl.constexpr,
        ABLATE: gl.constexpr, EPI_CHUNKS: gl.constexpr,
    ):
        BLOCK_H: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 64
        DH: gl.constexpr = 256
        dtype: gl.constexpr = kv_ptr.dtype.element_ty
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        chunk_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] pieces
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DH, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        num_programs = gl.num_programs(0)
        offs_d = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, gather_layout))
        offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_layout))
        offs_dc = HALF * DH + gl.arange(0, 64, layout=gl.SliceLayout(0, chunk_layout))
        offs_gc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, chunk_layout))
        offs_oh = gl.arange(0, BLOCK_H, layout=row_layout)
        offs_od = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))

        cu = gl.program_id(0)
        ct = 0
        c_start, c_end = _unit_band(band_ptr, cu, num_units, units_per_token, NUM_SPLITS)
        # The stream's first two tiles, one per ring slot; `g*` is the next tile to gather.
        gu = cu
        gt = 0
        g_start = c_start
        g_end = c_end
        for slot in gl.static_range(2):
            r = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            _gather_cols(kv_mine.index(slot), kv_ptr, stride_kv, r, offs_d, kv_ready.index(slot))
            gu, gt, g_start, g_end = _next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token, 0,
                                                num_programs, NUM_SPLITS, BLOCK_N, True)
        r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
        acc = gl.zeros([BLOCK_H, DH], gl.float32, layout=o_layout)

        j = 0
        uc = 0
        while cu < num_units:
            b = j % 2
            _trace_mark(trace_ptr, offs_oh, j, 5, TRACE and HALF == 0)
            mbarrier.wait(p_ready.index(b), (j // 2) & 1)
            _trace_mark(trace_ptr, offs_oh, j, 6, TRACE and HALF == 0)
            alpha = alpha_smem.index(b).load(row_layout)
            acc = acc * gl.expand_dims(alpha, 1)
            # A unit's first tile overwrites acc (use_acc false).
            acc = warpgroup_mma(p_smem.index(b), kv_mine.index(b), acc, use_acc=ct > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _cta_barrier()  # every warp's PV is done with p and with my columns of the slot
            _trace_mark(trace_ptr, offs_oh, j, 7, TRACE and HALF == 0)
            mbarrier.arrive(p_free.index(b))
            n_tiles = gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            last = ct + 1 >= n_tiles
            regathered = False
            if last:
                mbarrier.wait(l_ready, uc & 1)
                l_fin = l_smem.load(row_layout)
                _cta_barrier()
                mbarrier.arrive(l_free)
                _trace_mark(trace_ptr, offs_oh, j, 13, TRACE and HALF == 0)
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
                        skip = (c_end <= c_start) & (split > 0)
                    if not skip:
                        out = _rows_scaled(acc, gl.where(l_fin > 0, l_fin, 1.0), offs_oh)
                        kv_mine.index(b).store(out.to(dtype))
                        fence_async_shared()  # generic-proxy writes, read by the TMA engine
                        _cta_barrier()
                        _trace_mark(trace_ptr, offs_oh, j, 14, TRACE and HALF == 0)
                        for c in gl.static_range(DH // 64):
                            _tma_store(out_desc, [row0, HALF * DH + c * 64], kv_mine.index(b).slice(c * 64, 64, dim=1))
                        _trace_mark(trace_ptr, offs_oh, j, 15, TRACE and HALF == 0)
                        if EPI_CHUNKS:
                            r_c = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_gc,
                                            BLOCK_N)
                            if ABLATE == 1:
                                r_c = r_c * 0 - 1
                            _gather_cols_after_store(kv_mine.index(b), kv_ptr, stride_kv, r_c, offs_dc,
                                                     kv_ready.index(b))
                            regathered = True
                        else:
                            tma.store_wait(0)
                            _cta_barrier()
                else:
                    _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, l_fin, l_fin, tok, split, hb * BLOCK_H,
                                num_heads, stride_ot, stride_oh, c_end <= c_start, offs_oh, offs_od, offs_oh,
                                NUM_SPLITS, False, True)
            _trace_mark(trace_ptr, offs_oh, j, 12, TRACE and HALF == 0)
            # The score warpgroup finished this slot's QK^T before p_ready: my columns of it are free.
            if ABLATE == 1:  # probe only: no row traffic (masked copies still write zeros and arrive)
                r_ahead = r_ahead * 0 - 1
            if not regathered:
                _gather_cols(kv_mine.index(b), kv_ptr, stride_kv, r_ahead, offs_d, kv_ready.index(b))
            gu, gt, g_start, g_end = _next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token, 0,
                                                num_programs, NUM_SPLITS, BLOCK_N, True)
            r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            _trace_mark(trace_ptr, offs_oh, j, 8, TRACE and HALF == 0)
            if last:
                cu = cu + num_programs
                ct = 0
                c_start, c_end = _unit_band(band_ptr, cu, num_units, units_per_token, NUM_SPLITS)
                uc = uc + 1
            else:
                ct = ct + 1
            _trace_mark(trace_ptr, offs_oh, j, 11, TRACE and HALF == 0)
            j = j + 1
        _cp.wait_group(0)  # the gathers past the stream's end must land before the program exits

    @gluon.jit
    def _sparse_mqa_roles_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale, out_desc, q_desc, trace_ptr,
        NUM_SPLITS: gl.constexpr, WORKER_REGS: gl.constexpr, OUT_TMA: gl.constexpr, Q_TMA: gl.constexpr,
        EPI_CHUNKS: gl.constexpr, TRACE: gl.constexpr, ABLATE: gl.constexpr, PDL: gl.constexpr,
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
            mbarrier.init(kv_ready.index(i), count=256)  # every thread of both output warpgroups
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=2)
        mbarrier.init(l_ready, count=1)
        mbarrier.init(l_free, count=2)
        mbarrier.init(q_ready, count=1)  # Q_TMA: the issuing thread's expect; the bytes complete the phase
        fence_async_shared()
        _cta_barrier()
        gl.warp_specialize([
            (_score_partition, (q_ptr, rows_ptr, band_ptr, sinks_ptr, part_ml_ptr, num_heads, num_units,
                                units_per_token, stride_qt, stride_qh, stride_rt, qk_scale, q_desc,
                                q_lo, q_hi, kv_lo, kv_hi, p_smem, alpha_smem, l_smem,
                                kv_ready, p_ready, p_free, l_ready, l_free, q_ready, trace_ptr, NUM_SPLITS, TRACE,
                                Q_TMA)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, stride_kv, stride_rt, stride_ot, stride_oh, out_desc,
                                 kv_lo, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, trace_ptr, NUM_SPLITS, 0, OUT_TMA,
                                 TRACE, ABLATE, EPI_CHUNKS)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, stride_kv, stride_rt, stride_ot, stride_oh, out_desc,
                                 kv_hi, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, trace_ptr, NUM_SPLITS, 1, OUT_TMA,
                                 TRACE, ABLATE, EPI_CHUNKS)),
        ], [4, 4], [WORKER_REGS, WORKER_REGS])


WORKER_REGS = 168  # registers of each output warpgroup (setmaxnreg); the score warpgroup gets the rest, also 168
TRACE_TILES, TRACE_SLOTS = 512, 16  # the trace buffer's shape per program (as _trace_mark writes it)


def q_descriptor(q):
    """(q_desc, Q_TMA): a TMA descriptor of q as [tokens * heads, 512] in 64 x 64 boxes where q is contiguous (each
    unit's 64 heads are then one 64-row block), else q itself, a placeholder the kernel does not read, and cp.async."""
    if q.is_contiguous():
        return box_descriptor(q), True
    return q, False


def launch_roles_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                           num_splits: int, max_programs: int, worker_regs: int = WORKER_REGS, trace=None,
                           ablate: int = 0, q_tma: bool = True, epi_chunks: bool = True,
                           tma_store: bool = True) -> None:
    """As `sparse_attention_wgmma.launch_wgmma_attention` (64-row tiles, a band pre-pass), for this kernel
    (4 + 4 + 4 warps). Splits write 16-bit normalised partials, as the wgmma kernel's. q_tma: q loads by TMA where
    q is contiguous (else cp.async); epi_chunks: a unit's last slot is regathered chunk by chunk behind its output's
    TMA reads (else once all four are read); tma_store False (a probe variant): outputs stored from registers.
    Diagnostics for tools/roles_probe.py: trace, an int64 tensor [programs, TRACE_TILES, TRACE_SLOTS] for clock
    marks (score warpgroup: marks 0-4, unit 9, tile 10; output warpgroup 0: marks 5-8, 11, 12 and a unit's epilogue
    13-15), or None; ablate=1 masks every regather (no row traffic; outputs wrong on purpose)."""
    args, num_units = unit_launch_args(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale, num_splits)
    out_desc, out_tma = out_descriptor(out, part_acc, num_splits, tma_store)
    q_desc, q_by_tma = q_descriptor(q) if q_tma else (q, False)
    _sparse_mqa_roles_kernel[(min(num_units, max_programs),)](
        *args, out_desc, q_desc, q if trace is None else trace, NUM_SPLITS=num_splits, WORKER_REGS=worker_regs,
        OUT_TMA=out_tma, Q_TMA=q_by_tma, EPI_CHUNKS=epi_chunks and out_tma, TRACE=trace is not None, ABLATE=ablate,
        num_warps=4, **pdl_args(q.device))
