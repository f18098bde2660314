"""The bytes a model's weights take per GPU, as they will be held, for a parallel layout.

Inputs are tensor specs (name, shape, dtype; parameter or buffer), read from a model built on the
meta device (`model/meta_model.py`: nothing is allocated), and a held-format policy: the format each
parameter is held in. Buffers (router tables, rope tables) are held in their own dtype.

- `compute_dtype_policy(dtype)`: how the loader holds weights today: every parameter in the compute
  dtype except the float32 islands (`KEEP_FP32`), whatever the checkpoint's format (FP8/FP4 files
  are decoded at load).
- `checkpoint_policy(fmt)`: the release's storage (FP8 e4m3 linears with one scale per 128 x 128
  block, FP4 e2m1 or FP8 routed experts, bf16 embedding, head, router and compressor projections,
  float32 islands), for the checkpoint's size.
- `quantized_policy(dtype, quantization, fmt)`: under `LLM(quantization="auto"|"fp8")` the tensors
  `held_quant` names (the rule `model/quantize.py` applies) as held: FP8 1 byte per value + a 1-byte
  ue8m0 scale per 128 x 128 block, FP4 half a byte + a 1-byte scale per 32 values.

Per GPU under `tensor_parallel_size=N` (`TP_SPLITS`, as `model/sharding.py` cuts them): attention
heads split (q_b, sinks, the output groups of o_a, o_b's input), the LM head split over the
vocabulary, the shared expert split (gate/up rows, down columns), routed experts split within each
expert (TP) or whole experts across the ranks (`enable_expert_parallel`); everything else (the
embedding, q_a, the shared KV projection, compressors and indexers, router, norms, mHC, buffers)
replicated. Uneven splits count the largest shard.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

# Parameters held in float32 whatever the compute dtype (small mixing and normalisation tensors).
KEEP_FP32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "norm")

GiB = 1024**3


def format_bytes(n: int) -> str:
    """GiB for sizes from a tenth of one, MiB below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 1024**2:.2f} MiB"


def held_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the loader holds parameter `name` in for compute dtype `dtype`."""
    return torch.float32 if any(part in name for part in KEEP_FP32) else dtype


@dataclass(frozen=True)
class HeldFormat:
    """A tensor's storage: `value_bits` per value, plus one `scale_bytes` scale per
    `scale_block` (rows, cols) block of its last two dimensions (partial blocks count whole)."""

    name: str
    value_bits: int
    scale_block: tuple[int, int] | None = None
    scale_bytes: int = 0

    def nbytes(self, shape: tuple[int, ...]) -> int:
        numel = math.prod(shape)
        values = -(-numel * self.value_bits // 8)
        if self.scale_block is None or numel == 0:
            return values
        rows = shape[-2] if len(shape) >= 2 else 1
        lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
        block_rows, block_cols = self.scale_block
        return values + lead * -(-rows // block_rows) * -(-shape[-1] // block_cols) * self.scale_bytes


def dtype_format(dtype: torch.dtype) -> HeldFormat:
    return HeldFormat(str(dtype).removeprefix("torch."), dtype.itemsize * 8)


# Quantized as held on the GPU (fp32 block scales for FP8 linears; ue8m0 scales for FP4 experts).
FP8_BLOCK = HeldFormat("fp8 e4m3 (fp32 scale per 128x128)", 8, (128, 128), 4)
FP4_E2M1 = HeldFormat("fp4 e2m1 (ue8m0 scale per 32)", 4, (1, 32), 1)
BF16 = dtype_format(torch.bfloat16)
FP32 = dtype_format(torch.float32)

HeldPolicy = Callable[[str, tuple[int, ...]], HeldFormat]


def compute_dtype_policy(dtype: torch.dtype) -> HeldPolicy:
    formats = {torch.float32: FP32, dtype: dtype_format(dtype)}
    return lambda name, shape: formats[held_dtype(name, dtype)]


@dataclass(frozen=True)
class CheckpointFormat:
    """What the byte count needs of a checkpoint's `ModelConfig.weight_format`."""

    linears: str = "bf16"  # "fp8" or "bf16"
    experts: str = "bf16"  # "fp4", "fp8" or "bf16"
    block: tuple[int, int] = (128, 128)
    scale_bytes: int = 1  # ue8m0: one byte; fp32 scales: four

    def describe(self) -> str:
        if self.linears == "bf16" and self.experts == "bf16":
            return "bf16"
        scales = "ue8m0" if self.scale_bytes == 1 else "fp32"
        linears = (f"fp8 e4m3 linears ({scales} scale per {self.block[0]}x{self.block[1]})"
                   if self.linears == "fp8" else "bf16 linears")
        return f"{linears}, {self.experts} routed experts"


