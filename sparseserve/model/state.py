"""The model's per-sequence state (the "KV cache"), addressed by absolute position.

Per layer, one KV pool of rows [head_dim]:
    [ring: num_slots * ring_rows][staging: max_step_tokens][trash: 1][entries: num_blocks * block_size / rate]
- ring: the last `sliding_window + num_speculative_tokens` window rows of each running sequence;
- staging: the current step's fresh rows (read by attention before they are committed to the ring);
- trash: a write target for tokens whose write must go nowhere (keeps shapes static);
- entries: the paged compressed entries (CSA / HCA layers only).
CSA layers also have an indexer-key pool (entries only, [index_head_dim]). With kv_cache_dtype="fp8" the KV
pools hold packed FP8 rows (uint8 [rows, KVFormat.row_bytes]) and the indexer pool e4m3 codes with one fp32
scale per key (`index_scale`); sparseserve/kv_format.py has the layout. The compressor buffers stay in the
model's dtype (fixed per slot, and re-read at full precision by the pooling). A token that
closes no compress window is given the emission row -1, and the compressor skips it. Every compressor
has a state buffer of projected (kv || gate) rows laid out as [ring][staging][trash].
The engine decides num_blocks and num_slots; this module only lays out and addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from ..kernels.dispatch import capability
from ..kv_format import KVFormat


@dataclass(frozen=True)
class StateLayout:
    num_blocks: int
    block_size: int
    num_slots: int
    max_step_tokens: int
    sliding_window: int
    num_speculative_tokens: int = 0

    @property
    def ring_rows(self) -> int:
        return self.sliding_window + self.num_speculative_tokens

    def compressor_ring_rows(self, rate: int, overlap: bool) -> int:
        # A CSA entry pools two windows; speculative positions may run ahead of the last commit.
        return (2 if overlap else 1) * rate + self.num_speculative_tokens

    def staging_base(self, ring_rows: int) -> int:
        return self.num_slots * ring_rows

    def trash_row(self, ring_rows: int) -> int:
        return self.staging_base(ring_rows) + self.max_step_tokens

    def comp_base(self) -> int:
        return self.trash_row(self.ring_rows) + 1

    def entries_per_block(self, rate: int) -> int:
        return self.block_size // rate


class LayerState:
    """The tensors of one layer (those a layer kind does not use are None)."""

    def __init__(self, kv_pool: torch.Tensor, index_pool: torch.Tensor | None,
                 compressor_state: torch.Tensor | None, indexer_state: torch.Tensor | None,
                 kv_format: KVFormat | None = None, index_scale: torch.Tensor | None = None) -> None:
        self.kv_pool = kv_pool
        self.index_pool = index_pool
        self.compressor_state = compressor_state
        self.indexer_state = indexer_state
        self.kv_format = kv_format  # None: kv_pool holds [rows, head_dim] values in its dtype
        self.index_scale = index_scale  # FP8 indexer keys: one fp32 scale per index_pool row


class StepIndex:
    """Index vectors every step uses, made once (slices of them cost no launch): the token
    index 0..max_step_tokens-1, each ring's staging rows (its staging base plus the token index),
    the sliding window's row offsets and each compressor's window offsets."""

    def __init__(self, model_config: ModelConfig, layout: StateLayout, device: torch.device) -> None:
        self.token = torch.arange(layout.max_step_tokens, device=device)
        self.window_offsets = torch.arange(-layout.sliding_window + 1, 1, device=device)
        rings = {layout.ring_rows}
        self.span_offsets: dict[tuple[int, bool], torch.Tensor] = {}
        for layer_idx in range(model_config.num_layers):
            rate = model_config.compress_rate(layer_idx)
            if rate:
                overlap = model_config.is_csa(layer_idx)
                rings.add(layout.compressor_ring_rows(rate, overlap))
                span = (2 if overlap else 1) * rate
                self.span_offsets[(rate, overlap)] = torch.arange(-span + 1, 1, device=device)
        self.staging: dict[int, torch.Tensor] = {ring: layout.staging_base(ring) + self.token for ring in rings}


class ModelState:
    def __init__(self, model_config: ModelConfig, layout: StateLayout, device: torch.device, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto") -> None:
        if layout.block_size % model_config.lcm_rate != 0:
            raise ValueError(
                f"block_size {layout.block_size} must be a multiple of every compress rate "
                f"(lcm {model_config.lcm_rate})"
            )
        self.layout = layout
        hf = model_config.hf_config
        self.layers: list[LayerState] = []
        base_rows = layout.comp_base()
        fp8 = kv_cache_dtype == "fp8"
        if fp8 and device.type == "cuda" and capability(device) < (8, 9):
            raise ConfigError(f"kv_cache_dtype='fp8' needs e4m3 conversions (sm_89 or newer: Ada, Hopper); this GPU "
                              f"is sm_{''.join(map(str, capability(device)))}; use kv_cache_dtype='auto'")
        kv_format = KVFormat(hf.head_dim, hf.qk_rope_head_dim) if fp8 else None
        kv_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype
        for layer_idx in range(hf.num_hidden_layers):
            rate = model_config.compress_rate(layer_idx)
            entry_rows = layout.num_blocks * layout.entries_per_block(rate) if rate else 0
            if fp8:
                kv_pool = torch.zeros(base_rows + entry_rows, kv_format.row_bytes, device=device, dtype=torch.uint8)
            else:
                kv_pool = torch.zeros(base_rows + entry_rows, hf.head_dim, device=device, dtype=kv_dtype)
            index_pool = compressor_state = indexer_state = index_scale = None
            if rate:
                overlap = model_config.is_csa(layer_idx)
                comp_ring = layout.compressor_ring_rows(rate, overlap)
                state_rows = layout.trash_row(comp_ring) + 1
                width = (2 if overlap else 1) * hf.head_dim
                compressor_state = torch.zeros(state_rows, 2 * width, device=device, dtype=dtype)
                if overlap:
                    index_pool = torch.zeros(entry_rows, hf.index_head_dim, device=device,
                                             dtype=torch.uint8 if fp8 else kv_dtype)
                    if fp8:
                        index_scale = torch.ones(entry_rows, device=device, dtype=torch.float32)
                    indexer_state = torch.zeros(state_rows, 4 * hf.index_head_dim, device=device, dtype=dtype)
            self.layers.append(LayerState(kv_pool, index_pool, compressor_state, indexer_state, kv_format,
                                          index_scale))
        self.index = StepIndex(model_config, layout, device)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            for t in (layer.kv_pool, layer.index_pool, layer.compressor_state, layer.indexer_state,
                      layer.index_scale):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total
