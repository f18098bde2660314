"""The MTP (multi-token prediction) layer of DeepSeek-V4, used as the speculative drafter.

For position t:  e = enorm(embed(token[t+1]));  x = e_proj(e) (broadcast over the hc streams)
+ h_proj(hnorm(h[t])) per stream, where h[t] are the main model's residual streams before
its hc_head; x = block(x); logits = lm_head(norm(hc_head_mtp(x))) predict token t+2.
The block is a full V4 decoder layer whose attention is sliding-window only (plain
rope_theta, sinks) and whose MoE is top-k routed. Embedding and lm_head are the main
model's. Drafting k > 1 tokens feeds the block's output streams back in as h.

Checkpoint names: `mtp.0.` + the release's names (`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`,
`hc_head_{fn,base,scale}`, and the block's `attn.*`, `ffn.*`, `attn_norm`, `hc_attn_*`, ... as in
a decoder layer), or the project's older layout (`mtp.0.attn.q_a_proj.weight`: module names under
the release's block prefixes); `checkpoint_names.mtp_target` maps both (docs/checkpoints.md).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..config import LAYER_SLIDING, ModelConfig
from .batch import BatchMetadata
from .deepseek_v4 import DecoderLayer, DeepseekV4ForCausalLM
from .layers.fused_linear import pack_projections
from .layers.hyper_connection import HyperHead
from .layers.norm import RMSNorm
from .checkpoint_names import mtp_target, release_mtp_name
from .loader import KEEP_FP32, CheckpointError, init_dummy_weights
from .state import ModelState
from .step_context import build_step_context
from .weight_loader import load_state

# The project's older MTP names: module names under the release's block prefixes.
_RENAMES = [
    ("hc_head_fn", "hc_head.hc_fn"), ("hc_head_base", "hc_head.hc_base"), ("hc_head_scale", "hc_head.hc_scale"),
    ("attn_norm.", "block.input_layernorm."), ("ffn_norm.", "block.post_attention_layernorm."),
    ("hc_attn_fn", "block.attn_hc.fn"), ("hc_attn_base", "block.attn_hc.base"), ("hc_attn_scale", "block.attn_hc.scale"),
    ("hc_ffn_fn", "block.ffn_hc.fn"), ("hc_ffn_base", "block.ffn_hc.base"), ("hc_ffn_scale", "block.ffn_hc.scale"),
    ("attn.", "block.self_attn."), ("ffn.", "block.mlp."),
]
PREFIX = "mtp.0."


def checkpoint_to_module_name(name: str) -> str:
    """`mtp.0.attn.wq_a.weight` or `mtp.0.attn.q_a_proj.weight` -> `block.self_attn.q_a_proj.weight`
    (routed experts of the release: the stacked tensor they load into)."""
    return mtp_target(name).name


def module_to_checkpoint_name(name: str) -> str:
    """Module name -> the project's older checkpoint name (what `tools/make_tiny_checkpoint.py` writes)."""
    for src, dst in _RENAMES:
        if name.startswith(dst):
            return PREFIX + src + name[len(dst):]
    return PREFIX + name


def mtp_model_config(model_config: ModelConfig) -> ModelConfig:
    """The MTP block as a one-layer model: sliding-window attention, top-k routed MoE."""
    hf = copy.deepcopy(model_config.hf_config)
    hf.num_hidden_layers = 1
    hf.layer_types = [LAYER_SLIDING]
    hf.mlp_layer_types = ["moe"]
    return ModelConfig(hf, dtype=model_config.dtype, path=model_config.path)


class MTPModule(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = mtp_model_config(model_config)
        hf = self.config.hf_config
        dim = hf.hidden_size
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.enorm = RMSNorm(dim, hf.rms_norm_eps)
        self.hnorm = RMSNorm(dim, hf.rms_norm_eps)
        self.norm = RMSNorm(dim, hf.rms_norm_eps)
        self.hc_head = HyperHead(hf.hc_mult, dim, hf.hc_eps, hf.rms_norm_eps)
        self.block = DecoderLayer(self.config, 0)

    def forward(self, batch: BatchMetadata, hidden_streams: torch.Tensor, state: ModelState,
                target: DeepseekV4ForCausalLM) -> torch.Tensor:
        """batch.input_ids are the *next* tokens (token[t+1]) at positions t; hidden_streams [T, hc, D]
        the target's (or the previous draft's) streams at t. Returns the block's streams [T, hc, D]."""
        ctx = build_step_context(batch, state, self.config, target.rope_plan(), None)
        return self.block(self._block_input(batch, hidden_streams, target), ctx, state.layers[0])

    def forward_state(self, batch: BatchMetadata, hidden_streams: torch.Tensor, state: ModelState,
                      target: DeepseekV4ForCausalLM) -> None:
        """The catch-up that proposes nothing: writes the layer's state exactly as `forward` does (the
        block's input from the tokens and streams, its attention input, the KV rows into the window
        ring) and computes nothing else (`DecoderLayer.forward_state`: no q path, attention, output
        projection or MoE; no streams out)."""
        ctx = build_step_context(batch, state, self.config, target.rope_plan(), None, attention=False)
        self.block.forward_state(self._block_input(batch, hidden_streams, target), ctx, state.layers[0])

    def _block_input(self, batch: BatchMetadata, hidden_streams: torch.Tensor,
                     target: DeepseekV4ForCausalLM) -> torch.Tensor:
        """The block's input streams [T, hc, D]: e_proj(enorm(embed(next token))) + h_proj(hnorm(h))."""
        e = self.enorm(target.model.embed_tokens(batch.input_ids))
        x = self.e_proj(e).unsqueeze(1) + self.h_proj(self.hnorm(hidden_streams.to(e.dtype)))
        return x.contiguous()

    def compute_logits(self, streams: torch.Tensor, target: DeepseekV4ForCausalLM) -> torch.Tensor:
        return target.logits_of(self.hc_head.collapse_norm(streams, self.norm))


def describe(module_name: str) -> str:
    try:
        return f"{module_to_checkpoint_name(module_name)} (release name {release_mtp_name(module_name)})"
    except KeyError:
        return module_to_checkpoint_name(module_name)


def load_mtp_weights(module: MTPModule, tensors: dict[str, torch.Tensor]) -> None:
    """Load `mtp.*` checkpoint tensors (any layout, quantized or not) into the module; names every problem."""
    names = [k for k in tensors if k.startswith("mtp.")]
    load_state(module, tensors, names, mtp_target, module.config.weight_format, describe, "MTP weights")


def load_mtp(model_config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
             load_format: str = "auto", seed: int = 0) -> MTPModule:
    """The MTP layer, ready to draft: its `mtp.0.*` tensors (from `load_model`) loaded, or dummy
    weights for `load_format="dummy"`; cast to `dtype` except the fp32 islands; projections packed."""
    mtp = MTPModule(model_config).to(device)
    if load_format == "dummy":
        init_dummy_weights(mtp, seed + 1, model_config.hf_config)
    elif not tensors:
        raise CheckpointError("speculative decoding needs the MTP layer, but the checkpoint has no mtp.0.* tensors")
    else:
        load_mtp_weights(mtp, tensors)  # decoded on the host, written into the module's device tensors
    for name, p in mtp.named_parameters():
        if not any(part in name for part in KEEP_FP32):
            p.data = p.data.to(dtype)
    pack_projections(mtp)  # after the dtype cast, which would undo it
    return mtp.eval()
