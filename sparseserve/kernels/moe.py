"""Routed mixture-of-experts: expert selection and the grouped SwiGLU expert computation.

Roofline (T tokens, top-k, E_touched distinct experts, D hidden, I intermediate):
bytes = E_touched * 3 * I * D * 2 (bf16 weights) + activations; FLOPs = T * k * 6 * D * I.

GPU path (graph-capturable: static shapes, no host sync, nothing sized by the routing):
1. `moe_align` (kernels/moe_align.py): sort the T*k (token, slot) assignments by expert on the device and lay them
   out in a buffer where each expert's segment is padded to BLOCK_M rows. The buffer is sized
   for the worst case, T*k + min(E, T*k) * (BLOCK_M - 1) rows (only experts that receive a
   token are padded); tiles past the used length carry expert -1 and exit at once. A negative
   expert id skips its assignment (no row; its y row is never written): a prefill graph's padding
   tokens touch no expert.
2. `_moe_gate_up_kernel`: grouped GEMM x[token] @ w_gate_up[e].T for both halves in one
   program, the clamped SwiGLU in the epilogue; writes act [padded rows, I] in x's dtype.
3. `_moe_down_kernel`: grouped GEMM act @ w_down[e].T, the routing weight in the epilogue,
   scattered to y[assignment] (one row per (token, slot)).
4. `moe_combine`: out[t] = sum of its k rows of y (+ the shared expert's row), fp32, one pass.
   A plain sum, not atomics, keeps the result deterministic (eager == graph replay, bitwise).
The grid runs N tiles fastest by default: the programs of one M tile (one expert's rows) run
side by side and share its activation rows in L2, and an expert's few M tiles follow each
other so its weight tiles are read from HBM about once. `moe_config` picks tile shapes from
static shapes only (mean tokens per expert), never from the routing.

`select_experts` (kernels/moe_select.py) is one fused Triton launch on CUDA (scores, correction bias, top-k by
repeated max with the tie rule "lower expert id first", hash ids, normalisation).
`torch._grouped_mm` (CUTLASS, where torch has it) is the alternative `fused_moe_grouped`;
the benchmark times both. It was slower at every measured size on the H200 (docs/performance.md),
so `fused_moe` uses it only when GROUPED_MM_MIN_TOKENS is set.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

from .. import envs  # noqa: E402 (after the optional Triton import)
from .dispatch import enabled_on  # noqa: E402
from .moe_align import (align_kernel_max_assign, moe_align, moe_align_sizes, moe_align_torch,  # noqa: E402,F401
                        moe_align_triton)
from .moe_select import (_SCORING_IDS, launch_select_experts, score_experts, select_experts,  # noqa: E402,F401
                         select_experts_ref, select_experts_triton)
from .pdl import pdl_args, wait_for_prior_grid  # noqa: E402

# Read once, at import, which is when Triton decides whether the kernels below are interpreted.
_INTERPRET = envs.triton_interpret()


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path).

    x: [T, D]; w_gate_up: [E, 2I, D] (gate rows first, then up); w_down: [E, D, I];
    topk_weights: [T, k] fp32; topk_ids: [T, k] (a negative id: the assignment is skipped; a token
    with every assignment skipped gets an unspecified row on the kernels' path, zeros here).
    Returns [T, D] in x's dtype.
    """
    num_tokens, hidden = x.shape
    inter = w_down.shape[2]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:  # skipped (kernels/moe_align.py)
            continue
        sel = flat_ids == expert
        tokens = flat_tokens[sel]
        gate_up = x[tokens] @ w_gate_up[expert].t()
        act = swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        y = (act @ w_down[expert].t()).float() * flat_weights[sel].unsqueeze(1)
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)




# ----------------------------------------------------------------------------------------
# Triton grouped GEMMs
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gu_block_n: int  # per half: the program computes BLOCK_N gate and BLOCK_N up columns
    gu_block_k: int
    gu_warps: int
    gu_stages: int
    dn_block_n: int
    dn_block_k: int
    dn_warps: int
    dn_stages: int
    # Program order: M tiles fastest (tiles of one expert share a weight tile through L2) or
    # N tiles fastest (the programs of one M tile share its activation rows).
    m_fastest: bool = True


def moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoeConfig:
    """Static choice from shapes only (never from the routing), so a graph keeps it.

    By the mean tokens per expert: few, 16/32-row tiles and many programs streaming the touched
    experts' weights (weight-read bound); many, 64/128-row tiles with wide N (gate 128 + up 128,
    down 256) for the tensor cores. N tiles run fastest so that the programs of one M tile share
    its activation rows in L2 (M-fastest re-read them from HBM and was slower at T=4096).
    From the H200 sweeps in docs/performance.md (V4-Flash shapes).
    """
    avg = num_tokens * top_k / num_experts
    if avg <= 4:  # T <= 170 on V4-Flash
        cfg = MoeConfig(16, 64, 128, 4, 3, 128, 128, 4, 3, m_fastest=False)
    elif avg <= 24:  # T <= 1024
        cfg = MoeConfig(32, 64, 128, 4, 3, 128, 128, 4, 3, m_fastest=False)
    elif avg <= 48:  # T <= 2048
        cfg = MoeConfig(64, 128, 64, 4, 4, 256, 64, 4, 4, m_fastest=False)
    else:  # T=4096: 4 stages (196 KB of shared memory) beat 3
        cfg = MoeConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, m_fastest=False)
    return fit_config(cfg, hidden, inter)


def fit_config(cfg: MoeConfig, hidden: int, inter: int) -> MoeConfig:
    """Shrink tile sizes (keeping powers of two) until they divide the problem (tiny tests)."""

    def fit(block: int, size: int) -> int:
        block = min(block, 1 << (size.bit_length() - 1))  # a power of two (tl.arange), not above size
        while block > 16 and size % block:
            block //= 2
        return block

    return MoeConfig(
        cfg.block_m,
        fit(cfg.gu_block_n, inter),
        fit(cfg.gu_block_k, hidden),
        cfg.gu_warps,
        cfg.gu_stages,
        fit(cfg.dn_block_n, hidden),
        fit(cfg.dn_block_k, inter),
        cfg.dn_warps,
        cfg.dn_stages,
        cfg.m_fastest,
    )


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_assign", "top_k", "num_m_blocks"])
    def _moe_gate_up_kernel(
        x_ptr, w_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr,
        num_assign, top_k, hidden, inter, num_m_blocks,
        stride_xm, stride_we, stride_wn, stride_am,
        limit,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
        M_FASTEST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        pid = tl.program_id(0)
        if M_FASTEST:  # neighbouring programs: the tiles of one expert at one N tile
            pid_m = pid % num_m_blocks
            pid_n = pid // num_m_blocks
        else:
            pid_n = pid % (inter // BLOCK_N)
            pid_m = pid // (inter // BLOCK_N)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)
        row_ok = ids < num_assign
        tokens = (ids // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
        # w_gate_up[e] is [2I, D] with D contiguous: read [BLOCK_K, BLOCK_N] tiles of its transpose.
        g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, hidden // BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b_g = tl.load(g_ptrs)
            b_u = tl.load(u_ptrs)
            if UPCAST:  # the interpreter's 16-bit dot is wrong (triton 3.9); fp32 there
                a = a.to(tl.float32)
                b_g = b_g.to(tl.float32)
                b_u = b_u.to(tl.float32)
            acc_g = tl.dot(a, b_g, acc_g)
            acc_u = tl.dot(a, b_u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        # Clamped SwiGLU in fp32 on the accumulators (reference: silu(min(g, L)) * clamp(u, -L, L)).
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["num_assign", "num_m_blocks"])
    def _moe_down_kernel(
        act_ptr, w_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
        num_assign, hidden, inter, num_m_blocks,
        stride_am, stride_we, stride_wn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
        M_FASTEST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        pid = tl.program_id(0)
        if M_FASTEST:
            pid_m = pid % num_m_blocks
            pid_n = pid // num_m_blocks
        else:
            pid_n = pid % (hidden // BLOCK_N)
            pid_m = pid // (hidden // BLOCK_N)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)
        row_ok = ids < num_assign
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, inter // BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        # Routing weight in the epilogue; padding rows are neither weighted nor stored.
        route_w = tl.load(topk_w_ptr + ids, mask=row_ok, other=0.0)
        out = acc * route_w[:, None]
        y_ptrs = y_ptr + ids[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def _interpreting() -> bool:
    return _INTERPRET


def moe_gate_up(
    x: torch.Tensor, w_gate_up: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
    top_k: int, swiglu_limit: float, cfg: MoeConfig,
) -> torch.Tensor:
    """Stage 1: act[row] = swiglu_clamped(x[token(row)] @ w_gate_up[e].T) for every padded row.

    Reference: the gate_up matmul and swiglu_clamped lines of fused_moe_ref, per expert.
    """
    hidden = x.shape[1]
    inter = w_gate_up.shape[1] // 2
    assert hidden % cfg.gu_block_k == 0 and inter % cfg.gu_block_n == 0, "tile must divide D and I"
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1
    num_m_blocks = block_expert.numel()
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    grid = (num_m_blocks * (inter // cfg.gu_block_n),)
    _moe_gate_up_kernel[grid](
        x, w_gate_up, act, sorted_ids, block_expert,
        x.shape[0] * top_k, top_k, hidden, inter, num_m_blocks,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        float(swiglu_limit),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.gu_block_n, BLOCK_K=cfg.gu_block_k, UPCAST=_interpreting(),
        M_FASTEST=cfg.m_fastest,
        num_warps=cfg.gu_warps, num_stages=cfg.gu_stages, **pdl_args(x.device)
    )
    return act


def moe_down(
    act: torch.Tensor, w_down: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
    topk_weights: torch.Tensor, cfg: MoeConfig,
) -> torch.Tensor:
    """Stage 2: y[t*k+j] = w[t, j] * (act[row] @ w_down[e].T), one row per assignment.

    Reference: the down matmul and weighting lines of fused_moe_ref, before the index_add.
    """
    hidden, inter = w_down.shape[1], w_down.shape[2]
    assert hidden % cfg.dn_block_n == 0 and inter % cfg.dn_block_k == 0, "tile must divide D and I"
    assert w_down.stride(2) == 1
    num_assign = topk_weights.numel()
    num_m_blocks = block_expert.numel()
    y = torch.empty(num_assign, hidden, dtype=act.dtype, device=act.device)
    route_w = topk_weights.reshape(-1).float().contiguous()
    grid = (num_m_blocks * (hidden // cfg.dn_block_n),)
    _moe_down_kernel[grid](
        act, w_down, y, sorted_ids, block_expert, route_w,
        num_assign, hidden, inter, num_m_blocks,
        act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.dn_block_n, BLOCK_K=cfg.dn_block_k, UPCAST=_interpreting(),
        M_FASTEST=cfg.m_fastest,
        num_warps=cfg.dn_warps, num_stages=cfg.dn_stages, **pdl_args(act.device)
    )
    return y


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    config: MoeConfig | None = None,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sorted, padded grouped GEMMs in Triton (same contract as fused_moe_ref, graph-safe);
    `shared` [T, D] (the shared expert's output, or a function returning it, called right
    before the combine) is added in the combine pass."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x) if shared is None else _resolve(shared).clone()
    cfg = fit_config(config, hidden, inter) if config else moe_config(num_tokens, top_k, num_experts, hidden, inter)
    x = x.contiguous()
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, cfg.block_m)
    act = moe_gate_up(x, w_gate_up, sorted_ids, block_expert, top_k, swiglu_limit, cfg)
    y = moe_down(act, w_down, sorted_ids, block_expert, topk_weights, cfg)
    return moe_combine(y, top_k, _resolve(shared))


def _resolve(shared: torch.Tensor | Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    return shared() if callable(shared) else shared


def moe_combine_ref(y: torch.Tensor, top_k: int, shared: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_j y[t*k + j] (+ shared[t]): fp32 sum of the slots rounded once, then the shared add."""
    out = y.view(-1, top_k, y.shape[1]).sum(dim=1)
    return out if shared is None else out + shared


if HAS_TRITON:

    @triton.jit
    def _moe_combine_kernel(y_ptr, shared_ptr, out_ptr, hidden, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        # One pass: the k weighted slot rows and the shared expert's row summed in fp32, rounded once.
        wait_for_prior_grid(PDL)
        tok = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + (tok * TOP_K + j) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(shared_ptr + tok * hidden + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine_triton(y: torch.Tensor, top_k: int, shared: torch.Tensor | None) -> torch.Tensor:
    """Same contract as moe_combine_ref, one launch instead of a strided sum and an add; the sum
    and the shared add are rounded once (the reference rounds after each)."""
    hidden = y.shape[1]
    num_tokens = y.shape[0] // top_k
    y = y.contiguous()
    if shared is not None:
        shared = shared.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _moe_combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            y, shared if shared is not None else y, out, hidden, TOP_K=top_k, HAS_SHARED=shared is not None,
            BLOCK=block, num_warps=4, **pdl_args(y.device))
    return out


def moe_combine(y: torch.Tensor, top_k: int, shared: torch.Tensor | None) -> torch.Tensor:
    """Deterministic combine (no atomics: eager == graph replay, bitwise). Triton where it runs."""
    if top_k == 1 and shared is None:
        return y  # y already holds one weighted row per token
    if HAS_TRITON and (y.is_cuda or _INTERPRET):
        return moe_combine_triton(y, top_k, shared)
    return moe_combine_ref(y, top_k, shared)


# ----------------------------------------------------------------------------------------
# torch._grouped_mm path (CUTLASS grouped GEMM; torch >= 2.8 on sm90+), measured against Triton
# ----------------------------------------------------------------------------------------


def grouped_mm_available(device: torch.device) -> bool:
    """Static fact: torch has _grouped_mm and the device is a Hopper-or-newer GPU."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


if HAS_TRITON:

    @triton.jit
    def _swiglu_kernel(h_ptr, out_ptr, inter, stride_h, stride_o, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # One pass over [rows, 2I] instead of the four of the torch expression.
        wait_for_prior_grid(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h + inter + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * stride_o + offs, act.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[rows, 2I] -> [rows, I] in one pass; the reference is swiglu_clamped on the two halves."""
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    grid = (gate_up.shape[0], triton.cdiv(inter, block))
    _swiglu_kernel[grid](gate_up, out, inter, gate_up.stride(0), out.stride(0), float(limit), BLOCK=block,
                         **pdl_args(gate_up.device))
    return out


def swiglu_fused(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton on CUDA, swiglu_clamped elsewhere."""
    if HAS_TRITON and gate_up.is_cuda:
        return swiglu_triton(gate_up, limit)
    inter = gate_up.shape[1] // 2
    return swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], limit)


def fused_moe_grouped(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Same contract as fused_moe_ref through torch._grouped_mm (rows sorted by expert, no padding).

    Group ends live on the device (offs), so nothing here syncs with the host.
    """
    num_tokens, hidden = x.shape
    num_experts = w_gate_up.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    sorted_e, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(sorted_e, torch.arange(1, num_experts + 1, device=x.device)).to(torch.int32)
    xs = x.index_select(0, order // top_k)
    gate_up = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=ends)
    act = swiglu_fused(gate_up, swiglu_limit)
    ys = torch._grouped_mm(act, w_down.transpose(1, 2), offs=ends)
    # Back to (token, slot) order with a permutation (no atomics: deterministic), weight, sum.
    inverse = torch.empty_like(order)
    inverse.scatter_(0, order, torch.arange(order.numel(), device=x.device))
    y = ys.index_select(0, inverse).float() * topk_weights.reshape(-1, 1).float()
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


# ----------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------

# Set by measurement (docs/performance.md): the token counts from which _grouped_mm is used
# instead of the Triton kernels; None = never. Static per shape, so a graph keeps it.
GROUPED_MM_MIN_TOKENS: int | None = None


def _use_triton(x: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and w_gate_up.dtype == x.dtype
        and x.shape[1] % 16 == 0  # tiles of at least 16 must divide D and I
        and w_gate_up.shape[1] % 32 == 0
        and enabled_on("moe", x.device)
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton grouped kernel on CUDA, the reference elsewhere. `shared` [T, D], if
    given, is added to the result (by the Triton path inside its combine pass); it may be a
    function that returns it, called only when the sum needs it (the shared expert may still be
    running on another stream)."""
    args = (x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit)
    if not _use_triton(x, w_gate_up):
        routed = fused_moe_ref(*args)
    elif (
        GROUPED_MM_MIN_TOKENS is not None
        and x.shape[0] >= GROUPED_MM_MIN_TOKENS
        and x.dtype == torch.bfloat16
        and grouped_mm_available(x.device)
    ):
        routed = fused_moe_grouped(*args)
    else:
        return fused_moe_triton(*args, shared=shared)
    return routed if shared is None else routed + _resolve(shared)

