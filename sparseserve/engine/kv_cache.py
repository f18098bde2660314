"""Sparse-aware KV accounting and the block/slot manager.

V4's per-sequence state has two parts (docs/design.md, section 1):
- growing state, paged in blocks of `block_size` tokens: CSA entries (head_dim + indexer keys
  per `rate` tokens) and HCA entries (head_dim per `rate` tokens). Sliding layers add none.
- fixed state, one slot per running sequence: every layer's window ring and every
  compressor's partial-window buffer.
Accounting treats each part exactly; nothing is estimated as dense attention would be. Row sizes come from
the storage (`kv_cache_dtype`, sparseserve/kv_format.py): FP8 KV rows and indexer keys count their packed bytes
(scales and padding included); the compressor buffers stay in the model's dtype.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ..config import LAYER_CSA, LAYER_HCA, LAYER_SLIDING, ModelConfig
from ..errors import ConfigError, RequestTooLargeError
from ..kv_format import index_row_bytes, kv_row_bytes
from .request import Request

KIND_NAMES = {LAYER_CSA: "csa", LAYER_HCA: "hca", LAYER_SLIDING: "sliding"}


__all__ = ["KVPlan", "KVCacheManager", "RequestTooLargeError", "plan_kv"]


@dataclass
class KVPlan:
    """Byte accounting for one model, dtype and state geometry."""

    block_size: int
    dtype_bytes: int
    bytes_per_token_by_kind: dict[str, float]
    bytes_per_block_by_kind: dict[str, int]
    bytes_per_slot_by_kind: dict[str, int]
    layers_by_kind: dict[str, int]
    fixed_bytes: int  # staging rows and trash rows, independent of sequences
    dense_mla_bytes_per_token: int
    kv_cache_dtype: str = "auto"
    kv_row_bytes: int = 0  # one KV row (window, staging or compressed entry) as stored
    index_row_bytes: int = 0  # one indexer key as stored

    @property
    def bytes_per_token(self) -> float:
        return sum(self.bytes_per_token_by_kind.values())

    @property
    def bytes_per_block(self) -> int:
        return sum(self.bytes_per_block_by_kind.values())

    @property
    def bytes_per_slot(self) -> int:
        return sum(self.bytes_per_slot_by_kind.values())

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def sequence_bytes(self, num_tokens: int) -> int:
        """Growing state (rounded up to whole blocks) plus the sequence's fixed slot."""
        return self.blocks_for(num_tokens) * self.bytes_per_block + self.bytes_per_slot

    def max_concurrency(self, num_tokens: int, cache_bytes: int) -> int:
        return int(max(cache_bytes - self.fixed_bytes, 0) // self.sequence_bytes(num_tokens))

    def report(self, max_model_len: int, cache_bytes: int | None = None) -> str:
        gib = 1024**3
        lines = [f"KV plan (kv_cache_dtype {self.kv_cache_dtype}: {self.kv_row_bytes} B per KV row, "
                 f"{self.index_row_bytes} B per indexer key; block_size {self.block_size} tokens):"]
        lines.append(f"  {'kind':<9}{'layers':>7}{'B/token':>12}{'B/block':>12}{'fixed B/seq':>14}"
                     f"{'GiB/seq @' + str(max_model_len):>20}")
        for kind in ("csa", "hca", "sliding"):
            per_tok = self.bytes_per_token_by_kind.get(kind, 0.0)
            seq_bytes = per_tok * max_model_len
            lines.append(f"  {kind:<9}{self.layers_by_kind.get(kind, 0):>7}{per_tok:>12,.0f}"
                         f"{self.bytes_per_block_by_kind.get(kind, 0):>12,}"
                         f"{self.bytes_per_slot_by_kind.get(kind, 0):>14,}{seq_bytes / gib:>20.3f}")
        total_seq = self.bytes_per_token * max_model_len
        lines.append(f"  total compressed state: {self.bytes_per_token:,.0f} B/token, "
                     f"{total_seq / gib:.3f} GiB per sequence at {max_model_len:,} tokens "
                     f"(+ {self.bytes_per_slot / 1024**2:.2f} MiB fixed window/compressor rows)")
        dense_seq = self.dense_mla_bytes_per_token * max_model_len
        lines.append(f"  dense-MLA estimate: {self.dense_mla_bytes_per_token:,} B/token, {dense_seq / gib:.3f} GiB "
                     f"per sequence ({self.dense_mla_bytes_per_token / max(self.bytes_per_token, 1e-9):.1f}x more)")
        if cache_bytes is not None:
            lines.append(f"  cache {cache_bytes / gib:.2f} GiB -> max concurrency at {max_model_len:,} tokens: "
                         f"{self.max_concurrency(max_model_len, cache_bytes)} "
                         f"(dense-MLA accounting: {int(cache_bytes // max(dense_seq, 1))})")
        return "\n".join(lines)


def plan_kv(model_config: ModelConfig, dtype_bytes: int, block_size: int, max_step_tokens: int,
            num_speculative_tokens: int = 0, kv_cache_dtype: str = "auto") -> KVPlan:
    """dtype_bytes: the model's dtype (the compressor buffers, and the KV rows under "auto")."""
    hf = model_config.hf_config
    kv_row = kv_row_bytes(hf.head_dim, hf.qk_rope_head_dim, kv_cache_dtype, dtype_bytes)
    index_row = index_row_bytes(hf.index_head_dim, kv_cache_dtype, dtype_bytes)
    if block_size % model_config.lcm_rate != 0:
        raise ConfigError(f"block_size must be a multiple of {model_config.lcm_rate} (every compress rate) "
                         f"for this model, got {block_size}")
    per_token: dict[str, float] = {}
    per_block: dict[str, int] = {}
    per_slot: dict[str, int] = {}
    layers: dict[str, int] = {}
    ring_rows = hf.sliding_window + num_speculative_tokens
    fixed = 0
    for layer_idx in range(model_config.num_layers):
        kind = KIND_NAMES[model_config.layer_type(layer_idx)]
        layers[kind] = layers.get(kind, 0) + 1
        rate = model_config.compress_rate(layer_idx)
        slot_bytes = ring_rows * kv_row
        fixed += (max_step_tokens + 1) * kv_row
        if rate:
            csa = model_config.is_csa(layer_idx)
            entry_bytes = kv_row + (index_row if csa else 0)
            per_token[kind] = per_token.get(kind, 0.0) + entry_bytes / rate
            per_block[kind] = per_block.get(kind, 0) + (block_size // rate) * entry_bytes
            comp_ring = (2 if csa else 1) * rate + num_speculative_tokens
            # kv || gate rows; CSA projections are twice as wide (overlapping windows).
            width = hf.head_dim + (hf.index_head_dim if csa else 0)
            state_width = 2 * width * (2 if csa else 1)
            slot_bytes += comp_ring * state_width * dtype_bytes
            fixed += (max_step_tokens + 1) * state_width * dtype_bytes
        per_slot[kind] = per_slot.get(kind, 0) + slot_bytes
    dense = model_config.num_layers * (hf.head_dim + hf.qk_rope_head_dim + hf.index_head_dim) * dtype_bytes
    return KVPlan(block_size, dtype_bytes, per_token, per_block, per_slot, layers, fixed, dense, kv_cache_dtype,
                  kv_row, index_row)


@dataclass
class KVCacheManager:
    """Hands out blocks (growing state) and slots (fixed state); never leaks either."""

    num_blocks: int
    block_size: int
    num_slots: int
    free_blocks: deque = field(init=False)
    free_slots: deque = field(init=False)

    def __post_init__(self) -> None:
        self.free_blocks = deque(range(self.num_blocks))
        self.free_slots = deque(range(self.num_slots))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds(self, request: Request, num_tokens: int) -> bool:
        """True when the request already has a slot and the blocks for `num_tokens` (most decode steps)."""
        return request.slot is not None and num_tokens <= len(request.block_ids) * self.block_size

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        need_blocks = self.blocks_for(num_tokens) - len(request.block_ids)
        return need_blocks <= len(self.free_blocks) and (request.slot is not None or len(self.free_slots) > 0)

    def allocate(self, request: Request, num_tokens: int) -> None:
        need_blocks = self.blocks_for(num_tokens) - len(request.block_ids)
        if need_blocks > len(self.free_blocks) or (request.slot is None and not self.free_slots):
            raise RuntimeError("allocate() called without can_allocate(); this is a scheduler bug")
        if request.slot is None:
            request.slot = self.free_slots.popleft()
        for _ in range(need_blocks):
            request.block_ids.append(self.free_blocks.popleft())

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def all_free(self) -> bool:
        return len(self.free_blocks) == self.num_blocks and len(self.free_slots) == self.num_slots
