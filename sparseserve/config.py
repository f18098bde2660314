"""Configuration dataclasses: the model's static facts, the cache geometry, the engine's options."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import DeepseekV4Config

LAYER_SLIDING = "sliding_attention"
LAYER_CSA = "compressed_sparse_attention"
LAYER_HCA = "heavily_compressed_attention"


@dataclass
class ModelConfig:
    """A DeepSeek-V4 `transformers` config plus the facts the engine derives from it."""

    hf_config: DeepseekV4Config
    dtype: torch.dtype = torch.bfloat16
    path: str | None = None

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def layer_type(self, layer_idx: int) -> str:
        return self.hf_config.layer_types[layer_idx]

    def is_csa(self, layer_idx: int) -> bool:
        return self.layer_type(layer_idx) == LAYER_CSA

    def compress_rate(self, layer_idx: int) -> int:
        """0 for sliding-window-only layers."""
        kind = self.layer_type(layer_idx)
        return 0 if kind == LAYER_SLIDING else int(self.hf_config.compress_rates[kind])

    @property
    def rates(self) -> list[int]:
        return sorted({self.compress_rate(i) for i in range(self.num_layers)} - {0})

    @property
    def lcm_rate(self) -> int:
        return math.lcm(*self.rates) if self.rates else 1

    def compressed_bytes_per_token(self, layer_idx: int, dtype_bytes: int) -> float:
        """Bytes of compressed state one token adds to a layer (DESIGN.md section 1)."""
        rate = self.compress_rate(layer_idx)
        if rate == 0:
            return 0.0
        width = self.hf_config.head_dim + (self.hf_config.index_head_dim if self.is_csa(layer_idx) else 0)
        return width * dtype_bytes / rate


@dataclass
class CacheConfig:
    """The state geometry the engine chose; bytes per block are given by layer kind."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    num_slots: int = 0
    bytes_per_block_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_per_slot_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.bytes_per_block_by_kind.values())
