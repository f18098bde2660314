"""The small-step router (kernels/router.py) against F.linear + the selection reference.

CPU tests run the kernels under TRITON_INTERPRET=1 (set before triton is imported); `gpu` tests
run them compiled at V4-Flash widths, and under CUDA-graph replay.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparseserve.kernels.moe import select_experts_ref, select_experts_triton  # noqa: E402
from sparseserve.kernels.router import router_plan, router_select, router_select_triton  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not _INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1")


def _exact_inputs(tokens: int, experts: int, dim: int, gen: torch.Generator, dtype=torch.bfloat16):
    """Values k/8 with |k| <= 8 (x) and k/16 (w): every product and partial sum is exact in fp32
    whatever the order, so the logits equal F.linear's bit for bit before the rounding."""
    x = (torch.randint(-8, 9, (tokens, dim), generator=gen) / 8).to(dtype)
    w = (torch.randint(-4, 5, (experts, dim), generator=gen) / 16).to(dtype)
    return x, w


def _reference(x, w, top_k, scoring, scale, bias=None, hash_ids=None):
    logits = (x.float() @ w.float().t()).to(x.dtype)  # the GEMM's fp32 sum, rounded once
    return select_experts_ref(logits, top_k, scoring, scale, bias, hash_ids)


@cpu_interp
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("tokens,experts,dim", [(1, 16, 512), (5, 16, 1000), (16, 256, 256), (3, 384, 128)])
def test_router_equals_linear_then_select_cpu(tokens, experts, dim, scoring):
    """Exact logits (see _exact_inputs): the same weights and ids, in the same order, as the
    selection kernel on F.linear's rounded logits; and the same sets as the reference where the
    logits have no ties (with a random bias)."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts + dim)
    x, w = _exact_inputs(tokens, experts, dim, gen)
    bias = torch.randn(experts, generator=gen) * 0.1
    hash_ids = torch.randint(0, experts, (tokens, 6), generator=gen)
    logits = (x.float() @ w.float().t()).to(x.dtype)  # the GEMM's fp32 sum, rounded once
    for top_k, b, h in ((6, bias, None), (6, None, None), (6, None, hash_ids), (1, bias, None)):
        weights, ids = router_select_triton(x, w, top_k, scoring, 2.5, b, h)
        w_sel, ids_sel = select_experts_triton(logits, top_k, scoring, 2.5, b, h)
        assert torch.equal(ids, ids_sel) and torch.equal(weights, w_sel), (top_k, b is None, h is None)
    weights, ids = router_select_triton(x, w, 6, scoring, 2.5, bias)
    w_ref, ids_ref = _reference(x, w, 6, scoring, 2.5, bias)
    assert torch.equal(ids.sort(dim=1).values, ids_ref.sort(dim=1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(1)), w_ref.gather(1, ids_ref.argsort(1)),
                               rtol=1e-6, atol=1e-7)


@cpu_interp
def test_router_random_inputs_close_to_linear_cpu():
    """Random bf16 inputs: the fp32 sums differ from F.linear's only in order, so the logits agree
    to a rounding step and the weights to ~1e-2; the chosen sets agree away from near-ties."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 768, generator=gen).bfloat16()
    w = (torch.randn(16, 768, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(16, generator=gen) * 0.1
    weights, ids = router_select_triton(x, w, 4, "sigmoid", 1.5, bias)
    w_ref, ids_ref = _reference(x, w, 4, "sigmoid", 1.5, bias)
    same = (ids.sort(dim=1).values == ids_ref.sort(dim=1).values).all(dim=1)
    assert same.float().mean() >= 0.75
    torch.testing.assert_close(weights.sum(1), w_ref.sum(1), rtol=1e-5, atol=1e-5)


@cpu_interp
def test_router_reads_the_hash_table_at_the_token_ids_cpu():
    """Hash layers: the whole tid2eid table and the token ids give what the gathered rows give."""
    gen = torch.Generator().manual_seed(12)
    x, w = _exact_inputs(5, 16, 256, gen)
    table = torch.randint(0, 16, (50, 6), generator=gen)
    token_ids = torch.tensor([3, 49, 0, 3, 17])
    got = router_select_triton(x, w, 6, "sqrtsoftplus", 1.5, None, table, token_ids)
    want = router_select_triton(x, w, 6, "sqrtsoftplus", 1.5, None, table[token_ids])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[1], table[token_ids])
    ref = router_select(x.float(), w.float(), 6, "sqrtsoftplus", 1.5, None, table, token_ids)  # CPU: reference
    assert torch.equal(ref[1], table[token_ids])


def test_router_plan_reads_about_16_kb_per_program():
    for experts, dim in ((16, 4096), (256, 4096), (384, 7168), (8, 64)):
        block_e, block_k, parts = router_plan(experts, dim)
        assert block_e in (16, 32, 64) and block_k & (block_k - 1) == 0 and parts * block_k >= dim
        assert block_e * block_k * 2 <= 16384 or block_k == 64


def test_dispatch_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(8, 64, generator=gen)
    got = router_select(x, w, 2, "softmax", 1.0)
    ref = select_experts_ref(torch.nn.functional.linear(x, w), 2, "softmax", 1.0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experts", [16, 256])
def test_router_flash_widths_gpu(experts):
    gen = torch.Generator().manual_seed(experts)
    for tokens in (1, 8, 16):
        x, w = _exact_inputs(tokens, experts, 4096, gen)
        x, w = x.cuda(), w.cuda()
        bias = (torch.randn(experts, generator=gen) * 0.1).cuda()
        logits = torch.nn.functional.linear(x, w)  # cuBLAS: exact here, whatever its order
        for scoring in ("sqrtsoftplus", "sigmoid"):
            weights, ids = router_select(x, w, 6, scoring, 2.5, bias)
            w_sel, ids_sel = select_experts_triton(logits, 6, scoring, 2.5, bias)
            assert torch.equal(ids, ids_sel) and torch.equal(weights, w_sel)


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
def test_router_graph_replay_equals_eager_gpu():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 4096, generator=gen).bfloat16().cuda()
    w = (torch.randn(16, 4096, generator=gen) * 0.02).bfloat16().cuda()
    bias = (torch.randn(16, generator=gen) * 0.1).cuda()
    router_select(x, w, 6, "sigmoid", 2.5, bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_select(x, w, 6, "sigmoid", 2.5, bias)
    for seed in range(3):
        x.copy_(torch.randn(4, 4096, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        eager = router_select(x, w, 6, "sigmoid", 2.5, bias)
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