def checkpoint_format(model_config) -> CheckpointFormat:
    """The checkpoint's storage format, from `ModelConfig.weight_format` (config.json's
    `quantization_config` and `expert_dtype`)."""
    wf = model_config.weight_format
    return CheckpointFormat(linears=wf.linears, experts=wf.experts, block=tuple(wf.block_size),
                            scale_bytes=1 if wf.scale_fmt == "ue8m0" else 4)


def is_routed_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def is_release_fp8_linear(name: str) -> bool:
    """The projections the release stores in FP8: every `*_proj` linear but the compressors' own
    (kv, gate, the indexer's kv, gate and weights_proj), which ship in bf16 like the embedding,
    LM head and router."""
    if not name.endswith("_proj.weight") or is_routed_expert(name):
        return False
    return ".compressor." not in name or name.endswith("indexer.q_b_proj.weight")


def held_quant(name: str, quantization: str, fmt, shape: tuple[int, ...]) -> str | None:
    """The format parameter `name` of `shape` is held in under `quantization` (model/quantize.py):
    "fp8", "fp4" or None (the compute dtype). Routed experts quantize where the kernels take their
    shapes: FP8 with the intermediate size a multiple of 128, FP4 with both sizes multiples of 32."""
    if quantization == "none" or name.startswith("mtp."):  # the MTP layer stays in the compute dtype
        return None
    if is_routed_expert(name):
        kind = "fp8" if quantization == "fp8" else fmt.experts if fmt.experts in ("fp8", "fp4") else None
        inter = shape[-2] // 2 if name.endswith("gate_up_proj") else shape[-1]
        hidden = shape[-1] if name.endswith("gate_up_proj") else shape[-2]
        if (kind == "fp8" and inter % 128) or (kind == "fp4" and (inter % 32 or hidden % 32)):
            return None
        return kind
    if name.endswith("o_a_proj.weight") or not is_release_fp8_linear(name):
        return None
    return "fp8" if quantization == "fp8" or fmt.linears == "fp8" else None


# Held quantized by model/quantize.py: e4m3 with one e8m0 scale byte per 128 x 128 block; e2m1
# with one e8m0 byte per 32 values.
FP8_HELD = HeldFormat("fp8 e4m3 (ue8m0 scale per 128x128)", 8, (128, 128), 1)
FP4_HELD = HeldFormat("fp4 e2m1 (ue8m0 scale per 32)", 4, (1, 32), 1)


def quantized_policy(dtype: torch.dtype, quantization: str, fmt) -> HeldPolicy:
    """The compute-dtype policy with the tensors `held_quant` names in FP8/FP4."""
    base = compute_dtype_policy(dtype)
    held = {"fp8": FP8_HELD, "fp4": FP4_HELD}

    def policy(name: str, shape: tuple[int, ...]) -> HeldFormat:
        kind = held_quant(name, quantization, fmt, shape)
        return base(name, shape) if kind is None else held[kind]
    return policy


