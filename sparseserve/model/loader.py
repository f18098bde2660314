"""Load a DeepSeek-V4 checkpoint directory (Hugging Face layout) or make dummy weights.

- config.json goes through `transformers.DeepseekV4Config` (legacy keys such as
  `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim` are folded in there); its
  `quantization_config` and `expert_dtype` are checked and kept (`ModelConfig.weight_format`);
- weights come from `model.safetensors` or a sharded `model.safetensors.index.json`, in the
  release's layout (FP8/FP4 decoded at load), as `transformers` saves them, or under the engine's
  own module names (`weight_loader`, `checkpoint_names`; docs/checkpoints.md);
- `mtp.*` tensors are returned separately for speculative decoding (not an error);
- `load_format="dummy"` fills every tensor with random values of the right shape;
- one rank of a parallel layout (`shard`) loads only its share, part by part (`streamed_load`).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from transformers import DeepseekV4Config

from ..config import ModelConfig
from ..errors import CheckpointError
from ..checkpoint_checks import check_hf_config, check_override_keys, check_raw_config, check_weight_format
from .deepseek_v4 import DeepseekV4ForCausalLM
from .dummy_weights import init_dummy_weights  # noqa: F401 (re-exported)
from .fit_check import available_memory_bytes, check_weights_fit
from .layers.fused_linear import pack_projections
from .quantize import describe_quantized, quantize_model
from .streamed_load import PartSharder, stream_load
from .presets import CONFIGS_DIR, DEFAULT_MODEL, PRESETS, resolve_model_dir  # noqa: F401 (re-exported)
from .weight_bytes import KEEP_FP32, ParallelLayout, WeightPlan, held_dtype  # noqa: F401 (KEEP_FP32 re-exported)
from .weight_loader import apply_weights, checkpoint_files, load_checkpoint, read_tensors  # noqa: F401 (re-exported)

__all__ = ["CheckpointError", "load_model", "resolve_model_dir", "load_hf_config"]

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: Path, hf_overrides: dict | None = None) -> DeepseekV4Config:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    check_raw_config(raw, str(config_path))
    if raw.get("model_type") not in (None, "deepseek_v4"):
        raise CheckpointError(f"{config_path}: model_type is {raw.get('model_type')!r}, expected 'deepseek_v4'")
    overrides = dict(hf_overrides or {})
    check_override_keys(overrides)
    if "layer_types" in overrides or "num_hidden_layers" in overrides:
        raw.pop("compress_ratios", None)
    if "layer_types" in overrides:
        raw.pop("layer_types", None)
    raw.update(overrides)
    for key in ("architectures", "transformers_version", "torch_dtype"):
        raw.pop(key, None)
    where = f"{config_path}" + (f" with hf_overrides {overrides}" if overrides else "")
    check_weight_format(raw, where)  # kept on the config: ModelConfig.weight_format reads it
    try:
        hf = DeepseekV4Config(**raw)
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise their own types
        message = " ".join(str(exc).split())
        raise CheckpointError(f"{where}: invalid DeepSeek-V4 config: {message}") from exc
    check_hf_config(hf, where)
    return hf


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    hf_overrides: dict | None = None,
    seed: int = 0,
    quantization: str = "none",
    progress: bool = True,
    shard: PartSharder | None = None,
) -> tuple[DeepseekV4ForCausalLM, ModelConfig, dict[str, torch.Tensor]]:
    """The model on `device`, its config and the checkpoint's `mtp.*` tensors. With `shard` (one
    rank of a parallel layout, `model/sharding.py`'s `RankSharder`): only this rank's share, loaded
    part by part (`model/streamed_load.py`), the fit checked against that share."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    if shard is not None and quantization != "none":
        raise ValueError(f"quantization={quantization!r} runs on one GPU; a parallel load takes quantization='none'")
    model_dir, preset_overrides = resolve_model_dir(model)
    overrides = {**preset_overrides, **(hf_overrides or {})}
    hf_config = load_hf_config(model_dir, overrides)
    model_config = ModelConfig(hf_config, dtype=dtype, path=str(model_dir))
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(model_config)
    layout = shard.layout if shard is not None else ParallelLayout()
    check_weights_fit(WeightPlan.of([("", net)], model_config, dtype, quantization), layout,
                      available_memory_bytes(device), str(model), str(device))
    for name, p in net.named_parameters():  # on meta: to_empty then allocates the held dtypes directly
        p.data = p.data.to(held_dtype(name, dtype))
    fresh = DeepseekV4ForCausalLM.rope_buffers(model_config)  # non-persistent: recomputed, never loaded
    if shard is not None:
        mtp = stream_load(net, device, shard, load_format, model_dir, model_config.weight_format, seed,
                          hf_config.n_routed_experts, progress)
        for name, value in fresh.items():
            setattr(net, name, value.to(device))
        shard.finish(net)
        pack_projections(net)
        return net.eval(), model_config, mtp
    net = net.to_empty(device="cpu" if load_format != "dummy" else device)
    for name, value in fresh.items():
        getattr(net, name).copy_(value)
    mtp: dict[str, torch.Tensor] = {}
    if load_format == "dummy":
        init_dummy_weights(net, seed, progress=progress)
    else:
        mtp = load_checkpoint(net, model_dir, model_config.weight_format, progress)
    net = net.to(device)
    if quantization != "none":  # before packing: quantized groups pack their codes and scales
        logger.info("%s", describe_quantized(quantization, quantize_model(net, quantization,
                                                                          model_config.weight_format)))
    pack_projections(net)  # last: one GEMM per shared input (a later cast or move would undo it)
    return net.eval(), model_config, mtp
