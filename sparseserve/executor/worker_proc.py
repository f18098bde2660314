"""One worker process: one rank of the parallel layout, with its shard of the model and a runner.

Start-up: join the rendezvous, check that every rank was given the same options, load this rank's
share of the model part by part (model/streamed_load.py, model/sharding.py), build the
`ModelRunner`, report ready. Then the loop: rank 0 reads the driver's next message from its pipe
(or, after a quiet interval, a heartbeat, so that no rank's wait on the bounded-timeout control
group expires while the engine idles) and broadcasts it on the control group; every rank runs it.
Only rank 0 answers; any rank that raises reports the error with its traceback on its own pipe and
exits, so its peers' collectives fail or time out and the driver names the cause instead of waiting.
"""
from __future__ import annotations

import collections
import logging
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..config_checks import layout_fingerprint
from ..distributed.process_group import destroy_process_groups, init_process_groups
from ..errors import ConfigError
from ..model.loader import load_model
from ..model.mtp import load_mtp
from ..model.sharding import RankSharder, shard_mtp
from ..worker.model_runner import ModelRunner
from ..worker.runner_types import RunnerOptions
from .messages import StepDecoder

logger = logging.getLogger("sparseserve")

HEARTBEAT_S = 2.0  # rank 0 broadcasts a no-op after this long without a message (at most)
# The ranks' collectives time out this long after the driver's deadline: a hang is the driver's
# CollectiveTimeoutError (named, at the step timeout); the ranks' own timeout only unblocks them.
COLLECTIVE_MARGIN_S = 5.0


@dataclass
class RunnerLimits:
    """The sizes the driver's engine derived (rank 0 sends them to the ranks of other nodes)."""

    max_model_len: int
    max_num_batched_tokens: int
    block_size: int


@dataclass
class WorkerSpec:
    """What a worker needs to join the layout and build its runner."""

    config: EngineConfig
    device_type: str  # "cuda" or "cpu"
    dtype: torch.dtype
    world_size: int
    master_addr: str
    master_port: int
    startup_timeout_s: float
    limits: RunnerLimits | None = None  # None on the nodes without the driver: taken from rank 0


def _device(spec: WorkerSpec, local_rank: int) -> torch.device:
    if spec.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _build_runner(spec: WorkerSpec, limits: RunnerLimits, device: torch.device, group) -> ModelRunner:
    config = spec.config
    sharder = RankSharder(group) if group.world_size > 1 else None  # this rank's share only, part by part
    model, model_config, mtp_tensors = load_model(config.model, spec.dtype, device, config.load_format,
                                                  config.hf_overrides, config.seed, progress=config.use_tqdm_on_load,
                                                  shard=sharder)
    k = config.num_speculative_tokens
    mtp = (load_mtp(model_config, mtp_tensors, device, spec.dtype, config.load_format, config.seed) if k else None)
    if mtp is not None:
        shard_mtp(mtp, group)  # one layer, loaded whole then cut
    options = RunnerOptions(enforce_eager=config.enforce_eager, cuda_graph_sizes=config.cuda_graph_sizes,
                            topk_backend=config.topk_backend, step_timeout_s=config.step_timeout_s,
                            num_speculative_tokens=k, side_stream=config.side_stream,
                            kv_cache_dtype=config.kv_cache_dtype,
                            prefill_graphs=config.cudagraph_mode == "full_and_piecewise",
                            prefill_graph_sizes=config.prefill_cuda_graph_sizes)
    return ModelRunner(model, model_config, device, spec.dtype, config.max_num_seqs, limits.max_num_batched_tokens,
                       limits.max_model_len, limits.block_size, options, mtp=mtp)


