"""Configuration dataclasses: the model's static facts, the cache geometry, the engine's options."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import DeepseekV4Config

from .names import LAYER_CSA, LAYER_HCA, LAYER_SLIDING, SIDE_STREAM_MODES  # noqa: F401 (re-exported)

from .errors import ConfigError

# The values of config.json's `expert_dtype` that mean "routed experts as the other weights".
UNQUANTIZED_EXPERTS = (None, "bf16", "bfloat16")


@dataclass(frozen=True)
class WeightFormat:
    """How the checkpoint stores its weights: config.json's `quantization_config` and `expert_dtype`
    (checked by `checkpoint_checks.check_weight_format`; docs/checkpoints.md describes the formats).
    The loader decodes every quantized tensor into the compute dtype once, at load."""

    quant_method: str | None = None          # "fp8" (block FP8 linears) or None (unquantized)
    fmt: str = "e4m3"
    scale_fmt: str | None = None             # "ue8m0": every scale a power of two
    block_size: tuple[int, int] = (128, 128)  # FP8 scale block [out, in]
    activation_scheme: str = "dynamic"
    expert_dtype: str | None = None          # "fp4", "fp8", or None: see `experts`

    @classmethod
    def from_hf_config(cls, hf_config) -> "WeightFormat":
        quant = getattr(hf_config, "quantization_config", None) or {}
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        block = quant.get("weight_block_size") or (128, 128)
        return cls(quant_method=quant.get("quant_method"), fmt=quant.get("fmt") or "e4m3",
                   scale_fmt=quant.get("scale_fmt"), block_size=(int(block[0]), int(block[1])),
                   activation_scheme=quant.get("activation_scheme") or "dynamic",
                   expert_dtype=getattr(hf_config, "expert_dtype", None))

    @property
    def linears(self) -> str:
        """"fp8" when the checkpoint's dense projections may be block FP8, else "bf16"."""
        return "fp8" if self.quant_method == "fp8" else "bf16"

    @property
    def experts(self) -> str:
        """The routed experts' storage: "fp4", "fp8" or "bf16". Without `expert_dtype` they are
        stored as the linears are (FP8 in an fp8 checkpoint, as `transformers` reads it)."""
        if self.expert_dtype in UNQUANTIZED_EXPERTS:
            return self.linears if self.expert_dtype is None else "bf16"
        return str(self.expert_dtype)


