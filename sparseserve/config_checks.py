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
from .kv_format import KV_CACHE_DTYPES
from .names import QUANTIZATION_MODES, SIDE_STREAM_MODES
from .validation import check_bool, check_choice, check_float, check_int, is_int

DTYPE_NAMES = ("auto", "float32", "float", "bfloat16", "float16", "half")
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
TOPK_BACKENDS = ("auto", "standard", "persistent", "torch")
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only")  # vLLM's CUDAGraphMode names, lower case

# (lower bound, allowed None) of integer options; bounds above come from the model or from memory.
INT_RANGES: dict[str, tuple[int, bool]] = {
    "seed": (0, False), "max_model_len": (2, True), "max_num_seqs": (1, False),
    "max_num_batched_tokens": (1, True), "kv_cache_memory_bytes": (1, True), "block_size": (1, True),
    "tensor_parallel_size": (1, False), "num_gpu_blocks_override": (1, True), "max_logprobs": (0, False),
    "nnodes": (1, False), "node_rank": (0, False), "master_port": (1, True),
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
    rule = "{'method': 'mtp', 'num_speculative_tokens': k[, 'adaptive': True | False | None]} or None"
    if not isinstance(spec, dict):
        raise ConfigTypeError(f"speculative_config must be {rule}; got {spec!r} ({type(spec).__name__})")
    if spec.get("method") != "mtp":
        raise ConfigError(f"speculative_config must be {rule}; got {spec!r}")
    unknown = sorted(map(str, set(spec) - {"method", "num_speculative_tokens", "adaptive"}))
    if unknown:
        raise ConfigError(f"unsupported speculative_config keys: {unknown}; only 'method', "
                          "'num_speculative_tokens' and 'adaptive' are read")
    check_int(spec.get("num_speculative_tokens"), "speculative_config['num_speculative_tokens']", ConfigError, 1, 16)
    check_bool(spec.get("adaptive"), "speculative_config['adaptive']", ConfigError, none_ok=True)


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
    _check_nodes(config)
    _check_path(config.model, "model")
    _check_path(config.tokenizer, "tokenizer")
    _check_device(config.device)
    _check_dtype(config.dtype)
    check_float(config.gpu_memory_utilization, _name("gpu_memory_utilization"), ConfigError, 0.0, 1.0,
                lo_open=True)
    check_float(config.step_timeout_s, _name("step_timeout_s"), ConfigError, 0.0, lo_open=True)
    check_choice(config.load_format, _name("load_format"), ConfigError, LOAD_FORMATS)
    check_choice(config.quantization, _name("quantization"), ConfigError, QUANTIZATION_MODES)
    if config.quantization != "none" and config.tensor_parallel_size > 1:
        raise ConfigError(f"quantization={config.quantization!r} runs on one GPU; with tensor_parallel_size="
                          f"{config.tensor_parallel_size} use quantization='none' (weights decoded at load)")
    check_choice(config.kv_cache_dtype, _name("kv_cache_dtype"), ConfigError, KV_CACHE_DTYPES)
    check_choice(config.topk_backend, _name("topk_backend"), ConfigError, TOPK_BACKENDS)
    check_choice(config.side_stream, _name("side_stream"), ConfigError, SIDE_STREAM_MODES)
    _check_speculative(config.speculative_config)
    if config.speculative_adaptive and config.tensor_parallel_size > 1:
        raise ConfigError(f"speculative_config['adaptive']=True runs on one GPU (its step costs are measured where "
                          f"the graphs are captured); with tensor_parallel_size={config.tensor_parallel_size} set "
                          "'adaptive' to False or leave it out")
    _check_hf_overrides(config.hf_overrides)
    sizes = config.cuda_graph_sizes
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(is_int(s) for s in sizes):
            raise ConfigTypeError(f"cuda_graph_sizes must be a non-empty list of integers or None; "
                                  f"got {sizes!r}")
        for i, s in enumerate(sizes):
            check_int(s, f"cuda_graph_sizes[{i}]", ConfigError, 1, config.max_num_seqs,
                      hint=" (at most max_num_seqs)")
    check_choice(config.cudagraph_mode, _name("cudagraph_mode"), ConfigError, CUDAGRAPH_MODES)
    sizes = config.prefill_cuda_graph_sizes
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(is_int(s) for s in sizes):
            raise ConfigTypeError(f"prefill_cuda_graph_sizes must be a non-empty list of token counts or None; "
                                  f"got {sizes!r}")
        limit = config.max_num_batched_tokens
        for i, s in enumerate(sizes):
            check_int(s, f"prefill_cuda_graph_sizes[{i}]", ConfigError, 1, limit,
                      hint=" (at most max_num_batched_tokens)" if limit is not None else "")


def _check_nodes(config) -> None:
    """The node options against the world size (the model-dependent checks come once it is known:
    `check_parallel_layout`)."""
    tp, nnodes = config.tensor_parallel_size, config.nnodes
    if config.node_rank >= nnodes:
        raise ConfigError(f"node_rank={config.node_rank} must be below nnodes={nnodes}; number the nodes "
                          f"0..{nnodes - 1}")
    if tp % nnodes:
        raise ConfigError(f"tensor_parallel_size={tp} must be a multiple of nnodes={nnodes} (the same number of "
                          "ranks on every node); change one of them")
    if config.master_port is not None and config.master_port > 65535:
        raise ConfigError(f"master_port={config.master_port} is not a TCP port; give 1..65535")
    if config.master_addr is not None and (not isinstance(config.master_addr, str) or not config.master_addr):
        raise ConfigTypeError(f"master_addr must be a host name or address (str) or None; got {config.master_addr!r}")
    if nnodes > 1 and config.master_addr is None:
        raise ConfigError(f"nnodes={nnodes} needs master_addr (the address of node 0, reachable from every node)")
    if nnodes > 1 and config.master_port is None:
        raise ConfigError(f"nnodes={nnodes} needs master_port (a free TCP port on node 0, the same on every node)")


def check_parallel_layout(config, hf_config, device: torch.device, visible_gpus: int | None = None) -> None:
    """The parallel layout against the model and the machine, before any worker starts
    (docs/parallelism.md): the ranks must split the heads, the output groups, the expert
    intermediate size and (expert parallel) the experts evenly; a node must see a GPU per rank."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return  # one rank holds every head and expert (enable_expert_parallel changes nothing)
    heads, groups = int(hf_config.num_attention_heads), int(hf_config.o_groups)
    inter, experts = int(hf_config.moe_intermediate_size), int(hf_config.n_routed_experts)
    if heads % tp:
        raise ConfigError(f"tensor_parallel_size={tp} must divide the model's num_attention_heads ({heads}); "
                          f"use a divisor of {heads}")
    if groups % tp and tp % groups:
        raise ConfigError(f"tensor_parallel_size={tp} and the model's o_groups ({groups}) must divide one another "
                          "(each rank holds whole output groups, or an equal share of one)")
    if inter % tp:
        raise ConfigError(f"tensor_parallel_size={tp} must divide the model's moe_intermediate_size ({inter}): the "
                          "shared expert (and, without expert parallelism, every routed expert) is split across ranks")
    if config.enable_expert_parallel and experts % tp:
        raise ConfigError(f"enable_expert_parallel=True with tensor_parallel_size={tp} needs the model's "
                          f"n_routed_experts ({experts}) divisible by {tp}; use a divisor of {experts} or "
                          "enable_expert_parallel=False")
    per_node = tp // config.nnodes
    if device.type == "cuda" and visible_gpus is not None and per_node > visible_gpus:
        raise ConfigError(f"tensor_parallel_size={tp} over nnodes={config.nnodes} puts {per_node} ranks on this "
                          f"node, but it sees {visible_gpus} GPU(s); lower tensor_parallel_size, raise nnodes, "
                          "or make more GPUs visible (CUDA_VISIBLE_DEVICES)")


def layout_fingerprint(config) -> dict:
    """The options every node must agree on (compared across ranks at start-up)."""
    keys = ("model", "dtype", "tensor_parallel_size", "enable_expert_parallel", "nnodes", "max_model_len",
            "max_num_seqs", "max_num_batched_tokens", "block_size", "load_format", "hf_overrides",
            "speculative_config", "seed", "enforce_eager", "num_gpu_blocks_override", "kv_cache_memory_bytes",
            "kv_cache_dtype", "cudagraph_mode", "prefill_cuda_graph_sizes")  # graphs hold collectives: same on every rank
    return {k: repr(getattr(config, k)) for k in keys}


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
