"""A request as the engine tracks it: tokens, progress through the cache, output state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..outputs import Logprob
from ..sampling_params import SamplingParams
from ..step_types import PENDING_TOKEN_ID


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's list lookups must not compare every field
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int  # counter-based RNG seed: same seed, same samples, whatever the batch
    arrival: int  # order of arrival (lower = higher priority)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose state is in the cache
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # speculative drafts to verify next step
    # Tokens sampled by a launched step whose values the host has not read yet (async scheduling):
    # they follow output_token_ids, and the next step takes them from the device.
    num_pending_tokens: int = 0
    grammar: object | None = None  # structured_output.GrammarState of a structured-output request
    needs_host_state: bool = False  # sampling needs the previous token on the host (no async overlap)
    # Output state
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much of the output the last DELTA output carried (tokens, characters of text)
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    # Incremental detokenisation offsets (see engine/detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int, num_draft: int = 0) -> list[int]:
        """Tokens [start, end) of prompt + output + the first `num_draft` drafts, copying only those
        (a decode step needs one token of a sequence thousands long). Pending tokens (sampled, not
        yet read back) are given as PENDING_TOKEN_ID: the runner fills them in on the device."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        p, o = len(prompt), len(output)
        tokens = prompt[start:min(end, p)] if start < p else []
        if end > p and start < p + o:
            tokens += output[max(start - p, 0):min(end - p, o)]
        if end > p + o:
            if num_draft:
                tokens += self.draft_token_ids[max(start - p - o, 0):min(end - p - o, num_draft)]
            elif self.num_pending_tokens:
                tokens += [PENDING_TOKEN_ID] * (min(end, p + o + self.num_pending_tokens) - max(start, p + o))
        return tokens

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the request will have once every launched step is read back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    def reaches_length_limit(self, max_model_len: int | None, extra_tokens: int = 0) -> bool:
        """True when the outputs (plus `extra_tokens` more) reach max_tokens or the sequence reaches
        max_model_len: the request finishes with reason "length"."""
        max_tokens = self.params.max_tokens
        if max_tokens is not None and len(self.output_token_ids) + extra_tokens >= max_tokens:
            return True
        return max_model_len is not None and self.num_tokens + extra_tokens >= max_model_len

    def ends_by_length_with_pending(self, max_model_len: int | None) -> bool:
        """True when the pending tokens surely finish the request, so scheduling another step for it
        would only compute a token that is thrown away."""
        return self.num_pending_tokens > 0 and self.reaches_length_limit(max_model_len, self.num_pending_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
