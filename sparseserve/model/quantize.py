"""Quantized execution (`EngineConfig.quantization`): which weights are held quantized, and the
conversion of a loaded model's weights into the kernels' `QuantWeight`s (kernels/quant).

* ``"none"``: nothing; every weight in the compute dtype (the loader decodes FP8/FP4 files).
* ``"auto"``: what the checkpoint stores quantized stays quantized: its FP8 linears (block-FP8,
  ue8m0 scales per 128 x 128) and its FP4 or FP8 routed experts.
* ``"fp8"``: the linears the release stores in FP8 and the routed experts, as block-FP8, whatever
  the checkpoint holds (vLLM's dynamic FP8: scales from each block's amax at load).

The loader decodes into the compute dtype, then `quantize_model` re-encodes with power-of-two
scales: for a release checkpoint with ue8m0 scales the decoded values are exact in bf16/fp32 and
re-encoding gives back the same values (a block's scale may come out a power of two smaller, its
codes a power of two larger). A quantized linear keeps an empty `weight` Parameter and its
`QuantWeight` as `linear.qweight`; the routed experts keep theirs as `experts.q_gate_up` and
`experts.q_down`. The grouped `o_a_proj` (a batched GEMM over output groups) stays in the compute
dtype, and quantized execution runs on one GPU (`tensor_parallel_size=1`).

FP4 experts: whether each tensor is exact in the kernels' one-dot form (`QuantWeight.fp4_one_dot_exact`,
a pass over its codes and scales with one host sync) is decided here, once, so that no step (and no
graph capture) computes it; a tensor that is not runs the four-dot form (docs/quantization.md).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..config import WeightFormat
from ..kernels.quant.reference import quantize_fp4, quantize_fp8_block
from .weight_bytes import format_bytes, held_quant

logger = logging.getLogger(__name__)


def _empty_like(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str, fmt: WeightFormat, prefix: str = ""
                   ) -> dict[str, tuple[str, int]]:
    """Replace the weights `held_quant` names by QuantWeights (call after loading, before packing);
    returns {parameter name: (format, bytes held)} of what was converted."""
    done: dict[str, tuple[str, int]] = {}
    if quantization == "none":
        return done
    for mod_name, module in model.named_modules():
        base = prefix + (mod_name + "." if mod_name else "")
        if isinstance(module, nn.Linear) and module.bias is None and module.weight.dim() == 2:
            name = base + "weight"
            if held_quant(name, quantization, fmt, tuple(module.weight.shape)) == "fp8":
                module.qweight = quantize_fp8_block(module.weight)
                module.weight = _empty_like(module.weight)
                done[name] = ("fp8", module.qweight.nbytes)
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and isinstance(
                getattr(module, "gate_up_proj"), nn.Parameter):
            kind = held_quant(base + "gate_up_proj", quantization, fmt, tuple(module.gate_up_proj.shape))
            if kind is None:
                continue
            gu, dn = module.gate_up_proj, module.down_proj
            if kind == "fp4":
                module.q_gate_up, module.q_down = quantize_fp4(gu), quantize_fp4(dn)
                for part, w in (("gate_up_proj", module.q_gate_up), ("down_proj", module.q_down)):
                    if not w.fp4_one_dot_exact:  # read once here: the kernels' form for this tensor
                        logger.info("%s%s: a 128-column group's FP4 scales span more than 14 binades; its experts "
                                    "run the four-dot form", base, part)
            else:
                module.q_gate_up, module.q_down = quantize_fp8_block(gu), quantize_fp8_block(dn)  # I % 128 == 0
            module.gate_up_proj, module.down_proj = _empty_like(gu), _empty_like(dn)
            done[base + "gate_up_proj"] = (kind, module.q_gate_up.nbytes)
            done[base + "down_proj"] = (kind, module.q_down.nbytes)
    return done


def describe_quantized(quantization: str, done: dict[str, tuple[str, int]]) -> str:
    """The start-up line: how many tensors are held in which format, and their bytes."""
    if not done:
        return f"quantization={quantization!r}: every weight in the compute dtype"
    counts: dict[str, list[int]] = {}
    for kind, nbytes in done.values():
        entry = counts.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    names = {"fp8": "fp8 e4m3 + ue8m0 scale per 128x128", "fp4": "fp4 e2m1 + ue8m0 scale per 32"}
    parts = [f"{n} tensors in {names[k]} ({format_bytes(b)})" for k, (n, b) in sorted(counts.items())]
    return f"quantization={quantization!r}: held quantized: " + ", ".join(parts) + "; the rest in the compute dtype"
