"""An asynchronous front for `LLMEngine`: the engine loop runs on its own thread, and each request
streams its outputs to an asyncio queue of its own.

- `generate(prompt, params, request_id)` is an async iterator of `RequestOutput`s (as
  `params.output_kind` asks); leaving it early (a client that disconnects) aborts the request, and
  the engine thread frees its blocks and slot before its next step.
- Every engine call happens on the engine thread; the event loop only sends commands (add, abort)
  and receives outputs through `loop.call_soon_threadsafe`.
- A request that fails validation raises from `generate` before anything is queued; an error of the
  engine step itself is delivered to every request in flight, and the engine is marked dead.
- `max_waiting_requests` bounds the requests that wait for a seat: one more raises `QueueFullError`
  at once instead of queueing without end.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .llm_engine import InvalidRequestError, LLMEngine

logger = logging.getLogger("sparseserve")


class QueueFullError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can run."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of cache blocks in use
    num_free_blocks: int
    num_blocks: int
    num_free_slots: int
    num_slots: int


class _Stream:
    """One request's queue on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item) -> None:  # called from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 idle_wait_s: float = 0.05) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending_adds
        self._num_pending_adds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.step_observers: list = []  # callables(outputs, step_seconds), run on the engine thread

    # ---- lifecycle ----
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sparseserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0, release_engine: bool = False) -> None:
        """Stop the loop; requests still in flight get `EngineDeadError`. `release_engine` then shuts the
        wrapped engine down too (`LLMEngine.shutdown`: its model, state and graphs are freed)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # a step still runs: freeing its model under it would crash it
                logger.warning("the engine loop did not stop within %.0f s; the engine is not released", timeout_s)
                return
            self._thread = None
        if release_engine:
            self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the request side (event loop) ----
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def validate(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        return self.engine.validate_request(prompt, params)

    def stats(self) -> EngineStats:
        sched, kv = self.engine.scheduler, self.engine.kv
        free = kv.num_free_blocks
        with self._lock:
            pending = self._num_pending_adds
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + pending,
            kv_cache_usage=1.0 - free / kv.num_blocks if kv.num_blocks else 0.0, num_free_blocks=free,
            num_blocks=kv.num_blocks, num_free_slots=len(kv.free_slots), num_slots=kv.num_slots)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"the engine is not running ({self.error!r})" if self.error else
                                  "the engine is not running")
        text, ids = self.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if self.max_waiting_requests is not None:
                waiting = len(self.engine.scheduler.waiting) + self._num_pending_adds
                if waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests are waiting (max_waiting_requests="
                                         f"{self.max_waiting_requests}); retry later")
            self._streams[request_id] = stream
            self._num_pending_adds += 1
        self._commands.put(("add", request_id, text, ids, params))
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ----
    def _drain_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, text, ids, params = cmd
                with self._lock:
                    self._num_pending_adds -= 1
                    stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted before it was added
                try:
                    engine._add_validated(request_id, text, ids, params)
                except Exception as exc:  # noqa: BLE001 - delivered to this request only
                    self._close(request_id, exc)
            else:
                request_id = cmd[1]
                engine.abort_request(request_id)
                with self._lock:
                    self._streams.pop(request_id, None)

    def _close(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(item)

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                for observer in self.step_observers:
                    observer(outputs, elapsed)
                for out in outputs:
                    if out.finished:
                        self._close(out.request_id, out)
                    else:
                        with self._lock:
                            stream = self._streams.get(out.request_id)
                        if stream is not None:
                            stream.put(out)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("the engine loop stopped")
            self.error = exc
        finally:
            dead = EngineDeadError(f"the engine stopped: {self.error!r}" if self.error else "the engine shut down")
            with self._lock:
                streams, self._streams = self._streams, {}
            for request_id, stream in streams.items():
                stream.put(dead)
                try:
                    engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    pass