@dataclass
class ModelConfig:
    """A DeepSeek-V4 `transformers` config plus the facts the engine derives from it."""

    hf_config: DeepseekV4Config
    dtype: torch.dtype = torch.bfloat16
    path: str | None = None
    # How the checkpoint stores its weights (derived from hf_config when not given).
    weight_format: WeightFormat | None = None

    def __post_init__(self) -> None:
        if self.weight_format is None:
            self.weight_format = WeightFormat.from_hf_config(self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def layer_type(self, layer_idx: int) -> str:
        return self.hf_config.layer_types[layer_idx]

    def is_csa(self, layer_idx: int) -> bool:
        return self.layer_type(layer_idx) == LAYER_CSA

    def compress_rate(self, layer_idx: int) -> int:
        """0 for sliding-window-only layers."""
        kind = self.layer_type(layer_idx)
        return 0 if kind == LAYER_SLIDING else int(self.hf_config.compress_rates[kind])

    @property
    def rates(self) -> list[int]:
        return sorted({self.compress_rate(i) for i in range(self.num_layers)} - {0})

    @property
    def lcm_rate(self) -> int:
        return math.lcm(*self.rates) if self.rates else 1

    def compressed_bytes_per_token(self, layer_idx: int, dtype_bytes: int) -> float:
        """Bytes of compressed state one token adds to a layer (docs/design.md, section 1)."""
        rate = self.compress_rate(layer_idx)
        if rate == 0:
            return 0.0
        width = self.hf_config.head_dim + (self.hf_config.index_head_dim if self.is_csa(layer_idx) else 0)
        return width * dtype_bytes / rate


@dataclass
class CacheConfig:
    """The state geometry the engine chose; bytes per block are given by layer kind."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    num_slots: int = 0
    bytes_per_block_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_per_slot_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.bytes_per_block_by_kind.values())


@dataclass
class EngineConfig:
    """Every option of `LLM(...)`, with vLLM's names; validated by `validate()`."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # Routed experts split across the tensor-parallel ranks (whole experts per rank) instead of
    # within each expert (docs/parallelism.md).
    enable_expert_parallel: bool = False
    # Several nodes: torch.distributed's rendezvous at master_addr:master_port (None: torchrun's
    # MASTER_ADDR / MASTER_PORT when set, else localhost and a free port on one node).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    load_format: str = "auto"
    # Weights held quantized (model/quantize.py, docs/quantization.md): "none" (decoded to the compute
    # dtype at load), "auto" (what the checkpoint stores in FP8/FP4 stays so), "fp8" (block-FP8 at load).
    quantization: str = "none"
    # KV cache storage (vLLM's name; sparseserve/kv_format.py, docs/kv-cache.md): "auto" (the model's dtype),
    # "bfloat16", or "fp8" (window, compressed and indexer rows in FP8 e4m3 with power-of-two scales).
    kv_cache_dtype: str = "auto"
    use_tqdm_on_load: bool = True  # vLLM's: a progress bar while the weights load (on a terminal only)
    hf_overrides: dict | None = None
    speculative_config: dict | None = None
    topk_backend: str = "auto"
    num_gpu_blocks_override: int | None = None
    cuda_graph_sizes: list[int] | None = None
    # vLLM's compilation_config.cudagraph_mode: "full_and_piecewise" (decode steps replay whole-step graphs,
    # prefill and mixed steps piecewise graphs over token-count buckets: worker/prefill_graphs.py) or
    # "full_decode_only" (prefill and mixed steps run eagerly). enforce_eager=True captures neither.
    cudagraph_mode: str = "full_and_piecewise"
    # The piecewise graphs' token-count buckets (None: 16, 32, 64, 128, 256, multiples of 128 to 1,024
    # and of 256 to 2,048, capped at max_num_batched_tokens); a step pads to the smallest bucket that holds it.
    prefill_cuda_graph_sizes: list[int] | None = None
    # At every start-up compare each top-k path's graphs with a second capture at max_model_len dummy
    # lengths (a frozen host branch refuses to start); `cudagraph_audit_replay` also compares every
    # bucket's capture and replays each graph on random batches against the eager step (slow).
    cudagraph_audit: bool = True
    cudagraph_audit_replay: bool = False
    step_timeout_s: float = 60.0
    # Launch each step before the previous one is read back (None: on for CUDA without speculation).
    async_scheduling: bool | None = None
    # Where a step's independent work runs: "auto" (a second stream inside captured graphs, one
    # stream with speculation), "graphs", "always" (eager steps too) or "never" (one stream).
    side_stream: str = "auto"
    # The most logprobs / prompt_logprobs a request may ask for per token (vLLM's max_logprobs).
    max_logprobs: int = 20

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def validate(self) -> None:
        """Types and ranges of every option (sparseserve/config_checks.py); raises ConfigError."""
        from .config_checks import validate_engine_config

        validate_engine_config(self)

    @property
    def num_speculative_tokens(self) -> int:
        return int(self.speculative_config["num_speculative_tokens"]) if self.speculative_config else 0

    @property
    def speculative_adaptive(self) -> bool | None:
        """speculative_config['adaptive']: drafts per step chosen from acceptance and step costs
        (spec_decode/adaptive.py); None (the default) = off: k drafts every step."""
        return self.speculative_config.get("adaptive") if self.speculative_config else None

    def adaptive_speculation_on(self, device_type: str) -> bool:
        """Whether adaptive speculation runs: only when asked (`"adaptive": True`). It is opt-in while
        its step costs and the >= 0.97x-of-plain goal are unmeasured on a GPU (docs/design.md)."""
        del device_type  # the policy times graphs where they run, and models eager step costs elsewhere
        return bool(self.num_speculative_tokens and self.speculative_adaptive)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but CUDA is not available; use device='cpu' or 'auto'")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """'auto' is bfloat16 on CUDA and float32 on the CPU."""
        names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "half": torch.float16}
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in names:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(names)}, got {self.dtype!r}")
        return names[self.dtype]
