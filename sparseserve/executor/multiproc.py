"""The driver's side of a parallel layout: one worker process per local rank, the step sent each step.

`MultiprocExecutor` stands where the engine's `ModelRunner` stands in one process (launch,
collect, forget, the start-up calls), as vLLM's multiprocessing executor does: the engine and the
scheduler stay in the driver, which holds no model. A step goes to rank 0 through a pipe and rank 0
broadcasts it to every rank on torch.distributed's gloo control group (the same path reaches the
ranks of other nodes); rank 0 answers.

The driver never blocks without a deadline: it waits on rank 0's answer, on every local worker's
error pipe and on every worker's process sentinel at once, up to the step timeout. A worker that
exits is a `WorkerDiedError`, one that raises a `WorkerStepError` (with its traceback), no answer
in time a `CollectiveTimeoutError`; the executor then stops every worker and each later call raises
the same error. `run_node` starts the workers of a node without the driver (`--node-rank` > 0).
"""
from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from multiprocessing.connection import wait as wait_any

import torch

from ..errors import CollectiveTimeoutError, DistributedError, WorkerConfigError, WorkerDiedError, WorkerStepError
from ..step_types import RunnerOutput, SchedulerOutput
from .messages import StepEncoder
from .worker_proc import WorkerSpec, worker_main

logger = logging.getLogger("sparseserve")

GRACE_S = 1.0  # after a first failure sign, how long to gather the others (to name the first cause)


class RemoteStep:
    """A step launched on the workers; `collect` reads its result."""

    def __init__(self, sched: SchedulerOutput) -> None:
        self.sched = sched


def _stop(procs: list, conns: list, timeout_s: float = 5.0) -> None:
    """Ask the workers to stop, then terminate and kill the ones still running (never waits longer)."""
    for conn in conns[:1] if timeout_s > 0 else ():
        try:
            conn.send(("shutdown",))
        except (OSError, EOFError, BrokenPipeError):
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for conn in conns:
        conn.close()


