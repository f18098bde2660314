"""The decoder as pieces and cores: the work that depends only on a step's token count, and the work
that reads its sequences.

Every forward runs the same sequence (`DeepseekV4ForCausalLM.run_pieces`):

- piece 0: the token inputs, the embedding into the streams, layer 0's collapse and norm and its
  attention's projections (`Attention.project_in`);
- core i: the rest of layer i's attention, which reads the step's per-sequence metadata
  (`Attention.core`: the compressor's emissions, the indexer and its top-k, the sparse attention, the
  ring commits);
- piece i + 1: layer i's output projection, its feed-forward collapse, norm and MoE, then the expand
  into layer i + 1's collapse, norm and projections; after the last layer, the last expand (and, in a
  padded forward, the head's collapse and norm: the LM head's input for every token).

A piece reads and writes only tensors of the step's T tokens, the weights, and state rows addressed by
the token index alone (the staging rows). `Pieces.run(index, fn, *args)` runs piece `index` as
`fn(side, *args)`: `InlinePieces` for the plain forward (one side stream for the whole step, which is
how a decode graph captures it), `EagerPieces` or the worker's capture and replay
(`worker/prefill_graphs.py`) for a forward padded to a token-count bucket, where each piece is one
CUDA graph and must end with its side work joined.

In a padded forward the pieces run over the bucket's tokens (the real ones first) and the cores over
the real tokens only. `PaddedInputs` holds the bucket's token ids, positions and real-token count in
static buffers; inside piece 0 `padded_token_inputs` derives the rope tables, the staging rows (a
padding token stages to its ring's trash row) and the `valid` mask (a padding token routes to no
expert) from them. The attention outputs go to one static buffer whose padding rows keep whatever the
cores wrote there in earlier steps (finite values, or the zeros it starts with): nothing of a padding
token reaches a real token's row or any state row but the trash rows."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import torch

from ..config import ModelConfig
from ..kernels.rope import rope_tables
from .batch import BatchMetadata
from .side_stream import SideStream, SideStreams
from .state import ModelState

T = TypeVar("T")


@dataclass
class TokenInputs:
    """What the pieces read of a step besides the streams: per-token tensors only."""

    input_ids: torch.Tensor  # [T] (hash routing)
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin [T, rope_dim / 2]
    kv_staging: torch.Tensor  # [T] KV-pool staging row of each token
    comp_staging: dict[tuple[int, bool], torch.Tensor]  # (rate, overlap) -> [T] compressor staging rows
    valid: torch.Tensor | None = None  # [T] bool: real tokens (None: all of them)
    wait: Callable[[], None] | None = None  # makes the main stream wait for the rope tables (plain forward)

    def ready(self) -> None:
        """Before the main stream reads the rope tables."""
        if self.wait is not None:
            self.wait()

    @staticmethod
    def of_context(ctx) -> "TokenInputs":
        """The plain forward's: the step context's tensors (built on the side stream, waited for by `ready`)."""
        return TokenInputs(ctx.batch.input_ids, ctx.rope, ctx.kv_staging_rows,
                           {key: addr.staging_rows for key, addr in ctx.compressors.items()}, wait=ctx.wait_built)


class AttnPre(NamedTuple):
    """A layer's attention inputs, from `Attention.project_in`: what its core reads."""

    q: torch.Tensor  # [T, H, D] normed, rotated queries
    kv: torch.Tensor  # [T, D] fresh KV rows as the pool stores them (already in their staging rows)
    comp: torch.Tensor | None  # [T, 2 * width] staged compressor kv || gate (committed to the ring by the core)
    idx: torch.Tensor | None  # [T, 4 * index_dim] staged indexer kv || gate (CSA)
    idx_weights: torch.Tensor | None  # [T, index heads] the indexer's head weights (CSA)
    idx_q: torch.Tensor | None  # [T, index heads * index_dim] the indexer's queries, not rotated yet (CSA)
    mark: torch.cuda.Event | None  # the main stream right after the projections (the indexer forks from it)

    def head(self, n: int) -> "AttnPre":
        """The first n tokens' rows (a padded forward's real tokens)."""
        if self.q.shape[0] == n:
            return self
        return AttnPre(*(t[:n] if isinstance(t, torch.Tensor) else t for t in self))


