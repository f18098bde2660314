"""POST /v1/completions: one engine request per prompt (each with `n` completions); choices are
numbered prompt-major (`prompt_index * n + i`), as OpenAI's."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from ...sampling_params import RequestOutputKind
from .errors import APIError
from .metrics import RequestTimer
from .protocol import CompletionRequest, now, random_id
from .sampling import to_sampling_params
from .serving_base import (ChunkEncoder, ServerContext, completion_logprobs, merge_streams, record, run_final, sse,
                           sse_error, usage)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, a list of strings or a list of token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": list(p)} for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   "prompt")


def _check_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise APIError(400, "echo is not supported yet; leave it unset", "echo")
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options")


async def create_completion(ctx: ServerContext, req: CompletionRequest):
    model = ctx.check_model(req.model)
    _check_unsupported(req)
    engine = ctx.engine
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    extra = {"prompt_logprobs": req.prompt_logprobs} if req.prompt_logprobs is not None else None
    params = to_sampling_params(req, max_tokens=req.max_tokens or 16, logprobs=req.logprobs, output_kind=kind,
                                extra=extra)
    inputs = []  # (prompt for the engine, params); a bad prompt is a 400 before anything runs
    for prompt in _prompts(req.prompt):
        text, ids = engine.validate(prompt, params)
        inputs.append(({"prompt_token_ids": ids, "prompt": text}, params))
    request_id = random_id("cmpl")
    created = now()
    if req.stream:
        return StreamingResponse(_stream(ctx, req, inputs, request_id, model, created),
                                 media_type="text/event-stream")
    timers = [RequestTimer() for _ in inputs]
    finals = await asyncio.gather(*(run_final(ctx, p, sp, f"{request_id}-{i}", timers[i])
                                    for i, (p, sp) in enumerate(inputs)))
    tokenizer = engine.tokenizer
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append({"index": i * req.n + c.index, "text": c.text,
                            "logprobs": completion_logprobs(c.token_ids, c.logprobs, tokenizer)
                            if c.logprobs is not None else None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                         "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def _stream(ctx: ServerContext, req: CompletionRequest, inputs, request_id: str, model: str,
                  created: int) -> AsyncIterator[str]:
    engine, tokenizer = ctx.engine, ctx.engine.tokenizer
    timers = [RequestTimer() for _ in inputs]
    counts = [[0] * req.n for _ in inputs]
    reasons: list[list] = [[None] * req.n for _ in inputs]
    offsets = [[0] * req.n for _ in inputs]
    prompt_lens = [0] * len(inputs)
    streams = [engine.generate(p, sp, f"{request_id}-{i}") for i, (p, sp) in enumerate(inputs)]
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    encoder = ChunkEncoder(base)
    n = req.n
    try:
        async for i, out in merge_streams(streams):
            prompt_lens[i] = len(out.prompt_token_ids)
            choices = []
            advanced = False
            for c in out.outputs:
                index = c.index
                if c.token_ids:
                    advanced = True
                    counts[i][index] += len(c.token_ids)
                reasons[i][index] = c.finish_reason
                if c.logprobs is None and c.finish_reason is None:
                    if c.text:
                        choices.append(encoder.text_choice(i * n + index, c.text))
                        offsets[i][index] += len(c.text)
                    continue
                lp = None
                if c.logprobs is not None:
                    lp = completion_logprobs(c.token_ids, c.logprobs, tokenizer, offsets[i][index])
                offsets[i][index] += len(c.text)
                choices.append({"index": i * n + index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if advanced:
                timers[i].on_tokens()
            if choices:
                yield encoder.chunk(choices)
            if out.finished:
                record(ctx, timers[i], prompt_lens[i], counts[i], reasons[i])
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(prompt_lens)
            completion_tokens = sum(map(sum, counts))
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in the stream
        yield sse_error(exc)
    yield sse("[DONE]")
