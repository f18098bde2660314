"""Routed mixture-of-experts: expert selection and the grouped SwiGLU expert computation.

Roofline (T tokens, top-k, E_touched distinct experts, D hidden, I intermediate):
bytes = E_touched * 3 * I * D * 2 (bf16 weights) + activations; FLOPs = T * k * 6 * D * I.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    topk_weights: [T, k] fp32; topk_ids: [T, k]. Returns [T, D] in x's dtype.
    """
    num_tokens, hidden = x.shape
    inter = w_down.shape[2]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        sel = flat_ids == expert
        tokens = flat_tokens[sel]
        gate_up = x[tokens] @ w_gate_up[expert].t()
        act = swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        y = (act @ w_down[expert].t()).float() * flat_weights[sel].unsqueeze(1)
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Dispatch: the Triton grouped kernel on CUDA, the reference elsewhere."""
    return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, swiglu_limit)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts_ref(router_logits, top_k, scoring_func, routed_scaling_factor, correction_bias, hash_ids)
