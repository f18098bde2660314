"""Hopper (sm_90) kernel of gathered-row MQA with a sink, written in Gluon: the 64-head shapes of V4.

Same contract as `reference.sparse_mqa_attention_ref` (the plain-PyTorch reference and CPU path); `select.py` sends
a call here when the shapes fit (`hopper_supported`: D = 512, heads in blocks of 64, 16-bit) and there are enough
(token, 64-head) programs; every other shape, GPUs other than Hopper and the CPU interpreter take the portable
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

Each unit walks its valid band [first, last + 1) from the band pre-pass of `triton_kernel.py` (BAND), except where
every split is one tile (small decode batches): those units walk their split's whole segment and tell an all-holes
split from its row ids, which saves the pre-pass launch. An empty split (all holes, split > 0) writes
(max -inf, sum 0), and no output where its span is empty: the merge gives it weight 0 and never reads it.

Resources: 4 + 4 + 4 warps, one program per SM, 214 KB of shared memory (q 64 KB, two 64 KB slots, two 8 KB p
tiles), 168 registers per warpgroup (setmaxnreg; `tools/kernel_resources.py` checks the spills offline).
Roofline: bytes = 2*L*D + 4*H*D per token, FLOPs = 4*H*L*D.
"""
from __future__ import annotations

import torch

from ..dispatch import capability, enabled_on
from ..pdl import pdl_args

try:  # Gluon ships with triton >= 3.5; the stacks we support (3.6, 3.9) have it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves every shape
    _HAVE_GLUON = False

HEAD_BLOCK = 64  # heads per unit: the M of both wgmma products
HEAD_DIM = 512
WORKER_REGS = 168  # registers of each output warpgroup (setmaxnreg); the score warpgroup gets the rest, also 168


