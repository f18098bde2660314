"""DeepSeek-V4 attention: q-LoRA, shared-KV MQA with sinks, partial interleaved rope,
inverse rope on the output, grouped low-rank output projection; sliding, CSA (compressor +
Lightning Indexer + top-k) and HCA (compressor, all entries) layer kinds.

Parameter names follow `transformers`' DeepseekV4Attention so checkpoints load as they are.

Projections that read one input run as one GEMM once packed (`fused_linear.pack_projections`,
called by the loader): on the layer input x, `q_a_proj | kv_proj | compressor kv_proj, gate_proj
| indexer kv_proj, gate_proj | indexer weights_proj` (2, 4 or 7 linears by layer kind); on
q_residual, `q_b_proj | indexer q_b_proj` (CSA). Each weight stays a Parameter of its own name,
a view of its rows of the packed matrix; unpacked, the linears run one by one.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ...kernels.compressor import compress_windows
from ...kernels.gemv import decode_grouped_linear
from ...kernels.indexer import indexer_scores
from ...kernels.norm_rope import norm_rope
from ...kernels.rows import entry_pool_rows
from ...kernels.attention import sparse_mqa_attention
from ...distributed.communicator import ParallelGroup
from ..pieces import AttnPre, TokenInputs
from ..side_stream import SideStream
from ..state import LayerState
from ..step_context import StepContext
from .fused_linear import PackedWeight, Span, linear_weight_or_quant, shared_input_linear
from .norm import RMSNorm
from .rope import apply_rope

logger = logging.getLogger(__name__)


class Indexer(nn.Module):
    """Lightning Indexer: its own overlapped compressor at index_head_dim, and the scorer."""

    def __init__(self, hf, rate: int) -> None:
        super().__init__()
        self.rate = rate
        self.num_heads = hf.index_n_heads
        self.head_dim = hf.index_head_dim
        self.topk = hf.index_topk
        self.kv_proj = nn.Linear(hf.hidden_size, 2 * self.head_dim, bias=False)
        self.gate_proj = nn.Linear(hf.hidden_size, 2 * self.head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, 2 * self.head_dim))
        self.kv_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)
        self.q_b_proj = nn.Linear(hf.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hf.hidden_size, self.num_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5
        self.weights_scale = self.num_heads**-0.5


class Compressor(nn.Module):
    def __init__(self, hf, rate: int, overlap: bool) -> None:
        super().__init__()
        self.rate = rate
        self.overlap = overlap
        width = (2 if overlap else 1) * hf.head_dim
        self.kv_proj = nn.Linear(hf.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hf.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = RMSNorm(hf.head_dim, hf.rms_norm_eps)
        if overlap:
            self.indexer = Indexer(hf, rate)


class Attention(nn.Module):
    def __init__(self, hf, layer_idx: int, rate: int, is_csa: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.rate = rate
        self.is_csa = is_csa
        self.num_heads = hf.num_attention_heads
        self.head_dim = hf.head_dim
        self.o_groups = hf.o_groups
        self.o_lora_rank = hf.o_lora_rank
        self.eps = hf.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rope_name = "compress" if rate else "main"
        self.q_a_proj = nn.Linear(hf.hidden_size, hf.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(hf.q_lora_rank, hf.rms_norm_eps)
        self.q_b_proj = nn.Linear(hf.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(hf.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)
        # o_a_proj: one [o_lora_rank, heads*head_dim/groups] block per group, stacked.
        self.o_a_proj = nn.Linear(self.num_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(self.o_groups * self.o_lora_rank, hf.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.compressor = Compressor(hf, rate, is_csa) if rate else None
        # Tensor parallel (model/sharding.py): this rank's query heads and output groups; the
        # partial output is summed over the ranks. None: one process, nothing more runs.
        self.tp: ParallelGroup | None = None
        self._packed: dict[str, PackedWeight] = {}  # "x" / "q" -> packed weights of that input's linears

    # ---- projections that share an input (one GEMM per input once packed) ----
    def _x_linears(self) -> tuple[list[nn.Linear], list[Span]]:
        """The linears reading x, in packed order, and the spans wanted: q_a | kv | compressor
        kv||gate | indexer kv||gate | indexer head weights (kv||gate is what the state stages)."""
        linears, spans = [self.q_a_proj, self.kv_proj], [(0, 1), (1, 2)]
        comp = self.compressor
        if comp is not None:
            linears += [comp.kv_proj, comp.gate_proj]
            spans.append((2, 4))
            if self.is_csa:
                idx = comp.indexer
                linears += [idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
                spans += [(4, 6), (6, 7)]
        return linears, spans

    def _q_linears(self) -> tuple[list[nn.Linear], list[Span]]:
        """The linears reading q_residual: q_b | indexer q_b (CSA)."""
        if self.is_csa:
            return [self.q_b_proj, self.compressor.indexer.q_b_proj], [(0, 1), (1, 2)]
        return [self.q_b_proj], [(0, 1)]

    def _linear_groups(self) -> dict[str, tuple[list[nn.Linear], list[Span]]]:
        return {"x": self._x_linears(), "q": self._q_linears()}

    def _pack_projections(self) -> int:
        """Pack each group of linears sharing an input (see `fused_linear.pack_projections`);
        returns the number of groups packed now (intact ones are left as they are)."""
        count = 0
        for name, (linears, _) in self._linear_groups().items():
            packed = self._packed.get(name)
            if packed is not None and packed.holds(linears):
                continue
            self._packed.pop(name, None)
            packed = PackedWeight.pack(linears)
            if packed is not None:
                self._packed[name] = packed
                count += 1
        return count

    def packed_groups(self) -> list[str]:
        """The inputs ("x", "q") whose linears currently run as one GEMM."""
        groups = self._linear_groups()
        return [name for name, packed in self._packed.items() if packed.holds(groups[name][0])]

    def _packed_holding(self, name: str, linears: list[nn.Linear]) -> PackedWeight | None:
        """The packed weights of input `name`, or None when unpacked or no longer holding `linears`."""
        packed = self._packed.get(name)
        if packed is not None and not packed.holds(linears):
            # The weights were replaced after packing (.to() to another dtype/device, assign=True
            # loading): drop the stale matrix and run the linears one by one.
            logger.warning("layer %d: the packed %r projections no longer hold the weights (replaced after "
                           "packing); running them unpacked; call pack_projections(model) again to re-pack",
                           self.layer_idx, name)
            del self._packed[name]
            packed = None
        return packed

    def _project(self, name: str, inp: torch.Tensor) -> list[torch.Tensor]:
        linears, spans = self._x_linears() if name == "x" else self._q_linears()
        return shared_input_linear(inp, linears, self._packed_holding(name, linears), spans)

    def _project_state(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The x-projections that feed the layer's state: kv[, compressor kv||gate[, indexer kv||gate]]
        (`_x_linears` spans 1..3), one GEMM over their consecutive rows of the packed matrix; q_a and the
        indexer's head weights are not computed. Each output column is the same dot product as in the
        whole group's GEMM (bit-equal on the CPU; a CUDA GEMM of another shape may round otherwise)."""
        linears, spans = self._x_linears()
        state_spans = spans[1:4]  # kv | compressor | indexer, those the layer kind has
        first, last = state_spans[0][0], state_spans[-1][1]
        packed = self._packed_holding("x", linears)
        return shared_input_linear(x, linears[first:last], packed.rows(first, last) if packed is not None else None,
                                   [(i - first, j - first) for i, j in state_spans])

    def forward_state(self, x: torch.Tensor, ctx: StepContext, state: LayerState) -> None:
        """The part of `forward` that writes the layer's state, and nothing else: `project_in`'s staging
        (the compressor's and indexer's projections, the normed, rotated KV rows) and the core's emission
        of compressed entries and indexer keys and its ring commits, in `forward`'s order and with its
        kernels, so the state ends bit-equal. No q path, indexer scores, attention or output projection.
        `ctx` may be built with `attention=False` (no attention row lists)."""
        tokens = TokenInputs.of_context(ctx)
        x_proj = self._project_state(x)  # kv[, compressor kv||gate[, indexer kv||gate]]
        staged = self._stage(x_proj[1:], tokens, state) if self.compressor is not None else (None, None)
        kv = self._stage_kv(x_proj[0], tokens, state)
        if self.compressor is not None:
            self._emit(ctx, state)
        self._commit(staged, kv, ctx, state)

    def forward(self, x: torch.Tensor, ctx: StepContext, state: LayerState) -> torch.Tensor:
        """The whole attention over the step's tokens: `project_in`, `core`, `project_out`."""
        return self.project_out(self.core(self.project_in(x, TokenInputs.of_context(ctx), state, ctx.side), ctx, state))

    def project_in(self, x: torch.Tensor, tokens: TokenInputs, state: LayerState, side: SideStream) -> AttnPre:
        """What depends only on the step's tokens (a piece, model/pieces.py): the projections, this step's
        compressor (and indexer) rows and fresh KV rows written to their staging rows, and the normed,
        rotated queries. Side work runs on `side`: the compressor path and the fresh KV rows need only the
        projections until attention."""
        num_tokens = x.shape[0]
        x_proj = self._project("x", x)  # q_a, kv[, compressor kv||gate[, indexer kv||gate, indexer weights]]
        staged = side.run(self._stage, x_proj[2:], tokens, state) if self.compressor is not None else None
        fresh_kv = side.run(self._stage_kv, x_proj[1], tokens, state)
        q_residual = self.q_a_norm(x_proj[0])
        q_proj = self._project("q", q_residual)  # q[, indexer q]
        mark = side.mark() if self.is_csa else None  # the indexer forks here (the core's `_entry_rows`)
        tokens.ready()
        cos, sin = tokens.rope[self.rope_name]
        q = norm_rope(q_proj[0].view(num_tokens, self.num_heads, self.head_dim), None, self.eps, cos, sin)
        comp, idx = staged.value if staged is not None else (None, None)
        return AttnPre(q, fresh_kv.result(), comp, idx, x_proj[4] if self.is_csa else None,
                       q_proj[1] if self.is_csa else None, mark)

    def core(self, pre: AttnPre, ctx: StepContext, state: LayerState, out: torch.Tensor | None = None) -> torch.Tensor:
        """What reads the step's per-sequence metadata (run eagerly between a padded forward's pieces,
        over the real tokens): the compressed entries of the windows this step closes, the rows each token
        attends to (the indexer's top-k for CSA), the sparse attention (into `out` if given) and the
        ring commits. Returns the attention output [T, H, D], its rope channels rotated back."""
        side = ctx.side
        entry_rows = None
        if self.compressor is not None:
            # After this layer's staging on the side stream (nothing the main stream made since is read).
            side.then(self._emit, ctx, state)
            entry_rows = side.run_from(pre.mark, self._entry_rows, pre, ctx, state)
        ctx.wait_built()
        cos, sin = ctx.rope[self.rope_name]
        rows = ctx.window_rows if entry_rows is None else entry_rows.result()  # window rows, then entries
        # The output's rope channels are rotated back inside the attention launches.
        out = sparse_mqa_attention(pre.q, state.kv_pool, rows, self.sinks.float(), self.scale, inverse_rope=(cos, sin),
                                   kv_format=state.kv_format, out=out)
        # Commit after every read of the rings, queued after attention: beside it, even tiny
        # kernels slowed attention by half (an H200 profile). Nothing waits for the
        # commit before the forward's end, and the staged projections may be views of this
        # layer's GEMM output, freed when the caller drops them.
        side.keep_until_done(pre.comp, pre.idx)
        side.run(self._commit, (pre.comp, pre.idx), pre.kv, ctx, state)
        return out

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped output projection of the attention output [T, H, D] (a piece); summed over the
        tensor-parallel ranks."""
        if self.tp is None:
            return self._project_out(out)
        return self.tp.all_reduce(self._project_out(out))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        num_tokens = out.shape[0]
        # One row: both projections as weight streams (kernels/gemv.py), o_a's groups in one launch.
        mid = decode_grouped_linear(out.reshape(num_tokens, -1), self.o_a_proj.weight, self.o_groups)
        if mid is not None:
            return linear_weight_or_quant(mid, self.o_b_proj)
        grouped = out.reshape(num_tokens, self.o_groups, -1).transpose(0, 1)  # [G, T, in/G]
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)  # [G, r, in/G]
        # The batched GEMM writes each group's [T, r] block straight into its columns of mid
        # (cuBLAS takes the row stride G*r), instead of a [G, T, r] result copied across.
        mid = torch.empty(num_tokens, self.o_groups, self.o_lora_rank, dtype=out.dtype, device=out.device)
        torch.bmm(grouped, w.transpose(1, 2), out=mid.transpose(0, 1))
        return linear_weight_or_quant(mid.view(num_tokens, -1), self.o_b_proj)

    def _stage(self, x_proj: list[torch.Tensor], tokens: TokenInputs,
               state: LayerState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write this step's compressor (and indexer) projections to their staging rows. x_proj: compressor
        kv||gate[, indexer kv||gate] (anything after is not read). Returns the staged projections
        (compressor, indexer or None), which the core (or `forward_state`) commits to the rings."""
        key = (self.rate, self.is_csa)
        rows = tokens.comp_staging[key]
        # Staged straight from the GEMM output (kv and gate are adjacent there when packed).
        comp_kv_gate = x_proj[0].to(state.compressor_state.dtype)
        state.compressor_state.index_copy_(0, rows, comp_kv_gate)
        idx_kv_gate = None
        if self.is_csa:
            idx_kv_gate = x_proj[1].to(state.indexer_state.dtype)
            state.indexer_state.index_copy_(0, rows, idx_kv_gate)
        return comp_kv_gate, idx_kv_gate

    def _emit(self, ctx: StepContext, state: LayerState) -> None:
        """The compressed entries (and indexer keys) of the windows this step's tokens close, pooled from
        the staged and committed rows."""
        comp = self.compressor
        rate_addr = ctx.rates[self.rate]
        addr = ctx.compressors[(self.rate, self.is_csa)]
        compress_windows(state.compressor_state, addr.emit_src_rows, comp.position_bias, comp.overlap,
                         comp.kv_norm.weight, self.eps, rate_addr.emit_cos, rate_addr.emit_sin,
                         state.kv_pool, rate_addr.emit_kv_rows, kv_format=state.kv_format)
        if self.is_csa:
            idx = comp.indexer
            compress_windows(state.indexer_state, addr.emit_src_rows, idx.position_bias, True,
                             idx.kv_norm.weight, self.eps, rate_addr.emit_cos, rate_addr.emit_sin,
                             state.index_pool, rate_addr.emit_index_rows, out_scale=state.index_scale)

    def _stage_kv(self, kv_proj: torch.Tensor, tokens: TokenInputs, state: LayerState) -> torch.Tensor:
        """This step's KV rows (normed, rotated, in the pool's dtype; FP8: packed), written to their staging
        rows: attention reads them there; the core's commit writes them to the ring after it."""
        cos, sin = tokens.rope[self.rope_name]
        return norm_rope(kv_proj, self.kv_norm.weight, self.kv_norm.eps, cos, sin, state.kv_pool, tokens.kv_staging,
                         kv_format=state.kv_format)

    def _entry_rows(self, pre: AttnPre, ctx: StepContext, state: LayerState) -> torch.Tensor:
        """KV-pool rows each token attends to: its window rows, then those of the compressed entries,
        the indexer's top-k (CSA) or every visible entry (HCA)."""
        rate_addr = ctx.rates[self.rate]
        if not self.is_csa:
            return rate_addr.visible_rows
        idx = self.compressor.indexer
        batch = ctx.batch
        num_tokens = pre.q.shape[0]
        cos, sin = ctx.rope["compress"]
        # Rotated in place in the GEMM output (packed: a column slice; the indexer reads strides).
        iq = apply_rope(pre.idx_q.view(num_tokens, idx.num_heads, idx.head_dim), cos, sin)
        # The head weights (a column slice of the packed GEMM output) are scaled inside the kernel.
        scores = indexer_scores(iq, pre.idx_weights, state.index_pool, batch.block_table, batch.token_seq,
                                batch.positions, self.rate, ctx.layout.entries_per_block(self.rate),
                                idx.softmax_scale, rate_addr.num_entries, weights_scale=idx.weights_scale,
                                index_scale=state.index_scale)
        chosen = ctx.topk(scores, rate_addr.visible_counts, idx.topk)
        return entry_pool_rows(chosen, batch.token_seq, batch.block_table,
                               ctx.layout.entries_per_block(self.rate), ctx.layout.comp_base(), prefix=ctx.window_rows)

    def _commit(self, staged: tuple[torch.Tensor | None, torch.Tensor | None], kv: torch.Tensor, ctx: StepContext,
                state: LayerState) -> None:
        """Commit this step's KV rows and compressor (and indexer) projections to their rings.
        Staging row i holds token i's values, so they are committed from the values themselves."""
        state.kv_pool.index_copy_(0, ctx.kv_ring_write_rows, kv)
        comp_kv_gate, idx_kv_gate = staged
        if comp_kv_gate is not None:
            addr = ctx.compressors[(self.rate, self.is_csa)]
            state.compressor_state.index_copy_(0, addr.ring_write_rows, comp_kv_gate)
            if idx_kv_gate is not None:
                state.indexer_state.index_copy_(0, addr.ring_write_rows, idx_kv_gate)
