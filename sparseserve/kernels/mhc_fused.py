"""The mHC steps between two blocks, fused for small steps (decode, verify).

Between blocks a layer runs: expand (the block's output back into the streams), the next
collapse (split-K mixes, then coefficients and the pre-weighted sum) and the next block's
RMSNorm: four launches, each latency-bound at a few tokens (about 3-5 us each at batch 1 on the
H200, on the step's critical path five times per step). Here they take two:
  a. `_hc_expand_mix_kernel`, split over D: each program computes the new streams of its D
     range (all hc of them, as `_hc_expand_kernel` does: fp32, one rounding), stores them, and
     accumulates their partial sums of squares and fp32 mixes from the rounded values (the
     collapse reads the stored streams: the same numbers);
  b. `_hc_finalize_kernel` with NORM: one program per token sums the partials, computes the
     `pre` coefficients, the collapse and the block's RMSNorm; a second program per token
     computes post and comb (Sinkhorn) beside it.
Without an expand (a layer's first collapse, the head) only (b) is new: the collapse's mix
kernel, then finalize with the norm.

The result equals the unfused sequence up to the fp32 summation order of the mixes (the
partials cover other K subsets); the streams and the collapse round as before (compiled code may
contract multiply-adds differently: a rounding step apart at most). Used for up to
`FUSED_MAX_TOKENS` tokens (see there), for bf16/fp16 streams on CUDA; the references (the
unfused dispatch, in order) run elsewhere and with SPARSESERVE_DISABLE_KERNELS=mhc_fused.

Roofline of (a) per step: reads T*hc*D*e (streams) + T*D*e (block output) + M*hc*D*4 (fn),
writes T*hc*D*e (new streams); at T=1, hc=4, D=4096: 1.6 MB, ~0.4 us of HBM time: it is
latency-bound, as are the four kernels it replaces."""
from __future__ import annotations

import torch

from . import mhc
from .dispatch import use_triton
from .mhc import (
    HAS_TRITON,
    TARGET_PROGRAMS,
    _INTERPRET,
    finalize_triton,
    hc_collapse,
    hc_expand,
    hc_head_collapse,
    mix_step,
    store_partials,
    mix_width,
)
from .rmsnorm import rms_norm
from .pdl import pdl_args, wait_for_prior_grid

if HAS_TRITON:
    import triton
    import triton.language as tl

# The fused steps pay at batch 1 (decode_graphs on the H200) and not from batch 8 on, where the mix is a
# tensor-core dot and the one-program-per-token finalize with the norm is slower than the two kernels
# it replaces. So they run only in the few-token (FMA) regime.
FUSED_MAX_TOKENS = 4


# ----------------------------------------------------------------------------- references

def hc_collapse_norm_ref(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, norm_weight, block_eps):
    """(post, comb, rms_norm(collapse)) by the unfused dispatch."""
    post, comb, collapsed = hc_collapse(streams, fn, base, scale, hc, iters, hc_eps, norm_eps)
    return post, comb, rms_norm(collapsed, norm_weight, block_eps)


def hc_expand_collapse_norm_ref(streams, block_out, post, comb, fn, base, scale, hc, iters, hc_eps, norm_eps,
                                norm_weight, block_eps):
    """(new streams, post', comb', rms_norm(collapse')) by the unfused dispatch."""
    new = hc_expand(streams, block_out, post, comb)
    return (new, *hc_collapse_norm_ref(new, fn, base, scale, hc, iters, hc_eps, norm_eps, norm_weight, block_eps))


def hc_head_collapse_norm_ref(streams, fn, base, scale, hc_eps, norm_eps, norm_weight, block_eps):
    return rms_norm(hc_head_collapse(streams, fn, base, scale, hc_eps, norm_eps), norm_weight, block_eps)


