"""The routed experts of a one-token step as two weight streams (decode at batch 1, Hopper).

With one token the k selected experts are k distinct weight reads: gate_up [2I, D] and down
[D, I] per expert (V4-Flash: 33.5 + 16.8 MB each, 302 MB for top-6). The grouped path
(kernels/moe.py) aligns the assignments (one single-program launch), runs 16-row tensor-core
tiles of which 15 rows are padding, and combines the k rows in a fourth launch; its 192 programs
of 0.5-1 MB each also fill the H200's 132 SMs unevenly (batch-1 profile, session 16: gate_up
55.4 us = 3.63 TB/s, down 26.6 us, plus 3.0 us of alignment and 1.8 us of combine per layer).

Here, two launches, weight-stream programs as in kernels/gemv.py (BLOCK_N rows, the next
BLOCK_K tile in flight, per-lane fp32 products reduced once at the end):
  a. `_moe_gemv_gate_up_kernel`, program (BLOCK_N intermediate columns, slot j): reads the
     expert id of slot j, streams its gate and up rows, and writes act[j] = the clamped SwiGLU
     of the fp32 sums, rounded once to the activations' dtype (as `_moe_gate_up_kernel`).
  b. `_moe_gemv_down_kernel`, program (BLOCK_N output columns): streams the down rows of all k
     experts in turn (the first tile of the next slot in flight during the last of this one),
     weights each slot's sum, rounds it to the dtype (as `_moe_down_kernel`), and sums the k
     slots and the shared expert's row in fp32, rounded once (as `_moe_combine_kernel`).
No alignment and no combine launch; same rounding points as the grouped path, other fp32
summation order.

Roofline at T=1: bytes = k * 3 * I * D * 2 (the experts' weights) + activations; FLOPs
2 * k * 3 * I * D (CUDA-core FMAs, far below their rate). V4-Flash top-6: 302 MB, 71 us at 4.25 TB/s.
The reference `moe_gemv_ref` (the CPU path and the test oracle) rounds at the same points.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton
from .pdl import pdl_args, wait_for_prior_grid

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

BLOCK_N = 4  # rows per program: the best tile of gemv_bench --sweep on the H200 (session 16)
BLOCK_K = 512


def moe_gemv_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, swiglu_limit: float, shared: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, D], w_gate_up [E, 2I, D], w_down [E, D, I], topk_weights [1, k] fp32, topk_ids [1, k],
    shared [1, D] or None -> [1, D] in x's dtype, rounded where the kernels round."""
    inter = w_down.shape[2]
    ids = topk_ids.reshape(-1).long()
    gu = torch.einsum("d,knd->kn", x[0].float(), w_gate_up[ids].float())  # [k, 2I]
    gate = gu[:, :inter].clamp(max=swiglu_limit)
    up = gu[:, inter:].clamp(min=-swiglu_limit, max=swiglu_limit)
    act = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    y = torch.einsum("ki,kdi->kd", act.float(), w_down[ids].float()) * topk_weights.reshape(-1, 1).float()
    out = y.to(x.dtype).float().sum(dim=0, keepdim=True)
    if shared is not None:
        out = out + shared.float()
    return out.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, K, inter, stride_we, stride_wn, limit,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (BLOCK_N columns of act, slot): act[slot, n] = swiglu(gate[n], up[n]) of the slot's expert."""
        wait_for_prior_grid(PDL)
        slot = tl.program_id(1)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        g_rows = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        u_rows = g_rows + inter * stride_wn
        first = (kk < K)[None, :]
        g_next = tl.load(g_rows, mask=first, other=0.0)
        u_next = tl.load(u_rows, mask=first, other=0.0)
        # Per-lane products, reduced once at the end (no barrier between one step's loads and the next).
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g = g_next
            u = u_next
            ahead = (k0 + BLOCK_K + kk < K)[None, :]
            g_next = tl.load(g_rows + (k0 + BLOCK_K), mask=ahead, other=0.0)
            u_next = tl.load(u_rows + (k0 + BLOCK_K), mask=ahead, other=0.0)
            k = k0 + kk
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            acc_g += g.to(tl.float32) * x
            acc_u += u.to(tl.float32) * x
        gate = tl.minimum(tl.sum(acc_g, axis=1), limit)
        up = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1), -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + slot * inter + n, act.to(act_ptr.dtype.element_ty))

    @triton.jit
    def _moe_gemv_down_kernel(act_ptr, w_ptr, ids_ptr, route_w_ptr, shared_ptr, out_ptr, N, stride_we, stride_wn,
                              K: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (BLOCK_N output columns): out[n] = sum over slots of round(w_j * down_j[n] . act[j])
        (+ shared[n]), fp32, rounded once. The TOP_K x ceil(K / BLOCK_K) tiles are one unrolled
        sequence, each loaded a step ahead (across slot boundaries too)."""
        wait_for_prior_grid(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        rows = n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        w_next = tl.load(w_ptr + tl.load(ids_ptr).to(tl.int64) * stride_we + rows,
                         mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(TOP_K * STEPS):
            w = w_next
            if s + 1 < TOP_K * STEPS:  # the next tile (the next slot's first at a slot's last step)
                j_next = (s + 1) // STEPS
                k_next = ((s + 1) % STEPS) * BLOCK_K
                expert_next = tl.load(ids_ptr + j_next).to(tl.int64)
                w_next = tl.load(w_ptr + expert_next * stride_we + rows + k_next,
                                 mask=n_ok[:, None] & (k_next + kk < K)[None, :], other=0.0)
            j = s // STEPS
            k = (s % STEPS) * BLOCK_K
            a = tl.load(act_ptr + j * K + k + kk, mask=k + kk < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * a[None, :]
            if (s + 1) % STEPS == 0:  # the slot's last tile: weight, round as the grouped kernel does
                y = tl.sum(acc, axis=1) * tl.load(route_w_ptr + j)
                total += y.to(out_ptr.dtype.element_ty).to(tl.float32)
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if HAS_SHARED:
            total += tl.load(shared_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_gemv_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, swiglu_limit: float, shared: torch.Tensor | None = None,
                    block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> torch.Tensor:
    """The two kernels (on CUDA, or on CPU tensors under TRITON_INTERPRET=1); `moe_gemv_ref`'s contract.
    Needs contiguous weights, I divisible by block_n (the gate and up halves of a program's rows)."""
    num_experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[-1]
    if x.shape != (1, hidden) or w_down.shape != (num_experts, hidden, inter) or topk_weights.shape != (1, top_k):
        raise ValueError(f"moe_gemv needs x [1, D], w_gate_up [E, 2I, D], w_down [E, D, I], weights and ids [1, k]; "
                         f"got {tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if inter % block_n or not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
        raise ValueError(f"moe_gemv needs contiguous weights and I ({inter}) divisible by BLOCK_N ({block_n})")
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    route_w = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _moe_gemv_gate_up_kernel[(inter // block_n, top_k)](
        x, w_gate_up, ids, act, hidden, inter, w_gate_up.stride(0), w_gate_up.stride(1), float(swiglu_limit),
        BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(hidden)), num_warps=4, **pdl_args(x.device))
    if shared is not None:
        shared = shared.contiguous()
    _moe_gemv_down_kernel[(triton.cdiv(hidden, block_n),)](
        act, w_down, ids, route_w, shared if shared is not None else out, out, hidden, w_down.stride(0),
        w_down.stride(1), K=inter, TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(inter)), num_warps=4, **pdl_args(x.device))
    return out


def moe_gemv_here(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """One token, contiguous 16-bit weights, CUDA with the kernel enabled (SPARSESERVE_DISABLE_KERNELS=moe_gemv:
    the grouped path): static facts of the step's shape, so a graph replays the path it captured."""
    return (HAS_TRITON and x.dim() == 2 and x.shape[0] == 1 and use_triton("moe_gemv", x)
            and w_gate_up.is_contiguous() and w_down.is_contiguous() and w_gate_up.dtype == x.dtype
            and (w_gate_up.shape[1] // 2) % BLOCK_N == 0)
