"""An asynchronous front for `LLMEngine`: the engine loop runs on its own thread, and each request
streams its outputs to an asyncio queue of its own.

- `generate(prompt, params, request_id)` is an async iterator of `RequestOutput`s (as
  `params.output_kind` asks); leaving it early (a client that disconnects) aborts the request, and
  the engine thread frees its blocks and slot before its next step.
- Every engine call happens on the engine thread; the event loop only sends commands (add, abort)
  and receives outputs: one `loop.call_soon_threadsafe` per engine step carries every request's
  output of that step, and the loop side hands them to the requests' streams. A wake-up of the loop
  is a write to its self-pipe, and on the engine thread every such system call gives the GIL away
  and waits to take it back from a busy event loop, so one per step, not one per request.
- A stream whose reader is behind the engine gets the outputs that piled up merged into one
  (DELTA: text, tokens and logprobs joined; CUMULATIVE: the latest), as vLLM's output collector
  does: a slow client costs one chunk per read, not one per token.
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

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
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
    """One request's outputs on the event loop: those not yet taken and the reader's waiter."""

    __slots__ = ("loop", "items", "waiter", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list = []  # RequestOutputs, possibly ended by an exception
        self.waiter: asyncio.Future | None = None
        self.finished = False

    def push(self, item) -> None:  # on the event loop
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def _dispatch(batch: list) -> None:
    """On the event loop: one engine step's (stream, item) pairs to their streams."""
    for stream, item in batch:
        stream.push(item)


def merge_outputs(outputs: list[RequestOutput], kind: RequestOutputKind) -> RequestOutput:
    """Consecutive outputs of one request as one: DELTA outputs joined per completion (text, tokens,
    logprobs appended; finish and cumulative logprob from the latest), otherwise the latest."""
    last = outputs[-1]
    if len(outputs) == 1 or kind is not RequestOutputKind.DELTA:
        return last
    merged: dict[int, CompletionOutput] = {}
    for out in outputs:
        for c in out.outputs:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                                   list(c.logprobs) if c.logprobs is not None else None,
                                                   c.finish_reason, c.stop_reason)
                continue
            m.text += c.text
            m.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                m.logprobs = (m.logprobs or []) + c.logprobs
            m.cumulative_logprob, m.finish_reason, m.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, [merged[i] for i in sorted(merged)],
                         last.finished, last.prompt_logprobs, last.metrics)


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
        kind = params.output_kind
        try:
            while True:
                items = await stream.take()
                error = items.pop() if isinstance(items[-1], BaseException) else None
                if items:
                    out = merge_outputs(items, kind)
                    if out.finished:
                        stream.finished = True
                    yield out
                    if out.finished:
                        return
                if error is not None:
                    stream.finished = True
                    raise error
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
            self._deliver([(stream, item)])

    @staticmethod
    def _deliver(batch: list) -> None:
        """From the engine thread: (stream, item) pairs to their event loops, one wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for pair in batch:
            by_loop.setdefault(pair[0].loop, []).append(pair)
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, pairs)
            except RuntimeError:  # the loop is closed: nobody reads these streams any more
                pass

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
                if not outputs:
                    continue
                batch = []
                with self._lock:
                    streams = self._streams
                    for out in outputs:
                        stream = streams.pop(out.request_id, None) if out.finished else streams.get(out.request_id)
                        if stream is not None:
                            batch.append((stream, out))
                self._deliver(batch)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("the engine loop stopped")
            self.error = exc
        finally:
            dead = EngineDeadError(f"the engine stopped: {self.error!r}" if self.error else "the engine shut down")
            with self._lock:
                streams, self._streams = self._streams, {}
            self._deliver([(stream, dead) for stream in streams.values()])
            for request_id in streams:
                try:
                    engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    pass