# ----------------------------------------------------------------------------- kernel

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens", "splits"])
    def _hc_expand_mix_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, mix_ws_ptr, sq_ws_ptr,
                              num_tokens, D, K, M, chunk, splits,
                              HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, MP: tl.constexpr,
                              FMA: tl.constexpr, SPLIT_BF16: tl.constexpr, PREC: tl.constexpr,
                              DOT_F32: tl.constexpr, PDL: tl.constexpr):
        """Program (token tile, D chunk): new[k, d] = post[k] * o[d] + sum_j comb[j, k] * s[j, d]
        for every stream k, stored; then the partial sum of squares and x @ fn^T of the stored
        (rounded) values over K columns k * D + d. FMA / SPLIT_BF16 / PREC / DOT_F32 as in
        `_hc_mix_partial_kernel`."""
        wait_for_prior_grid(PDL)
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
        rmask = rows < num_tokens
        m = tl.arange(0, MP)
        mmask = m < M
        dd = tl.arange(0, BD)
        acc = tl.zeros([BT, MP], dtype=tl.float32)
        acc3 = tl.zeros([BT, MP, BD] if FMA else [1, 1, 1], dtype=tl.float32)
        sq = tl.zeros([BT], dtype=tl.float32)
        d_start = pid_s * chunk
        for d0 in range(d_start, d_start + chunk, BD):
            d = d0 + dd
            dmask = d < D
            tdmask = rmask[:, None] & dmask[None, :]
            o = tl.load(o_ptr + rows[:, None] * D + d[None, :], mask=tdmask, other=0.0).to(tl.float32)
            for k in tl.static_range(HC):
                pk = tl.load(post_ptr + rows * HC + k, mask=rmask, other=0.0)
                new = pk[:, None] * o
                for j in tl.static_range(HC):
                    cjk = tl.load(comb_ptr + rows * (HC * HC) + j * HC + k, mask=rmask, other=0.0)
                    sj = tl.load(s_ptr + (rows[:, None] * HC + j) * D + d[None, :], mask=tdmask, other=0.0)
                    new += cjk[:, None] * sj.to(tl.float32)
                x_raw = new.to(new_ptr.dtype.element_ty)
                tl.store(new_ptr + (rows[:, None] * HC + k) * D + d[None, :], x_raw, mask=tdmask)
                w = tl.load(fn_ptr + m[:, None] * K + k * D + d[None, :], mask=mmask[:, None] & dmask[None, :],
                            other=0.0).to(tl.float32)
                acc, acc3, sq = mix_step(acc, acc3, sq, x_raw, w, FMA, SPLIT_BF16, PREC, DOT_F32)
        store_partials(mix_ws_ptr, sq_ws_ptr, acc, acc3, sq, rows, rmask, m, pid_s, splits, MP, FMA)


