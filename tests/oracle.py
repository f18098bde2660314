"""Helpers shared by the parity tests: tiny random configs and the transformers oracle."""
from __future__ import annotations

import torch
from transformers import DeepseekV4Config
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sparseserve.config import ModelConfig
from sparseserve.model.batch import SequenceChunk, build_batch
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from sparseserve.model.state import ModelState, StateLayout


def tiny_config(**overrides) -> DeepseekV4Config:
    """Every layer kind, hash-MoE and MoE; 16 indexer heads (fewer make exact-zero ties common)."""
    args = dict(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=48, qk_rope_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
        index_n_heads=16, index_head_dim=16, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=5, max_position_embeddings=4096,
    )
    args.update(overrides)
    return DeepseekV4Config(**args)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values for every parameter and buffer, so no zero hides a bug."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("scale") or name.endswith("hc_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = b.shape[1]
            num_experts = model.config.n_routed_experts if hasattr(model, "config") else experts * 4
            b.copy_(torch.stack([torch.randperm(num_experts, generator=gen)[:experts] for _ in range(b.shape[0])]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def make_pair(config: DeepseekV4Config, seed: int = 0, dtype=torch.float32):
    """(oracle, engine model) sharing the same random weights."""
    torch.manual_seed(seed)
    oracle = HFDeepseekV4(config).eval()
    randomize(oracle, seed)
    oracle.to(dtype)
    ours = DeepseekV4ForCausalLM(ModelConfig(config, dtype=dtype))
    missing, unexpected = ours.load_state_dict(oracle.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all("inv_freq" in m for m in missing), missing
    ours.to(dtype).eval()
    return oracle, ours


class Driver:
    """Runs our model through its state with explicit chunks (what the runner does)."""

    def __init__(self, model: DeepseekV4ForCausalLM, num_slots: int = 4, num_blocks: int = 64,
                 block_size: int | None = None, max_step_tokens: int = 512, device="cpu", dtype=torch.float32,
                 kv_cache_dtype: str = "auto"):
        mc = model.model_config
        self.model = model
        self.block_size = block_size or max(mc.lcm_rate, 16)
        self.layout = StateLayout(num_blocks=num_blocks, block_size=self.block_size, num_slots=num_slots,
                                  max_step_tokens=max_step_tokens, sliding_window=mc.hf_config.sliding_window)
        self.state = ModelState(mc, self.layout, torch.device(device), dtype, kv_cache_dtype)
        self.next_block = 0
        self.blocks: dict[int, list[int]] = {}
        self.device = device

    def _blocks_for(self, slot: int, length: int) -> list[int]:
        blocks = self.blocks.setdefault(slot, [])
        while len(blocks) * self.block_size < length:
            blocks.append(self.next_block)
            self.next_block += 1
        return blocks

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, int, list[int]]], want: str = "all") -> list[torch.Tensor]:
        """chunks: (slot, start_pos, token_ids). Returns per-chunk fp32 logits [n, V] (want='all')."""
        seq_chunks = [SequenceChunk(slot, start, toks, list(self._blocks_for(slot, start + len(toks))), want)
                      for slot, start, toks in chunks]
        batch = build_batch(seq_chunks, self.model.model_config.rates, device=self.device)
        streams = self.model(batch, self.state)
        logits = self.model.compute_logits(streams[batch.logits_indices])
        out, i = [], 0
        for c in seq_chunks:
            n = len(c.token_ids) if want == "all" else 1
            out.append(logits[i:i + n])
            i += n
        return out
