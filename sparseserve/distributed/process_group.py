"""Joining the ranks of a parallel layout through torch.distributed's rendezvous.

Every rank calls `init_process_groups` with the same address, port and world size (what
`--master-addr`, `--master-port`, `--nnodes` and the tensor-parallel size give, or torchrun's
variables). Two groups come back: the device group the model's collectives run on (NCCL on CUDA,
gloo on the CPU) and a gloo group on the CPU for the executor's step broadcast, as vLLM keeps a
CPU group beside its device group. Both carry a bounded timeout: a collective whose peer has died
raises instead of waiting for ever.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .communicator import ParallelGroup


@dataclass
class ProcessGroups:
    device: ParallelGroup  # the model's collectives (the step timeout)
    control: object  # gloo group of the step broadcast (the step timeout)
    startup: object  # gloo group of the start-up checks and barrier (the start-up timeout: loading is slow)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (for a one-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_groups(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                        timeout_s: float, expert_parallel: bool = False,
                        startup_timeout_s: float = 600.0) -> ProcessGroups:
    """Join the rendezvous at master_addr:master_port as `rank` of `world_size`. The rendezvous
    and the start-up group wait up to `startup_timeout_s` (nodes start and load at their own
    pace); the groups used while serving time out after `timeout_s`. Every rank makes the groups
    in the same order, as torch.distributed requires."""
    startup = datetime.timedelta(seconds=max(startup_timeout_s, timeout_s))
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=startup, **kwargs)
    startup_group = dist.new_group(backend="gloo", timeout=startup)
    control = dist.new_group(backend="gloo", timeout=timeout)
    model_group = dist.new_group(backend=backend, timeout=timeout)
    group = ParallelGroup(rank=rank, world_size=world_size, group=model_group, expert_parallel=expert_parallel)
    return ProcessGroups(device=group, control=control, startup=startup_group)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