def checkpoint_policy(fmt: CheckpointFormat) -> HeldPolicy:
    fp8 = HeldFormat(f"fp8 e4m3 ({fmt.block[0]}x{fmt.block[1]} scales)", 8, fmt.block, fmt.scale_bytes)
    fp4 = HeldFormat("fp4 e2m1 (scale per 32)", 4, (1, 32), fmt.scale_bytes)
    experts = {"fp4": fp4, "fp8": fp8}.get(fmt.experts, BF16)
    linears = fp8 if fmt.linears == "fp8" else BF16

    def policy(name: str, shape: tuple[int, ...]) -> HeldFormat:
        if is_routed_expert(name):
            return experts
        if is_release_fp8_linear(name):
            return linears
        return FP32 if held_dtype(name, torch.bfloat16) == torch.float32 else BF16
    return policy


@dataclass(frozen=True)
class ParallelLayout:
    """How the weights are spread over GPUs (the EngineConfig options of the same names)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def describe(self) -> str:
        ep = ", enable_expert_parallel=True" if self.enable_expert_parallel and self.tensor_parallel_size > 1 else ""
        return f"tensor_parallel_size={self.tensor_parallel_size}{ep}"


# (name suffix, dimension) of the tensors split over tensor-parallel ranks (model/sharding.py); the
# rest is replicated.
TP_SPLITS: tuple[tuple[str, int], ...] = (
    ("lm_head.weight", 0),  # vocabulary
    ("self_attn.q_b_proj.weight", 0), ("self_attn.sinks", 0),  # attention heads
    ("self_attn.o_a_proj.weight", 0), ("self_attn.o_b_proj.weight", 1),  # output groups
    ("shared_experts.gate_proj.weight", 0), ("shared_experts.up_proj.weight", 0),
    ("shared_experts.down_proj.weight", 1),
)
# Routed experts [E, out, in]: split within each expert under TP (the intermediate dimension).
EXPERT_TP_SPLITS = {"experts.gate_up_proj": 1, "experts.down_proj": 2}


def _split(shape: tuple[int, ...], dim: int, ways: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = -(-out[dim] // ways)
    return tuple(out)


def shard_shape(name: str, shape: tuple[int, ...], layout: ParallelLayout, o_groups: int | None = None
                ) -> tuple[int, ...]:
    """The largest shard of tensor `name` one GPU holds under `layout`. With more ranks than output
    groups (`o_groups`), a rank holds its whole group's `o_b_proj` columns."""
    ways = layout.tensor_parallel_size
    if ways == 1:
        return tuple(shape)
    if o_groups and name.endswith("self_attn.o_b_proj.weight"):
        return _split(shape, 1, min(ways, o_groups))
    for suffix, dim in EXPERT_TP_SPLITS.items():
        if name.endswith(suffix):
            return _split(shape, 0 if layout.enable_expert_parallel else dim, ways)
    for suffix, dim in TP_SPLITS:
        if name.endswith(suffix):
            return _split(shape, dim, ways)
    return tuple(shape)


def layout_problem(hf, layout: ParallelLayout) -> str | None:
    """Why `layout` cannot split this model evenly, or None."""
    ways = layout.tensor_parallel_size
    checks = [("num_attention_heads", hf.num_attention_heads), ("o_groups", hf.o_groups),
              ("index_n_heads", hf.index_n_heads),
              ("moe_intermediate_size * n_shared_experts", hf.moe_intermediate_size * hf.n_shared_experts)]
    checks.append(("n_routed_experts", hf.n_routed_experts) if layout.enable_expert_parallel
                  else ("moe_intermediate_size", hf.moe_intermediate_size))
    for key, value in checks:
        if value % ways:
            return f"{key} ({value}) is not divisible by tensor_parallel_size={ways}"
    return None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


def tensor_specs(modules: Iterable[tuple[str, nn.Module]]) -> list[TensorSpec]:
    """Every parameter and buffer of the (prefix, module) pairs; meta-device modules are fine."""
    specs = []
    for prefix, module in modules:
        specs += [TensorSpec(prefix + n, tuple(p.shape), p.dtype, True) for n, p in module.named_parameters()]
        specs += [TensorSpec(prefix + n, tuple(b.shape), b.dtype, False) for n, b in module.named_buffers()]
    return specs


