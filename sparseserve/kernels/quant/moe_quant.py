"""Routed experts on FP8 (block-scaled e4m3) or FP4 (e2m1, per-32 scales) weights: the grouped gate-up and
down GEMMs of kernels/moe.py with a quantized weight argument, the release's numerics (reference.py).

Same calling convention and pipeline as `kernels/moe.fused_moe_triton`: `moe_align` sorts the (token, slot)
assignments by expert into BLOCK_M-padded tiles; the gate-up GEMM computes both halves of an expert's packed
[2I, D] weight per program and applies the clamped SwiGLU and the routing weight in its epilogue (the release
weighs the activation before w2); the down GEMM writes one row per assignment; `moe_combine` sums each
token's rows in fp32 (+ the shared expert). Only the weight arguments change: `QuantWeight`s
(formats.py) of shapes [E, 2I, D] and [E, D, I].

Activations are quantized per token and 128 columns as the release does: x once by act_quant before the
gate-up GEMM (every row of select.py's table; the benchmarked alternative quantizes x's rows inside each
gate-up program); the activation either in the gate-up epilogue (prefill rows: its 128 columns are one group,
the down GEMM reads e4m3 codes) or by act_quant on the bf16 act between the two GEMMs (decode rows; the
alternative quantizes it inside each down program).

FP4 weights (Hopper has no FP4 tensor cores) take one of four forms. Two run on the fp8 tensor cores
(MoeQuantConfig.fp4_fp8_mma): the one-dot form (constexpr FP4_ONE_DOT, MoeQuantConfig.fp4_one_dot;
fp4_one_dot.py): per (row, 128-column group) the four sub-scales folded into one, the e2m1 codes written as
exponent-shifted e4m3 codes, one K = 128 fp8 dot a group scaled once, exact for tensors whose sub-scale spans
allow it (QuantWeight.fp4_one_dot_exact, decided at load: a tensor that fails takes the four-dot form, so no
step branches on data); the four-dot form (constexpr FP4_FP8; fp4_fp8.py): each e2m1 code moved bit-wise to
the e4m3 code of value x 2^-6, four K = 32 fp8 dots per group, each partial times its per-32 scale (x 2^6) in
fp32. The two benchmarked alternatives multiply exact bf16 values (e2m1 x 2^e) through the bf16 mma
(constexpr FP4_SCALED_DOT): `tl.dot_scaled` on the packed bytes and their ue8m0 scale bytes (Triton's MX
upcast), or each byte's two nibbles decoded with scalar ops, times their scale. Where K is a multiple of 128
(EVEN_K) the FP4 loads are masked by row only and each row's 4 scale bytes of a group are read as one int32
word, which sm_90's software pipeliner copies ahead with the weight. In every form the activation side is
e4m3 codes, their per-group scale applied to the fp32 partial, so every product is exact. FP8 weights use the
fp8 tensor-core dot in every row.

A config with `gemv` (MoeQuantConfig; a benchmarked variant for FP4 at decode sizes, never the table's) runs
moe_gemv.py's weight-streaming form instead: no moe_align, no act_quant, one program per routed row and
weight-row tile.

Roofline (T tokens, top-k, E_t distinct experts touched, D hidden, I intermediate): bytes = E_t * 3 I D *
(1 for fp8, 1/2 + 1/32 for fp4) + scales + activations; FLOPs = 6 T k D I.
Graph-safe: shapes and the grid depend only on T, k, E (never on the routing); no host sync.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ... import envs
from ..dispatch import enabled_on
from ..moe import moe_combine
from ..moe_align import moe_align
from ..pdl import pdl_args, wait_for_prior_grid
from .act_quant import act_quant_triton
from .formats import BLOCK, QuantFormatError, QuantWeight, check_scale_fmt
from .moe_gemv import fused_moe_gemv
from .reference import fused_moe_quant_ref
from .select import MoeQuantConfig, moe_quant_config

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    from .fp4_fp8 import act_group_operands, fp4_fp8_group_partial
    from .fp4_one_dot import fp4_one_dot_partial, one_dot_act_group
    from .triton_common import activation_group, quant_group, round_to, weight_group_partial

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

_INTERPRET = envs.triton_interpret()
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _tile_coords(num_m_blocks, n_tiles, M_FASTEST: tl.constexpr):
        pid = tl.program_id(0)
        if M_FASTEST:
            return pid % num_m_blocks, pid // num_m_blocks
        else:
            return pid // n_tiles, pid % n_tiles

    @triton.jit(do_not_specialize=["num_assign", "top_k", "num_m_blocks"])
    def _moe_q_gate_up_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
        num_assign, top_k, hidden, inter, num_m_blocks, up_scale_row,
        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
        limit,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr, QUANT_A: tl.constexpr,
        OUT_QUANT: tl.constexpr, UE8M0: tl.constexpr, W_E8M0: tl.constexpr, DOT: tl.constexpr,
        FP4_SCALED_DOT: tl.constexpr, EVEN_K: tl.constexpr, ACT_DTYPE: tl.constexpr, M_FASTEST: tl.constexpr,
        PDL: tl.constexpr, FP4_FP8: tl.constexpr = False, INTERPRET: tl.constexpr = False,
        FP4_ONE_DOT: tl.constexpr = False,
    ):
        wait_for_prior_grid(PDL)
        pid_m, pid_n = _tile_coords(num_m_blocks, tl.cdiv(inter, BLOCK_N), M_FASTEST)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)
        row_ok = ids < num_assign
        tokens = (ids // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, 128)
        a_row = x_ptr + tokens[:, None] * stride_xm
        a_ptrs = a_row + offs_k[None, :]
        as_ptrs = xs_ptr + tokens * stride_xsm
        w_gate = w_ptr + expert * stride_we
        ws_gate = ws_ptr + expert * stride_wse
        w_up = w_gate + inter * stride_wn
        if FP4:  # scale rows follow the weight rows
            ws_up = ws_gate + inter * stride_wsn
            up_row0 = 0
        else:  # fp8_block: the up half's block rows start at up_scale_row
            ws_up = ws_gate
            up_row0 = up_scale_row
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, (hidden + 127) // 128):
            if FP4_ONE_DOT:  # one K = 128 fp8 dot a group and half, on exponent-shifted codes
                k_ok = g * 128 + offs_k < hidden
                a_op, sa = one_dot_act_group(a_ptrs + g * 128, as_ptrs + g, row_ok[:, None] & k_ok[None, :], row_ok,
                                             QUANT_A, UE8M0, INTERPRET)
                acc_g += fp4_one_dot_partial(a_op, g, w_gate, ws_gate, offs_n, n_ok, hidden, stride_wn, stride_wsn,
                                             W_E8M0, EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
                acc_u += fp4_one_dot_partial(a_op, g, w_up, ws_up, offs_n, n_ok, hidden, stride_wn, stride_wsn,
                                             W_E8M0, EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
            elif FP4_FP8:  # four K = 32 fp8 dots a group, both halves on the same activation codes
                sa, a0, a1, a2, a3 = act_group_operands(a_row, g, row_ok, as_ptrs, hidden, QUANT_A, UE8M0, INTERPRET)
                acc_g += fp4_fp8_group_partial(a0, a1, a2, a3, g, w_gate, ws_gate, offs_n, n_ok, hidden, stride_wn,
                                               stride_wsn, W_E8M0, EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
                acc_u += fp4_fp8_group_partial(a0, a1, a2, a3, g, w_up, ws_up, offs_n, n_ok, hidden, stride_wn,
                                               stride_wsn, W_E8M0, EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
            else:
                k_ok = g * 128 + offs_k < hidden
                a_op, sa = activation_group(a_ptrs + g * 128, as_ptrs + g, row_ok[:, None] & k_ok[None, :],
                                            row_ok, QUANT_A, UE8M0, DOT, False)
                acc_g += weight_group_partial(a_op, g, w_gate, ws_gate, 0, offs_n, n_ok, hidden, stride_wn,
                                              stride_wsn, FP4, W_E8M0, DOT, FP4_SCALED_DOT, EVEN_K) * sa[:, None]
                acc_u += weight_group_partial(a_op, g, w_up, ws_up, up_row0, offs_n, n_ok, hidden, stride_wn,
                                              stride_wsn, FP4, W_E8M0, DOT, FP4_SCALED_DOT, EVEN_K) * sa[:, None]
        # The release: each GEMM's output in the activation dtype, then fp32: clamps, silu, routing weight.
        gate = tl.minimum(round_to(acc_g, ACT_DTYPE), limit)
        up = tl.minimum(tl.maximum(round_to(acc_u, ACT_DTYPE), -limit), limit)
        route_w = tl.load(topk_w_ptr + ids, mask=row_ok, other=0.0)
        h = round_to(gate * tl.sigmoid(gate) * up * route_w[:, None], ACT_DTYPE)
        rows = offs_m.to(tl.int64)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        if OUT_QUANT:  # BLOCK_N == 128: this tile's columns are activation group pid_n
            hq, hs = quant_group(tl.where(n_ok[None, :], h, 0.0), UE8M0)
            tl.store(out_ptrs, hq.to(tl.float8e4nv), mask=n_ok[None, :])
            tl.store(outs_ptr + rows * stride_osm + pid_n, hs)
        else:
            tl.store(out_ptrs, h.to(ACT_DTYPE), mask=n_ok[None, :])

    @triton.jit(do_not_specialize=["num_assign", "num_m_blocks"])
    def _moe_q_down_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr,
        num_assign, hidden, inter, num_m_blocks,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr, QUANT_A: tl.constexpr,
        UE8M0: tl.constexpr, W_E8M0: tl.constexpr, DOT: tl.constexpr, FP4_SCALED_DOT: tl.constexpr,
        EVEN_K: tl.constexpr, M_FASTEST: tl.constexpr, PDL: tl.constexpr, FP4_FP8: tl.constexpr = False,
        INTERPRET: tl.constexpr = False, FP4_ONE_DOT: tl.constexpr = False,
    ):
        wait_for_prior_grid(PDL)
        pid_m, pid_n = _tile_coords(num_m_blocks, tl.cdiv(hidden, BLOCK_N), M_FASTEST)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)
        row_ok = ids < num_assign
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        offs_k = tl.arange(0, 128)
        rows = offs_m.to(tl.int64)
        a_row = a_ptr + rows[:, None] * stride_am
        a_ptrs = a_row + offs_k[None, :]
        as_ptrs = as_ptr + rows * stride_asm
        w_e = w_ptr + expert * stride_we
        ws_e = ws_ptr + expert * stride_wse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, (inter + 127) // 128):
            if FP4_ONE_DOT:
                k_ok = g * 128 + offs_k < inter
                a_op, sa = one_dot_act_group(a_ptrs + g * 128, as_ptrs + g, row_ok[:, None] & k_ok[None, :], row_ok,
                                             QUANT_A, UE8M0, INTERPRET)
                acc += fp4_one_dot_partial(a_op, g, w_e, ws_e, offs_n, n_ok, inter, stride_wn, stride_wsn, W_E8M0,
                                           EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
            elif FP4_FP8:
                sa, a0, a1, a2, a3 = act_group_operands(a_row, g, row_ok, as_ptrs, inter, QUANT_A, UE8M0, INTERPRET)
                acc += fp4_fp8_group_partial(a0, a1, a2, a3, g, w_e, ws_e, offs_n, n_ok, inter, stride_wn,
                                             stride_wsn, W_E8M0, EVEN_K, not INTERPRET, INTERPRET) * sa[:, None]
            else:
                k_ok = g * 128 + offs_k < inter
                a_op, sa = activation_group(a_ptrs + g * 128, as_ptrs + g, row_ok[:, None] & k_ok[None, :],
                                            row_ok, QUANT_A, UE8M0, DOT, False)
                acc += weight_group_partial(a_op, g, w_e, ws_e, 0, offs_n, n_ok, inter, stride_wn, stride_wsn,
                                            FP4, W_E8M0, DOT, FP4_SCALED_DOT, EVEN_K) * sa[:, None]
        y_ptrs = y_ptr + ids[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def interpreter_has_dot_scaled() -> bool:
    """Whether this Triton's interpreter runs tl.dot_scaled (3.9's does, 3.6's does not); compiled kernels
    have it on both."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpreterBuilder

    return hasattr(InterpreterBuilder, "create_dot_scaled")


