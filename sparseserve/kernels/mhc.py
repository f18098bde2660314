"""mHC (manifold-constrained hyper-connection) kernels: the residual is `hc` streams [T, hc, D].

Three operations, each a plain-PyTorch reference (the CPU path and the test oracle) beside
its Triton kernels; `hc_collapse`, `hc_head_collapse` and `hc_expand` dispatch. The Triton
path runs for bf16/fp16 streams on CUDA (fp32 streams, e.g. the CPU parity runs, keep the
reference); it is CUDA-graph capturable: launch configs depend on static shapes only, no host
sync, deterministic (no atomics: a fixed split-K order, so eager == graph replay, bitwise).

1. Coefficients (Sinkhorn), from the per-token mix logits m = x_norm @ fn^T:
       pre  = sigmoid(m_pre * s0 + b_pre) + eps
       post = 2 * sigmoid(m_post * s1 + b_post)
       comb = Sinkhorn(softmax_row(m_comb * s2 + b_comb) + eps)   (hc x hc, fp32)
   `iters` alternating column/row normalisations of a tiny matrix: ~6 PyTorch kernels per
   iteration, launch-bound; the Triton code does one token's projection in registers.
   Roofline: per token (2 + hc) * hc fp32 in, same out; FLOPs ~ 4 * hc^2 * iters.

2. Collapse (`HyperConnection.collapse_norm`, `HyperHead.collapse_norm`): x = streams.flatten(1) [T, K=hc*D];
   mixes = (x @ fn^T) * rsqrt(mean(x^2) + eps) (the rms factor is a per-token scalar, so it is
   applied after the product); coefficients; collapsed = sum_j pre[j] * streams[:, j].
   The reference materialises a T x K fp32 copy and its normalised copy and runs ~8 kernels.
   Triton, two launches:
     a. `_hc_mix_partial_kernel`, split-K over K: one pass over the streams gives each token's
        partial sum of squares and partial fp32 mixes (exact products, fp32 accumulate; below).
     b. `_hc_finalize_kernel`: sums the partials (fixed order), applies the rms factor, the
        `pre` coefficients and the `pre`-weighted collapse of its D block; `post`/`comb` (Sinkhorn)
        come from one extra D block of programs, beside the collapse.
   Roofline (e = streams element bytes, M = (2 + hc) * hc mixes, MP = M padded to >= 16):
     bytes = T*K*e (a: streams) + T*K*e (b: streams again, often from L2) + T*D*e (collapsed)
             + M*K*4 (fn; re-read per token tile from L2) + T*(hc + hc^2)*4 (post, comb)
             + 2 * T*S*(MP+1)*4 (the S split-K partials, written then read)
     = (2*hc + 1) * T*D*e + small; FLOPs = 2*T*K*MP.
   At T=8192, hc=4, D=4096, bf16: 604 MB -> 143 us at 4.23 TB/s. The product is 4.3 GFMA: at
   the fp32 FMA rate (~33 TFMA/s peak, far less through Triton's FMA dot) it
   would dominate, so for T > 4 it runs on the tensor cores as three bf16 products per K step
   (fn = hi + mid + lo, each bf16; x is exact in bf16; the products are exact, only the fp32
   accumulation rounds: as exact as an fp32 GEMM), or tf32x3 for fp16 streams. For T <= 4 the
   product is plain FMA in registers (no 16-row padding). At T=1, fn (1.5 MB fp32) dominates the
   bytes: ~0.4 us of HBM time; the two launches are latency-bound.
   Measured times against the reference and the floor: docs/performance.md (benchmarks/mhc_bench.py).

3. Expand (`HyperConnection.expand`, `expand_collapse_norm`): new[t,k,:] = post[t,k]*out[t,:] + sum_j comb[t,j,k]*streams[t,j,:]
   The reference runs T batched 4x4 GEMMs through cuBLAS (wmma 32x32 tiles) plus two elementwise
   kernels, rounding comb/post and every partial result to bf16. `_hc_expand_kernel`: one pass,
   fp32 math, one rounding to the streams dtype.
   Roofline: bytes = T*hc*D*e (streams) + T*D*e (out) + T*hc*D*e (new) + T*(hc + hc^2)*4
   = (2*hc + 1) * T*D*e; at T=8192, hc=4, D=4096, bf16: 604 MB -> 143 us at 4.23 TB/s.
   Measured times: docs/performance.md.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from .. import envs
from .dispatch import use_triton
from .rmsnorm import rms_norm
from .pdl import pdl_args, wait_for_prior_grid

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Read once, at import, which is when Triton decides whether the kernels below are interpreted.
_INTERPRET = envs.triton_interpret()
TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs


# ----------------------------------------------------------------------------- references

def hc_coefficients_ref(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference (and CPU path). mixes: [T, (2 + hc) * hc] fp32."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                    iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (post [T, hc] fp32, comb [T, hc, hc] fp32, collapsed [T, D])."""
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre, post, comb = hc_coefficients(mixes, base, scale, hc, iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_head_collapse_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                         hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse (HyperHead): fn [hc, hc*D], base [hc], scale [1] -> [T, D]."""
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand_ref(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """new[k] = post[k] * block_out + sum_j comb[j, k] * streams[j], in the streams dtype
    (as the oracle: comb and post rounded to it first)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _sinkhorn(logits, valid, eps, ITERS: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr):
        """softmax along ROW (the last index of comb[j, k]) + eps, then a normalisation along COL
        (over j) and ITERS - 1 (ROW, COL) pairs; masked entries stay 0."""
        logits = tl.where(valid, logits, float("-inf"))
        e = tl.exp(logits - tl.expand_dims(tl.max(logits, axis=ROW), ROW))
        e = tl.where(valid, e, 0.0)
        comb = e / tl.expand_dims(tl.sum(e, axis=ROW), ROW) + eps
        comb = tl.where(valid, comb, 0.0)
        comb = comb / (tl.expand_dims(tl.sum(comb, axis=COL), COL) + eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.expand_dims(tl.sum(comb, axis=ROW), ROW) + eps)
            comb = comb / (tl.expand_dims(tl.sum(comb, axis=COL), COL) + eps)
        return comb

    @triton.jit
    def _hc_coefficients_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, eps,
                                HC: tl.constexpr, HP: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr):
        wait_for_prior_grid(PDL)
        t = tl.program_id(0).to(tl.int64)
        width = (2 + HC) * HC
        row = mix_ptr + t * width
        i = tl.arange(0, HP)
        valid = i < HC
        s0 = tl.load(scale_ptr + 0)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m_pre = tl.load(row + i, mask=valid, other=0.0)
        m_post = tl.load(row + HC + i, mask=valid, other=0.0)
        pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + i, mask=valid, other=0.0)) + eps
        post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + HC + i, mask=valid, other=0.0))
        tl.store(pre_ptr + t * HC + i, pre, mask=valid)
        tl.store(post_ptr + t * HC + i, post, mask=valid)
        r = i[:, None]
        c = i[None, :]
        valid2 = (r < HC) & (c < HC)
        logits = tl.load(row + 2 * HC + r * HC + c, mask=valid2, other=0.0) * s2
        logits += tl.load(base_ptr + 2 * HC + r * HC + c, mask=valid2, other=0.0)
        comb = _sinkhorn(logits, valid2, eps, ITERS, 1, 0)
        tl.store(comb_ptr + t * HC * HC + r * HC + c, comb, mask=valid2)

    @triton.jit
    def mix_dot(acc, x_raw, w, SPLIT_BF16: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """acc + x @ w^T on the tensor cores, x [rows, k] in the streams dtype, w [MP, k] fp32.
        SPLIT_BF16 (bf16 x: exact in bf16) splits w into three bf16 parts hi + mid + lo (24 mantissa
        bits): the three bf16 products are exact and only the fp32 accumulation rounds. Otherwise
        fp32 operands with input_precision PREC. DOT_F32 (under the interpreter, whose bf16 dot is
        wrong): the bf16 parts go through fp32 dots, which gives the same exact products."""
        if SPLIT_BF16:
            xb = x_raw.to(tl.bfloat16)
            w_hi = w.to(tl.bfloat16)
            w_r = w - w_hi.to(tl.float32)
            w_mid = w_r.to(tl.bfloat16)
            w_lo = (w_r - w_mid.to(tl.float32)).to(tl.bfloat16)
            if DOT_F32:
                xf = xb.to(tl.float32)
                acc = tl.dot(xf, tl.trans(w_hi.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(w_mid.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(w_lo.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xb, tl.trans(w_hi), acc)
                acc = tl.dot(xb, tl.trans(w_mid), acc)
                acc = tl.dot(xb, tl.trans(w_lo), acc)
        else:
            acc = tl.dot(x_raw.to(tl.float32), tl.trans(w), acc, input_precision=PREC)
        return acc

    @triton.jit
    def mix_step(acc, acc3, sq, x_raw, w, FMA: tl.constexpr, SPLIT_BF16: tl.constexpr, PREC: tl.constexpr,
                 DOT_F32: tl.constexpr):
        """One K step of the partial mixes of x_raw [rows, k] (streams dtype) against w [MP, k]
        fp32: the sum of squares, and x @ w^T into acc3 [rows, MP, k] (FMA: elementwise, reduced
        once at the end) or acc [rows, MP] (`mix_dot`). Returns (acc, acc3, sq)."""
        x = x_raw.to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        if FMA:
            acc3 += x[:, None, :] * w[None, :, :]
        else:
            acc = mix_dot(acc, x_raw, w, SPLIT_BF16, PREC, DOT_F32)
        return acc, acc3, sq

    @triton.jit
    def store_partials(mix_ws_ptr, sq_ws_ptr, acc, acc3, sq, rows, rmask, m, pid_s, splits, MP: tl.constexpr,
                       FMA: tl.constexpr):
        """Store a program's partial mixes [rows, MP] and sums of squares at split pid_s."""
        if FMA:
            acc = tl.sum(acc3, axis=2)
        ws = rows * splits + pid_s
        tl.store(mix_ws_ptr + ws[:, None] * MP + m[None, :], acc, mask=rmask[:, None])
        tl.store(sq_ws_ptr + ws, sq, mask=rmask)

    @triton.jit(do_not_specialize=["num_tokens", "splits"])
    def _hc_mix_partial_kernel(x_ptr, fn_ptr, mix_ws_ptr, sq_ws_ptr, num_tokens, K, M, chunk, splits,
                               BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, FMA: tl.constexpr,
                               SPLIT_BF16: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        """Program (token tile, K chunk): partial sum of squares and partial x @ fn^T, fp32 accumulate.

        FMA: elementwise products accumulated in [BT, MP, BK] registers, one reduction at the end
        (few tokens: no padding of the token tile to the 16 rows a dot needs). Else a tensor-core
        dot (`mix_dot`: SPLIT_BF16, PREC, DOT_F32)."""
        wait_for_prior_grid(PDL)
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
        rmask = rows < num_tokens
        m = tl.arange(0, MP)
        mmask = m < M
        kk = tl.arange(0, BK)
        acc = tl.zeros([BT, MP], dtype=tl.float32)
        acc3 = tl.zeros([BT, MP, BK] if FMA else [1, 1, 1], dtype=tl.float32)
        sq = tl.zeros([BT], dtype=tl.float32)
        k_start = pid_s * chunk
        for k0 in range(k_start, k_start + chunk, BK):
            k = k0 + kk
            kmask = k < K
            x_raw = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            acc, acc3, sq = mix_step(acc, acc3, sq, x_raw, w, FMA, SPLIT_BF16, PREC, DOT_F32)
        store_partials(mix_ws_ptr, sq_ws_ptr, acc, acc3, sq, rows, rmask, m, pid_s, splits, MP, FMA)

    @triton.jit
    def _rms_factor(sq_ws_ptr, tt, s, splits, tsmask, K, norm_eps):
        """rsqrt(mean(x^2) + eps) [TB, 1] from the split partial sums of squares (in split order)."""
        sq = tl.sum(tl.load(sq_ws_ptr + tt[:, None] * splits + s[None, :], mask=tsmask, other=0.0), axis=1)
        return tl.rsqrt(sq / K + norm_eps)[:, None]

    @triton.jit(do_not_specialize=["num_tokens", "splits"])
    def _hc_finalize_kernel(x_ptr, mix_ws_ptr, sq_ws_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                            norm_w_ptr, num_tokens, D, K, splits, norm_eps, hc_eps, block_eps,
                            HC: tl.constexpr, HP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                            ITERS: tl.constexpr, HEAD: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr,
                            NORM: tl.constexpr, PDL: tl.constexpr):
        """Program (TB tokens, D block): reduce the split-K partials (fixed order), the rms factor,
        the `pre` coefficients and the pre-weighted collapse of its D block. NORM (one D block holds
        the whole row): then the block's RMSNorm with weight norm_w, rounded as `rms_norm` rounds
        (the collapse to the dtype, the normalised row, the weighted row).
        Unless HEAD, the grid has one D block more: its programs compute post and comb (Sinkhorn)
        beside the collapse instead of before it, which the next GEMM waits for (at batch 1 they made a
        layer's finalize take almost twice the head's, which has none)."""
        wait_for_prior_grid(PDL)
        tt = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
        tmask = tt < num_tokens
        pid_d = tl.program_id(1)
        s = tl.arange(0, SP)
        tsmask = tmask[:, None] & (s < splits)[None, :]
        ws = mix_ws_ptr + (tt[:, None] * splits + s[None, :]) * MP  # [TB, SP]
        i = tl.arange(0, HP)
        valid = i < HC
        pmask = tsmask[:, :, None] & valid[None, None, :]
        if pid_d < tl.num_programs(1) - (1 - HEAD):
            # The streams first: their load needs no partial, so its round trip overlaps the partials'.
            d = pid_d * BD + tl.arange(0, BD)
            dmask = d < D
            x = tl.load(x_ptr + tt[:, None, None] * K + i[None, :, None] * D + d[None, None, :],
                        mask=tmask[:, None, None] & valid[None, :, None] & dmask[None, None, :], other=0.0)
            r = _rms_factor(sq_ws_ptr, tt, s, splits, tsmask, K, norm_eps)
            m_pre = tl.sum(tl.load(ws[:, :, None] + i[None, None, :], mask=pmask, other=0.0), axis=1) * r
            s0 = tl.load(scale_ptr + 0).to(tl.float32)
            b_pre = tl.load(base_ptr + i, mask=valid, other=0.0).to(tl.float32)
            pre = tl.sigmoid(m_pre * s0 + b_pre[None, :]) + hc_eps
            pre = tl.where(valid[None, :], pre, 0.0)  # [TB, HP]
            out = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
            if NORM:
                y = out.to(out_ptr.dtype.element_ty).to(tl.float32)  # masked columns are 0
                rn = tl.rsqrt(tl.sum(y * y, axis=1) / D + block_eps)
                y = (y * rn[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
                out = y * tl.load(norm_w_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + tt[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=tmask[:, None] & dmask[None, :])
        elif not HEAD:
            r = _rms_factor(sq_ws_ptr, tt, s, splits, tsmask, K, norm_eps)
            s1 = tl.load(scale_ptr + 1).to(tl.float32)
            s2 = tl.load(scale_ptr + 2).to(tl.float32)
            m_post = tl.sum(tl.load(ws[:, :, None] + HC + i[None, None, :], mask=pmask, other=0.0), axis=1) * r
            b_post = tl.load(base_ptr + HC + i, mask=valid, other=0.0).to(tl.float32)
            post = 2.0 * tl.sigmoid(m_post * s1 + b_post[None, :])
            tl.store(post_ptr + tt[:, None] * HC + i[None, :], post, mask=tmask[:, None] & valid[None, :])
            # comb logits as a flat [HP * HP] index q = j * HP + k, then [TB, HP, HP]
            q = tl.arange(0, HP * HP)
            qj = q // HP
            qk = q % HP
            qvalid = (qj < HC) & (qk < HC)
            cidx = 2 * HC + qj * HC + qk
            m_comb = tl.sum(tl.load(ws[:, :, None] + cidx[None, None, :],
                                    mask=tsmask[:, :, None] & qvalid[None, None, :], other=0.0), axis=1) * r
            b_comb = tl.load(base_ptr + cidx, mask=qvalid, other=0.0).to(tl.float32)
            logits = tl.reshape(m_comb * s2 + b_comb[None, :], [TB, HP, HP])
            valid3 = (i[:, None] < HC) & (i[None, :] < HC)
            comb = _sinkhorn(logits, valid3[None, :, :], hc_eps, ITERS, 2, 1)
            cptr = comb_ptr + tt[:, None, None] * (HC * HC) + i[None, :, None] * HC + i[None, None, :]
            tl.store(cptr, comb, mask=tmask[:, None, None] & valid3[None, :, :])

    @triton.jit(do_not_specialize=["num_tokens"])
    def _hc_expand_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, num_tokens, D,
                          HC: tl.constexpr, HP: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
        """Program (TB tokens, D block): new[k, d] = post[k] * o[d] + sum_j comb[j, k] * s[j, d] (fp32)."""
        wait_for_prior_grid(PDL)
        tt = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
        tmask = tt < num_tokens
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = tmask[:, None] & (d < D)[None, :]  # [TB, BD]
        k = tl.arange(0, HP)
        kmask = tmask[:, None] & (k < HC)[None, :]  # [TB, HP]
        post = tl.load(post_ptr + tt[:, None] * HC + k[None, :], mask=kmask, other=0.0)
        o = tl.load(o_ptr + tt[:, None] * D + d[None, :], mask=dmask, other=0.0).to(tl.float32)
        acc = post[:, :, None] * o[:, None, :]
        for j in tl.static_range(HC):
            cj = tl.load(comb_ptr + tt[:, None] * (HC * HC) + j * HC + k[None, :], mask=kmask, other=0.0)
            sj = tl.load(s_ptr + (tt[:, None] * HC + j) * D + d[None, :], mask=dmask, other=0.0).to(tl.float32)
            acc += cj[:, :, None] * sj[:, None, :]
        tl.store(new_ptr + (tt[:, None, None] * HC + k[None, :, None]) * D + d[None, None, :],
                 acc.to(new_ptr.dtype.element_ty), mask=kmask[:, :, None] & dmask[:, None, :])


def hc_coefficients_triton(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mixes = mixes.float().contiguous()
    num_tokens = mixes.shape[0]
    pre = torch.empty(num_tokens, hc, device=mixes.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty(num_tokens, hc, hc, device=mixes.device, dtype=torch.float32)
    if num_tokens:
        hp = max(2, triton.next_power_of_2(hc))
        _hc_coefficients_kernel[(num_tokens,)](mixes, base.float().contiguous(), scale.float().contiguous(),
                                               pre, post, comb, eps, HC=hc, HP=hp, ITERS=iters, num_warps=1,
                                               **pdl_args(mixes.device))
    return pre, post, comb


def hc_coefficients(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if HAS_TRITON and use_triton("mhc", mixes):
        return hc_coefficients_triton(mixes, base, scale, hc, iters, eps)
    return hc_coefficients_ref(mixes, base, scale, hc, iters, eps)


# ----------------------------------------------------------------------------- launch configs

def row_config(num_tokens: int, dim: int) -> tuple[int, int]:
    """(TB tokens, BD columns) per program of the finalize and expand kernels: a D block 1024 wide,
    narrower (>= 256) when the tokens alone give too few programs; small D packs several tokens
    into one program (about 1024 columns each)."""
    block = min(1024, triton.next_power_of_2(max(dim, 16)))
    while block > 256 and num_tokens * triton.cdiv(dim, block) < TARGET_PROGRAMS:
        block //= 2
    tb = max(1, min(1024 // block, triton.next_power_of_2(num_tokens)))
    return tb, block


def finalize_warps(tb: int, hc: int, bd: int) -> int:
    """Warps of the finalize kernel: one for a small tile (the Sinkhorn's reductions then stay in
    one warp: the decode case), up to 4 for 4K-element tiles."""
    return max(1, min(4, tb * triton.next_power_of_2(hc) * bd // 1024))


def mix_config(num_tokens: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch of the mix kernel, from static shapes only: token tile BT, K step BK, the number of
    K chunks (about TARGET_PROGRAMS programs, at most 128 chunks) and the product's method: FMA
    for up to 4 tokens, else a tensor-core dot (three exact bf16 products for bf16 streams,
    `tf32x3` for fp16). See benchmarks/mhc_bench.py --sweep for the alternatives' times."""
    fma = num_tokens <= 4
    if fma:
        bt = triton.next_power_of_2(num_tokens)
        bk, warps = (64 if bt <= 2 else 32), 4
    elif num_tokens <= 2048:  # few token tiles: fn (1.5 MB) is re-read once per tile
        bt, bk, warps = (16 if num_tokens <= 16 else 64), 64, 4
    else:
        bt, bk, warps = 128, 64, 8
    tiles = triton.cdiv(num_tokens, bt)
    want = max(1, min(128, triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(k, bk)))
    chunk = triton.cdiv(triton.cdiv(k, want), bk) * bk
    return {"BT": bt, "BK": bk, "chunk": chunk, "splits": triton.cdiv(k, chunk), "num_warps": warps, "fma": fma,
            "prec": "bf16x3" if dtype == torch.bfloat16 else "tf32x3"}


def _collapse_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                     iters: int, hc_eps: float, norm_eps: float, head: bool, config: dict | None = None,
                     norm_weight: torch.Tensor | None = None, block_eps: float = 0.0):
    """The split-K mixes, then the finalize (with `norm_weight`: followed by the block's RMSNorm)."""
    x = streams.contiguous()
    partials = mix_partials_triton(x, fn, config) if x.shape[0] else None
    return finalize_triton(x, partials, base, scale, hc, iters, hc_eps, norm_eps, head, norm_weight, block_eps)


def mix_partials_triton(x: torch.Tensor, fn: torch.Tensor, config: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials of contiguous streams x [T, hc, D]: mixes [T, splits, MP] and sums of
    squares [T, splits] (fp32)."""
    num_tokens, hc, dim = x.shape
    k = hc * dim
    m = fn.shape[0]
    cfg = dict(mix_config(num_tokens, k, x.dtype), **(config or {}))
    split_bf16 = cfg["prec"] == "bf16x3"
    if split_bf16 and x.dtype != torch.bfloat16:
        raise ValueError("the bf16x3 product needs bf16 streams")
    mp = mix_width(m)
    splits = cfg["splits"]
    mix_ws = torch.empty(num_tokens, splits, mp, device=x.device, dtype=torch.float32)
    sq_ws = torch.empty(num_tokens, splits, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(num_tokens, cfg["BT"]), splits)
    _hc_mix_partial_kernel[grid](x, fn.contiguous(), mix_ws, sq_ws, num_tokens, k, m, cfg["chunk"], splits,
                                 BT=cfg["BT"], BK=cfg["BK"], MP=mp, FMA=cfg["fma"], SPLIT_BF16=split_bf16,
                                 PREC="ieee" if split_bf16 else cfg["prec"], DOT_F32=_INTERPRET,
                                 num_warps=cfg["num_warps"], **pdl_args(x.device))
    return mix_ws, sq_ws


def mix_width(m: int) -> int:
    """Columns of a partial-mixes row: the (2 + hc) * hc mixes padded to a power of two >= 16."""
    return max(16, triton.next_power_of_2(m))


def finalize_triton(x: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor] | None, base: torch.Tensor,
                    scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float, head: bool,
                    norm_weight: torch.Tensor | None = None, block_eps: float = 0.0, norm_warps: int | None = None):
    """(post, comb, out) from the streams x [T, hc, D] and their partials (None when T = 0): out is
    the collapse, or with `norm_weight` the block's RMSNorm of it (one program per token, `norm_warps`
    warps: by default 8 for a 4 x 4096 row)."""
    num_tokens, _, dim = x.shape
    dev = x.device
    out = torch.empty(num_tokens, dim, device=dev, dtype=x.dtype)
    post = comb = None
    if not head:
        post = torch.empty(num_tokens, hc, device=dev, dtype=torch.float32)
        comb = torch.empty(num_tokens, hc, hc, device=dev, dtype=torch.float32)
    if num_tokens == 0:
        return post, comb, out
    mix_ws, sq_ws = partials
    splits, mp = mix_ws.shape[1], mix_ws.shape[2]
    if norm_weight is None:
        tb, bd = row_config(num_tokens, dim)
        warps = finalize_warps(tb, hc, bd)
    else:
        tb, bd = 1, triton.next_power_of_2(dim)
        warps = norm_warps or max(1, min(8, bd * triton.next_power_of_2(hc) // 2048))
    coefficient_blocks = 0 if head else 1  # see the kernel: post and comb on programs of their own
    _hc_finalize_kernel[(triton.cdiv(num_tokens, tb), triton.cdiv(dim, bd) + coefficient_blocks)](
        x, mix_ws, sq_ws, base.contiguous(), scale.contiguous(), post if post is not None else out,
        comb if comb is not None else out, out, norm_weight if norm_weight is not None else out,
        num_tokens, dim, hc * dim, splits, norm_eps, hc_eps, block_eps,
        HC=hc, HP=max(2, triton.next_power_of_2(hc)), MP=mp, SP=max(2, triton.next_power_of_2(splits)),
        ITERS=iters, HEAD=head, TB=tb, BD=bd, NORM=norm_weight is not None, num_warps=warps, **pdl_args(x.device))
    return post, comb, out


def hc_collapse_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                       iters: int, hc_eps: float, norm_eps: float,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _collapse_triton(streams, fn, base, scale, hc, iters, hc_eps, norm_eps, False, config)


def hc_head_collapse_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                            hc_eps: float, norm_eps: float, config: dict | None = None) -> torch.Tensor:
    return _collapse_triton(streams, fn, base, scale, streams.shape[1], 1, hc_eps, norm_eps, True, config)[2]


def hc_expand_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> torch.Tensor:
    num_tokens, hc, dim = streams.shape
    streams = streams.contiguous()
    new = torch.empty_like(streams)
    if num_tokens:
        tb, bd = row_config(num_tokens, dim)
        _hc_expand_kernel[(triton.cdiv(num_tokens, tb), triton.cdiv(dim, bd))](
            streams, block_out.contiguous(), post.float().contiguous(), comb.float().contiguous(), new,
            num_tokens, dim, HC=hc, HP=max(2, triton.next_power_of_2(hc)), TB=tb, BD=bd, num_warps=4,
            **pdl_args(streams.device))
    return new


# ----------------------------------------------------------------------------- dispatch

def _fused(streams: torch.Tensor) -> bool:
    return HAS_TRITON and streams.dtype in FUSED_DTYPES and use_triton("mhc", streams)


def hc_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (post [T, hc] fp32, comb [T, hc, hc] fp32, collapsed [T, D])."""
    if _fused(streams):
        return hc_collapse_triton(streams, fn, base, scale, hc, iters, hc_eps, norm_eps)
    return hc_collapse_ref(streams, fn, base, scale, hc, iters, hc_eps, norm_eps)


def hc_head_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     hc_eps: float, norm_eps: float) -> torch.Tensor:
    if _fused(streams):
        return hc_head_collapse_triton(streams, fn, base, scale, hc_eps, norm_eps)
    return hc_head_collapse_ref(streams, fn, base, scale, hc_eps, norm_eps)


def hc_expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if _fused(streams) and block_out.dtype == streams.dtype:
        return hc_expand_triton(streams, block_out, post, comb)
    return hc_expand_ref(streams, block_out, post, comb)
