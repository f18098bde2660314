"""Which kernels run as Triton: all of them on CUDA, none on the CPU. For diagnosis,
SPARSESERVE_DISABLE_KERNELS=name[,name...] (or `all`) sends the named ones to their
plain-PyTorch references on CUDA too: attention (`attention_hopper` only turns off the Hopper Gluon kernels, so the
64-head shapes take the portable Triton kernel), indexer, compressor, rows, mhc, mhc_fused, rmsnorm,
rope, argmax, embed, norm_rope, router, gemv, quant (the FP8/FP4 kernels); `overlap` runs the whole step on one stream (see model/side_stream.py),
`lm_head_fp32` rounds the logits to the model dtype before converting them (as the oracle does), and `pdl` launches
every kernel without programmatic dependent launch (see kernels/pdl.py), and `moe` sends the expert selection
and the grouped expert GEMMs to their references."""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import envs

_DISABLED = envs.disabled_kernels()


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