def _scaled_dot(cfg: MoeQuantConfig, w: QuantWeight) -> bool:
    """The dot_scaled FP4 form where the config asks for it and the weight's scales are ue8m0 (it reads
    exponent bytes); fp32-scaled FP4 and FP8 weights take the decoding form."""
    return cfg.fp4_scaled_dot and not cfg.fp4_fp8_mma and w.fmt == "fp4" and w.scale_is_e8m0


def _one_dot(cfg: MoeQuantConfig, w: QuantWeight) -> bool:
    """The one-dot FP4 form where the config asks for it and the weight is exact in it (a static property of the
    tensor, computed once: QuantWeight.fp4_one_dot_exact); else the four-dot form."""
    if not (w.fmt == "fp4" and cfg.fp4_fp8_mma and cfg.fp4_one_dot):
        return False
    if "fp4_one_dot_exact" not in w.__dict__ and w.data.is_cuda and torch.cuda.is_current_stream_capturing():
        raise QuantFormatError("fused_moe_quant: QuantWeight.fp4_one_dot_exact is computed by a host sync, which a "
                               "CUDA graph capture cannot run; read it once before capturing (the loader does, "
                               "model/quantize.py)")
    return w.fp4_one_dot_exact


def _even_k(w: QuantWeight, k: int) -> bool:
    """The kernels' EVEN_K: K a multiple of 128 and, for FP4, scale rows and base 4-byte aligned (the
    dot_scaled form reads each group's 4 scale bytes of a row as one int32 word)."""
    if k % BLOCK:
        return False
    s = w.scale  # e8m0: one byte an element, so its strides are the exponent bytes' (no uint8 view needed)
    return not w.scale_is_e8m0 or (s.stride(0) % 4 == 0 and s.stride(1) % 4 == 0 and s.data_ptr() % 4 == 0)


