"""The types a step passes between the scheduler and the model runner.

The scheduler fills a `SchedulerOutput`; the runner reads it and returns a `RunnerOutput`.
Both sides import these from here, so neither imports the other: the engine sits above the
runner, and the runner never reaches back up into the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: no runtime import from the engine
    from .engine.request import Request

PENDING_TOKEN_ID = 0  # stands for a token still on the device; never read as a real token


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed this step, starting at start_pos (drafts included)
    start_pos: int  # the request's num_computed_tokens when scheduled
    completes: bool  # the chunk reaches the request's last token, so a new token is sampled
    num_draft: int = 0  # trailing speculative drafts among them, verified this step


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Drafts the runner proposes per request for the next step: None = the speculator's k; set by
    # adaptive speculation (spec_decode/adaptive.py), 0 = none (the drafter only catches up).
    num_propose: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    # request_id -> the tokens this step emits (one, or accepted drafts plus the next token)
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)  # request_id -> accepted drafts
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request_id -> drafts for the next step
    # request_id -> [(position of the predicted prompt token, logprob, rank, top)]
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
