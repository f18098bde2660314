"""The embedding written into the hc streams equals weight[ids] broadcast, exactly (a copy)."""
import pytest
import torch

from sparseserve.kernels.embed import embed_streams, embed_streams_ref, embed_streams_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens, hc, dim, dtype", [(1, 4, 64, torch.bfloat16), (7, 2, 100, torch.float16),
                                                    (3, 1, 1500, torch.float32), (0, 4, 64, torch.bfloat16)])
def test_matches_reference(tokens, hc, dim, dtype):
    gen = torch.Generator().manual_seed(tokens + dim)
    weight = torch.randn(50, dim, generator=gen).to(DEVICE, dtype)
    ids = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    if tokens:
        ids[0] = 49  # the last row
    got = embed_streams_triton(ids, weight, hc)
    assert got.shape == (tokens, hc, dim) and got.dtype == dtype
    assert torch.equal(got, embed_streams_ref(ids, weight, hc))


def test_dispatch_keeps_the_reference_on_cpu():
    weight = torch.randn(10, 8)
    ids = torch.tensor([3, 9])
    assert torch.equal(embed_streams(ids, weight.to("cpu"), 4), embed_streams_ref(ids, weight, 4))


@pytest.mark.gpu
def test_flash_shape_gpu():
    weight = torch.randn(129280, 4096, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 129280, (64,), device="cuda")
    assert torch.equal(embed_streams(ids, weight, 4), embed_streams_ref(ids, weight, 4))
