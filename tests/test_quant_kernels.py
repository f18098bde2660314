"""The quantized kernels (sparseserve/kernels/quant/) against their plain-PyTorch references: activation
quantization bit for bit, the block-FP8 linear in both forms, the FP8 and FP4 routed experts (ragged loads,
both activation paths), the FP4 nibble order on a hand-built byte, the config table, the checks; on a GPU the
tensor-core path at V4-Flash shapes and CUDA-graph replay.

CPU runs use the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is imported). Its
fp32 -> fp8 and fp32 -> bf16 casts round wrongly, so the kernels round on the bits; its bf16 dot is wrong, so
the interpreter configs take the fp32 dot (exact on e4m3 and scaled e2m1 values), while its fp8 dot is right
and is tested as the tensor-core path. Runs in float32 compare to the reference to fp32 summation order; bf16
runs to one bf16 unit of the output (the interpreter truncates the final store)."""
from __future__ import annotations

import os

import pytest
import torch

from sparseserve.kernels.quant import reference as ref
from sparseserve.kernels.quant.act_quant import act_quant, act_quant_triton
from sparseserve.kernels.quant.formats import QuantFormatError, QuantWeight
from sparseserve.kernels.quant.linear import quant_linear, quant_linear_triton
from sparseserve.kernels.quant.moe_quant import HAS_TRITON, fused_moe_quant, fused_moe_quant_triton
from sparseserve.kernels.quant.select import (DOT_BF16, DOT_FP8, DOT_FP32, GemmConfig, MoeQuantConfig,
                                              linear_config, moe_quant_config)
from quant_checks import assert_moe_close

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EXACT_DOT = DOT_BF16 if CUDA else DOT_FP32  # the exact non-fp8 dot where the test runs
needs_kernels = pytest.mark.skipif(not HAS_TRITON or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                   reason="runs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on the CPU)")


def spread_rows(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Rows scaled by powers of two from 2^-8 to 2^6: activation scales far from 1."""
    return x * torch.exp2(torch.randint(-8, 7, (x.shape[0], 1), generator=gen).float())


def spread_blocks(w: torch.Tensor, gen: torch.Generator, block: int) -> torch.Tensor:
    """Each block x block tile of the last two dims scaled by its own power of two in 2^-8 .. 2^6."""
    *lead, n, k = w.shape
    e = torch.randint(-8, 7, (*lead, -(-n // block), -(-k // block)), generator=gen).float()
    mult = torch.exp2(e).repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
    return w * mult


def assert_close_to(y: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: summation order (2^-18 of the row's magnitude); bf16: plus one unit of the output."""
    assert torch.isfinite(y).all()
    y, want = y.float(), want.float()
    tol = 2.0 ** -18 * want.abs().amax(dim=-1, keepdim=True) + 1e-30
    if dtype != torch.float32:
        tol = tol + 2.0 ** -7 * want.abs()
    excess = ((y - want).abs() - tol).max().item()
    assert excess <= 0, f"max excess over the tolerance {excess:.3g}"


# ------------------------------------------------------------------ formats and references


def test_fp4_nibble_order_on_a_hand_built_byte():
    """Byte 0x2B: low nibble 0xB (sign, magnitude code 3 = 1.5) is element 0, high nibble 0x2 (1.0) element 1."""
    data = torch.tensor([[0x2B] + [0] * 15], dtype=torch.uint8)
    assert ref.unpack_fp4(data)[0, :2].tolist() == [-1.5, 1.0]
    scale = torch.tensor([[4.0]])
    assert ref.dequant_fp4(data, scale)[0, :3].tolist() == [-6.0, 4.0, 0.0]
    every = torch.arange(16, dtype=torch.uint8).view(1, 16) * 0x11  # both nibbles code c
    values = ref.unpack_fp4(every)[0, 0::2].tolist()
    assert values == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.mark.parametrize("e8m0", [True, False])
def test_quantizers_round_trip_within_their_grids(e8m0):
    gen = torch.Generator().manual_seed(1)
    w = spread_blocks(torch.randn(200, 300, generator=gen), gen, 128)
    q8 = ref.quantize_fp8_block(w, e8m0=e8m0)
    assert q8.scale.shape == (2, 3) and q8.scale_is_e8m0 == e8m0
    err8 = (ref.dequant_weight(q8) - w).abs() / w.abs().clamp_min(1e-3)
    assert err8.median() < 2 ** -4
    w4 = torch.randn(6, 64, generator=gen)
    q4 = ref.quantize_fp4(w4, e8m0=e8m0)
    assert q4.data.shape == (6, 32) and q4.scale.shape == (6, 2)
    back = ref.dequant_weight(q4)
    scale = ref.scale_to_float(q4.scale).repeat_interleave(32, -1)
    assert ((back - w4).abs() <= scale * 1.0 + 1e-6).all()  # half the widest e2m1 step (2) times the scale


def test_act_quant_ref_follows_the_release_formula():
    """amax = max(|x|, 1e-4); s = 2^ceil(log2(amax * (1/448))); codes e4m3(x / s): spot values."""
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 5], x[0, 129] = 448.0, -3.3, 1.0  # group 1 of row 0 is [1.0, 0] (2 columns)
    x[1, :] = 1e-6  # amax floor
    q, s = ref.act_quant_ref(x, "ue8m0")
    assert s[0].tolist() == [1.0, 2.0 ** -8]
    assert s[1, 0].item() == 2.0 ** -22  # 1e-4 / 448 = 2.2e-7 -> 2^-22
    assert q[0, 0].float().item() == 448.0 and q[0, 5].float().item() == -3.25 and q[0, 129].float().item() == 256.0
    q32, s32 = ref.act_quant_ref(x, None)
    assert s32[0, 0].item() == pytest.approx(1.0) and s32[0, 1].item() == pytest.approx(1.0 / 448)


