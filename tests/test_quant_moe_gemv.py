"""The FP4 experts' weight-streaming form (kernels/quant/moe_gemv.py) against fused_moe_quant_ref: T of 1 and 3,
ragged loads, negative ids (one slot, and every slot of a token), with and without `shared`, e8m0 and fp32
weight scales, both activation scale formats, K not a multiple of the step nor of 128; its config checks, the
variant table, and on a GPU V4-Flash shapes and graph replay.

Tolerance: every product the kernels form is the reference's (a decoded weight value times a decoded activation
value, each fp32, multiplied once; with power-of-two scales the products are exact), so in float32 the outputs
differ only by the fp32 summation order of each dot, bounded by 2^-18 of the row's largest output
(quant_checks.assert_moe_close; it also allows the rare row where a one-ulp difference of gate, up or h before
the next rounding moved an activation code by one e4m3 step). bf16 runs compare in norm for the same reason."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from sparseserve.kernels.quant import reference as ref
from sparseserve.kernels.quant.formats import QuantFormatError, QuantWeight
from sparseserve.kernels.quant.moe_quant import HAS_TRITON, fused_moe_quant_triton
from sparseserve.kernels.quant.select import FP4_GEMV, GEMV_MAX_TOKENS, moe_quant_config, moe_quant_variants
from quant_checks import assert_moe_close, scaled_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_kernels = pytest.mark.skipif(not HAS_TRITON or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                   reason="runs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on the CPU)")
E, TOP_K, LIMIT = 8, 3, 1.5
HIDDEN, INTER = 288, 160  # K of the gate-up: one 256-column step and a 32-column one (a group cut short)
SMALL = replace(FP4_GEMV, gu_block_n=32, dn_block_n=64)  # fewer programs: the interpreter is slow


def _case(num_tokens: int, dtype: torch.dtype, e8m0: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = scaled_rows(gen, num_tokens, HIDDEN).to(dtype)
    sub = torch.exp2(torch.randint(-8, 7, (E, 2 * INTER, HIDDEN // 32), generator=gen).float())
    w_gu = ref.quantize_fp4(torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5 * 2
                            * sub.repeat_interleave(32, -1), e8m0=e8m0)
    w_dn = ref.quantize_fp4(torch.randn(E, HIDDEN, INTER, generator=gen) * INTER ** -0.5 * 64, e8m0=e8m0)
    others = torch.stack([torch.randperm(5, generator=gen)[: TOP_K - 1] + 1 for _ in range(num_tokens)])
    ids = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.long), others], dim=1)  # expert 0 takes every token
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    dev = [QuantWeight(w.data.to(DEVICE), w.scale.to(DEVICE), w.fmt) for w in (w_gu, w_dn)]
    return x.to(DEVICE), dev[0], dev[1], weights.to(DEVICE), ids.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("num_tokens,e8m0,scale_fmt,shared,skip", [
    (1, True, "ue8m0", None, False),
    (1, False, None, "tensor", False),
    (3, True, "ue8m0", "callable", True),
    (3, False, "ue8m0", None, True),
])
def test_gemv_matches_the_reference_in_float32(num_tokens, e8m0, scale_fmt, shared, skip):
    x, w_gu, w_dn, weights, ids = _case(num_tokens, torch.float32, e8m0, seed=num_tokens * 10 + e8m0)
    if skip:  # token 1 drops one slot; token 2 every slot (a padding token: its routed part is zero)
        ids[1, 1] = -1
        ids[2, :] = -1
    extra = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE) if shared else None
    arg = (lambda: extra) if shared == "callable" else extra
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, scale_fmt, config=SMALL, shared=arg)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT, scale_fmt)
    assert want.abs().amax(dim=1).min() > 0 or skip
    assert_moe_close(y, want if extra is None else want + extra)
    if skip:
        assert torch.equal(y[2].cpu(), torch.zeros(HIDDEN) if extra is None else extra[2].cpu())


@needs_kernels
def test_gemv_default_variant_in_bf16():
    """The variant as the benchmark times it (16-row tiles, 256-column steps: the gate-up's K walks two steps,
    the down's one cut short) on bf16 activations."""
    x, w_gu, w_dn, weights, ids = _case(3, torch.bfloat16, True, seed=4)
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=FP4_GEMV)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT).float()
    assert y.dtype == torch.bfloat16
    err = ((y.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err


def test_gemv_rejects_fp8_experts_and_bad_tiles():
    gen = torch.Generator().manual_seed(1)
    w_gu = ref.quantize_fp8_block(torch.randn(E, 256, 128, generator=gen))
    w_dn = ref.quantize_fp8_block(torch.randn(E, 128, 128, generator=gen))
    x, weights, ids = torch.randn(1, 128), torch.rand(1, TOP_K), torch.zeros(1, TOP_K, dtype=torch.long)
    with pytest.raises(QuantFormatError, match="FP4 experts only"):
        fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=FP4_GEMV)
    xq, q_gu, q_dn, weights, ids = _case(1, torch.float32, True, seed=2)
    with pytest.raises(QuantFormatError, match="gemv_block_k"):
        fused_moe_quant_triton(xq, q_gu, q_dn, weights, ids, LIMIT, config=replace(FP4_GEMV, gemv_block_k=192))
    with pytest.raises(QuantFormatError, match="gu_block_n"):
        fused_moe_quant_triton(xq, q_gu, q_dn, weights, ids, LIMIT, config=replace(FP4_GEMV, gu_block_n=24))


def test_gemv_is_a_decode_variant_the_table_never_picks():
    for tokens in (1, GEMV_MAX_TOKENS):
        variants = moe_quant_variants(tokens, 6, 256, "fp4")
        assert variants["fp4_gemv"].gemv and variants["fp4_gemv_8_warps"].gemv
        assert not variants["table"].gemv and not moe_quant_config(tokens, 6, 256, "fp4").gemv
    assert not any(c.gemv for c in moe_quant_variants(GEMV_MAX_TOKENS + 1, 6, 256, "fp4").values())
    assert not any(c.gemv for c in moe_quant_variants(1, 6, 256, "fp8_block").values())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_gpu_gemv_at_v4_flash_expert_shapes_and_graph_replay(num_tokens):
    if not CUDA:
        pytest.skip("needs CUDA")
    hidden, inter, experts, top_k = 4096, 2048, 32, 6
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w_gu = ref.quantize_fp4(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5)
    w_dn = ref.quantize_fp4(torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5)
    weights, ids = torch.rand(num_tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1)
    ids[0, -1] = -1
    shared = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, 10.0).float() + shared.float()
    for name, cfg in moe_quant_variants(num_tokens, top_k, experts, "fp4").items():
        if not cfg.gemv:
            continue
        y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=cfg, shared=shared)
        assert ((y.float() - want).norm() / want.norm()).item() < 2e-2, name
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=cfg, shared=shared)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y), name
