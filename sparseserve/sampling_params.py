"""SamplingParams with vLLM's names and semantics, validated on construction."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import SamplingParamsError
from .validation import ModelLimits, validate_sampling_params

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's and vLLM's clamp of a logit bias

__all__ = ["SamplingParams", "SamplingParamsError", "RequestOutputKind"]


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: exactly one of json, json_object, regex, choice, grammar.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular expression;
    choice: one of these strings; grammar: an EBNF (GBNF) grammar with a `root` rule."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError(f"structured_outputs.json must be a dict or JSON text, got "
                                      f"{type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise SamplingParamsError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise SamplingParamsError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingParamsError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    def key(self) -> tuple:
        """What identifies the compiled grammar (for caching)."""
        import json as _json

        spec = _json.dumps(self.json, sort_keys=True) if isinstance(self.json, dict) else self.json
        return (spec, self.regex, tuple(self.choice) if self.choice else None, self.grammar,
                bool(self.json_object), self.disable_any_whitespace, self.disable_additional_properties)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request that advanced (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only what is new since the request's last output
    FINAL_ONLY = 2  # one output, when the request finishes


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    # Token ids of bad_words, filled from the tokenizer when the engine accepts the request.
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, limits: ModelLimits | None = None) -> None:
        """Check every field (again: the engine calls this when a request is added, with the model's
        limits, so a field changed after construction is checked too); raises SamplingParamsError."""
        validate_sampling_params(self, limits)

        def fail(message: str) -> None:
            raise SamplingParamsError(message)

        self._validate_logits_fields(fail)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        # Whether the sampler must process this request's logits (the runner reads it every step).
        self.needs_logits_processing = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.bad_words or self.allowed_token_ids is not None or self.min_tokens
            or self.structured_outputs is not None)

    def _validate_logits_fields(self, fail) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                fail(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp < float("inf"):
            fail(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for tok, value in self.logit_bias.items():
                try:  # the OpenAI API sends token ids as strings
                    tid = int(tok)
                except (TypeError, ValueError):
                    fail(f"logit_bias keys must be token ids (integers), got {tok!r}")
                if tid < 0:
                    fail(f"logit_bias token ids must be >= 0, got {tid}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                    fail(f"logit_bias[{tid}] must be a number, got {value!r}")
                bias[tid] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
            self.logit_bias = bias
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                fail(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, (list, tuple)) or not ids
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                fail(f"allowed_token_ids must be a non-empty list of token ids >= 0, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            else:
                fail("structured_outputs must be StructuredOutputsParams (or a dict of its fields), got "
                     f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (`LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise SamplingParamsError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise SamplingParamsError(f"length_penalty must be a number, got {self.length_penalty!r}")