def expand_mix_config(num_tokens: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch of the expand+mix kernel from static shapes: token tile BT, D step BD, D chunks
    (about TARGET_PROGRAMS programs, at most 128) and the product's method (as `mix_config`)."""
    fma = num_tokens <= 4
    if fma:
        bt = triton.next_power_of_2(num_tokens)
        bd = 64 if bt <= 2 else 32
    else:
        bt, bd = (16 if num_tokens <= 16 else 64), 64
    tiles = triton.cdiv(num_tokens, bt)
    want = max(1, min(128, triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(dim, bd)))
    chunk = triton.cdiv(triton.cdiv(dim, want), bd) * bd
    # One stage: the loads are small and mostly from L2; pipelining the unrolled hc x hc loads of the
    # dot path needs more shared memory than an SM has (366 KB at BT 64 with triton 3.6's default 3).
    return {"BT": bt, "BD": bd, "chunk": chunk, "splits": triton.cdiv(dim, chunk), "num_warps": 4, "num_stages": 1,
            "fma": fma, "prec": "bf16x3" if dtype == torch.bfloat16 else "tf32x3"}


def expand_mix_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, config: dict | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(new streams, their split partials) for `finalize_triton`."""
    num_tokens, hc, dim = streams.shape
    streams = streams.contiguous()
    new = torch.empty_like(streams)
    m = fn.shape[0]
    cfg = dict(expand_mix_config(num_tokens, dim, streams.dtype), **(config or {}))
    split_bf16 = cfg["prec"] == "bf16x3"
    if split_bf16 and streams.dtype != torch.bfloat16:
        raise ValueError("the bf16x3 product needs bf16 streams")
    mp = mix_width(m)
    splits = cfg["splits"]
    mix_ws = torch.empty(num_tokens, splits, mp, device=streams.device, dtype=torch.float32)
    sq_ws = torch.empty(num_tokens, splits, device=streams.device, dtype=torch.float32)
    if num_tokens:
        _hc_expand_mix_kernel[(triton.cdiv(num_tokens, cfg["BT"]), splits)](
            streams, block_out.contiguous(), post.float().contiguous(), comb.float().contiguous(), new,
            fn.contiguous(), mix_ws, sq_ws, num_tokens, dim, hc * dim, m, cfg["chunk"], splits,
            HC=hc, BT=cfg["BT"], BD=cfg["BD"], MP=mp, FMA=cfg["fma"], SPLIT_BF16=split_bf16,
            PREC="ieee" if split_bf16 else cfg["prec"], DOT_F32=_INTERPRET, num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 1), **pdl_args(streams.device))
    return new, (mix_ws, sq_ws)


def hc_collapse_norm_triton(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, norm_weight, block_eps):
    return mhc._collapse_triton(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, False, None, norm_weight,
                                block_eps)


def hc_expand_collapse_norm_triton(streams, block_out, post, comb, fn, base, scale, hc, iters, hc_eps, norm_eps,
                                   norm_weight, block_eps, config: dict | None = None, norm_warps: int | None = None):
    """`config`: the expand+mix kernel's launch (see `expand_mix_config`); `norm_warps`: the finalize's."""
    new, partials = expand_mix_triton(streams, block_out, post, comb, fn, config)
    return (new, *finalize_triton(new, partials if new.shape[0] else None, base, scale, hc, iters, hc_eps,
                                  norm_eps, False, norm_weight, block_eps, norm_warps))


def hc_head_collapse_norm_triton(streams, fn, base, scale, hc_eps, norm_eps, norm_weight, block_eps):
    return mhc._collapse_triton(streams, fn, base, scale, streams.shape[1], 1, hc_eps, norm_eps, True, None,
                                norm_weight, block_eps)[2]


# ----------------------------------------------------------------------------- dispatch

def fused_here(streams: torch.Tensor) -> bool:
    """Whether the fused kernels run for these streams (a static fact of the step's shape)."""
    # mhc._fused looked up at call time: benchmarks/mhc_bench.py --decode old patches it.
    return streams.shape[0] <= FUSED_MAX_TOKENS and mhc._fused(streams) and use_triton("mhc_fused", streams)


def hc_collapse_norm(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                     iters: int, hc_eps: float, norm_eps: float, norm_weight: torch.Tensor, block_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (post, comb, the block's input: rms_norm(collapse) [T, D])."""
    if fused_here(streams):
        return hc_collapse_norm_triton(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, norm_weight, block_eps)
    return hc_collapse_norm_ref(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, norm_weight, block_eps)


def hc_expand_collapse_norm(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                            fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                            hc_eps: float, norm_eps: float, norm_weight: torch.Tensor, block_eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The previous block's output into the streams, then the next block's collapse and norm:
    (new streams, post, comb, the next block's input)."""
    if fused_here(streams) and block_out.dtype == streams.dtype:
        return hc_expand_collapse_norm_triton(streams, block_out, post, comb, fn, base, scale, hc, iters, hc_eps,
                                              norm_eps, norm_weight, block_eps)
    return hc_expand_collapse_norm_ref(streams, block_out, post, comb, fn, base, scale, hc, iters, hc_eps, norm_eps,
                                       norm_weight, block_eps)


def hc_head_collapse_norm(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                          hc_eps: float, norm_eps: float, norm_weight: torch.Tensor, block_eps: float) -> torch.Tensor:
    """The final collapse and the shared norm before the LM head."""
    if fused_here(streams):
        return hc_head_collapse_norm_triton(streams, fn, base, scale, hc_eps, norm_eps, norm_weight, block_eps)
    return hc_head_collapse_norm_ref(streams, fn, base, scale, hc_eps, norm_eps, norm_weight, block_eps)
