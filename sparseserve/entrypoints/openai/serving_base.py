"""What the completion and chat endpoints share: the served models, SSE framing, running several
engine requests of one API request, and token logprobs in OpenAI's shapes."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ...engine.async_engine import AsyncLLMEngine
from ...outputs import Logprob, RequestOutput
from .errors import APIError, error_body, to_api_error
from .metrics import RequestTimer, ServerMetrics


@dataclass
class ServerContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    metrics: ServerMetrics
    max_model_len: int

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.served_model_names[0]
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_model_names)}", "model")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.max_model_len - prompt_len)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_encode = json.JSONEncoder(ensure_ascii=False).encode  # one encoder, not one per call (json.dumps with options)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else _encode(data)}\n\n"


class ChunkEncoder:
    """The SSE chunks of one stream: the fields every chunk repeats (id, object, created, model) are
    encoded once; a chunk adds its choices. `text_choice` writes the common streamed choice (text,
    no logprobs, not finished) from a template; the result is the JSON `sse({**base, "choices": ...})`
    would give."""

    def __init__(self, base: dict) -> None:
        self.head = "data: " + _encode(base)[:-1] + ', "choices": ['

    def chunk(self, choices: list) -> str:
        return self.head + ", ".join(c if isinstance(c, str) else _encode(c) for c in choices) + "]}\n\n"

    @staticmethod
    def text_choice(index: int, text: str) -> str:
        return ('{"index": %d, "text": %s, "logprobs": null, "finish_reason": null, "stop_reason": null}'
                % (index, _encode(text)))


def sse_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse(error_body(err.status, err.message, err.param))


async def run_final(ctx: ServerContext, prompt, params, request_id: str, timer: RequestTimer) -> RequestOutput:
    """One engine request to its end (params.output_kind FINAL_ONLY); metrics recorded."""
    final = None
    async for out in ctx.engine.generate(prompt, params, request_id):
        timer.on_tokens()
        final = out
    record(ctx, timer, len(final.prompt_token_ids), [len(c.token_ids) for c in final.outputs],
           [c.finish_reason for c in final.outputs])
    return final


def record(ctx: ServerContext, timer: RequestTimer, prompt_tokens: int, num_tokens: list[int],
           reasons: list[str | None]) -> None:
    ctx.metrics.record(timer, prompt_tokens, num_tokens, reasons)


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, tagged with the iterator's index; an error of
    one ends the merge with that error; leaving early cancels the rest (which aborts their requests)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _entry(token_id: int, lp: Logprob, tokenizer) -> tuple[str, float]:
    text = lp.decoded_token if lp.decoded_token is not None else (
        tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}")
    return text, max(lp.logprob, -9999.0)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer,
                        text_offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        text, value = _entry(tid, entry[tid], tokenizer)
        tokens.append(text)
        token_lps.append(value)
        offsets.append(text_offset)
        text_offset += len(text)
        tops.append(dict(_entry(t, lp, tokenizer) for t, lp in entry.items()))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer, top: int) -> dict:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs}]."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        text, value = _entry(tid, entry[tid], tokenizer)
        ranked = sorted(((lp.rank or 0, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                        key=lambda r: r[0])
        content.append({"token": text, "logprob": value, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                         for s, v in (_entry(t, lp, tokenizer) for _, t, lp in ranked)]})
    return {"content": content}
