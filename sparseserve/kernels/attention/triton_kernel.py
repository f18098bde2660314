"""Portable Triton kernel of gathered-row MQA with a sink (every GPU, and the CPU under TRITON_INTERPRET=1), the
band pre-pass and the split merge that the Hopper kernel shares, and the launcher of both kernels.

One program per (token, block of heads, split of the row list). Heads are the M dimension of both dot products, so
a KV tile is loaded once and serves every head of the block (QK^T uses it as K, PV as V). Rows stream in tiles with
an online softmax whose running max starts at the sink logit. Small batches split the row list across programs
(flash-decoding) and the merge kernel combines the partial results. Each program streams only the tiles from its
first to its last valid row (a device-side loop bound, so still graph-safe): the work follows the rows a token sees,
not the list's static width. Launch choices come from `select.attention_config` (static shapes only).

FP8 KV cache (sparseserve/kv_format.py): the pool holds packed rows; a tile is gathered through one uint8 pointer
(stride in bytes) and dequantized in registers to q's dtype (exact: e4m3 times a power of two), then the same
dot products run. The engine's selection sends FP8 rows here; the role-split Hopper kernel has an FP8 form
(`hopper_fp8.py`), launched by the named config `select.fp8_hopper_attention_config` (not yet the engine's).

Roofline (per token, D = head dim, H heads, L rows): bytes = L*D*2 (rows, bf16; FP8: L*row_bytes) + 2*H*D*2 (q in, out);
FLOPs = 4*H*L*D (QK^T and PV).
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from ... import envs
from ...kv_format import KVFormat
from ..dispatch import num_sms
from ..kv_fp8 import fp8_block, load_kv_tile
from ..pdl import pdl_args, wait_for_prior_grid
from ..rope import apply_rope
from .hopper import launch_hopper_attention
from .hopper_common import hopper_supported
from .hopper_fp8 import FP8_FORMAT, hopper_fp8_supported
from .hopper_split import launch_split_attention
from .select import MERGE_COLS, MERGE_HEADS, AttnConfig, attention_config, needs_band_prepass, split_length

_LOG2E = 1.4426950408889634
# Read once, at import, which is when Triton decides whether the kernels below are interpreted.
_INTERPRET = envs.triton_interpret()


@triton.jit
def _valid_band(rows_base, row_start, row_end, SCAN: tl.constexpr):
    """[first, last + 1) of the valid (>= 0) rows in [row_start, row_end); empty if none. Holes lead
    the window rows of a sequence's first tokens and trail the entries of short sequences (in
    prefill most of a CSA list): the scan reads 4 B per row against 2*D B for each row it spares."""
    lo = row_end
    hi = row_start
    for s0 in range(row_start, row_end, SCAN):
        offs_s = s0 + tl.arange(0, SCAN)
        r_s = tl.load(rows_base + offs_s, mask=offs_s < row_end, other=-1)
        lo = tl.minimum(lo, tl.min(tl.where(r_s >= 0, offs_s, row_end)))
        hi = tl.maximum(hi, tl.max(tl.where(r_s >= 0, offs_s + 1, row_start)))
    return lo, hi


@triton.jit(do_not_specialize=["num_rows", "stride_rt"])
def _valid_band_kernel(rows_ptr, band_ptr, num_rows, rows_per_split, stride_rt,
                       NUM_SPLITS: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr):
    """Each (token, split)'s valid band, for attention programs that read it instead of scanning."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    tok = (pid // NUM_SPLITS).to(tl.int64)
    split = pid % NUM_SPLITS
    row_start = tl.minimum(split * rows_per_split, num_rows)
    row_end = tl.minimum(split * rows_per_split + rows_per_split, num_rows)
    lo, hi = _valid_band(rows_ptr + tok * stride_rt, row_start, row_end, SCAN)
    tl.store(band_ptr + pid * 2, lo)
    tl.store(band_ptr + pid * 2 + 1, hi)


