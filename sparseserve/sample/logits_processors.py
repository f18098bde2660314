"""Per-request logits processing before sampling, with vLLM's semantics and order:
the grammar's token bitmask, allowed_token_ids, bad_words and min_tokens bans, logit_bias,
then the repetition, frequency and presence penalties.

The sampler runs after the forward (outside any captured graph), so this is eager device work
on the step's logits rows. It costs nothing for rows that use none of it: the runner calls
`process_logits` only when a row needs it, and each feature launches work only when a row of the
batch uses it. Per-row state is rebuilt from the host's token lists every step (counts by one
`index_put_` over the flat token ids), so preemption (recompute), speculation (a verify row counts
the drafts before it) and async scheduling (a pending token is read from the device) stay correct
without incremental device state to keep in sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams
from ..model.host_copy import to_device


@dataclass(slots=True)
class LogitsRow:
    """What one logits row's processing needs."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]  # the output tokens before this row's position (drafts of a verify row included)
    pending: int | None = None  # index in `pending_tokens` of one more output token, still on the device
    grammar: object | None = None  # a structured_output.GrammarState
    grammar_prefix: list[int] = field(default_factory=list)  # tokens to advance the grammar by (drafts)
    prompt_mask: torch.Tensor | None = None  # bool [V] on the device: the prompt's tokens (repetition penalty)


def stop_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """Tokens min_tokens holds back: EOS (unless ignore_eos) and stop_token_ids, as vLLM defines it."""
    ids = list(params.stop_token_ids or [])
    if eos_token_id is not None and not params.ignore_eos:
        ids.append(eos_token_id)
    return ids


def banned_bad_words(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's bad words: a one-token word is always banned; the last token of a longer word is
    banned when the output ends with the word's other tokens."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def process_logits(logits: torch.Tensor, rows: list[LogitsRow], eos_token_id: int | None,
                   pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A processed copy of fp32 `logits` [R, V] (row i processed as `rows[i]` says)."""
    device = logits.device
    vocab = logits.shape[1]
    out = logits.clone()
    grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
    if grammar_rows:
        from ..structured_output.bitmask import apply_bitmask, fill_bitmask

        mask = fill_bitmask([(rows[i].grammar, rows[i].grammar_prefix) for i in grammar_rows], vocab)
        apply_bitmask(out, to_device(grammar_rows, device), to_device(mask, device, torch.int32))
    allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool)
        for n, i in enumerate(allowed_rows):
            ids = [t for t in rows[i].params.allowed_token_ids if t < vocab]
            keep[n, ids] = True
        sel = to_device(allowed_rows, device)
        out[sel] = out[sel].masked_fill(~to_device(keep, device, torch.bool), float("-inf"))
    # Bans (bad words, min_tokens) and biases, each as one scatter over (row, token) pairs.
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.bad_words_token_ids:
            for t in banned_bad_words(p.bad_words_token_ids, r.output):
                ban_r.append(i)
                ban_t.append(t)
        if p.min_tokens and len(r.output) + (r.pending is not None) < p.min_tokens:
            for t in stop_ids(p, eos_token_id):
                ban_r.append(i)
                ban_t.append(t)
        if p.logit_bias:
            for t, v in p.logit_bias.items():
                if t < vocab:
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(v)
    if ban_r:
        out[to_device(ban_r, device), to_device(ban_t, device)] = float("-inf")
    if bias_r:
        out.index_put_((to_device(bias_r, device), to_device(bias_t, device)),
                       to_device(bias_v, device, torch.float32), accumulate=True)
    _apply_penalties(out, rows, pending_tokens)
    return out


def _apply_penalties(out: torch.Tensor, rows: list[LogitsRow], pending_tokens: torch.Tensor | None) -> None:
    pen = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty
           or r.params.repetition_penalty != 1.0]
    if not pen:
        return
    device, vocab = out.device, out.shape[1]
    flat: list[int] = []  # n * vocab + token over the output tokens of penalised rows
    for n, i in enumerate(pen):
        base = n * vocab
        flat += [base + t for t in rows[i].output]
    flat_t = to_device(flat, device)
    pend = [(n, rows[i].pending) for n, i in enumerate(pen) if rows[i].pending is not None]
    if pend:  # async scheduling: the last output token is still on the device
        sel = to_device([s for _, s in pend], device)
        base = to_device([n * vocab for n, _ in pend], device)
        flat_t = torch.cat([flat_t, base + pending_tokens.index_select(0, sel)])
    counts = torch.zeros(len(pen) * vocab, device=device, dtype=torch.float32)
    counts.index_put_((flat_t,), torch.ones_like(flat_t, dtype=torch.float32), accumulate=True)
    counts = counts.view(len(pen), vocab)
    sel = to_device(pen, device)
    logits = out.index_select(0, sel)
    params = [rows[i].params for i in pen]
    # One copy for the three per-row factors.
    rp, fp, pp = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                            [p.presence_penalty for p in params]], device, torch.float32).unsqueeze(2)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        # A row without the repetition penalty divides by 1, so its mask does not matter: one blank serves them.
        blank = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen |= torch.stack([prompt_seen_mask(rows[i], vocab, device) if rows[i].params.repetition_penalty != 1.0
                             else blank for i in pen])
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if any(p.frequency_penalty for p in params):
        logits = logits - fp * counts
    if any(p.presence_penalty for p in params):
        logits = logits - pp * (counts > 0).float()
    out.index_copy_(0, sel, logits)


def prompt_seen_mask(row: LogitsRow, vocab: int, device: torch.device) -> torch.Tensor:
    """bool [vocab]: the tokens of the row's prompt (the runner caches it per request, so a prompt
    is not re-read every step)."""
    if row.prompt_mask is not None:
        return row.prompt_mask
    return build_prompt_mask(row.prompt, vocab, device)


def build_prompt_mask(prompt: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [t for t in prompt if t < vocab]
    if ids:
        mask[to_device(ids, device)] = True
    return mask
