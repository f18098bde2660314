"""The model and its MTP layer on the meta device: every tensor's name, shape and dtype, no memory.

`weight_plan` is what the engine and `sparseserve kv-plan` size the weights from before anything is
allocated (`model/weight_bytes.py`, `model/fit_check.py`).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .deepseek_v4 import DeepseekV4ForCausalLM
from .mtp import MTPModule
from .weight_bytes import WeightPlan


def weight_plan(model_config: ModelConfig, dtype: torch.dtype, include_mtp: bool = False,
                quantization: str = "none") -> WeightPlan:
    """The weights as the loader holds them in `dtype` under `quantization`; with the MTP layer (`mtp.`
    names) when asked."""
    with torch.device("meta"):
        modules = [("", DeepseekV4ForCausalLM(model_config))]
        if include_mtp:
            modules.append(("mtp.", MTPModule(model_config)))
    return WeightPlan.of(modules, model_config, dtype, quantization)