def _context():
    """Workers fork from a clean server process that has imported the worker's modules once (no
    CUDA, no threads in it: safe to fork), so a worker starts without importing torch again."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["sparseserve.executor.worker_proc"])
    return ctx


class _Processes:
    """The local worker processes of a node and their pipes (index i: local rank i)."""

    def __init__(self, spec: WorkerSpec, first_rank: int, count: int) -> None:
        ctx = _context()
        self.ranks = list(range(first_rank, first_rank + count))
        self.procs, self.conns = [], []
        for local_rank, rank in enumerate(self.ranks):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(spec, rank, local_rank, theirs), daemon=True,
                               name=f"sparseserve-rank{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.failure: DistributedError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)

    def wait(self, what: str, timeout_s: float, reply_from: int | None = 0, count: int = 1) -> list:
        """`count` answers ("ok"/"ready" messages) from local rank `reply_from` (None: one from each
        rank), watching every pipe and process; raises the named error of the first failure."""
        if self.failure is not None:
            raise self.failure
        deadline = time.monotonic() + timeout_s
        answers: list = []
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while len(answers) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.fail(CollectiveTimeoutError(
                    f"no answer from the workers within {timeout_s:.0f} s while running {what} (a hung collective "
                    "or rank); raise step_timeout_s if steps are this slow"))
            ready = wait_any(self.conns + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in sentinels:
                    self.fail(self._diagnose(what))
                i = self.conns.index(obj)
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    self.fail(self._diagnose(what))
                if msg[0] == "error":
                    self.fail(self._diagnose(what, first_error=msg))
                if reply_from is None or i == reply_from:
                    answers.append(msg[1])
        return answers

    def _diagnose(self, what: str, first_error: tuple | None = None) -> DistributedError:
        """The failure's first cause: a rank that died without a word (killed) over a rank whose
        collective failed because of it."""
        time.sleep(GRACE_S)
        errors = [first_error] if first_error is not None else []
        for conn in self.conns:
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "error":
                        errors.append(msg)
            except (EOFError, OSError):
                continue
        reported = {e[1] for e in errors}
        for rank, proc in zip(self.ranks, self.procs):
            if proc.exitcode is not None and rank not in reported:
                return WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                                       f"while the engine ran {what}; the engine has stopped its workers")
        if errors:
            _, rank, message, text, bad_option = errors[0]
            if bad_option:  # the options themselves (e.g. nodes started with different ones): a ConfigError
                return WorkerConfigError(f"worker rank {rank}: {message}")
            return WorkerStepError(f"worker rank {rank} failed while running {what}: {message}\n{text}")
        return WorkerDiedError(f"a worker's pipe closed while the engine ran {what}")

    def fail(self, error: DistributedError) -> None:
        """Record the failure, stop every worker at once (no graceful wait: a peer may be hung) and raise."""
        self.failure = error
        if self._finalizer.detach() is not None:
            _stop(self.procs, self.conns, timeout_s=0.0)
        raise error

    def stop(self) -> None:
        self._finalizer()


class MultiprocExecutor:
    """A `ModelRunner`'s face to the engine, over the worker processes of this node (the driver's)."""

    def __init__(self, spec: WorkerSpec, max_num_seqs: int) -> None:
        config = spec.config
        self.max_num_seqs = max_num_seqs
        self.step_timeout_s = config.step_timeout_s
        self.startup_timeout_s = spec.startup_timeout_s
        self.world_size = spec.world_size
        local = spec.world_size // config.nnodes
        self.procs = _Processes(spec, config.node_rank * local, local)
        self.procs.wait("start-up", self.startup_timeout_s, reply_from=None, count=local)
        self.encoder = StepEncoder()
        self.draft_probs: dict = {}  # the drafts' distributions live on the workers (isolation reads this)
        self._last_sampled = None  # the engine resets it after a failed async step; the workers keep theirs
        self.graphs: dict = {}
        self.mtp_graphs: dict = {}

    # ---- start-up calls: every rank runs them, rank 0 answers ----
    def _call(self, name: str, *args, timeout_s: float | None = None):
        self._send(("call", self.encoder.pending_housekeeping(), name, args))
        return self.procs.wait(name, timeout_s or self.step_timeout_s)[0]

    def _send(self, msg) -> None:
        if self.procs.failure is not None:
            raise self.procs.failure
        for rank, proc in zip(self.procs.ranks, self.procs.procs):
            if proc.exitcode is not None:
                self.procs.fail(self.procs._diagnose(f"{msg[0]} (sending)"))
        try:
            self.procs.conns[0].send(msg)
        except (OSError, EOFError, BrokenPipeError):
            self.procs.fail(self.procs._diagnose(f"{msg[0]} (sending)"))

    def profile_peak_activation_bytes(self) -> int:
        return int(self._call("profile_peak_activation_bytes", timeout_s=self.startup_timeout_s))

    def cache_bytes_available(self, gpu_memory_utilization: float) -> int:
        return int(self._call("cache_bytes_available", gpu_memory_utilization, timeout_s=self.startup_timeout_s))

    def allocate_state(self, num_blocks: int) -> None:
        self._call("allocate_state", num_blocks, timeout_s=self.startup_timeout_s)

    def warm_up_kernels(self) -> None:
        self._call("warm_up_kernels", timeout_s=self.startup_timeout_s)

    def capture_graphs(self, audit: str = "off") -> None:
        self._call("capture_graphs", audit, timeout_s=self.startup_timeout_s)

    # ---- steps ----
    def forget(self, request_id: str) -> None:
        self.encoder.forget(request_id)

    # The workers sample inside `launch`: a request that needs its previous token on the host is
    # read back before the next step is launched (the engine's unsplit path).
    defers_sampling = False

    def launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> RemoteStep:
        if defer_sampling:
            raise RuntimeError("the multiprocess executor samples inside launch (defers_sampling is False)")
        self._send(("launch", self.encoder.encode(sched)))
        return RemoteStep(sched)

    def collect(self, step: RemoteStep) -> RunnerOutput:
        self._send(("collect",))
        return self.procs.wait(f"a step of {len(step.sched.chunks)} request(s)", self.step_timeout_s)[0]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(sched))

    def forward(self, chunks) -> tuple[torch.Tensor, object]:
        """The probe step of the isolation logic: logits of `chunks` (no request)."""
        logits = torch.tensor(self._call("forward", chunks))
        return logits, lambda: "probe step"

    def shutdown(self) -> None:
        self.procs.stop()


def run_node(spec: WorkerSpec) -> None:
    """A node without the driver (`--node-rank` > 0): start its workers and wait for them; returns
    when they stop (the driver shut down), raises a named error when one fails."""
    config = spec.config
    local = spec.world_size // config.nnodes
    procs = _Processes(spec, config.node_rank * local, local)
    try:
        procs.wait("start-up", spec.startup_timeout_s, reply_from=None, count=local)
        logger.info("node %d: ranks %s ready", config.node_rank, procs.ranks)
        conns = list(procs.conns)
        while any(p.exitcode is None for p in procs.procs):
            for obj in wait_any(conns + [p.sentinel for p in procs.procs if p.exitcode is None], timeout=60.0):
                if obj not in conns:
                    continue
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    conns.remove(obj)
                    continue
                if msg[0] == "error":
                    procs.fail(procs._diagnose("serving", first_error=msg))
        if any(p.exitcode for p in procs.procs):
            procs.fail(procs._diagnose("serving"))
    finally:
        procs.stop()
