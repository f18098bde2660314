"""The MoE router for small steps: logits and expert selection in two launches, without cuBLAS.

At batch 1 the router GEMM ([T, D] x [D, E]: 128 KB of weights for 16 experts, 2 MB for 256) is a
cuBLAS split-K kernel plus its reduce, then the selection kernel. The GEMM runs beside the shared
expert's GEMMs (on the side stream), which hold every SM, and waits for SMs: in a batch-1 profile on
the H200 it took about four times as long as alone, and its reduce and the selection came on top.

Here launch 1 (`_router_partials_kernel`) has one small program per (K slice, expert block): each
reads ~16 KB of weights into registers and uses almost no shared memory, so it fits on an SM beside
a GEMM's programs, and writes fp32 partial logits [P, T, E]. Launch 2 is the selection kernel (kernels/moe.py), which
sums the partials in part order (deterministic: eager and graphs give the same bits), rounds them
to the logits dtype as the GEMM's output is rounded, and selects as before.

Roofline: E * D * 2 bytes of weights + T * D * 2 of activations + 2 * P * T * E * 4 of partials;
FLOPs 2 * T * D * E (fp32 FMA, a token at a time). Latency-bound at these sizes.

Used for steps of at most `ROUTER_MAX_TOKENS` tokens with bf16/fp16 weights on CUDA (larger steps
fill the GPU and keep the GEMM); elsewhere, and with SPARSESERVE_DISABLE_KERNELS=router, F.linear then
`select_experts` (on the CPU its reference, `select_experts_ref`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import use_triton
from .moe_select import _SCORING_IDS, launch_select_experts, select_experts
from .pdl import pdl_args, wait_for_prior_grid

ROUTER_MAX_TOKENS = 16
WEIGHT_BYTES_PER_PROGRAM = 16384


@triton.jit(do_not_specialize=["num_tokens"])
def _router_partials_kernel(x_ptr, w_ptr, part_ptr, num_tokens, num_experts, dim, stride_x, stride_w,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (K slice, expert block): part[slice, t, e] = sum over the slice of x[t, k] * w[e, k],
    for every token in turn. The weight tile stays in registers and the products are fp32 (exact
    for bf16/fp16 inputs): the GEMM's arithmetic in another order. No tl.dot, so the program needs
    almost no shared memory and fits on an SM beside a GEMM's programs. The weight tile is read
    before the PDL wait (nothing in a step writes it): that round trip overlaps the previous kernel."""
    pid_k = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = k < dim
    emask = e < num_experts
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_w + k[None, :], mask=emask[:, None] & kmask[None, :],
                other=0.0).to(tl.float32)
    wait_for_prior_grid(PDL)
    for t in range(num_tokens):
        x = tl.load(x_ptr + t * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
        acc = tl.sum(w * x[None, :], axis=1)
        tl.store(part_ptr + (pid_k * num_tokens + t) * num_experts + e, acc, mask=emask)


def router_plan(num_experts: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_K, parts): expert blocks of up to 64, K slices of ~16 KB of weights each."""
    block_e = max(16, min(64, triton.next_power_of_2(num_experts)))
    block_k = max(64, min(triton.next_power_of_2(dim), WEIGHT_BYTES_PER_PROGRAM // (2 * block_e)))
    return block_e, block_k, triton.cdiv(dim, block_k)


def router_select_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, scoring_func: str,
                         routed_scaling_factor: float, correction_bias: torch.Tensor | None = None,
                         hash_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(F.linear(x, weight), ...)` in two launches; x [T <= 16, D], weight [E, D].
    With token_ids [T], hash_ids is the whole table tid2eid [V, k], read inside the selection."""
    num_tokens, dim = x.shape
    num_experts = weight.shape[0]
    weights = torch.empty(num_tokens, top_k if hash_ids is None else hash_ids.shape[1], dtype=torch.float32,
                          device=x.device)
    ids = torch.empty(weights.shape, dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    block_e, block_k, parts = router_plan(num_experts, dim)
    partials = torch.empty(parts, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    _router_partials_kernel[(parts, triton.cdiv(num_experts, block_e))](
        x, weight, partials, num_tokens, num_experts, dim, x.stride(0), weight.stride(0),
        BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4, **pdl_args(x.device))
    launch_select_experts(partials, 0, x.dtype, num_experts, weights, ids, top_k, scoring_func, routed_scaling_factor,
                          correction_bias, hash_ids, token_ids, num_parts=parts)
    return weights, ids


def router_select(x: torch.Tensor, weight: torch.Tensor, top_k: int, scoring_func: str,
                  routed_scaling_factor: float, correction_bias: torch.Tensor | None = None,
                  hash_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits and the selection: (weights fp32 [T, k], ids int64 [T, k]). hash_ids:
    the experts per token [T, k], or with token_ids [T] the whole table tid2eid [V, k]. The two
    launches above for small bf16/fp16 steps on CUDA (a static fact of the step's shape), else the
    GEMM and `select_experts` (which has its own Triton kernel on CUDA)."""
    if (use_triton("router", x) and x.shape[0] <= ROUTER_MAX_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and scoring_func in _SCORING_IDS
            and (hash_ids is not None or top_k <= weight.shape[0])):
        return router_select_triton(x, weight, top_k, scoring_func, routed_scaling_factor, correction_bias, hash_ids,
                                    token_ids)
    if hash_ids is not None and token_ids is not None:
        hash_ids = hash_ids[token_ids]
    return select_experts(F.linear(x, weight), top_k, scoring_func, routed_scaling_factor, correction_bias,
                          hash_ids)