def test_quant_weight_checks_name_the_field():
    codes = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantFormatError, match="scale has shape"):
        QuantWeight(codes, torch.ones(1, 2), "fp8_block")
    with pytest.raises(QuantFormatError, match="fmt is 'int4'"):
        QuantWeight(codes, torch.ones(2, 2), "int4")
    with pytest.raises(QuantFormatError, match="float8_e4m3fn"):
        QuantWeight(torch.zeros(256, 256), torch.ones(2, 2), "fp8_block")
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        QuantWeight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 0), "fp4")
    with pytest.raises(QuantFormatError, match="scale_fmt"):
        ref.act_quant_ref(torch.ones(1, 128), "e4m3")


# ------------------------------------------------------------------ activation quantization


@needs_kernels
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("m,k", [(1, 128), (3, 300), (64, 256), (300, 130)])
def test_act_quant_kernel_is_bitwise_the_reference(m, k, scale_fmt):
    gen = torch.Generator().manual_seed(m * k)
    x = spread_rows(torch.randn(m, k, generator=gen), gen).bfloat16().to(DEVICE)
    q, s = act_quant_triton(x, scale_fmt)
    q_ref, s_ref = ref.act_quant_ref(x, scale_fmt)
    assert torch.equal(s, s_ref)
    # Values, not bytes: triton 3.6's interpreter stores -0.0 as +0 (the kernel keeps the sign; the GPU too).
    assert torch.equal(q.float(), q_ref.float())


