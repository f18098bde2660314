"""Load a DeepSeek-V4 checkpoint directory (Hugging Face layout) or make dummy weights.

- config.json goes through `transformers.DeepseekV4Config` (legacy keys such as
  `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim` are folded in there); its
  `quantization_config` and `expert_dtype` are checked and kept (`ModelConfig.weight_format`);
- weights come from `model.safetensors` or a sharded `model.safetensors.index.json`, in the
  release's layout (FP8/FP4 decoded at load), as `transformers` saves them, or under the engine's
  own module names (`weight_loader`, `checkpoint_names`; docs/checkpoints.md);
- `mtp.*` tensors are returned separately for speculative decoding (not an error);
- `load_format="dummy"` fills every tensor with random values of the right shape.
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
from ..logger import progress_bar
from ..checkpoint_checks import check_hf_config, check_override_keys, check_raw_config, check_weight_format
from .deepseek_v4 import DeepseekV4ForCausalLM
from .fit_check import available_memory_bytes, check_weights_fit
from .layers.fused_linear import pack_projections
from .quantize import describe_quantized, quantize_model
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


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, hf_config=None, progress: bool = True) -> None:
    """Random weights of the right shapes (for benchmarks at real shapes; never zeros).
    Drawn on the parameters' device, so billions of values take seconds on a GPU."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    hf = hf_config if hf_config is not None else model.model_config.hf_config
    params = list(model.named_parameters())
    for name, p in progress_bar(params, enabled=progress, desc="Initializing dummy weights", unit="tensor"):
        if "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 0.1)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            # Distinct experts per token: a random start walking modulo the expert count.
            first = torch.randint(0, hf.n_routed_experts, (b.shape[0], 1), generator=gen, device=device)
            b.copy_((first + torch.arange(b.shape[1], device=device)) % hf.n_routed_experts)
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen, device=device) * 0.01)


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    hf_overrides: dict | None = None,
    seed: int = 0,
    quantization: str = "none",
    progress: bool = True,
) -> tuple[DeepseekV4ForCausalLM, ModelConfig, dict[str, torch.Tensor]]:
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    model_dir, preset_overrides = resolve_model_dir(model)
    overrides = {**preset_overrides, **(hf_overrides or {})}
    hf_config = load_hf_config(model_dir, overrides)
    model_config = ModelConfig(hf_config, dtype=dtype, path=str(model_dir))
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(model_config)
    check_weights_fit(WeightPlan.of([("", net)], model_config, dtype, quantization), ParallelLayout(),
                      available_memory_bytes(device), str(model), str(device))
    for name, p in net.named_parameters():  # on meta: to_empty then allocates the held dtypes directly
        p.data = p.data.to(held_dtype(name, dtype))
    net = net.to_empty(device="cpu" if load_format != "dummy" else device)
    # Non-persistent buffers (rope tables) are recomputed after to_empty.
    fresh = DeepseekV4ForCausalLM.rope_buffers(model_config)
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
