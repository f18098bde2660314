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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128  # FP8 weight block (both axes) and activation group along K
FP4_GROUP = 32  # FP4 scale group along K
FP8_MAX = 448.0  # largest finite e4m3 magnitude
FORMATS = ("fp8_block", "fp4")
SCALE_FMTS = ("ue8m0", None)  # activation scales: powers of two (the release's "ue8m0") or plain amax / 448


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


def check_scale_fmt(scale_fmt: str | None) -> None:
    if scale_fmt not in SCALE_FMTS:
        raise QuantFormatError(f"scale_fmt is {scale_fmt!r}: use 'ue8m0' (power-of-two activation scales) or None")
