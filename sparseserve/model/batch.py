"""Per-step metadata: what the model needs to know about a flat batch of tokens.

The runner builds it (on the host, then one copy to the device); the model only reads it.
Tokens of one sequence are contiguous in the flat batch and have consecutive positions.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .host_copy import to_device


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
    # Static fact: emit_tokens[r] lists every token in order (decode steps), so gathers by it
    # can be skipped.
    emit_all_tokens: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def logits_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """The rows of `streams` [T, ...] whose logits are wanted. When every token wants them (a
        shape fact: decode and verify steps, captured graphs included), `build_batch` lists them in
        order, so the rows are `streams` itself and the gather (a copy on the step's critical path)
        is skipped."""
        if self.logits_indices.shape[0] == self.num_tokens:
            return streams
        return streams[self.logits_indices]


# The per-token and per-sequence int64 fields, in the order build_batch lays them out in one buffer.
INT64_FIELDS = ("input_ids", "positions", "token_seq", "seq_slots", "seq_start", "seq_num_tokens",
                "seq_token_offset", "logits_indices")


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's share of a step, as the scheduler hands it to the runner."""

    slot: int
    start_pos: int
    token_ids: list[int]
    block_ids: list[int]
    want_logits: str = "last"  # "last", "all" or "none"


class BlockTableCache:
    """Host block-table rows by slot, each refreshed only when its slot's block list changed.

    Copying every sequence's block ids into a fresh table each step costs more host time than
    the rest of a decode step's metadata at long contexts. A request's block list only grows
    while it holds its slot (KVCacheManager.allocate appends) and a freed request gets a new
    list (KVCacheManager.free), so the same list object with the same length holds the same ids,
    and only the appended tail needs copying."""

    def __init__(self, num_slots: int, width: int) -> None:
        self.width = width
        self.rows = np.full((num_slots, max(width, 1)), -1, dtype=np.int32)
        self.lists: list[list[int] | None] = [None] * num_slots  # the list each row was copied from
        self.lengths = [0] * num_slots

    def table(self, chunks: list[SequenceChunk]) -> np.ndarray:
        rows, lists, lengths = self.rows, self.lists, self.lengths
        for chunk in chunks:
            slot, blocks = chunk.slot, chunk.block_ids
            n = len(blocks)
            if lists[slot] is blocks:
                if lengths[slot] == n:
                    continue
                rows[slot, lengths[slot]:n] = blocks[lengths[slot]:]
            else:
                if n > self.width:
                    raise ValueError(f"a sequence holds {n} blocks; the block table has {self.width} columns")
                rows[slot, :n] = blocks
                rows[slot, n:] = -1
                lists[slot] = blocks
            lengths[slot] = n
        return rows[[chunk.slot for chunk in chunks]]


def build_batch(
    chunks: list[SequenceChunk],
    rates: list[int],
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
    num_entries: dict[int, int] | None = None,
    tables: BlockTableCache | None = None,
) -> BatchMetadata:
    """Host-side construction of the metadata for a step, in numpy (vectorised for prefill
    steps of thousands of tokens, and cheap per call for small decode steps: this runs while
    the GPU waits). `tables` (of width `max_blocks`) supplies the block-table rows by slot."""
    num_seqs = len(chunks)
    counts = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    starts = np.array([c.start_pos for c in chunks], dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    num_tokens = int(counts.sum())
    if num_tokens == num_seqs and bool((counts == 1).all()):  # one token per sequence (decode)
        token_seq = np.arange(num_seqs, dtype=np.int64)
        positions = starts
        input_ids = np.array([c.token_ids[0] for c in chunks], dtype=np.int64)
    else:
        token_seq = np.repeat(np.arange(num_seqs, dtype=np.int64), counts)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - offsets, counts)
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens)
    wants = {c.want_logits for c in chunks}
    if wants == {"last"}:
        logits = offsets + counts - 1
    elif wants == {"all"}:
        logits = np.arange(num_tokens, dtype=np.int64)
    else:
        rows: list[int] = []
        for chunk, first, n in zip(chunks, offsets.tolist(), counts.tolist()):
            if chunk.want_logits == "last":
                rows.append(first + n - 1)
            elif chunk.want_logits == "all":
                rows.extend(range(first, first + n))
        logits = np.asarray(rows, dtype=np.int64)
    emit = {r: np.flatnonzero((positions + 1) % r == 0) for r in rates}
    if tables is not None:
        if tables.width != max_blocks:
            raise ValueError(f"the block-table cache has {tables.width} columns, the step wants {max_blocks}")
        table = tables.table(chunks)
    else:
        width = max_blocks if max_blocks is not None else max((len(c.block_ids) for c in chunks), default=1)
        table = np.full((num_seqs, max(width, 1)), -1, dtype=np.int32)
        for b, chunk in enumerate(chunks):
            if chunk.block_ids:
                table[b, : len(chunk.block_ids)] = chunk.block_ids
    max_end = int((starts + counts).max()) if num_seqs else 0
    if num_entries is None:
        num_entries = {r: max_end // r for r in rates}

    # Every int64 field goes to the device in one copy, through pinned memory: a copy from pageable
    # memory would first wait for the GPU to drain, and with async scheduling the GPU is still busy
    # with the previous step while this one is built.
    values = dict(zip(INT64_FIELDS, (input_ids, positions, token_seq,
                                     np.array([c.slot for c in chunks], dtype=np.int64), starts, counts,
                                     offsets, logits)))
    parts = list(values.values()) + list(emit.values())
    flat, views = _aligned_flat(parts, device)
    return BatchMetadata(
        **dict(zip(INT64_FIELDS, views)),
        block_table=to_device(torch.from_numpy(table), device, torch.int32),
        num_entries=num_entries,
        emit_tokens=dict(zip(emit, views[len(INT64_FIELDS):])),
    )


def aligned_offsets(lengths: list[int]) -> list[int]:
    """Start of each part in the one int64 buffer of `build_batch`: every part starts on a 16-byte
    boundary (an even index). Triton specialises a pointer argument on 16-byte alignment, so views at
    odd offsets (which follow from the step's token and sequence counts) would build a kernel variant
    per parity while requests wait; aligned views give every step the same one."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += n + (n & 1)
    return offsets


def _aligned_flat(parts: list[np.ndarray], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    lengths = [len(v) for v in parts]
    offsets = aligned_offsets(lengths)
    host = np.zeros(offsets[-1] + lengths[-1] if parts else 0, dtype=np.int64)
    for v, at in zip(parts, offsets):
        host[at:at + len(v)] = v
    flat = to_device(torch.from_numpy(host), device)
    return flat, [flat.narrow(0, at, n) for at, n in zip(offsets, lengths)]
