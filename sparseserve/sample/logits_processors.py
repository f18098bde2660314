"""Per-request logits processing before sampling, with vLLM's semantics and order:
the grammar's token bitmask, allowed_token_ids, bad_words and min_tokens bans, logit_bias,
then the repetition, frequency and presence penalties.

The sampler runs after the forward (outside any captured graph), so this is eager device work
on the step's logits rows. It costs nothing for rows that use none of it: the runner calls
`process_logits` only when a row needs it, only the rows that need it are processed, and each
feature launches work only when a row of the batch uses it.

A `LogitsPlan` prepares the processing of a fixed list of rows once: the rows' order (grammar
rows first, then the penalised rows, so both are slices), the static masks (allowed_token_ids,
one-token bad words), the biases and the penalty factors on the device, and the penalised rows'
output-token counts, kept on the device and brought up to date each step by one scatter of the
tokens the host has added since, or, under async scheduling, of the pending token read from the
device tokens (the host holds it by the next step; a row whose counted tokens the host does not
hold, as after a failed step, is counted again). The runner keeps one plan per batch composition
(sparseserve/worker/sampling_state.py); a list of rows gets a plan for the one call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.host_copy import to_device
from ..sampling_params import SamplingParams


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
    # What the row's state belongs to (the runner's request): a plan built after this one carries the
    # row's penalty counts over when the same owner is in it. None: nothing is carried.
    owner: object | None = None


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


def has_penalty(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def process_logits(logits: torch.Tensor, rows: list[LogitsRow] | LogitsPlan, eos_token_id: int | None,
                   pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A processed copy of fp32 `logits` [R, V]: row i processed as `rows[i]` says, or as a plan
    (built for R rows of this width) says."""
    if isinstance(rows, LogitsPlan):
        return rows.apply(logits, pending_tokens)
    index = [i for i, r in enumerate(rows) if r.grammar is not None or r.params.needs_logits_processing]
    plan = LogitsPlan([rows[i] for i in index], index, len(rows), logits.shape[1], logits.device, eos_token_id)
    return plan.apply(logits, pending_tokens)


