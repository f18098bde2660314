"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Randomness is counter-based: the noise for a request's n-th sampled token is a hash of
(request seed, n, token id), so a seed gives the same output whatever else is batched with
it, and no per-request generator or host sync is needed. A sample is the argmax of
probs / Exp(1) noise (the exponential race), which draws exactly from the filtered
distribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values < 2^32 (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) [B, vocab] from (seed, counter, token id), deterministic on any device."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    h = _mix32((seeds.unsqueeze(1) & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((counters.unsqueeze(1) * 0x27D4EB2F) & _MASK32))
    h = _mix32(h ^ ((token * 0x165667B1) & _MASK32))
    return ((h >> 8).float() + 0.5) / float(1 << 24)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one batch, on the device."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64 index of the token being sampled
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_greedy: bool


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; returns probabilities (rows sum to 1)."""
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    scaled = logits / temp.unsqueeze(1)
    if st.any_top_k:
        vocab = scaled.shape[1]
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab)).clamp(max=vocab)
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if st.any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= st.top_p.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if st.any_min_p:
        threshold = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Token ids [B] (int64) for fp32 logits [B, V]."""
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy
    probs = filtered_probs(logits, st)
    exp_noise = -torch.log(uniform_noise(st.seeds, st.counters, logits.shape[1]))
    sampled = (probs / exp_noise).argmax(dim=-1)
    return torch.where(st.temperature > 0, sampled, greedy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """Raw-model logprobs: (logprob of `tokens` [B], their rank [B] (1 = best),
    top ids [B, num_top], top logprobs [B, num_top])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    rank = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top = logprobs.topk(num_top, dim=-1) if num_top > 0 else None
    top_ids = top.indices if top is not None else tokens.new_zeros((tokens.shape[0], 0))
    top_lp = top.values if top is not None else logprobs.new_zeros((tokens.shape[0], 0))
    return chosen, rank, top_ids, top_lp
