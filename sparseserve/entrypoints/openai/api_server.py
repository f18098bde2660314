"""`sparseserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLMEngine`.

Endpoints: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /version, /metrics. With an API key every /v1 route needs `Authorization: Bearer KEY`.
"""
from __future__ import annotations

import contextlib
import gc
import hmac
import logging
import threading
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ... import __version__
from ...chat import render_chat
from ...engine.async_engine import AsyncLLMEngine
from .errors import APIError, error_response, install_handlers
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, now
from .serving_base import ServerContext
from .serving_chat import create_chat_completion
from .serving_completion import create_completion

logger = logging.getLogger("sparseserve")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] | None = None
    max_waiting_requests: int | None = None
    log_level: str = "info"


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY`. Plain ASGI: Starlette's `BaseHTTPMiddleware`
    (`@app.middleware`) would pass each streamed chunk through an extra task and memory stream."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="sparseserve", version=__version__)
    metrics = ServerMetrics(engine, served_model_names[0])
    ctx = ServerContext(engine, served_model_names, metrics, engine.engine.max_model_len)
    app.state.ctx = ctx
    install_handlers(app)

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await create_completion(ctx, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await create_chat_completion(ctx, body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now(), "owned_by": "sparseserve",
                                            "root": name, "max_model_len": ctx.max_model_len}
                                           for name in served_model_names]}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error_response(503, f"the engine is not running ({engine.error!r})")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            text = render_chat([m.model_dump(exclude_none=True) for m in body.messages], tokenizer,
                               chat_template_kwargs=body.chat_template_kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer")
        vocab = engine.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/")
    async def root():
        return JSONResponse({"name": "sparseserve", "version": __version__, "models": served_model_names})

    return app


class ServerThread:
    """uvicorn on a thread of this process: what tests and `bench serve --launch` use."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="sparseserve-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


@contextlib.contextmanager
def frozen_startup_heap(gen0_threshold: int = 50_000):
    """While serving: the objects alive after start-up (torch, transformers, the model, the app: some
    400,000 on the tiny model) moved out of the garbage collector's sight (`gc.freeze`), and young
    collections made rarer. Every streamed token allocates a few objects; with the default thresholds
    the full collections they trigger walked the whole start-up heap, on the engine thread as often as
    not (on the CPU with the model stubbed: about 30 of the engine thread's 47 us per token at 200
    streams). On exit the heap is unfrozen, so that shutting the engine down collects the model's
    cycles."""
    gc.collect()
    gc.freeze()
    old = gc.get_threshold()
    gc.set_threshold(max(gen0_threshold, old[0]), 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def run_server(engine_kwargs: dict, config: ServerConfig) -> None:
    """Load the engine, serve until interrupted, shut down cleanly."""
    import uvicorn

    from ...llm import LLM

    llm = LLM(**engine_kwargs)
    engine = AsyncLLMEngine(llm.llm_engine, max_waiting_requests=config.max_waiting_requests)
    names = config.served_model_names or [engine_kwargs.get("model") or "demo"]
    app = build_app(engine, names, config.api_key)
    engine.start()
    logger.info("serving %s on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions)",
                ", ".join(names), config.host, config.port)
    try:
        with frozen_startup_heap():
            uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                        timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        llm.shutdown()  # the model, the state and the workers
