"""A second CUDA stream for the parts of a decode step that do not depend on each other.

At small batches a step is a chain of latency-bound kernels: most of them occupy a few SMs and
leave the memory system idle. Work that the main chain does not need yet runs beside it on a
side stream, inside the same captured graph (fork and join become graph edges):
  - the step's metadata (row lists, rope tables) beside the embedding and the first layer's
    collapse, norm and projections;
  - the compressor and indexer path of a layer beside its q/kv path;
  - the shared expert beside the router and the routed experts.

`SideStream.run(fn, ...)` makes the side stream wait for the main stream's work so far, runs fn
on it and returns a `SideWork` (`then` queues fn after the side stream's own work without that
wait, `run_from` waits only for the main stream's work up to an earlier `mark`); `SideWork.result()` makes the main stream wait for exactly that
work (an event), so later side work does not hold the main stream. `SideStream.join()` waits for
all of it: a forward calls it before returning, so no captured graph ends with a fork open.

Memory: tensors made on the side stream and read by the main stream return to the side stream's
pool when freed; the side stream only reuses them after its next fork, which waits for the main
stream's work so far, so no read can race a reuse. Main-stream tensors that side work reads stay
referenced by the caller until the main stream waits for that work, or are marked with
`keep_until_done`.

Inline (no stream) outside graph capture (see `SideStreams`), on the CPU, for steps above
`OVERLAP_MAX_TOKENS` tokens (large steps fill the GPU anyway, and per-stream pools would hold
more memory), and with SPARSESERVE_DISABLE_KERNELS=overlap. The choice depends on static facts
only, so a captured graph keeps the schedule it was captured with (docs/design.md, invariant 3)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ..kernels.dispatch import enabled_on

OVERLAP_MAX_TOKENS = 512

T = TypeVar("T")


@dataclass
class SideWork(Generic[T]):
    """The value of work queued on a side stream, and the event that marks its end."""

    value: T
    event: torch.cuda.Event | None = None

    def result(self) -> T:
        """The value, after making the current (main) stream wait for the work (once)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None
        return self.value


class SideStream:
    """One step's side stream, or inline execution when `stream` is None."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream
        self._open = False  # side work queued since the last join

    @property
    def active(self) -> bool:
        return self.stream is not None

    def run(self, fn: Callable[..., T], *args, **kwargs) -> SideWork[T]:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        return self.then(fn, *args, **kwargs)

    def mark(self) -> torch.cuda.Event | None:
        """An event at the main stream's work so far (None when inline): `run_from` forks from it later."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def run_from(self, mark: torch.cuda.Event | None, fn: Callable[..., T], *args, **kwargs) -> SideWork[T]:
        """Like `run`, but the side stream waits only for the main stream's work up to `mark` (fn reads
        nothing the main stream made after it)."""
        if self.stream is None or mark is None:
            return self.run(fn, *args, **kwargs)
        self.stream.wait_event(mark)
        return self.then(fn, *args, **kwargs)

    def then(self, fn: Callable[..., T], *args, **kwargs) -> SideWork[T]:
        """Like `run`, but after the side stream's work so far only: the side stream does not wait for
        the main stream's later work (fn reads only what earlier side work made or what was ready at the
        last fork). Call it only after a `run` of this step."""
        if self.stream is None:
            return SideWork(fn(*args, **kwargs))
        with torch.cuda.stream(self.stream):
            value = fn(*args, **kwargs)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._open = True
        return SideWork(value, event)

    def keep_until_done(self, *tensors: torch.Tensor | None) -> None:
        """Main-stream tensors that side work queued from now on reads and that the main stream
        may free before it joins: their memory is not reused until that work is done (in a
        capture: not before the capture ends)."""
        if self.stream is not None:
            for t in tensors:
                if t is not None:
                    t.record_stream(self.stream)

    def join(self) -> None:
        """Make the current (main) stream wait for everything queued on the side stream."""
        if self.stream is not None and self._open:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._open = False


class SideStreams:
    """A model's side streams, one per device, made on first use.

    mode "graphs" (the default) uses the side stream only while a CUDA graph is being captured:
    there its forks and joins become graph edges that cost nothing at replay, while an eager
    step is bound by the host, which the stream switches and events only slow down. "always"
    also uses it in eager steps and "never" in none (tests compare the schedules: same kernels,
    same inputs, bitwise equal results)."""

    MODES = ("graphs", "always", "never")

    def __init__(self, mode: str = "graphs") -> None:
        self.mode = mode
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"side-stream mode must be one of {self.MODES}, got {mode!r} "
                             "(LLM(side_stream=...) also takes 'auto')")
        self._mode = mode

    def for_step(self, device: torch.device, num_tokens: int) -> SideStream:
        if self.mode == "never" or num_tokens > OVERLAP_MAX_TOKENS or not enabled_on("overlap", device):
            return SideStream(None)
        stream = self._streams.get(device)
        if stream is None:  # made at the first eager step (a capture's warm-up), not inside a capture
            stream = self._streams[device] = _new_stream(device)
        if self.mode == "graphs" and not torch.cuda.is_current_stream_capturing():
            return SideStream(None)
        return SideStream(stream)


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream on which cuBLAS has already run: cuBLAS makes its workspace for a stream at
    the first GEMM there, and that should happen outside any capture, as it does for the main
    stream (in mode "graphs" the side stream's first GEMM would otherwise be inside one)."""
    stream = torch.cuda.Stream(device=device)
    main = torch.cuda.current_stream(device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.bmm(a[None], a[None])
        torch.addmm(a, a, a)
    main.wait_stream(stream)
    return stream
