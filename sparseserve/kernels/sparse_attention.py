"""Per-token gathered-row MQA with a per-head sink: the one attention primitive of V4.

Every query token attends over an explicit list of rows of a KV pool (window rows and
chosen compressed rows; -1 marks an unused slot). All heads share the row (K = V).
The softmax denominator also holds exp(sink[h]), and the sink contributes no value.

Roofline (per token, D = head dim, H heads, L rows): bytes = L*D*2 (rows, bf16)
+ 2*H*D*2 (q in, out); FLOPs = 4*H*L*D (QK^T and PV).

Triton kernel: one program per (token, block of heads, split of the row list). Heads are
the M dimension of both dot products, so a KV tile is loaded once and serves every head of
the block (QK^T uses it as K, PV as V). Rows stream in tiles with an online softmax whose
running max starts at the sink logit, so the sink is in the denominator from the start and
the running max is always finite (a token whose rows are all -1 gets exactly 0). Small
batches split the row list across programs (flash-decoding) and a second kernel merges the
partial results. Every choice (block sizes, splits) comes from static shapes only, so the
launch is safe to capture in a CUDA graph. Inside, each program scans its row indices and
streams only the tiles from its first to its last valid row (a device-side loop bound, so
still graph-safe): the work follows the rows a token sees, not the list's static width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl

from .dispatch import enabled_on, env_count, num_sms, use_triton
from .rope import apply_rope
from .pdl import pdl_args, wait_for_prior_grid
from .sparse_attention_wgmma import launch_wgmma_attention, wgmma_supported
from .sparse_attention_wgmma_pair import launch_pair_attention
from .sparse_attention_wgmma_roles import launch_roles_attention


def sparse_mqa_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    token_chunk: int = 256,
) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path).

    q: [T, H, D]; kv_pool: [N, D]; rows: [T, L] int (-1 = unused); sinks: [H] (fp32).
    Returns [T, H, D] in q's dtype. Computed in fp32, in chunks of tokens to bound memory.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    sink_logits = sinks.float().view(1, num_heads, 1)
    for start in range(0, num_tokens, token_chunk):
        end = min(start + token_chunk, num_tokens)
        chunk_rows = rows[start:end].long()
        valid = chunk_rows >= 0  # [t, L]
        keys = kv_pool[chunk_rows.clamp(min=0)].float()  # [t, L, D]
        logits = torch.einsum("thd,tld->thl", q[start:end].float(), keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        row_max = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_logits.expand(end - start, -1, -1))
        probs = torch.exp(logits - row_max)
        denom = probs.sum(dim=-1, keepdim=True) + torch.exp(sink_logits - row_max)
        out[start:end] = torch.einsum("thl,tld->thd", probs / denom, keys).to(q.dtype)
    return out


_LOG2E = 1.4426950408889634


@triton.jit
def _gather_tile(kv_ptr, stride_kv, r, offs_own, own_mask, offs_oth, oth_mask, DV_SPLIT: tl.constexpr):
    """Rows r of the pool (own column half, and the other half when the columns are split).
    Holes (-1) are masked out of the gather, so they cost no memory traffic."""
    valid = r >= 0
    row_ptr = kv_ptr + r.to(tl.int64)[:, None] * stride_kv
    k_own = tl.load(row_ptr + offs_own[None, :], mask=valid[:, None] & own_mask[None, :], other=0.0)
    if DV_SPLIT == 2:
        k_oth = tl.load(row_ptr + offs_oth[None, :], mask=valid[:, None] & oth_mask[None, :], other=0.0)
    else:
        k_oth = k_own
    return k_own, k_oth


@triton.jit
def _attend_tile(q_own, q_oth, k_own, k_oth, valid, m_i, l_i, acc, qk_scale, DV_SPLIT: tl.constexpr):
    """One online-softmax step over a tile of rows (logits in base 2)."""
    s = tl.dot(q_own, tl.trans(k_own))  # [BLOCK_H, BLOCK_N]
    if DV_SPLIT == 2:
        s = tl.dot(q_oth, tl.trans(k_oth), s)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_own.dtype), k_own)
    return m_new, l_i, acc


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


@triton.jit
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


@triton.jit
def _sparse_mqa_fwd_kernel(
    q_ptr, kv_ptr, rows_ptr, band_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    num_heads, num_rows, head_dim, rows_per_split, head_blocks,
    stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh,
    qk_scale,  # scale * log2(e): logits are kept in base 2
    NUM_SPLITS: tl.constexpr, DV_SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCAN: tl.constexpr,
    BAND_PREPASS: tl.constexpr,
    PDL: tl.constexpr,
):
    # One flat grid axis (the y/z axes cap at 65535); head blocks, value halves and splits of
    # one token are adjacent in launch order, so they run together and share rows through L2.
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    per_token = head_blocks * DV_SPLIT * NUM_SPLITS
    tok = (pid // per_token).to(tl.int64)
    rem = pid % per_token
    hb = rem // (DV_SPLIT * NUM_SPLITS)
    dv = (rem // NUM_SPLITS) % DV_SPLIT
    split = rem % NUM_SPLITS

    # DV_SPLIT = 2: this program accumulates only its half of the output columns (half the
    # fp32 accumulator registers); QK^T still needs all D, from its own and the other half.
    DV: tl.constexpr = BLOCK_D // DV_SPLIT
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_own = dv * DV + tl.arange(0, DV)
    own_mask = offs_own < head_dim
    q_base = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh
    q_own = tl.load(q_base + offs_own[None, :], mask=h_mask[:, None] & own_mask[None, :], other=0.0)
    if DV_SPLIT == 2:
        offs_oth = (1 - dv) * DV + tl.arange(0, DV)
        oth_mask = offs_oth < head_dim
        q_oth = tl.load(q_base + offs_oth[None, :], mask=h_mask[:, None] & oth_mask[None, :], other=0.0)
    else:
        offs_oth = offs_own
        oth_mask = own_mask
        q_oth = q_own
    # The running max starts at the sink logit and the sum at exp(sink - max) = 1, so the sink
    # sits in the denominator; only split 0 adds it, the merge then counts it once.
    m_i = tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + (split == 0).to(tl.float32)
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)

    rows_base = rows_ptr + tok * stride_rt
    # Stream only the tiles between the first and the last valid row of this split.
    if BAND_PREPASS:
        # Found by _valid_band_kernel: scanning here, next to a [64, D] accumulator, made the 64-head
        # variants spill (76 registers per thread on triton 3.6, against none without the scan).
        band = band_ptr + (tok * NUM_SPLITS + split) * 2
        row_start = tl.load(band)
        row_end = tl.load(band + 1)
    else:
        # Scanned here (the 16-head variants keep their registers, and a decode step a launch).
        row_start = tl.minimum(split * rows_per_split, num_rows)
        row_end = tl.minimum(split * rows_per_split + rows_per_split, num_rows)
        row_start, row_end = _valid_band(rows_base, row_start, row_end, SCAN)
    if PREFETCH:
        # Register double-buffering: the gather of tile i+1 and the index load of tile i+2 are
        # issued before tile i is computed, so their latency overlaps the math. (Triton's own
        # pipeliner waits for every copy at the top of each iteration here, exposing it.)
        offs_n = row_start + tl.arange(0, BLOCK_N)
        r_cur = tl.load(rows_base + offs_n, mask=offs_n < row_end, other=-1)
        k_own, k_oth = _gather_tile(kv_ptr, stride_kv, r_cur, offs_own, own_mask, offs_oth, oth_mask, DV_SPLIT)
        r_nxt = tl.load(rows_base + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < row_end, other=-1)
        for n0 in range(row_start, row_end, BLOCK_N):
            k_own_nxt, k_oth_nxt = _gather_tile(
                kv_ptr, stride_kv, r_nxt, offs_own, own_mask, offs_oth, oth_mask, DV_SPLIT)
            offs_nn = n0 + 2 * BLOCK_N + tl.arange(0, BLOCK_N)
            r_nn = tl.load(rows_base + offs_nn, mask=offs_nn < row_end, other=-1)
            m_i, l_i, acc = _attend_tile(q_own, q_oth, k_own, k_oth, r_cur >= 0, m_i, l_i, acc, qk_scale, DV_SPLIT)
            r_cur = r_nxt
            r_nxt = r_nn
            k_own = k_own_nxt
            k_oth = k_oth_nxt
    else:
        for n0 in range(row_start, row_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            r = tl.load(rows_base + offs_n, mask=offs_n < row_end, other=-1)
            k_own, k_oth = _gather_tile(kv_ptr, stride_kv, r, offs_own, own_mask, offs_oth, oth_mask, DV_SPLIT)
            m_i, l_i, acc = _attend_tile(q_own, q_oth, k_own, k_oth, r >= 0, m_i, l_i, acc, qk_scale, DV_SPLIT)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_own[None, :],
            out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & own_mask[None, :],
        )
    else:
        # Partials: unnormalised acc [T, S, H, D] and (max, sum) [T, S, 2, H], fp32, contiguous.
        part = tok * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + (part * num_heads + offs_h[:, None]) * head_dim + offs_own[None, :],
            acc, mask=h_mask[:, None] & own_mask[None, :],
        )
        ml_mask = h_mask & ((tl.zeros([BLOCK_H], dtype=tl.int32) + dv) == 0)  # both halves hold the same (max, sum)
        tl.store(part_ml_ptr + part * 2 * num_heads + offs_h, m_i, mask=ml_mask)
        tl.store(part_ml_ptr + part * 2 * num_heads + num_heads + offs_h, l_i, mask=ml_mask)


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
    each split's output is normalised by its own sum (the wgmma kernel's), so it weighs by its share of the
    denominator; else it is the raw accumulator (the Triton and tile-pair kernels'). ROPE_HALF > 0: then rotate the trailing
    2 * ROPE_HALF channels of each head by rope_sign times the token's angles (cos/sin [T, ROPE_HALF]),
    on the output rounded to its dtype, as `rope.apply_rope` would after it: one launch fewer on
    the critical path (the output's inverse rope, ~4 us at batch 1)."""
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
        # A split of weight 0 adds nothing; the wgmma kernel marks an empty split so (max -inf) and
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


