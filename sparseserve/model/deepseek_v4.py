"""DeepSeek-V4 over a flat, varlen batch of tokens from many sequences.

forward() runs the decoder stack and returns the residual streams [T, hc, D] (what the
MTP drafter consumes); compute_logits() applies hc_head, the final norm and the LM head
to the tokens whose logits are wanted. forward_padded() runs the same stack padded to a
token-count bucket, as pieces and cores (model/pieces.py: what a prefill graph captures and
what runs between its pieces). Parameter names equal `DeepseekV4ForCausalLM`'s.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.communicator import ParallelGroup
from ..kernels.dispatch import use_triton
from ..kernels.embed import embed_streams
from .batch import BatchMetadata
from .layers.attention import Attention
from .layers.hyper_connection import HyperConnection, HyperHead
from .layers.moe import SparseMoE
from .layers.norm import RMSNorm
from .layers.rope import rope_inv_freq
from .pieces import InlinePieces, LayerCarry, PaddedInputs, Pieces, TokenInputs, padded_token_inputs
from .side_stream import SideStream, SideStreams, SideWork
from .state import ModelState
from .step_context import RopeTablePlan, StepContext, TopKFn, build_step_context

# torch.mm(..., out_dtype=torch.float32): bf16/fp16 GEMMs with fp32 output on CUDA (torch >= 2.8).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")


class DecoderLayer(nn.Module):
    def __init__(self, model_config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.self_attn = Attention(hf, layer_idx, model_config.compress_rate(layer_idx),
                                   model_config.is_csa(layer_idx))
        self.mlp = SparseMoE(hf, hf.mlp_layer_types[layer_idx] == "hash_moe")
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        hc_args = (hf.hc_mult, hf.hidden_size, hf.hc_sinkhorn_iters, hf.hc_eps, hf.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc_args)
        self.ffn_hc = HyperConnection(*hc_args)

    def forward(self, streams: torch.Tensor, ctx: StepContext, state) -> torch.Tensor:
        streams, pending = self.forward_deferred(streams, ctx, state)
        return HyperConnection.expand(streams, *pending)

    def forward_state(self, streams: torch.Tensor, ctx: StepContext, state) -> None:
        """Only what `forward` writes to the layer's state: the attention input (the pre-attention
        collapse and norm) and the attention's state writes (`Attention.forward_state`); no
        attention output, FFN or expand. The MTP drafter's catch-up where it proposes nothing."""
        _, _, x = self.attn_hc.collapse_norm(streams, self.input_layernorm)
        self.self_attn.forward_state(x, ctx, state)

    def forward_deferred(self, streams: torch.Tensor, ctx: StepContext, state,
                         pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The layer with the last expand left to the caller: returns (streams, (mlp_out, post, comb)).
        `pending` is the previous layer's: its expand and this layer's collapse then run as one
        expand+collapse step, as between the two sub-blocks (two launches for small steps, not three)."""
        tokens = TokenInputs.of_context(ctx)
        carry = self.attn_in(ctx.side, streams, pending, tokens, state)
        return self.ffn(ctx.side, carry, self.self_attn.core(carry.pre, ctx, state), tokens)

    def attn_in(self, side: SideStream, streams: torch.Tensor, pending, tokens: TokenInputs, state) -> LayerCarry:
        """The attention sub-block up to its core (model/pieces.py): the previous block's expand (`pending`)
        and this collapse and norm, then the attention's projections."""
        if pending is None:
            post, comb, x = self.attn_hc.collapse_norm(streams, self.input_layernorm)
        else:
            streams, post, comb, x = self.attn_hc.expand_collapse_norm(streams, *pending, self.input_layernorm)
        return LayerCarry(streams, post, comb, self.self_attn.project_in(x, tokens, state, side))

    def ffn(self, side: SideStream, carry: LayerCarry, attn: torch.Tensor, tokens: TokenInputs
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """After the attention core: its output projection into the streams, the feed-forward collapse,
        norm and MoE; the MoE's expand is left pending. `attn` [T, H, D]."""
        attn_out = self.self_attn.project_out(attn)
        streams, post, comb, x = self.ffn_hc.expand_collapse_norm(carry.streams, attn_out, carry.post, carry.comb,
                                                                  self.post_attention_layernorm)
        mlp_out = self.mlp(x, tokens.input_ids, side, tokens.valid)
        return streams, (mlp_out, post, comb)


class DeepseekV4Decoder(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.embed_tokens = nn.Embedding(hf.vocab_size, hf.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(model_config, i) for i in range(hf.num_hidden_layers))
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.hc_head = HyperHead(hf.hc_mult, hf.hidden_size, hf.hc_eps, hf.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.model_config = model_config
        hf = model_config.hf_config
        self.hc_mult = hf.hc_mult
        self.model = DeepseekV4Decoder(model_config)
        self.lm_head = nn.Linear(hf.hidden_size, hf.vocab_size, bias=False)
        for name, value in self.rope_buffers(model_config).items():
            self.register_buffer(name, value, persistent=False)
        self._rope_tables = RopeTablePlan.for_model(model_config)  # static; its tensors are the buffers
        self.side_streams = SideStreams()
        # Tensor parallel (model/sharding.py): lm_head holds this rank's vocabulary rows and the
        # logits are gathered from the ranks. None: one process.
        self.tp: ParallelGroup | None = None

    @staticmethod
    def rope_buffers(model_config: ModelConfig) -> dict[str, torch.Tensor]:
        """The non-persistent rope buffers: each base's inverse frequencies, and the step's rope
        tables as one plan (`RopeTablePlan`: offsets and frequencies, one row per table)."""
        hf = model_config.hf_config
        inv_freq = {name: rope_inv_freq(hf.rope_parameters[name], hf.qk_rope_head_dim) for name in ("main", "compress")}
        plan = RopeTablePlan.for_model(model_config)
        return {**{f"{name}_inv_freq": value for name, value in inv_freq.items()},
                "rope_table_offsets": torch.tensor(plan.offsets, dtype=torch.int64),
                "rope_table_inv_freq": torch.stack([inv_freq[base] for base in plan.bases])}

    def rope_plan(self) -> RopeTablePlan:
        # The buffers are looked up per call: a .to() or the loader's to_empty replaces them.
        return dataclasses.replace(self._rope_tables, offsets_tensor=self.rope_table_offsets,
                                   inv_freq_tensor=self.rope_table_inv_freq)

    def prepare(self, batch: BatchMetadata, state: ModelState, topk: TopKFn | None = None) -> StepContext:
        return build_step_context(batch, state, self.model_config, self.rope_plan(), topk)

    def forward(self, batch: BatchMetadata, state: ModelState, topk: TopKFn | None = None) -> torch.Tensor:
        """Residual streams [T, hc, D] after the last layer. `topk` selects the indexer's
        entries (default: the stateless dispatch); the runner passes its graph-safe one."""
        side = self.side_streams.for_step(batch.input_ids.device, batch.num_tokens)
        embedded = embed_streams(batch.input_ids, self.model.embed_tokens.weight, self.hc_mult)
        # The step's metadata is built on the side stream, beside the first layer's collapse and
        # projections; attention waits for it (ctx.wait_built). Queueing that collapse before the
        # fork was slower at every batch on the H200, so the fork comes first.
        built = side.run(self.prepare, batch, state, topk)
        ctx = built.value
        # Only the wait is kept: the work's value is ctx itself, and a cycle would hold the step's
        # tensors until the next garbage collection.
        ctx.side, ctx.built = side, SideWork(None, built.event)
        tokens = TokenInputs.of_context(ctx)
        streams = self.run_pieces(ctx, state, InlinePieces(side), lambda: (tokens, embedded)).streams
        side.join()
        return streams

    def forward_padded(self, batch: BatchMetadata, state: ModelState, inputs: PaddedInputs, pieces: Pieces,
                       topk: TopKFn | None = None) -> LayerCarry:
        """The step padded to `inputs`' bucket (`batch`: its real tokens, first in the bucket): the pieces
        over the bucket through `pieces` (eager, captured or replayed), the cores eagerly over the real
        tokens. Returns the last piece's carry: the streams [bucket, hc, D] and the LM head's input
        `hidden` [bucket, D], the real tokens' rows first."""
        ctx = self.prepare(batch, state, topk)
        inputs.fill(batch)
        return self.run_pieces(ctx, state, pieces, lambda: self._padded_inputs(inputs, state), inputs.attn_out,
                               head=True)

    def _padded_inputs(self, inputs: PaddedInputs, state: ModelState) -> tuple[TokenInputs, torch.Tensor]:
        tokens = padded_token_inputs(inputs, state, self.model_config, self.rope_plan())
        return tokens, embed_streams(tokens.input_ids, self.model.embed_tokens.weight, self.hc_mult)

    def run_pieces(self, ctx: StepContext, state: ModelState, pieces: Pieces,
                   first: Callable[[], tuple[TokenInputs, torch.Tensor]], attn_out: torch.Tensor | None = None,
                   head: bool = False) -> LayerCarry:
        """The decoder as pieces and cores (model/pieces.py). `first()` gives piece 0 the token inputs and the
        embedded streams; `attn_out` (padded forward): the static buffer the cores write the real tokens'
        attention outputs into and the next piece reads whole; `head`: the last piece also computes the LM
        head's input for every token."""
        num_tokens = ctx.batch.num_tokens
        tokens, carry = pieces.run(0, self._first_piece, first, state)
        for i, (layer, layer_state) in enumerate(zip(self.model.layers, state.layers)):
            pre, carry = carry.pre.head(num_tokens), carry._replace(pre=None)
            attn = layer.self_attn.core(pre, ctx, layer_state, None if attn_out is None else attn_out[:num_tokens])
            del pre  # dead once the core is queued (a capture may reuse its memory in the next piece)
            carry = pieces.run(i + 1, self._next_piece, i, carry, attn if attn_out is None else attn_out, tokens,
                               state, head)
        return carry

    def _first_piece(self, side: SideStream, first, state: ModelState) -> tuple[TokenInputs, LayerCarry]:
        tokens, streams = first()
        return tokens, self.model.layers[0].attn_in(side, streams, None, tokens, state.layers[0])

    def _next_piece(self, side: SideStream, i: int, carry: LayerCarry, attn: torch.Tensor, tokens: TokenInputs,
                    state: ModelState, head: bool) -> LayerCarry:
        layers = self.model.layers
        streams, pending = layers[i].ffn(side, carry, attn, tokens)
        if i + 1 < len(layers):  # this layer's last expand runs inside the next layer's first collapse
            return layers[i + 1].attn_in(side, streams, pending, tokens, state.layers[i + 1])
        streams = HyperConnection.expand(streams, *pending)
        hidden = self.model.hc_head.collapse_norm(streams, self.model.norm) if head else None
        return LayerCarry(streams, hidden=hidden)

    def compute_logits(self, streams: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits for the given residual streams [N, hc, D] (written into `out` [N, V] if given:
        captured graphs share one static logits buffer)."""
        return self.logits_of(self.model.hc_head.collapse_norm(streams, self.model.norm), out)

    def logits_of(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the LM head's inputs. On CUDA the GEMM writes fp32 itself (bf16/fp16
        inputs, fp32 accumulate, no rounding to bf16 and no conversion kernel after it)."""
        if self.tp is None:
            return self._head_logits(hidden, out)
        # Vocabulary shards, gathered (the last rank's trailing padding rows dropped).
        full = self.tp.all_gather_last(self._head_logits(hidden))[:, :self.model_config.hf_config.vocab_size]
        return full if out is None else out.copy_(full)

    def _head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if _MM_OUT_DTYPE and hidden.dtype in (torch.bfloat16, torch.float16) and use_triton("lm_head_fp32", hidden):
            weight = self.lm_head.weight.t()
            if out is None:
                return torch.mm(hidden, weight, out_dtype=torch.float32)
            return torch.mm(hidden, weight, out_dtype=torch.float32, out=out)
        if out is None:
            return self.lm_head(hidden).float()
        return out.copy_(self.lm_head(hidden))
