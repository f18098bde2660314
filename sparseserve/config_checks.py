"""Checks of `EngineConfig`'s options (types, ranges) and of the limits the loaded model sets.

`EngineConfig.validate()` runs `validate_engine_config` before anything is loaded; the engine runs
`check_model_limits` once the model's config is known (vLLM's rule: max_model_len may not exceed
the model's positions).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from .errors import ConfigError, ConfigTypeError
from .names import SIDE_STREAM_MODES
from .validation import check_bool, check_choice, check_float, check_int, is_int

DTYPE_NAMES = ("auto", "float32", "float", "bfloat16", "float16", "half")
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
TOPK_BACKENDS = ("auto", "standard", "persistent", "torch")

# (lower bound, allowed None) of integer options; bounds above come from the model or from memory.
INT_RANGES: dict[str, tuple[int, bool]] = {
    "seed": (0, False), "max_model_len": (2, True), "max_num_seqs": (1, False),
    "max_num_batched_tokens": (1, True), "kv_cache_memory_bytes": (1, True), "block_size": (1, True),
    "tensor_parallel_size": (1, False), "num_gpu_blocks_override": (1, True), "max_logprobs": (0, False),
}


def _name(field: str) -> str:
    return field


def _check_path(value, field: str) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigTypeError(f"{field} must be a path (str) or None; got {value!r} ({type(value).__name__})")


def _check_device(value) -> None:
    if isinstance(value, torch.device):
        return
    if not isinstance(value, str):
        raise ConfigTypeError(f"device must be 'auto', 'cpu' or 'cuda[:N]'; got {value!r} "
                              f"({type(value).__name__})")
    if value == "auto":
        return
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]'; got {value!r}") from None


def _check_dtype(value) -> None:
    if isinstance(value, torch.dtype):
        if value not in TORCH_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(map(str, TORCH_DTYPES))} (or a name "
                              f"such as 'bfloat16'); got {value}")
        return
    check_choice(value, _name("dtype"), ConfigError, DTYPE_NAMES)


def _check_speculative(spec) -> None:
    if spec is None:
        return
    rule = "{'method': 'mtp', 'num_speculative_tokens': k} or None"
    if not isinstance(spec, dict):
        raise ConfigTypeError(f"speculative_config must be {rule}; got {spec!r} ({type(spec).__name__})")
    if spec.get("method") != "mtp":
        raise ConfigError(f"speculative_config must be {rule}; got {spec!r}")
    unknown = sorted(map(str, set(spec) - {"method", "num_speculative_tokens"}))
    if unknown:
        raise ConfigError(f"unsupported speculative_config keys: {unknown}; only 'method' and "
                          "'num_speculative_tokens' are read")
    check_int(spec.get("num_speculative_tokens"), "speculative_config['num_speculative_tokens']", ConfigError, 1, 16)


def _check_hf_overrides(value) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigTypeError(f"hf_overrides must be a dict of config.json keys to values, or None; "
                              f"got {value!r} ({type(value).__name__})")
    from .checkpoint_checks import check_override_keys

    check_override_keys(value)


def validate_engine_config(config) -> None:
    """Every option's type and range; raises ConfigError / ConfigTypeError (NotImplementedError for
    supported-later options)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        annotation = str(f.type).replace(" ", "")
        if annotation == "bool":
            check_bool(value, _name(f.name), ConfigError)
        elif annotation in ("bool|None", "None|bool"):
            check_bool(value, _name(f.name), ConfigError, none_ok=True)
        elif f.name in INT_RANGES:
            lo, none_ok = INT_RANGES[f.name]
            hi = 2**63 - 1 if f.name == "seed" else None
            check_int(value, _name(f.name), ConfigError, lo, hi, none_ok=none_ok)
    if config.tensor_parallel_size != 1:
        raise NotImplementedError(
            f"tensor_parallel_size={config.tensor_parallel_size} is not supported yet; sparseserve runs on one GPU")
    _check_path(config.model, "model")
    _check_path(config.tokenizer, "tokenizer")
    _check_device(config.device)
    _check_dtype(config.dtype)
    check_float(config.gpu_memory_utilization, _name("gpu_memory_utilization"), ConfigError, 0.0, 1.0,
                lo_open=True)
    check_float(config.step_timeout_s, _name("step_timeout_s"), ConfigError, 0.0, lo_open=True)
    check_choice(config.load_format, _name("load_format"), ConfigError, LOAD_FORMATS)
    check_choice(config.topk_backend, _name("topk_backend"), ConfigError, TOPK_BACKENDS)
    check_choice(config.side_stream, _name("side_stream"), ConfigError, SIDE_STREAM_MODES)
    _check_speculative(config.speculative_config)
    _check_hf_overrides(config.hf_overrides)
    sizes = config.cuda_graph_sizes
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(is_int(s) for s in sizes):
            raise ConfigTypeError(f"cuda_graph_sizes must be a non-empty list of integers or None; "
                                  f"got {sizes!r}")
        for i, s in enumerate(sizes):
            check_int(s, f"cuda_graph_sizes[{i}]", ConfigError, 1, config.max_num_seqs,
                      hint=" (at most max_num_seqs)")


def check_model_limits(config, hf_config) -> int:
    """The engine's max_model_len (the model's positions when unset), checked against the model."""
    positions = int(hf_config.max_position_embeddings)
    if config.max_model_len is None:
        return positions
    if config.max_model_len > positions:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({positions}); lower max_model_len to at most {positions}")
    return int(config.max_model_len)


def check_memory(name: str, need_bytes: int, free_bytes: int | None, what_to_change: str) -> None:
    """Fail before allocating state that cannot fit (a clear error instead of an OOM kill)."""
    if free_bytes is not None and need_bytes > free_bytes:
        raise ConfigError(f"{name} needs {need_bytes / 1024**3:.2f} GiB, but {free_bytes / 1024**3:.2f} GiB is "
                          f"free; {what_to_change}")