@triton.jit(do_not_specialize=["num_rows", "stride_rt"])
def _sparse_mqa_fwd_kernel(
    q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    num_heads, num_rows, head_dim, rows_per_split, head_blocks,
    stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
    qk_scale,  # scale * log2(e): logits are kept in base 2
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr, BAND_PREPASS: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr,
    SCALE_OFF: tl.constexpr, F32_PRODUCT: tl.constexpr, PARTS_NORMALISED: tl.constexpr, PDL: tl.constexpr,
):
    # One flat grid axis (the y/z axes cap at 65535); head blocks and splits of one token are adjacent in launch
    # order, so they run together and share rows through L2.
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    per_token = head_blocks * NUM_SPLITS
    tok = (pid // per_token).to(tl.int64)
    hb = (pid % per_token) // NUM_SPLITS
    split = pid % NUM_SPLITS

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    # The running max starts at the sink logit and the sum at exp(sink - max) = 1, so the sink sits in the
    # denominator and the max is always finite; only split 0 adds it, the merge then counts it once.
    m_i = tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + (split == 0).to(tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    rows_base = rows_ptr + tok * stride_rt
    # Stream only the tiles between the first and the last valid row of this split.
    if BAND_PREPASS:
        # Found by _valid_band_kernel: scanning here, next to a [64, D] accumulator, made the 64-head variants spill.
        band = band_ptr + (tok * NUM_SPLITS + split) * 2
        row_start = tl.load(band)
        row_end = tl.load(band + 1)
    else:
        # Scanned here (the 16-head variants keep their registers, and a decode step a launch).
        row_start = tl.minimum(split * rows_per_split, num_rows)
        row_end = tl.minimum(split * rows_per_split + rows_per_split, num_rows)
        row_start, row_end = _valid_band(rows_base, row_start, row_end, SCAN)
    for n0 in range(row_start, row_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        r = tl.load(rows_base + offs_n, mask=offs_n < row_end, other=-1)
        valid = r >= 0
        # Holes (-1) are masked out of the gather, so they cost no memory traffic.
        if FP8:
            k = load_kv_tile(kv_ptr, r.to(tl.int64), valid, stride_kv, head_dim, NOPE, SCALE_OFF, BLOCK_D,
                             q_ptr.dtype.element_ty, F32_PRODUCT)
        else:
            k = tl.load(kv_ptr + r.to(tl.int64)[:, None] * stride_kv + offs_d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Partials: acc [T, S, H, D] and (max, sum) [T, S, 2, H], contiguous. The acc unnormalised in fp32, or
        # (PARTS_NORMALISED) divided by its split's sum in the partials' dtype, as the Hopper kernel stores them;
        # an empty split (sum 0) stores 0, which the merge weighs by 0.
        part = tok * NUM_SPLITS + split
        if PARTS_NORMALISED:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(part_acc_ptr + (part * num_heads + offs_h[:, None]) * head_dim + offs_d[None, :],
                 acc.to(part_acc_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + part * 2 * num_heads + offs_h, m_i, mask=h_mask)
        tl.store(part_ml_ptr + part * 2 * num_heads + num_heads + offs_h, l_i, mask=h_mask)


@triton.jit
def _sparse_mqa_merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, cos_ptr, sin_ptr,
    num_heads, head_dim, stride_ot, stride_oh, rope_sign,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_HALF: tl.constexpr,
    PARTS_NORMALISED: tl.constexpr, PDL: tl.constexpr,
):
    """Combine the row splits of one token's heads, BLOCK_D of their columns per program (grid axis 2), so each
    thread loads a few values per split and every split's load can be in flight at once (with whole rows, 16
    values per thread and split, ptxas issued the loads in rounds set by its register budget). PARTS_NORMALISED:
    each split's output is normalised by its own sum (the Hopper kernel's), so it weighs by its share of the
    denominator; else it is the raw accumulator (the Triton kernel's). ROPE_HALF > 0: then rotate the trailing
    2 * ROPE_HALF channels of each head by rope_sign times the token's angles (cos/sin [T, ROPE_HALF]),
    on the output rounded to its dtype, as `rope.apply_rope` would after it: one launch fewer on
    the critical path (the output's inverse rope)."""
    wait_for_prior_grid(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col0 = tl.program_id(2) * BLOCK_D
    offs_d = col0 + tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
    ml_base = part_ml_ptr + tok * NUM_SPLITS * 2 * num_heads
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(ml_base + s * 2 * num_heads + offs_h, mask=h_mask, other=0.0))
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(ml_base + s * 2 * num_heads + offs_h, mask=h_mask, other=0.0)
        l_s = tl.load(ml_base + s * 2 * num_heads + num_heads + offs_h, mask=h_mask, other=0.0)
        w = tl.exp2(m_s - m)  # split 0's max is >= the sink logit, so m is finite: no NaN
        l += l_s * w
        # A split of weight 0 adds nothing; the Hopper kernel marks an empty split so (max -inf) and
        # does not write its output, which is then never read.
        a = tl.load(
            part_acc_ptr + ((tok * NUM_SPLITS + s) * num_heads + offs_h[:, None]) * head_dim + offs_d[None, :],
            mask=mask & (w[:, None] > 0), other=0.0,
        ).to(tl.float32)
        if PARTS_NORMALISED:
            w = w * l_s
        acc += a * w[:, None]
    l = tl.where(h_mask, l, 1.0)  # padded heads: avoid 0/0 (never stored)
    out = acc / l[:, None]
    if ROPE_HALF > 0:
        y = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        e, o = tl.split(tl.reshape(y, [BLOCK_H, BLOCK_D // 2, 2]))
        pair = col0 // 2 + tl.arange(0, BLOCK_D // 2) - (head_dim // 2 - ROPE_HALF)  # index among the rotated pairs
        rotated = (pair >= 0) & (pair < ROPE_HALF)
        c = tl.load(cos_ptr + tok * ROPE_HALF + pair, mask=rotated, other=1.0)[None, :]
        sn = (tl.load(sin_ptr + tok * ROPE_HALF + pair, mask=rotated, other=0.0) * rope_sign)[None, :]
        e_out = tl.where(rotated[None, :], e * c - o * sn, e)
        o_out = tl.where(rotated[None, :], o * c + e * sn, o)
        out = tl.reshape(tl.join(e_out, o_out), [BLOCK_H, BLOCK_D])
    tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def engine_attention_config(q: torch.Tensor, kv_pool: torch.Tensor, num_rows: int) -> AttnConfig:
    """The config the engine takes for these tensors: `attention_config`, with the Hopper kernel where it can serve
    the call and is not turned off (SPARSESERVE_DISABLE_KERNELS=attention_hopper; FP8 rows, a uint8 pool: never,
    they take the FP8 rows of the table)."""
    num_tokens, num_heads, head_dim = q.shape
    return attention_config(num_tokens, num_heads, num_rows, head_dim, num_sms(q.device),
                            hopper=hopper_supported(q, kv_pool), fp8=kv_pool.dtype == torch.uint8)


def sparse_mqa_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    config: AttnConfig | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_format: KVFormat | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels; same contract as `reference.sparse_mqa_attention_ref`. Runs on CUDA, or on the CPU under
    TRITON_INTERPRET=1 (the Triton kernel only). inverse_rope (cos, sin [T, rope_dim/2] fp32): then the output's
    trailing rope channels are rotated back, as `rope.apply_rope(out, cos, sin, inverse=True)` does (inside the
    split merge when there is one, else by that kernel). `out`: a contiguous [T, H, D] tensor in q's dtype to
    write (and return) instead of a new one."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows = rows.shape[1]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv_pool.stride(1) != 1:
        kv_pool = kv_pool.contiguous()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    sinks = sinks.contiguous()
    cfg = config or engine_attention_config(q, kv_pool, num_rows)
    hopper = cfg.kernel == "hopper"
    hopper_tiles = cfg.block_h == 64 and cfg.block_n == 64 and cfg.band_prepass
    if hopper and kv_format is not None:
        if not (hopper_fp8_supported(q, kv_pool, kv_format) and hopper_tiles):
            raise ValueError(f"{cfg} asks for the Hopper kernel on FP8 KV rows, which takes sm_90, bf16 q with "
                             f"64-head blocks, D = 512, the {FP8_FORMAT} row layout, 64-row tiles and a band "
                             f"pre-pass; got q {tuple(q.shape)} {q.dtype} on {q.device}, {kv_format}: use a 'triton' "
                             f"config (select.fp8_attention_config)")
    elif config is not None and hopper and not (hopper_supported(q, kv_pool) and hopper_tiles):
        raise ValueError(f"{cfg} asks for the Hopper kernel, which takes sm_90, 64-head blocks, D = 512, 64-row "
                         f"tiles and a band pre-pass; got q {tuple(q.shape)} {q.dtype} on {q.device}")
    if cfg.kernel not in ("triton", "hopper"):
        raise ValueError(f"AttnConfig.kernel must be 'triton' or 'hopper', got {cfg.kernel!r}")
    block_d = fp8_block(head_dim) if kv_format is not None else max(16, triton.next_power_of_2(head_dim))
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    splits = cfg.num_splits
    rows_per_split = split_length(num_rows, cfg)
    normalised = hopper or kv_format is not None  # the split partials: normalised, in q's dtype
    if splits > 1:
        # The Hopper kernel stores its splits' normalised outputs by TMA in q's dtype (half the bytes, whole
        # sectors), and so does the Triton kernel on FP8 rows (at 592 B a row, fp32 partials of a 2-split batch-64
        # call would be 70% of its row bytes); on 16-bit rows it keeps the raw fp32 accumulators.
        part_dtype = q.dtype if normalised else torch.float32
        part_acc = torch.empty((num_tokens, splits, num_heads, head_dim), dtype=part_dtype, device=q.device)
        part_ml = torch.empty((num_tokens, splits, 2, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    scan = min(256, triton.next_power_of_2(max(rows_per_split, 16)))
    band = None
    if needs_band_prepass(cfg, rows_per_split):
        band = torch.empty(num_tokens * splits * 2, dtype=torch.int32, device=q.device)
        _valid_band_kernel[(num_tokens * splits,)](
            rows, band, num_rows, rows_per_split, rows.stride(0), NUM_SPLITS=splits, SCAN=scan, num_warps=4,
            **pdl_args(rows.device))
    if hopper and kv_format is not None:
        # FP8 rows: the role-split kernel's FP8 form, split or not (only it has one: hopper_fp8.py).
        launch_hopper_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, float(scale) * _LOG2E, splits,
                                cfg.max_programs or num_sms(q.device), fp8=True)
    elif hopper:
        # Unsplit calls take the role-split kernel, split ones the lockstep kernel (select.py says why).
        launch = launch_split_attention if splits > 1 else launch_hopper_attention
        launch(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, float(scale) * _LOG2E, splits,
               cfg.max_programs or num_sms(q.device))
    else:
        _sparse_mqa_fwd_kernel[(num_tokens * head_blocks * splits,)](
            q, kv_pool, rows, rows if band is None else band, sinks, out, part_acc, part_ml,
            num_heads, num_rows, head_dim, rows_per_split, head_blocks,
            q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1),
            float(scale) * _LOG2E,
            NUM_SPLITS=splits, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SCAN=scan,
            BAND_PREPASS=band is not None, FP8=kv_format is not None,
            NOPE=kv_format.nope_dim if kv_format is not None else 0,
            SCALE_OFF=kv_format.scale_offset if kv_format is not None else 0,
            F32_PRODUCT=kv_format is not None and (_INTERPRET or q.dtype != torch.bfloat16),
            PARTS_NORMALISED=normalised and splits > 1, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl_args(q.device)
        )
    fuse_rope = inverse_rope is not None and splits > 1 and block_d == head_dim
    if splits > 1:
        cos, sin = (t.float().contiguous() for t in inverse_rope) if fuse_rope else (out, out)
        merge_cols = min(MERGE_COLS, block_d)
        _sparse_mqa_merge_kernel[(num_tokens, triton.cdiv(num_heads, MERGE_HEADS), triton.cdiv(head_dim, merge_cols))](
            part_acc, part_ml, out, cos, sin, num_heads, head_dim, out.stride(0), out.stride(1), -1.0,
            NUM_SPLITS=splits, BLOCK_H=MERGE_HEADS, BLOCK_D=merge_cols,
            ROPE_HALF=inverse_rope[0].shape[-1] if fuse_rope else 0, PARTS_NORMALISED=normalised,
            num_warps=4, **pdl_args(part_acc.device)
        )
    if inverse_rope is not None and not fuse_rope:
        rotated = apply_rope(out, *inverse_rope, inverse=True)
        if rotated is not out:  # the rope's reference path rotates out of place
            out.copy_(rotated)
    return out