def _check_same_options(spec: WorkerSpec, group) -> RunnerLimits:
    """Every rank (every node) must run the same layout and model: compared once, at start-up.
    Returns rank 0's runner sizes."""
    mine = layout_fingerprint(spec.config)
    everyone: list = [None] * spec.world_size
    dist.all_gather_object(everyone, (mine, spec.limits), group=group)
    limits = everyone[0][1]
    everyone = [theirs for theirs, _ in everyone]
    for rank, theirs in enumerate(everyone):
        diff = sorted(k for k in mine if theirs.get(k) != mine[k])
        if diff:
            details = ", ".join(f"{k}: {mine[k]} here, {theirs.get(k)} on rank {rank}" for k in diff)
            raise ConfigError(f"the nodes were started with different options ({details}); start every node "
                              "with the same model and engine options")
    return limits


class _Worker:
    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int, conn) -> None:
        self.spec, self.rank, self.conn = spec, rank, conn
        self.device = _device(spec, local_rank)
        if self.device.type == "cpu":  # the node's cores (or OMP_NUM_THREADS of them) shared by its ranks
            local = max(1, spec.world_size // spec.config.nnodes)
            torch.set_num_threads(max(1, torch.get_num_threads() // local))
        groups = init_process_groups(rank, spec.world_size, spec.master_addr, spec.master_port, self.device,
                                     spec.config.step_timeout_s + COLLECTIVE_MARGIN_S,
                                     spec.config.enable_expert_parallel,
                                     startup_timeout_s=spec.startup_timeout_s)
        self.control = groups.control
        limits = _check_same_options(spec, groups.startup)
        self.runner = _build_runner(spec, limits, self.device, groups.device)
        dist.barrier(group=groups.startup)  # every rank has its shard
        self.decoder = StepDecoder()
        self.launched: collections.deque = collections.deque()

    def next_message(self):
        """Rank 0: the driver's next message (a heartbeat when it is quiet), broadcast to all."""
        box = [None]
        if self.rank == 0:
            try:
                quiet = min(HEARTBEAT_S, self.spec.config.step_timeout_s / 4)
                box[0] = self.conn.recv() if self.conn.poll(quiet) else ("ping",)
            except (EOFError, OSError):
                box[0] = ("shutdown",)  # the driver is gone
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def handle(self, msg) -> object:
        kind = msg[0]
        runner = self.runner
        if kind == "launch":
            sched = self.decoder.decode(msg[1], runner.forget)
            self.launched.append(runner.launch(sched))
            return None
        if kind == "collect":
            return runner.collect(self.launched.popleft())
        if kind == "call":
            _, housekeeping, name, args = msg
            self.decoder.decode(housekeeping, runner.forget)
            if name == "reset_pending":
                runner._last_sampled = None
                self.launched.clear()
                return None
            with torch.no_grad():
                result = getattr(runner, name)(*args)
            if name == "forward":  # the probe step: logits as a list (tensors do not cross the pipe)
                return result[0].float().cpu().tolist()
            return result
        raise RuntimeError(f"unknown executor message {kind!r}")

    def loop(self) -> None:
        while True:
            msg = self.next_message()
            if msg[0] == "shutdown":
                return
            if msg[0] == "ping":
                continue
            result = self.handle(msg)
            if self.rank == 0 and msg[0] != "launch":
                self.conn.send(("ok", result))


def worker_main(spec: WorkerSpec, rank: int, local_rank: int, conn) -> None:
    """The process's entry point (a multiprocessing forkserver child)."""
    try:
        worker = _Worker(spec, rank, local_rank, conn)
        if conn is not None:
            conn.send(("ready", rank))
        worker.loop()
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver, then the process exits
        text = "".join(traceback.format_exception(exc))
        try:
            if conn is not None:
                conn.send(("error", rank, f"{type(exc).__name__}: {exc}", text, isinstance(exc, ConfigError)))
        except (OSError, EOFError):
            pass
        logger.error("worker rank %d failed:\n%s", rank, text)
        os._exit(1)  # peers see the closed connections at once; no interpreter teardown that could block
    destroy_process_groups()
