"""Checkpoint tensors -> the engine's parameters: shards read one tensor at a time, names mapped
(`checkpoint_names`), quantized weights checked and decoded (`quant_formats`) straight into
the parameters, so peak memory stays near the model's own size plus one tensor.

Quantized weights are the release's: a block-FP8 `<module>.weight` (e4m3) with its
`<module>.scale` (or `.weight_scale_inv`), and FP4 routed experts (int8, two e2m1 values per byte)
with theirs; everything is decoded into the parameter's dtype once, here.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint_checks import check_quantized_weight, check_tensor_dtype
from ..config import WeightFormat
from ..errors import CheckpointError
from ..logger import progress_bar
from ..quant_formats import FP4_STORAGE_DTYPES, dequantize_fp4, dequantize_fp8_block
from .checkpoint_names import Target, main_target, release_name

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_READ_ERRORS = (SafetensorError, OSError, RuntimeError)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


class ShardedTensors(Mapping):
    """The tensors of a checkpoint's shards by name, each read from its file when asked for. At
    most two shards are open (memory-mapped) at a time, so reading shard after shard keeps about
    two shards' pages resident, not the whole checkpoint's."""

    MAX_OPEN = 2

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._where: dict[str, int] = {}
        self._open: dict[int, contextlib.ExitStack] = {}
        self._handles: dict[int, object] = {}
        for i, f in enumerate(files):
            for name in self._handle(i).keys():
                if name in self._where:
                    raise CheckpointError(f"tensor {name} appears in more than one shard (again in {f.name})")
                self._where[name] = i
        self.close()

    def _handle(self, i: int):
        if i not in self._handles:
            while len(self._handles) >= self.MAX_OPEN:
                oldest = next(iter(self._handles))
                self._handles.pop(oldest)
                self._open.pop(oldest).close()
            stack = contextlib.ExitStack()
            try:
                self._handles[i] = stack.enter_context(safe_open(str(self.files[i]), framework="pt"))
            except _READ_ERRORS as exc:
                raise CheckpointError(f"cannot read {self.files[i]}: it is corrupted or truncated ({exc})") from exc
            self._open[i] = stack
        return self._handles[i]

    def shard_of(self, name: str) -> int:
        return self._where[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._where[name]
        try:
            return self._handle(i).get_tensor(name)
        except _READ_ERRORS as exc:
            raise CheckpointError(f"cannot read {self.files[i]}: it is corrupted or truncated ({exc})") from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        for stack in self._open.values():
            stack.close()
        self._open.clear()
        self._handles.clear()

    def __enter__(self) -> "ShardedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the shards, in memory."""
    with ShardedTensors(files) as source:
        return {name: source[name] for name in source}


def scale_of(name: str, names: Mapping | set) -> str | None:
    """The scale tensor's name paired with the weight `name`, if the checkpoint has one."""
    if not name.endswith(".weight"):
        return None
    base = name[: -len(".weight")]
    return next((base + s for s in SCALE_SUFFIXES if base + s in names), None)


def _is_scale(name: str, names: Mapping) -> bool:
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in names:
            return True
    return False


def _is_quantized(value: torch.Tensor, dest: torch.Tensor) -> bool:
    return value.dtype == torch.float8_e4m3fn or (dest.is_floating_point() and value.dtype in FP4_STORAGE_DTYPES)


@torch.no_grad()
def load_tensor(dest: torch.Tensor, source: Mapping, name: str, fmt: WeightFormat, expert: bool) -> str | None:
    """Decode (or copy) checkpoint tensor `name` into `dest`; returns the name of the scale it used."""
    value = source[name]
    scale_name = scale_of(name, source)
    stored_as = fmt.experts if expert else fmt.linears
    if expert and fmt.experts != "bf16" and not _is_quantized(value, dest):
        check_quantized_weight(name, value, None, "", tuple(dest.shape), stored_as, fmt.block_size, False, True)
    if not _is_quantized(value, dest):
        if tuple(value.shape) != tuple(dest.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(value.shape)}, the config implies {tuple(dest.shape)}")
        check_tensor_dtype(name, value, dest)
        dest.copy_(value)
        return None
    scale = source[scale_name] if scale_name else None
    ue8m0 = fmt.scale_fmt == "ue8m0"
    check_quantized_weight(name, value, scale, scale_name or name[: -len("weight")] + "scale", tuple(dest.shape),
                           stored_as, fmt.block_size, ue8m0, expert)
    if value.dtype == torch.float8_e4m3fn:
        dequantize_fp8_block(value, scale, fmt.block_size, dest.dtype, out=dest)
    else:
        dequantize_fp4(value, scale, dtype=dest.dtype, out=dest)
    return scale_name


def _expert_view(dest: torch.Tensor, target: Target) -> torch.Tensor:
    view = dest[target.expert]
    if target.half is None:
        return view
    rows = view.shape[0] // 2
    return view[target.half * rows:(target.half + 1) * rows]


