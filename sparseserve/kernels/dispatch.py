"""Which kernels run as Triton: all of them on CUDA, none on the CPU. For diagnosis,
SPARSESERVE_DISABLE_KERNELS=name[,name...] (or `all`) sends the named ones to their
plain-PyTorch references on CUDA too: attention, indexer, compressor, rows, mhc, rmsnorm, rope,
argmax."""
from __future__ import annotations

import os

import torch

_DISABLED = {n.strip() for n in os.environ.get("SPARSESERVE_DISABLE_KERNELS", "").split(",") if n.strip()}


def use_triton(name: str, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and name not in _DISABLED and "all" not in _DISABLED
