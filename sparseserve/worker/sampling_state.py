"""The runner's sampling state across steps: the logits processing (penalties, bans, biases,
grammar masks) and the per-row sampling parameters, both rebuilt only when the batch changes.

One `LogitsPlan` for the current batch composition (the list of sampled requests): built when the
composition changes, carrying over the penalty counts of the requests that stay, and brought up
to date each step with what changes (pending tokens, finished grammars). Each request's prompt
mask (repetition penalty) is made once and kept until the request is forgotten (finished,
aborted, preempted); forgetting a request also drops the plan it is in, so a recompute after
preemption counts its tokens again from the host.
"""
from __future__ import annotations

import torch

from ..model.host_copy import to_device
from ..sample.logits_processors import LogitsPlan, LogitsRow, build_prompt_mask
from ..sample.sampler import SamplingTensors
from ..structured_output.bitmask import BitmaskStaging


class LogitsState:
    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.prompt_masks: dict[str, torch.Tensor] = {}  # request id -> its prompt tokens (repetition penalty)
        self.staging = BitmaskStaging()
        self._plan: LogitsPlan | None = None
        self._key: tuple[int, ...] | None = None  # id() of each sampled request of the plan's composition
        self._reqs: list = []  # the plan's requests, kept so that their ids stay theirs

    def forget(self, request_id: str) -> None:
        self.prompt_masks.pop(request_id, None)
        if self._plan is None:
            return
        for row in self._plan.rows:
            if row.owner is not None and row.owner.request_id == request_id:
                row.owner = None  # nothing of it is carried into the next plan
                self._key = None
        if all(row.owner is None for row in self._plan.rows):  # nothing left to carry: free its tensors
            self._plan, self._key, self._reqs = None, None, []

    def plan(self, reqs: list, last_rows: dict, vocab: int, device: torch.device) -> LogitsPlan:
        """The plan for the logits rows of `reqs` (in order), up to date for this step; `last_rows`:
        each request's row among the last launched step's sampled tokens (its pending token)."""
        key = tuple(map(id, reqs))
        plan = self._plan
        if key != self._key or plan is None or plan.vocab != vocab or plan.device != device:
            index = [i for i, r in enumerate(reqs) if r.params.needs_logits_processing]
            rows = [LogitsRow(r.params, r.prompt_token_ids, r.output_token_ids,
                              grammar=None if r.is_finished else r.grammar,
                              prompt_mask=self._prompt_mask(r, vocab, device), owner=r)
                    for r in (reqs[i] for i in index)]
            plan = self._plan = LogitsPlan(rows, index, len(reqs), vocab, device, self.eos_token_id,
                                           previous=plan, staging=self.staging)
            self._key, self._reqs = key, list(reqs)
        for n, row in enumerate(plan.rows):
            req = row.owner
            row.output = req.output_token_ids
            row.pending = last_rows.get(req) if req.num_pending_tokens else None
            if n < plan.num_grammar:
                row.grammar = None if req.is_finished else req.grammar
        return plan

    def _prompt_mask(self, req, vocab: int, device: torch.device) -> torch.Tensor | None:
        """The prompt's tokens as a device mask, made once per request that uses a repetition penalty."""
        if req.params.repetition_penalty == 1.0:
            return None
        mask = self.prompt_masks.get(req.request_id)
        if mask is None:
            mask = self.prompt_masks[req.request_id] = build_prompt_mask(req.prompt_token_ids, vocab, device)
        return mask


class SamplingTensorCache:
    """The sampling parameters of the last batch composition on the device (two copies when it
    changes); each step copies only the counters (the index of the token each row samples)."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._reqs: list = []  # kept so that the key's ids stay theirs
        self._static: tuple | None = None

    def forget(self, request_id: str) -> None:
        """Drop the cached composition if the request is in it (it finished or left the batch)."""
        if any(r.request_id == request_id for r in self._reqs):
            self._key, self._reqs, self._static = None, [], None

    def get(self, reqs: list, counters: list[int], device: torch.device) -> SamplingTensors:
        key = tuple(map(id, reqs))
        if key != self._key or self._static is None or self._static[0].device != device:
            params = [r.params for r in reqs]
            floats = to_device([[p.temperature for p in params], [p.top_p for p in params],
                                [p.min_p for p in params]], device, torch.float32)
            ints = to_device([[p.top_k for p in params], [r.sample_seed for r in reqs]], device, torch.int64)
            self._static = (floats[0], ints[0], floats[1], floats[2], ints[1],
                            any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params),
                            any(p.min_p > 0 for p in params), all(p.greedy for p in params))
            self._key, self._reqs = key, list(reqs)
        temperature, top_k, top_p, min_p, seeds, any_top_k, any_top_p, any_min_p, all_greedy = self._static
        return SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                               counters=to_device(counters, device, torch.int64), any_top_k=any_top_k,
                               any_top_p=any_top_p, any_min_p=any_min_p, all_greedy=all_greedy)
