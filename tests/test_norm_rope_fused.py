"""RMSNorm then rope (and the pool write) in one launch equals the unfused kernels: on the CPU
under the Triton interpreter exactly against the unfused Triton kernels (rms_norm_triton, then
apply_rope_ in place, then index_copy), and within a bf16 rounding step of the plain-PyTorch
references (whose rsqrt rounds differently in the last fp32 bit, which can flip a bf16 rounding);
the `gpu` tests at V4-Flash shapes within a rounding step (compiled kernels may contract
multiply-adds differently)."""
import pytest
import torch

from sparseserve.kernels.norm_rope import norm_rope, norm_rope_ref, norm_rope_triton
from sparseserve.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from sparseserve.kernels.rope import apply_rope_, apply_rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tables(tokens, half, gen):
    angle = torch.rand(tokens, half, generator=gen) * 6.3
    return angle.cos().to(DEVICE), angle.sin().to(DEVICE)


def unfused_kernels(x, weight, eps, cos, sin):
    return apply_rope_(rms_norm_triton(x, weight, eps), cos, sin)


def plain_ref(x, weight, eps, cos, sin):
    return apply_rope_ref(rms_norm_ref(x, weight, eps), cos, sin)


def assert_within_a_rounding_step(got, want):
    """A rounding flip of the normalised row moves each rotated output by up to a rounding step of
    its pair's larger value: errors are bounded by the row's largest magnitude, not each value's."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(got.dtype).eps
    err = (got.float() - want.float()).abs()
    assert (err <= 2 * ulp * want.float().abs().amax(-1, keepdim=True)).all(), float(err.max())


# [T, H, D] query heads (unweighted norm), [T, D] KV rows (weighted); D a power of two or not;
# a strided view (a column slice of a packed projection output).
@pytest.mark.parametrize("tokens, heads, dim, half, weighted, dtype", [
    (1, 4, 64, 8, False, torch.bfloat16), (5, 3, 96, 16, False, torch.float16), (3, None, 64, 8, True, torch.bfloat16),
    (7, None, 100, 4, True, torch.bfloat16), (2, 2, 64, 32, False, torch.bfloat16)])
def test_matches_the_unfused_reference(tokens, heads, dim, half, weighted, dtype):
    gen = torch.Generator().manual_seed(tokens * 7 + dim)
    width = (heads or 1) * dim
    packed = (torch.randn(tokens, width + 24, generator=gen) * 3).to(DEVICE, dtype)  # other columns beside
    x = packed[:, 24:].view(tokens, heads, dim) if heads else packed[:, 24:]
    weight = (0.5 + torch.rand(dim, generator=gen)).to(DEVICE) if weighted else None
    cos, sin = tables(tokens, half, gen)
    got = norm_rope_triton(x, weight, 1e-6, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, unfused_kernels(x, weight, 1e-6, cos, sin))
    assert_within_a_rounding_step(got, plain_ref(x, weight, 1e-6, cos, sin))


def test_pool_write_matches_index_copy():
    gen = torch.Generator().manual_seed(1)
    tokens, dim, half = 4, 64, 8
    x = torch.randn(tokens, dim, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (0.5 + torch.rand(dim, generator=gen)).to(DEVICE)
    cos, sin = tables(tokens, half, gen)
    rows = torch.tensor([9, 2, 30, 17]).to(DEVICE)
    pool = torch.randn(40, dim, generator=gen).to(DEVICE, torch.bfloat16)
    want_pool = pool.clone()
    want = unfused_kernels(x, weight, 1e-6, cos, sin)
    want_pool.index_copy_(0, rows, want)
    got = norm_rope_triton(x, weight, 1e-6, cos, sin, pool, rows)
    assert torch.equal(got, want)
    assert torch.equal(pool, want_pool)  # the rows written, every other row untouched


def test_dispatch_keeps_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 64, generator=gen)
    cos, sin = tables(3, 8, gen)
    assert torch.equal(norm_rope(x, None, 1e-6, cos.cpu(), sin.cpu()), plain_ref(x, None, 1e-6, cos.cpu(), sin.cpu()))


@pytest.mark.gpu
def test_flash_shapes_gpu():
    """Against the unfused Triton kernels (rms_norm, apply_rope in place, index_copy)."""
    gen = torch.Generator().manual_seed(3)
    tokens = 64
    cos, sin = tables(tokens, 32, gen)
    q = torch.randn(tokens, 64 * 512 + 64, generator=gen).to("cuda", torch.bfloat16)[:, 64:].view(tokens, 64, 512)
    assert_within_a_rounding_step(norm_rope(q, None, 1e-6, cos, sin), norm_rope_ref(q, None, 1e-6, cos, sin))
    kv = torch.randn(tokens, 512, generator=gen).to("cuda", torch.bfloat16)
    weight = (0.5 + torch.rand(512, generator=gen)).cuda()
    rows = torch.randperm(1000, generator=gen)[:tokens].cuda()
    pool, want_pool = (torch.zeros(1000, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = norm_rope(kv, weight, 1e-6, cos, sin, pool, rows)
    want = norm_rope_ref(kv, weight, 1e-6, cos, sin, want_pool, rows)
    assert_within_a_rounding_step(got, want)
    assert torch.equal(pool[rows], got) and not pool[~torch.isin(torch.arange(1000, device="cuda"), rows)].any()
