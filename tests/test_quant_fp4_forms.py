"""The three FP4 partial-product forms of the routed-expert kernels against the reference
(kernels/quant/reference.py): the fp8-mma form (kernels/quant/fp4_fp8.py, the table's), tl.dot_scaled and the
scalar nibble decode (kernels/quant/triton_common.py). One K group read back through an identity activation
with e8m0 exponents from 2^-100 to 2^100 (ragged rows, a partial group and the whole-group word loads of the
scales); the full experts at T = 1, 3, 64 with ragged expert loads, sizes not multiples of 128 and scales
spread over many binades, through both decode activation paths and the prefill one; the fp8-mma form against
the decode form on e8m0 and fp32 scales; the launches (grid and constexprs) independent of the routing; the
config table's choices and its benchmarked alternatives; on a GPU every alternative at V4-Flash expert shapes
(FP4 and FP8 experts) with CUDA-graph replay, and the linear's.

CPU runs use the Triton interpreter (conftest.py sets TRITON_INTERPRET=1); its dots run in fp32 (select.py), and
an interpreter without tl.dot_scaled (triton 3.6's) skips the dot_scaled cases."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from sparseserve.kernels.quant import moe_quant
from sparseserve.kernels.quant import reference as ref
from sparseserve.kernels.quant.formats import QuantFormatError, QuantWeight
from sparseserve.kernels.quant.moe_quant import HAS_TRITON, fused_moe_quant_triton, interpreter_has_dot_scaled
from sparseserve.kernels.quant.select import (DOT_BF16, DOT_FP8, DOT_FP16, DOT_FP32, MoeQuantConfig, linear_config,
                                              linear_variants, moe_quant_config, moe_quant_variants)
from quant_checks import assert_moe_close, expert_routing, launches_match_across_routings, scaled_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EXACT_DOT = DOT_BF16 if CUDA else DOT_FP32
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not HAS_TRITON or not (CUDA or INTERPRET),
                                   reason="runs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on the CPU)")
FORMS = {"scaled_dot": True, "decode": False}
EXPERT_FORMS = {  # the experts' three FP4 forms: MoeQuantConfig fields
    "scaled_dot": {"fp4_scaled_dot": True, "fp4_fp8_mma": False},
    "decode": {"fp4_scaled_dot": False, "fp4_fp8_mma": False},
    "fp8_mma": {"fp4_scaled_dot": False, "fp4_fp8_mma": True},
}


def skip_unless_form_runs(scaled: bool) -> None:
    if scaled and not CUDA and not interpreter_has_dot_scaled():
        pytest.skip("this Triton's interpreter has no tl.dot_scaled")


def random_fp4(gen: torch.Generator, shape: tuple[int, ...], lo: int, hi: int) -> QuantWeight:
    """Random e2m1 bytes [..., N, K/2] (every code, never an all-zero tensor) and e8m0 exponent bytes in
    [lo, hi] [..., N, K/32]."""
    *lead, n, k = shape
    data = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen)
    exps = torch.randint(lo, hi + 1, (*lead, n, k // 32), dtype=torch.uint8, generator=gen)
    return QuantWeight(data.to(DEVICE), exps.view(torch.float8_e8m0fnu).to(DEVICE), "fp4")


# ------------------------------------------------------------------ one K group through an identity

if HAS_TRITON:
    import triton
    import triton.language as tl

    from sparseserve.kernels.quant.triton_common import as_dot_operand, weight_group_partial

    @triton.jit
    def _group_probe_kernel(w_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_wsn, SCALED_DOT: tl.constexpr,
                            EVEN_K: tl.constexpr, DOT: tl.constexpr):
        """The identity [128, 128] times K group 0 of 16 weight rows (N of them real): out [128, 16] = W^T."""
        r = tl.arange(0, 128)
        eye = as_dot_operand(tl.where(r[:, None] == r[None, :], 1.0, 0.0), DOT)
        offs_n = tl.arange(0, 16)
        part = weight_group_partial(eye, 0, w_ptr, ws_ptr, 0, offs_n, offs_n < N, K, stride_wn, stride_wsn,
                                    True, True, DOT, SCALED_DOT, EVEN_K)
        tl.store(out_ptr + r[:, None] * 16 + offs_n[None, :], part)


@needs_kernels
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("k", [128, 96, 32])
def test_one_group_gives_the_weight_values_over_a_wide_scale_range(form, k):
    """Exponent bytes 27..227 (2^-100 .. 2^100), every e2m1 code, 13 of 16 rows real, K of one whole or one
    partial group (the whole one through the scale-word loads): the partial is W's values exactly, zero past
    K and in the masked rows."""
    scaled = FORMS[form]
    skip_unless_form_runs(scaled)
    gen = torch.Generator().manual_seed(k + scaled)
    w = random_fp4(gen, (13, k), 27, 227)
    out = torch.full((128, 16), float("nan"), device=DEVICE)
    _group_probe_kernel[(1,)](w.codes, w.scale_bits, out, 13, k, w.data.stride(0), w.scale.stride(0),
                              SCALED_DOT=scaled, EVEN_K=k % 128 == 0, DOT=EXACT_DOT)
    want = torch.zeros(128, 16)
    want[:k, :13] = ref.dequant_weight(QuantWeight(w.data.cpu(), w.scale.cpu(), "fp4")).t()
    assert torch.equal(out.cpu(), want)


# ------------------------------------------------------------------ the experts, both forms

E, TOP_K, LIMIT = 8, 3, 1.5
SHAPES = {"ragged": (96, 160), "even": (256, 128)}  # (D, I): not multiples of 128 / multiples (scale words)
PATHS = {  # the activation paths at tiny tiles: the decode rows' (act_quant launches) and their in-kernel
    # alternative, the prefill rows'
    "decode": MoeQuantConfig(16, 64, 4, 2, 64, 4, 2, False, True, EXACT_DOT, down_act_quant=True),
    "decode_in_kernel_quant": MoeQuantConfig(16, 64, 4, 2, 64, 4, 2, False, False, EXACT_DOT),
    "prefill": MoeQuantConfig(32, 128, 4, 2, 64, 4, 2, True, True, EXACT_DOT),
}


def _experts_case(num_tokens: int, shape: str, skewed: bool = True):
    """Random FP4 experts with exponents spread over 25 (gate-up) and 61 (down) binades, x rows over 15;
    skewed: expert 0 takes every token and experts 6, 7 none; else a uniform random routing."""
    hidden, inter = SHAPES[shape]
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden)
    x = scaled_rows(gen, num_tokens, hidden)
    w_gu = random_fp4(gen, (E, 2 * inter, hidden), 127 - 22, 127 + 2)
    w_dn = random_fp4(gen, (E, hidden, inter), 127 - 30, 127 + 30)
    weights, ids = expert_routing(gen, num_tokens, E, TOP_K, skewed)
    return x.to(DEVICE), w_gu, w_dn, weights.to(DEVICE), ids.to(DEVICE)


# Every form through every path at 1 and 3 tokens; 64 tokens (a full prefill tile, the interpreter's slowest
# case) through the prefill path only, on the ragged shape.
_FORM_CASES = [(form, path, shape, t) for form in sorted(EXPERT_FORMS) for path in sorted(PATHS)
               for shape in sorted(SHAPES) for t in (1, 3)]
_FORM_CASES += [(form, "prefill", "ragged", 64) for form in sorted(EXPERT_FORMS)]


@needs_kernels
@pytest.mark.parametrize("form,path,shape,num_tokens", _FORM_CASES)
def test_every_fp4_form_matches_the_reference(form, path, shape, num_tokens):
    skip_unless_form_runs(EXPERT_FORMS[form]["fp4_scaled_dot"])
    x, w_gu, w_dn, weights, ids = _experts_case(num_tokens, shape)
    cfg = replace(PATHS[path], **EXPERT_FORMS[form])
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=cfg)
    assert_moe_close(y, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))


@needs_kernels
@pytest.mark.parametrize("scales,shape", [("e8m0", "even"), ("e8m0", "ragged"), ("fp32", "ragged")])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_fp8_mma_form_gives_the_decode_forms_values(scales, path, shape):
    """The e2m1 -> e4m3 code move is exact and each K = 32 partial is scaled in fp32, so the fp8-mma form
    equals the scalar decode form (both dots exact; only the fp32 sums' order differs): e8m0 scales through
    the scale-word loads and the masked loads, and fp32 scales (never dot_scaled)."""
    x, w_gu, w_dn, weights, ids = _experts_case(3, shape)
    if scales == "fp32":
        w_gu, w_dn = (QuantWeight(w.data, ref.scale_to_float(w.scale), "fp4") for w in (w_gu, w_dn))
    decode = replace(PATHS[path], **EXPERT_FORMS["decode"])
    mma = replace(PATHS[path], **EXPERT_FORMS["fp8_mma"])
    want = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=decode)
    assert_moe_close(fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=mma), want)


@needs_kernels
@pytest.mark.parametrize("form,num_tokens", [(form, 3) for form in sorted(EXPERT_FORMS)] + [("fp8_mma", 64)])
def test_launches_depend_on_static_shapes_only(form, num_tokens, monkeypatch):
    """Graph safety: the grids and constexprs are the same for a skewed and a uniform routing (and for scales
    of another exponent range); FP4_SCALED_DOT and FP4_FP8 follow the config (FP4_SCALED_DOT for ue8m0 scales
    only)."""
    fields = EXPERT_FORMS[form]
    skip_unless_form_runs(fields["fp4_scaled_dot"])
    cfg = replace(moe_quant_config(num_tokens, TOP_K, E, "fp4", interpret=not CUDA), **fields)
    if not fields["fp4_fp8_mma"]:
        cfg = replace(cfg, dot=EXACT_DOT)
    gate_up, down, (x, w_gu, w_dn, weights, ids) = launches_match_across_routings(
        monkeypatch, cfg, _experts_case, num_tokens, LIMIT)
    for launches in (gate_up.launches, down.launches):
        constexprs = dict(launches[0][1])
        assert constexprs["FP4_SCALED_DOT"] is fields["fp4_scaled_dot"] and constexprs["EVEN_K"] is True
        assert constexprs["FP4_FP8"] is fields["fp4_fp8_mma"]
    w32 = [QuantWeight(w.data, ref.scale_to_float(w.scale), "fp4") for w in (w_gu, w_dn)]
    fused_moe_quant_triton(x, w32[0], w32[1], weights, ids, LIMIT, config=cfg)
    assert dict(gate_up.launches[-1][1])["FP4_SCALED_DOT"] is False
    assert gate_up.launches[-1][0] == gate_up.launches[0][0]


@needs_kernels
def test_an_interpreter_without_dot_scaled_runs_the_table_and_refuses_dot_scaled(monkeypatch):
    """The table's fp8-mma form needs no tl.dot_scaled; a config that asks for dot_scaled is refused."""
    if CUDA or not INTERPRET:
        pytest.skip("the interpreter's fallback")
    monkeypatch.setattr(moe_quant, "interpreter_has_dot_scaled", lambda: False)
    x, w_gu, w_dn, weights, ids = _experts_case(3, "ragged")
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT)
    assert_moe_close(y, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))
    with pytest.raises(QuantFormatError, match="fp4_scaled_dot"):
        fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT,
                               config=replace(PATHS["decode"], fp4_scaled_dot=True))


