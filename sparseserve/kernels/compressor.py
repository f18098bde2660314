"""Compressor: pools a closed window of projected tokens into one compressed entry.

For a token that closes window w (position p = (w + 1) * rate - 1), the entry is
    kv_norm( sum_j softmax_j(gate_j + position_bias_j) * kv_j )  (per channel, over the window)
then rotated with rope at position w * rate and written to its pool row. CSA ("overlap")
pools 2*rate slots: the first half of each source token's features from window w-1 and
the second half from window w. Sources before position 0 get zero weight.
The token's projections live in a position-addressed state buffer (kv || gate).

An emitting token whose out row is -1 writes nothing (and the kernel reads nothing for it):
a captured step passes every token as a possible emitter, and the ones that close no window
then cost no memory traffic, with no host branch (docs/design.md, invariant 1).

FP8 KV cache (sparseserve/kv_format.py): the entry is computed as for the compressor state's dtype, then
quantized in the same program: packed KV rows (`kv_format`), or indexer codes with one scale per key
(`out_scale`).

Roofline (per emitted entry, S slots, width Wd): bytes = S * 2 * Wd * 2 + out; FLOPs ~ 6 * S * Wd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_format import KVFormat, quantize_index_rows, quantize_kv_rows
from .dispatch import use_triton
from .kv_fp8 import fp8_block, quant_index_row, store_kv_row
from .rmsnorm import rms_norm_ref
from .rope import apply_rope_ref
from .pdl import pdl_args, wait_for_prior_grid


def compress_windows_ref(
    state: torch.Tensor,
    src_rows: torch.Tensor,
    position_bias: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_pool: torch.Tensor,
    out_rows: torch.Tensor,
    kv_format: KVFormat | None = None,
    out_scale: torch.Tensor | None = None,
) -> None:
    """Plain-PyTorch reference (and CPU path).

    state: [N, 2 * Wd] rows of kv || gate; src_rows: [M, S] (S = 2*rate with overlap, else rate;
    -1 = no source); position_bias: [rate, Wd]; cos/sin: [M, rope_dim/2] at the entry positions;
    out_pool: [P, head_dim]; out_rows: [M] destination rows (-1 = write nothing).
    kv_format: out_pool holds packed FP8 KV rows [P, row_bytes]; out_scale [P] fp32: out_pool holds FP8
    indexer codes [P, head_dim] uint8 with these scales. Either way the entry is first rounded to state's dtype.
    """
    if src_rows.shape[0] == 0:
        return
    width = state.shape[1] // 2
    rate = position_bias.shape[0]
    valid = src_rows >= 0
    gathered = state[src_rows.clamp(min=0)].float()  # [M, S, 2*Wd]
    kv, gate = gathered[..., :width], gathered[..., width:]
    bias = position_bias.float()
    if overlap:
        head_dim = width // 2
        kv = torch.cat([kv[:, :rate, :head_dim], kv[:, rate:, head_dim:]], dim=1)
        gate = torch.cat([gate[:, :rate, :head_dim] + bias[:, :head_dim], gate[:, rate:, head_dim:] + bias[:, head_dim:]], dim=1)
    else:
        gate = gate + bias
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    pooled = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
    quantized = kv_format is not None or out_scale is not None
    row_dtype = state.dtype if quantized else out_pool.dtype
    entry = (norm_weight.float() * rms_norm_ref(pooled, None, norm_eps)).to(row_dtype)
    entry = apply_rope_ref(entry, cos, sin)
    keep = out_rows >= 0  # a mask index syncs on CUDA; this is the CPU path
    dest = out_rows[keep].long()
    if kv_format is not None:
        out_pool.index_copy_(0, dest, quantize_kv_rows(entry[keep], kv_format))
    elif out_scale is not None:
        codes, scales = quantize_index_rows(entry[keep])
        out_pool.index_copy_(0, dest, codes)
        out_scale.index_copy_(0, dest, scales)
    else:
        out_pool.index_copy_(0, dest, entry[keep])


@triton.jit
def _compress_windows_kernel(
    state_ptr, src_ptr, bias_ptr, normw_ptr, cos_ptr, sin_ptr, out_ptr, out_rows_ptr, out_scale_ptr,
    stride_state, stride_src, stride_bias, stride_cos, stride_sin, stride_out,
    eps,
    HEAD_DIM: tl.constexpr,  # output channels (the RMSNorm width); even
    WIDTH: tl.constexpr,  # kv (and gate) features per state row: 2*HEAD_DIM with overlap
    RATE: tl.constexpr,
    OVERLAP: tl.constexpr,
    NUM_SLOTS: tl.constexpr,  # 2*RATE with overlap, else RATE
    HALF_ROPE: tl.constexpr,  # rope_dim // 2 (pairs rotated at the tail of the row)
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    QUANT: tl.constexpr,  # 0: out_pool in a float dtype; 1: packed FP8 KV rows; 2: FP8 indexer codes + scales
    NOPE: tl.constexpr,  # QUANT 1: the FP8 channels and the scale bytes' offset
    SCALE_OFF: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per emitting token, holding its whole row so the RMSNorm needs no second
    # pass; rows are read contiguously and only the final row is split into (even, odd)
    # pairs for the interleaved rope.
    wait_for_prior_grid(PDL)
    m = tl.program_id(0).to(tl.int64)
    out_row = tl.load(out_rows_ptr + m).to(tl.int64)
    if out_row >= 0:  # device-side: a token that closes no window reads and writes nothing
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        # Running max starts finite so an all-hole tile gives alpha = 1, p = 0 (not NaN).
        m_i = tl.full([BLOCK_D], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, NUM_SLOTS, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            jmask = j < NUM_SLOTS
            rows = tl.load(src_ptr + m * stride_src + j, mask=jmask, other=-1).to(tl.int64)
            valid = rows >= 0
            if OVERLAP:
                # Slots of window w-1 read features [:HEAD_DIM], those of window w [HEAD_DIM:]
                # (the reference concatenates; here it is only an offset).
                # (A product, not a select: keeps the offset's divisibility visible, so the
                # loads stay vectorised.)
                feat = (j // RATE) * HEAD_DIM
                brow = j % RATE
            else:
                feat = j * 0
                brow = j
            lmask = valid[:, None] & dmask[None, :]
            src = state_ptr + rows[:, None] * stride_state + feat[:, None] + d[None, :]
            kv = tl.load(src, mask=lmask, other=0.0).to(tl.float32)
            g = tl.load(src + WIDTH, mask=lmask, other=0.0).to(tl.float32)
            g += tl.load(bias_ptr + brow[:, None] * stride_bias + feat[:, None] + d[None, :],
                         mask=jmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            g = tl.where(lmask, g, float("-inf"))
            # Online softmax over slots, per channel.
            m_new = tl.maximum(m_i, tl.max(g, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(g - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p * kv, 0)
            m_i = m_new
        # Padding channels (dmask off) hold 0/0: divide them by 1 instead.
        pooled = tl.where(dmask, acc / tl.where(dmask, l_i, 1.0), 0.0)
        r = 1.0 / tl.sqrt(tl.sum(pooled * pooled, 0) / HEAD_DIM + eps)
        w = tl.load(normw_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        # The reference rounds the normed entry to the pool dtype before rope: so do we.
        odt = out_ptr.dtype.element_ty if QUANT == 0 else state_ptr.dtype.element_ty
        y = (w * (pooled * r)).to(odt).to(tl.float32)
        # Interleaved rope on the trailing pairs: (2i, 2i+1) -> (e*c - o*s, o*c + e*s).
        y_e, y_o = tl.split(tl.reshape(y, [BLOCK_D // 2, 2]))
        pair = tl.arange(0, BLOCK_D // 2)
        k = pair - (HEAD_DIM // 2 - HALF_ROPE)
        rmask = (k >= 0) & (pair < HEAD_DIM // 2)
        c = tl.load(cos_ptr + m * stride_cos + k, mask=rmask, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + m * stride_sin + k, mask=rmask, other=0.0).to(tl.float32)
        o_e = tl.where(rmask, y_e * c - y_o * s, y_e)
        o_o = tl.where(rmask, y_o * c + y_e * s, y_o)
        out = tl.reshape(tl.join(o_e, o_o), [BLOCK_D])
        if QUANT == 1:
            store_kv_row(out_ptr + out_row * stride_out, out.to(odt).to(tl.float32), HEAD_DIM, NOPE, SCALE_OFF,
                         BLOCK_D)
        elif QUANT == 2:
            codes, sc = quant_index_row(out.to(odt).to(tl.float32), dmask)
            tl.store(out_ptr + out_row * stride_out + d, codes.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
                     mask=dmask)
            tl.store(out_scale_ptr + out_row, sc)
        else:
            tl.store(out_ptr + out_row * stride_out + d, out.to(odt), mask=dmask)


def compress_config(head_dim: int, num_slots: int) -> tuple[int, int]:
    """(BLOCK_S, num_warps): about 4K elements per [BLOCK_S, BLOCK_D] tile."""
    block_d = triton.next_power_of_2(max(head_dim, 2))
    block_s = min(triton.next_power_of_2(num_slots), max(1, 4096 // block_d))
    return block_s, (8 if block_d >= 512 else 4)


def compress_windows_triton(
    state: torch.Tensor,
    src_rows: torch.Tensor,
    position_bias: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_pool: torch.Tensor,
    out_rows: torch.Tensor,
    block_s: int | None = None,
    num_warps: int | None = None,
    kv_format: KVFormat | None = None,
    out_scale: torch.Tensor | None = None,
) -> None:
    """Triton kernel, one launch for all M emitting tokens; same contract as
    compress_windows_ref. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
    No host sync: only static shapes are read here (CUDA-graph capturable)."""
    num_emit = src_rows.shape[0]
    if num_emit == 0:
        return
    width = state.shape[1] // 2
    rate = position_bias.shape[0]
    head_dim = kv_format.head_dim if kv_format is not None else out_pool.shape[1]
    num_slots = src_rows.shape[1]
    if head_dim != (width // 2 if overlap else width) or num_slots != (2 if overlap else 1) * rate:
        raise ValueError(
            f"compressor shapes disagree: state width {width}, out head_dim {head_dim}, "
            f"{num_slots} slots at rate {rate}, overlap={overlap}"
        )
    if head_dim % 2 or 2 * cos.shape[-1] > head_dim:
        raise ValueError(f"head_dim {head_dim} must be even and hold the rope dims {2 * cos.shape[-1]}")
    # Unit stride on the feature axis; these are no-ops for the model's tensors.
    state = state if state.stride(1) == 1 else state.contiguous()
    src_rows = src_rows if src_rows.stride(1) == 1 else src_rows.contiguous()
    position_bias = position_bias.contiguous()
    norm_weight = norm_weight.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out_rows = out_rows.contiguous()
    if out_pool.stride(1) != 1:
        raise ValueError("out_pool needs unit stride on its last dim (it is written in place)")
    cfg_s, cfg_warps = compress_config(head_dim, num_slots)
    quant = 1 if kv_format is not None else 2 if out_scale is not None else 0
    block_d = triton.next_power_of_2(max(head_dim, 2))
    _compress_windows_kernel[(num_emit,)](
        state, src_rows, position_bias, norm_weight, cos, sin, out_pool, out_rows,
        out_scale if out_scale is not None else out_rows,
        state.stride(0), src_rows.stride(0), position_bias.stride(0), cos.stride(0), sin.stride(0),
        out_pool.stride(0),
        float(norm_eps),
        HEAD_DIM=head_dim, WIDTH=width, RATE=rate, OVERLAP=bool(overlap), NUM_SLOTS=num_slots,
        HALF_ROPE=cos.shape[-1], BLOCK_S=block_s or cfg_s,
        BLOCK_D=fp8_block(block_d) if quant == 1 else block_d, QUANT=quant,
        NOPE=kv_format.nope_dim if quant == 1 else 0, SCALE_OFF=kv_format.scale_offset if quant == 1 else 0,
        num_warps=num_warps or cfg_warps, **pdl_args(state.device)
    )


def compress_windows(
    state: torch.Tensor,
    src_rows: torch.Tensor,
    position_bias: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    norm_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_pool: torch.Tensor,
    out_rows: torch.Tensor,
    kv_format: KVFormat | None = None,
    out_scale: torch.Tensor | None = None,
) -> None:
    """Dispatch on the device (a static fact): the Triton kernel on CUDA, the reference elsewhere."""
    if use_triton("compressor", state):
        compress_windows_triton(state, src_rows, position_bias, overlap, norm_weight, norm_eps, cos, sin,
                                out_pool, out_rows, kv_format=kv_format, out_scale=out_scale)
    else:
        compress_windows_ref(state, src_rows, position_bias, overlap, norm_weight, norm_eps, cos, sin,
                             out_pool, out_rows, kv_format, out_scale)
