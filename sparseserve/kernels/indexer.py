"""Lightning Indexer scores: sum_h w[t,h] * relu(q[t,h] . k[s]) * scale, fp32.

Each query token is scored against the compressed indexer keys of its own sequence,
found through the paged layout: entry w of a sequence lives in pool row
block_table[seq, w // entries_per_block] * entries_per_block + w % entries_per_block.
Entry w is visible to the token at position t only when w < (t + 1) // rate; invisible
and out-of-range entries score -inf.

Roofline (per token, E visible entries, Hi heads, Di dim): bytes = E*Di*2 (keys)
+ E*4 (scores out); FLOPs = 2*Hi*E*Di + 2*Hi*E.

Triton kernel: one program per (token, chunk of entries). Heads are the M dimension of the
[Hi, Di] x [Di, BLOCK_E] product, so each key is read once per token for all heads; the
relu, the head weights and the head sum run on the product in registers, and only the
[BLOCK_E] scores go out. Tiles past the token's visible count skip the key loads and the
product (a device-side loop bound, no host branch) and write -inf. Configs come from
static shapes only, so the launch can be captured in a CUDA graph.

FP8 keys (kv_cache_dtype="fp8", sparseserve/kv_format.py): index_pool holds e4m3 codes and index_scale one fp32
power of two per key. The codes go into the product as q's dtype (exact) and each column of q . k is then
multiplied by its key's scale (relu commutes with a positive scale): 132 B per key read instead of 256.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl

from ..kv_format import dequantize_index_rows
from .dispatch import num_sms, use_triton
from .pdl import pdl_args, wait_for_prior_grid


def entry_rows(
    block_table: torch.Tensor, token_seq: torch.Tensor, num_entries: int, entries_per_block: int
) -> torch.Tensor:
    """Pool rows [T, num_entries] of entries 0..num_entries-1 of each token's sequence (-1 past the table)."""
    entries = torch.arange(num_entries, device=block_table.device)
    block_idx = entries // entries_per_block
    max_blocks = block_table.shape[1]
    blocks = block_table[token_seq.long()][:, block_idx.clamp(max=max_blocks - 1)]  # [T, E]
    rows = blocks.long() * entries_per_block + (entries % entries_per_block)
    in_table = (block_idx < max_blocks).unsqueeze(0) & (blocks >= 0)
    return torch.where(in_table, rows, torch.full_like(rows, -1))


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
    entries_per_block: int,
    scale: float,
    num_entries: int,
    token_chunk: int = 256,
    weights_scale: float = 1.0,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path).

    q: [T, Hi, Di]; weights: [T, Hi], any float dtype, times weights_scale (the head scaling)
    in fp32;
    index_pool: [N, Di] (index_scale [N] fp32: FP8 codes, uint8); block_table: [B, max_blocks] int (-1 = no block);
    token_seq: [T] batch index of each token's sequence; positions: [T] absolute positions.
    Returns fp32 [T, num_entries], -inf where the entry is not visible.
    """
    num_tokens = q.shape[0]
    out = torch.full((num_tokens, num_entries), float("-inf"), dtype=torch.float32, device=q.device)
    if num_entries == 0:
        return out
    entries = torch.arange(num_entries, device=q.device)
    for start in range(0, num_tokens, token_chunk):
        end = min(start + token_chunk, num_tokens)
        rows = entry_rows(block_table, token_seq[start:end], num_entries, entries_per_block)
        visible = (entries.unsqueeze(0) < ((positions[start:end].long() + 1) // rate).unsqueeze(1)) & (rows >= 0)
        safe = rows.clamp(min=0)
        keys = (index_pool[safe].float() if index_scale is None
                else dequantize_index_rows(index_pool[safe], index_scale[safe]))  # [t, E, Di]
        dots = torch.einsum("thd,ted->the", q[start:end].float(), keys)
        head_weights = weights[start:end].float() * weights_scale
        scores = (torch.relu(dots) * scale * head_weights.unsqueeze(-1)).sum(dim=1)
        out[start:end] = scores.masked_fill(~visible, float("-inf"))
    return out


# Lengths and widths that vary per step are plain, unspecialised arguments (no build per new value):
# the entry count (the longest sequence / rate in an eager step), the output's row stride and the
# chunks per token.
@triton.jit(do_not_specialize=["num_entries", "stride_ot", "chunks"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, pool_ptr, kscale_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr,
    num_heads, head_dim, num_entries, max_blocks, rate, entries_per_block, scale, weights_scale,
    stride_qt, stride_qh, stride_wt, stride_pool, stride_bt, stride_ot, chunks,
    TILES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # Flat grid (y/z cap at 65535); a token's chunks are adjacent in launch order.
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    tok = (pid // chunks).to(tl.int64)
    chunk = pid % chunks
    seq = tl.load(seq_ptr + tok).to(tl.int64)
    visible = (tl.load(pos_ptr + tok).to(tl.int64) + 1) // rate

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    # The head scaling applied here (no separate cast and multiply kernels), then scale folded
    # into the head weights: sum_h w*relu(x)*scale = sum_h (w*scale)*relu(x).
    w = (tl.load(w_ptr + tok * stride_wt + offs_h, mask=h_mask, other=0.0).to(tl.float32) * weights_scale) * scale

    chunk_start = chunk * (TILES * BLOCK_E)
    # Tiles holding at least one visible entry; the rest only get -inf.
    n_live = tl.minimum(tl.maximum(tl.cdiv(visible - chunk_start, BLOCK_E), 0), TILES)
    out_base = out_ptr + tok * stride_ot
    bt_base = bt_ptr + seq * stride_bt
    for i in range(0, n_live):
        offs_e = chunk_start + i * BLOCK_E + tl.arange(0, BLOCK_E)
        in_range = offs_e < num_entries
        blk_idx = offs_e // entries_per_block
        blk = tl.load(bt_base + blk_idx, mask=in_range & (blk_idx < max_blocks), other=-1)
        ok = in_range & (offs_e < visible) & (blk >= 0)
        row = blk.to(tl.int64) * entries_per_block + (offs_e % entries_per_block)
        if FP8:
            codes = tl.load(pool_ptr + row[:, None] * stride_pool + offs_d[None, :],
                            mask=ok[:, None] & d_mask[None, :], other=0)
            k = codes.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            dots = tl.dot(q, tl.trans(k)) * tl.load(kscale_ptr + row, mask=ok, other=0.0)[None, :]
        else:
            k = tl.load(pool_ptr + row[:, None] * stride_pool + offs_d[None, :],
                        mask=ok[:, None] & d_mask[None, :], other=0.0)
            dots = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_E], fp32
        sc = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
        tl.store(out_base + offs_e, tl.where(ok, sc, float("-inf")), mask=in_range)
    for i in range(n_live, TILES):
        offs_e = chunk_start + i * BLOCK_E + tl.arange(0, BLOCK_E)
        tl.store(out_base + offs_e, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=offs_e < num_entries)


@dataclass(frozen=True)
class IndexerConfig:
    block_e: int
    tiles: int  # tiles of block_e entries per program
    num_warps: int
    num_stages: int


def indexer_config(num_tokens: int, num_heads: int, head_dim: int, num_entries: int, num_sms: int) -> IndexerConfig:
    """Static-shape choice, from a config sweep on the H200 (docs/performance.md): small grids
    take one 64-entry tile per program (most programs in flight); large ones (>= 8 x SMs
    128-entry tiles: big decode batches, long contexts, prefill) 4 tiles of 128 per program,
    double-buffered (2 stages measured faster than 3 there)."""
    tiles128 = num_tokens * triton.cdiv(max(num_entries, 1), 128)
    if tiles128 >= 8 * num_sms:
        return IndexerConfig(128, 4, 4, 2)
    return IndexerConfig(64, 1, 4, 3)


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
    entries_per_block: int,
    scale: float,
    num_entries: int,
    config: IndexerConfig | None = None,
    weights_scale: float = 1.0,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton kernel; same contract as indexer_scores_ref. Runs on CUDA, or on the CPU under
    TRITON_INTERPRET=1 (tests)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_entries), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_entries == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    if index_pool.stride(1) != 1:
        index_pool = index_pool.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    cfg = config or indexer_config(num_tokens, num_heads, head_dim, num_entries, num_sms(q.device))
    chunks = triton.cdiv(num_entries, cfg.block_e * cfg.tiles)
    _indexer_scores_kernel[(num_tokens * chunks,)](
        q, weights, index_pool, index_scale if index_scale is not None else out, block_table,
        token_seq.contiguous(), positions.contiguous(), out,
        num_heads, head_dim, num_entries, block_table.shape[1], rate, entries_per_block, float(scale),
        float(weights_scale),
        q.stride(0), q.stride(1), weights.stride(0), index_pool.stride(0), block_table.stride(0), out.stride(0), chunks,
        TILES=cfg.tiles,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_E=cfg.block_e, FP8=index_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(q.device)
    )
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
    entries_per_block: int,
    scale: float,
    num_entries: int,
    weights_scale: float = 1.0,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (bf16/fp16), the reference elsewhere. The head weights
    are `weights * weights_scale` in fp32 (weights in any float dtype). index_scale: FP8 keys."""
    if (use_triton("indexer", q) and q.dtype in (torch.bfloat16, torch.float16)
            and (index_scale is not None or index_pool.dtype == q.dtype)):
        return indexer_scores_triton(
            q, weights, index_pool, block_table, token_seq, positions, rate, entries_per_block, scale, num_entries,
            weights_scale=weights_scale, index_scale=index_scale,
        )
    return indexer_scores_ref(
        q, weights, index_pool, block_table, token_seq, positions, rate, entries_per_block, scale, num_entries,
        weights_scale=weights_scale, index_scale=index_scale,
    )