# ------------------------------------------------------------------ the table and its alternatives


def test_table_takes_the_fp8_mma_form_and_names_its_alternatives():
    for tokens in (1, 8, 64, 512, 2048, 8192):
        table = moe_quant_config(tokens, 6, 256, "fp4")
        assert table.fp4_fp8_mma and table.x_quant and table.dot == DOT_FP8
        variants = moe_quant_variants(tokens, 6, 256, "fp4")
        assert variants["table"] == table
        for name, scaled in (("fp4_scaled_dot", True), ("fp4_decode", False)):
            form = variants[name]
            assert not form.fp4_fp8_mma and form.fp4_scaled_dot is scaled and form.dot == DOT_BF16
            assert (form.block_m, form.gu_block_n, form.out_quant) == (table.block_m, table.gu_block_n,
                                                                       table.out_quant)
        decode_row = not table.out_quant
        assert table.down_act_quant is decode_row
        assert ("in_kernel_quant" in variants) is decode_row and ("gate_up_block_n_32" in variants) is decode_row
        if decode_row:
            assert not variants["in_kernel_quant"].x_quant and not variants["down_in_kernel_quant"].down_act_quant
    assert moe_quant_config(512, 6, 256, "fp4").gu_warps == 4
    assert moe_quant_variants(2048, 6, 256, "fp4")["warps_4"].gu_warps == 4
    assert list(moe_quant_variants(2048, 6, 256, "fp8_block")) == ["table"]  # no alternative at prefill
    assert moe_quant_variants(1, 6, 256, "fp8_block")["bf16_dot"].dot == DOT_BF16
    assert moe_quant_variants(1, 6, 256, "fp4", interpret=True)["fp4_decode"].dot == DOT_FP32
    streaming = linear_variants(1, 4096, 4096)
    assert streaming["table"] == linear_config(1, 4096, 4096) and not streaming["table"].quant_a
    assert streaming["in_kernel_quant"].quant_a and streaming["in_kernel_quant"].dot == DOT_BF16
    assert streaming["in_kernel_quant_fp16_dot"].dot == DOT_FP16 and streaming["warps_8"].num_warps == 8
    assert streaming["in_kernel_quant_hw_round_fp8_dot"].hw_round and list(linear_variants(512, 4096, 4096)) == [
        "table"]
    interpreted = linear_variants(1, 4096, 4096, interpret=True)
    assert interpreted["in_kernel_quant_fp16_dot"].dot == DOT_FP32 and not any(c.hw_round for c in
                                                                               interpreted.values())


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("num_tokens", [1, 8, 512, 2048])
def test_gpu_expert_alternatives_at_v4_flash_expert_shapes_and_graph_replay(fmt, num_tokens):
    """D 4096, I 2048 (the scale-word loads), 32 experts, top-6: the table's config and every alternative
    select.moe_quant_variants names (the three FP4 forms, in-kernel activation quantization, the bf16 dot on
    FP8 weights, 4 warps, narrower tiles) against the reference; each replayed from a CUDA graph gives the
    same bits as eager."""
    hidden, inter, experts, top_k = 4096, 2048, 32, 6
    quantize = ref.quantize_fp4 if fmt == "fp4" else ref.quantize_fp8_block
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w_gu = quantize(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5)
    w_dn = quantize(torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5)
    weights, ids = torch.rand(num_tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, 10.0).float()
    variants = moe_quant_variants(num_tokens, top_k, experts, fmt)
    assert fmt != "fp4" or "fp4_decode" in variants
    for name, cfg in variants.items():
        y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=cfg)
        assert ((y.float() - want).norm() / want.norm()).item() < 2e-2, name
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y), name


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_linear_streaming_alternatives_match_the_reference(m):
    """The streaming row's benchmarked alternatives (fp16 dot, 8 warps, hardware e4m3 rounding) at q_b and o_b
    shapes."""
    from sparseserve.kernels.quant.linear import quant_linear_triton

    for n, k in ((32768, 1024), (4096, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = ref.quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5)
        want = ref.quant_linear_ref(x, w, out_dtype=torch.float32)
        table = quant_linear_triton(x, w)
        variants = linear_variants(m, n, k)
        assert {"in_kernel_quant", "warps_8", "in_kernel_quant_hw_round_fp8_dot"} <= set(variants)
        for name, cfg in variants.items():
            y = quant_linear_triton(x, w, config=cfg)
            assert ((y.float() - want).norm() / want.norm()).item() < 4e-3, name
            tol = 2.0 ** -7 * table.float().abs() + 1e-6  # one bf16 unit: the fp32 sums' order may differ
            assert ((y.float() - table.float()).abs() <= tol).all(), name
        # The hardware e4m3 conversion inside the kernel gives act_quant's codes: the same dot, the same bits.
        assert torch.equal(quant_linear_triton(x, w, config=variants["in_kernel_quant_hw_round_fp8_dot"]), table)