def test_act_quant_dispatch_on_the_cpu_is_the_reference():
    x = torch.randn(3, 200)
    q, s = act_quant(x)
    q_ref, s_ref = ref.act_quant_ref(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


# ------------------------------------------------------------------ block-FP8 linear


def _linear_case(m: int, n: int, k: int, e8m0: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = spread_rows(torch.randn(m, k, generator=gen), gen).to(dtype).to(DEVICE)
    w = ref.quantize_fp8_block(spread_blocks(torch.randn(n, k, generator=gen) * k ** -0.5, gen, 128), e8m0=e8m0)
    w = QuantWeight(w.data.to(DEVICE), w.scale.to(DEVICE), w.fmt)
    return x, w


LINEAR_CONFIGS = {
    "streaming": GemmConfig(16, 32, 4, 2, True, EXACT_DOT, k_step=2),  # K of 3 groups: a ragged last step
    "tensor_fp8": GemmConfig(32, 64, 4, 2, False, DOT_FP8),
    "tensor_exact": GemmConfig(64, 32, 4, 2, False, EXACT_DOT),
}


@needs_kernels
@pytest.mark.parametrize("form", sorted(LINEAR_CONFIGS))
@pytest.mark.parametrize("m,n,k", [(1, 130, 300), (3, 64, 256), (64, 200, 384), (300, 40, 130)])
def test_linear_kernel_matches_the_reference(m, n, k, form):
    """Ragged M, N and K (not multiples of the blocks), activation and block scales from 2^-8 to 2^6, e8m0
    block scales; float32 to summation order, bf16 to one output unit."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _linear_case(m, n, k, True, dtype)
        y = quant_linear_triton(x, w, "ue8m0", config=LINEAR_CONFIGS[form])
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close_to(y, ref.quant_linear_ref(x, w, "ue8m0", out_dtype=torch.float32), dtype)


@needs_kernels
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_linear_kernel_with_fp32_scales_and_the_default_table(scale_fmt):
    """fp32 weight scales, both activation scale formats, the config the table picks (streaming at M=3,
    the tensor form with the fp8 dot at M=300)."""
    for m in (3, 300):
        x, w = _linear_case(m, 72, 200, False, torch.float32)
        y = quant_linear_triton(x, w, scale_fmt)
        want = ref.quant_linear_ref(x, w, scale_fmt, out_dtype=torch.float32)
        assert_close_to(y, want, torch.float32)
        exact = x.double() @ ref.dequant_weight(w).double().t()  # quantizing x costs a few per cent, no more
        assert ((y.double() - exact).norm() / exact.norm()).item() < 0.05


def test_linear_dispatch_on_the_cpu_is_the_reference():
    x, w = _linear_case(3, 40, 130, True, torch.float32)
    x, w = x.cpu(), QuantWeight(w.data.cpu(), w.scale.cpu(), w.fmt)
    assert torch.equal(quant_linear(x, w), ref.quant_linear_ref(x, w))
    with pytest.raises(QuantFormatError, match=r"x needs \[M, 130\]"):
        quant_linear(torch.ones(2, 129), w)


# ------------------------------------------------------------------ routed experts

E, TOP_K, LIMIT = 8, 3, 1.5


def _moe_case(fmt: str, num_tokens: int, dtype: torch.dtype, e8m0: bool = True):
    """V4-like experts at tiny sizes: D and I not multiples of 128 where the format allows; ragged loads
    (expert 0 takes every token, experts 6 and 7 none)."""
    hidden, inter = (96, 160) if fmt == "fp4" else (200, 128)
    gen = torch.Generator().manual_seed(num_tokens * 7 + len(fmt))
    x = spread_rows(torch.randn(num_tokens, hidden, generator=gen), gen).to(dtype)
    w_gu = torch.randn(E, 2 * inter, hidden, generator=gen) * hidden ** -0.5 * 2
    w_dn = torch.randn(E, hidden, inter, generator=gen) * inter ** -0.5
    if fmt == "fp4":
        quant = ref.quantize_fp4
        w_gu = w_gu * torch.exp2(torch.randint(-8, 7, (E, 2 * inter, hidden // 32), generator=gen).float()
                                 ).repeat_interleave(32, -1)
    else:
        quant = ref.quantize_fp8_block
        w_gu, w_dn = spread_blocks(w_gu, gen, 128), spread_blocks(w_dn, gen, 128)
    w_gu, w_dn = quant(w_gu, e8m0=e8m0), quant(w_dn, e8m0=e8m0)
    others = torch.stack([torch.randperm(5, generator=gen)[: TOP_K - 1] + 1 for _ in range(num_tokens)])
    ids = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.long), others], dim=1)
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    dev = [QuantWeight(w.data.to(DEVICE), w.scale.to(DEVICE), w.fmt) for w in (w_gu, w_dn)]
    return x.to(DEVICE), dev[0], dev[1], weights.to(DEVICE), ids.to(DEVICE)


MOE_CONFIGS = {  # the two activation paths of select.py's table, at tiny tiles
    "decode": MoeQuantConfig(16, 64, 4, 2, 64, 4, 2, False, False, EXACT_DOT),
    "prefill": MoeQuantConfig(32, 128, 4, 2, 64, 4, 2, True, True, EXACT_DOT),
}


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("path", sorted(MOE_CONFIGS) + ["table"])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_moe_kernels_match_the_reference(fmt, path, num_tokens):
    """The two activation paths at tiny tiles, and the table's own config (act_quant launches, fp8 dots, FP4's
    fp8-mma form) at its sizes."""
    for dtype in (torch.float32, torch.bfloat16) if num_tokens <= 3 else (torch.float32,):
        x, w_gu, w_dn, weights, ids = _moe_case(fmt, num_tokens, dtype)
        cfg = moe_quant_config(num_tokens, TOP_K, E, fmt, interpret=not CUDA) if path == "table" else MOE_CONFIGS[path]
        y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=cfg)
        want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT).float()
        if dtype == torch.float32:
            assert_moe_close(y, want)
        else:  # an ulp of bf16 before a re-quantization can move a code by one e4m3 step: compare in norm
            err = ((y.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, err


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
def test_moe_kernels_at_300_tokens_with_fp8_dot_and_shared(fmt):
    """The table's prefill row (fp8 dot for fp8 weights), fp32 weight scales, the shared expert's rows added."""
    x, w_gu, w_dn, weights, ids = _moe_case(fmt, 300, torch.float32, e8m0=False)
    cfg = moe_quant_config(300, TOP_K, E, fmt, interpret=not CUDA)
    assert cfg.out_quant and cfg.dot == DOT_FP8 and cfg.fp4_fp8_mma == (fmt == "fp4")
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, shared=lambda: shared)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT) + shared
    assert_moe_close(y, want)


def test_moe_dispatch_on_the_cpu_is_the_reference_and_checks_shapes():
    x, w_gu, w_dn, weights, ids = _moe_case("fp4", 3, torch.float32)
    if CUDA:
        pytest.skip("the dispatch runs the kernels on CUDA")
    got = fused_moe_quant(x, w_gu, w_dn, weights, ids, LIMIT)
    assert torch.equal(got, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))
    with pytest.raises(QuantFormatError, match=r"need \[E, 2I, D\] and \[E, D, I\]"):
        fused_moe_quant(x, w_gu, w_gu, weights, ids, LIMIT)


# ------------------------------------------------------------------ the FP4 decode inside a kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from sparseserve.kernels.quant.triton_common import as_dot_operand, fp4_weight_partial

    @triton.jit
    def _decode_probe_kernel(w_ptr, ws_ptr, out_ptr, DOT: tl.constexpr):
        """Multiplies the identity [16, 128] by one 128-column group of a 16-row fp4 weight: out = W's values."""
        r = tl.arange(0, 16)
        c = tl.arange(0, 128)
        eye = as_dot_operand(tl.where(r[:, None] == c[None, :], 1.0, 0.0), DOT)
        j = tl.arange(0, 64)
        part = fp4_weight_partial(eye, w_ptr + r[:, None] * 64 + j[None, :], ws_ptr + r[:, None] * 4 + (j // 16)[None, :],
                                  (r[:, None] >= 0) & (j[None, :] < 64), True, DOT)
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], part)


