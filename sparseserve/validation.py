"""Checks of public inputs at the API boundary: typed numbers, prompts, sampling parameters.

Every check raises one of `sparseserve.errors`' types with a message that names the field, the
value and what is allowed. `bool` is not accepted as an integer, `1.5` is not an integer, and
floats must be finite.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import TYPE_ERRORS, InvalidRequestError, SamplingParamsError

# The default cap on logprobs / prompt_logprobs per token (vLLM's default max_logprobs).
DEFAULT_MAX_LOGPROBS = 20


def _fail(err: type[ValueError], name: str, value, rule: str, wrong_type: bool = False):
    cls = TYPE_ERRORS.get(err, err) if wrong_type else err
    got = f"{value!r} ({type(value).__name__})" if wrong_type else repr(value)
    raise cls(f"{name} must be {rule}; got {got}")


def _range_rule(kind: str, lo, hi, lo_open: bool = False, none_ok: bool = False) -> str:
    parts = [kind]
    if lo is not None and hi is not None:
        parts.append(f"in {'(' if lo_open else '['}{lo}, {hi}]")
    elif lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    elif hi is not None:
        parts.append(f"<= {hi}")
    rule = " ".join(parts)
    return rule + " or None" if none_ok else rule


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value, name: str, err: type[ValueError], lo: int | None = None, hi: int | None = None,
              none_ok: bool = False, hint: str = "") -> int | None:
    if value is None and none_ok:
        return None
    if not is_int(value):
        _fail(err, name, value, _range_rule("an integer", lo, hi, none_ok=none_ok) + hint, wrong_type=True)
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        _fail(err, name, value, _range_rule("an integer", lo, hi, none_ok=none_ok) + hint)
    return value


def check_float(value, name: str, err: type[ValueError], lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, none_ok: bool = False, hint: str = "") -> float | None:
    if value is None and none_ok:
        return None
    wrong_type = not isinstance(value, numbers.Real) or isinstance(value, bool)
    if not wrong_type:
        value = float(value)
        if math.isfinite(value) and (lo is None or not (value < lo or (lo_open and value == lo))) \
                and (hi is None or value <= hi):
            return value
    # The rule's text is built only for the error (validation runs for every request).
    _fail(err, name, value, _range_rule("a finite number", lo, hi, lo_open, none_ok) + hint, wrong_type=wrong_type)


def check_bool(value, name: str, err: type[ValueError], none_ok: bool = False) -> bool | None:
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        _fail(err, name, value, "True or False" + (" or None" if none_ok else ""), wrong_type=True)
    return value


def check_choice(value, name: str, err: type[ValueError], choices: tuple) -> str:
    if not isinstance(value, str):
        _fail(err, name, value, f"one of {', '.join(map(repr, choices))}", wrong_type=True)
    if value not in choices:
        _fail(err, name, value, f"one of {', '.join(map(repr, choices))}")
    return value


def check_token_ids(values, name: str, err: type[ValueError], vocab_size: int | None = None) -> list[int]:
    """A list (or tuple) of token ids, each an integer in [0, vocab_size)."""
    if not isinstance(values, (list, tuple)):
        hint = "; call .tolist() first" if hasattr(values, "tolist") else ""
        _fail(err, name, values, "a list of integer token ids" + hint, wrong_type=True)
    hi = vocab_size - 1 if vocab_size is not None else None
    # Fast path (a prompt is checked at every add_request): plain ints in range need no per-item work.
    if values and all(type(t) is int for t in values) and min(values) >= 0 and (hi is None or max(values) <= hi):
        return list(values)
    return [check_int(t, f"{name}[{i}]", err, 0, hi,
                      hint=" (a token id of the model's vocabulary)" if hi is not None else "")
            for i, t in enumerate(values)]


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model allows; `SamplingParams.validate(limits)` checks against it."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


def validate_sampling_params(sp, limits: ModelLimits | None = None) -> None:
    """Check (and normalise: top_k -1 -> 0, stop -> stop_strings) every field of a SamplingParams."""
    err = SamplingParamsError
    sp.n = check_int(sp.n, "n", err, 1)
    sp.temperature = check_float(sp.temperature, "temperature", err, 0.0, hint=" (0 means greedy)")
    sp.top_p = check_float(sp.top_p, "top_p", err, 0.0, 1.0, lo_open=True, hint=" (1 disables it)")
    sp.top_k = check_int(sp.top_k, "top_k", err, -1, hint=" (0 or -1 disables it)")
    if sp.top_k == -1:
        sp.top_k = 0
    sp.min_p = check_float(sp.min_p, "min_p", err, 0.0, 1.0, hint=" (0 disables it)")
    sp.seed = check_int(sp.seed, "seed", err, 0, 2**63 - 1, none_ok=True)
    sp.max_tokens = check_int(sp.max_tokens, "max_tokens", err, 1, none_ok=True)
    sp.min_tokens = check_int(sp.min_tokens, "min_tokens", err, 0)
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise err(f"min_tokens ({sp.min_tokens}) must not exceed max_tokens ({sp.max_tokens}); "
                  "lower min_tokens or raise max_tokens")
    cap = None
    if limits is not None:
        cap = min(limits.max_logprobs, limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        hint = " (raise the engine's max_logprobs option for more)" if cap is not None else ""
        setattr(sp, name, check_int(getattr(sp, name), name, err, 0, cap, none_ok=True, hint=hint))
    for name in ("ignore_eos", "skip_special_tokens", "detokenize"):
        check_bool(getattr(sp, name), name, err)
    stop = sp.stop
    if stop is None:
        strings = []
    elif isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, (list, tuple)):
        strings = list(stop)
    else:
        _fail(err, "stop", stop, "a non-empty string, a list of them, or None", wrong_type=True)
    for i, s in enumerate(strings):
        if not isinstance(s, str):
            _fail(err, f"stop[{i}]", s, "a non-empty string", wrong_type=True)
        if s == "":
            _fail(err, f"stop[{i}]", s, "a non-empty string")
    sp.stop_strings = strings
    if sp.stop_token_ids is not None:
        vocab = limits.vocab_size if limits is not None else None
        sp.stop_token_ids = check_token_ids(sp.stop_token_ids, "stop_token_ids", err, vocab)
    if limits is not None and sp.max_tokens is not None and sp.min_tokens >= limits.max_model_len:
        raise err(f"min_tokens ({sp.min_tokens}) must be below max_model_len ({limits.max_model_len})")


PROMPT_KEYS = ("prompt", "prompt_token_ids")
PROMPT_RULE = "a string, a list of token ids, or a dict with 'prompt' (a string) and/or 'prompt_token_ids'"


def parse_prompt(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt; raises InvalidRequestError(TypeError) with what to change."""
    err = InvalidRequestError
    if isinstance(prompt, str):
        if tokenizer is None:
            raise err("this engine has no tokenizer, so the prompt cannot be a string; "
                      "pass {'prompt_token_ids': [...]} instead")
        return prompt, check_token_ids(list(tokenizer.encode(prompt)), "the tokenized prompt", err, vocab_size)
    if isinstance(prompt, (list, tuple)):
        return None, check_token_ids(prompt, "prompt", err, vocab_size)
    if isinstance(prompt, dict):
        unknown = sorted(map(str, set(prompt) - set(PROMPT_KEYS)))
        if unknown:
            raise TYPE_ERRORS[err](f"prompt dict has unsupported key(s) {', '.join(unknown)}; "
                                   f"use {' and/or '.join(map(repr, PROMPT_KEYS))}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            _fail(err, "prompt['prompt']", text, "a string", wrong_type=True)
        if "prompt_token_ids" in prompt:
            return text, check_token_ids(prompt["prompt_token_ids"], "prompt_token_ids", err, vocab_size)
        if text is not None:
            return parse_prompt(text, tokenizer, vocab_size)
        raise err("prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of token ids)")
    hint = "; decode bytes to str first" if isinstance(prompt, (bytes, bytearray)) else ""
    _fail(err, "a prompt", prompt, PROMPT_RULE + hint, wrong_type=True)


def split_prompts(prompts) -> list:
    """`generate`'s prompts as a list: one prompt (a string, a dict or a list of token ids) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(is_int(t) for t in prompts):
            return [list(prompts)]  # one prompt of token ids, as vLLM reads a flat list of ints
        return list(prompts)
    if isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray)):
        return list(prompts)  # a generator of prompts
    hint = "; decode bytes to str first" if isinstance(prompts, (bytes, bytearray)) else ""
    _fail(InvalidRequestError, "prompts", prompts, PROMPT_RULE + ", or a list of those" + hint, wrong_type=True)
