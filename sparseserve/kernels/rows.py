"""Row-list construction: from the step's metadata to the pool rows each kernel reads.

Every row is derived from a token's absolute position (DESIGN.md invariant 4):
- a position written in an earlier step lives in its sequence's ring:
  slot * ring_rows + position % ring_rows;
- a position of the current step lives in the staging region, at its token's index in
  the flat batch (so a chunk never reads a ring row it has itself overwritten);
- compressed entry w lives in a paged block: comp_base + block_table[seq, w // epb] * epb + w % epb.
All functions here are device-side tensor code with static output shapes.
"""
from __future__ import annotations

import torch


def source_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_token_offset: torch.Tensor,
    seq_slots: torch.Tensor,
    offsets: torch.Tensor,
    ring_rows: int,
    staging_base: int,
) -> torch.Tensor:
    """Rows [T, n] of positions `positions[t] + offsets` of each token's sequence (-1 before 0)."""
    src = positions.unsqueeze(1) + offsets.unsqueeze(0)
    start = seq_start[token_seq].unsqueeze(1)
    staging = staging_base + seq_token_offset[token_seq].unsqueeze(1) + (src - start)
    ring = seq_slots[token_seq].unsqueeze(1) * ring_rows + src.remainder(ring_rows)
    rows = torch.where(src >= start, staging, ring)
    return torch.where(src >= 0, rows, torch.full_like(rows, -1))


def ring_write_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_num_tokens: torch.Tensor,
    seq_slots: torch.Tensor,
    ring_rows: int,
    trash_row: int,
) -> torch.Tensor:
    """Ring row [T] each token's state is committed to after the step; only the last
    `ring_rows` positions of a sequence's chunk are kept (earlier ones go to the trash row),
    so no two tokens of one step write the same ring row."""
    last = (seq_start + seq_num_tokens - 1)[token_seq]
    rows = seq_slots[token_seq] * ring_rows + positions.remainder(ring_rows)
    keep = positions > last - ring_rows
    return torch.where(keep, rows, torch.full_like(rows, trash_row))


def entry_pool_rows(
    entry_ids: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    entries_per_block: int,
    comp_base: int,
) -> torch.Tensor:
    """Pool rows of compressed entries `entry_ids [T, K]` (-1 stays -1)."""
    ids = entry_ids.long()
    safe = ids.clamp(min=0)
    block_col = (safe // entries_per_block).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[token_seq].long().gather(1, block_col)
    rows = comp_base + blocks * entries_per_block + safe % entries_per_block
    return torch.where((ids >= 0) & (blocks >= 0), rows, torch.full_like(rows, -1))


def visible_entry_ids(positions: torch.Tensor, rate: int, num_entries: int) -> torch.Tensor:
    """Entry ids [T, num_entries]: w where w < (t + 1) // rate, else -1."""
    entries = torch.arange(num_entries, device=positions.device).unsqueeze(0)
    visible = entries < ((positions + 1) // rate).unsqueeze(1)
    return torch.where(visible, entries, torch.full_like(entries, -1))


def emit_pool_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    entries_per_block: int,
    comp_base: int,
    trash_row: int,
) -> torch.Tensor:
    """Pool row [M] each emitting token writes its entry to; tokens that close no window
    write the trash row (no host branch on whether a window closed)."""
    closes = (positions + 1).remainder(rate) == 0
    entry = ((positions + 1) // rate - 1).clamp(min=0)
    rows = entry_pool_rows(entry.unsqueeze(1), token_seq, block_table, entries_per_block, comp_base).squeeze(1)
    return torch.where(closes & (rows >= 0), rows, torch.full_like(rows, trash_row))
