"""DeepSeek-V4 attention: q-LoRA, shared-KV MQA with sinks, partial interleaved rope,
inverse rope on the output, grouped low-rank output projection; sliding, CSA (compressor +
Lightning Indexer + top-k) and HCA (compressor, all entries) layer kinds.

Parameter names follow `transformers`' DeepseekV4Attention so checkpoints load as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from ...kernels.compressor import compress_windows
from ...kernels.indexer import indexer_scores
from ...kernels.rows import entry_pool_rows
from ...kernels.sparse_attention import sparse_mqa_attention
from ..state import LayerState
from ..step_context import StepContext
from .norm import RMSNorm, rms_normalize
from .rope import apply_rope


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


def _stage_projections(state: torch.Tensor, staging_rows: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor) -> None:
    state.index_copy_(0, staging_rows, torch.cat([kv, gate], dim=-1).to(state.dtype))


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

    def forward(self, x: torch.Tensor, ctx: StepContext, state: LayerState) -> torch.Tensor:
        num_tokens = x.shape[0]
        cos, sin = ctx.rope[self.rope_name]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(num_tokens, self.num_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        # Fresh rows go to staging first: attention reads them there, then they are committed.
        state.kv_pool.index_copy_(0, ctx.kv_staging_rows, kv.to(state.kv_pool.dtype))

        rows = ctx.window_rows
        if self.compressor is not None:
            rows = torch.cat([rows, self._compressed_rows(x, q_residual, ctx, state)], dim=1)
        out = sparse_mqa_attention(q, state.kv_pool, rows, self.sinks.float(), self.scale)
        out = apply_rope(out, cos, sin, inverse=True)

        state.kv_pool.index_copy_(0, ctx.kv_ring_write_rows, kv.to(state.kv_pool.dtype))
        return self._project_out(out)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        num_tokens = out.shape[0]
        grouped = out.reshape(num_tokens, self.o_groups, -1).transpose(0, 1)  # [G, T, in/G]
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)  # [G, r, in/G]
        mid = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(num_tokens, -1)
        return self.o_b_proj(mid)

    def _compressed_rows(self, x: torch.Tensor, q_residual: torch.Tensor, ctx: StepContext,
                         state: LayerState) -> torch.Tensor:
        comp = self.compressor
        rate_addr = ctx.rates[self.rate]
        addr = ctx.compressors[(self.rate, self.is_csa)]
        batch = ctx.batch
        _stage_projections(state.compressor_state, addr.staging_rows, comp.kv_proj(x), comp.gate_proj(x))
        compress_windows(state.compressor_state, addr.emit_src_rows, comp.position_bias, comp.overlap,
                         comp.kv_norm.weight, self.eps, rate_addr.emit_cos, rate_addr.emit_sin,
                         state.kv_pool, rate_addr.emit_kv_rows)
        if self.is_csa:
            idx = comp.indexer
            _stage_projections(state.indexer_state, addr.staging_rows, idx.kv_proj(x), idx.gate_proj(x))
            compress_windows(state.indexer_state, addr.emit_src_rows, idx.position_bias, True,
                             idx.kv_norm.weight, self.eps, rate_addr.emit_cos, rate_addr.emit_sin,
                             state.index_pool, rate_addr.emit_index_rows)
            cos, sin = ctx.rope["compress"]
            iq = apply_rope(idx.q_b_proj(q_residual).view(x.shape[0], idx.num_heads, idx.head_dim), cos, sin)
            weights = idx.scorer.weights_proj(x).float() * idx.weights_scale
            scores = indexer_scores(iq, weights, state.index_pool, batch.block_table, batch.token_seq,
                                    batch.positions, self.rate, ctx.layout.entries_per_block(self.rate),
                                    idx.softmax_scale, rate_addr.num_entries)
            lengths = ((batch.positions + 1) // self.rate).clamp(max=rate_addr.num_entries).to(torch.int32)
            chosen = ctx.topk(scores, lengths, idx.topk, batch.max_seq_len)
            rows = entry_pool_rows(chosen, batch.token_seq, batch.block_table,
                                   ctx.layout.entries_per_block(self.rate), ctx.layout.comp_base())
        else:
            rows = rate_addr.visible_rows
        # Commit this step's projections to the compressor rings (after every read above).
        for buf in (state.compressor_state, state.indexer_state if self.is_csa else None):
            if buf is not None:
                buf.index_copy_(0, addr.ring_write_rows, buf.index_select(0, addr.staging_rows))
        return rows
