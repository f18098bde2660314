"""The fused mHC coefficient kernel equals its reference (Triton interpreter on CPU; GPU too)."""
import pytest
import torch

from sparseserve.kernels.mhc import hc_coefficients_ref, hc_coefficients_triton


@pytest.mark.parametrize("hc, iters, tokens", [(4, 20, 33), (2, 5, 7), (1, 3, 4), (3, 20, 9)])
def test_kernel_matches_reference(hc, iters, tokens):
    gen = torch.Generator().manual_seed(hc * 100 + iters)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mixes = (2 * torch.randn(tokens, (2 + hc) * hc, generator=gen)).to(device)
    base = torch.randn((2 + hc) * hc, generator=gen).to(device)
    scale = (0.5 + torch.rand(3, generator=gen)).to(device)
    ref = hc_coefficients_ref(mixes, base, scale, hc, iters, 1e-6)
    got = hc_coefficients_triton(mixes, base, scale, hc, iters, 1e-6)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
