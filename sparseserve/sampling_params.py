"""SamplingParams with vLLM's names and semantics, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import SamplingParamsError
from .validation import ModelLimits, validate_sampling_params

__all__ = ["SamplingParams", "SamplingParamsError"]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, limits: ModelLimits | None = None) -> None:
        """Check every field (again: the engine calls this when a request is added, with the model's
        limits, so a field changed after construction is checked too); raises SamplingParamsError."""
        validate_sampling_params(self, limits)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