class LogitsPlan:
    """The processing of `rows`, which are rows `row_index` of a [num_rows, vocab] logits tensor
    (the other rows are left as they are). `previous`: the plan this one replaces (rows with the
    same owner keep their penalty counts); `staging`: reused grammar bitmask buffers."""

    def __init__(self, rows: list[LogitsRow], row_index: list[int], num_rows: int, vocab: int,
                 device: torch.device, eos_token_id: int | None, previous: LogitsPlan | None = None,
                 staging=None) -> None:
        self.vocab, self.device, self.num_rows, self.staging = vocab, device, num_rows, staging
        # Grammar rows first, penalised rows next (the two overlap): both are slices of the processed rows.
        groups: tuple[list, ...] = ([], [], [], [])
        for r, i in zip(rows, row_index):
            pen = has_penalty(r.params)
            groups[(0 if not pen else 1) if r.grammar is not None else (2 if pen else 3)].append((r, i))
        ordered = [x for group in groups for x in group]
        self.rows = [r for r, _ in ordered]
        index = [i for _, i in ordered]
        self.sel = None if index == list(range(num_rows)) else to_device(index, device)
        self.num_grammar = len(groups[0]) + len(groups[1])
        self.pen_start, self.pen_end = len(groups[0]), len(groups[0]) + len(groups[1]) + len(groups[2])
        self._bits = None  # int32 [32] on the device (bit i set in word i), made at the first grammar row
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._static_masks()
        self._dynamic = []  # (row position, multi-token bad words, min_tokens' stop ids)
        for n, r in enumerate(self.rows):
            words = [w for w in r.params.bad_words_token_ids if len(w) > 1]
            stops = stop_ids(r.params, eos_token_id) if r.params.min_tokens else []
            if words or stops:
                self._dynamic.append((n, words, stops))
        self._penalty_tensors(previous)

    # ---- built once ----
    def _static_masks(self) -> None:
        """Bans that do not change (allowed_token_ids, one-token bad words) as one bool mask, and the
        biases as one (flat index, value) scatter."""
        vocab = self.vocab
        ban = None
        bias_idx, bias_val = [], []
        for n, r in enumerate(self.rows):
            p = r.params
            singles = [w[0] for w in p.bad_words_token_ids if len(w) == 1 and w[0] < vocab]
            if p.allowed_token_ids is not None or singles:
                if ban is None:
                    ban = torch.zeros(len(self.rows), vocab, dtype=torch.bool)
                if p.allowed_token_ids is not None:
                    ban[n] = True
                    ban[n, [t for t in p.allowed_token_ids if t < vocab]] = False
                ban[n, singles] = True
            for t, v in (p.logit_bias or {}).items():
                if t < vocab:
                    bias_idx.append(n * vocab + t)
                    bias_val.append(v)
        self._ban = to_device(ban, self.device, torch.bool) if ban is not None else None
        self._bias = ((to_device(bias_idx, self.device), to_device(bias_val, self.device, torch.float32))
                      if bias_idx else None)

    def _penalty_tensors(self, previous: LogitsPlan | None) -> None:
        pen = self.rows[self.pen_start:self.pen_end]
        self._pen_rows = pen
        if not pen:
            return
        device, vocab = self.device, self.vocab
        params = [r.params for r in pen]
        # One copy for the three per-row factors.
        self._rp, self._fp, self._pp = to_device(
            [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
             [p.presence_penalty for p in params]], device, torch.float32).unsqueeze(2)
        self._any_rep = any(p.repetition_penalty != 1.0 for p in params)
        self._any_freq = any(p.frequency_penalty for p in params)
        self._any_pres = any(p.presence_penalty for p in params)
        self._prompt_seen = None
        if self._any_rep:
            # A row without the repetition penalty divides by 1, so its mask does not matter: one blank serves them.
            blank = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._prompt_seen = torch.stack([prompt_seen_mask(r, vocab, device) if r.params.repetition_penalty != 1.0
                                             else blank for r in pen])
        # counts[n] is the histogram of row n's first counted[n] output tokens (the last one may be a
        # pending token counted from the device: the host holds it by the next step).
        self._counts = torch.zeros(len(pen), vocab, dtype=torch.float32, device=device)
        self._counted = [0] * len(pen)
        self._pending_key: list | None = None
        if previous is not None and previous._pen_rows and previous.vocab == vocab:
            old = {id(r.owner): j for j, r in enumerate(previous._pen_rows) if r.owner is not None}
            new_pos, old_pos = [], []
            for n, r in enumerate(pen):
                j = old.get(id(r.owner)) if r.owner is not None else None
                if j is not None:
                    new_pos.append(n)
                    old_pos.append(j)
                    self._counted[n] = previous._counted[j]
            if new_pos:
                self._counts.index_copy_(0, to_device(new_pos, device),
                                         previous._counts.index_select(0, to_device(old_pos, device)))

    # ---- every step ----
    def apply(self, logits: torch.Tensor, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if not self.rows:
            return logits.clone()
        vocab = self.vocab
        sub = logits.clone() if self.sel is None else logits.index_select(0, self.sel)
        if self.num_grammar:
            self._apply_grammar(sub)
        if self._ban is not None:
            sub.masked_fill_(self._ban, float("-inf"))
        if self._dynamic:
            flat = []
            for n, words, stops in self._dynamic:
                r, base = self.rows[n], n * vocab
                if words:
                    flat += [base + t for t in banned_bad_words(words, r.output)]
                if stops and len(r.output) + (r.pending is not None) < r.params.min_tokens:
                    flat += [base + t for t in stops]
            if flat:
                sub.view(-1).index_fill_(0, to_device(flat, self.device), float("-inf"))
        if self._bias is not None:
            sub.view(-1).index_put_((self._bias[0],), self._bias[1], accumulate=True)
        if self._pen_rows:
            sub = self._apply_penalties(sub, pending_tokens)
        return sub if self.sel is None else logits.index_copy(0, self.sel, sub)

    def _apply_grammar(self, sub: torch.Tensor) -> None:
        from ..structured_output.bitmask import disallowed_tokens, fill_bitmask_into, new_bitmask, word_bits

        g = self.num_grammar
        rows = [(r.grammar, r.grammar_prefix) for r in self.rows[:g]]
        if self.staging is not None:
            host = self.staging.host_rows(g, self.vocab, self.device)
            fill_bitmask_into(rows, host)
            mask = self.staging.to_device(host, self.device)
        else:
            host = new_bitmask(g, self.vocab)
            fill_bitmask_into(rows, host)
            mask = to_device(host, self.device, torch.int32)
        if self._bits is None:
            self._bits = word_bits(self.device)
        sub[:g].masked_fill_(disallowed_tokens(mask, self.vocab, self._bits), float("-inf"))

    def _step_counts(self, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        """The penalised rows' output-token counts [P, V] before their positions, brought up to date
        with the tokens added since the last step: the host's new tokens by one scatter, a pending
        token (async scheduling) by one scatter from the device tokens."""
        vocab, counts, counted = self.vocab, self._counts, self._counted
        flat: list[int] = []
        pending = []
        for n, r in enumerate(self._pen_rows):
            out = r.output
            have = len(out)
            if counted[n] != have:
                # More tokens counted than the host holds (a failed step dropped the pending token
                # counted last step, or the row's tokens were replaced): count the row again.
                if counted[n] > have:
                    counts[n].zero_()
                    counted[n] = 0
                base = n * vocab
                flat += [base + t for t in out[counted[n]:]]
                counted[n] = have
            if r.pending is not None:
                pending.append((n, r.pending))
                counted[n] = have + 1  # the host holds it by the next step (or the row is counted again)
        if flat:
            counts.view(-1).index_put_((to_device(flat, self.device),), self._one.expand(len(flat)), accumulate=True)
        if pending:
            if pending != self._pending_key:
                self._pending_key = pending
                self._pending_sel = to_device([s for _, s in pending], self.device)
                self._pending_base = to_device([n * vocab for n, _ in pending], self.device)
            counts.view(-1).index_put_((self._pending_base + pending_tokens.index_select(0, self._pending_sel),),
                                       self._one.expand(len(pending)), accumulate=True)
        return counts

    def _apply_penalties(self, sub: torch.Tensor, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        counts = self._step_counts(pending_tokens)
        a, b = self.pen_start, self.pen_end
        logits = sub[a:b]
        present = counts > 0 if (self._any_rep or self._any_pres) else None
        if self._any_rep:
            seen = present | self._prompt_seen
            penalised = torch.where(logits > 0, logits / self._rp, logits * self._rp)
            logits = torch.where(seen, penalised, logits)
        if self._any_freq:
            logits = logits - self._fp * counts
        if self._any_pres:  # x - pp where present, x elsewhere: x - pp * present, bit for bit, in two ops
            logits = torch.where(present, logits - self._pp, logits)
        if a == 0 and b == sub.shape[0]:
            return logits
        sub[a:b] = logits
        return sub


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
