"""Write a DeepSeek-V4 release checkpoint: the release's tensor names, its FP8 block linears and
FP4 (or FP8) routed experts, sharded with a `model.safetensors.index.json`, the MTP layer
included. Tests and benchmarks get release-format files this way without downloading any;
`tools/write_release_checkpoint.py` is the command line (docs/checkpoints.md).

The shapes come from a config (a preset or a directory, with overrides: e.g. V4-Flash's layer
shapes with fewer layers and experts). The values are random (`weights="random"`), made, encoded
and written one at a time (one expert at a time for the routed experts), so memory stays at about
one shard; or the model directory's own weights (`weights="model"`, e.g. the trained demo model),
loaded in float32 and encoded the same way, so the model must fit in host memory.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..quant_formats import FP8_BLOCK, quantize_fp4, quantize_fp8_block
from .checkpoint_names import MTP_PREFIX, release_mtp_name, release_name, release_storage
from .deepseek_v4 import DeepseekV4ForCausalLM
from .loader import load_hf_config, load_model, resolve_model_dir
from .mtp import MTPModule, load_mtp

EXPERT_DTYPES = ("fp4", "fp8", "bf16")
WEIGHT_SOURCES = ("random", "model")
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "scale_fmt": "ue8m0", "weight_block_size": list(FP8_BLOCK)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    """Random values of the right kind for `name`, made a few million at a time (in place, so a
    vocabulary-sized bf16 tensor needs no float32 copy of itself)."""
    leaf = name.rsplit(".", 1)[-1]
    out = torch.empty(shape, dtype=dtype, device=gen.device)
    rows = out.view(-1, shape[-1]) if out.dim() else out.view(1, 1)
    step = max(1, (1 << 22) // rows.shape[1])
    for r in range(0, rows.shape[0], step):
        chunk = rows[r:r + step]
        if leaf in ("scale", "hc_scale"):
            values = torch.rand(chunk.shape, generator=gen, device=gen.device).add_(0.5)
        else:
            values = torch.randn(chunk.shape, generator=gen, device=gen.device)
            if "norm" in name and leaf == "weight":
                values.mul_(0.1).add_(1.0)
            else:
                values.mul_(shape[-1] ** -0.5 if len(shape) >= 2 else 0.5)
        chunk.copy_(values)
    return out


def _tid2eid(shape: tuple[int, ...], num_experts: int, gen: torch.Generator) -> torch.Tensor:
    first = torch.randint(0, num_experts, (shape[0], 1), generator=gen, device=gen.device)
    return (first + torch.arange(shape[1], device=gen.device)) % num_experts  # distinct experts per token


class _Encoder:
    def __init__(self, expert_dtype: str) -> None:
        self.expert_dtype = expert_dtype
        # The fp4-expert release stores every scale as float8_e8m0fnu; the fp8-expert one as float32.
        self.scale_dtype = torch.float8_e8m0fnu if expert_dtype == "fp4" else torch.float32

    def dtype_of(self, release: str) -> torch.dtype:
        """The dtype a tensor is made in: float32 for what is then quantized, else its stored dtype."""
        storage = release_storage(release)
        if storage == "fp8" and self.expert_dtype != "bf16":
            return torch.float32
        return {"fp32": torch.float32, "int64": torch.int64}.get(storage, torch.bfloat16)

    def tensor(self, release: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if release_storage(release) == "fp8" and self.expert_dtype != "bf16":
            q, s = quantize_fp8_block(value, FP8_BLOCK, self.scale_dtype)
            return {release: q, release[: -len("weight")] + "scale": s}
        return {release: value.to(self.dtype_of(release)).contiguous()}

    def expert(self, release: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = release[: -len("weight")] + "scale"
        if self.expert_dtype == "fp4":
            q, s = quantize_fp4(value, scale_dtype=self.scale_dtype)
            return {release: q, scale: s}
        if self.expert_dtype == "fp8":
            q, s = quantize_fp8_block(value, FP8_BLOCK, self.scale_dtype)
            return {release: q, scale: s}
        return {release: value.to(torch.bfloat16).contiguous()}


def _release_tensors(module: torch.nn.Module, to_release, prefix_of_layer, num_experts: int,
                     encoder: _Encoder, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """(release name -> stored tensor) groups for every tensor of `module`: random values when it
    is built on meta, else its own values."""
    for name, t in module.state_dict(keep_vars=True).items():
        shape = tuple(t.shape)
        if t.device.type != "meta":
            yield from _encoded(name, t.detach(), to_release, prefix_of_layer, encoder)
        elif name.endswith("tid2eid"):
            yield encoder.tensor(to_release(name), _tid2eid(shape, num_experts, gen))
        elif name.endswith("e_score_correction_bias"):
            yield encoder.tensor(to_release(name), 0.1 * torch.randn(shape, generator=gen, device=gen.device))
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            prefix = prefix_of_layer(name)
            for e in range(shape[0]):
                w = _random(name, shape[1:], gen)
                if name.endswith("gate_up_proj"):
                    half = shape[1] // 2
                    yield encoder.expert(f"{prefix}ffn.experts.{e}.w1.weight", w[:half])
                    yield encoder.expert(f"{prefix}ffn.experts.{e}.w3.weight", w[half:])
                else:
                    yield encoder.expert(f"{prefix}ffn.experts.{e}.w2.weight", w)
        else:
            release = to_release(name)
            yield encoder.tensor(release, _random(name, shape, gen, encoder.dtype_of(release)))


def _encoded(name: str, value: torch.Tensor, to_release, prefix_of_layer, encoder: _Encoder
             ) -> Iterator[dict[str, torch.Tensor]]:
    """The release's tensors of one of the model's own tensors (the routed experts one by one)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix, half = prefix_of_layer(name), value.shape[1] // 2
        for e in range(value.shape[0]):
            yield encoder.expert(f"{prefix}ffn.experts.{e}.w1.weight", value[e, :half])
            yield encoder.expert(f"{prefix}ffn.experts.{e}.w3.weight", value[e, half:])
    elif name.endswith("mlp.experts.down_proj"):
        prefix = prefix_of_layer(name)
        for e in range(value.shape[0]):
            yield encoder.expert(f"{prefix}ffn.experts.{e}.w2.weight", value[e])
    else:
        release = to_release(name)
        yield encoder.tensor(release, value.to(encoder.dtype_of(release)))


