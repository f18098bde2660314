"""Which kernels run as Triton: all of them on CUDA, none on the CPU. For diagnosis,
SPARSESERVE_DISABLE_KERNELS=name[,name...] (or `all`) sends the named ones to their
plain-PyTorch references on CUDA too: attention (`attention_wgmma` only turns off the Hopper Gluon kernel, so the
64-head shapes take the Triton kernel again), indexer, compressor, rows, mhc, mhc_fused, rmsnorm,
rope, argmax, embed, norm_rope, router, gemv; `overlap` runs the whole step on one stream (see model/side_stream.py),
`lm_head_fp32` rounds the logits to the model dtype before converting them (as the oracle does), and `pdl` launches
every kernel without programmatic dependent launch (see kernels/pdl.py)."""
from __future__ import annotations

import os
from functools import lru_cache

import torch

_DISABLED = {n.strip() for n in os.environ.get("SPARSESERVE_DISABLE_KERNELS", "").split(",") if n.strip()}


def use_triton(name: str, tensor: torch.Tensor) -> bool:
    return enabled_on(name, tensor.device)


def enabled_on(name: str, device: torch.device) -> bool:
    return device.type == "cuda" and name not in _DISABLED and "all" not in _DISABLED


def num_sms(device: torch.device, cpu_default: int = 132) -> int:
    """The device's multiprocessor count (cached: launch configs ask on every call); `cpu_default` for CPU
    tensors under the interpreter."""
    if device.type != "cuda":
        return cpu_default
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (cached)."""
    props = _properties(_index(device))
    return props.major, props.minor


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def env_count(name: str, default: int) -> int:
    """A positive whole-number tuning knob from the environment (for measuring other settings in a
    whole step), or `default` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {raw!r}; unset it for the default {default}")
    return int(raw)