if _HAVE_GLUON:
    # Renamed between the supported versions (3.6 -> 3.9).
    _async_gather = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared  # (smem, pointers, mask)
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (desc, coord, smem)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (desc, coord, barrier, smem)

    @gluon.jit
    def wait_for_prior_grid(PDL: gl.constexpr):
        """Gluon twin of kernels/pdl.py's wait (a Gluon kernel cannot call a @triton.jit function)."""
        if PDL >= 1:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @gluon.jit
    def _issue_q(q_smem, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_d,
                 NUM_SPLITS: gl.constexpr):
        """cp.async of the unit's 64 query heads (columns offs_d) into q_smem, as its own commit group."""
        tok = (unit // units_per_token).to(gl.int64)
        hb = (unit % units_per_token) // NUM_SPLITS
        heads = (hb * 64 + offs_qh).to(gl.int64)
        q_rows = q_ptr + tok * stride_qt + gl.expand_dims(heads * stride_qh, 1)
        _async_gather(q_smem, q_rows + gl.expand_dims(offs_d, 0))
        _cp.commit_group()

    @gluon.jit
    def _unit_sink(sinks_ptr, unit, units_per_token, offs_h, NUM_SPLITS: gl.constexpr):
        """The unit's 64-head block and its heads' sink logits in base 2 (offs_h: 0..63 in the wanted layout): the
        running max a unit starts from, so the sink is in the denominator from the start."""
        hb = (unit % units_per_token) // NUM_SPLITS
        return hb, gl.load(sinks_ptr + hb * 64 + offs_h).to(gl.float32) * 1.4426950408889634

    @gluon.jit
    def _unit_row_sum(row_sums, m_i, m_sink, split):
        """A unit's softmax denominator: its rows' exponentials summed, plus the sink's (exp2(sink - max)) in split 0
        only (the merge adds the splits)."""
        return (split == 0).to(gl.float32) * gl.exp2(m_sink - m_i) + row_sums

    @gluon.jit
    def _unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr, BAND: gl.constexpr):
        """[start, end) of the rows a unit walks: its valid band from the pre-pass (BAND), or else (every split is
        one tile) its split's whole segment, holes and all; (0, 0) past the last unit."""
        live = unit < num_units
        if BAND:
            idx = (unit // units_per_token) * NUM_SPLITS + unit % NUM_SPLITS
            start = gl.load(band_ptr + idx * 2, mask=live, other=0)
            end = gl.load(band_ptr + idx * 2 + 1, mask=live, other=0)
        else:
            start = gl.where(live, gl.minimum((unit % NUM_SPLITS) * BLOCK_N, num_rows), 0)
            end = gl.where(live, gl.minimum(start + BLOCK_N, num_rows), 0)
        return start, end

    @gluon.jit
    def _next_tile(unit, tile, start, end, band_ptr, num_units, units_per_token, num_rows, num_programs,
                   NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, BAND: gl.constexpr):
        """The tile after (unit, tile) in this program's stream: every unit has at least one tile (an empty unit's
        one tile is all holes, so it still writes its result), then the program's next unit (unit + num_programs)."""
        if tile + 1 < gl.maximum(gl.cdiv(end - start, BLOCK_N), 1):
            tile = tile + 1
        else:
            unit = unit + num_programs
            tile = 0
            start, end = _unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        return unit, tile, start, end

    @gluon.jit
    def _tile_ids(rows_ptr, stride_rt, unit, tile, start, end, units_per_token, offs, BLOCK_N: gl.constexpr):
        """Row ids of one tile (-1 past the span's end and past the last unit)."""
        tok = (unit // units_per_token).to(gl.int64)
        pos = start + tile * BLOCK_N + offs
        return gl.load(rows_ptr + tok * stride_rt + pos, mask=pos < end, other=-1)

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
            top = gl.max(_tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token, offs, BLOCK_N), 0)
            for c in gl.static_range(1, BLOCK_N // 16):
                ids = _tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token, offs + c * 16, BLOCK_N)
                top = gl.maximum(top, gl.max(ids, 0))
            return top < 0

    @gluon.jit
    def _rows_scaled(acc, l, offs_rows):
        """acc with row i multiplied by 1 / l[i] (offs_rows: a vector in acc's row layout). One reciprocal per row:
        a division per element compiles to four instructions (div.full.f32's range checks)."""
        return acc * gl.expand_dims(gl.convert_layout(1.0 / l, offs_rows.type.layout), 1)

    @gluon.jit
    def _store_ml(part_ml_ptr, part, heads, num_heads, offs_sh, m_i, l_i, empty):
        """A split's (max, sum) into part_ml [T, S, 2, H]; an empty split's is (-inf, 0), weight 0 in the merge,
        which then never reads its output (so the unit does not write it)."""
        ml = part_ml_ptr + part * 2 * num_heads + heads + offs_sh
        gl.store(ml, gl.where(empty, float("-inf"), m_i))
        gl.store(ml + num_heads, gl.where(empty, 0.0, l_i))

    @gluon.jit
    def _store_unit(out_ptr, part_acc_ptr, acc, l_i, tok, split, heads, num_heads, stride_ot, stride_oh, empty,
                    offs_oh, offs_od, NUM_SPLITS: gl.constexpr):
        """A finished unit's result stored from registers (where no TMA descriptor fits): the normalised output of
        its heads' columns offs_od (one split), or its split's normalised partial [T, S, H, 512] (none where its span
        is empty)."""
        if NUM_SPLITS == 1:
            out = _rows_scaled(acc, l_i, offs_oh)
            out_rows = out_ptr + tok * stride_ot + gl.expand_dims((heads + offs_oh).to(gl.int64) * stride_oh, 1)
            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))
        else:
            if not (empty & (split > 0)):
                part = tok * NUM_SPLITS + split
                acc_rows = part_acc_ptr + (part * num_heads + heads + gl.expand_dims(offs_oh, 1)) * 512
                acc = _rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
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
                _tma_load(q_desc, [row0, c * 64], q_ready, q_lo.slice(c * 64, 64, dim=1))
                _tma_load(q_desc, [row0, 256 + c * 64], q_ready, q_hi.slice(c * 64, 64, dim=1))
        else:
            _issue_q(q_lo, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo, NUM_SPLITS)
            _issue_q(q_hi, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_lo + 256, NUM_SPLITS)

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
        c_start, c_end = _unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
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
            if ct == 0:  # the unit's q has landed
                if Q_TMA:
                    mbarrier.wait(q_ready, uc & 1)
                else:  # (this partition's only cp.async)
                    _cp.wait_group(0)
                    _cta_barrier()
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
            nt_start, nt_end = _unit_span(band_ptr, nt_u, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                          BAND)
            nt_start = gl.where(last, nt_start, c_start)
            nt_end = gl.where(last, nt_end, c_end)
            r_next = _tile_ids(rows_ptr, stride_rt, nt_u, nt_t, nt_start, nt_end, units_per_token, offs_s, BLOCK_N)
            hb_next, m_sink_next = _unit_sink(sinks_ptr, nu, units_per_token, offs_sh, NUM_SPLITS)  # (cached reads)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
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
            mbarrier.wait(p_free.index(b), ((j // 2) + 1) & 1, pred=j >= 2)
            p_smem.index(b).store(p.to(dtype))
            alpha_smem.index(b).store(alpha)
            fence_async_shared()  # p is read by wgmma (async proxy)
            _cta_barrier()  # every warp's part is written before the one arrival
            mbarrier.arrive(p_ready.index(b))

            if last:
                split = cu % NUM_SPLITS
                l_fin = _unit_row_sum(l_i, m_i, m_sink, split)
                if NUM_SPLITS > 1:
                    tok = (cu // units_per_token).to(gl.int64)
                    empty = _unit_empty(rows_ptr, stride_rt, cu, c_start, c_end, units_per_token, BLOCK_N, BAND)
                    _store_ml(part_ml_ptr, tok * NUM_SPLITS + split, hb * BLOCK_H, num_heads, offs_sh, m_i, l_fin,
                              empty & (split > 0))
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
        num_rows, stride_kv, stride_rt, stride_ot, stride_oh, out_desc,
        kv_mine, p_smem, alpha_smem, l_smem,
        kv_ready, p_ready, p_free, l_ready, l_free,
        NUM_SPLITS: gl.constexpr, HALF: gl.constexpr, OUT_TMA: gl.constexpr, BAND: gl.constexpr,
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
        c_start, c_end = _unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        # The stream's first two tiles, one per ring slot; `g*` is the next tile to gather.
        gu = cu
        gt = 0
        g_start = c_start
        g_end = c_end
        for slot in gl.static_range(2):
            r = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            _gather_cols(kv_mine.index(slot), kv_ptr, stride_kv, r, offs_d, kv_ready.index(slot))
            gu, gt, g_start, g_end = _next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
        r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
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
            _cta_barrier()  # every warp's PV is done with p and with my columns of the slot
            mbarrier.arrive(p_free.index(b))
            n_tiles = gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            last = ct + 1 >= n_tiles
            regathered = False
            if last:
                mbarrier.wait(l_ready, uc & 1)
                l_fin = l_smem.load(row_layout)
                _cta_barrier()
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
                        out = _rows_scaled(acc, gl.where(l_fin > 0, l_fin, 1.0), offs_oh)
                        kv_mine.index(b).store(out.to(dtype))
                        fence_async_shared()  # generic-proxy writes, read by the TMA engine
                        _cta_barrier()
                        for c in gl.static_range(DH // 64):
                            _tma_store(out_desc, [row0, HALF * DH + c * 64], kv_mine.index(b).slice(c * 64, 64, dim=1))
                        r_c = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_gc, BLOCK_N)
                        _gather_cols_after_store(kv_mine.index(b), kv_ptr, stride_kv, r_c, offs_dc, kv_ready.index(b))
                        regathered = True
                else:
                    _store_unit(out_ptr, part_acc_ptr, acc, l_fin, tok, split, hb * BLOCK_H, num_heads, stride_ot,
                                stride_oh,
                                c_end <= c_start, offs_oh, offs_od, NUM_SPLITS)
            # The score warpgroup finished this slot's QK^T before p_ready: my columns of it are free.
            if not regathered:
                _gather_cols(kv_mine.index(b), kv_ptr, stride_kv, r_ahead, offs_d, kv_ready.index(b))
            gu, gt, g_start, g_end = _next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
            r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            if last:
                cu = cu + num_programs
                ct = 0
                c_start, c_end = _unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                            BAND)
                uc = uc + 1
            else:
                ct = ct + 1
            j = j + 1
        _cp.wait_group(0)  # the gathers past the stream's end must land before the program exits

    @gluon.jit
    def _sparse_mqa_hopper_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token, num_rows,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale,  # scale * log2(e): logits are kept in base 2
        out_desc, q_desc,
        NUM_SPLITS: gl.constexpr, WORKER_REGS: gl.constexpr, OUT_TMA: gl.constexpr, Q_TMA: gl.constexpr,
        BAND: gl.constexpr, PDL: gl.constexpr,
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
                                units_per_token, num_rows, stride_qt, stride_qh, stride_rt, qk_scale, q_desc,
                                q_lo, q_hi, kv_lo, kv_hi, p_smem, alpha_smem, l_smem,
                                kv_ready, p_ready, p_free, l_ready, l_free, q_ready, NUM_SPLITS, Q_TMA, BAND)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, num_rows, stride_kv, stride_rt, stride_ot, stride_oh,
                                 out_desc, kv_lo, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, NUM_SPLITS, 0, OUT_TMA, BAND)),
            (_output_partition, (kv_ptr, rows_ptr, band_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_heads,
                                 num_units, units_per_token, num_rows, stride_kv, stride_rt, stride_ot, stride_oh,
                                 out_desc, kv_hi, p_smem, alpha_smem, l_smem,
                                 kv_ready, p_ready, p_free, l_ready, l_free, NUM_SPLITS, 1, OUT_TMA, BAND)),
        ], [4, 4], [WORKER_REGS, WORKER_REGS])


