"""Hopper (sm_90) attention kernel, written in Gluon, in which each warpgroup owns a whole tile.

Same contract, units, bands, partials and merge as `sparse_attention_wgmma.py`. There both warpgroups
work on every tile in lockstep: QK^T splits the tile's 64 rows between them (m64n32 instructions that
each read all of q: 192 KB of shared memory per tile), and softmax runs on both at once while the
tensor cores idle. Here (the layout of FlashMLA's Hopper sparse prefill, written from its description)
the tiles of a unit go in pairs: warpgroup w (w = 0 the default partition, w = 1 a worker partition
of 4 warps) gathers tile 2i + w into its own ring slot and
  * computes that tile's whole QK^T (m64n64: 128 KB of shared memory per tile);
  * exchanges the tile's row max with the other, so both use one running max m;
  * hands its probabilities p_w (bf16) to the other through shared memory;
  * owns the output columns [256w, 256w + 256): acc_w += p_w v_w[:, own] (p from registers) and
    acc_w += p_other v_other[:, own] (p from shared memory).
The column half of its slot that only it reads is gathered again as soon as its own PV is done, the
other half once the other warpgroup's PV on it is done. Row sums are added across the two at the
unit's end. A unit with an odd number of tiles leaves warpgroup 1 a masked tile in its last pair.
Every barrier is an mbarrier of count 1 (one elected arrival per partition) and completes once per
pair (or unit): its phase parity is the pair (unit) counter's.

When it is used (`sparse_attention.attention_config`): long units, i.e. >= 1024 rows per split of
128-head models (V4-Pro CSA, decode from batch 64 and prefill), where the role-split kernel
(`sparse_attention_wgmma_roles.py`, session 23: 1.04-1.18x faster on those shapes) is turned off. H200,
session 18, kernel benchmark against `sparse_attention_wgmma.py` in the same run: prefill Pro CSA 32K
23,615 vs 26,563 us (50% of bf16), 4K 2,019 vs 2,246; Pro decode batch 64 / 256 4-7% faster. Session 19 gave
the wgmma kernel a TMA output store, which made it the faster on V4-Flash CSA prefill (4K 816 vs 875 us), and measured
one here too: it has to wait for the TMA read inside the unit (the slot halves are regathered at
once), gained on V4-Flash but not on Pro CSA 4K (2,033 vs 2,009 us) and raised the spills, so this
kernel keeps the register store (Pro CSA 32K: 23,243 vs the wgmma kernel's 25,287). Not used where it lost: Flash
decode (640 rows from HBM: 5-17% slower), decode with 8 splits (23 vs 21 us), HCA prefill (5-18% slower):
short units expose the per-unit exchange and the first pair's gathers, and an odd tile count leaves
warpgroup 1 a masked tile. Resources (`tools/kernel_resources.py --wgmma`): 255 registers, 136-184 B of
spilled wgmma descriptors (reloaded from L1 before each product), 214,540 B of shared memory.
"""
from __future__ import annotations

