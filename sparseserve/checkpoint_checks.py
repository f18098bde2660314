"""Checks of a checkpoint's config.json (and of `hf_overrides`) and of its tensors' dtypes.

Every value the engine relies on is checked once, at load, with a CheckpointError that names the
key, its value and what is allowed, instead of a division by zero or a top-k failure at the first step.
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch
from transformers import DeepseekV4Config

from .names import LAYER_CSA, LAYER_HCA, LAYER_SLIDING
from .errors import CheckpointError, ConfigError
from .validation import is_int

LEGACY_KEYS = ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "model_type", "quantization_config",
               "expert_dtype", "architectures", "transformers_version", "torch_dtype")
LAYER_KINDS = (LAYER_SLIDING, LAYER_CSA, LAYER_HCA)
MLP_KINDS = ("hash_moe", "moe")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# key -> lower bound: the integers the engine's shapes and loops are built from.
POSITIVE_INTS = {
    "vocab_size": 2, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 1, "qk_rope_head_dim": 0, "q_lora_rank": 1, "o_lora_rank": 1, "o_groups": 1, "index_n_heads": 1,
    "index_head_dim": 1, "index_topk": 1, "sliding_window": 1, "max_position_embeddings": 2, "hc_mult": 1,
    "hc_sinkhorn_iters": 1, "n_routed_experts": 1, "num_experts_per_tok": 1, "n_shared_experts": 0,
    "moe_intermediate_size": 1, "num_nextn_predict_layers": 0,
}
POSITIVE_FLOATS = ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit")


def known_config_keys() -> set[str]:
    params = set(inspect.signature(DeepseekV4Config.__init__).parameters) - {"self", "kwargs"}
    return params | set(DeepseekV4Config().to_dict()) | set(LEGACY_KEYS)


def check_override_keys(overrides: dict) -> None:
    """`hf_overrides` names only keys a DeepSeek-V4 config.json has."""
    bad = [k for k in overrides if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"hf_overrides keys must be strings (config.json keys); got {bad[0]!r}")
    unknown = sorted(set(overrides) - known_config_keys())
    if unknown:
        raise ConfigError(f"hf_overrides has key(s) {', '.join(unknown)} that a DeepSeek-V4 config.json does not "
                          "have; check the spelling (e.g. 'num_hidden_layers', 'n_routed_experts')")


def check_raw_config(raw, where: str) -> None:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must hold a JSON object (the model's config), got {type(raw).__name__}")


def _fail(where: str, key: str, value, rule: str) -> None:
    raise CheckpointError(f"{where}: {key} is {value!r}; it must be {rule}")


def check_hf_config(hf: DeepseekV4Config, where: str) -> None:
    """Every value the engine relies on, after transformers folded the legacy keys."""
    for key, lo in POSITIVE_INTS.items():
        value = getattr(hf, key, None)
        if not is_int(value) or value < lo:
            _fail(where, key, value, f"an integer >= {lo}")
    for key in POSITIVE_FLOATS:
        value = getattr(hf, key, None)
        if value is None and key == "swiglu_limit":
            continue
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            _fail(where, key, value, "a finite number > 0")
    if hf.num_experts_per_tok > hf.n_routed_experts:
        _fail(where, "num_experts_per_tok", hf.num_experts_per_tok,
              f"at most n_routed_experts ({hf.n_routed_experts})")
    if hf.num_attention_heads % hf.o_groups:
        _fail(where, "o_groups", hf.o_groups, f"a divisor of num_attention_heads ({hf.num_attention_heads})")
    if hf.qk_rope_head_dim > hf.head_dim or hf.qk_rope_head_dim % 2:
        _fail(where, "qk_rope_head_dim", hf.qk_rope_head_dim, f"even and at most head_dim ({hf.head_dim})")
    layers = hf.num_hidden_layers
    for key, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        value = getattr(hf, key, None)
        if not isinstance(value, (list, tuple)) or len(value) != layers:
            _fail(where, key, value, f"a list of {layers} entries (one per layer)")
        for i, kind in enumerate(value):
            if kind not in kinds:
                _fail(where, f"{key}[{i}]", kind, f"one of {', '.join(kinds)}")
    rates = hf.compress_rates
    if not isinstance(rates, dict):
        _fail(where, "compress_rates", rates, "a dict of layer kind to compress rate")
    for kind in set(hf.layer_types) - {LAYER_SLIDING}:
        rate = rates.get(kind)
        if not is_int(rate) or rate < 1:
            _fail(where, f"compress_rates[{kind!r}]", rate, "an integer >= 1 (tokens per compressed entry)")
    vocab = hf.vocab_size
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(hf, key, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        for t in ids:
            if t is not None and (not is_int(t) or not 0 <= t < vocab):
                _fail(where, key, value, f"None or token id(s) in [0, vocab_size={vocab})")


def check_tensor_dtype(name: str, value: torch.Tensor, target: torch.Tensor) -> None:
    """A checkpoint tensor's dtype must be one the model's tensor can take without losing meaning:
    a float tensor for a float parameter (fp32/bf16/fp16), an integer tensor for an integer buffer."""
    if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"tensor {name} is fp8; fp8 checkpoints are not supported yet (use a bf16 copy)")
    if target.dtype.is_floating_point:
        if value.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {value.dtype}; it must be one of "
                                  f"{', '.join(map(str, FLOAT_DTYPES))} (re-export the checkpoint in bf16)")
    elif value.dtype.is_floating_point or value.dtype == torch.bool:
        raise CheckpointError(f"tensor {name} has dtype {value.dtype}; it must be an integer tensor "
                              f"(the model holds it as {target.dtype})")
