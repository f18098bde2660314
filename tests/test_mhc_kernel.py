"""The mHC kernels equal their references: the Sinkhorn coefficients, the fused collapse
(split-K sum of squares + fp32 mixes, then coefficients + pre-weighted collapse), the head
collapse and the fused expand. On the CPU the Triton kernels run under the interpreter
(conftest sets TRITON_INTERPRET); the `gpu` tests run at V4-Flash shapes (hc 4, D 4096)."""
import pytest
import torch

from sparseserve.kernels import mhc
from sparseserve.kernels.mhc import (
    hc_coefficients_ref,
    hc_coefficients_triton,
    hc_collapse,
    hc_collapse_ref,
    hc_collapse_triton,
    hc_expand,
    hc_expand_ref,
    hc_expand_triton,
    hc_head_collapse,
    hc_head_collapse_ref,
    hc_head_collapse_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


@pytest.mark.parametrize("hc, iters, tokens", [(4, 20, 33), (2, 5, 7), (1, 3, 4), (3, 20, 9)])
def test_kernel_matches_reference(hc, iters, tokens):
    gen = torch.Generator().manual_seed(hc * 100 + iters)
    mixes = (2 * torch.randn(tokens, (2 + hc) * hc, generator=gen)).to(DEVICE)
    base = torch.randn((2 + hc) * hc, generator=gen).to(DEVICE)
    scale = (0.5 + torch.rand(3, generator=gen)).to(DEVICE)
    ref = hc_coefficients_ref(mixes, base, scale, hc, iters, 1e-6)
    got = hc_coefficients_triton(mixes, base, scale, hc, iters, 1e-6)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def make_inputs(tokens, hc, dim, dtype, seed, mixes=None, device=DEVICE):
    """Random streams with per-token magnitudes, fn ~ N(0, 1/K) (mix logits of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    m = (2 + hc) * hc if mixes is None else mixes
    k = hc * dim
    streams = torch.randn(tokens, hc, dim, generator=gen) * (0.5 + 2 * torch.rand(tokens, 1, 1, generator=gen))
    fn = torch.randn(m, k, generator=gen) * k ** -0.5
    base = 0.5 * torch.randn(m, generator=gen)
    scale = 0.5 + torch.rand(3 if mixes is None else 1, generator=gen)
    return (streams.to(device, dtype), fn.to(device), base.to(device), scale.to(device))


def assert_close_dtype(got, ref, dtype):
    """Equal up to a rounding step or two of `dtype` (the fused kernels round once, in fp32)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    ulp = torch.finfo(dtype).eps
    err = (got.float() - ref.float()).abs()
    assert (err <= 2 * ulp * ref.float().abs() + 1e-3 * ref.float().abs().max()).all(), float(err.max())


# T, hc, D, Sinkhorn iterations: T from 1 to 130, hc 1/2/4, D from 64 to 4096 (one small-T case at
# the real width); 1 Sinkhorn iteration is the edge case of no loop.
SHAPES = [(1, 4, 64, 20, torch.bfloat16), (3, 2, 128, 20, torch.float16), (17, 1, 64, 1, torch.bfloat16),
          (17, 4, 128, 20, torch.float16), (130, 4, 64, 20, torch.bfloat16), (130, 2, 100, 20, torch.float16),
          (3, 4, 4096, 20, torch.bfloat16)]


@pytest.mark.parametrize("tokens, hc, dim, iters, dtype", SHAPES)
def test_collapse_matches_reference(tokens, hc, dim, iters, dtype):
    streams, fn, base, scale = make_inputs(tokens, hc, dim, dtype, seed=tokens * 31 + hc * 7 + dim)
    post, comb, collapsed = hc_collapse_triton(streams, fn, base, scale, hc, iters, HC_EPS, NORM_EPS)
    post_r, comb_r, collapsed_r = hc_collapse_ref(streams, fn, base, scale, hc, iters, HC_EPS, NORM_EPS)
    assert post.dtype == comb.dtype == torch.float32
    assert torch.allclose(post, post_r, rtol=1e-4, atol=1e-5)
    assert torch.allclose(comb, comb_r, rtol=1e-4, atol=1e-5)
    assert_close_dtype(collapsed, collapsed_r, dtype)


@pytest.mark.parametrize("config", [
    {"BT": 16, "BK": 32, "chunk": 32, "splits": 16},  # 16 K chunks, 3 token tiles (bf16x3 dot)
    {"BT": 32, "BK": 128, "chunk": 512, "splits": 1},  # one chunk, masked K tail
    {"BT": 8, "BK": 16, "chunk": 64, "splits": 8, "fma": True},  # the few-token FMA path on 5 tiles
    {"BT": 16, "BK": 64, "chunk": 128, "splits": 4, "prec": "ieee"},  # fp32 operand dots
    {"BT": 16, "BK": 64, "chunk": 128, "splits": 4, "prec": "tf32x3"},
])
def test_collapse_split_k_configs(config):
    tokens, hc, dim, iters = 40, 4, 128, ITERS
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=5)
    post, comb, collapsed = hc_collapse_triton(streams, fn, base, scale, hc, iters, HC_EPS, NORM_EPS, config)
    post_r, comb_r, collapsed_r = hc_collapse_ref(streams, fn, base, scale, hc, iters, HC_EPS, NORM_EPS)
    assert torch.allclose(post, post_r, rtol=1e-4, atol=1e-5)
    assert torch.allclose(comb, comb_r, rtol=1e-4, atol=1e-5)
    assert_close_dtype(collapsed, collapsed_r, torch.bfloat16)


