"""The DeepSeek-V4 release's quantized weight formats, in plain PyTorch: decode and encode.

These functions are the reference of the formats: the loader decodes with them once at load,
the release-checkpoint writer encodes with them, and kernels that read the formats directly
are tested against them. Byte layouts (docs/checkpoints.md has the same with examples):

ue8m0 scale
    One unsigned byte `b` per scale, the power of two `2 ** (b - 127)` (no sign, no mantissa;
    `b = 255` is NaN). Stored as `torch.float8_e8m0fnu`, as raw `uint8` bytes, or as the power of
    two itself in a float32 container (the fp8-expert release does that).

FP8 block (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [bn, bk]`, 128 x 128 in the release)
    `weight` [N, K] `float8_e4m3fn` (1 sign, 4 exponent, 3 mantissa bits; finite max 448), and
    `scale` [ceil(N / bn), ceil(K / bk)]: element (n, k) is `weight[n, k] * scale[n // bn, k // bk]`.
    A partial last block (N or K not a multiple of the block) has a scale of its own.

FP4 e2m1 (`expert_dtype: fp4`, routed experts)
    `weight` [N, K / 2] `int8` (or `uint8`, or torch's `float4_e2m1fn_x2`): byte j of a row holds
    element 2j in its low nibble and element 2j + 1 in its high nibble. A nibble is e2m1: bit 3
    the sign, bits 0-2 the magnitude code 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6. `scale` [N, K / 32]:
    element (n, k) is `value(n, k) * scale[n, k // 32]`.

Every decode works in float32, where each of these products is exact, and writes into `out` (or
a new tensor of `dtype`) a block of rows at a time, so the float32 temporaries stay small.
"""
from __future__ import annotations

import math

import torch

FP8_BLOCK = (128, 128)
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Magnitudes of the e2m1 codes 0..7; codes 8..15 are the same with the sign bit set.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between neighbouring magnitudes (round to nearest, ties to the even code).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_UE8M0_BIAS = 127
_ROWS_PER_CHUNK = 128

FP4_STORAGE_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, ...]:
    """The scale grid of an FP8 block weight of `shape` (leading dims, e.g. experts, kept)."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def fp4_scale_shape(packed_shape: tuple[int, ...], group: int = FP4_GROUP) -> tuple[int, ...]:
    """The scale grid of an FP4 weight stored as `packed_shape` ([..., N, K / 2])."""
    *lead, n, half = packed_shape
    return (*lead, n, math.ceil(2 * half / group))


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales from a ue8m0 tensor (`float8_e8m0fnu`, raw `uint8` bytes or float32 powers of two)."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.to(torch.int32) - _UE8M0_BIAS)
    return scale.to(torch.float32)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """`float8_e8m0fnu` bytes of float32 powers of two (exact; rounds others up to the next power)."""
    exponent = torch.ceil(torch.log2(scale.to(torch.float32))).to(torch.int32) + _UE8M0_BIAS
    return exponent.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def is_power_of_two(scale: torch.Tensor) -> bool:
    """Whether every scale is a positive finite power of two (what ue8m0 can hold)."""
    s = ue8m0_to_float(scale)
    mantissa, _ = torch.frexp(s)
    return bool(((mantissa == 0.5) & torch.isfinite(s)).all())


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= qmax (1 for all-zero blocks)."""
    ratio = (amax.to(torch.float32) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(ratio))), torch.ones_like(ratio))


