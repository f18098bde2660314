"""Hopper (sm_90) kernel for the 64-head path of gathered-row MQA with a sink, written in Gluon.

Same contract as `sparse_attention.sparse_mqa_attention_ref` (the plain-PyTorch reference beside
it, and the CPU path); only the shapes that take 64 heads per program come here (decode from WGMMA_MIN_PROGRAMS
token x 64-head programs on, split or of V4-Flash; prefill only where the role-split kernel,
`sparse_attention_wgmma_roles.py`, is off: `sparse_attention.attention_config`). The Triton kernel
in `sparse_attention.py` stays the path of every other shape, of the CPU interpreter and of GPUs
other than Hopper.

Why a second kernel. The Triton kernel's 64-head variant reaches 17-31% of the bf16 rate
(docs/performance.md, "What limits it"): Triton's pipeliner leaves the indirect row gather as a
synchronous load, so every tile pays two dependent memory round trips, and its layout for the
chained dots ([8, 1] warps for a 64-row product) makes both warpgroups compute the same QK^T.
Gluon states layouts and copies explicitly, so here:
  * rows are gathered with cp.async straight into a ring of two shared-memory tiles (q takes
    64 KB, a 64-row tile 64 KB: a third does not fit), the next tile issued while the tensor cores
    run this tile's QK^T and the row ids one tile further ahead still;
  * programs are persistent (one per SM) and walk their units (token x head block x row split)
    as one stream of tiles, so a unit's q and first rows load while the previous unit finishes;
  * both products are wgmma on shared-memory operands with warps [4, 2]: QK^T splits the tile's
    rows between the two warpgroups (no duplicate), PV splits the 512 value columns; the
    probabilities pass from one to the other through a small shared tile;
  * a unit's output (or a split's 16-bit normalised partial) leaves by TMA from its last tile's ring
    slot, waited for one tile later: stored from the wgmma layout it cost 23% of a short (HCA) unit's
    time (session 19).

Roofline: as in `sparse_attention.py` (bytes = 2*L*D + 4*H*D per token, FLOPs = 4*H*L*D).

Shapes it takes: D = 512 (V4), heads a multiple of 64, bf16 or fp16, rows that 16-byte cp.async can
read (`cp_async_aligned`). The work is cut into units (token, 64-head block, split of the row list),
at most one program per SM walks its share of them; splits write their outputs normalised (the Triton
kernel writes raw fp32 accumulators) and its merge kernel combines them (`PARTS_NORMALISED`). Every choice
comes from static shapes (graph-safe); each unit's valid band [first, last + 1) comes from the band pre-pass of
`sparse_attention.py`, except where every split is one tile (small decode batches: BAND false), whose units
walk their split's whole segment and tell an all-holes split from its row ids.
"""
from __future__ import annotations

import torch

from .dispatch import capability, enabled_on
from .pdl import pdl_args

