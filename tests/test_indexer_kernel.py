"""Lightning Indexer scores: Triton kernel vs the plain-PyTorch reference.

CPU tests run the kernel under TRITON_INTERPRET=1 on small shapes (fp32: summation order
only, ~1e-7). GPU tests use real shapes (64 heads, dim 128, bf16 inputs) against the fp32
reference on the same upcast inputs: products of bf16 values are exact in fp32, so only the
accumulation order differs and 1e-4 is a generous bound. The -inf pattern must match exactly.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as in conftest.py: the interpreter only where there is no GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU runs)

from sparseserve.kernels.indexer import (
    IndexerConfig,
    indexer_config,
    indexer_scores,
    indexer_scores_ref,
    indexer_scores_triton,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# CPU tests feed CPU tensors to the kernels: they need the interpreter.
cpu_interp = pytest.mark.skipif(not _INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1")
RATE = 4


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert (out[~fin] == float("-inf")).all()
    if fin.any():
        err = (out[fin].double() - ref[fin].double()).norm() / ref[fin].double().norm().clamp_min(1e-30)
        assert err.item() < tol


def _make_case(T, Hi, Di, B, epb, max_blocks, num_entries, gen, device="cpu", dtype=torch.float32):
    """Ragged sequences in a shuffled paged pool; block tables with -1 tails and a hole;
    positions at rate-window boundaries (4k-1 closes a window, 4k opens one) and beyond
    the static width."""
    num_pool_blocks = B * max_blocks + 3
    q = torch.randn(T, Hi, Di, generator=gen).to(device, dtype)
    weights = torch.randn(T, Hi, generator=gen).to(device)
    pool = torch.randn(num_pool_blocks * epb, Di, generator=gen).to(device, dtype)
    block_table = torch.randperm(num_pool_blocks, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    lengths = torch.randint(1, max_blocks + 1, (B,), generator=gen)
    block_table[torch.arange(max_blocks).unsqueeze(0) >= lengths.unsqueeze(1)] = -1
    if max_blocks > 2:
        block_table[0, 1] = -1  # a hole inside a table
    token_seq = torch.randint(0, B, (T,), generator=gen)
    positions = torch.randint(0, RATE * num_entries + 3 * RATE, (T,), generator=gen)
    boundary = torch.tensor([0, RATE - 1, RATE, 2 * RATE - 1, RATE * epb - 1, RATE * epb, RATE * num_entries - 1])
    n = min(T, boundary.numel())
    positions[:n] = boundary[:n]
    return (q, weights, pool, block_table.to(device), token_seq.to(device), positions.to(device))


CPU_CASES = [
    # (T, Hi, Di, B, epb, max_blocks, E, config)
    (9, 4, 32, 3, 16, 5, 70, None),
    (8, 16, 64, 2, 8, 10, 80, None),
    (7, 16, 32, 4, 16, 3, 64, IndexerConfig(16, 2, 4, 2)),  # E past the table (48 entries)
    (8, 4, 64, 3, 32, 4, 130, IndexerConfig(32, 3, 4, 2)),  # ragged last chunk
    (6, 12, 32, 2, 4, 20, 33, IndexerConfig(16, 1, 4, 2)),
]


@cpu_interp
@pytest.mark.parametrize("T,Hi,Di,B,epb,max_blocks,E,cfg", CPU_CASES)
def test_indexer_matches_reference_cpu(T, Hi, Di, B, epb, max_blocks, E, cfg):
    gen = torch.Generator().manual_seed(17 + T * Hi + Di + E)
    args = _make_case(T, Hi, Di, B, epb, max_blocks, E, gen)
    scale = Di**-0.5
    out = indexer_scores_triton(*args, RATE, epb, scale, E, cfg)
    ref = indexer_scores_ref(*args, RATE, epb, scale, E)
    assert out.dtype == torch.float32 and out.shape == (T, E)
    _check(out, ref, 1e-5)


@cpu_interp
def test_indexer_scales_low_precision_head_weights_in_the_kernel_cpu():
    """bf16 head weights (a strided column slice, as the packed GEMM output gives them) and the
    head scaling passed to the kernel equal the reference on the same weights cast and scaled
    first, as the model did before with two extra kernels."""
    gen = torch.Generator().manual_seed(23)
    q, weights, pool, *rest = _make_case(9, 4, 32, 3, 16, 5, 70, gen)
    packed = torch.randn(9, 3 * 4, generator=gen).to(torch.bfloat16)
    head_weights = packed[:, 4:8]  # stride(0) = 12, stride(1) = 1
    scale, weights_scale = 32**-0.5, 4**-0.5
    out = indexer_scores_triton(q, head_weights, pool, *rest, RATE, 16, scale, 70, weights_scale=weights_scale)
    ref = indexer_scores_ref(q, head_weights.float() * weights_scale, pool, *rest, RATE, 16, scale, 70)
    _check(out, ref, 1e-5)
    assert torch.equal(indexer_scores_ref(q, head_weights, pool, *rest, RATE, 16, scale, 70,
                                          weights_scale=weights_scale), ref)


@cpu_interp
def test_indexer_zero_width_and_config_cpu():
    gen = torch.Generator().manual_seed(1)
    args = _make_case(3, 4, 32, 2, 8, 2, 16, gen)
    assert indexer_scores_triton(*args, RATE, 8, 1.0, 0).shape == (3, 0)
    cfg = indexer_config(256, 64, 128, 32768, 132)
    assert cfg == indexer_config(256, 64, 128, 32768, 132) and cfg.tiles >= 1


def test_indexer_dispatch_uses_reference_on_cpu():
    gen = torch.Generator().manual_seed(2)
    args = _make_case(4, 4, 16, 2, 8, 2, 16, gen)
    assert torch.equal(indexer_scores(*args, RATE, 8, 0.5, 16), indexer_scores_ref(*args, RATE, 8, 0.5, 16))


# ---------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
@pytest.mark.parametrize(
    "name,T,B,E",
    [
        ("decode-8x32k", 8, 8, 8192),
        ("decode-64x4k", 64, 64, 1024),
        ("prefill-2k-ragged", 2048, 3, 2048),
    ],
)
def test_indexer_real_shapes_gpu(name, T, B, E):
    gen = torch.Generator().manual_seed(T + E)
    epb = 64
    args = _make_case(T, 64, 128, B, epb, E // epb, E, gen, device="cuda", dtype=torch.bfloat16)
    scale = 128**-0.5
    out = indexer_scores(*args, RATE, epb, scale, E)
    q, w, pool, *rest = args
    ref = indexer_scores_ref(q.float(), w, pool.float(), *rest, RATE, epb, scale, E)
    torch.cuda.synchronize()
    _check(out, ref, 1e-4)
    for cfg in (IndexerConfig(64, 4, 4, 3), IndexerConfig(128, 1, 8, 2)):
        _check(indexer_scores_triton(*args, RATE, epb, scale, E, cfg), ref, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
def test_indexer_cuda_graph_replay_gpu():
    gen = torch.Generator().manual_seed(9)
    epb, E, T = 64, 4096, 16
    args = _make_case(T, 64, 128, T, epb, E // epb, E, gen, device="cuda", dtype=torch.bfloat16)
    q, w, pool, bt, seq, pos = args
    indexer_scores(*args, RATE, epb, 0.1, E)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = indexer_scores(*args, RATE, epb, 0.1, E)
    for step in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        pos.copy_(torch.randint(0, RATE * E, pos.shape, generator=gen).to(pos))
        g.replay()
        torch.cuda.synchronize()
        _check(out, indexer_scores_ref(q.float(), w, pool.float(), bt, seq, pos, RATE, epb, 0.1, E), 1e-4)
