"""The fused mHC steps between blocks equal the unfused kernels they replace: expand, then the
collapse (split-K mixes, finalize), then the block's RMSNorm. On the CPU the Triton kernels run
under the interpreter; the `gpu` tests run at V4-Flash shapes (hc 4, D 4096)."""
import pytest
import torch

from sparseserve.kernels import mhc_fused
from sparseserve.kernels.mhc import hc_collapse_triton, hc_expand_triton, hc_head_collapse_triton
from sparseserve.kernels.mhc_fused import (
    hc_collapse_norm,
    hc_collapse_norm_ref,
    hc_collapse_norm_triton,
    hc_expand_collapse_norm,
    hc_expand_collapse_norm_ref,
    hc_expand_collapse_norm_triton,
    hc_head_collapse_norm_triton,
)
from sparseserve.kernels.rmsnorm import rms_norm_triton
from tests.test_mhc_kernel import DEVICE, HC_EPS, ITERS, NORM_EPS, assert_close_dtype, make_inputs

BLOCK_EPS = 1e-5


def norm_weight(dim, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 + torch.rand(dim, generator=gen)).to(device)  # fp32, as the loader keeps norms


def expand_inputs(tokens, hc, dim, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens, dim, generator=gen).to(device, dtype)
    post = (2 * torch.rand(tokens, hc, generator=gen)).to(device)
    comb = torch.softmax(torch.randn(tokens, hc, hc, generator=gen), dim=-1).to(device)
    return out, post, comb


def unfused(streams, out, post, comb, fn, base, scale, hc, weight):
    """The kernels the fused path replaces, in order."""
    new = hc_expand_triton(streams, out, post, comb) if out is not None else streams
    post2, comb2, collapsed = hc_collapse_triton(new, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS)
    return new, post2, comb2, rms_norm_triton(collapsed, weight, BLOCK_EPS)


def assert_coefficients_close(got, ref):
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# T from 1 (the FMA path) to 40 (the dot path on 3 token tiles); D a power of two or not, and a
# D chunk boundary inside a row (D 100 with BD 32/64); hc 1, 2, 4.
SHAPES = [(1, 4, 64, torch.bfloat16), (3, 2, 100, torch.float16), (5, 4, 128, torch.bfloat16),
          (17, 1, 64, torch.bfloat16), (40, 4, 100, torch.float16), (2, 4, 1024, torch.bfloat16)]


@pytest.mark.parametrize("tokens, hc, dim, dtype", SHAPES)
def test_expand_collapse_norm_matches_the_unfused_kernels(tokens, hc, dim, dtype):
    seed = tokens * 17 + hc * 5 + dim
    streams, fn, base, scale = make_inputs(tokens, hc, dim, dtype, seed=seed)
    out, post, comb = expand_inputs(tokens, hc, dim, dtype, seed=seed + 1)
    weight = norm_weight(dim, seed + 2)
    got = hc_expand_collapse_norm_triton(streams, out, post, comb, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS,
                                         weight, BLOCK_EPS)
    ref = unfused(streams, out, post, comb, fn, base, scale, hc, weight)
    assert torch.equal(got[0], ref[0])  # the same expand arithmetic, one rounding
    assert_coefficients_close(got[1:3], ref[1:3])
    assert_close_dtype(got[3], ref[3], dtype)


@pytest.mark.parametrize("config", [
    {"BT": 1, "BD": 16, "chunk": 32, "splits": 4, "fma": True},  # several D steps per chunk
    {"BT": 16, "BD": 32, "chunk": 64, "splits": 2, "fma": False, "prec": "bf16x3"},  # dot, masked rows
    {"BT": 16, "BD": 64, "chunk": 128, "splits": 1, "fma": False, "prec": "ieee"},  # one chunk
])
def test_expand_mix_configs(config):
    tokens, hc, dim = (3 if config["fma"] else 9), 4, 128
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=11)
    out, post, comb = expand_inputs(tokens, hc, dim, torch.bfloat16, seed=12)
    weight = norm_weight(dim, 13)
    got = hc_expand_collapse_norm_triton(streams, out, post, comb, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS,
                                         weight, BLOCK_EPS, config)
    ref = unfused(streams, out, post, comb, fn, base, scale, hc, weight)
    assert torch.equal(got[0], ref[0])
    assert_coefficients_close(got[1:3], ref[1:3])
    assert_close_dtype(got[3], ref[3], torch.bfloat16)