@torch.no_grad()
def load_state(module: torch.nn.Module, source: Mapping, names: list[str], to_target: Callable[[str], Target],
               fmt: WeightFormat, describe: Callable[[str], str], what: str = "checkpoint", progress: bool = True
               ) -> None:
    """Load the checkpoint tensors `names` (weights and scales) of `source` into `module`'s state
    dict, mapping names with `to_target`; every missing, unexpected or malformed tensor is an error
    that names it (`describe` turns an engine name into the checkpoint names it may have)."""
    expected = module.state_dict(keep_vars=True)
    groups: dict[str, list[tuple[str, Target]]] = {}
    scales = {n for n in names if _is_scale(n, source)}
    for name in names:
        if name not in scales:
            target = to_target(name)
            groups.setdefault(target.name, []).append((name, target))
    missing = sorted(set(expected) - set(groups))
    unexpected = sorted(n for t, entries in groups.items() if t not in expected for n, _ in entries)
    if missing:
        raise CheckpointError(f"{what}: {len(missing)} tensor(s) missing, first: "
                              + ", ".join(describe(m) for m in missing[:5]))
    if unexpected:
        raise CheckpointError(f"{what}: {len(unexpected)} unexpected tensor(s), first: {', '.join(unexpected[:5])}")
    work: list[tuple[str, torch.Tensor, bool]] = []
    for target_name, entries in groups.items():
        dest = expected[target_name].data
        stacked = [t for _, t in entries if t.expert is not None]
        if stacked:
            _check_experts(target_name, dest, entries, describe)
        elif len(entries) > 1:
            raise CheckpointError(f"tensors {', '.join(n for n, _ in entries)} all load into {target_name}; "
                                  "keep one of them")
        for name, target in entries:
            view = _expert_view(dest, target) if target.expert is not None else dest
            work.append((name, view, ".experts." in target_name))
    used = set()
    if isinstance(source, ShardedTensors):  # read from disk: a bar over the bytes of the parameters
        work.sort(key=lambda item: source.shard_of(item[0]))  # shard after shard
        total = sum(view.numel() * view.element_size() for _, view, _ in work)
        with progress_bar(total=total, enabled=progress, desc=f"Loading safetensors {what} ({len(source.files)} "
                          "shards)", unit="B", unit_scale=True, unit_divisor=1024) as bar:
            for name, view, expert in work:
                used.add(load_tensor(view, source, name, fmt, expert))
                bar.update(view.numel() * view.element_size())
    else:
        used = {load_tensor(view, source, name, fmt, expert) for name, view, expert in work}
    stray = sorted(scales - used)
    if stray:
        raise CheckpointError(f"tensor {stray[0]} is a scale, but its weight is stored unquantized; remove the "
                              "scale or store the weight quantized")


def _check_experts(target_name: str, dest: torch.Tensor, entries: list[tuple[str, Target]],
                   describe: Callable[[str], str]) -> None:
    halves = (None,) if target_name.endswith("down_proj") else (0, 1)
    have = {(t.expert, t.half) for _, t in entries if t.expert is not None}
    if len(have) != sum(1 for _, t in entries):
        raise CheckpointError(f"{target_name} is given both stacked and per expert, or an expert twice")
    want = {(e, h) for e in range(dest.shape[0]) for h in halves}
    extra = sorted(have - want, key=str)
    if extra:
        raise CheckpointError(f"{target_name}: the checkpoint has routed expert {extra[0][0]}, but the config "
                              f"has {dest.shape[0]} experts (n_routed_experts)")
    lacking = sorted(want - have, key=str)
    if lacking:
        part = {None: "w2", 0: "w1", 1: "w3"}[lacking[0][1]]
        raise CheckpointError(f"checkpoint is missing routed expert tensor(s) of {describe(target_name)}, "
                              f"first: expert {lacking[0][0]}, {part}")


def describe_main(engine_name: str) -> str:
    """An engine tensor name with the release's name for it (for error messages)."""
    with contextlib.suppress(KeyError):
        return f"{engine_name} (release name {release_name(engine_name)})"
    return engine_name


def load_checkpoint(model: torch.nn.Module, model_dir: Path, fmt: WeightFormat, progress: bool = True
                    ) -> dict[str, torch.Tensor]:
    """Load a checkpoint directory into `model` (any of the three layouts, quantized or not);
    returns the `mtp.*` tensors as stored (read into memory: one layer), for speculative decoding."""
    with ShardedTensors(checkpoint_files(model_dir)) as source:
        main = [n for n in source if not n.startswith("mtp.")]
        load_state(model, source, main, main_target, fmt, describe_main, progress=progress)
        return {n: source[n] for n in source if n.startswith("mtp.")}


def apply_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                  fmt: WeightFormat | None = None) -> dict[str, torch.Tensor]:
    """Copy in-memory checkpoint tensors into the model; returns the kept `mtp.*` tensors."""
    fmt = fmt or model.model_config.weight_format
    load_state(model, tensors, [n for n in tensors if not n.startswith("mtp.")], main_target, fmt, describe_main)
    return {k: v for k, v in tensors.items() if k.startswith("mtp.")}
