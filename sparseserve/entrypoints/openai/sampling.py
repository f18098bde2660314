"""OpenAI request fields -> `SamplingParams`.

Each request field maps to a `SamplingParams` field in `FIELDS` (one line each). A field whose target
this `SamplingParams` does not have answers 400 when the request sets it to anything but its neutral
value, so an option the engine cannot honour is never ignored silently.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .errors import APIError

MAX_N = 128
MAX_LOGPROBS = 20


def _logit_bias(value: dict) -> dict:
    try:
        return {int(k): float(v) for k, v in value.items()}
    except ValueError as exc:
        raise APIError(400, f"logit_bias keys must be token ids, got {list(value)[:3]}", "logit_bias") from exc


# request field -> (SamplingParams field, neutral value that needs no support, converter)
FIELDS: dict[str, tuple[str, object, Callable | None]] = {
    "n": ("n", 1, None),
    "temperature": ("temperature", None, None),
    "top_p": ("top_p", None, None),
    "top_k": ("top_k", None, None),
    "min_p": ("min_p", None, None),
    "seed": ("seed", None, None),
    "stop": ("stop", None, None),
    "stop_token_ids": ("stop_token_ids", None, None),
    "ignore_eos": ("ignore_eos", False, None),
    "min_tokens": ("min_tokens", 0, None),
    "skip_special_tokens": ("skip_special_tokens", True, None),
    "presence_penalty": ("presence_penalty", 0.0, None),
    "frequency_penalty": ("frequency_penalty", 0.0, None),
    "repetition_penalty": ("repetition_penalty", 1.0, None),
    "logit_bias": ("logit_bias", None, _logit_bias),
    "include_stop_str_in_output": ("include_stop_str_in_output", False, None),
}
_SUPPORTED = {f.name for f in dataclasses.fields(SamplingParams) if f.init}


def to_sampling_params(request, *, max_tokens: int | None, logprobs: int | None,
                       output_kind: RequestOutputKind, extra: dict | None = None) -> SamplingParams:
    """`max_tokens` and `logprobs` come resolved by the endpoint (their names differ between completions
    and chat); `extra` sets fields the endpoint decides itself."""
    if request.n > MAX_N:
        raise APIError(400, f"n is {request.n}; at most {MAX_N} completions per request", "n")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise APIError(400, f"at most {MAX_LOGPROBS} logprobs per token, got {logprobs}", "logprobs")
    kwargs: dict = {"max_tokens": max_tokens, "logprobs": logprobs, "output_kind": output_kind}
    for name, (target, neutral, convert) in FIELDS.items():
        value = getattr(request, name, None)
        if value is None or value == neutral:
            continue
        if target not in _SUPPORTED:
            raise APIError(400, f"{name} is not supported by this server yet; leave it unset", name)
        kwargs[target] = convert(value) if convert else value
    kwargs.update(extra or {})
    if request.temperature is None:
        kwargs.pop("temperature", None)  # SamplingParams' default (1.0), as OpenAI's
    return SamplingParams(**kwargs)


def structured_outputs_of(response_format: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` as a structured-output constraint: "text" (none), "json_object" (any JSON
    object) or "json_schema" (`{"json_schema": {"schema": {...}}}`)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            raise APIError(400, "response_format json_schema needs {'json_schema': {'schema': {...}}}",
                           "response_format")
        return StructuredOutputsParams(json=schema)
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "response_format")
