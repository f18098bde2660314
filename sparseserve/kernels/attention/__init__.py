"""The attention primitive of V4: per-token gathered-row MQA with a per-head sink.

`reference.py` (plain PyTorch: the CPU path and the test oracle), `triton_kernel.py` (the portable Triton kernel,
the band pre-pass, the split merge and the launcher), `hopper.py` and `hopper_split.py` (the Gluon kernels of the
64-head shapes on sm_90, unsplit and split calls, sharing `hopper_common.py`; `hopper_fp8.py`, the role-split
kernel's FP8-row form), `select.py` (which of them runs a call: the selection table). `sparse_mqa_attention` is what
the model calls.
"""
from __future__ import annotations

import torch

from ...kv_format import KVFormat
from ..dispatch import use_triton
from ..rope import apply_rope
from .reference import sparse_mqa_attention_ref
from .select import AttnConfig, attention_config
from .triton_kernel import engine_attention_config, sparse_mqa_attention_triton

__all__ = ["AttnConfig", "attention_config", "engine_attention_config", "sparse_mqa_attention",
           "sparse_mqa_attention_ref", "sparse_mqa_attention_triton"]


def sparse_mqa_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor, scale: float,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None, kv_format: KVFormat | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], kv_pool [N, D], rows [T, L] int32 (-1: unused), sinks [H] fp32 -> [T, H, D] in q's dtype.
    The kernels on CUDA (bf16/fp16), the reference elsewhere. inverse_rope (cos, sin): then the output's rope
    channels are rotated back (V4 attention output). kv_format: kv_pool holds packed FP8 rows (kv_format.py),
    read by the portable Triton kernel (the role-split Hopper kernel's FP8 form runs only under an explicit config,
`select.fp8_hopper_attention_config`). `out` (contiguous [T, H, D]
    in q's dtype): written and returned instead of a new tensor (a prefill graph's static buffer)."""
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
        raise ValueError(f"attention out must be a contiguous {tuple(q.shape)} {q.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    if (use_triton("attention", q) and q.dtype in (torch.bfloat16, torch.float16)
            and (kv_format is not None or kv_pool.dtype == q.dtype)):
        return sparse_mqa_attention_triton(q, kv_pool, rows, sinks, scale, inverse_rope=inverse_rope,
                                           kv_format=kv_format, out=out)
    result = sparse_mqa_attention_ref(q, kv_pool, rows, sinks, scale, kv_format=kv_format)
    if inverse_rope is not None:
        result = apply_rope(result, *inverse_rope, inverse=True)
    return result if out is None else out.copy_(result)