@needs_kernels
def test_fp4_nibble_order_inside_the_kernel():
    """Row 0 byte 0 is 0x2B: the kernel must see -1.5 at column 0 and 1.0 at column 1 (times the scale)."""
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=gen)
    data[0, 0] = 0x2B
    scale = torch.exp2(torch.randint(-8, 7, (16, 4), generator=gen).float())
    scale[0, 0] = 2.0
    values = ref.dequant_fp4(data, scale)
    assert values[0, :2].tolist() == [-3.0, 2.0]
    out = torch.empty(16, 16, device=DEVICE)
    e8m0 = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    _decode_probe_kernel[(1,)](data.to(DEVICE), e8m0.to(DEVICE), out, DOT=EXACT_DOT)
    assert torch.equal(out.cpu(), values[:, :16].t())  # out[r, c] = row c's value at column r


# ------------------------------------------------------------------ the table


def test_linear_table_rows():
    stream = linear_config(1, 4096, 4096)
    assert not stream.quant_a and stream.dot == DOT_FP8 and linear_config(16, 4096, 4096).block_m == 16
    assert stream.block_n == 32 and linear_config(1, 40960, 1024).block_n == 64 and stream.k_step == 4
    assert linear_config(17, 4096, 4096) == GemmConfig(64, 64, 4, 4, False, DOT_FP8)
    assert linear_config(1024, 4096, 4096).block_n == 128 and linear_config(1025, 4096, 4096).block_m == 128
    assert linear_config(8, 4096, 4096, interpret=True) == stream
    assert linear_config(8192, 4096, 4096, interpret=True).dot == DOT_FP8