def hopper_supported(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether this kernel can serve the call: Hopper, D = 512, heads in blocks of 64, 16-bit, rows that 16-byte
    cp.async can read; and not turned off (SPARSESERVE_DISABLE_KERNELS=attention_hopper)."""
    if not _HAVE_GLUON or q.device.type != "cuda" or q.dim() != 3 or not enabled_on("attention_hopper", q.device):
        return False
    _, num_heads, head_dim = q.shape
    return (capability(q.device)[0] == 9 and head_dim == HEAD_DIM and num_heads % HEAD_BLOCK == 0
            and q.dtype in (torch.bfloat16, torch.float16) and kv_pool.dtype == q.dtype
            and kv_pool.shape[-1] == HEAD_DIM and cp_async_aligned(q) and cp_async_aligned(kv_pool))


def cp_async_aligned(t: torch.Tensor) -> bool:
    """Whether 16-byte cp.async copies can read t's rows: 16-byte-aligned start, unit last stride, and the
    other strides multiples of 16 elements (what Triton's argument specialisation can prove; otherwise the
    kernel does not compile, so such a view takes the Triton kernel instead)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride % 16 == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1))


def tile_layout():
    """The shared-memory layout of q, the ring slots and the TMA boxes: 128-byte swizzle, 16-bit."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def box_descriptor(t: torch.Tensor):
    """A TMA descriptor of a contiguous [..., 512] tensor as [rows, 512] in 64 x 64 boxes (the tile layout)."""
    return TensorDescriptor.from_tensor(t.view(-1, HEAD_DIM), [HEAD_BLOCK, 64], tile_layout())


def out_descriptor(out: torch.Tensor, part_acc: torch.Tensor, num_splits: int):
    """(out_desc, OUT_TMA): a TMA descriptor of what the units store (out as [tokens * heads, 512] with one split;
    the 16-bit partials as [tokens * splits * heads, 512] with splits) when that is contiguous and 16-bit; otherwise
    out itself, a placeholder the kernel does not read, and stores from registers. (Built per launch on the host;
    a captured graph keeps it, as it keeps the target's address.)"""
    target = out if num_splits == 1 else part_acc
    if target.dtype in (torch.bfloat16, torch.float16) and target.is_contiguous():
        return box_descriptor(target), True
    return out, False


def q_descriptor(q: torch.Tensor):
    """(q_desc, Q_TMA): a TMA descriptor of q as [tokens * heads, 512] where q is contiguous (each unit's 64 heads
    are then one 64-row block), else q itself, a placeholder the kernel does not read, and cp.async."""
    if q.is_contiguous():
        return box_descriptor(q), True
    return q, False


def launch_hopper_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                            num_splits: int, max_programs: int) -> None:
    """Launch the kernel. The caller (`triton_kernel.sparse_mqa_attention_triton`) has checked `hopper_supported`,
    made the last dims contiguous and run the band pre-pass for rows cut into `num_splits` pieces, or passes band
    None where every split is one 64-row tile; with splits, its merge kernel combines the normalised partials
    (`PARTS_NORMALISED`). At most `max_programs` persistent programs (one per SM: each holds 214 KB of shared
    memory)."""
    num_tokens, num_heads, _ = q.shape
    units_per_token = num_heads // HEAD_BLOCK * num_splits
    num_units = num_tokens * units_per_token
    out_desc, out_tma = out_descriptor(out, part_acc, num_splits)
    q_desc, q_tma = q_descriptor(q)
    _sparse_mqa_hopper_kernel[(min(num_units, max_programs),)](
        q, kv_pool, rows, rows if band is None else band, sinks, out, part_acc, part_ml,
        num_heads, num_units, units_per_token, rows.shape[1],
        q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1), qk_scale,
        out_desc, q_desc, NUM_SPLITS=num_splits, WORKER_REGS=WORKER_REGS, OUT_TMA=out_tma, Q_TMA=q_tma,
        BAND=band is not None, num_warps=4, **pdl_args(q.device))
