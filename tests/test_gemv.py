"""The batch-1 projection kernel (kernels/gemv.py) against its fp32-accumulating reference: ragged
N and K, several tile configs, grouped projections; the dispatch; on a GPU, V4-Flash shapes
eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from oracle import Driver, make_pair, tiny_config

from sparseserve.kernels import gemv
from sparseserve.model.layers.fused_linear import pack_projections

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not gemv.HAS_TRITON,
                                       reason="runs the Triton kernel under TRITON_INTERPRET=1")


def _close_to_fp32(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> None:
    """Within one unit in the last place of the output dtype (2^-7 relative for bf16, 2^-10 for fp16:
    the interpreter's cast truncates, so half a unit is not enough there) of the fp32 result, plus
    the fp32 summation-order error (K * 2^-24 * sum |x w|, bounded loosely)."""
    n, k = weight.shape
    exact = torch.einsum("tgk,gnk->tgn", x.float().view(1, groups, k), weight.float().view(groups, n // groups, k))
    exact = exact.reshape(1, n)
    mag = torch.einsum("tgk,gnk->tgn", x.float().abs().view(1, groups, k),
                       weight.float().abs().view(groups, n // groups, k)).reshape(1, n)
    ulp = 2.0 ** -7 if y.dtype == torch.bfloat16 else 2.0 ** -10
    err = (y.float() - exact).abs()
    bound = ulp * exact.abs() + k * 2.0 ** -24 * mag + 1e-6
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,config", [(37, 300, (4, 128, 4)), (64, 1000, (16, 256, 4)), (130, 513, (8, 512, 4)),
                                        (16, 64, (16, 64, 1))])
def test_kernel_matches_fp32_on_ragged_shapes(dtype, n, k, config):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    y = gemv.gemv_triton(x, weight, config=config)
    assert y.shape == (1, n) and y.dtype == dtype
    _close_to_fp32(y, x, weight)
    torch.testing.assert_close(y.float(), gemv.gemv_ref(x, weight).float(), rtol=2 ** -7, atol=1e-2)


@needs_interpreter
@pytest.mark.parametrize("groups,config", [(4, (8, 128, 4)), (3, (4, 256, 4))])
def test_grouped_projection_reads_each_groups_slice(groups, config):
    """Output rows of group g read x[:, g*K:(g+1)*K] (the o_a projection); a kernel that read the
    first slice for every group would be off by whole dot products."""
    gen = torch.Generator().manual_seed(groups)
    k, n = 200, 24 * groups
    x = torch.randn(1, groups * k, generator=gen).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    y = gemv.gemv_triton(x, weight, groups, config=config)
    _close_to_fp32(y, x, weight, groups)
    ref = gemv.gemv_ref(x, weight, groups)
    for g in range(groups):  # the reference is the grouped GEMM the model runs
        rows = slice(g * n // groups, (g + 1) * n // groups)
        torch.testing.assert_close(ref[:, rows].float(), F.linear(x[:, g * k:(g + 1) * k].float(),
                                                                  weight[rows].float()), rtol=2 ** -7, atol=1e-2)


def test_bad_shapes_raise_clear_errors():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    with pytest.raises(ValueError, match="x \\[1, G\\*K\\]"):
        gemv.gemv_triton(x, w)
    with pytest.raises(ValueError, match="groups"):
        gemv.gemv_triton(x[:1], w, groups=3)
    with pytest.raises(ValueError, match="one dtype"):
        gemv.gemv_triton(x[:1].half(), w)


def test_config_divides_the_group_and_fills_the_chip():
    for n, k, groups in ((4160, 4096, 1), (40960, 1024, 1), (8192, 4096, 8), (4096, 8192, 1), (2560, 4096, 1)):
        block_n, block_k, _ = gemv.gemv_config(n, k, groups, 132)
        assert (n // groups) % block_n == 0 and block_n * block_k <= 8192
        assert n // block_n >= 4 * 132 or block_n == 4


def test_dispatch_on_the_cpu_is_cublas_free_reference():
    """On the CPU decode_linear is F.linear, whatever the rows."""
    x = torch.randn(1, 64).bfloat16()
    w = torch.randn(8, 64).bfloat16()
    assert torch.equal(gemv.decode_linear(x, w), F.linear(x, w))
    assert gemv.decode_grouped_linear(x, w.repeat(2, 1)[:, :32], 2) is None


@needs_interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel inside the CPU model under the interpreter")
def test_model_steps_through_the_kernel_match_cublas(monkeypatch):
    """The fp16 tiny model (every layer kind, packed projections, grouped o_a) with its one-row
    projections through the kernel, against the same model through F.linear / bmm: prefill chunks
    and two-sequence steps stay on cuBLAS, one-sequence decode steps take the kernel (counted, with
    the grouped call among them), and the logits agree. fp16, not bf16: its finer rounding lets
    the check see an error in the kernel through four layers."""
    _, model = make_pair(tiny_config(), seed=3, dtype=torch.float16)
    pack_projections(model)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (24, 21)]

    def run() -> list[torch.Tensor]:
        driver = Driver(model, dtype=torch.float16)
        logits = [driver.step([(0, 0, seqs[0][:20])])[0], driver.step([(1, 0, seqs[1][:18])])[0]]
        for p in range(20, 24):  # two sequences per step, then one
            step = [(0, p, [seqs[0][p]])] + ([(1, p - 2, [seqs[1][p - 2]])] if p - 2 < len(seqs[1]) else [])
            logits += driver.step(step)
        return logits

    want = run()
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "use_triton", lambda name, t: name == "gemv")
    monkeypatch.setattr(gemv, "gemv_triton", lambda x, w, groups=1: calls.append(groups) or real(x, w, groups))
    got = run()
    assert calls and 1 in calls and max(calls) > 1  # ungrouped and grouped (o_a) projections
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0.01, atol=0.01 * w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_flash_shapes_on_the_gpu_eager_and_in_a_graph():
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(4160, 4096, 1), (40960, 1024, 1), (8192, 4096, 8), (4096, 8192, 1), (4096, 2048, 1)]
    for n, k, groups in cases:
        x = torch.randn(1, groups * k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) / 32).bfloat16()
        y = gemv.gemv_triton(x, w, groups)
        _close_to_fp32(y, x, w, groups)
        out = torch.empty_like(y)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(gemv.gemv_triton(x, w, groups))
        x.copy_(torch.randn(1, groups * k, device="cuda", generator=gen).bfloat16())  # new input, same buffer
        graph.replay()
        torch.cuda.synchronize()
        _close_to_fp32(out, x, w, groups)
