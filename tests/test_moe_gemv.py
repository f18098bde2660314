"""The one-token routed experts (kernels/moe_gemv.py): the two kernels against their reference on
random ragged shapes (K not a multiple of the tile, several slots, a repeated expert, with and
without the shared row), the reference against the grouped path's reference, the dispatch; on a
GPU, V4-Flash shapes against the grouped Triton path, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch

from sparseserve.kernels import moe, moe_gemv

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not moe_gemv.HAS_TRITON,
                                       reason="runs the Triton kernels under TRITON_INTERPRET=1")


def _problem(hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int,
             ids: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    weights = torch.rand(1, top_k, generator=gen) + 0.1
    chosen = torch.tensor([ids]) if ids is not None else torch.randperm(experts, generator=gen)[:top_k].view(1, -1)
    shared = torch.randn(1, hidden, generator=gen).to(dtype)
    return x, w_gate_up, w_down, weights, chosen, shared


def _assert_close_bf16(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """Rounding points are the same; the fp32 sums differ in order only, so results agree to about
    one unit of the 16-bit output (2^-7 relative for bf16; the interpreter's cast truncates: two units)
    plus a tiny fp32 term; a wrong slot, expert or K tile is off by whole dot products."""
    ulp = 2.0 ** -7 if y.dtype == torch.bfloat16 else 2.0 ** -10
    err = (y.float() - ref.float()).abs()
    bound = 2 * ulp * (ref.float().abs() + scale) + 1e-5
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,inter,experts,top_k,block_n,block_k,ids", [
    (96, 40, 8, 3, 4, 64, None),        # K of both stages not a multiple of the tile (96 / 64, 40 / 64)
    (200, 24, 6, 2, 8, 128, None),      # several K tiles in gate_up, one in down
    (64, 48, 5, 4, 4, 16, [3, 1, 3, 0]),  # a repeated expert (hash routing may repeat one), 3 K tiles a slot
])
@pytest.mark.parametrize("with_shared", [True, False])
def test_kernels_match_reference_on_ragged_shapes(dtype, hidden, inter, experts, top_k, block_n, block_k, ids,
                                                  with_shared):
    x, w_gu, w_dn, weights, chosen, shared = _problem(hidden, inter, experts, top_k, dtype, hidden * inter, ids)
    shared = shared if with_shared else None
    y = moe_gemv.moe_gemv_triton(x, w_gu, w_dn, weights, chosen, 7.0, shared, block_n=block_n, block_k=block_k)
    ref = moe_gemv.moe_gemv_ref(x, w_gu, w_dn, weights, chosen, 7.0, shared)
    assert y.shape == (1, hidden) and y.dtype == dtype
    # scale: a bound on the slot sums' magnitude (the sum of |y_j| rounded terms)
    scale = weights.sum() * ref.float().abs().max()
    _assert_close_bf16(y, ref, scale)


def test_reference_matches_the_grouped_reference():
    """moe_gemv_ref rounds act once from fp32 (as the Triton kernels do); fused_moe_ref rounds the
    gate/up GEMM's output first: equal up to those bf16 roundings, far from a wrong expert."""
    x, w_gu, w_dn, weights, chosen, shared = _problem(128, 64, 8, 3, torch.bfloat16, 1)
    ours = moe_gemv.moe_gemv_ref(x, w_gu, w_dn, weights, chosen, 7.0, shared)
    grouped = moe.fused_moe_ref(x, w_gu, w_dn, weights, chosen, 7.0) + shared
    torch.testing.assert_close(ours.float(), grouped.float(), rtol=0.03, atol=0.03)
    wrong = moe.fused_moe_ref(x, w_gu, w_dn, weights, (chosen + 1) % 8, 7.0) + shared
    assert (ours.float() - wrong.float()).abs().max() > 0.1


def test_dispatch_is_a_static_fact_of_the_shape():
    x, w_gu, w_dn, *_ = _problem(64, 32, 4, 2, torch.bfloat16, 2)
    assert not moe_gemv.moe_gemv_here(x, w_gu, w_dn)  # CPU tensors: the reference paths
    if torch.cuda.is_available():
        xc, gu, dn = x.cuda(), w_gu.cuda(), w_dn.cuda()
        assert moe_gemv.moe_gemv_here(xc, gu, dn) is (moe_gemv.HAS_TRITON and "moe_gemv" not in
                                                     os.environ.get("SPARSESERVE_DISABLE_KERNELS", ""))
        assert not moe_gemv.moe_gemv_here(torch.cat([xc, xc]), gu, dn)  # two tokens: grouped path
        assert not moe_gemv.moe_gemv_here(xc, gu.transpose(1, 2).contiguous().transpose(1, 2), dn)


def test_bad_shapes_raise_clear_errors():
    x, w_gu, w_dn, weights, chosen, shared = _problem(64, 30, 4, 2, torch.bfloat16, 3)
    with pytest.raises(ValueError, match="divisible by BLOCK_N"):
        moe_gemv.moe_gemv_triton(x, w_gu, w_dn, weights, chosen, 7.0, block_n=4)
    with pytest.raises(ValueError, match=r"x \[1, D\]"):
        moe_gemv.moe_gemv_triton(torch.cat([x, x]), w_gu, w_dn, weights, chosen, 7.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experts", [16, 256])
def test_v4_flash_shapes_match_the_grouped_path_eager_and_in_a_graph(experts):
    """D 4096, I 2048, top-6: the dispatch (one token: these kernels) against the grouped Triton
    kernels (an explicit config keeps fused_moe_triton on them) and the reference; a CUDA graph
    replays the same bits as the eager call, for new routing written into the captured inputs."""
    if not moe_gemv.moe_gemv_here(torch.empty(1, 16, device="cuda", dtype=torch.bfloat16),
                                  torch.empty(1, 8, 16, device="cuda", dtype=torch.bfloat16),
                                  torch.empty(1, 16, 4, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("moe_gemv disabled")
    x, w_gu, w_dn, weights, chosen, shared = (t.cuda() for t in _problem(4096, 2048, experts, 6, torch.bfloat16, 4))
    cfg = moe.moe_config(1, 6, experts, 4096, 2048)
    ours = moe.fused_moe_triton(x, w_gu, w_dn, weights, chosen, 7.0, shared=shared)
    grouped = moe.fused_moe_triton(x, w_gu, w_dn, weights, chosen, 7.0, config=cfg, shared=shared)
    ref = moe_gemv.moe_gemv_ref(x, w_gu, w_dn, weights, chosen, 7.0, shared)
    scale = weights.sum().cuda() * ref.float().abs().max()
    _assert_close_bf16(ours, ref, scale)
    _assert_close_bf16(grouped, ref, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.fused_moe_triton(x, w_gu, w_dn, weights, chosen, 7.0, shared=shared)
    new_ids = torch.randperm(experts, device="cuda")[:6].view(1, -1)
    chosen.copy_(new_ids)
    weights.copy_(torch.rand(1, 6, device="cuda") + 0.1)
    graph.replay()
    eager = moe.fused_moe_triton(x, w_gu, w_dn, weights, chosen, 7.0, shared=shared)
    assert torch.equal(replayed, eager)
    _assert_close_bf16(eager, moe_gemv.moe_gemv_ref(x, w_gu, w_dn, weights, chosen, 7.0, shared), scale)
