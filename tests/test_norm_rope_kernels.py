"""Fused RMSNorm and in-place rope kernels equal their references (interpreter on CPU; GPU too)."""
import pytest
import torch

from sparseserve.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from sparseserve.kernels.rope import apply_rope_, apply_rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape, weighted, dtype", [((7, 48), True, torch.float32), ((3, 5, 64), False, torch.float32),
                                                    ((9, 100), True, torch.bfloat16)])
def test_rms_norm(shape, weighted, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE) if weighted else None
    ref = rms_norm_ref(x, w, 1e-6)
    got = rms_norm_triton(x, w, 1e-6)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: within one rounding step
    assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("view", ["cols", "heads", "transposed"])
def test_rms_norm_reads_strided_views_in_place(view):
    """Column slices of a packed projection's output (2-D, and split into heads) are normalised
    without a copy; other layouts fall back to a contiguous copy. The output is contiguous."""
    gen = torch.Generator().manual_seed(3)
    packed = (2 * torch.randn(11, 7 * 32 + 40, generator=gen)).to(DEVICE)
    w = (1 + 0.3 * torch.randn(32, generator=gen)).to(DEVICE)
    if view == "cols":
        x, w = packed[:, 8:8 + 96], torch.cat([w, w, w])
    elif view == "heads":
        x = packed[:, 40:].view(11, 7, 32)
    else:
        x = packed[:, :32 * 7].view(11, 7, 32).transpose(0, 1)
    assert not x.is_contiguous()
    got = rms_norm_triton(x, w, 1e-6)
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.allclose(got, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, rope_half, inverse", [((6, 32), 8, False), ((5, 3, 64), 16, True),
                                                       ((4, 2, 16), 8, False),
                                                       ((37, 5, 64), 32, False),  # 185 rows: a ragged last tile
                                                       ((130, 96), 32, True)])
def test_rope_in_place(shape, rope_half, inverse):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen).to(DEVICE)
    pos = torch.randint(0, 5000, (shape[0],), generator=gen).float()
    freqs = pos.unsqueeze(1) * (1.0 / 10000 ** (torch.arange(rope_half) / rope_half)).unsqueeze(0)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    ref = apply_rope_ref(x, cos, sin, inverse)
    got = apply_rope_(x.clone(), cos, sin, inverse)
    assert torch.allclose(got, ref, atol=1e-5)
    back = apply_rope_(got.clone(), cos, sin, not inverse)
    assert torch.allclose(back, x, atol=1e-4)


@pytest.mark.parametrize("layout", ["heads_of_a_column_slice", "rows_of_a_column_slice"])
def test_rope_rotates_a_strided_view_in_place(layout):
    """The head-split column slice of a packed projection's output is rotated where it lies:
    the columns outside the slice are untouched."""
    gen = torch.Generator().manual_seed(4)
    packed = torch.randn(9, 24 + 3 * 32 + 8, generator=gen).to(DEVICE)
    x = packed[:, 24:24 + 96].view(9, 3, 32) if layout == "heads_of_a_column_slice" else packed[:, 24:24 + 96]
    pos = torch.randint(0, 3000, (9,), generator=gen).float()
    freqs = pos.unsqueeze(1) * (1.0 / 10000 ** (torch.arange(8) / 8)).unsqueeze(0)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    before = packed.clone()
    ref = apply_rope_ref(x, cos, sin)
    assert apply_rope_(x, cos, sin) is x
    assert torch.allclose(x, ref, atol=1e-5)
    assert torch.equal(packed[:, :24], before[:, :24]) and torch.equal(packed[:, 120:], before[:, 120:])
