"""The collectives the model runs inside its forward, over one explicit process group.

A `ParallelGroup` is handed to the modules that need it by `model/sharding.py` (no global state):
attention's and the MoE's all-reduce of partial outputs, and the LM head's all-gather of vocabulary
shards. Every collective takes and returns device tensors and never reads a value on the host, so
with NCCL the same calls are captured into CUDA graphs; with gloo they run on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    """One tensor-parallel group: this process's rank in it, its size and the torch.distributed
    group the model's collectives run on. `expert_parallel`: routed experts are split across the
    ranks (whole experts each) rather than within each expert."""

    rank: int
    world_size: int
    group: object | None = None  # torch.distributed ProcessGroup (None: the default group)
    expert_parallel: bool = False

    def shard_range(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of `size` (which the world size divides)."""
        if size % self.world_size:
            raise ValueError(f"{size} does not split evenly over {self.world_size} ranks")
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over the ranks, in place (the partial outputs of a row-parallel split),
        in the tensor's dtype (as vLLM's tensor-parallel all-reduce)."""
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors side by side along the last dimension, rank 0 first (vocabulary
        shards of the logits)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)
