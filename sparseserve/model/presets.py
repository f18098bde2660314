"""Model presets: a name -> a config folder in sparseserve/configs plus `hf_overrides`.

The reduced V4-Flash presets keep the published layer shapes with fewer layers or routed experts, so
one GPU holds them with dummy weights (`load_format="dummy"`):

- `v4-flash-2l16e`, `v4-flash-4l64e`: 2 or 4 layers, a bf16 checkpoint;
- `v4-flash-43l8e`, `v4-flash-43l16e`: all 43 layers in the release's pattern (`compress_ratios` of
  its config.json: 2 sliding-window layers, then CSA and HCA alternating, the last one CSA; the first
  3 layers hash-routed), 8 or 16 routed experts, a bf16 checkpoint (no `quantization_config`);
- `v4-flash-43l8e-fp8`, `v4-flash-43l16e-fp8`: the same with the release's checkpoint format (FP8
  e4m3 linears, one ue8m0 scale per 128 x 128 block, FP4 routed experts). The format describes the
  checkpoint; what the engine holds is reported by the fit check (`model/weight_bytes.py`).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

from ..errors import CheckpointError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_MODEL = "demo"

# The release's quantization_config (DeepSeek-V4-Flash / -Pro config.json).
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
BF16_CHECKPOINT = {"quantization_config": None, "expert_dtype": None}
RELEASE_CHECKPOINT = {"quantization_config": RELEASE_QUANTIZATION, "expert_dtype": "fp4"}

PRESETS: dict[str, tuple[str, dict]] = {
    "deepseek-v4-flash": ("deepseek-v4-flash", {}),
    "deepseek-v4-pro": ("deepseek-v4-pro", {}),
    "v4-flash-2l16e": ("deepseek-v4-flash", {"num_hidden_layers": 2, "n_routed_experts": 16,
                                             "layer_types": ["compressed_sparse_attention",
                                                             "heavily_compressed_attention"],
                                             "num_hash_layers": 1, **BF16_CHECKPOINT}),
    "v4-flash-4l64e": ("deepseek-v4-flash", {"num_hidden_layers": 4, "n_routed_experts": 64,
                                             "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                                             "heavily_compressed_attention",
                                                             "compressed_sparse_attention"],
                                             "num_hash_layers": 1, **BF16_CHECKPOINT}),
    # Every layer of V4-Flash: its config.json's layer pattern and hash layers are kept as they are.
    "v4-flash-43l8e": ("deepseek-v4-flash", {"n_routed_experts": 8, **BF16_CHECKPOINT}),
    "v4-flash-43l16e": ("deepseek-v4-flash", {"n_routed_experts": 16, **BF16_CHECKPOINT}),
    "v4-flash-43l8e-fp8": ("deepseek-v4-flash", {"n_routed_experts": 8, **RELEASE_CHECKPOINT}),
    "v4-flash-43l16e-fp8": ("deepseek-v4-flash", {"n_routed_experts": 16, **RELEASE_CHECKPOINT}),
}


def resolve_model_dir(model: str | os.PathLike | None) -> tuple[Path, dict]:
    """A directory, a preset name or None (the embedded default model) -> (dir, hf overrides)."""
    if model is None:
        model = DEFAULT_MODEL
    name = str(model)
    if name in PRESETS:
        base, overrides = PRESETS[name]
        return CONFIGS_DIR / base, copy.deepcopy(overrides)
    if (CONFIGS_DIR / name).is_dir() and not Path(name).is_dir():
        return CONFIGS_DIR / name, {}
    path = Path(name)
    if not path.is_dir():
        raise CheckpointError(
            f"model {name!r} is neither a directory nor a preset; presets: {', '.join(sorted(PRESETS))}, "
            f"or one of the folders in {CONFIGS_DIR}"
        )
    return path, {}