@pytest.mark.parametrize("tokens, hc, dim", [(1, 4, 64), (17, 2, 128), (130, 4, 64), (3, 1, 64)])
def test_head_collapse_matches_reference(tokens, hc, dim):
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=tokens + dim, mixes=hc)
    got = hc_head_collapse_triton(streams, fn, base, scale, HC_EPS, NORM_EPS)
    assert_close_dtype(got, hc_head_collapse_ref(streams, fn, base, scale, HC_EPS, NORM_EPS), torch.bfloat16)


def make_expand_inputs(tokens, hc, dim, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, hc, dim, generator=gen)
    out = torch.randn(tokens, dim, generator=gen)
    post = 2 * torch.rand(tokens, hc, generator=gen)
    comb = torch.softmax(torch.randn(tokens, hc, hc, generator=gen), dim=-1)
    return streams.to(device, dtype), out.to(device, dtype), post.to(device), comb.to(device)


@pytest.mark.parametrize("tokens, hc, dim, dtype", [(1, 4, 64, torch.bfloat16), (3, 2, 128, torch.float16),
                                                    (17, 1, 64, torch.bfloat16), (130, 4, 64, torch.bfloat16),
                                                    (3, 4, 4096, torch.float16), (17, 4, 100, torch.bfloat16)])
def test_expand_matches_reference(tokens, hc, dim, dtype):
    streams, out, post, comb = make_expand_inputs(tokens, hc, dim, dtype, seed=tokens * 13 + hc + dim)
    got = hc_expand_triton(streams, out, post, comb)
    # fp32 math on the same inputs, one rounding: the kernel's contract.
    exact = hc_expand_ref(streams.float(), out.float(), post, comb).to(dtype)
    assert_close_dtype(got, exact, dtype)
    # The oracle's order (comb, post and partial results rounded to the dtype) is a few ulps away.
    loose = hc_expand_ref(streams, out, post, comb)
    assert torch.allclose(got.float(), loose.float(), rtol=3e-2, atol=3e-2)


def test_dispatch_keeps_the_reference_for_fp32_and_cpu():
    streams, fn, base, scale = make_inputs(5, 4, 64, torch.float32, seed=3, device="cpu")
    for a, b in zip(hc_collapse(streams, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS),
                    hc_collapse_ref(streams, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS)):
        assert torch.equal(a, b)
    s, out, post, comb = make_expand_inputs(5, 4, 64, torch.bfloat16, seed=4, device="cpu")
    assert torch.equal(hc_expand(s, out, post, comb), hc_expand_ref(s, out, post, comb))
    assert not mhc._fused(s)  # CPU tensors: the reference, whatever the dtype
    streams, fn, base, scale = make_inputs(5, 4, 64, torch.float32, seed=3, mixes=4, device="cpu")
    assert torch.equal(hc_head_collapse(streams, fn, base, scale, HC_EPS, NORM_EPS),
                       hc_head_collapse_ref(streams, fn, base, scale, HC_EPS, NORM_EPS))


def test_mix_config_is_static_and_covers_k():
    for tokens in (1, 3, 17, 64, 130, 2048, 8192):
        for k in (64, 256, 16384):
            cfg = mhc.mix_config(tokens, k)
            assert cfg["fma"] or cfg["BT"] >= 16  # a dot needs 16 rows
            assert cfg["chunk"] % cfg["BK"] == 0
            assert cfg["splits"] * cfg["chunk"] >= k > (cfg["splits"] - 1) * cfg["chunk"]
            assert cfg == mhc.mix_config(tokens, k)


# ----------------------------------------------------------------------------- GPU, V4-Flash shapes

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1000, 8192])
def test_gpu_flash_shapes(tokens):
    hc, dim = 4, 4096
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=tokens)
    post, comb, collapsed = hc_collapse(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS)
    post_r, comb_r, collapsed_r = hc_collapse_ref(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS)
    assert torch.allclose(post, post_r, rtol=1e-4, atol=1e-5)
    assert torch.allclose(comb, comb_r, rtol=1e-4, atol=1e-5)
    assert_close_dtype(collapsed, collapsed_r, torch.bfloat16)
    head_fn, head_base, head_scale = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
    assert_close_dtype(hc_head_collapse(streams, head_fn, head_base, head_scale, HC_EPS, NORM_EPS),
                       hc_head_collapse_ref(streams, head_fn, head_base, head_scale, HC_EPS, NORM_EPS),
                       torch.bfloat16)
    out = torch.randn(tokens, dim, device="cuda").to(torch.bfloat16)
    new = hc_expand(streams, out, post_r, comb_r)
    exact = hc_expand_ref(streams.float(), out.float(), post_r, comb_r).to(torch.bfloat16)
    assert_close_dtype(new, exact, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_graph_replay_equals_eager(tokens):
    """Captured once, replayed on fresh inputs: bitwise equal to the eager calls."""
    hc, dim = 4, 4096
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=1)
    out = torch.randn(tokens, dim, device="cuda").to(torch.bfloat16)

    def step():
        post, comb, collapsed = hc_collapse(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS)
        return hc_expand(streams, out + collapsed, post, comb)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (2, 3):
        streams.copy_(make_inputs(tokens, hc, dim, torch.bfloat16, seed=seed)[0])
        out.normal_()
        graph.replay()
        assert torch.equal(captured, step())
