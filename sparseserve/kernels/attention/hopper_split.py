"""Hopper (sm_90) kernel of gathered-row MQA with a sink for calls whose row lists are split (small decode batches),
in Gluon: the 64-head shapes of V4 where `select.py` picks more than one split.

Same contract as `reference.sparse_mqa_attention_ref`; `triton_kernel.py`'s merge combines the splits' normalised
16-bit partials. Both warpgroups of a program (8 warps, warps [4, 2]) work on every tile in lockstep: QK^T splits
the tile's rows between them, PV the 512 value columns; rows are gathered by cp.async into a ring of two 64-row
shared-memory tiles while the tensor cores run, and a unit's partial leaves by TMA from its last tile's slot.
Why not the role-split kernel (`hopper.py`) here: a split unit is one or two tiles, too short for the roles'
pipeline to pay for its hand-overs; measured on the H200, the role-split kernel takes 1.03-1.16x this kernel's
time on such calls (docs/performance.md, "Attention"), while it is the faster one on unsplit calls.

Units walk their valid band from the band pre-pass (BAND), or, where every split is one tile, their split's whole
segment (an all-holes split found from its row ids: `_all_holes`).
Resources: 8 warps, one program per SM, ~200 KB of shared memory (q 64 KB, two 64 KB slots, the p tile).
"""
from __future__ import annotations

