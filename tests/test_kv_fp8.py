"""The FP8 KV cache (sparseserve/kv_format.py, docs/kv-cache.md): the layout's bytes, quantize / dequantize
against an independent reference, and the kernels that write (norm_rope, the compressor) and read (attention,
the indexer) packed rows, under TRITON_INTERPRET=1 against the plain-PyTorch path.

Inputs are random with per-group magnitudes from 1e-3 to 1e3 (scales far from 1), never zeros, and rows at the
pool's first and last position. Kernels run on fp32 rows where the unquantized dtype's rounding is exact, so the
written bytes must equal the reference's bit for bit; the readers compare with fp32 summation-order tolerances.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as in conftest.py: the interpreter only where there is no GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparseserve.kernels import rows as R
from sparseserve.kernels.attention import (
    AttnConfig, attention_config, sparse_mqa_attention_ref, sparse_mqa_attention_triton)
from sparseserve.kernels.attention.hopper_fp8 import hopper_fp8_supported
from sparseserve.kernels.attention.select import fp8_hopper_attention_config
from sparseserve.kernels.compressor import compress_windows_ref, compress_windows_triton
from sparseserve.kernels.indexer import IndexerConfig, indexer_scores_ref, indexer_scores_triton
from sparseserve.kernels.norm_rope import norm_rope_ref, norm_rope_triton
from sparseserve.kv_format import (
    FP8_KV_GROUP,
    IndexFormat,
    KVFormat,
    dequantize_index_rows,
    dequantize_kv_rows,
    quantize_index_rows,
    quantize_kv_rows,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not _INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1")


def _rows(m: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows whose 64-channel groups span magnitudes 1e-3..1e3; no exact zeros."""
    x = torch.randn(m, dim, generator=gen)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    groups = -(-dim // FP8_KV_GROUP)
    mag = 10.0 ** torch.empty(m, groups).uniform_(-3, 3, generator=gen)
    return x * mag.repeat_interleave(FP8_KV_GROUP, dim=1)[:, :dim]


def test_layout_bytes():
    v4 = KVFormat(512, 64)
    assert (v4.nope_dim, v4.num_scales, v4.rope_offset, v4.scale_offset, v4.row_bytes) == (448, 7, 448, 576, 592)
    assert IndexFormat(128).row_bytes == 132
    tiny = KVFormat(64, 16)
    assert (tiny.num_scales, tiny.scale_offset, tiny.row_bytes) == (1, 80, 96)
    assert KVFormat(96, 0).num_scales == 2  # a partial last group has its own scale
    with pytest.raises(ValueError, match="rope_dim"):
        KVFormat(64, 64)


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (64, 16), (96, 8)])
def test_quantize_matches_an_independent_reference(head_dim, rope_dim):
    """Codes and scales against frexp-based arithmetic; error within half an e4m3 step."""
    gen = torch.Generator().manual_seed(head_dim + rope_dim)
    fmt = KVFormat(head_dim, rope_dim)
    x = _rows(37, head_dim, gen)
    packed = quantize_kv_rows(x, fmt)
    assert packed.shape == (37, fmt.row_bytes) and packed.dtype == torch.uint8
    nope = fmt.nope_dim
    for g in range(fmt.num_scales):
        cols = slice(g * FP8_KV_GROUP, min((g + 1) * FP8_KV_GROUP, nope))
        amax = x[:, cols].abs().amax(1).clamp_min(1e-4) / 448.0
        mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
        want_exp = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(amax))
        assert torch.equal(packed[:, fmt.scale_offset + g].long(), want_exp.long() + 127)
        scale = torch.ldexp(torch.ones_like(amax), want_exp)
        want_codes = (x[:, cols] / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(packed[:, cols], want_codes)
        assert ((x[:, cols].abs().amax(1) / scale) > 224).all()  # the scale is the tightest power of two
    assert (packed[:, fmt.scale_offset + fmt.num_scales:] == 0).all()  # padding
    back = dequantize_kv_rows(packed, fmt)
    assert torch.equal(back[:, nope:], x[:, nope:].bfloat16().float())  # rope kept in bf16
    # Half an e4m3 step: 2^-4 relative for normal codes, 2^-10 * scale absolute for subnormal ones.
    step = 2.0 ** (packed[:, fmt.scale_offset:fmt.scale_offset + fmt.num_scales].long() - 127 - 9).float()
    abs_bound = step.repeat_interleave(FP8_KV_GROUP, dim=1)[:, :nope]
    assert ((back[:, :nope] - x[:, :nope]).abs() <= torch.maximum(2**-4 * x[:, :nope].abs(), abs_bound)).all()


def test_no_rows():
    fmt = KVFormat(64, 16)
    assert quantize_kv_rows(torch.zeros(0, 64), fmt).shape == (0, fmt.row_bytes)
    assert dequantize_kv_rows(torch.zeros(0, fmt.row_bytes, dtype=torch.uint8), fmt).shape == (0, 64)
    codes, scales = quantize_index_rows(torch.zeros(0, 32))
    assert codes.shape == (0, 32) and scales.shape == (0,)


def test_index_quantize_roundtrip():
    gen = torch.Generator().manual_seed(3)
    x = _rows(29, 128, gen)[:, :128] * 10.0 ** torch.empty(29, 1).uniform_(-3, 3, generator=gen)
    codes, scales = quantize_index_rows(x)
    assert codes.dtype == torch.uint8 and scales.shape == (29,)
    mant, _ = torch.frexp(scales)
    assert (mant == 0.5).all()  # powers of two
    assert torch.equal(codes, (x / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    back = dequantize_index_rows(codes, scales)
    bound = torch.maximum(2**-4 * x.abs(), scales[:, None] * 2**-10)
    assert ((back - x).abs() <= bound).all()


@cpu_interp
@pytest.mark.parametrize("dim,half", [(64, 8), (128, 16), (32, 4)])
def test_norm_rope_writes_the_reference_bytes(dim, half):
    gen = torch.Generator().manual_seed(dim)
    fmt = KVFormat(dim, 2 * half)
    tokens = 6
    x = _rows(tokens, dim, gen)
    weight = 0.5 + torch.rand(dim, generator=gen) * 100
    angle = torch.rand(tokens, half, generator=gen) * 6.3
    cos, sin = angle.cos(), angle.sin()
    pool_rows = torch.tensor([0, 9, 3, 4, 5, 10])  # the pool's first and last row
    pools = [torch.randint(0, 255, (11, fmt.row_bytes), generator=gen, dtype=torch.uint8) for _ in range(2)]
    before = pools[0].clone()
    pools[1].copy_(before)
    got = norm_rope_triton(x, weight, 1e-6, cos, sin, pools[0], pool_rows, kv_format=fmt)
    want = norm_rope_ref(x, weight, 1e-6, cos, sin, pools[1], pool_rows, kv_format=fmt)
    used = fmt.scale_offset + fmt.num_scales
    assert torch.equal(got[:, :used], want[:, :used])
    assert torch.equal(pools[0][:, :used], pools[1][:, :used])
    untouched = torch.tensor([i not in pool_rows.tolist() for i in range(11)])
    assert torch.equal(pools[0][untouched], before[untouched])


def _compress_case(head_dim, rope_dim, rate, overlap, gen):
    """One compress call at window boundaries (decode tokens and prefill chunks), as the model makes it."""
    width = (2 if overlap else 1) * head_dim
    span = (2 if overlap else 1) * rate
    starts = [0, rate - 1, rate, 2 * rate - 1, 0]
    chunks = [1, 1, 1, 1, 2 * rate + 1]
    nt = torch.tensor(chunks)
    tok_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), nt[:-1]]), 0)
    slots = torch.randperm(len(chunks) + 2, generator=gen)[:len(chunks)]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, chunks)])
    seq = torch.repeat_interleave(torch.arange(len(chunks)), nt)
    ring = span + 3
    staging_base = (len(chunks) + 2) * ring
    state = torch.randn(staging_base + pos.shape[0] + 1, 2 * width, generator=gen)
    state[:, :width] *= 10.0 ** torch.empty(1, width).uniform_(-2, 2, generator=gen)
    src_rows = R.source_rows_ref(pos, seq, torch.tensor(starts), tok_off, slots, torch.arange(-span + 1, 1), ring,
                                 staging_base)
    epb = 4
    max_blocks = (int(pos.max()) // rate + epb) // epb
    table = torch.randperm(len(chunks) * max_blocks + 3, generator=gen)[:len(chunks) * max_blocks]
    table = table.view(len(chunks), max_blocks).int()
    pool_rows = (len(chunks) * max_blocks + 3) * epb
    out_rows = R.emit_pool_rows_ref(pos, seq, table, rate, epb, 0, -1)
    angle = (pos + 1 - rate).float()[:, None] * torch.rand(1, rope_dim // 2, generator=gen)
    bias = torch.randn(rate, width, generator=gen)
    norm_weight = (1.0 + 0.5 * torch.randn(head_dim, generator=gen)) * 30
    return (state, src_rows, bias, overlap, norm_weight, 1e-6, angle.cos(), angle.sin()), pool_rows, out_rows


def _close_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    """FP8 codes from fp32 pools that differ only in summation order: equal, or one e4m3 step apart."""
    va, vb = a.view(torch.float8_e4m3fn).float(), b.view(torch.float8_e4m3fn).float()
    assert ((va - vb).abs() <= 2**-3 * torch.maximum(va.abs(), vb.abs()) + 2**-9).all()
    assert (a == b).float().mean() > 0.97


@cpu_interp
@pytest.mark.parametrize("head_dim,rope_dim,rate,overlap", [(64, 16, 4, True), (128, 16, 8, False),
                                                            (32, 8, 16, False)])
def test_compressor_writes_packed_rows(head_dim, rope_dim, rate, overlap):
    gen = torch.Generator().manual_seed(head_dim + rate)
    fmt = KVFormat(head_dim, rope_dim)
    head, n_rows, out_rows = _compress_case(head_dim, rope_dim, rate, overlap, gen)
    assert (out_rows >= 0).sum() >= 3 and (out_rows < 0).any()
    ref = torch.randint(0, 255, (n_rows, fmt.row_bytes), generator=gen, dtype=torch.uint8)
    out = ref.clone()
    before = ref.clone()
    compress_windows_ref(*head, ref, out_rows, kv_format=fmt)
    compress_windows_triton(*head, out, out_rows, kv_format=fmt)
    written = torch.zeros(n_rows, dtype=torch.bool)
    written[out_rows[out_rows >= 0]] = True
    assert torch.equal(out[~written], before[~written])  # rows -1 wrote nothing
    s0, s1 = fmt.scale_offset, fmt.scale_offset + fmt.num_scales
    assert torch.equal(out[written, s0:s1], ref[written, s0:s1])
    _close_codes(out[written, :fmt.nope_dim], ref[written, :fmt.nope_dim])
    rope_out = out[written, fmt.rope_offset:s0].contiguous().view(torch.bfloat16).float()
    rope_ref = ref[written, fmt.rope_offset:s0].contiguous().view(torch.bfloat16).float()
    torch.testing.assert_close(rope_out, rope_ref, rtol=2**-7, atol=1e-6)
    # And the values are the unquantized kernel's entries, quantized.
    plain = torch.zeros(n_rows, head_dim)
    compress_windows_ref(*head, plain, out_rows)
    deq = dequantize_kv_rows(ref[written], fmt)
    assert ((deq - plain[written]).abs() <= 2**-4 * plain[written].abs() + 1e-3 * plain[written].abs().amax()).all()


@cpu_interp
def test_indexer_compressor_writes_codes_and_scales():
    gen = torch.Generator().manual_seed(11)
    head, n_rows, out_rows = _compress_case(32, 8, 4, True, gen)
    codes = [torch.zeros(n_rows, 32, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.full((n_rows,), 7.0) for _ in range(2)]
    compress_windows_ref(*head, codes[0], out_rows, out_scale=scales[0])
    compress_windows_triton(*head, codes[1], out_rows, out_scale=scales[1])
    written = torch.zeros(n_rows, dtype=torch.bool)
    written[out_rows[out_rows >= 0]] = True
    assert torch.equal(scales[0], scales[1]) and (scales[0][~written] == 7.0).all()
    _close_codes(codes[1][written], codes[0][written])


def _packed_pool(n: int, fmt: KVFormat, gen: torch.Generator) -> torch.Tensor:
    return quantize_kv_rows(_rows(n, fmt.head_dim, gen) * 0.05, fmt)


ATTN_CASES = [
    # (T, H, D, rope, L, config): unsplit (the engine's config), split (empty splits), band pre-pass, 64-head
    # programs; D = 64 and 128: a scale group shares its 64 columns with rope channels
    (4, 4, 64, 16, 40, None),
    (3, 16, 128, 16, 65, AttnConfig("triton", 16, 16, 4, 2, 4)),
    (3, 16, 64, 16, 70, AttnConfig("triton", 16, 32, 4, 2, 2, band_prepass=True)),
    (2, 64, 64, 16, 48, AttnConfig("triton", 64, 32, 4, 2, 1, band_prepass=True)),
    # the selection's FP8 rows at V4's layout (7 scale groups, the rope in the 8th): F1 split, F2
    (2, 64, 512, 64, 70, AttnConfig("triton", 64, 32, 8, 2, 2, band_prepass=True)),
    (3, 16, 512, 64, 65, AttnConfig("triton", 16, 32, 4, 2, 4)),
]


@cpu_interp
@pytest.mark.parametrize("T,H,D,rope,L,cfg", ATTN_CASES)
def test_attention_reads_packed_rows(T, H, D, rope, L, cfg):
    gen = torch.Generator().manual_seed(T * H + D + L)
    fmt = KVFormat(D, rope)
    n_pool = 2 * L + 5
    pool = _packed_pool(n_pool, fmt, gen)
    q = torch.randn(T, H, D, generator=gen)
    rows = torch.randint(0, n_pool, (T, L), generator=gen, dtype=torch.int32)
    rows[torch.rand(T, L, generator=gen) < 0.2] = -1
    rows[0, 0], rows[0, -1] = 0, n_pool - 1  # the pool's first and last row
    rows[-1, :] = -1  # no rows: output exactly 0
    sinks = torch.randn(H, generator=gen)
    out = sparse_mqa_attention_triton(q, pool, rows, sinks, D**-0.5, cfg, kv_format=fmt)
    ref = sparse_mqa_attention_ref(q, pool, rows, sinks, D**-0.5, kv_format=fmt)
    # The reference on the dequantized rows as a plain pool: the same function.
    plain = sparse_mqa_attention_ref(q, dequantize_kv_rows(pool, fmt), rows, sinks, D**-0.5)
    assert torch.equal(ref, plain)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    assert out[-1].abs().max().item() == 0.0


def test_hopper_config_refuses_fp8_rows_it_cannot_serve():
    """The Hopper kernel's FP8 form takes only V4's row layout, bf16 q on sm_90: elsewhere an explicit Hopper
    config on FP8 rows is a clear error naming the layout it takes (never a silent fallback)."""
    for fmt, dim in ((KVFormat(64, 16), 64), (KVFormat(512, 64), 512)):
        q = torch.zeros(2, 64, dim)
        with pytest.raises(ValueError, match="Hopper kernel on FP8 KV rows.*KVFormat"):
            sparse_mqa_attention_triton(q, torch.zeros(4, fmt.row_bytes, dtype=torch.uint8),
                                        torch.zeros(2, 3, dtype=torch.int32), torch.zeros(64), 1.0,
                                        AttnConfig("hopper", 64, 64, 4, 2, 1, band_prepass=True), kv_format=fmt)
    assert not hopper_fp8_supported(torch.zeros(2, 64, 512, dtype=torch.bfloat16),
                                    torch.zeros(4, 592, dtype=torch.uint8), KVFormat(512, 64))  # CPU tensors


@pytest.mark.parametrize("tokens,rows", [(1, 640), (8, 640), (64, 640), (64, 384), (64, 1152), (256, 1152),
                                         (128, 130), (16, 100), (4096, 640)])
def test_fp8_hopper_config_takes_the_hopper_rows_splits(tokens, rows):
    """The named FP8 Hopper config (row FH) splits as the bf16 Hopper row 1 does at the same shapes, while the
    engine's FP8 selection stays on the Triton rows F1/F2."""
    cfg = fp8_hopper_attention_config(tokens, 64, rows, 132)
    bf16 = attention_config(tokens, 64, rows, 512, 132, hopper=True)
    assert cfg.kernel == "hopper" and cfg.band_prepass and (cfg.block_h, cfg.block_n) == (64, 64)
    if bf16.kernel == "hopper":  # (at least HOPPER_MIN_PROGRAMS programs)
        assert cfg == bf16
    assert attention_config(tokens, 64, rows, 512, 132, hopper=True, fp8=True).kernel == "triton"


@cpu_interp
@pytest.mark.parametrize("cfg", [None, IndexerConfig(16, 2, 4, 2)])
def test_indexer_reads_fp8_keys(cfg):
    gen = torch.Generator().manual_seed(5)
    T, Hi, Di, B, epb, max_blocks, E, rate = 7, 16, 32, 3, 8, 4, 30, 4
    n_blocks = B * max_blocks + 2
    keys = _rows(n_blocks * epb, Di, gen)[:, :Di] * 10.0 ** torch.empty(n_blocks * epb, 1).uniform_(-2, 2,
                                                                                                    generator=gen)
    codes, scales = quantize_index_rows(keys)
    q = torch.randn(T, Hi, Di, generator=gen)
    weights = torch.randn(T, Hi, generator=gen)
    table = torch.randperm(n_blocks, generator=gen)[:B * max_blocks].view(B, max_blocks).int()
    table[1, 3] = -1
    token_seq = torch.randint(0, B, (T,), generator=gen)
    positions = torch.tensor([0, rate - 1, rate, 2 * rate - 1, rate * epb, rate * E - 1, 50])
    args = (q, weights, codes, table, token_seq, positions, rate, epb, Di**-0.5, E)
    out = indexer_scores_triton(*args, cfg, index_scale=scales)
    ref = indexer_scores_ref(*args, index_scale=scales)
    plain = indexer_scores_ref(q, weights, dequantize_index_rows(codes, scales), *args[3:])
    assert torch.equal(ref, plain)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin) and fin.any()
    assert ((out[fin] - ref[fin]).norm() / ref[fin].norm()).item() < 1e-5