def _check_moe(x: torch.Tensor, w_gate_up: QuantWeight, w_down: QuantWeight, topk_ids: torch.Tensor) -> None:
    if w_gate_up.fmt != w_down.fmt or w_gate_up.data.dim() != 3 or w_down.data.dim() != 3:
        raise QuantFormatError(f"fused_moe_quant needs 3-D expert weights of one format, got w_gate_up "
                               f"{w_gate_up.fmt} {tuple(w_gate_up.shape)} and w_down {w_down.fmt} {tuple(w_down.shape)}")
    e, two_i, d = w_gate_up.shape
    inter = two_i // 2
    if two_i % 2 or tuple(w_down.shape) != (e, d, inter):
        raise QuantFormatError(f"w_gate_up is {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)}: need "
                               f"[E, 2I, D] and [E, D, I]")
    if w_gate_up.fmt == "fp8_block" and inter % BLOCK:
        raise QuantFormatError(f"fp8_block experts need the intermediate size I = {inter} to be a multiple of "
                               f"{BLOCK} (the gate and up halves' block scales are stacked)")
    if x.dim() != 2 or x.shape[1] != d or x.stride(1) != 1:
        raise QuantFormatError(f"fused_moe_quant: x has shape {tuple(x.shape)}; the experts need [T, {d}] with "
                               "contiguous rows")
    if x.dtype not in _ACT_DTYPES:
        raise QuantFormatError(f"fused_moe_quant: x has dtype {x.dtype}; use bfloat16, float16 or float32")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise QuantFormatError(f"topk_ids has shape {tuple(topk_ids.shape)}; need [{x.shape[0]}, top_k]")


