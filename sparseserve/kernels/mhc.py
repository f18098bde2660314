"""mHC mixing coefficients: from the per-token mix logits to (pre, post, comb).

    pre  = sigmoid(m_pre * s0 + b_pre) + eps
    post = 2 * sigmoid(m_post * s1 + b_post)
    comb = Sinkhorn(softmax_row(m_comb * s2 + b_comb) + eps)   (hc x hc, fp32)

The Sinkhorn projection is `iters` alternating column/row normalisations of a tiny matrix:
in plain PyTorch that is ~6 kernels per iteration (over 100 per sub-block at 20 iterations),
all launch-bound. The Triton kernel does one token's whole projection in registers.

Roofline: per token (2 + hc) * hc fp32 in, same out; FLOPs ~ 4 * hc^2 * iters. Launch-bound.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


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


if HAS_TRITON:

    @triton.jit
    def _hc_coefficients_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, eps,
                                HC: tl.constexpr, HP: tl.constexpr, ITERS: tl.constexpr):
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
        logits = tl.where(valid2, logits, float("-inf"))
        row_max = tl.max(logits, axis=1)
        e = tl.exp(logits - row_max[:, None])
        e = tl.where(valid2, e, 0.0)
        comb = e / tl.sum(e, axis=1)[:, None] + eps
        comb = tl.where(valid2, comb, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
        tl.store(comb_ptr + t * HC * HC + r * HC + c, comb, mask=valid2)


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
                                               pre, post, comb, eps, HC=hc, HP=hp, ITERS=iters, num_warps=1)
    return pre, post, comb


def hc_coefficients(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if HAS_TRITON and use_triton("mhc", mixes):
        return hc_coefficients_triton(mixes, base, scale, hc, iters, eps)
    return hc_coefficients_ref(mixes, base, scale, hc, iters, eps)