class LayerCarry(NamedTuple):
    """What a piece hands on: the streams and the pending mHC coefficients of the block in flight,
    the attention inputs of the next core, and after the last layer the head's input."""

    streams: torch.Tensor
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None
    pre: AttnPre | None = None
    hidden: torch.Tensor | None = None  # [T, D] norm(hc_head collapse): the LM head's input (padded forward)


class Pieces(Protocol):
    def run(self, index: int, fn: Callable[..., T], *args) -> T:
        """Piece `index` of the step: fn(side, *args)."""


class InlinePieces:
    """The plain forward: every piece inline, on the step's one side stream (joined by the caller)."""

    def __init__(self, side: SideStream) -> None:
        self.side = side

    def run(self, index: int, fn: Callable[..., T], *args) -> T:
        return fn(self.side, *args)


class EagerPieces:
    """A padded forward run eagerly: each piece on its own side stream, joined at its end (as a captured
    piece must be), so it launches what the capture records."""

    def __init__(self, side_streams: SideStreams, device: torch.device, num_tokens: int) -> None:
        self.side_streams = side_streams
        self.device = device
        self.num_tokens = num_tokens

    def run(self, index: int, fn: Callable[..., T], *args) -> T:
        side = self.side_streams.for_step(self.device, self.num_tokens)
        value = fn(side, *args)
        side.join()
        return value


@dataclass
class PaddedInputs:
    """Static buffers of a padded forward (views of the largest bucket's, so every bucket's share one
    address): the bucket's token ids and positions (the real tokens first; padding rows keep earlier
    steps' values, valid ids and positions), the number of real tokens, and the attention outputs."""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    num_real: torch.Tensor  # [1] int64
    attn_out: torch.Tensor  # [bucket, heads, head_dim]: the cores write the real rows

    @staticmethod
    def allocate(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> "PaddedInputs":
        flat = torch.zeros(2 * num_tokens + 1, dtype=torch.int64, device=device)
        attn = torch.zeros(num_tokens, heads, head_dim, dtype=dtype, device=device)
        return PaddedInputs(flat[:num_tokens], flat[num_tokens:2 * num_tokens], flat[2 * num_tokens:], attn)

    @property
    def bucket(self) -> int:
        return self.input_ids.shape[0]

    def narrow(self, bucket: int) -> "PaddedInputs":
        if bucket > self.bucket:
            raise ValueError(f"bucket {bucket} exceeds the padded buffers' {self.bucket} tokens")
        return PaddedInputs(self.input_ids[:bucket], self.positions[:bucket], self.num_real,
                            self.attn_out[:bucket])

    def fill(self, batch: BatchMetadata) -> None:
        """The real tokens' ids and positions, and their count (device copies: no host sync)."""
        n = batch.num_tokens
        if n > self.bucket:
            raise ValueError(f"a step of {n} tokens does not fit the bucket of {self.bucket}")
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.num_real.fill_(n)


def compressor_keys(model_config: ModelConfig) -> list[tuple[int, bool]]:
    """The compressors' (rate, overlap) kinds, in layer order."""
    return list(dict.fromkeys((model_config.compress_rate(i), model_config.is_csa(i))
                              for i in range(model_config.num_layers) if model_config.compress_rate(i)))


def padded_token_inputs(inputs: PaddedInputs, state: ModelState, model_config: ModelConfig, rope) -> TokenInputs:
    """The pieces' token inputs over the bucket, from the static buffers alone (inside piece 0). `rope`:
    the model's `RopeTablePlan`."""
    num_tokens = inputs.bucket
    layout, index = state.layout, state.index
    tables = rope_tables(inputs.positions, rope.offsets_tensor, rope.inv_freq_tensor)
    valid = index.token[:num_tokens] < inputs.num_real
    staging: dict[int, torch.Tensor] = {}

    def rows(ring: int) -> torch.Tensor:  # padding tokens stage to the ring's trash row
        if ring not in staging:
            staging[ring] = torch.where(valid, index.staging[ring][:num_tokens], layout.trash_row(ring))
        return staging[ring]

    return TokenInputs(inputs.input_ids, {"main": (tables[0, 0], tables[0, 1]), "compress": (tables[1, 0], tables[1, 1])},
                       rows(layout.ring_rows),
                       {key: rows(layout.compressor_ring_rows(*key)) for key in compressor_keys(model_config)},
                       valid=valid)
