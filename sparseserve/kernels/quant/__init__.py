"""Kernels that compute on FP8 (block-scaled e4m3) and FP4 (e2m1, per-32 scales) weights as the DeepSeek-V4
release stores them (docs/quantization.md): activation quantization, the block-scaled linear (tensor-core and
weight-streaming forms) and the routed-expert grouped GEMMs; `reference.py` is the CPU path and the oracle.

Engine interface: `QuantWeight(data, scale, fmt)` holds a weight; `quant_linear(x, w)` replaces
`F.linear(x, weight)` and `fused_moe_quant(x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit,
shared=...)` replaces `kernels.moe.fused_moe` (same arguments, QuantWeights for the two weights)."""
from __future__ import annotations

from .act_quant import act_quant
from .formats import QuantFormatError, QuantWeight
from .linear import quant_linear
from .moe_quant import fused_moe_quant
from .reference import dequant_weight

__all__ = ["QuantFormatError", "QuantWeight", "act_quant", "dequant_weight", "fused_moe_quant", "quant_linear"]
