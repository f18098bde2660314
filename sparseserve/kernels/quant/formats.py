"""The quantized weight formats the kernels read, and their checks.

* ``fp8_block``: e4m3 codes ``[..., N, K]`` (``torch.float8_e4m3fn``) with one scale per 128 x 128 block,
  ``[..., ceil(N/128), ceil(K/128)]``, as fp32 or ``torch.float8_e8m0fnu`` (a power of two, "ue8m0").
* ``fp4``: e2m1 codes ``[..., N, K/2]`` as uint8 or int8 (``torch.float4_e2m1fn_x2`` is viewed as uint8), two
  values per byte along K, element ``k = 2j`` in the low nibble of byte ``j``; one ue8m0 (or fp32) scale per 32
  values along K, ``[..., N, K/32]``.

A leading expert dimension ``E`` is allowed (the routed experts). A packed gate-up weight is ``w1`` rows then
``w3`` rows, with the scales concatenated the same way (``scale = cat(s1, s3)`` along the row axis); for
``fp8_block`` the up half's block scales therefore start at scale row ``ceil(I/128)``, whatever ``I`` is.

Activation scales are always fp32 inside the kernels (they are transient); an e8m0 scale holds the same power of
two, so the format of the release's ``scale_dtype`` only changes storage, never a value.

The one-dot FP4 form (kernels/quant/fp4_one_dot.py) multiplies a 128-column group of a weight row as ONE set of
e4m3 codes with ONE scale. With ``e_q`` the exponent of sub-group ``q``'s scale (``2^(e_q - 127)``), ``e_max`` the
largest of the group's and ``d_q = e_max - e_q``, element value ``v`` (an e2m1 magnitude, with its sign) becomes the
e4m3 code of ``v * 2^(T - d_q)`` (``T = ONE_DOT_TOP = 6``) and the group's scale is ``2^(e_max - 127 - T)``.

Exactness bound (``ONE_DOT_MAX_SHIFT``). A nonzero e2m1 magnitude is ``c * 2^b`` with ``c`` in {1, 3} and
``b`` in {-1, 0, 1, 2} (0.5, 1, 2, 4 and 1.5, 3, 6), so ``x = v * 2^s`` (``s = T - d_q``) has at most two
significant bits, the lowest of weight ``2^(b + s)``. e4m3 (``float8_e4m3fn``) holds every value of at most four
significant bits from ``2^-6`` up to 448, and below ``2^-6`` the multiples of ``2^-9`` (subnormals, up to
``7 * 2^-9``). Hence ``x`` is exact iff ``x <= 448`` and ``2^(b + s) >= 2^-9``. The top: ``6 * 2^s <= 448`` iff
``s <= 6``, so ``T = 6`` is the largest offset that never overflows (``6 * 64 = 384``); ``d_q >= 0`` keeps
``s <= T``. The bottom, over the magnitudes with ``b = -1`` (0.5 and 1.5): ``s - 1 >= -9``, i.e. ``s >= -8``,
i.e. ``d_q <= T + 8 = 14``. So a sub-group is exact for every code it could hold iff ``d_q <= 14``, and with
``d_q = 15`` a code of 0.5 (``2^-10``) or 1.5 (``3 * 2^-10``) is not representable; zeros are exact at any shift.
`fp4_one_dot_exact` tests this for every (row, group) of a tensor, counting only sub-groups that hold a nonzero
code (the zero ones contribute nothing; quantizers give all-zero sub-groups tiny scales) but taking ``e_max`` over
all of a group's sub-groups, as the kernel does. fp32 scales qualify only where the sub-groups with a nonzero
code have positive normal powers of two (their exponent field is then ``e_q``); any other fp32 scale, and any
exponent 255 (e8m0 NaN, fp32 inf/NaN), leaves the tensor to the four-dot form.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 128  # FP8 weight block (both axes) and activation group along K
FP4_GROUP = 32  # FP4 scale group along K
FP8_MAX = 448.0  # largest finite e4m3 magnitude
FORMATS = ("fp8_block", "fp4")
SCALE_FMTS = ("ue8m0", None)  # activation scales: powers of two (the release's "ue8m0") or plain amax / 448
ONE_DOT_TOP = 6  # T: the largest sub-group's codes are e2m1 values x 2^T (6 x 64 = 384 <= 448)
ONE_DOT_MAX_SHIFT = ONE_DOT_TOP + 8  # the largest d_q with every code exact (module docstring)


class QuantFormatError(ValueError):
    """A quantized weight or an argument that does not match its format; the message names the field."""


@dataclass(frozen=True)
class QuantWeight:
    """A weight the kernels compute on without decoding it first.

    ``data`` and ``scale`` as described in the module docstring; ``fmt`` is ``"fp8_block"`` or ``"fp4"``.
    ``shape`` is the logical ``[..., N, K]``."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str

    def __post_init__(self) -> None:
        check_weight(self)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, k = self.data.shape
        return (*lead, n, k * 2 if self.fmt == "fp4" else k)

    @property
    def codes(self) -> torch.Tensor:
        """``data`` as the kernels read it: e4m3 for fp8_block, uint8 for fp4."""
        if self.fmt == "fp4" and self.data.dtype != torch.uint8:
            return self.data.view(torch.uint8)
        return self.data

    @property
    def scale_is_e8m0(self) -> bool:
        return self.scale.dtype == torch.float8_e8m0fnu

    @property
    def scale_bits(self) -> torch.Tensor:
        """``scale`` as the kernels read it: the exponent bytes of an e8m0 scale, an fp32 scale as it is."""
        return self.scale.view(torch.uint8) if self.scale_is_e8m0 else self.scale

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    @functools.cached_property
    def fp4_one_dot_exact(self) -> bool:
        """fp4: whether the one-dot form is exact on every group (the module's fp4_one_dot_exact); False for
        fp8_block.
        Computed once per QuantWeight (a pass over codes and scales, one host sync): the loader reads it at
        load (model/quantize.py), so no step, and no graph capture, computes it."""
        return self.fmt == "fp4" and fp4_one_dot_exact(self.codes, self.scale)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_weight(w: QuantWeight) -> None:
    """Raise QuantFormatError unless data, scale and fmt agree (dtypes and shapes)."""
    if w.fmt not in FORMATS:
        raise QuantFormatError(f"QuantWeight.fmt is {w.fmt!r}: use one of {FORMATS}")
    if w.scale.dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise QuantFormatError(f"QuantWeight.scale has dtype {w.scale.dtype}: use torch.float32 or "
                               "torch.float8_e8m0fnu")
    if w.data.dim() < 2 or w.data.dim() != w.scale.dim():
        raise QuantFormatError(f"QuantWeight.data {tuple(w.data.shape)} and .scale {tuple(w.scale.shape)} need "
                               "the same number (>= 2) of dimensions")
    if w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise QuantFormatError("QuantWeight.data and .scale need a contiguous last dimension")
    *lead, n, k = w.shape
    if w.fmt == "fp8_block":
        if w.data.dtype != torch.float8_e4m3fn:
            raise QuantFormatError(f"fp8_block QuantWeight.data has dtype {w.data.dtype}: use torch.float8_e4m3fn")
        want = (*lead, _cdiv(n, BLOCK), _cdiv(k, BLOCK))
    else:
        if w.data.dtype not in (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.uint8)):
            raise QuantFormatError(f"fp4 QuantWeight.data has dtype {w.data.dtype}: use uint8 or int8 (two e2m1 "
                                   "codes per byte)")
        if k % FP4_GROUP:
            raise QuantFormatError(f"fp4 QuantWeight has K = {k} (2 x {k // 2} bytes): K must be a multiple of "
                                   f"{FP4_GROUP}")
        want = (*lead, n, k // FP4_GROUP)
    if tuple(w.scale.shape) != want:
        raise QuantFormatError(f"{w.fmt} QuantWeight.scale has shape {tuple(w.scale.shape)}; data "
                               f"{tuple(w.data.shape)} needs {want}")


def scale_exponents(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 scales -> (exponent fields e_q, int32; whether each scale is 2^(e_q - 127) exactly). e8m0: the bytes,
    every one a power of two but 255 (NaN). fp32: bits 30-23; a power of two where positive, normal and with a
    zero mantissa."""
    if scale.dtype == torch.float8_e8m0fnu:
        e = scale.view(torch.uint8).to(torch.int32)
        return e, e != 255
    bits = scale.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    return e, (bits >= 0) & (bits & 0x7FFFFF == 0) & (e >= 1) & (e <= 254)


def fp4_one_dot_exact(codes: torch.Tensor, scale: torch.Tensor, rows_per_pass: int = 1 << 16) -> bool:
    """Whether the one-dot FP4 form is exact for packed e2m1 codes [..., N, K/2] (uint8) and their per-32 scales
    [..., N, K/32] (module docstring): in every 128-column group of every row, each sub-group holding a nonzero
    code has d_q = e_max - e_q <= ONE_DOT_MAX_SHIFT and a power-of-two scale, and no sub-group's exponent is
    255. Runs on the tensors' device in passes of `rows_per_pass` rows (bounded temporaries); one host sync."""
    k32 = scale.shape[-1]
    flat_codes = codes.reshape(-1, codes.shape[-1])
    flat_scale = scale.reshape(-1, k32)
    groups = -(-k32 // 4)
    bad = torch.zeros((), dtype=torch.bool, device=codes.device)
    for r0 in range(0, flat_scale.shape[0], rows_per_pass):
        e, pow2 = scale_exponents(flat_scale[r0:r0 + rows_per_pass])
        rows = e.shape[0]
        nonzero = (flat_codes[r0:r0 + rows].reshape(rows, k32, 16) & 0x77).ne(0).any(dim=-1)  # -0 counts as zero
        pad = groups * 4 - k32  # a last group of fewer sub-groups: pad with e = 0, no codes (the kernel's mask)
        e_pad = torch.nn.functional.pad(e, (0, pad)).view(rows, groups, 4)
        shift = (e_pad.amax(dim=-1, keepdim=True) - e_pad).view(rows, groups * 4)[:, :k32]
        bad |= (nonzero & ((shift > ONE_DOT_MAX_SHIFT) | ~pow2)).any() | (e == 255).any()
    return not bool(bad.item())


def check_scale_fmt(scale_fmt: str | None) -> None:
    if scale_fmt not in SCALE_FMTS:
        raise QuantFormatError(f"scale_fmt is {scale_fmt!r}: use 'ue8m0' (power-of-two activation scales) or None")
