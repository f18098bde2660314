"""POST /v1/chat/completions: the conversation rendered by `sparseserve.chat`, one engine request
with `n` completions; for DeepSeek-V4-format models the output goes through the reasoning and DSML
tool-call parser (streamed choice by choice), so `reasoning_content`, `content` and `tool_calls`
come apart and no markup reaches `content`."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from ...chat import (DEEPSEEK_V4, ChatFormatError, DeepSeekV4OutputParser, DeltaMessage, chat_format_of,
                     merge_tool_call_deltas, render_chat, thinking_enabled)
from ...chat.deepseek_v4 import DSML, THINK_END, THINK_START
from ...sampling_params import RequestOutputKind
from .errors import APIError
from .metrics import RequestTimer
from .protocol import ChatCompletionRequest, now, random_id
from .sampling import structured_outputs_of, to_sampling_params
from .serving_base import ServerContext, chat_logprobs, record, run_final, sse, sse_error, usage


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice {req.tool_choice!r} is not supported yet; use 'auto' or 'none'",
                       "tool_choice")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")


def _delta_dict(delta, with_role: bool = False) -> dict:
    out: dict = {"role": "assistant"} if with_role else {}
    if delta.reasoning_content:
        out["reasoning_content"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [
            {"index": t.index, **({"id": t.id, "type": "function"} if t.id else {}),
             "function": {**({"name": t.name} if t.name is not None else {}), "arguments": t.arguments}}
            for t in delta.tool_calls]
    return out


class _PlainParser:
    """Models with a Jinja chat template: the text is the content."""

    num_tool_calls = 0

    def feed(self, text: str) -> DeltaMessage:
        return DeltaMessage(content=text)

    def finish(self) -> DeltaMessage:
        return DeltaMessage()


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest):
    model = ctx.check_model(req.model)
    _check_unsupported(req)
    engine, tokenizer = ctx.engine, ctx.engine.tokenizer
    fmt = chat_format_of(tokenizer)
    if fmt is None:
        raise ChatFormatError("this model has no chat format (no chat_template, not a DeepSeek-V4 tokenizer); "
                              "use /v1/completions")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    prompt = render_chat(messages, tokenizer, tools=tools, add_generation_prompt=req.add_generation_prompt,
                         chat_template_kwargs=req.chat_template_kwargs)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    thinking = fmt == DEEPSEEK_V4 and thinking_enabled(req.chat_template_kwargs)
    extra = {}
    if fmt == DEEPSEEK_V4 and req.skip_special_tokens:
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        if special & {THINK_START, THINK_END, DSML, f"<{DSML}tool_calls>"}:
            extra["skip_special_tokens"] = False  # the parser must see the markers
    structured = structured_outputs_of(req.response_format)
    if structured is not None:
        extra["structured_outputs"] = structured
    top = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.default_max_tokens(len(ids))
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=top if req.logprobs else None,
                                output_kind=kind, extra=extra)
    engine.validate({"prompt_token_ids": ids}, params)
    request_id = random_id("chatcmpl")
    created = now()

    def new_parser():
        return DeepSeekV4OutputParser(thinking) if fmt == DEEPSEEK_V4 else _PlainParser()

    engine_prompt = {"prompt_token_ids": ids, "prompt": prompt}
    if req.stream:
        return StreamingResponse(_stream(ctx, req, engine_prompt, params, request_id, model, created, new_parser, top),
                                 media_type="text/event-stream")
    timer = RequestTimer()
    out = await run_final(ctx, engine_prompt, params, request_id, timer)
    choices, completion_tokens = [], 0
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        parser = new_parser()
        first, last = parser.feed(c.text), parser.finish()
        calls = merge_tool_call_deltas(first.tool_calls + last.tool_calls)
        message = {"role": "assistant", "content": first.content + last.content, "tool_calls": calls}
        if thinking:
            message["reasoning_content"] = first.reasoning_content + last.reasoning_content
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        choices.append({"index": c.index, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs, tokenizer, top)
                        if c.logprobs is not None else None})
    prompt_tokens = len(out.prompt_token_ids)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, prompt, params, request_id: str, model: str,
                  created: int, new_parser, top: int) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    parsers = [new_parser() for _ in range(req.n)]
    counts, reasons = [0] * req.n, [None] * req.n
    timer = RequestTimer()
    prompt_tokens = 0
    try:
        yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None} for i in range(req.n)]})
        async for out in ctx.engine.generate(prompt, params, request_id):
            prompt_tokens = len(out.prompt_token_ids)
            if any(c.token_ids for c in out.outputs):
                timer.on_tokens()
            choices = []
            for c in out.outputs:
                counts[c.index] += len(c.token_ids)
                parser = parsers[c.index]
                delta = parser.feed(c.text)
                finish = None
                if c.finish_reason is not None:
                    rest = parser.finish()
                    delta.reasoning_content += rest.reasoning_content
                    delta.content += rest.content
                    delta.tool_calls += rest.tool_calls
                    reasons[c.index] = c.finish_reason
                    finish = "tool_calls" if parser.num_tool_calls and c.finish_reason == "stop" else c.finish_reason
                lp = chat_logprobs(c.token_ids, c.logprobs, tokenizer, top) if c.logprobs else None
                if delta or finish is not None or lp is not None:
                    choice = {"index": c.index, "delta": _delta_dict(delta), "logprobs": lp, "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = c.stop_reason
                    choices.append(choice)
            if choices:
                yield sse({**base, "choices": choices})
        record(ctx, timer, prompt_tokens, counts, reasons)
        if req.stream_options is not None and req.stream_options.include_usage:
            total = sum(counts)
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, total)})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in the stream
        yield sse_error(exc)
    yield sse("[DONE]")
