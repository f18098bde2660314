"""Per-step metadata: what the model needs to know about a flat batch of tokens.

The runner builds it (on the host, then one copy to the device); the model only reads it.
Tokens of one sequence are contiguous in the flat batch and have consecutive positions.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class BatchMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 absolute positions
    token_seq: torch.Tensor  # [T] int64 index of the token's sequence in this batch
    seq_slots: torch.Tensor  # [B] int64 state slot of each sequence
    seq_start: torch.Tensor  # [B] int64 position of the sequence's first token in this step
    seq_num_tokens: torch.Tensor  # [B] int64 tokens of the sequence in this step
    seq_token_offset: torch.Tensor  # [B] int64 index of its first token in the flat batch
    block_table: torch.Tensor  # [B, max_blocks] int32 (-1 = no block)
    logits_indices: torch.Tensor  # [N] int64 tokens whose logits are wanted
    # Static widths: compressed entries a row list may reference, per compress rate.
    num_entries: dict[int, int] = field(default_factory=dict)
    # Tokens that may close a compress window, per rate (all tokens in a captured step,
    # only the closing ones in an eager step); kernels mask the rest.
    emit_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    # Host fact: the longest sequence (positions + 1) in the step. Only the test-only top-k
    # bug switch reads it; nothing real may branch on it (DESIGN.md invariant 1).
    max_seq_len: int = 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class SequenceChunk:
    """One sequence's share of a step, as the scheduler hands it to the runner."""

    slot: int
    start_pos: int
    token_ids: list[int]
    block_ids: list[int]
    want_logits: str = "last"  # "last", "all" or "none"


def build_batch(
    chunks: list[SequenceChunk],
    rates: list[int],
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
    num_entries: dict[int, int] | None = None,
) -> BatchMetadata:
    """Host-side construction of the metadata for a step (vectorised: prefill steps carry
    thousands of tokens, and this runs while the GPU waits)."""
    counts = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
    offsets_t = torch.cumsum(counts, 0) - counts
    num_tokens = int(counts.sum())
    token_seq_t = torch.repeat_interleave(torch.arange(len(chunks)), counts)
    positions_t = torch.arange(num_tokens) - offsets_t[token_seq_t] + starts[token_seq_t]
    input_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
    offsets = offsets_t.tolist()
    logits: list[int] = []
    for chunk, first, n in zip(chunks, offsets, counts.tolist()):
        if chunk.want_logits == "last":
            logits.append(first + n - 1)
        elif chunk.want_logits == "all":
            logits.extend(range(first, first + n))
    emit = {r: torch.nonzero((positions_t + 1) % r == 0).view(-1) for r in rates}
    width = max_blocks if max_blocks is not None else max((len(c.block_ids) for c in chunks), default=1)
    table = torch.full((len(chunks), max(width, 1)), -1, dtype=torch.int32)
    for b, chunk in enumerate(chunks):
        table[b, : len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.int32)
    max_end = int((starts + counts).max()) if chunks else 0
    if num_entries is None:
        num_entries = {r: max_end // r for r in rates}

    def t(values) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(device)
        return torch.tensor(values, dtype=torch.int64, device=device)

    return BatchMetadata(
        input_ids=t(input_ids),
        positions=t(positions_t),
        token_seq=t(token_seq_t),
        seq_slots=t([c.slot for c in chunks]),
        seq_start=t(starts),
        seq_num_tokens=t(counts),
        seq_token_offset=t(offsets_t),
        block_table=table.to(device),
        logits_indices=t(logits),
        num_entries=num_entries,
        emit_tokens={r: t(v) for r, v in emit.items()},
        max_seq_len=max_end,
    )