@dataclass(frozen=True)
class AttnConfig:
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    dv_split: int = 1  # 2: each program owns half of the output columns
    prefetch: bool = False  # register double-buffering of the row gather (use with num_stages=1)
    band_prepass: bool = False  # valid-row bands from a separate kernel (the 64-head variants: no spills)
    wgmma: bool = False  # the Hopper Gluon kernel (sparse_attention_wgmma.py): 64 heads, D = 512, 8 warps, 2 stages
    max_programs: int = 0  # wgmma: at most this many persistent programs (0: one per SM)
    pair: bool = False  # wgmma: the tile-pair kernel (sparse_attention_wgmma_pair.py; 64-row tiles)
    roles: bool = False  # wgmma: the role-split kernel (sparse_attention_wgmma_roles.py; 64-row tiles)


def attention_config(
    num_tokens: int, num_heads: int, num_rows: int, head_dim: int, num_sms: int, prefetch: bool | None = None,
    wgmma: bool = False, roles: bool | None = None,
) -> AttnConfig:
    """Pick block sizes and row splits from static shapes only (graph-safe).

    wgmma (the Hopper Gluon kernel can serve the call: `sparse_attention_wgmma.wgmma_supported`), from
    WGMMA_MIN_PROGRAMS (token, 64-head) programs on: 64 heads per program, 64-row tiles in a 2-slot ring,
    and the rows split in a power of two (<= WGMMA_SPLIT_MAX, >= WGMMA_SPLIT_MIN_ROWS rows each) while
    the programs still fit one wave. Unsplit rows take the role-split kernel (`sparse_attention_wgmma_roles.py`)
    where `roles` holds (None: as wgmma); otherwise long units take the tile-pair kernel: >= WGMMA_PAIR_MIN_ROWS
    rows per split of 128-head models.

    Chosen from a config sweep on the H200 (docs/performance.md, benchmarks/results/kernels.json):
    - many (token, 64-head) programs (big decode batches, prefill): 64 heads per program, so a KV
      tile feeds an M=64 wgmma and is read once for all heads; 8 warps for the [64, D] fp32
      accumulator; prefill-sized grids take 64-row tiles (rows shared through L2, the kernel
      is compute/latency bound), big decode batches 32-row tiles with 3 stages.
    - otherwise 16 heads per program (mma.sync, no spills) and the rows split in up to
      SPLIT_MAX pieces of >= SPLIT_MIN_ROWS rows, until about 2 programs per SM are running.
      `prefetch` picks the register double-buffered variant there (16-row tiles, the largest
      that does not spill); None = the measured default.
    """
    if prefetch is None:
        prefetch = _PREFETCH_DEFAULT
    wide = num_tokens * triton.cdiv(num_heads, 64)  # (token, 64-head) programs
    if wgmma and num_heads % 64 == 0 and head_dim == 512 and wide >= WGMMA_MIN_PROGRAMS:
        splits = 1
        while (splits * 2 <= WGMMA_SPLIT_MAX and wide * splits * 2 <= num_sms
               and num_rows >= splits * 2 * WGMMA_SPLIT_MIN_ROWS):
            splits *= 2
        # Unsplit rows take the role-split kernel (sparse_attention_wgmma_roles.py). H200, session 24, same process:
        # with q loaded by TMA it runs V4-Flash decode at batch 256 1.07-1.11x the wgmma kernel (session 23's
        # version, 0.92-0.99x, was kept to prefill and 128-head models); docs/performance.md.
        if (wgmma if roles is None else roles) and splits == 1:
            return AttnConfig(64, 64, 8, 2, 1, band_prepass=True, wgmma=True, roles=True)
        # Long units of 128-head models (V4-Pro) take the tile-pair kernel (sparse_attention_wgmma_pair.py).
        pair = num_heads % 128 == 0 and num_rows // splits >= WGMMA_PAIR_MIN_ROWS
        return AttnConfig(64, 64, 8, 2, splits, band_prepass=True, wgmma=True, pair=pair)
    big_d = head_dim > 128
    if num_heads >= 64 and 4 * wide >= 3 * num_sms:
        if not big_d:
            return AttnConfig(64, 64, 4, 2, band_prepass=True)
        if wide >= 8 * num_sms:
            return AttnConfig(64, 64, 8, 2, band_prepass=True)
        return AttnConfig(64, 32, 8, 3, band_prepass=True)
    block_h = 16
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    # Each split keeps >= SPLIT_MIN_ROWS rows so partials stay small.
    max_splits = min(SPLIT_MAX, max(1, num_rows // SPLIT_MIN_ROWS))
    splits = 1
    while splits * 2 <= max_splits and programs * splits * 2 <= 2 * num_sms:  # powers of 2: few compiles
        splits *= 2
    if prefetch:
        return AttnConfig(block_h, 16, 4, 1, splits, 1, True)
    return AttnConfig(block_h, 64, 4, 2, splits)


_PREFETCH_DEFAULT = False
# Row splits of the 16-head path (static: a captured graph keeps its split). The environment
# overrides them only to measure other splits in a whole decode step (gpu_session.sh).
SPLIT_MIN_ROWS = env_count("SPARSESERVE_ATTN_SPLIT_MIN_ROWS", 64)
SPLIT_MAX = env_count("SPARSESERVE_ATTN_SPLIT_MAX", 8)
WGMMA_SPLIT_MIN_ROWS = env_count("SPARSESERVE_ATTN_WGMMA_SPLIT_MIN_ROWS", 32)
WGMMA_SPLIT_MAX = env_count("SPARSESERVE_ATTN_WGMMA_SPLIT_MAX", 16)
# Fewer (token, 64-head) programs than this keep the Triton 16-head path. Session 17 set 16: at batch 1-8 the
# wgmma kernel was at best 1-2 us faster on full row lists, and 24 us slower per decode step at batch 8 with
# 256-token prompts (lists mostly holes). Since its split partials leave as 16 bits by TMA (session 20), V4-Flash
# batch 8 (8 programs) takes 13.5 vs 16.6 us at CSA and 16.3 vs 20.7 at HCA 128K, and those decode steps are
# even (0.954 vs 0.947 ms back to back; H200, docs/performance.md).
WGMMA_MIN_PROGRAMS = env_count("SPARSESERVE_ATTN_WGMMA_MIN_PROGRAMS", 8)
# Row splits this long (V4-Pro CSA, and HCA from 128K: 1152 rows) of 128-head models take the tile-pair kernel where
# the role-split kernel is off (with it on, such rows are unsplit and go to it).
# H200, session 18, same run: Pro CSA prefill 32K 23202 vs 26491 us, 4K 2020 vs 2232, decode batch 64/256 4-6%
# faster; batch 8 (8 splits of 144 rows) 5-10% slower, Flash CSA (640 rows) and HCA prefill no gain or slower.
WGMMA_PAIR_MIN_ROWS = env_count("SPARSESERVE_ATTN_WGMMA_PAIR_MIN_ROWS", 1024)
# (Session 18 also sent V4-Flash CSA prefill, 640 rows, to it: 881 vs 908 us at 4K. Since the wgmma kernel stores
# its output by TMA, session 19, it is the faster there: 816 vs 875 us at 4K, 7363 vs 7778 at 32K, same run.)
# Heads per merge program (a power of two): 4 gives a batch-1 token 16 programs at 64 heads instead of 4
# (H200, session 11, b2b steps: batch 1 0.746 / 0.747 -> 0.739 / 0.738 ms, batch 8 0.998 / 1.000 -> 0.994 / 0.991).
MERGE_HEADS = env_count("SPARSESERVE_ATTN_MERGE_HEADS", 4)
if MERGE_HEADS & (MERGE_HEADS - 1):
    raise ValueError(f"SPARSESERVE_ATTN_MERGE_HEADS must be a power of two, got {MERGE_HEADS}")
# Columns per merge program (a power of two, at least 16). H200, session 21, decode kernel benchmark: 256 against the
# whole row (512) per program: batch 8 (wgmma) up to 1.5 us faster, batch 1 (Triton) 0.3-0.6 us; 128 measured between.
MERGE_COLS = env_count("SPARSESERVE_ATTN_MERGE_COLS", 256)
if MERGE_COLS & (MERGE_COLS - 1) or MERGE_COLS < 16:
    raise ValueError(f"SPARSESERVE_ATTN_MERGE_COLS must be a power of two >= 16, got {MERGE_COLS}")


def engine_attention_config(q: torch.Tensor, kv_pool: torch.Tensor, num_rows: int) -> AttnConfig:
    """The config the engine takes for these tensors: `attention_config` with the Gluon kernels where they can
    serve the call and are not turned off (SPARSESERVE_DISABLE_KERNELS=attention_wgmma / attention_roles)."""
    on_hopper = wgmma_supported(q, kv_pool)
    num_tokens, num_heads, head_dim = q.shape
    return attention_config(num_tokens, num_heads, num_rows, head_dim, num_sms(q.device), wgmma=on_hopper,
                            roles=on_hopper and enabled_on("attention_roles", q.device))


def split_length(num_rows: int, cfg: AttnConfig) -> int:
    """Row slots per split: the list cut into cfg.num_splits pieces, each a whole number of tiles."""
    return triton.cdiv(triton.cdiv(max(num_rows, 1), cfg.num_splits), cfg.block_n) * cfg.block_n


def needs_band_prepass(cfg: AttnConfig, rows_per_split: int) -> bool:
    """Whether the launch runs `_valid_band_kernel` first. The wgmma kernel's splits of one tile (small decode
    batches: 16 splits of 640 rows, 8 of 384) need no band: the tile masks its holes anyway and an all-holes
    split is known from its row ids, so the pre-pass and its graph node are saved."""
    if cfg.wgmma and not (cfg.pair or cfg.roles) and rows_per_split == cfg.block_n:
        return False
    return cfg.band_prepass


def sparse_mqa_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    config: AttnConfig | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton kernel; same contract as sparse_mqa_attention_ref. Runs on CUDA, or on the CPU
    under TRITON_INTERPRET=1 (tests). inverse_rope (cos, sin [T, rope_dim/2] fp32): then the output's
    trailing rope channels are rotated back, as `rope.apply_rope(out, cos, sin, inverse=True)` does
    (inside the split merge when there is one, else by that kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows = rows.shape[1]
    out = torch.empty_like(q)
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
    # (The engine's own configs are valid by construction; a caller's is checked.)
    if config is not None and cfg.wgmma and not (
            wgmma_supported(q, kv_pool) and cfg.block_h == 64 and cfg.band_prepass and cfg.num_stages == 2
            and cfg.block_n in ((64,) if cfg.pair or cfg.roles else (32, 64))):
        raise ValueError(f"{cfg} asks for the wgmma kernel, which takes Hopper, 64-head blocks, D = 512, 2 stages of "
                         f"32 or 64 rows and a band pre-pass; got q {tuple(q.shape)} {q.dtype} on {q.device}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    splits = cfg.num_splits
    rows_per_split = split_length(num_rows, cfg)
    if splits > 1:
        # The wgmma kernel stores its splits' normalised outputs by TMA in q's dtype (half the bytes, in whole
        # sectors); the other kernels' stores from registers keep the fp32 acc (a 16-bit store from the
        # wgmma layout writes half sectors: 10-16% slower, session 19).
        parts_normalised = cfg.wgmma and not cfg.pair  # (the role-split kernel's too)
        part_dtype = q.dtype if parts_normalised and cfg.block_n == 64 else torch.float32
        part_acc = torch.empty((num_tokens, splits, num_heads, head_dim), dtype=part_dtype, device=q.device)
        part_ml = torch.empty((num_tokens, splits, 2, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    dv_split = cfg.dv_split if block_d >= 32 else 1
    scan = min(256, triton.next_power_of_2(max(rows_per_split, 16)))
    if needs_band_prepass(cfg, rows_per_split):
        band = torch.empty(num_tokens * splits * 2, dtype=torch.int32, device=q.device)
        _valid_band_kernel[(num_tokens * splits,)](
            rows, band, num_rows, rows_per_split, rows.stride(0), NUM_SPLITS=splits, SCAN=scan, num_warps=4,
            **pdl_args(rows.device))
    else:
        band = None if cfg.wgmma else rows  # wgmma: one-tile splits read their segments; else unused
    if cfg.wgmma and cfg.roles:
        launch_roles_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, float(scale) * _LOG2E,
                               splits, cfg.max_programs or num_sms(q.device))
    elif cfg.wgmma and cfg.pair:
        launch_pair_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, float(scale) * _LOG2E,
                              splits, cfg.max_programs or num_sms(q.device))
    elif cfg.wgmma:
        launch_wgmma_attention(q, kv_pool, rows, band, sinks, out, part_acc, part_ml, float(scale) * _LOG2E,
                               cfg.block_n, splits, cfg.max_programs or num_sms(q.device))
    else:
        _sparse_mqa_fwd_kernel[(num_tokens * head_blocks * dv_split * splits,)](
            q, kv_pool, rows, band, sinks, out, part_acc, part_ml,
            num_heads, num_rows, head_dim, rows_per_split, head_blocks,
            q.stride(0), q.stride(1), kv_pool.stride(0), rows.stride(0), out.stride(0), out.stride(1),
            float(scale) * _LOG2E,
            NUM_SPLITS=splits, DV_SPLIT=dv_split, PREFETCH=cfg.prefetch,
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SCAN=scan, BAND_PREPASS=cfg.band_prepass,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q.device)
        )
    fuse_rope = inverse_rope is not None and splits > 1 and block_d == head_dim
    if splits > 1:
        merge_bh = MERGE_HEADS
        cos, sin = (t.float().contiguous() for t in inverse_rope) if fuse_rope else (out, out)
        merge_cols = min(MERGE_COLS, block_d)
        _sparse_mqa_merge_kernel[(num_tokens, triton.cdiv(num_heads, merge_bh), triton.cdiv(head_dim, merge_cols))](
            part_acc, part_ml, out, cos, sin, num_heads, head_dim, out.stride(0), out.stride(1), -1.0,
            NUM_SPLITS=splits, BLOCK_H=merge_bh, BLOCK_D=merge_cols,
            ROPE_HALF=inverse_rope[0].shape[-1] if fuse_rope else 0, PARTS_NORMALISED=parts_normalised,
            num_warps=4, **pdl_args(part_acc.device)
        )
    if inverse_rope is not None and not fuse_rope:
        out = apply_rope(out, *inverse_rope, inverse=True)
    return out


def sparse_mqa_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor, scale: float,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (bf16/fp16), the reference elsewhere. inverse_rope
    (cos, sin): then the output's rope channels are rotated back (V4 attention output)."""
    if use_triton("attention", q) and q.dtype in (torch.bfloat16, torch.float16):
        return sparse_mqa_attention_triton(q, kv_pool, rows, sinks, scale, inverse_rope=inverse_rope)
    out = sparse_mqa_attention_ref(q, kv_pool, rows, sinks, scale)
    return out if inverse_rope is None else apply_rope(out, *inverse_rope, inverse=True)