def test_moe_table_rows():
    for fmt in ("fp4", "fp8_block"):
        decode = moe_quant_config(1, 6, 256, fmt)
        assert (decode.block_m, decode.out_quant, decode.x_quant, decode.down_act_quant, decode.dot) == (
            16, False, True, True, DOT_FP8)
        assert decode.fp4_fp8_mma == (fmt == "fp4")
    assert moe_quant_config(1024, 6, 256, "fp8_block").block_m == 32
    mid = moe_quant_config(2048, 6, 256, "fp8_block")
    assert (mid.block_m, mid.gu_block_n, mid.out_quant, mid.dot) == (64, 128, True, DOT_FP8)
    big = moe_quant_config(8192, 6, 256, "fp4")
    assert big.fp4_fp8_mma and big.block_m == 64 and moe_quant_config(8192, 6, 256, "fp8_block").block_m == 128


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 512, 2048])
def test_gpu_linear_at_v4_flash_shapes_and_graph_replay(m):
    """The table's config at V4-Flash shapes (q_b 1024 -> 32768, o_b 8192 -> 4096) against the reference; the
    launch replayed from a CUDA graph gives the same bits as eager."""
    for n, k in ((32768, 1024), (4096, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = ref.quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5)
        y = quant_linear_triton(x, w)
        want = ref.quant_linear_ref(x, w, out_dtype=torch.float32)
        assert ((y.float() - want).norm() / want.norm()).item() < 4e-3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = quant_linear_triton(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_gpu_moe_at_v4_flash_expert_shapes_and_graph_replay(fmt, num_tokens):
    hidden, inter, experts, top_k = 4096, 2048, 32, 6
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    quant = ref.quantize_fp4 if fmt == "fp4" else ref.quantize_fp8_block
    w_gu = quant(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5)
    w_dn = quant(torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5)
    scores = torch.rand(num_tokens, experts, device="cuda", generator=gen)
    weights, ids = scores.topk(top_k, dim=1)
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, 10.0).float()
    assert ((y.float() - want).norm() / want.norm()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)


# ------------------------------------------------------------------ the benchmark script


@needs_kernels
def test_benchmark_smoke_run_writes_its_result(tmp_path):
    """benchmarks/quant_gemm.py end to end at tiny shapes on the CPU: every case runs and is correct."""
    if CUDA:
        pytest.skip("the smoke run is the CPU version")
    import json

    from benchmarks import quant_gemm

    out = tmp_path / "quant_gemm.json"
    assert quant_gemm.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["cases"]) == 4 and not result["skipped"]
    assert all(row["correct"] and row["kernel_us"] > 0 and row["bytes"] > 0 for row in result["cases"])
