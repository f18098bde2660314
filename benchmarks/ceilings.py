"""Hardware ceilings measured in the benchmark's own process (CUDA)."""
from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


def hbm_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) over a 1 GiB bf16 buffer."""
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)


# A read ceiling: torch's row sum carried ~5.5 us of fixed cost per call on the H200 (1 MB in 5.7 us, 8 MB in
# 6.7 us), which hides what HBM delivers to a small read.

READ_BLOCK = 8192  # bf16 elements (16 KB) per program


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[p] = the fp32 sum of x[p * BLOCK : (p + 1) * BLOCK] (masked past n): every byte of x is read once and
    1/4096 as many bytes are written."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), 0))


def read_sum_ref(x: torch.Tensor, block: int = READ_BLOCK) -> torch.Tensor:
    """The reference of `read_sum`: block sums of a flat tensor in fp32."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block).sum(1)


def read_sum(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block sums of a contiguous tensor (`read_sum_ref`) by `_read_sum_kernel`: a read of all of x."""
    if not x.is_contiguous():
        raise ValueError("read_sum reads a contiguous tensor; pass x.contiguous()")
    n = x.numel()
    blocks = triton.cdiv(n, READ_BLOCK)
    if out is None:
        out = torch.empty(blocks, dtype=torch.float32, device=x.device)
    elif out.numel() < blocks or out.dtype != torch.float32:
        raise ValueError(f"read_sum needs an fp32 out of >= {blocks} elements, got {out.dtype} {tuple(out.shape)}")
    _read_sum_kernel[(blocks,)](x, out, n, BLOCK=READ_BLOCK, num_warps=8)
    return out
