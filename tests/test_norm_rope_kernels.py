"""Fused RMSNorm, in-place rope and rope-table kernels equal their references (interpreter on CPU; GPU too)."""
import pytest
import torch

from sparseserve.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from sparseserve.kernels.rope import apply_rope_, apply_rope_ref, rope_tables_ref, rope_tables_triton
from sparseserve.model.layers.rope import rope_cos_sin, rope_inv_freq

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


@pytest.mark.parametrize("num_tokens, half", [(1, 32), (5, 8), (67, 32), (130, 16)])  # 67, 130: ragged last tiles
def test_rope_tables_kernel(num_tokens, half):
    """One launch of every table: positions up to 1M (angles up to ~1e6 rad), negative offsets
    (an entry's position before the token's), a YaRN base next to a plain one."""
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.randint(0, 1 << 20, (num_tokens,), generator=gen)
    positions[0] = 0  # position 0 with offset 1 - rate: a negative position, as the reference computes it
    offsets = torch.tensor([0, 0, -3, -127])
    yarn = {"rope_theta": 160000.0, "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536}
    inv_freq = torch.stack([rope_inv_freq({"rope_theta": 10000.0}, 2 * half), rope_inv_freq(yarn, 2 * half),
                            rope_inv_freq(yarn, 2 * half), torch.rand(half, generator=gen)])
    ref = rope_tables_ref(positions, offsets, inv_freq)
    got = rope_tables_triton(positions.to(DEVICE), offsets.to(DEVICE), inv_freq.to(DEVICE)).cpu()
    assert got.shape == (4, 2, num_tokens, half)
    # Angles up to ~1e6 rad: fp32 cos/sin implementations may differ by a few ulp of the angle's reduction.
    assert torch.allclose(got, ref, atol=2e-6, rtol=0)


def test_rope_tables_ref_equals_the_per_table_computation():
    """Bitwise: table i is rope_cos_sin(positions + offsets[i], inv_freq[i]), as the step context
    computed it table by table before."""
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 100000, (40,), generator=gen)
    offsets = torch.tensor([0, -3, -127])
    inv_freq = torch.rand(3, 32, generator=gen)
    tables = rope_tables_ref(positions, offsets, inv_freq)
    for i in range(3):
        cos, sin = rope_cos_sin(positions + int(offsets[i]), inv_freq[i])
        assert torch.equal(tables[i, 0], cos) and torch.equal(tables[i, 1], sin)
