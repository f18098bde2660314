"""Compressor emission: Triton kernel vs the plain-PyTorch reference.

CPU tests run the kernel under TRITON_INTERPRET=1 (fp32: only the summation order and the
online softmax differ, ~1e-7 relative). The state is laid out as the model lays it out
([ring | staging | trash], source rows built by `rows.source_rows_ref`), with decode tokens
and prefill chunks side by side, positions at window boundaries (0, rate-1, rate, 2*rate-1,
...) so that the first slots of early windows are -1, every token offered as a possible
emitter (the captured-step shape) and the non-closing ones given out row -1 (skipped) or the
trash row. The whole pool is compared, so a stray write shows.

Note on bf16 under the interpreter: its fp32 -> bf16 cast truncates (the GPU rounds to
nearest even), so CPU bf16 checks allow one bf16 ulp; fp16 rounds like the GPU.
GPU tests (V4-Flash shapes: head_dim 512 rate 4 with overlap, index_head_dim 128 rate 4 with
overlap, head_dim 512 rate 128 without; rope dim 64; bf16) compare with the reference on the
same tensors: the kernel and the reference round the same fp32 values to bf16 twice (before
and after rope), so they differ only where summation order moves a value across a rounding
boundary: rare one-ulp flips.
"""
from __future__ import annotations

import os


import pytest
import torch

from sparseserve.kernels import rows as R
from sparseserve.kernels.compressor import (
    compress_config,
    compress_windows,
    compress_windows_ref,
    compress_windows_triton,
)
from sparseserve.model.layers.rope import rope_cos_sin, rope_inv_freq

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6


def _case(head_dim: int, rope_dim: int, rate: int, overlap: bool, chunks: list[int], starts: list[int],
          gen: torch.Generator, *, trash: bool = False, device="cpu", dtype=torch.float32, epb: int = 4,
          max_entries: int | None = None):
    """Everything one compress_windows call needs, built the way the model builds it."""
    width = (2 if overlap else 1) * head_dim
    span = (2 if overlap else 1) * rate
    B = len(chunks)
    nt = torch.tensor(chunks)
    start = torch.tensor(starts)
    tok_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), nt[:-1]]), 0)
    slots = torch.randperm(B + 2, generator=gen)[:B]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, chunks)])
    seq = torch.repeat_interleave(torch.arange(B), nt)
    T = pos.shape[0]
    ring = span + 3
    staging_base = (B + 2) * ring
    state = torch.randn(staging_base + T + 1, 2 * width, generator=gen)
    state[:, width:] *= 3.0  # peaky, varied softmax weights
    # Every token may emit (as in a captured step); the kernels mask the others.
    src_rows = R.source_rows_ref(pos, seq, start, tok_off, slots, torch.arange(-span + 1, 1), ring, staging_base)
    max_entries = max_entries or int(pos.max()) // rate + 1  # fixed by the graph test: static pool
    max_blocks = (max_entries + epb - 1) // epb
    table = torch.randperm(B * max_blocks + 3, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    pool_rows = (B * max_blocks + 3) * epb + 1
    trash_row = pool_rows - 1
    out_rows = R.emit_pool_rows_ref(pos, seq, table, rate, epb, 0, trash_row if trash else -1)
    bias = torch.randn(rate, width, generator=gen)
    norm_weight = 1.0 + 0.5 * torch.randn(head_dim, generator=gen)
    inv_freq = rope_inv_freq({"rope_theta": 160000.0}, rope_dim)
    cos, sin = rope_cos_sin(pos + 1 - rate, inv_freq)
    # The pool (large at real shapes: every sequence's entries) is drawn on the device.
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    pool = torch.randn(pool_rows, head_dim, generator=dev_gen, device=device).to(dtype)
    t = lambda x: x.to(device)  # noqa: E731
    d = lambda x: x.to(device, dtype)  # noqa: E731
    return (d(state), t(src_rows), d(bias), overlap, d(norm_weight), EPS, t(cos), t(sin), pool, t(out_rows))


def _pair_mag(x: torch.Tensor) -> torch.Tensor:
    """|x_2i| + |x_2i+1| per channel: a one-ulp difference before rope moves both channels
    of a pair by up to an ulp of either, so half-precision bounds are relative to this."""
    mag = x.float().abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True)
    return mag.expand(*mag.shape[:-1], 2).flatten(-2).clamp_min(2**-14)


def _run_both(args, **kw):
    *head, pool, out_rows = args
    ref, out = pool.clone(), pool.clone()
    compress_windows_ref(*head, ref, out_rows)
    compress_windows_triton(*head, out, out_rows, **kw)
    return out, ref, pool


