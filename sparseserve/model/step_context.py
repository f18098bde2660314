"""Everything a step's layers share, derived once per forward on the device from the
batch metadata: row lists, state addresses and rope tables."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..kernels import rows as R
from ..kernels.rope import rope_tables
from ..kernels.topk import topk_indices
from .batch import BatchMetadata
from .side_stream import SideStream, SideWork
from .state import ModelState, StateLayout


# (scores [T, E] fp32, lengths [T] int32, k) -> int32 [T, k] entry ids (-1 = none)
TopKFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def default_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
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
    # [T, W + E] the rows an HCA layer attends to: the window rows, then the visible entries' rows
    # (made here once per rate and step: no cat on each layer's critical path)
    visible_rows: torch.Tensor | None
    num_entries: int
    visible_counts: torch.Tensor | None = None  # [T] int32 entries each token may select (CSA top-k)


@dataclass
class RopeTablePlan:
    """The rope tables a step needs, made in one launch (`kernels.rope.rope_tables`): table i is
    cos/sin of (position + offsets[i]) * the inverse frequencies of base bases[i]. Tables 0 and 1
    are the main and compress bases at the token positions; then one per compress rate r at the
    position of the entry a token would emit (position + 1 - r). The tensors are the model's
    non-persistent buffers (offsets [n] int64, inverse frequencies [n, rope_dim / 2] fp32)."""

    offsets: tuple[int, ...]
    bases: tuple[str, ...]
    rate_table: dict[int, int]
    offsets_tensor: torch.Tensor | None = None
    inv_freq_tensor: torch.Tensor | None = None

    @staticmethod
    def for_model(model_config: ModelConfig, offsets_tensor: torch.Tensor | None = None,
                  inv_freq_tensor: torch.Tensor | None = None) -> "RopeTablePlan":
        rates = sorted({model_config.compress_rate(i) for i in range(model_config.num_layers)} - {0})
        return RopeTablePlan(offsets=(0, 0) + tuple(1 - r for r in rates),
                             bases=("main", "compress") + ("compress",) * len(rates),
                             rate_table={r: 2 + i for i, r in enumerate(rates)},
                             offsets_tensor=offsets_tensor, inv_freq_tensor=inv_freq_tensor)


@dataclass
class StepContext:
    batch: BatchMetadata
    layout: StateLayout
    window_rows: torch.Tensor | None  # [T, W]; None in a context built for state writes only
    kv_staging_rows: torch.Tensor  # [T]
    kv_ring_write_rows: torch.Tensor  # [T]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main"/"compress" -> cos, sin at token positions
    topk: "TopKFn"
    rates: dict[int, RateAddresses] = field(default_factory=dict)
    compressors: dict[tuple[int, bool], CompressorAddresses] = field(default_factory=dict)
    # Where independent work of the step runs (inline unless the forward sets a side stream), and,
    # when this context was built on that stream, the work the main stream waits for before it
    # reads any of the context's tensors.
    side: SideStream = field(default_factory=SideStream)
    built: SideWork[None] | None = None

    def wait_built(self) -> None:
        """Make the current stream wait until the context's tensors are made (a no-op once done)."""
        if self.built is not None:
            self.built.result()


def build_step_context(
    batch: BatchMetadata,
    state: ModelState,
    model_config: ModelConfig,
    rope: RopeTablePlan,
    topk: TopKFn | None = None,
    attention: bool = True,
) -> StepContext:
    """`attention=False`: only what state writes address (rope tables, staging and ring rows, the
    compressors' emission addresses), for `forward_state`; no attention row lists or entry counts."""
    layout = state.layout
    if batch.num_tokens > layout.max_step_tokens:
        raise ValueError(
            f"step has {batch.num_tokens} tokens but the state was laid out for {layout.max_step_tokens}; "
            "raise max_num_batched_tokens"
        )
    pos, seq = batch.positions, batch.token_seq
    index = state.index  # made once: slices of it cost no launch
    num_tokens = batch.num_tokens
    ring = layout.ring_rows
    window_rows = R.source_rows(
        pos, seq, batch.seq_start, batch.seq_token_offset, batch.seq_slots,
        index.window_offsets, ring, layout.staging_base(ring),
    ) if attention else None
    tables = rope_tables(pos, rope.offsets_tensor, rope.inv_freq_tensor)  # [n, 2, T, rope_dim / 2], one launch
    # The compressors' (rate, overlap) keys in layer order; every ring's write rows in one launch.
    keys = list(dict.fromkeys((model_config.compress_rate(i), model_config.is_csa(i))
                              for i in range(model_config.num_layers) if model_config.compress_rate(i)))
    rings = [ring] + [layout.compressor_ring_rows(rate, overlap) for rate, overlap in keys]
    kv_write_rows, *comp_write_rows = R.ring_write_rows_multi(
        pos, seq, batch.seq_start, batch.seq_num_tokens, batch.seq_slots, [(r, layout.trash_row(r)) for r in rings])
    comp_write_rows = dict(zip(keys, comp_write_rows))
    ctx = StepContext(
        batch=batch,
        layout=layout,
        window_rows=window_rows,
        kv_staging_rows=index.staging[ring][:num_tokens],
        kv_ring_write_rows=kv_write_rows,
        rope={"main": (tables[0, 0], tables[0, 1]), "compress": (tables[1, 0], tables[1, 1])},
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
            # The rate's table at every token; emitting tokens' rows when not all of them emit.
            emit_table = tables[rope.rate_table[rate]]
            if not batch.emit_all_tokens:
                emit_table = emit_table.index_select(1, emit_tokens)
            cos, sin = emit_table[0], emit_table[1]
            visible = counts = None
            if rate in hca_rates and attention:
                visible = R.visible_pool_rows(pos, seq, batch.block_table, rate, num_entries, epb, comp_base,
                                              prefix=window_rows)
            if rate in csa_rates and attention:  # causal: entries whose window closed at or before the token
                counts = R.visible_counts(pos, rate, num_entries)
            # Tokens that close no window get out row -1: the compressor reads and writes nothing
            # for them, decided on the device (no host branch).
            emit_kv_rows, emit_index_rows = R.emit_pool_rows_pair(emit_pos, emit_seq, batch.block_table, rate, epb,
                                                                  (comp_base, 0), -1)
            ctx.rates[rate] = RateAddresses(
                emit_tokens=emit_tokens,
                emit_kv_rows=emit_kv_rows,
                emit_index_rows=emit_index_rows,
                emit_cos=cos,
                emit_sin=sin,
                visible_rows=visible,
                num_entries=num_entries,
                visible_counts=counts,
            )
        key = (rate, overlap)
        if key not in ctx.compressors:
            comp_ring = layout.compressor_ring_rows(rate, overlap)
            emit_pos, emit_seq = emit_pos_seq[rate]
            ctx.compressors[key] = CompressorAddresses(
                staging_rows=index.staging[comp_ring][:num_tokens],
                ring_write_rows=comp_write_rows[key],
                emit_src_rows=R.source_rows(
                    emit_pos, emit_seq, batch.seq_start, batch.seq_token_offset, batch.seq_slots,
                    index.span_offsets[key], comp_ring, layout.staging_base(comp_ring),
                ),
            )
    return ctx