try:  # Gluon ships with triton >= 3.5; the stacks we support (3.6, 3.9) have it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
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
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (desc, coord, smem)

    @gluon.jit
    def wait_for_prior_grid(PDL: gl.constexpr):
        """Gluon twin of kernels/pdl.py's wait (a Gluon kernel cannot call a @triton.jit function)."""
        if PDL >= 1:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @gluon.jit
    def _gather_rows(dst, kv_ptr, stride_kv, r, offs_d):
        """cp.async of columns offs_d of pool rows r (ids in the gather layout) into dst; -1 rows are masked (no
        memory traffic) and land as zeros. The caller commits the group (the Gluon kernels share this)."""
        row_ptr = kv_ptr + gl.expand_dims(r.to(gl.int64) * stride_kv, 1)
        _async_gather(dst, row_ptr + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(r >= 0, 1))

    @gluon.jit
    def _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, stage):
        """Rows r into ring slot `stage` (_gather_rows). One commit group per tile."""
        _gather_rows(kv_smem.index(stage), kv_ptr, stride_kv, r, offs_d)
        _cp.commit_group()

    @gluon.jit
    def _issue_q(q_smem, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_d,
                 NUM_SPLITS: gl.constexpr):
        """cp.async of the unit's 64 query heads into q_smem, as its own commit group."""
        tok = (unit // units_per_token).to(gl.int64)
        hb = (unit % units_per_token) // NUM_SPLITS
        heads = (hb * 64 + offs_qh).to(gl.int64)
        q_rows = q_ptr + tok * stride_qt + gl.expand_dims(heads * stride_qh, 1)
        _async_gather(q_smem, q_rows + gl.expand_dims(offs_d, 0))
        _cp.commit_group()

    @gluon.jit
    def _unit_sink(sinks_ptr, unit, units_per_token, offs_h, NUM_SPLITS: gl.constexpr):
        """The unit's 64-head block and its heads' sink logits in base 2 (offs_h: 0..63 in the wanted layout): the
        running max a unit starts from."""
        hb = (unit % units_per_token) // NUM_SPLITS
        return hb, gl.load(sinks_ptr + hb * 64 + offs_h).to(gl.float32) * 1.4426950408889634

    @gluon.jit
    def _unit_row_sum(row_sums, m_i, m_sink, split):
        """A unit's softmax denominator: its rows' exponentials summed, plus the sink's (exp2(sink - max)) in split 0
        only (the merge adds the splits)."""
        return (split == 0).to(gl.float32) * gl.exp2(m_sink - m_i) + row_sums

    @gluon.jit
    def _unit_band(band_ptr, unit, num_units, units_per_token, NUM_SPLITS: gl.constexpr):
        """[start, end) of the unit's valid rows (the band pre-pass); (0, 0) past the last unit."""
        idx = (unit // units_per_token) * NUM_SPLITS + unit % NUM_SPLITS
        live = unit < num_units
        return (gl.load(band_ptr + idx * 2, mask=live, other=0),
                gl.load(band_ptr + idx * 2 + 1, mask=live, other=0))

    @gluon.jit
    def _unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr, BAND: gl.constexpr):
        """[start, end) of the rows a unit walks: its valid band from the pre-pass (BAND), or else (every split is
        one tile) its split's whole segment, holes and all; (0, 0) past the last unit."""
        if BAND:
            start, end = _unit_band(band_ptr, unit, num_units, units_per_token, NUM_SPLITS)
        else:
            live = unit < num_units
            start = gl.where(live, gl.minimum((unit % NUM_SPLITS) * BLOCK_N, num_rows), 0)
            end = gl.where(live, gl.minimum(start + BLOCK_N, num_rows), 0)
        return start, end

    @gluon.jit
    def _next_tile(unit, tile, start, end, band_ptr, num_units, units_per_token, num_rows, num_programs,
                   NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, BAND: gl.constexpr):
        """The tile after (unit, tile) in this program's stream: every unit has at least one tile
        (an empty unit's one tile is all holes, so it still writes its output), then the program's
        next unit (unit + num_programs) starts."""
        if tile + 1 < gl.maximum(gl.cdiv(end - start, BLOCK_N), 1):
            tile = tile + 1
        else:
            unit = unit + num_programs
            tile = 0
            start, end = _unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        return unit, tile, start, end

    @gluon.jit
    def _tile_ids(rows_ptr, stride_rt, unit, tile, start, end, units_per_token, offs, BLOCK_N: gl.constexpr):
        """Row ids of one tile (-1 past the band's end and past the last unit)."""
        tok = (unit // units_per_token).to(gl.int64)
        pos = start + tile * BLOCK_N + offs
        return gl.load(rows_ptr + tok * stride_rt + pos, mask=pos < end, other=-1)

    @gluon.jit
    def _all_holes(rows_ptr, stride_rt, unit, start, end, units_per_token, BLOCK_N: gl.constexpr):
        """Whether a one-tile unit (no band) has only holes. Every thread reads all BLOCK_N ids itself (BLOCK_N
        scalar loads, the same address across a warp), so no warp waits for another: a CTA-wide reduction of the
        tile's ids made ptxas spill under triton 3.6."""
        whole: gl.constexpr = gl.BlockedLayout([BLOCK_N], [32], [8], [0])  # the kernel's 8 warps
        ids = _tile_ids(rows_ptr, stride_rt, unit, 0, start, end, units_per_token,
                        gl.arange(0, BLOCK_N, layout=whole), BLOCK_N)
        return gl.max(ids, 0) < 0

    @gluon.jit
    def _rows_scaled(acc, l, offs_rows):
        """acc with row i multiplied by 1 / l[i] (offs_rows: a vector in acc's row layout; a layout argument does not
        compile under 3.6). One reciprocal per row: a division per element compiles to 4 instructions
        (div.full.f32's range checks), 250 per warp in a unit's epilogue."""
        return acc * gl.expand_dims(gl.convert_layout(1.0 / l, offs_rows.type.layout), 1)

    @gluon.jit
    def _store_ml(part_ml_ptr, part, heads, num_heads, offs_sh, m_i, l_i, empty):
        """A split's (max, sum) into part_ml [T, S, 2, H]; an empty split's is (-inf, 0), weight 0 in the merge,
        which then never reads its output (so the unit does not write it)."""
        ml = part_ml_ptr + part * 2 * num_heads + heads + offs_sh
        gl.store(ml, gl.where(empty, float("-inf"), m_i))
        gl.store(ml + num_heads, gl.where(empty, 0.0, l_i))

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
            out = _rows_scaled(acc, l_i, offs_oh)
            out_rows = out_ptr + tok * stride_ot + gl.expand_dims((heads + offs_oh).to(gl.int64) * stride_oh, 1)
            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))
        else:
            part = tok * NUM_SPLITS + split
            # An empty split (short contexts leave most of them empty) adds nothing: 128 KB are not written.
            empty = band_empty & (split > 0)
            if WRITE_ML:
                _store_ml(part_ml_ptr, part, heads, num_heads, offs_sh, m_i, l_i, empty)
            if not empty:
                acc_rows = part_acc_ptr + (part * num_heads + heads + gl.expand_dims(offs_oh, 1)) * 512
                if NORMALISE:
                    acc = _rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
                gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc.to(part_acc_ptr.dtype.element_ty))

    @gluon.jit
    def _sparse_mqa_wgmma_kernel(
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
        c_start, c_end = _unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        _issue_q(q_smem, q_ptr, cu, units_per_token, stride_qt, stride_qh, offs_qh, offs_d, NUM_SPLITS)
        r = _tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_g, BLOCK_N)
        _issue_gather(kv_smem, kv_ptr, stride_kv, r, offs_d, 0)
        gu, gt, g_start, g_end = _next_tile(cu, ct, c_start, c_end, band_ptr, num_units, units_per_token, num_rows,
                                            num_programs, NUM_SPLITS, BLOCK_N, BAND)
        r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)

        # The running max starts at the sink logit and the sum at exp(sink - max) = 1, so the sink
        # is in the denominator from the start; only split 0 counts it (the merge adds the rest).
        hb, m_sink = _unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
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
            _cta_barrier()
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one
            k_tile = kv_smem.index(j % 2)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if OUT_TMA:
                if tma_pending:  # the last unit's output must have left the slot the next gather fills
                    tma.store_wait(0)
                    _cta_barrier()
                    tma_pending = False
            # While the tensor cores run QK^T: gather the next tile, fetch the ids after it.
            _issue_gather(kv_smem, kv_ptr, stride_kv, r_ahead, offs_d, (j + 1) % 2)
            gu, gt, g_start, g_end = _next_tile(gu, gt, g_start, g_end, band_ptr, num_units, units_per_token,
                                                num_rows, num_programs, NUM_SPLITS, BLOCK_N, BAND)
            r_ahead = _tile_ids(rows_ptr, stride_rt, gu, gt, g_start, g_end, units_per_token, offs_g, BLOCK_N)
            r_s = _tile_ids(rows_ptr, stride_rt, cu, ct, c_start, c_end, units_per_token, offs_s, BLOCK_N)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

            s = gl.where(gl.expand_dims(r_s >= 0, 0), s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))  # the one cross-warpgroup reduction per tile
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_cols = l_cols * gl.expand_dims(alpha, 1) + p  # row sums reduced once, at the unit's end
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()  # p is whole, and both warpgroups are done with q for this tile
            last = ct + 1 >= gl.maximum(gl.cdiv(c_end - c_start, BLOCK_N), 1)
            nu = cu + num_programs
            if last & (nu < num_units):
                _issue_q(q_smem, q_ptr, nu, units_per_token, stride_qt, stride_qh, offs_qh, offs_d, NUM_SPLITS)
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
                l_i = _unit_row_sum(gl.sum(l_cols, 1), m_i, m_sink, split)
                if OUT_TMA:
                    # The output (or a split's normalised partial output) leaves through the tile's ring slot,
                    # by TMA, while the next unit computes: stored from the wgmma layout (4 bytes per thread,
                    # 16-byte row runs) it cost 23% of a short unit's time (session 19: Flash HCA 4K 476 -> 366 us).
                    # Each warpgroup's PV is done with the slot, and it writes only the 256 columns its PV read.
                    if NUM_SPLITS == 1:
                        row0 = (tok * num_heads + hb * BLOCK_H).to(gl.int32)
                        skip = False
                    else:
                        part = tok * NUM_SPLITS + split
                        row0 = (part * num_heads + hb * BLOCK_H).to(gl.int32)
                        skip = band_empty & (split > 0)
                        _store_ml(part_ml_ptr, part, hb * BLOCK_H, num_heads, offs_sh, m_i, l_i, skip)
                    if not skip:
                        # A split's row sum is 0 where the sink outweighs all its logits by > 2^126 (exp2 underflows):
                        # its weight in the merge is then 0, and its output 0, not 0/0 = NaN.
                        out = _rows_scaled(acc, gl.where(l_i > 0, l_i, 1.0), offs_oh)
                        k_tile.store(out.to(dtype))
                        fence_async_shared()  # generic-proxy writes, read by the TMA engine
                        _cta_barrier()
                        for c in gl.static_range(D // 64):
                            _tma_store(out_desc, [row0, c * 64], k_tile.slice(c * 64, 64, dim=1))
                        tma_pending = True
                else:
                    _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, split, hb * BLOCK_H, num_heads,
                                stride_ot, stride_oh, band_empty, offs_oh, offs_od, offs_sh, NUM_SPLITS, True, True)
                cu = nu
                ct = 0
                c_start, c_end = _unit_span(band_ptr, cu, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N,
                                            BAND)
                hb, m_sink = _unit_sink(sinks_ptr, cu, units_per_token, offs_sh, NUM_SPLITS)
                m_i = m_sink
                l_cols = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
            else:
                ct = ct + 1
            j = j + 1
        _cp.wait_group(0)  # nothing may still write shared memory when the program exits
        if OUT_TMA:
            tma.store_wait(0)  # nor may a TMA store still read it