@pytest.mark.parametrize("tokens, hc, dim, dtype", SHAPES[:4])
def test_collapse_norm_matches_the_unfused_kernels(tokens, hc, dim, dtype):
    streams, fn, base, scale = make_inputs(tokens, hc, dim, dtype, seed=tokens + dim)
    weight = norm_weight(dim, 3)
    got = hc_collapse_norm_triton(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS, weight, BLOCK_EPS)
    _, post, comb, normed = unfused(streams, None, None, None, fn, base, scale, hc, weight)
    assert_coefficients_close(got[:2], (post, comb))
    # Same partials and coefficients: the collapse rounds the same, so the norm is exact too.
    assert torch.equal(got[2], normed)


@pytest.mark.parametrize("tokens, hc, dim", [(1, 4, 64), (7, 2, 100)])
def test_head_collapse_norm_matches_the_unfused_kernels(tokens, hc, dim):
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=tokens, mixes=hc)
    weight = norm_weight(dim, 4)
    got = hc_head_collapse_norm_triton(streams, fn, base, scale, HC_EPS, NORM_EPS, weight, BLOCK_EPS)
    ref = rms_norm_triton(hc_head_collapse_triton(streams, fn, base, scale, HC_EPS, NORM_EPS), weight, BLOCK_EPS)
    assert torch.equal(got, ref)


def test_dispatch_uses_the_unfused_path_on_cpu_fp32_and_large_steps():
    streams, fn, base, scale = make_inputs(3, 4, 64, torch.float32, seed=1, device="cpu")
    out, post, comb = expand_inputs(3, 4, 64, torch.float32, seed=2, device="cpu")
    weight = norm_weight(64, 3, device="cpu")
    args = (fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS, weight, BLOCK_EPS)
    for a, b in zip(hc_expand_collapse_norm(streams, out, post, comb, *args),
                    hc_expand_collapse_norm_ref(streams, out, post, comb, *args)):
        assert torch.equal(a, b)
    for a, b in zip(hc_collapse_norm(streams, *args), hc_collapse_norm_ref(streams, *args)):
        assert torch.equal(a, b)
    assert not mhc_fused.fused_here(streams.bfloat16())  # CPU tensors
    big = torch.empty(mhc_fused.FUSED_MAX_TOKENS + 1, 4, 64, dtype=torch.bfloat16, device="meta")
    assert not mhc_fused.fused_here(big)


def test_expand_mix_config_is_static_and_covers_d():
    for tokens in (1, 3, 17, 64, 256):
        for dim in (64, 100, 4096, 7168):
            cfg = mhc_fused.expand_mix_config(tokens, dim)
            assert cfg["fma"] or cfg["BT"] >= 16
            assert cfg["chunk"] % cfg["BD"] == 0
            assert cfg["splits"] * cfg["chunk"] >= dim > (cfg["splits"] - 1) * cfg["chunk"]
            assert cfg == mhc_fused.expand_mix_config(tokens, dim)


# ----------------------------------------------------------------------------- GPU, V4-Flash shapes

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_gpu_flash_shapes(tokens):
    """Compiled, the fused and the unfused kernels may contract multiply-adds differently (the
    interpreter's CPU tests above are exact): equal up to a rounding step of bf16."""
    hc, dim = 4, 4096
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=tokens)
    out, post, comb = expand_inputs(tokens, hc, dim, torch.bfloat16, seed=tokens + 1)
    weight = norm_weight(dim, 5)
    got = hc_expand_collapse_norm_triton(streams, out, post, comb, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS,
                                         weight, BLOCK_EPS)
    ref = unfused(streams, out, post, comb, fn, base, scale, hc, weight)
    assert_close_dtype(got[0], ref[0], torch.bfloat16)
    assert_coefficients_close(got[1:3], ref[1:3])
    assert_close_dtype(got[3], ref[3], torch.bfloat16)
    got = hc_collapse_norm_triton(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS, weight, BLOCK_EPS)
    ref = unfused(streams, None, None, None, fn, base, scale, hc, weight)
    assert_coefficients_close(got[:2], ref[1:3])
    assert_close_dtype(got[2], ref[3], torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    hc, dim, tokens = 4, 4096, mhc_fused.FUSED_MAX_TOKENS
    streams, fn, base, scale = make_inputs(tokens, hc, dim, torch.bfloat16, seed=1)
    out, post, comb = expand_inputs(tokens, hc, dim, torch.bfloat16, seed=2)
    weight = norm_weight(dim, 3)

    def step():
        post2, comb2, x = hc_collapse_norm(streams, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS, weight, BLOCK_EPS)
        return hc_expand_collapse_norm(streams, out + x, post2, comb2, fn, base, scale, hc, ITERS, HC_EPS, NORM_EPS,
                                       weight, BLOCK_EPS)[3]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (4, 5):
        streams.copy_(make_inputs(tokens, hc, dim, torch.bfloat16, seed=seed)[0])
        out.normal_()
        graph.replay()
        assert torch.equal(captured, step())