def _layer_prefix(name: str) -> str:
    """`model.layers.3.mlp.experts.down_proj` -> `layers.3.`; `block.mlp...` (MTP) -> `mtp.0.`."""
    if name.startswith("block."):
        return MTP_PREFIX
    return ".".join(name.split(".")[1:3]) + "."


class _ShardWriter:
    def __init__(self, out: Path, max_shard_bytes: int) -> None:
        self.out, self.max_bytes = out, max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.current and self.size + nbytes > self.max_bytes:
            self.flush()
        self.current.update({k: v.cpu() for k, v in tensors.items()})  # drawn on the writer's device
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if self.current:
            save_file(self.current, str(self.out / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
            self.shards.append(list(self.current))
            self.current, self.size = {}, 0

    def finish(self) -> int:
        self.flush()
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(self.out / f"shard-{i:05d}.tmp", self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return len(self.shards)


def release_config(hf_config, expert_dtype: str) -> dict:
    """The config.json of the written checkpoint: the model's config with the release's
    `quantization_config` and `expert_dtype` (neither for a bf16 checkpoint)."""
    raw = hf_config.to_dict()
    for key in ("quantization_config", "expert_dtype", "transformers_version", "dtype", "torch_dtype"):
        raw.pop(key, None)
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    raw["torch_dtype"] = "bfloat16"
    if expert_dtype != "bf16":
        raw["quantization_config"] = dict(RELEASE_QUANTIZATION)
        raw["expert_dtype"] = expert_dtype
    return raw


def write_release_checkpoint(out_dir: str | os.PathLike, model: str | os.PathLike | None = "tiny",
                             hf_overrides: dict | None = None, expert_dtype: str = "fp4", seed: int = 0,
                             max_shard_bytes: int = 4 << 30, mtp: bool = True,
                             tokenizer_dir: str | os.PathLike | None = None,
                             device: str | torch.device = "cpu", weights: str = "random") -> Path:
    """Write a release-format checkpoint of `model`'s config (a preset or a directory, with
    `hf_overrides`) into `out_dir`: FP8 linears with FP4 (`expert_dtype="fp4"`, as DeepSeek-V4-Flash)
    or FP8 (`"fp8"`, as -Flash-Base) routed experts, or everything unquantized (`"bf16"`).
    `weights="random"`: random values; `"model"`: the checkpoint's own weights (`model` must have
    them; its MTP layer's too when `mtp`), quantized as the release stores them.
    The tokenizer files of `tokenizer_dir` (default: the config's directory, if it has them) are copied.
    `device` draws and encodes the values there (a GPU writes V4-Flash-sized files in seconds); the
    same arguments on the same kind of device write the same files."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
    if weights not in WEIGHT_SOURCES:
        raise ValueError(f"weights must be one of {WEIGHT_SOURCES}, got {weights!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    model_dir, preset_overrides = resolve_model_dir(model)
    hf = load_hf_config(model_dir, {**preset_overrides, **(hf_overrides or {})})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_config = ModelConfig(hf, dtype=torch.float32)
    if weights == "model":
        net, model_config, mtp_tensors = load_model(model_dir, torch.float32, torch.device(device),
                                                    hf_overrides={**preset_overrides, **(hf_overrides or {})},
                                                    progress=False)
        mtp_module = (load_mtp(model_config, mtp_tensors, torch.device(device), torch.float32)
                      if mtp and hf.num_nextn_predict_layers > 0 else None)
    else:
        with torch.device("meta"):
            net = DeepseekV4ForCausalLM(model_config)
            mtp_module = MTPModule(model_config) if mtp and hf.num_nextn_predict_layers > 0 else None
    gen = torch.Generator(device=device).manual_seed(seed)
    encoder = _Encoder(expert_dtype)
    writer = _ShardWriter(out, max_shard_bytes)
    for group in _release_tensors(net, release_name, _layer_prefix, hf.n_routed_experts, encoder, gen):
        writer.add(group)
    if mtp_module is not None:
        for group in _release_tensors(mtp_module, release_mtp_name, _layer_prefix, hf.n_routed_experts, encoder, gen):
            writer.add(group)
    writer.finish()
    (out / "config.json").write_text(json.dumps(release_config(hf, expert_dtype), indent=2, sort_keys=True) + "\n")
    source = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out
