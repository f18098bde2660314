"""The KV cache's storage formats (`kv_cache_dtype`), in plain PyTorch: layout, quantize, dequantize.

Neutral: the engine counts bytes with it, the model allocates with it, and the kernels that write and read FP8
rows are tested against these functions (docs/kv-cache.md has the layout with the numbers for V4-Flash).

`kv_cache_dtype`
    "auto": the model's dtype (bf16 for the checkpoints); "bfloat16": bf16 rows whatever the model's dtype;
    "fp8": the KV rows (window ring, staging, compressed entries) and the indexer keys in FP8 e4m3.

FP8 KV row (one uint8 row of `KVFormat.row_bytes`, array-of-structures, one gather per row)
    [ nope codes: nope_dim x e4m3 | rope: rope_dim x bf16 | scales: one ue8m0 byte per 64 nope dims | pad ]
    nope_dim = head_dim - rope_dim. Value of nope channel c: e4m3(code[c]) * 2^(scale[c // 64] - 127); the rope
    channels are the bf16 row's own values (rope angles need the precision; 64 of 512 channels). The row is
    padded to a multiple of 16 bytes, so every row starts 16-byte aligned (whole 16-byte vectors for cp.async
    and vectorised loads): V4 (512 = 448 + 64) takes 448 + 128 + 7 (+ 9 pad) = 592 B against 1,024 in bf16.
FP8 indexer key (two tensors: codes [E, index_head_dim] uint8, scales [E] fp32)
    key[c] = e4m3(code[c]) * scale; the scale a power of two: 128 + 4 = 132 B against 256 in bf16.

Quantization (both): per group, scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (the release's ue8m0 rounding, as
its activation quantization), code = round-to-nearest-even e4m3 of value / scale (exact division by a power of
two). A row is first rounded to the dtype the unquantized cache would hold (the model's), then quantized, so the
FP8 cache holds exactly Q(the bf16 cache's row). Dequantized values are exact in bf16 (3 mantissa bits, a
power-of-two scale), so kernels may dequantize straight into 16-bit dot operands.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")
FP8_KV_GROUP = 64  # nope channels per ue8m0 scale
ROW_ALIGN = 16  # bytes; every FP8 KV row starts on a 16-byte boundary
FP8_MAX = 448.0
_INV_FP8_MAX = 1.0 / 448.0
_AMAX_FLOOR = 1e-4
_BF16_BYTES = 2


@dataclass(frozen=True)
class KVFormat:
    """The byte layout of one FP8 KV row (module docstring). All offsets in bytes from the row's start."""

    head_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        if not (0 <= self.rope_dim < self.head_dim) or self.rope_dim % 2 or self.head_dim % 2:
            raise ValueError(f"an FP8 KV row needs an even head_dim above an even rope_dim, got head_dim "
                             f"{self.head_dim}, rope_dim {self.rope_dim}")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_scales(self) -> int:
        return -(-self.nope_dim // FP8_KV_GROUP)

    @property
    def rope_offset(self) -> int:
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.nope_dim + _BF16_BYTES * self.rope_dim

    @property
    def row_bytes(self) -> int:
        used = self.scale_offset + self.num_scales
        return -(-used // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class IndexFormat:
    """FP8 indexer keys: `head_dim` one-byte codes and one fp32 scale per key."""

    head_dim: int

    @property
    def row_bytes(self) -> int:
        return self.head_dim + 4


def kv_row_bytes(head_dim: int, rope_dim: int, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes of one KV row (window, staging or compressed entry) in that storage."""
    if kv_cache_dtype == "fp8":
        return KVFormat(head_dim, rope_dim).row_bytes
    return head_dim * (2 if kv_cache_dtype == "bfloat16" else dtype_bytes)


def index_row_bytes(index_head_dim: int, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes of one indexer key in that storage."""
    if kv_cache_dtype == "fp8":
        return IndexFormat(index_head_dim).row_bytes
    return index_head_dim * (2 if kv_cache_dtype == "bfloat16" else dtype_bytes)


def pow2_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponents (int32) of 2^ceil(log2(max(amax, 1e-4) / 448)), on the fp32 bits (exact)."""
    s = amax.float().clamp_min(_AMAX_FLOOR) * _INV_FP8_MAX
    bits = s.view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) as fp32 from ue8m0 bytes (b in 1..254)."""
    return (exponent_bytes.to(torch.int32) << 23).view(torch.float32)


def _e4m3_codes(x: torch.Tensor, exponent_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of x / 2^(b - 127) (exact scaling; then round to nearest even)."""
    inv = ((254 - exponent_bytes.to(torch.int32)) << 23).view(torch.float32)
    return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_kv_rows(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows [M, head_dim] (any float dtype, already in the cache's unquantized dtype) -> packed FP8 rows
    [M, row_bytes] uint8. The padding bytes are 0."""
    m = rows.shape[0]
    x = rows.float()
    out = torch.zeros(m, fmt.row_bytes, dtype=torch.uint8, device=rows.device)
    nope = x[:, :fmt.nope_dim]
    pad = fmt.num_scales * FP8_KV_GROUP - fmt.nope_dim
    groups = torch.nn.functional.pad(nope, (0, pad)).view(m, fmt.num_scales, FP8_KV_GROUP)
    exps = pow2_scale_bytes(groups.abs().amax(dim=2))  # [M, G]
    codes = _e4m3_codes(groups, exps.unsqueeze(-1)).reshape(m, fmt.num_scales * FP8_KV_GROUP)[:, :fmt.nope_dim]
    out[:, :fmt.nope_dim] = codes
    rope = x[:, fmt.nope_dim:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, fmt.rope_offset:fmt.scale_offset] = rope
    out[:, fmt.scale_offset:fmt.scale_offset + fmt.num_scales] = exps.to(torch.uint8)
    return out


def dequantize_kv_rows(packed: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed FP8 rows [..., row_bytes] uint8 -> values [..., head_dim] (exact in bf16 and fp32)."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, fmt.row_bytes)
    codes = flat[:, :fmt.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    exps = flat[:, fmt.scale_offset:fmt.scale_offset + fmt.num_scales]
    scales = _pow2(exps).repeat_interleave(FP8_KV_GROUP, dim=1)[:, :fmt.nope_dim]
    rope = flat[:, fmt.rope_offset:fmt.scale_offset].contiguous().view(torch.bfloat16).float()
    return torch.cat([codes * scales, rope], dim=1).to(dtype).view(*lead, fmt.head_dim)


def quantize_index_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys [M, Di] -> (codes [M, Di] uint8, scales [M] fp32, powers of two)."""
    x = rows.float()
    exps = pow2_scale_bytes(x.abs().amax(dim=1))
    return _e4m3_codes(x, exps.unsqueeze(-1)), _pow2(exps)


def dequantize_index_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                          ) -> torch.Tensor:
    """(codes [..., Di] uint8, scales [...] fp32) -> keys [..., Di]."""
    return (codes.view(torch.float8_e4m3fn).float() * scales.float().unsqueeze(-1)).to(dtype)
