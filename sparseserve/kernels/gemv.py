"""Batch-1 decode projections: y = x @ W.T for one row of x, as a weight stream (Hopper).

At batch 1 every projection of a layer is a read of its weight: x-projections [4160, 4096],
q_b [40960, 1024], the grouped o_a [8 x 1024, 4096], o_b [4096, 8192], the shared expert
[4096, 4096] and [4096, 2048] (V4-Flash; 8-84 MB each). cuBLAS runs them at 2.5-3.8 TB/s
(an H200 profile: split-K plus a reduce kernel for most), against 4.3 TB/s for the LM head's
1 GB. Two things cost the small ones: each program walks K with one load round trip per step,
and nothing is read before the previous kernel has completed.

This kernel:
  * one program per BLOCK_N output columns walks K in BLOCK_K steps with the next tile's loads
    issued before the current tile's multiply-adds (register double buffering: two tiles in
    flight per program, several programs per SM), no split-K, no reduce kernel;
  * launches with PDL (kernels/pdl.py) and issues its first weight tile BEFORE waiting for the
    previous kernel: the weight is not written during a step, so only x must wait. That first
    round trip overlaps the previous kernel's end.
  * groups: the grouped o_a projection (G groups, each [N/G, K] on its own slice of x) is one
    launch: output column n reads x[(n // (N/G)) * K:][:K].

Roofline: bytes = 2 N K (the weight) + 2 (G K + N); FLOPs 2 N K (CUDA-core FMAs, far below their
rate). At 4.25 TB/s: q_b 19.7 us, o_b 15.8 us, CSA x-projections 8.0 us.

Rounding: fp32 accumulation in a different order than cuBLAS (whose split-K also sums in fp32),
one rounding to the output dtype; `gemv_ref` accumulates in fp32 (the CPU path and the oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import num_sms, use_triton
from .pdl import pdl_args, wait_for_prior_grid

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [1, G*K] @ weight [N, K].T per group (group g: rows g*N/G.. of weight, x[:, g*K:(g+1)*K])
    -> [1, N] in x's dtype, accumulated in fp32."""
    n, k = weight.shape
    xg = x.float().view(1, groups, k)
    wg = weight.float().view(groups, n // groups, k)
    return torch.einsum("tgk,gnk->tgn", xg, wg).reshape(1, n).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, group_n,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program: BLOCK_N output columns (within one group). The weight tile of step i+1 is
        loaded before step i's multiply-adds; its first tile before the PDL wait (the weight is
        read-only during a step; x, written by the previous kernel, only after the wait)."""
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        w_next = tl.load(w_rows, mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
        wait_for_prior_grid(PDL)
        x_row = x_ptr + ((pid * BLOCK_N) // group_n).to(tl.int64) * K
        # Products accumulate per lane and are reduced across the program once, at the end: a
        # reduction per step would put a barrier between each step's loads and the next.
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = w_next
            k_next = k0 + BLOCK_K + kk
            w_next = tl.load(w_rows + (k0 + BLOCK_K), mask=n_ok[:, None] & (k_next[None, :] < K), other=0.0)
            k = k0 + kk
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int, groups: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from static shapes. A tile of at most 8K elements (16 KB of
    bf16: 32 registers a thread at 4 warps, two of them in flight, and 64 of fp32 accumulator); BLOCK_N the widest power of two
    <= 64 (dividing a group's rows when grouped) that still gives about 4 programs per SM (the bytes
    in flight per SM that the HBM rate needs at ~1 us of load latency: ~40 KB). `gemv_bench --sweep`
    on the H200: this pick (4 x 512 at V4-Flash shapes) is the fastest or within 0.4 us of it for every
    projection."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 64
    while block_n > 4 and ((groups > 1 and (n // groups) % block_n) or triton.cdiv(n, block_n) < 4 * num_sms
                           or block_n * block_k > 8192):
        block_n //= 2
    return block_n, block_k, 4


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, groups: int = 1, config: tuple[int, int, int] | None = None
                ) -> torch.Tensor:
    """The kernel (on CUDA, or on CPU tensors under TRITON_INTERPRET=1). x [1, groups*K] with a
    contiguous row, weight [N, K] with contiguous rows and N divisible by groups; y [1, N]."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2:
        raise ValueError(f"gemv needs x [1, G*K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    n, k = weight.shape
    if groups < 1 or n % groups or x.shape[1] != groups * k:
        raise ValueError(f"gemv: x has {x.shape[1]} columns and weight is [{n}, {k}]: need {groups} groups of "
                         f"{k} columns and N divisible by {groups}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs a contiguous last dim in x and weight")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv needs x and weight of one dtype, got {x.dtype} and {weight.dtype}")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_n, block_k, warps = config or gemv_config(n, k, groups, num_sms(x.device))
    # Column n reads x's group (n // group_n); one group: every program reads x's start.
    group_n = n // groups if groups > 1 else triton.cdiv(n, block_n) * block_n
    if group_n % block_n:
        raise ValueError(f"gemv: BLOCK_N {block_n} must divide the group's {group_n} rows")
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, n, k, weight.stride(0), group_n, BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=warps, **pdl_args(x.device))
    return y


def _gemv_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, 16-bit, contiguous, no autograd, CUDA with the kernel enabled: static facts of the
    step's shape (a captured graph replays the path it was captured with, invariant 3)."""
    return (HAS_TRITON and x.dim() == 2 and x.shape[0] == 1 and use_triton("gemv", x) and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1 and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) of a bias-free layer; batch-1 rows through the kernel
    (SPARSESERVE_DISABLE_KERNELS=gemv: cuBLAS everywhere)."""
    if _gemv_here(x, weight):
        return gemv_triton(x, weight)
    return F.linear(x, weight)


def decode_grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The grouped projection of one row through the kernel ([1, G*K] -> [1, N]), or None where the
    caller's batched GEMM runs instead."""
    if _gemv_here(x, weight):
        return gemv_triton(x, weight, groups)
    return None