from ..pdl import pdl_args
from .hopper_common import HAVE_GLUON, HEAD_BLOCK, HEAD_DIM, out_descriptor, tile_layout

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, tma, warpgroup_mma, warpgroup_mma_wait)

    from .hopper_common import (
        async_gather, cta_barrier, issue_q, next_tile, rows_scaled, store_ml, tile_ids, tma_store_async,
        unit_row_sum, unit_sink, unit_span, wait_for_prior_grid)

    @gluon.jit
    def _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, stage):
        """cp.async of pool rows r (ids in the gather layout) into ring slot `stage`; -1 rows are masked (no memory
        traffic) and land as zeros. One commit group per tile."""
        row_ptr = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        async_gather(kv_smem.index(stage), row_ptr + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(r >= 0, 1))
        _cp.commit_group()

    @gluon.jit
    def _all_holes(rows_ptr, stride_rt, unit, start, end, units_per_token, BLOCK_N: gl.constexpr):
        """Whether a one-tile unit (no band) has only holes. Every thread reads all BLOCK_N ids itself (BLOCK_N
        scalar loads, the same address across a warp), so no warp waits for another: a CTA-wide reduction of the
        tile's ids made ptxas spill under triton 3.6."""
        whole: gl.constexpr = gl.BlockedLayout([BLOCK_N], [32], [8], [0])  # the kernel's 8 warps
        ids = tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token,
                        gl.arange(0, BLOCK_N, layout=whole), BLOCK_N)
        return gl.max(ids, 0) < 0

    @gluon.jit
    def _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, split, heads, num_heads,
                    stride_ot, stride_oh, band_empty, offs_oh, offs_od, offs_sh,
                    NUM_SPLITS: gl.constexpr, WRITE_ML: gl.constexpr, NORMALISE: gl.constexpr):
        """A finished unit's result: the normalised output of its 64 heads (one split), or its partials: the
        split's output [T, S, H, 512] in part_acc's dtype (NORMALISE: divided by its own sum; else the raw
        acc, as the Triton kernel writes it) and its (max, sum) [T, S, 2, H] in fp32. acc may hold only some
        of the columns (offs_od); WRITE_ML: this caller also writes the unit's (max, sum). tok (int64), split
        and heads (the block's first head) locate the unit."""
        if NUM_SPLITS == 1:
            out = rows_scaled(acc, l_i, offs_oh)
            out_rows = out_ptr + tok * stride_ot + gl.expand_dims((heads + offs_oh).to(gl.int64) * stride_oh, 1)
            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))
        else:
            part = tok * NUM_SPLITS + split
            # An empty split (short contexts leave most of them empty) adds nothing: 128 KB are not written.
            empty = band_empty & (split > 0)
            if WRITE_ML:
                store_ml(part_ml_ptr, part, heads, num_heads, offs_sh, m_i, l_i, empty)
            if not empty:
                acc_rows = part_acc_ptr + (part * num_heads + heads + gl.expand_dims(offs_oh, 1)) * 512
                if NORMALISE:
                    acc = rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
                gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc.to(part_acc_ptr.dtype.element_ty))

    @gluon.jit(do_not_specialize=["num_units", "num_rows", "stride_rt"])
    def _sparse_mqa_split_kernel(
        q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        num_heads, num_units, units_per_token,
        stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
        qk_scale,  # scale * log2(e): logits are kept in base 2
        num_rows,  # row slots per token (read where not BAND)
        out_desc,  # OUT_TMA: TMA descriptor of out (one split) or of the partial outputs (splits) as [rows, 512]
        NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, OUT_TMA: gl.constexpr, BAND: gl.constexpr,
        gather_layout: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
        tile_smem: gl.constexpr, p_smem_layout: gl.constexpr,
        PDL: gl.constexpr,
    ):
        # Persistent: program p takes units p, p + G, ... (a unit = token x 64-head block x row
        # split) as one stream of tiles, so the next unit's q and first rows load while this one
        # finishes, instead of after it (a unit often has only 2-10 tiles).
        wait_for_prior_grid(PDL)
        BLOCK_H: gl.constexpr = 64
        D: gl.constexpr = 512
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        num_programs = gl.num_programs(0)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D], tile_smem)
        kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], tile_smem)  # ring of 2 tiles
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_smem_layout)

        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, gather_layout))
        offs_qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gather_layout))
        offs_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_layout))
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        offs_sh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        offs_oh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        offs_od = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))

        # Two cursors over the stream: `c*` the tile being computed, `g*` the next tile to gather.
        cu = gl.program_id(0)
        ct = 0
        c_start, c_end = unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        issue_q(q_smem, q_ptr, cu, units_per_token, stride_qt, stride_qh, offs_qh, offs_d, NUM_SPLITS)
        r = tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_g, BLOCK_N)
        _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, 0)
        gu, gt, g_start, g_end = next_tile(cu, ct, c_start, c_end, band_ptr, num_units, units_per_token, num_rows,
                                            num_programs, NUM_SPLITS, BLOCK_N, BAND)
        r_ahead = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)

        # The running max starts at the sink logit and the sum at exp(sink - max) = 1, so the sink
        # is in the denominator from the start; only split 0 counts it (the merge adds the rest).
        hb, m_sink = unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
        m_i = m_sink
        acc = gl.zeros([BLOCK_H, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        l_cols = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)

        j = 0  # tiles computed so far: ring slot j % 2
        tma_pending = False  # OUT_TMA: a TMA store of the last unit's output still reads ring slot (j + 1) % 2
        while cu < num_units:
            # Every copy issued so far (this tile, and q when a unit starts) has landed; the
            # barrier makes them visible to all warps and frees the slot and p of the last tile.
            _cp.wait_group(0)
            cta_barrier()
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
            k_tile = kv_smem.index(j % 2)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if OUT_TMA:
                if tma_pending:  # the last unit's output must have left the slot the next gather fills
                    tma.store_wait(0)
                    cta_barrier()
                    tma_pending = False
            # While the tensor cores run QK^T: gather the next tile, fetch the ids after it.
            _issue_gather(kv_smem, kv_ptr, stride_kv, r_ahead, offs_d, (j + 1) % 2)
            gu, gt, g_start, g_end = next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
            r_ahead = tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            r_s = tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_s, BLOCK_N)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))  # the one cross-warpgroup reduction per tile
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_cols = l_cols * gl.expand_dims(alpha, 1) + p  # row sums reduced once, at the unit's end
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            cta_barrier()  # p is whole, and both warpgroups are done with q for this tile
            last = ct + 1 >= gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            nu = cu + num_programs
            if last & (nu < num_units):
                issue_q(q_smem, q_ptr, nu, units_per_token, stride_qt, stride_qh, offs_qh, offs_d, NUM_SPLITS)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            # A unit's first tile overwrites acc (use_acc false) instead of adding to a zeroed one: zeroing 128
            # registers per thread took ~128 instructions per warp of every unit's epilogue.
            acc = warpgroup_mma(p_smem, k_tile, acc, use_acc=ct > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

            if last:
                tok = (cu // units_per_token).to(gl.int64)
                split = cu % NUM_SPLITS
                if BAND:
                    band_empty = c_end <= c_start
                else:  # the unit's one tile has only holes
                    band_empty = _all_holes(rows_ptr, stride_rt, cu, c_start, c_end, units_per_token, BLOCK_N)
                l_i = unit_row_sum(gl.sum(l_cols, 1), m_i, m_sink, split)
                if OUT_TMA:
                    # The output (or a split's normalised partial output) leaves through the tile's ring slot,
                    # by TMA, while the next unit computes (stored from the wgmma layout, 4 bytes per thread in
                    # 16-byte row runs, it cost about a quarter of a short unit's time).
                    # Each warpgroup's PV is done with the slot, and it writes only the 256 columns its PV read.
                    if NUM_SPLITS == 1:
                        row0 = (tok * num_heads + hb * BLOCK_H).to(gl.int32)
                        skip = False
                    else:
                        part = tok * NUM_SPLITS + split
                        row0 = (part * num_heads + hb * BLOCK_H).to(gl.int32)
                        skip = band_empty & (split > 0)
                        store_ml(part_ml_ptr, part, hb * BLOCK_H, num_heads, offs_sh, m_i, l_i, skip)
                    if not skip:
                        # A split's row sum is 0 where the sink outweighs all its logits by > 2^126 (exp2 underflows):
                        # its weight in the merge is then 0, and its output 0, not 0/0 = NaN.
                        out = rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
                        k_tile.store(out.to(dtype))
                        fence_async_shared()  # generic-proxy writes, read by the TMA engine
                        cta_barrier()
                        for c in gl.static_range(D // 64):
                            tma_store_async(out_desc, [row0, c * 64], k_tile.slice(c * 64, 64, dim=1))
                        tma_pending = True
                else:
                    _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, split, hb * BLOCK_H, num_heads,
                                stride_ot, stride_oh, band_empty, offs_oh, offs_od, offs_sh, NUM_SPLITS, True, True)
                cu = nu
                ct = 0
                c_start, c_end = unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                            BAND)
                hb, m_sink = unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
                m_i = m_sink
                l_cols = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
            else:
                ct = ct + 1
            j = j + 1
        _cp.wait_group(0)  # nothing may still write shared memory when the program exits
        if OUT_TMA:
            tma.store_wait(0)  # nor may a TMA store still read it


def _layouts():
    gather = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # 16-byte cp.async per thread
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    p = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return gather, s, o, tile_layout(), p


def launch_split_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                           num_splits: int, max_programs: int) -> None:
    """Launch the kernel (64-row tiles). The caller (`triton_kernel.sparse_mqa_attention_triton`) has checked
    `hopper_supported`, made the last dims contiguous and run the band pre-pass, or passes band None where every
    split is one tile; its merge kernel combines the partials. At most `max_programs` persistent programs."""
    num_tokens, num_heads, _ = q.shape
    units_per_token = num_heads // HEAD_BLOCK * num_splits
    num_units = num_tokens * units_per_token
    gather, s, o, tile, p = _layouts()
    out_desc, out_tma = out_descriptor(out, part_acc, num_splits)
    _sparse_mqa_split_kernel[(min(num_units, max_programs),)](
        q, kv_pool, rows, rows if band is None else band, sinks, out, part_acc, part_ml, num_heads, num_units,
        units_per_token, q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1),
        qk_scale, rows.shape[1], out_desc, NUM_SPLITS=num_splits, BLOCK_N=64, OUT_TMA=out_tma, BAND=band is not None,
        gather_layout=gather, s_layout=s, o_layout=o, tile_smem=tile, p_smem_layout=p, num_warps=8,
        **pdl_args(q.device))