def _out(shape, like: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, the decoded tensor {tuple(shape)}")
    return out


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                         dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode an FP8 block weight [..., N, K] with its scale grid (module docstring)."""
    if tuple(scale.shape) != fp8_scale_shape(tuple(weight.shape), block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                         f"with blocks {tuple(block)}: expected {fp8_scale_shape(tuple(weight.shape), block)}")
    n, k = weight.shape[-2:]
    bn, bk = block
    s = ue8m0_to_float(scale)
    result = _out(weight.shape, weight, dtype, out)
    step = bn * max(1, _ROWS_PER_CHUNK // bn)  # whole blocks of rows
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = weight[..., r0:r1, :].to(torch.float32)
        grid = s[..., r0 // bn:(r1 + bn - 1) // bn, :]
        grid = grid.repeat_interleave(bn, dim=-2)[..., :r1 - r0, :].repeat_interleave(bk, dim=-1)[..., :k]
        result[..., r0:r1, :] = rows * grid
    return result


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                       scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode [..., N, K] as e4m3 with one power-of-two scale per block (the release's recipe:
    scale = the smallest power of two that brings the block's largest magnitude to <= 448).
    `scale_dtype`: `float8_e8m0fnu` or float32 (a float32 container of the same powers of two)."""
    n, k = weight.shape[-2:]
    bn, bk = block
    w = weight.to(torch.float32)
    pn, pk = math.ceil(n / bn) * bn - n, math.ceil(k / bk) * bk - k
    padded = torch.nn.functional.pad(w, (0, pk, 0, pn))
    tiles = padded.reshape(*w.shape[:-2], (n + pn) // bn, bn, (k + pk) // bk, bk)
    scale = _pow2_scale(tiles.abs().amax(dim=(-3, -1)), E4M3_MAX)
    full = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (float_to_ue8m0(scale) if scale_dtype == torch.float8_e8m0fnu else scale.to(scale_dtype))


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2 * K2] from FP4 bytes [..., K2] (even element in the low nibble)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    pairs = torch.stack((table[(u8 & 0x0F).long()], table[(u8 >> 4).long()]), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """int8 [..., K / 2] from values [..., K] (K even), each rounded to the nearest e2m1 value
    (ties to the even code; magnitudes above 6 saturate to 6)."""
    if values.shape[-1] % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dimension ({values.shape[-1]}) must be even")
    v = values.to(torch.float32)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=v.device)
    mag = v.abs()
    code = torch.bucketize(mag, mids, right=False)  # mag == mids[i] lands on code i, the lower neighbour
    odd_tie = (code % 2 == 1) & (mag == mids[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    code = torch.where(odd_tie, code + 1, code)
    code = code | torch.where(torch.signbit(v) & (code > 0), 8, 0)
    code = code.to(torch.uint8).reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return (code[..., 0] | (code[..., 1] << 4)).view(torch.int8)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP,
                   dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode FP4 e2m1 bytes [..., N, K / 2] with one scale per `group` values along K."""
    if tuple(scale.shape) != fp4_scale_shape(tuple(packed.shape), group):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match FP4 weight {tuple(packed.shape)} "
                         f"(2 values per byte, one scale per {group}): expected "
                         f"{fp4_scale_shape(tuple(packed.shape), group)}")
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    s = ue8m0_to_float(scale)
    result = _out((*packed.shape[:-1], k), packed, dtype, out)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(n, r0 + _ROWS_PER_CHUNK)
        values = unpack_e2m1(packed[..., r0:r1, :])
        result[..., r0:r1, :] = values * s[..., r0:r1, :].repeat_interleave(group, dim=-1)[..., :k]
    return result


def quantize_fp4(weight: torch.Tensor, group: int = FP4_GROUP,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode [..., N, K] (K even) as packed e2m1 with one power-of-two scale per `group` values
    along K (the smallest power of two that brings the group's largest magnitude to <= 6)."""
    k = weight.shape[-1]
    if k % 2:
        raise ValueError(f"FP4 packs two values per byte: the input dimension ({k}) must be even")
    w = weight.to(torch.float32)
    pad = math.ceil(k / group) * group - k
    groups = torch.nn.functional.pad(w, (0, pad)).reshape(*w.shape[:-1], (k + pad) // group, group)
    scale = _pow2_scale(groups.abs().amax(dim=-1), E2M1_MAX)
    packed = pack_e2m1(w / scale.repeat_interleave(group, dim=-1)[..., :k])
    return packed, (float_to_ue8m0(scale) if scale_dtype == torch.float8_e8m0fnu else scale.to(scale_dtype))
