"""Routed experts on FP4 weights as a weight stream, for decode-sized batches (MoeQuantConfig.gemv).

At a few tokens each routed (token, slot) row meets its own expert, so the grouped GEMM of moe_quant.py
pads every row to a 16-row tile and the kernels' time goes to per-tile latency, not to the bytes. This form
treats each routed row as a matrix-vector product against its expert, the shape of kernels/gemv.py:

  * gate-up: grid (R = T * top_k rows, cdiv(I, BLOCK_N)); program (r, nb) takes token r // top_k and expert
    topk_ids[r], streams BLOCK_N rows of the gate half and of the up half of that expert's packed e2m1 bytes and
    their per-32 scales along K in BLOCK_K steps (a multiple of 128), and quantizes x's row itself, per
    128-column group as act_quant_ref does (no act_quant launch). The epilogue is the release's: gate and up
    each rounded to x's dtype, the clamps, silu(gate) * up * route_weight, rounded to x's dtype -> h [R, I].
  * down: grid (R, cdiv(D, BLOCK_N)); quantizes row r of h per 128-column group in the same way, times the
    expert's w_down rows -> y [R, D] in x's dtype; then moe_combine (kernels/moe.py) sums each token's rows in
    fp32 and adds `shared`.

Each program loads the next step's weight bytes and scale bytes before multiplying the current ones (register
double buffering), accumulates products per lane in fp32 and reduces across the tile once, after the loop.
Products are decoded weight values (e2m1 x scale, fp32) times decoded activation values (e4m3 code x scale,
fp32), as the reference multiplies them, so results differ from fused_moe_quant_ref only in the fp32 summation
order. A negative expert id skips its row: the gate-up program writes nothing and the down program writes a
zero row (so the combine adds nothing for it).

Roofline (T tokens, E_t distinct experts touched): bytes = the routed rows' expert weights, 3 I D (1/2 + 1/32)
per row (rows of one expert reread through L2), plus activations; FLOPs = 6 T k D I on the CUDA cores.
Graph-safe: the grid depends only on T, k and the shapes; no host sync. FP4 weights only.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..moe import moe_combine
from ..pdl import pdl_args, wait_for_prior_grid
from .formats import BLOCK, QuantFormatError, QuantWeight
from .select import MoeQuantConfig

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    from .triton_common import e2m1_to_f32, e8m0_to_f32, round_e4m3, round_to, scale_group

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

if HAS_TRITON:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _load_tile(w_rows, ws_rows, n_ok, k0, K, BLOCK_K: tl.constexpr, W_E8M0: tl.constexpr):
        """One BLOCK_K step of BLOCK_N weight rows: (packed bytes [BN, BK/32, 16], one scale per 32 columns
        [BN, BK/32] as stored: e8m0 exponent bytes or fp32). Byte (q, j) holds columns k0 + 32q + 2j and
        + 1. Columns past K (a multiple of 32) are masked: code 0, scale 2^0."""
        q = tl.arange(0, BLOCK_K // 32)
        j = tl.arange(0, 16)
        q_ok = k0 + 32 * q < K
        b = tl.load(w_rows[:, None, None] + (k0 // 2 + 16 * q)[None, :, None] + j[None, None, :],
                    mask=n_ok[:, None, None] & q_ok[None, :, None], other=0)
        s_ptrs = ws_rows[:, None] + (k0 // 32 + q)[None, :]
        if W_E8M0:
            s = tl.load(s_ptrs, mask=n_ok[:, None] & q_ok[None, :], other=127)
        else:
            s = tl.load(s_ptrs, mask=n_ok[:, None] & q_ok[None, :], other=1.0)
        return b, s

    @triton.jit
    def _act_step(a_row, k0, K, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr):
        """BLOCK_K columns of one activation row quantized per 128-column group as act_quant_ref does, decoded
        back (code x scale, fp32) and split into even and odd columns [BK/32, 16] (the low and the high
        nibbles' partners). A group cut by K takes its amax over the columns it has (masked ones are 0)."""
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_row + k, mask=k < K, other=0.0).to(tl.float32)
        q, s = scale_group(tl.reshape(a, (BLOCK_K // 128, 128)), UE8M0)
        v = round_e4m3(q) * s[:, None]
        return tl.split(tl.reshape(v, (BLOCK_K // 32, 16, 2)))

    @triton.jit
    def _fma_tile(acc, b, s, a_even, a_odd, W_E8M0: tl.constexpr):
        """acc [BN, BK/32, 16] += each byte's two decoded weight values times their activation values, per
        lane."""
        b = b.to(tl.int32)
        sc = (e8m0_to_f32(s) if W_E8M0 else s)[:, :, None]
        acc += (e2m1_to_f32(b & 0xF) * sc) * a_even[None, :, :]
        acc += (e2m1_to_f32(b >> 4) * sc) * a_odd[None, :, :]
        return acc

    @triton.jit(do_not_specialize=["top_k"])
    def _moe_gemv_gate_up_kernel(
        x_ptr, w_ptr, ws_ptr, h_ptr, topk_ids_ptr, topk_w_ptr,
        top_k, hidden, inter, stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, limit,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, W_E8M0: tl.constexpr,
        ACT_DTYPE: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)  # the ids (router) and x are the previous kernels' outputs
        r = tl.program_id(0)
        expert = tl.load(topk_ids_ptr + r).to(tl.int64)
        if expert < 0:  # skipped (kernels/moe_align.py); the down kernel writes its row's zeros
            return
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        rows = offs_n.to(tl.int64)
        g_rows = w_ptr + expert * stride_we + rows * stride_wn
        gs_rows = ws_ptr + expert * stride_wse + rows * stride_wsn
        u_rows = g_rows + inter * stride_wn  # the up half: rows I.. of the packed [2I, D] weight and its scales
        us_rows = gs_rows + inter * stride_wsn
        a_row = x_ptr + (r // top_k).to(tl.int64) * stride_xm
        gb_next, gs_next = _load_tile(g_rows, gs_rows, n_ok, 0, hidden, BLOCK_K, W_E8M0)
        ub_next, us_next = _load_tile(u_rows, us_rows, n_ok, 0, hidden, BLOCK_K, W_E8M0)
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            gb, gs, ub, us = gb_next, gs_next, ub_next, us_next
            # The next step's bytes are in flight while this step multiplies.
            gb_next, gs_next = _load_tile(g_rows, gs_rows, n_ok, k0 + BLOCK_K, hidden, BLOCK_K, W_E8M0)
            ub_next, us_next = _load_tile(u_rows, us_rows, n_ok, k0 + BLOCK_K, hidden, BLOCK_K, W_E8M0)
            a_even, a_odd = _act_step(a_row, k0, hidden, BLOCK_K, UE8M0)
            acc_g = _fma_tile(acc_g, gb, gs, a_even, a_odd, W_E8M0)
            acc_u = _fma_tile(acc_u, ub, us, a_even, a_odd, W_E8M0)
        # The release: each GEMM's output in the activation dtype, then fp32: clamps, silu, routing weight.
        gate = tl.minimum(round_to(tl.sum(tl.sum(acc_g, axis=2), axis=1), ACT_DTYPE), limit)
        up = tl.minimum(tl.maximum(round_to(tl.sum(tl.sum(acc_u, axis=2), axis=1), ACT_DTYPE), -limit), limit)
        h = round_to(gate * tl.sigmoid(gate) * up * tl.load(topk_w_ptr + r), ACT_DTYPE)
        tl.store(h_ptr + r.to(tl.int64) * stride_hm + offs_n, h.to(ACT_DTYPE), mask=n_ok)

    @triton.jit
    def _moe_gemv_down_kernel(
        h_ptr, w_ptr, ws_ptr, y_ptr, topk_ids_ptr,
        hidden, inter, stride_hm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, W_E8M0: tl.constexpr,
        ACT_DTYPE: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        r = tl.program_id(0)
        expert = tl.load(topk_ids_ptr + r).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        y_ptrs = y_ptr + r.to(tl.int64) * stride_ym + offs_n
        if expert < 0:  # a skipped assignment adds nothing to its token
            tl.store(y_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32).to(ACT_DTYPE), mask=n_ok)
            return
        rows = offs_n.to(tl.int64)
        w_rows = w_ptr + expert * stride_we + rows * stride_wn
        ws_rows = ws_ptr + expert * stride_wse + rows * stride_wsn
        a_row = h_ptr + r.to(tl.int64) * stride_hm
        b_next, s_next = _load_tile(w_rows, ws_rows, n_ok, 0, inter, BLOCK_K, W_E8M0)
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            b, s = b_next, s_next
            b_next, s_next = _load_tile(w_rows, ws_rows, n_ok, k0 + BLOCK_K, inter, BLOCK_K, W_E8M0)
            a_even, a_odd = _act_step(a_row, k0, inter, BLOCK_K, UE8M0)
            acc = _fma_tile(acc, b, s, a_even, a_odd, W_E8M0)
        y = round_to(tl.sum(tl.sum(acc, axis=2), axis=1), ACT_DTYPE)  # on the bits: the interpreter's cast truncates
        tl.store(y_ptrs, y.to(ACT_DTYPE), mask=n_ok)


def check_gemv_config(cfg: MoeQuantConfig) -> None:
    """The gemv form's tile constraints, with the field to change."""
    if cfg.gemv_block_k % BLOCK or cfg.gemv_block_k & (cfg.gemv_block_k - 1):
        raise QuantFormatError(f"MoeQuantConfig.gemv_block_k is {cfg.gemv_block_k}: use a power of two that is a "
                               f"multiple of {BLOCK} (whole activation groups per step)")
    for name in ("gu_block_n", "dn_block_n"):
        n = getattr(cfg, name)
        if n < 1 or n & (n - 1):
            raise QuantFormatError(f"MoeQuantConfig.{name} is {n}: the gemv form needs a power of two")


def fused_moe_gemv(
    x: torch.Tensor,
    w_gate_up: QuantWeight,
    w_down: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    scale_fmt: str | None,
    cfg: MoeQuantConfig,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The weight-streaming form (module docstring); same contract as moe_quant.fused_moe_quant_triton, whose
    shape and scale_fmt checks have run (it dispatches here when cfg.gemv). FP4 weights only."""
    if w_gate_up.fmt != "fp4" or w_down.fmt != "fp4":
        raise QuantFormatError(f"MoeQuantConfig.gemv runs FP4 experts only, got {w_gate_up.fmt} weights: use "
                               "gemv=False (the grouped GEMM) for fp8_block experts")
    check_gemv_config(cfg)
    num_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    rows = num_tokens * top_k
    ids = topk_ids.reshape(-1).contiguous()  # int32 or int64: the kernels read either
    route_w = topk_weights.reshape(-1).float().contiguous()
    ue8m0 = scale_fmt == "ue8m0"
    act_dtype = _TL_DTYPES[x.dtype]
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    gu, gus = w_gate_up.codes, w_gate_up.scale_bits
    _moe_gemv_gate_up_kernel[(rows, triton.cdiv(inter, cfg.gu_block_n))](
        x, gu, gus, h, ids, route_w, top_k, hidden, inter, x.stride(0), gu.stride(0), gu.stride(1),
        gus.stride(0), gus.stride(1), h.stride(0), float(swiglu_limit),
        BLOCK_N=cfg.gu_block_n, BLOCK_K=cfg.gemv_block_k, UE8M0=ue8m0, W_E8M0=w_gate_up.scale_is_e8m0,
        ACT_DTYPE=act_dtype, num_warps=cfg.gu_warps, num_stages=cfg.gu_stages, **pdl_args(x.device))
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    dn, dns = w_down.codes, w_down.scale_bits
    _moe_gemv_down_kernel[(rows, triton.cdiv(hidden, cfg.dn_block_n))](
        h, dn, dns, y, ids, hidden, inter, h.stride(0), dn.stride(0), dn.stride(1), dns.stride(0), dns.stride(1),
        y.stride(0),
        BLOCK_N=cfg.dn_block_n, BLOCK_K=cfg.gemv_block_k, UE8M0=ue8m0, W_E8M0=w_down.scale_is_e8m0,
        ACT_DTYPE=act_dtype, num_warps=cfg.dn_warps, num_stages=cfg.dn_stages, **pdl_args(x.device))
    return moe_combine(y, top_k, shared() if callable(shared) else shared)
