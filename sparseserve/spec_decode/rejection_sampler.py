"""Verification of drafted tokens: greedy prefix matching, or rejection sampling that
preserves the target distribution exactly (Leviathan et al. / Chen et al.).

Per request with drafts d_1..d_k (-1 = no draft) drawn from q_1..q_k, and target
distributions p_1..p_{k+1} at the k+1 verified positions:
  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), stop at the first rejection;
  after a rejection at i the next token is drawn from norm(max(p_i - q_i, 0));
  after k acceptances a bonus token is drawn from p_{k+1}.
Greedy requests accept d_i iff it is the argmax of p_i, and the next token is an argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [B, k + 1] int64: accepted drafts, then the next token, then -1


def verify(target_probs: torch.Tensor, target_greedy: torch.Tensor, drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, greedy: torch.Tensor, accept_uniform: torch.Tensor,
           next_exp_noise: torch.Tensor) -> VerifyResult:
    """target_probs [B, k+1, V] (filtered, rows sum to 1); target_greedy [B, k+1] argmax of the raw logits;
    drafts [B, k]; draft_probs [B, k, V] (None when every request is greedy); greedy [B] bool;
    accept_uniform [B, k] U(0,1); next_exp_noise [B, k+1, V] Exp(1) noise for the next-token draws."""
    batch, k = drafts.shape
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    if k:
        p_draft = target_probs[:, :k].gather(2, safe.unsqueeze(-1)).squeeze(-1)
        if draft_probs is not None:
            q_draft = draft_probs.gather(2, safe.unsqueeze(-1)).squeeze(-1)
            ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.zeros_like(p_draft))
            sampled_ok = accept_uniform < ratio.clamp(max=1.0)
        else:
            sampled_ok = torch.zeros_like(has_draft)
        greedy_ok = safe == target_greedy[:, :k]
        ok = torch.where(greedy.unsqueeze(1), greedy_ok, sampled_ok) & has_draft
        num_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=drafts.device)
    rows = torch.arange(batch, device=drafts.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if draft_probs is not None and k:
        # After a rejection at position a, draw from the residual max(p - q, 0).
        rejected = num_accepted < has_draft.long().sum(dim=1)
        q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)]
        residual = (p_next - q_at).clamp(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected.unsqueeze(1), residual, p_next)
    sampled_next = (p_next / next_exp_noise[rows, num_accepted]).argmax(dim=-1)
    next_token = torch.where(greedy, target_greedy[rows, num_accepted], sampled_next)
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=drafts.device)
    slot = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    if k:
        tokens[:, :k] = torch.where(slot[:, :k] < num_accepted.unsqueeze(1), safe, tokens[:, :k])
    tokens.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return VerifyResult(num_accepted, tokens)
