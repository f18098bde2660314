"""MoE expert selection: scores, correction bias, top-k (ties to the lower expert id), hash
experts, normalisation. The plain-PyTorch reference and one fused Triton launch per call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

from .dispatch import enabled_on  # noqa: E402 (after the optional Triton import)
from .pdl import pdl_args, wait_for_prior_grid  # noqa: E402


def score_experts(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(router_logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(router_logits)
    if scoring_func == "softmax":
        return torch.softmax(router_logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}; expected sqrtsoftplus, sigmoid or softmax")


def select_experts_ref(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts per token and their weights.

    router_logits: [T, E]. With hash_ids ([T, k], from tid2eid[token]) the experts are given;
    otherwise the top-k of scores + correction_bias. Weights are the chosen scores,
    normalised to sum 1, times routed_scaling_factor. Returns (weights fp32 [T, k], ids int64 [T, k]).
    """
    scores = score_experts(router_logits, scoring_func)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        biased = scores if correction_bias is None else scores + correction_bias
        ids = torch.topk(biased, top_k, dim=-1).indices
    weights = scores.gather(1, ids).float()
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids



_SCORING_IDS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}

if HAS_TRITON:

    @triton.jit
    def _round_like(x, ROUND: tl.constexpr):
        """fp32 -> the logits dtype -> fp32, as torch rounds each op's output. bf16 by bit ops
        (round to nearest even) since the interpreter's cast truncates; fp16 by a cast."""
        if ROUND == 1:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def _select_experts_kernel(
        logits_ptr, bias_ptr, hash_ptr, token_ptr, weights_ptr, ids_ptr,
        num_experts, stride_l, scale,
        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SCORING: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_HASH: tl.constexpr, ROUND: tl.constexpr, NUM_PARTS: tl.constexpr = 0,
        HASH_BY_TOKEN: tl.constexpr = False,
        PDL: tl.constexpr = 0,
    ):
        # One program per token: score, (bias), top-k by repeated max, gather, normalise.
        # NUM_PARTS > 0: logits_ptr holds fp32 partial logits [NUM_PARTS, T, E] (kernels/router.py),
        # summed here in part order and rounded to the logits dtype, as the GEMM's output is.
        # HASH_BY_TOKEN: hash_ptr is the whole table tid2eid [V, k], read at the token's id (token_ptr)
        # here instead of by a gather kernel before this one.
        wait_for_prior_grid(PDL)
        row = tl.program_id(0).to(tl.int64)
        hash_row = row
        if HASH_BY_TOKEN:
            hash_row = tl.load(token_ptr + row).to(tl.int64)
        e = tl.arange(0, E_PAD)
        valid = e < num_experts
        if NUM_PARTS > 0:
            num_tokens = tl.num_programs(0)
            x = tl.zeros([E_PAD], dtype=tl.float32)
            for part in tl.static_range(NUM_PARTS):
                x += tl.load(logits_ptr + (part * num_tokens + row) * num_experts + e, mask=valid, other=0.0)
            x = _round_like(x, ROUND)
        else:
            x = tl.load(logits_ptr + row * stride_l + e, mask=valid, other=0.0).to(tl.float32)
        if SCORING == 0:
            ex = tl.exp(tl.minimum(x, 20.0))
            u = 1.0 + ex
            # log1p(ex) without the cancellation of log(1 + ex) for small ex; torch's threshold 20.
            lp = tl.where(u == 1.0, ex, tl.log(u) * ex / tl.where(u == 1.0, 1.0, u - 1.0))
            sp = tl.where(x > 20.0, x, lp)
            # torch rounds each op's output to the logits dtype: do the same (no-op for fp32).
            sp = _round_like(sp, ROUND)
            scores = tl.sqrt(sp)
        elif SCORING == 1:
            scores = tl.sigmoid(x)
        else:
            xm = tl.where(valid, x, float("-inf"))
            p = tl.exp(xm - tl.max(xm, 0))
            scores = p / tl.sum(p, 0)
        scores = _round_like(scores, ROUND)
        sel = scores
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        sel = tl.where(valid, sel, float("-inf"))
        kk = tl.arange(0, K_PAD)
        w_vec = tl.zeros([K_PAD], dtype=tl.float32)
        id_vec = tl.zeros([K_PAD], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            if HAS_HASH:
                idx = tl.load(hash_ptr + hash_row * TOP_K + j).to(tl.int32)
            else:
                best = tl.max(sel, 0)
                idx = tl.min(tl.where(sel == best, e, E_PAD), 0)  # tie rule: the lower expert id
                sel = tl.where(e == idx, float("-inf"), sel)
            w_j = tl.sum(tl.where(e == idx, scores, 0.0), 0)
            w_vec = tl.where(kk == j, w_j, w_vec)
            id_vec = tl.where(kk == j, idx, id_vec)
        w_vec = w_vec / (tl.sum(w_vec, 0) + 1e-20) * scale
        out_mask = kk < TOP_K
        tl.store(weights_ptr + row * TOP_K + kk, w_vec, mask=out_mask)
        tl.store(ids_ptr + row * TOP_K + kk, id_vec.to(tl.int64), mask=out_mask)


def select_experts_triton(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts_ref in one launch. Chosen ids come in descending biased score, ties to the
    lower expert id (torch.topk leaves ties unordered, so ids may differ there only)."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        launch_select_experts(router_logits, router_logits.stride(0), router_logits.dtype, num_experts, weights, ids,
                              top_k, scoring_func, routed_scaling_factor, correction_bias, hash_ids)
    return weights, ids


def launch_select_experts(
    logits: torch.Tensor,
    stride_l: int,
    logits_dtype: torch.dtype,
    num_experts: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    token_ids: torch.Tensor | None = None,
    num_parts: int = 0,
) -> None:
    """The selection kernel, one program per row of `weights`/`ids` [T, k] (written). logits: [T, E]
    rows `stride_l` apart, or with num_parts > 0 fp32 partial logits [num_parts, T, E] (kernels/router.py)
    summed and rounded to `logits_dtype`. hash_ids: the experts per token [T, k], or with token_ids [T]
    the whole table [V, k], read at each token's id."""
    if hash_ids is not None:
        hash_ids = hash_ids.contiguous()
        top_k = hash_ids.shape[1]
    by_token = hash_ids is not None and token_ids is not None
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    _select_experts_kernel[(weights.shape[0],)](
        logits, bias, hash_ids if hash_ids is not None else ids, token_ids.contiguous() if by_token else ids,
        weights, ids,
        num_experts, stride_l, float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=max(16, triton.next_power_of_2(num_experts)),
        SCORING=_SCORING_IDS[scoring_func], HAS_BIAS=correction_bias is not None and hash_ids is None,
        HAS_HASH=hash_ids is not None, ROUND={torch.bfloat16: 1, torch.float16: 2}.get(logits_dtype, 0),
        NUM_PARTS=num_parts, HASH_BY_TOKEN=by_token, num_warps=4, **pdl_args(logits.device)
    )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: one fused Triton launch on CUDA, the reference elsewhere (both graph-safe)."""
    if (
        HAS_TRITON
        and router_logits.is_cuda
        and scoring_func in _SCORING_IDS
        and router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (hash_ids is not None or top_k <= router_logits.shape[1])
        and enabled_on("moe", router_logits.device)
    ):
        return select_experts_triton(
            router_logits, top_k, scoring_func, routed_scaling_factor, correction_bias, hash_ids
        )
    return select_experts_ref(router_logits, top_k, scoring_func, routed_scaling_factor, correction_bias, hash_ids)
