"""Do the weights fit? Checked before anything is allocated, against the free memory given.

`check_weights_fit` raises `ModelTooLargeError` with the bytes per GPU as held, the free memory, and
the smallest tensor-parallel size (with and without expert parallelism) whose share would fit, on
GPUs with as much free memory as this one. The free memory is an argument: `available_memory_bytes`
reads it for a device.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelTooLargeError
from .weight_bytes import ParallelLayout, WeightBytes, WeightPlan, format_bytes, layout_problem

MAX_PARALLEL_SIZE = 64


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CUDA), or MemAvailable of the host (CPU); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def candidate_layouts(hf, max_size: int = MAX_PARALLEL_SIZE) -> list[ParallelLayout]:
    """Power-of-two layouts that split the model evenly, smallest first (TP before EP at a size)."""
    out, size = [], 1
    while size <= max_size:
        for ep in ((False,) if size == 1 else (False, True)):
            layout = ParallelLayout(size, ep)
            if layout_problem(hf, layout) is None:
                out.append(layout)
        size *= 2
    return out


def smallest_fitting(plan: WeightPlan, free_bytes: int, expert_parallel: bool) -> WeightBytes | None:
    """The weights at the smallest layout (of this expert-parallel choice) whose share fits `free_bytes`."""
    for layout in candidate_layouts(plan.hf_config):
        if layout.tensor_parallel_size > 1 and layout.enable_expert_parallel != expert_parallel:
            continue
        weights = plan.at(layout)
        if weights.per_gpu_bytes <= free_bytes:
            return weights
    return None


def fitting_layouts_hint(plan: WeightPlan, free_bytes: int) -> str:
    """The smallest tensor-parallel sizes, without and with expert parallelism, that fit `free_bytes`."""
    fits = [w for w in (smallest_fitting(plan, free_bytes, False), smallest_fitting(plan, free_bytes, True))
            if w is not None]
    if not fits:
        largest = plan.at(candidate_layouts(plan.hf_config)[-1])
        return (f"no even split fits: the largest, {largest.layout.describe()}, needs "
                f"{format_bytes(largest.per_gpu_bytes)} per GPU")
    if len(fits) == 2 and fits[0].layout.tensor_parallel_size == fits[1].layout.tensor_parallel_size \
            and fits[0].per_gpu_bytes == fits[1].per_gpu_bytes:
        fits = fits[:1]
        options = (f"tensor_parallel_size={fits[0].layout.tensor_parallel_size}, with or without "
                   f"enable_expert_parallel ({format_bytes(fits[0].per_gpu_bytes)} per GPU)")
    else:
        options = " or ".join(f"{w.layout.describe()} ({format_bytes(w.per_gpu_bytes)} per GPU)" for w in fits)
    return (f"the smallest layouts whose weights fit GPUs with {format_bytes(free_bytes)} free: {options}; the KV "
            "cache needs room beside them (set tensor_parallel_size, and enable_expert_parallel, to one of these)")


def check_weights_fit(plan: WeightPlan, layout: ParallelLayout, free_bytes: int | None, name: str,
                      where: str = "the device") -> WeightBytes:
    """The weights under `layout`, or ModelTooLargeError when their share exceeds `free_bytes` (None:
    unknown, not checked)."""
    weights = plan.at(layout)
    if free_bytes is None or weights.per_gpu_bytes <= free_bytes:
        return weights
    hint = fitting_layouts_hint(plan, free_bytes)
    raise ModelTooLargeError(
        f"model {name!r} needs {format_bytes(weights.per_gpu_bytes)} per GPU for its weights as held "
        f"({plan.held}; checkpoint {plan.checkpoint.describe()}, about {format_bytes(plan.checkpoint_bytes())}) "
        f"with {layout.describe()}, but {where} has {format_bytes(free_bytes)} free; {hint}; or use a smaller "
        "preset (sparseserve.model.presets.PRESETS) or hf_overrides with fewer layers or experts")
