"""Everything a step's layers share, derived once per forward on the device from the
batch metadata: row lists, state addresses and rope tables."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..kernels import rows as R
from ..kernels.topk import topk_indices
from .batch import BatchMetadata
from .layers.rope import rope_cos_sin
from .state import StateLayout


# (scores [T, E] fp32, lengths [T] int32, k, max_seq_len host int) -> int32 [T, k] entry ids (-1 = none)
TopKFn = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def default_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, max_seq_len: int) -> torch.Tensor:
    return topk_indices(scores, lengths, k)


@dataclass
class CompressorAddresses:
    """Addresses of one compressor kind (a rate, with or without overlap)."""

    staging_rows: torch.Tensor  # [T] where each token's projections are staged
    ring_write_rows: torch.Tensor  # [T] where they are committed after the step
    emit_src_rows: torch.Tensor  # [M, S] state rows pooled by each emitting token


@dataclass
class RateAddresses:
    """Addresses shared by all layers of one compress rate."""

    emit_tokens: torch.Tensor  # [M] token indices that may close a window
    emit_kv_rows: torch.Tensor  # [M] KV-pool rows of the emitted entries (-1 if none)
    emit_index_rows: torch.Tensor  # [M] indexer-pool rows (CSA only; -1 if none)
    emit_cos: torch.Tensor
    emit_sin: torch.Tensor
    visible_rows: torch.Tensor | None  # [T, E] KV-pool rows of visible entries (HCA)
    num_entries: int
    visible_counts: torch.Tensor | None = None  # [T] int32 entries each token may select (CSA top-k)


@dataclass
class StepContext:
    batch: BatchMetadata
    layout: StateLayout
    window_rows: torch.Tensor  # [T, W]
    kv_staging_rows: torch.Tensor  # [T]
    kv_ring_write_rows: torch.Tensor  # [T]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main"/"compress" -> cos, sin at token positions
    topk: "TopKFn"
    rates: dict[int, RateAddresses] = field(default_factory=dict)
    compressors: dict[tuple[int, bool], CompressorAddresses] = field(default_factory=dict)


def build_step_context(
    batch: BatchMetadata,
    layout: StateLayout,
    model_config: ModelConfig,
    inv_freq: dict[str, torch.Tensor],
    topk: TopKFn | None = None,
) -> StepContext:
    if batch.num_tokens > layout.max_step_tokens:
        raise ValueError(
            f"step has {batch.num_tokens} tokens but the state was laid out for {layout.max_step_tokens}; "
            "raise max_num_batched_tokens"
        )
    device = batch.positions.device
    pos, seq = batch.positions, batch.token_seq
    token_idx = torch.arange(batch.num_tokens, device=device)
    ring = layout.ring_rows
    window = layout.sliding_window
    window_rows = R.source_rows(
        pos, seq, batch.seq_start, batch.seq_token_offset, batch.seq_slots,
        torch.arange(-window + 1, 1, device=device), ring, layout.staging_base(ring),
    )
    ctx = StepContext(
        batch=batch,
        layout=layout,
        window_rows=window_rows,
        kv_staging_rows=layout.staging_base(ring) + token_idx,
        kv_ring_write_rows=R.ring_write_rows(
            pos, seq, batch.seq_start, batch.seq_num_tokens, batch.seq_slots, ring, layout.trash_row(ring)
        ),
        rope={name: rope_cos_sin(pos, f) for name, f in inv_freq.items()},
        topk=topk or default_topk,
    )
    comp_base = layout.comp_base()
    hca_rates = {model_config.compress_rate(i) for i in range(model_config.num_layers)
                 if model_config.compress_rate(i) and not model_config.is_csa(i)}
    csa_rates = {model_config.compress_rate(i) for i in range(model_config.num_layers) if model_config.is_csa(i)}
    emit_pos_seq: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rate -> positions, sequences of emit_tokens
    for layer_idx in range(model_config.num_layers):
        rate = model_config.compress_rate(layer_idx)
        if rate == 0:
            continue
        overlap = model_config.is_csa(layer_idx)
        if rate not in ctx.rates:
            emit_tokens = batch.emit_tokens[rate]
            # Decode steps list every token (a static fact of the step's kind): no gather needed.
            emit_pos, emit_seq = (pos, seq) if batch.emit_all_tokens else (pos[emit_tokens], seq[emit_tokens])
            emit_pos_seq[rate] = emit_pos, emit_seq
            epb = layout.entries_per_block(rate)
            num_entries = batch.num_entries[rate]
            cos, sin = rope_cos_sin(emit_pos + (1 - rate), inv_freq["compress"])  # one add, not two
            visible = counts = None
            if rate in hca_rates:
                visible = R.visible_pool_rows(pos, seq, batch.block_table, rate, num_entries, epb, comp_base)
            if rate in csa_rates:  # causal: entries whose window closed at or before the token
                counts = ((pos + 1) // rate).clamp(max=num_entries).to(torch.int32)
            # Tokens that close no window get out row -1: the compressor reads and writes nothing
            # for them, decided on the device (no host branch).
            ctx.rates[rate] = RateAddresses(
                emit_tokens=emit_tokens,
                emit_kv_rows=R.emit_pool_rows(emit_pos, emit_seq, batch.block_table, rate, epb, comp_base, -1),
                emit_index_rows=R.emit_pool_rows(emit_pos, emit_seq, batch.block_table, rate, epb, 0, -1),
                emit_cos=cos,
                emit_sin=sin,
                visible_rows=visible,
                num_entries=num_entries,
                visible_counts=counts,
            )
        key = (rate, overlap)
        if key not in ctx.compressors:
            comp_ring = layout.compressor_ring_rows(rate, overlap)
            span = (2 if overlap else 1) * rate
            emit_pos, emit_seq = emit_pos_seq[rate]
            ctx.compressors[key] = CompressorAddresses(
                staging_rows=layout.staging_base(comp_ring) + token_idx,
                ring_write_rows=R.ring_write_rows(
                    pos, seq, batch.seq_start, batch.seq_num_tokens, batch.seq_slots, comp_ring,
                    layout.trash_row(comp_ring),
                ),
                emit_src_rows=R.source_rows(
                    emit_pos, emit_seq, batch.seq_start, batch.seq_token_offset, batch.seq_slots,
                    torch.arange(-span + 1, 1, device=device), comp_ring, layout.staging_base(comp_ring),
                ),
            )
    return ctx