def fused_moe_quant_triton(
    x: torch.Tensor,
    w_gate_up: QuantWeight,
    w_down: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    scale_fmt: str | None = "ue8m0",
    config: MoeQuantConfig | None = None,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1): same contract as fused_moe_quant_ref;
    `shared` as in kernels/moe.fused_moe_triton (added in the combine pass)."""
    check_scale_fmt(scale_fmt)
    _check_moe(x, w_gate_up, w_down, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x) if shared is None else (shared() if callable(shared) else shared).clone()
    cfg = config or moe_quant_config(num_tokens, top_k, num_experts, w_gate_up.fmt, _INTERPRET)
    if cfg.gemv:  # the weight-streaming form (moe_gemv.py)
        return fused_moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit, scale_fmt, cfg, shared)
    if _INTERPRET and cfg.fp4_scaled_dot and not interpreter_has_dot_scaled():
        if config is not None and _scaled_dot(cfg, w_gate_up):
            raise QuantFormatError("MoeQuantConfig.fp4_scaled_dot: this Triton's interpreter has no "
                                   "tl.dot_scaled; pass fp4_scaled_dot=False")
        cfg = replace(cfg, fp4_scaled_dot=False)
    if cfg.out_quant and cfg.gu_block_n != BLOCK:
        raise QuantFormatError(f"MoeQuantConfig.out_quant needs gu_block_n = {BLOCK}, got {cfg.gu_block_n}")
    fp4 = w_gate_up.fmt == "fp4"
    ue8m0 = scale_fmt == "ue8m0"
    gu_one_dot, dn_one_dot = _one_dot(cfg, w_gate_up), _one_dot(cfg, w_down)  # before any launch
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, cfg.block_m)
    num_m_blocks = block_expert.numel()
    rows = sorted_ids.numel()
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    xq, xs = act_quant_triton(x, scale_fmt) if cfg.x_quant else (x, dummy)
    if cfg.out_quant:
        act = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_s = torch.empty(rows, triton.cdiv(inter, BLOCK), dtype=torch.float32, device=x.device)
    else:
        act, act_s = torch.empty(rows, inter, dtype=x.dtype, device=x.device), dummy
    route_w = topk_weights.reshape(-1).float().contiguous()
    _moe_q_gate_up_kernel[(num_m_blocks * triton.cdiv(inter, cfg.gu_block_n),)](
        xq, xs, w_gate_up.codes, w_gate_up.scale_bits, act, act_s, sorted_ids, block_expert, route_w,
        num_tokens * top_k, top_k, hidden, inter, num_m_blocks, inter // BLOCK,
        xq.stride(0), xs.stride(0), w_gate_up.data.stride(0), w_gate_up.data.stride(1),
        w_gate_up.scale.stride(0), w_gate_up.scale.stride(1), act.stride(0), act_s.stride(0),
        float(swiglu_limit),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.gu_block_n, FP4=fp4, QUANT_A=not cfg.x_quant, OUT_QUANT=cfg.out_quant,
        UE8M0=ue8m0, W_E8M0=w_gate_up.scale_is_e8m0, DOT=cfg.dot, FP4_SCALED_DOT=_scaled_dot(cfg, w_gate_up),
        EVEN_K=_even_k(w_gate_up, hidden), ACT_DTYPE=_TL_DTYPES[x.dtype], M_FASTEST=False,
        FP4_FP8=fp4 and cfg.fp4_fp8_mma, INTERPRET=_INTERPRET, FP4_ONE_DOT=gu_one_dot,
        num_warps=cfg.gu_warps, num_stages=cfg.gu_stages, **pdl_args(x.device))
    codes_down = cfg.out_quant or cfg.down_act_quant
    if codes_down and not cfg.out_quant:
        act, act_s = act_quant_triton(act, scale_fmt)
    y = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _moe_q_down_kernel[(num_m_blocks * triton.cdiv(hidden, cfg.dn_block_n),)](
        act, act_s, w_down.codes, w_down.scale_bits, y, sorted_ids, block_expert,
        num_tokens * top_k, hidden, inter, num_m_blocks,
        act.stride(0), act_s.stride(0), w_down.data.stride(0), w_down.data.stride(1),
        w_down.scale.stride(0), w_down.scale.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.dn_block_n, FP4=fp4, QUANT_A=not codes_down, UE8M0=ue8m0,
        W_E8M0=w_down.scale_is_e8m0, DOT=cfg.dot, FP4_SCALED_DOT=_scaled_dot(cfg, w_down),
        EVEN_K=_even_k(w_down, inter), M_FASTEST=False, FP4_FP8=fp4 and cfg.fp4_fp8_mma, INTERPRET=_INTERPRET,
        FP4_ONE_DOT=dn_one_dot, num_warps=cfg.dn_warps, num_stages=cfg.dn_stages, **pdl_args(x.device))
    return moe_combine(y, top_k, shared() if callable(shared) else shared)


def fused_moe_quant(
    x: torch.Tensor,
    w_gate_up: QuantWeight,
    w_down: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    scale_fmt: str | None = "ue8m0",
) -> torch.Tensor:
    """kernels/moe.fused_moe with quantized expert weights: the kernels on CUDA (`SPARSESERVE_DISABLE_KERNELS=
    quant`: the reference), the reference on the CPU; `shared` [T, D] (or a function returning it) is added."""
    if HAS_TRITON and enabled_on("quant", x.device) and enabled_on("moe", x.device):
        return fused_moe_quant_triton(x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit, scale_fmt,
                                      shared=shared)
    _check_moe(x, w_gate_up, w_down, topk_ids)
    routed = fused_moe_quant_ref(x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit, scale_fmt)
    if shared is None:
        return routed
    return routed + (shared() if callable(shared) else shared)