def wgmma_supported(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether this kernel can serve the call: Hopper, D = 512, heads in blocks of 64, 16-bit."""
    if not _HAVE_GLUON or q.device.type != "cuda" or q.dim() != 3 or not enabled_on("attention_wgmma", q.device):
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
    """The shared-memory layout of q, the ring slots and the TMA output boxes: 128-byte swizzle, 16-bit."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _layouts(block_n: int):
    gather = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # 16-byte cp.async per thread
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 16])
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    tile = tile_layout()
    p = gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n * 2), element_bitwidth=16, rank=2)
    return gather, s, o, tile, p


def unit_launch_args(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                     num_splits: int) -> tuple[tuple, int]:
    """The positional arguments that this kernel and the tile-pair kernel take, and the number of units
    (token x 64-head block x row split) that their persistent programs walk."""
    num_tokens, num_heads, _ = q.shape
    units_per_token = num_heads // HEAD_BLOCK * num_splits
    num_units = num_tokens * units_per_token
    args = (q, kv_pool, rows, band, sinks, out, part_acc, part_ml, num_heads, num_units, units_per_token,
            q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1), qk_scale)
    return args, num_units


def box_descriptor(t: torch.Tensor):
    """A TMA descriptor of a contiguous [..., 512] tensor as [rows, 512] in 64 x 64 boxes (the tile layout): what the
    Gluon kernels load q from and store their outputs to."""
    return TensorDescriptor.from_tensor(t.view(-1, HEAD_DIM), [HEAD_BLOCK, 64], tile_layout())


