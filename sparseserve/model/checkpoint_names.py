"""The one name map: checkpoint tensor names -> the engine's module (state-dict) names.

Three layouts load (docs/checkpoints.md has the full table):
- the DeepSeek-V4 release: `embed.weight`, `head.weight`, `layers.N.attn.wq_a.weight` (+ `.scale`),
  `layers.N.ffn.experts.E.w1.weight`, `layers.N.hc_attn_fn`, `mtp.0.*`, ...;
- what `transformers`' `DeepseekV4ForCausalLM.save_pretrained` writes: the release's layer names
  under a `model.` prefix, with `model.embed_tokens.weight`, `model.hc_head.hc_*`, `head.weight`,
  and the attention's kv norm as `attn.norm.weight`;
- the engine's own module names (what the project's tools write; they pass through unchanged),
  with the MTP layer's older mix of release prefixes and module names (`mtp.0.attn.q_a_proj.weight`).

Scales (`<module>.scale`, or `<module>.weight_scale_inv`) are not mapped here: the loader pairs each
with its `<module>.weight`. Routed experts are one tensor per expert and projection in the release
(`w1` gate, `w3` up, `w2` down) and one stacked tensor per layer in the engine
(`mlp.experts.gate_up_proj` [E, 2I, D] = w1 rows then w3 rows; `mlp.experts.down_proj` [E, D, I]).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Release module paths inside a decoder layer (`layers.N.` / `mtp.0.`) -> engine module paths.
# Each is followed by `.weight` (and `.scale` when quantized), or another leaf (`ffn.gate.tid2eid`).
LAYER_MODULES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
# Names `save_pretrained` writes where they differ from the release's.
SAVE_PRETRAINED_MODULES: dict[str, str] = {"attn.norm": "self_attn.kv_norm"}
# Release tensors inside a layer that are parameters of their own (no `.weight`).
LAYER_PARAMS: dict[str, str] = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    **{f"hc_{block}_{leaf}": f"{block}_hc.{leaf}" for block in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
}
# Top-level release tensors -> engine names.
TOP: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    **{f"hc_head_{leaf}": f"model.hc_head.hc_{leaf}" for leaf in ("fn", "base", "scale")},
}
# The MTP layer's own tensors (`mtp.0.` + these); the rest of `mtp.0.*` is its decoder block.
MTP_MODULES = ("e_proj", "h_proj", "enorm", "hnorm", "norm")
MTP_PARAMS: dict[str, str] = {f"hc_head_{leaf}": f"hc_head.hc_{leaf}" for leaf in ("fn", "base", "scale")}
MTP_PREFIX = "mtp.0."

# Routed experts: release projection -> (engine tensor, its row half in gate_up_proj or None).
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                                                   "w2": ("down_proj", None)}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")

# What the release stores as block FP8 (every other floating tensor is bf16 or, below, float32;
# routed experts follow expert_dtype): the `Linear`s of its inference code without a dtype of their own.
RELEASE_FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b",
                       "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3",
                       "e_proj", "h_proj")
RELEASE_FP32 = ("attn.attn_sink", "attn.compressor.ape", "attn.indexer.compressor.ape", "attn.compressor.wkv",
                "attn.compressor.wgate", "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate",
                "ffn.gate.bias", "hc_")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor loads: the engine tensor `name`, or for a release routed-expert
    tensor, expert `expert` of the stacked `name`, rows `half` (0 gate, 1 up) or all (`half` None)."""

    name: str
    expert: int | None = None
    half: int | None = None


def _layer_target(tail: str, prefix: str) -> Target:
    if tail in LAYER_PARAMS:
        return Target(prefix + LAYER_PARAMS[tail])
    expert = _EXPERT.match(tail)
    if expert:
        stacked, half = EXPERT_PARTS[expert[2]]
        return Target(f"{prefix}mlp.experts.{stacked}", int(expert[1]), half)
    module, _, leaf = tail.rpartition(".")
    mapped = LAYER_MODULES.get(module) or SAVE_PRETRAINED_MODULES.get(module)
    if mapped:
        return Target(f"{prefix}{mapped}.{leaf}")
    # Module names under the release's block prefixes (the project's older MTP layout).
    for old, new in (("attn.", "self_attn."), ("ffn.", "mlp.")):
        if tail.startswith(old):
            return Target(prefix + new + tail[len(old):])
    return Target(prefix + tail)


def main_target(name: str) -> Target:
    """The engine tensor a main-model checkpoint tensor (any of the three layouts) loads into."""
    if name in TOP:
        return Target(TOP[name])
    stripped = name[len("model."):] if name.startswith("model.") else name
    layer = _LAYER.match(stripped)
    if layer:
        return _layer_target(layer[2], f"model.layers.{layer[1]}.")
    if stripped in TOP:
        return Target(TOP[stripped])
    return Target(name)


def mtp_target(name: str) -> Target:
    """The `MTPModule` tensor an `mtp.0.*` checkpoint tensor loads into (`block.*` for its decoder layer)."""
    rest = name[len(MTP_PREFIX):] if name.startswith(MTP_PREFIX) else name
    if rest in MTP_PARAMS:
        return Target(MTP_PARAMS[rest])
    if rest.partition(".")[0] in MTP_MODULES + ("hc_head",):
        return Target(rest)
    return _layer_target(rest, "block.")


_RELEASE_LAYER = {**{v: k for k, v in LAYER_MODULES.items()}}
_RELEASE_PARAMS = {v: k for k, v in LAYER_PARAMS.items()}
_RELEASE_TOP = {v: k for k, v in TOP.items()}


def release_layer_name(tail: str) -> str:
    """Engine name inside a decoder layer -> the release's (routed experts aside)."""
    if tail in _RELEASE_PARAMS:
        return _RELEASE_PARAMS[tail]
    module, _, leaf = tail.rpartition(".")
    if module in _RELEASE_LAYER:
        return f"{_RELEASE_LAYER[module]}.{leaf}"
    raise KeyError(f"no release name for the layer tensor {tail!r}")


def release_name(engine_name: str) -> str:
    """Engine state-dict name -> the release checkpoint's name (routed experts aside)."""
    if engine_name in _RELEASE_TOP:
        return _RELEASE_TOP[engine_name]
    layer = _LAYER.match(engine_name[len("model."):])
    if engine_name.startswith("model.") and layer:
        return f"layers.{layer[1]}.{release_layer_name(layer[2])}"
    raise KeyError(f"no release name for {engine_name!r}")


def release_mtp_name(module_name: str) -> str:
    """`MTPModule` state-dict name -> the release's `mtp.0.*` name (routed experts aside)."""
    for leaf, mapped in MTP_PARAMS.items():
        if module_name == mapped:
            return MTP_PREFIX + leaf
    if module_name.startswith("block."):
        return MTP_PREFIX + release_layer_name(module_name[len("block."):])
    return MTP_PREFIX + module_name


def release_storage(release: str) -> str:
    """How the release stores a (non-expert) tensor, by its name inside a layer, mtp.0 or the top:
    "fp8", "fp32", "int64" or "bf16"."""
    tail = _LAYER.sub(r"\2", release)
    tail = tail[len(MTP_PREFIX):] if tail.startswith(MTP_PREFIX) else tail
    module = tail.rpartition(".")[0]
    if module in RELEASE_FP8_MODULES and tail.endswith(".weight"):
        return "fp8"
    if tail.endswith("tid2eid"):
        return "int64"
    if any(tail == p or tail.startswith(p if p.endswith("_") else p + ".") for p in RELEASE_FP32):
        return "fp32"
    return "bf16"
