"""Cut one rank's shard of a loaded model (tensor and expert parallelism, docs/parallelism.md).

The parallel load hands each part of the model to a `RankSharder` as soon as it is filled
(`model/streamed_load.py`), which replaces each split parameter by this rank's slice and hands the
module its `ParallelGroup`; `shard_model` does the same to a model loaded whole. What is split:

- attention: the query heads (`q_b_proj` rows, `sinks`) and the output groups (`o_a_proj` rows and,
  when there are more ranks than groups, its input columns of this rank's heads; `o_b_proj`
  columns); the partial output is all-reduced. Replicated: `q_a_proj`, `kv_proj` (the one
  shared KV head that every query head reads), the compressor and the indexer (their outputs
  are the KV pool's rows and the top-k choice, which every head needs whole);
- MoE: the shared expert (gate/up rows, down columns) and, without expert parallelism, every routed
  expert the same way; with it, whole routed experts per rank. The router and `tid2eid` are
  replicated (every rank routes every token). One all-reduce sums the MoE's partial outputs;
- the LM head's vocabulary rows (padded to a multiple of the ranks); the logits are all-gathered.
  The embedding, the mHC mixes and the norms are replicated.

A part is cut where it was filled (on the host for a checkpoint, on the device for dummy weights),
before it moves to the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.communicator import ParallelGroup
from .layers.attention import Attention
from .layers.fused_linear import pack_projections
from .layers.moe import SparseMoE
from .streamed_load import model_parts
from .weight_bytes import ParallelLayout


@dataclass(frozen=True)
class HeadLayout:
    """One rank's query heads and output groups (`o_groups` and the ranks divide one another)."""

    num_heads: int  # query heads per rank
    num_groups: int  # output groups per rank (1 when a group is shared by several ranks)
    first_group: int  # this rank's first group
    group_cols: tuple[int, int]  # [start, stop) of its columns within each of its groups' o_a input

    @staticmethod
    def of(heads: int, groups: int, head_dim: int, group: ParallelGroup) -> "HeadLayout":
        n, r = group.world_size, group.rank
        width = heads // groups * head_dim  # o_a input width of one group
        if groups % n == 0:  # whole groups per rank
            return HeadLayout(heads // n, groups // n, r * (groups // n), (0, width))
        ranks_per_group = n // groups  # a group's heads spread over several ranks
        share = width // ranks_per_group
        part = r % ranks_per_group
        return HeadLayout(heads // n, 1, r // ranks_per_group, (part * share, (part + 1) * share))


def _rows(t: torch.Tensor, start: int, stop: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, stop - start).clone()


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _split_linear_rows(linear: nn.Linear, start: int, stop: int) -> None:
    _set(linear, "weight", _rows(linear.weight.data, start, stop, 0))


def _split_linear_cols(linear: nn.Linear, start: int, stop: int) -> None:
    _set(linear, "weight", _rows(linear.weight.data, start, stop, 1))


@torch.no_grad()
def shard_attention(attn: Attention, group: ParallelGroup) -> None:
    layout = HeadLayout.of(attn.num_heads, attn.o_groups, attn.head_dim, group)
    hd, rank_r = attn.head_dim, attn.o_lora_rank
    first_head = group.rank * layout.num_heads
    _split_linear_rows(attn.q_b_proj, first_head * hd, (first_head + layout.num_heads) * hd)
    _set(attn, "sinks", _rows(attn.sinks.data, first_head, first_head + layout.num_heads))
    g0, g1 = layout.first_group, layout.first_group + layout.num_groups
    o_a = _rows(attn.o_a_proj.weight.data, g0 * rank_r, g1 * rank_r, 0)
    _set(attn.o_a_proj, "weight", _rows(o_a, *layout.group_cols, dim=1))
    _split_linear_cols(attn.o_b_proj, g0 * rank_r, g1 * rank_r)
    attn.num_heads, attn.o_groups = layout.num_heads, layout.num_groups
    attn.tp = group


@torch.no_grad()
def shard_moe(moe: SparseMoE, group: ParallelGroup) -> None:
    shared = moe.shared_experts
    start, stop = group.shard_range(shared.gate_proj.weight.shape[0])
    _split_linear_rows(shared.gate_proj, start, stop)
    _split_linear_rows(shared.up_proj, start, stop)
    _split_linear_cols(shared.down_proj, start, stop)
    experts = moe.experts
    if group.expert_parallel:
        first, last = group.shard_range(experts.gate_up_proj.shape[0])
        _set(experts, "gate_up_proj", _rows(experts.gate_up_proj.data, first, last))
        _set(experts, "down_proj", _rows(experts.down_proj.data, first, last))
        moe.local_experts = (first, last - first)
    else:
        inter = experts.down_proj.shape[2]
        lo, hi = group.shard_range(inter)
        gate_up = experts.gate_up_proj.data  # [E, 2I, D]: gate rows, then up rows
        _set(experts, "gate_up_proj", torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo:inter + hi]], dim=1))
        _set(experts, "down_proj", _rows(experts.down_proj.data, lo, hi, 2))
    moe.tp = group


@torch.no_grad()
def shard_lm_head(lm_head: nn.Linear, group: ParallelGroup) -> None:
    """This rank's rows of the vocabulary, zero-padded to ceil(V / ranks) (the padding's logits are
    dropped after the gather)."""
    vocab = lm_head.weight.shape[0]
    share = -(-vocab // group.world_size)
    start = min(group.rank * share, vocab)
    rows = lm_head.weight.data[start:min(start + share, vocab)]
    if rows.shape[0] < share:
        rows = torch.cat([rows, rows.new_zeros(share - rows.shape[0], rows.shape[1])])
    _set(lm_head, "weight", rows.clone())


def shard_layers(root: nn.Module, group: ParallelGroup) -> None:
    """Every attention and MoE block under `root` (the decoder stack, or the MTP layer)."""
    for module in root.modules():
        if isinstance(module, Attention):
            shard_attention(module, group)
        elif isinstance(module, SparseMoE):
            shard_moe(module, group)


def shard_part(name: str, part: nn.Module, group: ParallelGroup) -> None:
    """This rank's share of one part of the model (`streamed_load.model_parts`): the LM head's rows,
    or every attention and MoE block in it."""
    if name == "lm_head":
        shard_lm_head(part, group)
    else:
        shard_layers(part, group)


@dataclass(frozen=True)
class RankSharder:
    """The parallel load's cutter (`streamed_load.PartSharder`) for one rank of `group`."""

    group: ParallelGroup

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.group.world_size, self.group.expert_parallel)

    def part(self, name: str, module: nn.Module) -> None:
        shard_part(name, module, self.group)

    def finish(self, model: nn.Module) -> None:
        model.tp = self.group


def shard_mtp(mtp: nn.Module, group: ParallelGroup) -> None:
    """The MTP layer's share (its logits use the target's LM head); re-packs its projections."""
    if group.world_size == 1:
        return
    shard_layers(mtp, group)
    pack_projections(mtp)


def shard_model(model: nn.Module, group: ParallelGroup, mtp: nn.Module | None = None) -> None:
    """Keep only this rank's share of a loaded `DeepseekV4ForCausalLM` (and its MTP layer); re-packs
    the projections that share an input."""
    if group.world_size == 1:
        return
    for name, part in model_parts(model):
        shard_part(name, part, group)
    model.tp = group
    pack_projections(model)
    if mtp is not None:
        shard_mtp(mtp, group)