def _boundary(rate: int) -> tuple[list[int], list[int]]:
    """Decode tokens at 0, rate-1, rate, 2*rate-1, 2*rate, 3*rate-1 plus prefill chunks
    starting at 0 and mid-window that cross two boundaries."""
    starts = [0, rate - 1, rate, 2 * rate - 1, 2 * rate, 3 * rate - 1, 0, rate // 2 + 1]
    chunks = [1, 1, 1, 1, 1, 1, 2 * rate + 1, 2 * rate]
    return chunks, starts


CPU_CASES = [
    # head_dim, rope_dim, rate, overlap
    (64, 16, 4, True),
    (64, 16, 4, False),
    (32, 8, 2, True),
    (48, 16, 2, False),  # head_dim / 2 not a power of two: masked channels
    (32, 16, 16, True),
    (24, 8, 16, False),
    (16, 8, 128, False),
    (16, 4, 128, True),
]


@pytest.mark.parametrize("head_dim,rope_dim,rate,overlap", CPU_CASES)
def test_compressor_matches_reference_cpu(head_dim, rope_dim, rate, overlap):
    gen = torch.Generator().manual_seed(head_dim * 1000 + rate * 2 + overlap)
    chunks, starts = _boundary(rate)
    args = _case(head_dim, rope_dim, rate, overlap, chunks, starts, gen)
    out_rows = args[-1]
    assert (out_rows >= 0).sum() >= 4 and (out_rows < 0).any()
    if overlap:  # windows 0 have no previous window: their first `rate` slots are holes
        assert (args[1][:, :rate] < 0).all(dim=1).any()
    out, ref, before = _run_both(args)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    written = torch.zeros(before.shape[0], dtype=torch.bool)
    written[out_rows[out_rows >= 0]] = True
    assert torch.equal(out[~written], before[~written])  # -1 rows wrote nothing
    assert not torch.equal(out[written], before[written])


@pytest.mark.parametrize("rate,overlap", [(4, True), (16, False)])
def test_compressor_trash_row_and_small_tiles_cpu(rate, overlap):
    """Non-closing tokens aimed at a real trash row (the other contract), and tiles of 2
    slots so the online softmax crosses tiles, some of them all holes."""
    gen = torch.Generator().manual_seed(rate + 5)
    chunks, starts = _boundary(rate)
    args = _case(32, 8, rate, overlap, chunks, starts, gen, trash=True)
    trash = args[-1].max()
    closes = args[-1] != trash
    out, ref, _ = _run_both(args, block_s=2)
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[trash] = False  # the trash row's content depends on which writer lands last
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=2e-5)
    assert closes.sum() >= 4


def test_compressor_random_rows_and_strides_cpu():
    """Random source rows with holes anywhere (one live slot kept per token), row-strided
    state and pool views, int32 row lists."""
    gen = torch.Generator().manual_seed(7)
    head_dim, rate, M, N = 32, 4, 11, 90
    for overlap in (True, False):
        width = (2 if overlap else 1) * head_dim
        S = (2 if overlap else 1) * rate
        big = torch.randn(N, 2 * width + 5, generator=gen)
        state = big[:, 3 : 3 + 2 * width]
        src = torch.randint(0, N, (M, S), generator=gen, dtype=torch.int32)
        src[torch.rand(M, S, generator=gen) < 0.4] = -1
        live = torch.randint(0, S, (M,), generator=gen)
        src[torch.arange(M), live] = torch.randint(0, N, (M,), generator=gen, dtype=torch.int32)
        pool_big = torch.randn(40, head_dim + 6, generator=gen)
        pool = pool_big[:, 2 : 2 + head_dim]
        out_rows = torch.randperm(40, generator=gen)[:M].int()
        out_rows[3] = -1
        bias = torch.randn(rate, width, generator=gen)
        nw = torch.randn(head_dim, generator=gen)
        cos, sin = rope_cos_sin(torch.randint(0, 5000, (M,), generator=gen), torch.rand(4, generator=gen))
        ref, out = pool.clone(), pool_big.clone()
        compress_windows_ref(state, src, bias, overlap, nw, EPS, cos, sin, ref, out_rows)
        compress_windows_triton(state, src, bias, overlap, nw, EPS, cos, sin, out[:, 2 : 2 + head_dim], out_rows)
        torch.testing.assert_close(out[:, 2 : 2 + head_dim], ref, atol=2e-5, rtol=2e-5)
        assert torch.equal(out[:, :2], pool_big[:, :2]) and torch.equal(out[:, 2 + head_dim :], pool_big[:, 2 + head_dim :])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compressor_half_precision_cpu(dtype):
    gen = torch.Generator().manual_seed(13)
    chunks, starts = _boundary(4)
    args = _case(64, 16, 4, True, chunks, starts, gen, dtype=dtype)
    out, ref, _ = _run_both(args)
    diff = (out.float() - ref.float()).abs()
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    assert (diff <= 2 * ulp * _pair_mag(ref) + 1e-6).all(), diff.max()
    if dtype == torch.float16:
        assert (diff > 0).float().mean() < 0.02  # same rounding as the GPU: only rare flips


