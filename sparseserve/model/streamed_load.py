"""The parallel load: the model's parts materialized, filled, cut to this rank's share and moved to
the device one at a time (docs/parallelism.md, "Loading").

A rank never holds the whole model: its host memory peaks at about one part (a decoder layer, or
the embedding or LM head) and its device memory at its own share plus one part. The parts are the
model's top-level children with the decoder stack split into its layers, in `named_parameters`
order: the embedding, each decoder layer, the final norm, the mHC head, the LM head.

- checkpoint: each part's tensors (weights and their scales, any of the three layouts) are read
  into the part on the host, shard after shard within it, checked like the whole model's
  (`weight_loader.load_state`: missing, unexpected, malformed tensors named);
- dummy weights: each part is drawn on the device from one seeded generator continued across the
  parts, so the values are the whole model's draw (`dummy_weights`), bit for bit.

The cutting is a `PartSharder` (model/sharding.py's `RankSharder`): it is handed each part once.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..config import WeightFormat
from ..errors import CheckpointError
from ..logger import progress_bar
from .checkpoint_names import Target, main_target
from .dummy_weights import dummy_generator, init_dummy_buffers, init_dummy_params
from .weight_bytes import ParallelLayout
from .weight_loader import SCALE_SUFFIXES, ShardedTensors, checkpoint_files, describe_main, load_state


class PartSharder(Protocol):
    """Cuts one rank's share of each part as it is loaded."""

    @property
    def layout(self) -> ParallelLayout: ...

    def part(self, name: str, module: nn.Module) -> None: ...

    def finish(self, model: nn.Module) -> None: ...


def model_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the parts under `model`, in `named_parameters` order: a child that holds
    tensors of its own or has no children is one part, a `ModuleList`'s entries are one part each,
    any other child is split into its children. `model`'s own tensors (the rope buffers) are not
    in any part."""
    parts: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            own = next(child.named_parameters(recurse=False), None) or next(child.named_buffers(recurse=False), None)
            if isinstance(child, nn.ModuleList):
                parts.extend((f"{full}.{i}", entry) for i, entry in child.named_children())
            elif own is not None or next(child.children(), None) is None:
                parts.append((full, child))
            else:
                walk(full + ".", child)
    walk("", model)
    return parts


def _owner(target: str, prefixes: set[str]) -> str | None:
    pieces = target.split(".")
    return next((p for k in range(1, len(pieces)) for p in [".".join(pieces[:k])] if p in prefixes), None)


def _weight_of(name: str, source: ShardedTensors) -> str:
    """The weight a scale tensor belongs to (the name itself for anything else)."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in source:
            return name[: -len(suffix)] + ".weight"
    return name


def names_by_part(source: ShardedTensors, prefixes: list[str]) -> dict[str, list[str]]:
    """The main-model checkpoint tensors (weights with their scales) each part loads; a tensor that
    loads into no part is an error."""
    wanted = set(prefixes)
    out: dict[str, list[str]] = {p: [] for p in prefixes}
    stray = []
    for name in source:
        if name.startswith("mtp."):
            continue
        owner = _owner(main_target(_weight_of(name, source)).name, wanted)
        if owner is None:
            stray.append(name)
        else:
            out[owner].append(name)
    if stray:
        raise CheckpointError(f"checkpoint: {len(stray)} unexpected tensor(s), first: {', '.join(sorted(stray)[:5])}")
    return out


def _in_part(prefix: str):
    def to_target(name: str) -> Target:
        target = main_target(name)
        return replace(target, name=target.name[len(prefix) + 1:])
    return to_target


def _parts_bar(parts: list[tuple[str, nn.Module]], progress: bool, what: str) -> Iterator[tuple[str, nn.Module]]:
    yield from progress_bar(parts, enabled=progress, desc=f"Loading {what} part by part", unit="part")


@torch.no_grad()
def stream_load(model: nn.Module, device: torch.device, shard: PartSharder, load_format: str,
                model_dir: Path, fmt: WeightFormat, seed: int, n_routed_experts: int, progress: bool = True
                ) -> dict[str, torch.Tensor]:
    """Fill `model` (built on the meta device, parameters in their held dtypes) part by part, each
    cut by `shard` and moved to `device`; returns the `mtp.*` checkpoint tensors (none for dummy)."""
    parts = model_parts(model)
    if load_format == "dummy":
        gen = dummy_generator(device, seed)
        for name, part in _parts_bar(parts, progress, "dummy weights"):
            part.to_empty(device=device)
            init_dummy_params(part.named_parameters(prefix=name), gen, device)
            shard.part(name, part)
        init_dummy_buffers(model.named_buffers(), gen, device, n_routed_experts)  # after every parameter
        return {}
    with ShardedTensors(checkpoint_files(model_dir)) as source:
        names = names_by_part(source, [name for name, _ in parts])
        for name, part in _parts_bar(parts, progress, f"safetensors ({len(source.files)} shards)"):
            part.to_empty(device="cpu")
            load_state(part, source, names[name], _in_part(name), fmt,
                       lambda engine_name, prefix=name: describe_main(f"{prefix}.{engine_name}"), progress=False)
            shard.part(name, part)
            part.to(device)  # the host copy is dropped here
        return {n: source[n] for n in source if n.startswith("mtp.")}