def out_descriptor(out: torch.Tensor, part_acc: torch.Tensor, num_splits: int, tma_store: bool):
    """(out_desc, OUT_TMA) for the wgmma kernel: a TMA descriptor, in 64 x 64 boxes, of what its units store
    (out as [tokens * heads, 512] with one split; the 16-bit partial outputs as [tokens * splits * heads, 512]
    with splits) when that is contiguous; otherwise out itself, as a placeholder the kernel does not read,
    and the stores from registers. (Built per launch on the host, a few microseconds; a captured graph keeps
    it, as it keeps the target's address.)"""
    target = out if num_splits == 1 else part_acc
    if tma_store and target.dtype in (torch.bfloat16, torch.float16) and target.is_contiguous():
        return box_descriptor(target), True
    return out, False


def launch_wgmma_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, qk_scale: float,
                           block_n: int, num_splits: int, max_programs: int, tma_store: bool = True) -> None:
    """Launch the kernel. The caller (`sparse_attention.sparse_mqa_attention_triton`) has checked
    `wgmma_supported`, made the last dims contiguous and run the band pre-pass for rows cut into
    `num_splits` pieces, or passes band None where every split is one tile (`needs_band_prepass`); with
    splits, its merge kernel combines the partials. At most `max_programs` persistent programs (one per SM:
    each holds ~200 KB of shared memory).
    tma_store: units with 64-row tiles store their output (or 16-bit partials) by TMA (False: from registers)."""
    has_band = band is not None
    args, num_units = unit_launch_args(q, kv_pool, rows, band if has_band else rows, sinks, out, part_acc, part_ml,
                                       qk_scale, num_splits)
    gather, s, o, tile, p = _layouts(block_n)
    out_desc, out_tma = out_descriptor(out, part_acc, num_splits, tma_store and block_n == 64)
    _sparse_mqa_wgmma_kernel[(min(num_units, max_programs),)](
        *args, rows.shape[1], out_desc, NUM_SPLITS=num_splits, BLOCK_N=block_n, OUT_TMA=out_tma, BAND=has_band,
        gather_layout=gather, s_layout=s, o_layout=o, tile_smem=tile, p_smem_layout=p,
        num_warps=8, **pdl_args(q.device),
    )