def test_compressor_empty_dispatch_and_shape_checks_cpu():
    gen = torch.Generator().manual_seed(2)
    chunks, starts = _boundary(4)
    args = list(_case(32, 8, 4, True, chunks, starts, gen))
    before = args[8].clone()
    compress_windows_triton(args[0], args[1][:0], *args[2:6], args[6][:0], args[7][:0], args[8], args[9][:0])
    assert torch.equal(args[8], before)
    # On the CPU the dispatch is the reference (the model's CPU parity path).
    ref = before.clone()
    compress_windows_ref(*args[:8], ref, args[9])
    compress_windows(*args)
    assert torch.equal(args[8], ref)
    with pytest.raises(ValueError):
        compress_windows_triton(*args[:3], False, *args[4:])  # overlap flag vs the state width
    assert compress_config(512, 8) == (8, 8) and compress_config(128, 128)[0] <= 32


# --------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes, bf16
# --------------------------------------------------------------------------------------------

FLASH = [
    # name, head_dim, rate, overlap (rope dim 64 everywhere)
    ("csa-kv", 512, 4, True),
    ("csa-indexer", 128, 4, True),
    ("hca-kv", 512, 128, False),
]


def _flash_batch(kind: str, rate: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    if kind == "decode-256":  # one token each, a quarter of them closing a window
        starts = [int(x) for x in torch.randint(0, 32768 // rate, (256,), generator=gen) * rate - 1 + (torch.arange(256) % 4 != 0)]
        return [1] * 256, [max(s, 0) for s in starts]
    if kind == "prefill-4k":
        return [4096], [0]
    return [1] * 30 + [700, 3 * rate + 1], [int(x) for x in torch.randint(0, 20000, (30,), generator=gen)] + [rate - 1, 5 * rate]


def _gpu_check(out: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, out_rows: torch.Tensor) -> None:
    written = torch.zeros(before.shape[0], dtype=torch.bool, device=before.device)
    written[out_rows[out_rows >= 0]] = True
    assert torch.equal(out[~written], before[~written])
    o, r = out[written].float(), ref[written].float()
    diff = (o - r).abs()
    assert (diff <= 2 * 2**-7 * _pair_mag(r)).all(), diff.max()  # within two bf16 ulps of the pair
    assert (diff > 0).float().mean() < 0.02  # and rare


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
@pytest.mark.parametrize("kind", ["decode-256", "prefill-4k", "mixed"])
@pytest.mark.parametrize("name,head_dim,rate,overlap", FLASH)
def test_compressor_flash_shapes_gpu(name, head_dim, rate, overlap, kind):
    gen = torch.Generator().manual_seed(head_dim + rate + len(kind))
    chunks, starts = _flash_batch(kind, rate, gen)
    args = _case(head_dim, 64, rate, overlap, chunks, starts, gen, device="cuda", dtype=torch.bfloat16,
                 epb=128 // rate)
    *head, pool, out_rows = args
    ref, out = pool.clone(), pool.clone()
    compress_windows_ref(*head, ref, out_rows)
    compress_windows(*head, out, out_rows)  # the dispatch: Triton on CUDA
    torch.cuda.synchronize()
    _gpu_check(out, ref, pool, out_rows)


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
@pytest.mark.parametrize("name,head_dim,rate,overlap", FLASH)
def test_compressor_cuda_graph_replay_gpu(name, head_dim, rate, overlap):
    """Captured once with static buffers; new state contents, source rows, rope tables and
    out rows (closing and non-closing tokens change) written in place replay right."""
    gen = torch.Generator().manual_seed(rate * 3 + head_dim)
    chunks, starts = _flash_batch("mixed", rate, gen)
    args = _case(head_dim, 64, rate, overlap, chunks, starts, gen, device="cuda", dtype=torch.bfloat16,
                 epb=128 // rate, max_entries=25000 // rate)
    state, src, bias, ov, nw, eps, cos, sin, pool, out_rows = args
    compress_windows(*args)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        compress_windows(*args)
    for step in range(3):
        starts = [int(x) for x in torch.randint(0, 20000, (len(chunks),), generator=gen)]
        new = _case(head_dim, 64, rate, overlap, chunks, starts, gen, device="cuda", dtype=torch.bfloat16,
                    epb=128 // rate, max_entries=25000 // rate)
        for dst, src_ in zip((state, src, cos, sin, out_rows), (new[0], new[1], new[6], new[7], new[9])):
            dst.copy_(src_)  # same static shapes: new contents in the captured buffers
        before = pool.clone()
        ref = pool.clone()
        compress_windows_ref(state, src, bias, ov, nw, eps, cos, sin, ref, out_rows)
        g.replay()
        torch.cuda.synchronize()
        _gpu_check(pool, ref, before, out_rows)
