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
from .quant_formats import FP4_STORAGE_DTYPES, SCALE_DTYPES, fp4_scale_shape, fp8_scale_shape, is_power_of_two
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
    a float tensor for a float parameter (fp32/bf16/fp16), an integer tensor for an integer buffer.
    (Quantized weights are checked and decoded before this: `check_quantized_weight`.)"""
    if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"tensor {name} is {value.dtype}, which sparseserve reads only as a block-FP8 "
                              "projection weight with its .scale; this tensor must be stored unquantized (bf16/fp32)")
    if target.dtype.is_floating_point:
        if value.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {value.dtype}; it must be one of "
                                  f"{', '.join(map(str, FLOAT_DTYPES))} (re-export the checkpoint in bf16)")
    elif value.dtype.is_floating_point or value.dtype == torch.bool:
        raise CheckpointError(f"tensor {name} has dtype {value.dtype}; it must be an integer tensor "
                              f"(the model holds it as {target.dtype})")


QUANT_METHODS = ("fp8",)
EXPERT_DTYPES = (None, "fp4", "fp8", "bf16", "bfloat16")
SCALE_FMTS = (None, "ue8m0", "float")


def check_weight_format(raw: dict, where: str) -> None:
    """config.json's `quantization_config` and `expert_dtype`: the formats sparseserve decodes
    (docs/checkpoints.md), or a named error for anything else."""
    quant = raw.get("quantization_config")
    expert_dtype = raw.get("expert_dtype")
    if expert_dtype not in EXPERT_DTYPES:
        _fail(where, "expert_dtype", expert_dtype, "'fp4', 'fp8', or absent (experts stored like the other weights)")
    if quant is None:
        if expert_dtype in ("fp4", "fp8"):
            _fail(where, "expert_dtype", expert_dtype, "absent when there is no quantization_config (the scales' "
                  "format comes from it); add the release's quantization_config or remove expert_dtype")
        return
    if not isinstance(quant, dict):
        _fail(where, "quantization_config", quant, "a JSON object")
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        _fail(where, "quantization_config.quant_method", method,
              "'fp8' (DeepSeek-V4's block FP8); for another method, convert the checkpoint to bf16 or to the "
              "release's fp8 format")
    if quant.get("fmt", "e4m3") != "e4m3":
        _fail(where, "quantization_config.fmt", quant.get("fmt"), "'e4m3'")
    if quant.get("scale_fmt") not in SCALE_FMTS:
        _fail(where, "quantization_config.scale_fmt", quant.get("scale_fmt"), "'ue8m0', 'float' or absent")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        _fail(where, "quantization_config.activation_scheme", quant.get("activation_scheme"),
              "'dynamic' (weights are decoded at load; static activation scales are not read)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(b) and b >= 1 for b in block)):
        _fail(where, "quantization_config.weight_block_size", block, "two integers >= 1 (e.g. [128, 128])")
    if expert_dtype == "fp4":
        for key in ("hidden_size", "moe_intermediate_size"):  # the routed experts' input dimensions
            value = raw.get(key)
            if is_int(value) and value % 2:
                _fail(where, key, value, "even when expert_dtype is 'fp4' (FP4 experts pack two values per byte "
                      "along their input dimension)")


def _check_scale(name: str, scale: torch.Tensor | None, scale_name: str, expected: tuple[int, ...], what: str,
                 ue8m0: bool) -> None:
    if scale is None:
        raise CheckpointError(f"tensor {name} is {what} but the checkpoint has no {scale_name}; quantized "
                              "weights need their scales (re-export the checkpoint with its .scale tensors)")
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"tensor {scale_name} has shape {tuple(scale.shape)}; the {what} weight {name} "
                              f"needs a scale of shape {expected}")
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"tensor {scale_name} has dtype {scale.dtype}; scales must be float8_e8m0fnu, "
                              "uint8 (ue8m0 bytes) or float32")
    if ue8m0 and scale.dtype == torch.float32 and not is_power_of_two(scale):
        raise CheckpointError(f"tensor {scale_name} holds values that are not powers of two, but "
                              "quantization_config.scale_fmt is 'ue8m0'; fix the scales or the scale_fmt")


def check_quantized_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, scale_name: str,
                           expected_shape: tuple[int, ...], stored_as: str, block: tuple[int, int],
                           ue8m0: bool, expert: bool) -> None:
    """A quantized projection weight and its scale against the shape the config implies.
    `stored_as` is what the config says this tensor is ("fp8", "fp4" or "bf16")."""
    is_fp8 = weight.dtype == torch.float8_e4m3fn
    is_fp4 = weight.dtype in FP4_STORAGE_DTYPES
    found = "fp8" if is_fp8 else "fp4" if is_fp4 else "bf16"
    if found != stored_as:
        if expert:
            hint = {"fp4": "'fp4'", "fp8": "'fp8'", "bf16": "absent (or 'bf16')"}[found]
            extra = " (with the release's quantization_config)" if stored_as == "bf16" else ""
            raise CheckpointError(f"config.json's expert_dtype and quantization_config say the routed experts are "
                                  f"{stored_as}, but tensor {name} is {weight.dtype} ({found}); set expert_dtype to "
                                  f"{hint}{extra} to match the tensors")
        if found == "fp8":
            raise CheckpointError(f"tensor {name} is {weight.dtype}, but config.json has no fp8 quantization_config; "
                                  "add the release's quantization_config (quant_method 'fp8')")
        raise CheckpointError(f"tensor {name} has dtype {weight.dtype}; this projection must be stored as "
                              f"{stored_as} (or unquantized)")
    *lead, n, k = expected_shape
    if found == "fp8":
        if tuple(weight.shape) != tuple(expected_shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(weight.shape)}, the config implies "
                                  f"{tuple(expected_shape)}")
        _check_scale(name, scale, scale_name, fp8_scale_shape(tuple(weight.shape), block), "fp8", ue8m0)
    elif found == "fp4":
        if k % 2:
            raise CheckpointError(f"tensor {name} is FP4, which packs two values per byte along the input "
                                  f"dimension, but the config gives it an odd input dimension ({k}); FP4 "
                                  "needs an even one")
        if tuple(weight.shape) != (*lead, n, k // 2):
            raise CheckpointError(f"tensor {name} has shape {tuple(weight.shape)} (FP4, two values per byte: "
                                  f"{(*weight.shape[:-1], 2 * weight.shape[-1])}); the config implies "
                                  f"{tuple(expected_shape)}, stored as {(*lead, n, k // 2)}")
        _check_scale(name, scale, scale_name, fp4_scale_shape(tuple(weight.shape)), "fp4", ue8m0)