PARTS = ("routed experts", "attention", "shared experts", "embedding and LM head", "other", "MTP layer")


def part_of(name: str) -> str:
    if name.startswith("mtp."):
        return "MTP layer"
    if is_routed_expert(name):
        return "routed experts"
    if ".self_attn." in name:
        return "attention"
    if "shared_experts." in name:
        return "shared experts"
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "embedding and LM head"
    return "other"


@dataclass(frozen=True)
class WeightBytes:
    """The weights of one model under one layout: one whole copy, and the largest GPU's share."""

    layout: ParallelLayout
    held: str
    total_bytes: int
    per_gpu_bytes: int
    per_gpu_by_part: dict[str, int] = field(default_factory=dict)

    def report(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.per_gpu_by_part.items() if v)
        return (f"weights as held ({self.held}): {format_bytes(self.total_bytes)} in all, "
                f"{format_bytes(self.per_gpu_bytes)} per GPU with {self.layout.describe()} ({parts})")


def count_bytes(specs: list[TensorSpec], policy: HeldPolicy, layout: ParallelLayout, held: str,
                o_groups: int | None = None) -> WeightBytes:
    total = per_gpu = 0
    by_part = dict.fromkeys(PARTS, 0)
    for spec in specs:
        fmt = policy(spec.name, spec.shape) if spec.is_parameter else dtype_format(spec.dtype)
        total += fmt.nbytes(spec.shape)
        share = fmt.nbytes(shard_shape(spec.name, spec.shape, layout, o_groups))
        per_gpu += share
        by_part[part_of(spec.name)] += share
    return WeightBytes(layout, held, total, per_gpu, by_part)


def describe_held(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if dtype == torch.float32 else f"{name}; norms, mHC and sinks float32"


@dataclass
class WeightPlan:
    """A model's tensors, how they are held and the checkpoint's format: bytes for any layout."""

    specs: list[TensorSpec]
    policy: HeldPolicy
    held: str
    hf_config: object
    checkpoint: CheckpointFormat

    @classmethod
    def of(cls, modules: Iterable[tuple[str, nn.Module]], model_config, dtype: torch.dtype,
           quantization: str = "none") -> WeightPlan:
        """As the loader holds them: `dtype` with float32 islands, and under `quantization` (auto, fp8)
        the tensors model/quantize.py keeps in FP8/FP4."""
        specs = tensor_specs(modules)
        if quantization == "none":
            return cls(specs, compute_dtype_policy(dtype), describe_held(dtype), model_config.hf_config,
                       checkpoint_format(model_config))
        policy = quantized_policy(dtype, quantization, model_config.weight_format)
        kinds = sorted({k for s in specs if s.is_parameter
                        for k in [held_quant(s.name, quantization, model_config.weight_format, s.shape)] if k})
        held = (f"quantization={quantization!r}: " + (", ".join(f"{k} where quantized" for k in kinds) or
                                                       "nothing quantized") + f", else {describe_held(dtype)}")
        return cls(specs, policy, held, model_config.hf_config, checkpoint_format(model_config))

    def at(self, layout: ParallelLayout = ParallelLayout()) -> WeightBytes:
        return count_bytes(self.specs, self.policy, layout, self.held, getattr(self.hf_config, "o_groups", None))

    def checkpoint_bytes(self) -> int:
        """One copy of every tensor in the checkpoint's own format (its size on disk, about)."""
        return count_bytes(self.specs, checkpoint_policy(self.checkpoint), ParallelLayout(), "").total_bytes

    def report(self, layout: ParallelLayout = ParallelLayout()) -> str:
        return (f"{self.at(layout).report()}; checkpoint {self.checkpoint.describe()}: about "
                f"{format_bytes(self.checkpoint_bytes())}")
