"""Shared pieces of the two Hopper (sm_90) attention kernels in Gluon (`hopper.py`, unsplit calls; `hopper_split.py`,
row splits): the Gluon imports, the unit stream (a unit = token x 64-head block x split of the row list, walked by
persistent programs as one stream of 64-row tiles), the sink and softmax bookkeeping, the TMA descriptors, and
whether the kernels can serve a call.
"""
from __future__ import annotations

import torch

from ..dispatch import capability, enabled_on

try:  # Gluon ships with triton >= 3.5; the stacks we support (3.6, 3.9) have it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves every shape
    HAVE_GLUON = False

HEAD_BLOCK = 64  # heads per unit: the M of both wgmma products
HEAD_DIM = 512


if HAVE_GLUON:
    # Renamed between the supported versions (3.6 -> 3.9).
    async_gather = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared  # (smem, pointers, mask)
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    tma_store_async = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (desc, coord, smem)
    tma_load_async = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (desc, coord, barrier, smem)

    @gluon.jit
    def wait_for_prior_grid(PDL: gl.constexpr):
        """Gluon twin of kernels/pdl.py's wait (a Gluon kernel cannot call a @triton.jit function)."""
        if PDL >= 1:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @gluon.jit
    def issue_q(q_smem, q_ptr, unit, units_per_token, stride_qt, stride_qh, offs_qh, offs_d,
                 NUM_SPLITS: gl.constexpr):
        """cp.async of the unit's 64 query heads (columns offs_d) into q_smem, as its own commit group."""
        tok = (unit // units_per_token).to(gl.int64)
        hb = (unit % units_per_token) // NUM_SPLITS
        heads = (hb * 64 + offs_qh).to(gl.int64)
        q_rows = q_ptr + tok * stride_qt + gl.expand_dims(heads * stride_qh, 1)
        async_gather(q_smem, q_rows + gl.expand_dims(offs_d, 0))
        _cp.commit_group()

    @gluon.jit
    def unit_sink(sinks_ptr, unit, units_per_token, offs_h, NUM_SPLITS: gl.constexpr):
        """The unit's 64-head block and its heads' sink logits in base 2 (offs_h: 0..63 in the wanted layout): the
        running max a unit starts from, so the sink is in the denominator from the start."""
        hb = (unit % units_per_token) // NUM_SPLITS
        return hb, gl.load(sinks_ptr + hb * 64 + offs_h).to(gl.float32) * 1.4426950408889634

    @gluon.jit
    def unit_row_sum(row_sums, m_i, m_sink, split):
        """A unit's softmax denominator: its rows' exponentials summed, plus the sink's (exp2(sink - max)) in split 0
        only (the merge adds the splits)."""
        return (split == 0).to(gl.float32) * gl.exp2(m_sink - m_i) + row_sums

    @gluon.jit
    def unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS: gl.constexpr,
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
    def next_tile(unit, tile, start, end, band_ptr, num_units, units_per_token, num_rows, num_programs,
                   NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, BAND: gl.constexpr):
        """The tile after (unit, tile) in this program's stream: every unit has at least one tile (an empty unit's
        one tile is all holes, so it still writes its result), then the program's next unit (unit + num_programs)."""
        if tile + 1 < gl.maximum(gl.cdiv(end - start, BLOCK_N), 1):
            tile = tile + 1
        else:
            unit = unit + num_programs
            tile = 0
            start, end = unit_span(band_ptr, unit, num_units, units_per_token, num_rows, NUM_SPLITS, BLOCK_N, BAND)
        return unit, tile, start, end

    @gluon.jit
    def tile_ids(rows_ptr, stride_rt, unit, tile, start, end, units_per_token, offs, BLOCK_N: gl.constexpr):
        """Row ids of one tile (-1 past the span's end and past the last unit)."""
        tok = (unit // units_per_token).to(gl.int64)
        pos = start + tile * BLOCK_N + offs
        return gl.load(rows_ptr + tok * stride_rt + pos, mask=pos < end, other=-1)

    @gluon.jit
    def rows_scaled(acc, l, offs_rows):
        """acc with row i multiplied by 1 / l[i] (offs_rows: a vector in acc's row layout). One reciprocal per row:
        a division per element compiles to four instructions (div.full.f32's range checks)."""
        return acc * gl.expand_dims(gl.convert_layout(1.0 / l, offs_rows.type.layout), 1)

    @gluon.jit
    def store_ml(part_ml_ptr, part, heads, num_heads, offs_sh, m_i, l_i, empty):
        """A split's (max, sum) into part_ml [T, S, 2, H]; an empty split's is (-inf, 0), weight 0 in the merge,
        which then never reads its output (so the unit does not write it)."""
        ml = part_ml_ptr + part * 2 * num_heads + heads + offs_sh
        gl.store(ml, gl.where(empty, float("-inf"), m_i))
        gl.store(ml + num_heads, gl.where(empty, 0.0, l_i))


def hopper_enabled(q: torch.Tensor) -> bool:
    """Whether the Hopper kernels may run for a call on q: Gluon present, q on an sm_90 GPU, and not turned off
    (SPARSESERVE_DISABLE_KERNELS=attention_hopper)."""
    return (HAVE_GLUON and q.device.type == "cuda" and enabled_on("attention_hopper", q.device)
            and capability(q.device)[0] == 9)


def hopper_supported(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether this kernel can serve the call: Hopper, D = 512, heads in blocks of 64, 16-bit, rows that 16-byte
    cp.async can read; and not turned off (SPARSESERVE_DISABLE_KERNELS=attention_hopper). Packed FP8 rows:
    `hopper_fp8.hopper_fp8_supported`."""
    if q.dim() != 3 or not hopper_enabled(q):
        return False
    _, num_heads, head_dim = q.shape
    return (head_dim == HEAD_DIM and num_heads % HEAD_BLOCK == 0
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