from .pdl import pdl_args
from .sparse_attention_wgmma import _HAVE_GLUON, unit_launch_args

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

    from .sparse_attention_wgmma import (
        _cp, _cta_barrier, _gather_rows, _issue_q, _store_unit, _unit_band, _unit_row_sum, _unit_sink,
        wait_for_prior_grid)

    @gluon.jit
    def _pair_tile_ids(rows_ptr, stride_rt, unit, pair, start, end, units_per_token, offs, HALF: gl.constexpr):
        """Row ids of this warpgroup's tile (2 * pair + HALF) of the unit: -1 past the band and past the last unit."""
        tok = (unit // units_per_token).to(gl.int64)
        pos = start + (2 * pair + HALF) * 64 + offs
        return gl.load(rows_ptr + tok * stride_rt + pos, mask=pos < end, other=-1)

    @gluon.jit
    def _gather_half(dst, kv_ptr, stride_kv, r, offs_d):
        """One column half ([64 rows, 256]) of rows r (_gather_rows). One commit group."""
        _gather_rows(dst, kv_ptr, stride_kv, r, offs_d)
        _cp.commit_group()

    @gluon.jit
    def _pair_partition(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh, qk_scale,
        q_mine, q_theirs,  # q's column halves ([64, 256] each): mine (I load it) and the other's
        v_mine, v_other_slot,  # my columns of my slot / of the other's slot (the PV operands)
        g_first, g_second,  # gather order of my slot's halves: my columns first, then the other's
        p_mine, p_other, mx_mine, mx_other, lx_mine, lx_other,
        mx_ready_mine, mx_ready_other, p_ready_mine, p_ready_other, p_free_mine, p_free_other,
        q_ready_mine, q_ready_other, l_ready_mine, l_ready_other,
        NUM_SPLITS: gl.constexpr, HALF: gl.constexpr,
    ):
        # Per pair: PV on the other's tile first, so the other columns of my slot (which its PV reads) are
        # free, and regathered, while I run PV on my own tile; then my columns. QK^T of the next pair starts
        # on the half gathered first. (The opposite order measured the same within 1-2%: session 18.)
        BLOCK_H: gl.constexpr = 64
        BLOCK_N: gl.constexpr = 64
        DH: gl.constexpr = 256
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DH, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        vec_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        num_programs = gl.num_programs(0)

        offs_mine = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, gather_layout))
        offs_other = (1 - HALF) * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, gather_layout))
        offs_qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gather_layout))
        offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_layout))
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        offs_sh = gl.arange(0, BLOCK_H, layout=vec_layout)
        offs_oh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        offs_od = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))

        cu = gl.program_id(0)
        cp = 0
        c_start, c_end = _unit_band(band_ptr, cu, num_units, units_per_token, NUM_SPLITS)
        _issue_q(q_mine, q_ptr, cu, units_per_token, stride_qt, stride_qh, offs_qh, offs_mine, NUM_SPLITS)
        r = _pair_tile_ids(rows_ptr, stride_rt, cu, cp, c_start, c_end, units_per_token, offs_g, HALF)
        _gather_half(g_second, kv_ptr, stride_kv, r, offs_other)
        _gather_half(g_first, kv_ptr, stride_kv, r, offs_mine)

        hb, m_sink = _unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
        m_i = m_sink
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
        acc = gl.zeros([BLOCK_H, DH], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)

        i = 0  # pairs done by this program: the parity of the per-pair barriers
        uc = 0  # units done: the parity of the per-unit barriers
        while cu < num_units:
            # The half gathered first (and, at a unit's start, my half of q, issued before both) has landed.
            _cp.wait_group(1)
            _cta_barrier()  # this partition's warps only
            fence_async_shared()
            if cp == 0:
                mbarrier.arrive(q_ready_mine)
                mbarrier.wait(q_ready_other, uc & 1)
            s = warpgroup_mma(q_theirs, g_second.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _cp.wait_group(0)
            _cta_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_mine, g_first.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            n_pairs = gl.maximum(gl.cdiv(gl.cdiv(c_end - c_start, BLOCK_N), 2), 1)
            last = cp + 1 >= n_pairs
            # My next tile: the next pair of this unit, or the first of my next unit (branch-free).
            nu = cu + last.to(gl.int32) * num_programs
            n_cp = (cp + 1) * (1 - last.to(gl.int32))
            nu_start, nu_end = _unit_band(band_ptr, nu, num_units, units_per_token, NUM_SPLITS)
            r_next = _pair_tile_ids(rows_ptr, stride_rt, nu, n_cp, nu_start, nu_end, units_per_token, offs_g, HALF)
            r_s = _pair_tile_ids(rows_ptr, stride_rt, cu, cp, c_start, c_end, units_per_token, offs_s, HALF)

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_tile = gl.max(s, 1)
            # One running max for both tiles of the pair (both compute the same max of the same values).
            mx_mine.store(m_tile)
            mbarrier.arrive(mx_ready_mine)
            mbarrier.wait(mx_ready_other, i & 1)
            if last & (nu < num_units):  # both of us are past the unit's last QK^T: load my half of the next q
                _issue_q(q_mine, q_ptr, nu, units_per_token, stride_qt, stride_qh, offs_qh, offs_mine, NUM_SPLITS)
            m_new = gl.maximum(m_i, gl.maximum(m_tile, mx_other.load(vec_layout)))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p16 = p.to(dtype)
            p_mine.store(p16)
            fence_async_shared()
            mbarrier.arrive(p_ready_mine)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)

            mbarrier.wait(p_ready_other, i & 1)
            acc = warpgroup_mma(p_other, v_other_slot, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(p_free_other)  # done with the other's p and with my columns of its slot
            # The other columns of my slot are free once the other's PV on them is done.
            mbarrier.wait(p_free_mine, i & 1)
            _gather_half(g_second, kv_ptr, stride_kv, r_next, offs_other)
            acc = warpgroup_mma(gl.convert_layout(p16, p_layout), v_mine, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            # My columns of my slot: read only by me (QK^T and this PV, both done).
            _cta_barrier()
            _gather_half(g_first, kv_ptr, stride_kv, r_next, offs_mine)

            if last:
                # Row sums of the two tiles' streams, added once per unit.
                lx_mine.store(l_i)
                mbarrier.arrive(l_ready_mine)
                mbarrier.wait(l_ready_other, uc & 1)
                l_tot = l_i + lx_other.load(vec_layout)
                tok = (cu // units_per_token).to(gl.int64)
                split = cu % NUM_SPLITS
                l_fin = _unit_row_sum(l_tot, m_i, m_sink, split)
                _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_fin, tok, split, hb * BLOCK_H, num_heads,
                            stride_ot, stride_oh, c_end <= c_start, offs_oh, offs_od, offs_sh, NUM_SPLITS, HALF == 0,
                            False)
                cu = nu
                cp = 0
                c_start = nu_start
                c_end = nu_end
                hb, m_sink = _unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
                m_i = m_sink
                l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
                acc = gl.zeros([BLOCK_H, DH], gl.float32, layout=o_layout)
                uc = uc + 1
            else:
                cp = cp + 1
            i = i + 1
        _cp.wait_group(0)

    @gluon.jit
    def _sparse_mqa_pair_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale,
        NUM_SPLITS: gl.constexpr, WORKER_REGS: gl.constexpr, PDL: gl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        # Separate allocations per half and per warpgroup (triton 3.6 asserts when one buffer is cut
        # into per-partition pieces for warp_specialize).
        q_lo = gl.allocate_shared_memory(dtype, [64, 256], tile)
        q_hi = gl.allocate_shared_memory(dtype, [64, 256], tile)
        k0_lo = gl.allocate_shared_memory(dtype, [64, 256], tile)
        k0_hi = gl.allocate_shared_memory(dtype, [64, 256], tile)
        k1_lo = gl.allocate_shared_memory(dtype, [64, 256], tile)
        k1_hi = gl.allocate_shared_memory(dtype, [64, 256], tile)
        p0 = gl.allocate_shared_memory(dtype, [64, 64], tile)
        p1 = gl.allocate_shared_memory(dtype, [64, 64], tile)
        mx0 = gl.allocate_shared_memory(gl.float32, [64], vec)
        mx1 = gl.allocate_shared_memory(gl.float32, [64], vec)
        lx0 = gl.allocate_shared_memory(gl.float32, [64], vec)
        lx1 = gl.allocate_shared_memory(gl.float32, [64], vec)
        mxr0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mxr1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pr0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pr1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pf0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pf1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        qr0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        qr1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        lr0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        lr1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(mxr0, count=1)
        mbarrier.init(mxr1, count=1)
        mbarrier.init(pr0, count=1)
        mbarrier.init(pr1, count=1)
        mbarrier.init(pf0, count=1)
        mbarrier.init(pf1, count=1)
        mbarrier.init(qr0, count=1)
        mbarrier.init(qr1, count=1)
        mbarrier.init(lr0, count=1)
        mbarrier.init(lr1, count=1)
        fence_async_shared()
        _cta_barrier()
        # (Argument tuples spelled out: a tuple built by concatenation loses its constexprs.)
        gl.warp_specialize([
            (_pair_partition, (q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                               num_heads, num_units, units_per_token,
                               stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh, qk_scale,
                               q_lo, q_hi, k0_lo, k1_lo, k0_lo, k0_hi,
                               p0, p1, mx0, mx1, lx0, lx1,
                               mxr0, mxr1, pr0, pr1, pf0, pf1, qr0, qr1, lr0, lr1,
                               NUM_SPLITS, 0)),
            (_pair_partition, (q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                               num_heads, num_units, units_per_token,
                               stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh, qk_scale,
                               q_hi, q_lo, k1_hi, k0_hi, k1_hi, k1_lo,
                               p1, p0, mx1, mx0, lx1, lx0,
                               mxr1, mxr0, pr1, pr0, pf1, pf0, qr1, qr0, lr1, lr0,
                               NUM_SPLITS, 1)),
        ], [4], [WORKER_REGS])


def launch_pair_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                          num_splits: int, max_programs: int, worker_regs: int = 248) -> None:
    """As `sparse_attention_wgmma.launch_wgmma_attention` (64-row tiles), for the pair kernel (4 + 4 warps)."""
    args, num_units = unit_launch_args(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale, num_splits)
    _sparse_mqa_pair_kernel[(min(num_units, max_programs),)](
        *args, NUM_SPLITS=num_splits, WORKER_REGS=worker_regs, num_warps=4, **pdl_args(q.device))
