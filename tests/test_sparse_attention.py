"""Sparse MQA attention with sink: Triton kernel vs the plain-PyTorch reference.

CPU tests run the kernel under TRITON_INTERPRET=1 on small shapes (fp32, so the only
differences are summation order: ~1e-6). GPU tests run real V4-Flash / V4-Pro shapes in
bf16 against the fp32 reference on the same (upcast) inputs: the kernel rounds P to bf16
for the PV product and the output to bf16 (2^-9 relative), so the relative Frobenius error
sits near 3e-3; 1e-2 leaves room without hiding a wrong row or a lost sink (those give O(1)).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as in conftest.py: the interpreter only where there is no GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU runs)

from sparseserve.kernels.attention import (
    AttnConfig,
    attention_config,
    sparse_mqa_attention,
    sparse_mqa_attention_ref,
    sparse_mqa_attention_triton,
)
from sparseserve.kernels.attention import hopper_common as hopper_mod
from sparseserve.kernels.attention import select as select_mod
from sparseserve.kernels.attention import triton_kernel as triton_mod
from sparseserve.kv_format import KVFormat


def T16(block_n: int, warps: int, stages: int, splits: int = 1, band: bool = False) -> AttnConfig:
    """A config of the portable Triton kernel with 16-head programs."""
    return AttnConfig("triton", 16, block_n, warps, stages, splits, band_prepass=band)


def HOP(splits: int = 1, max_programs: int = 0) -> AttnConfig:
    """A config of the Hopper kernel."""
    return AttnConfig("hopper", 64, 64, 4, 2, splits, band_prepass=True, max_programs=max_programs)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# CPU tests feed CPU tensors to the kernels: they need the interpreter.
cpu_interp = pytest.mark.skipif(not _INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _make_rows(num_tokens: int, num_rows: int, pool: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Ragged row lists: each token keeps a random number of valid rows, holes (-1) land
    anywhere, rows include the pool's first and last row, one token has no rows at all."""
    rows = torch.randint(0, pool, (num_tokens, num_rows), generator=gen, dtype=torch.int32)
    keep = torch.randint(0, num_rows + 1, (num_tokens, 1), generator=gen)
    pos = torch.arange(num_rows).unsqueeze(0)
    rows[pos >= keep] = -1  # ragged tail
    rows[torch.rand(num_tokens, num_rows, generator=gen) < 0.2] = -1  # holes anywhere
    rows[0, :] = -1  # all holes: output must be exactly 0
    if num_tokens > 1:
        rows[1, 0], rows[1, -1] = 0, pool - 1  # pool boundaries, first/last slot
    if num_tokens > 2:
        rows[2, :] = torch.randint(0, pool, (num_rows,), generator=gen, dtype=torch.int32)  # full list
    return rows.to(device)


CPU_CASES = [
    # (T, H, D, L, config): L around tile boundaries (16/32/64), splits that leave empty splits
    (5, 4, 32, 40, None),
    (4, 16, 64, 64, None),
    (3, 16, 32, 65, T16(16, 4, 2)),
    (4, 4, 64, 130, T16(32, 4, 2, 3)),
    (3, 16, 64, 33, T16(16, 4, 2, 4)),  # 4 splits of 16 rows over 33: one split empty
    (2, 16, 32, 70, T16(16, 4, 2, 16)),  # 16 splits of 16 rows over 70: eleven empty
    (2, 32, 32, 48, AttnConfig("triton", 16, 16, 4, 2, 2)),  # two head blocks
    (3, 16, 64, 33, T16(16, 4, 2, 4, band=True)),  # bands from the pre-pass, an empty split
    (3, 4, 32, 70, T16(32, 4, 2, 2, band=True)),  # pre-pass with row splits
    (3, 64, 32, 70, AttnConfig("triton", 64, 32, 4, 2, 1, band_prepass=True)),  # 64-head programs
]


@cpu_interp
@pytest.mark.parametrize("T,H,D,L,cfg", CPU_CASES)
def test_attention_matches_reference_cpu(T, H, D, L, cfg):
    gen = torch.Generator().manual_seed(1000 + T * H + D + L)
    pool = 3 * L + 7
    q = torch.randn(T, H, D, generator=gen)
    kv = torch.randn(pool, D, generator=gen)
    rows = _make_rows(T, L, pool, gen)
    sinks = torch.randn(H, generator=gen) * 2
    scale = D**-0.5
    out = sparse_mqa_attention_triton(q, kv, rows, sinks, scale, cfg)
    ref = sparse_mqa_attention_ref(q, kv, rows, sinks, scale)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    assert out[0].abs().max().item() == 0.0  # no rows: sink only, output 0


@cpu_interp
def test_attention_extreme_logits_and_sinks_cpu():
    """Logits far above and far below the sink: the online max must not overflow or NaN."""
    gen = torch.Generator().manual_seed(7)
    T, H, D, L, pool = 4, 16, 32, 48, 100
    q = torch.randn(T, H, D, generator=gen) * 8
    kv = torch.randn(pool, D, generator=gen)
    rows = _make_rows(T, L, pool, gen)
    sinks = torch.linspace(-60, 60, H)
    for cfg in (T16(16, 4, 2), T16(16, 4, 2, 3)):
        out = sparse_mqa_attention_triton(q, kv, rows, sinks, 1.0, cfg)
        ref = sparse_mqa_attention_ref(q, kv, rows, sinks, 1.0)
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-5


@cpu_interp
@pytest.mark.parametrize("cfg", [None, T16(16, 4, 2), T16(16, 4, 2, 4), T16(16, 4, 2, 3), T16(16, 4, 2, 1, band=True),
                                 T16(16, 4, 2, 4, band=True)])
def test_attention_bands_of_valid_rows_cpu(cfg):
    """Lists shaped like the model's: holes before a sequence's first window row and after its
    last entry. The kernel streams only the tiles between the first and last valid row, so the
    band edges sit on, just before and just after tile (16) and split boundaries; a token whose
    band is empty gives 0, and holes inside the band still count as holes."""
    gen = torch.Generator().manual_seed(21)
    L, H, D, pool = 70, 16, 32, 200
    bands = [(0, 0), (0, 70), (15, 16), (16, 17), (17, 33), (31, 64), (33, 34), (47, 70), (69, 70), (5, 60)]
    rows = torch.randint(0, pool, (len(bands), L), generator=gen, dtype=torch.int32)
    for t, (a, b) in enumerate(bands):
        rows[t, :a] = -1
        rows[t, b:] = -1
    rows[9, 20:30] = -1  # a hole run inside a band
    q = torch.randn(len(bands), H, D, generator=gen)
    kv = torch.randn(pool, D, generator=gen)
    sinks = torch.randn(H, generator=gen)
    out = sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg)
    ref = sparse_mqa_attention_ref(q, kv, rows, sinks, D**-0.5)
    assert _rel(out, ref) < 1e-5
    assert out[0].abs().max().item() == 0.0


@cpu_interp
def test_attention_strided_inputs_cpu():
    """q as a slice of a wider tensor and a pool view with a row stride > D."""
    gen = torch.Generator().manual_seed(11)
    T, H, D, L, pool = 3, 4, 32, 20, 50
    q_wide = torch.randn(T, H + 2, D, generator=gen)
    q = q_wide[:, 1 : H + 1]
    kv_wide = torch.randn(pool, D + 16, generator=gen)
    kv = kv_wide[:, :D]
    rows = _make_rows(T, L, pool, gen)
    sinks = torch.randn(H, generator=gen)
    out = sparse_mqa_attention_triton(q, kv, rows, sinks, 0.2)
    ref = sparse_mqa_attention_ref(q, kv, rows, sinks, 0.2)
    assert _rel(out, ref) < 1e-5


# The selection table, cell by cell: (model heads, batch or prefill tokens, row-list width) on an H200 (132 SMs).
# Row widths: CSA = window 128 + top-k (Flash 512, Pro 1024); HCA = 128 + max_model_len / 128 (4K, 32K, 128K).
FLASH, PRO = 64, 128
CSA_FLASH, CSA_PRO, HCA_4K, HCA_32K, HCA_128K = 640, 1152, 160, 384, 1152
SELECTION_CELLS = [
    # heads, tokens, rows  -> kernel, heads per program, splits, band pre-pass launched
    (FLASH, 1, CSA_FLASH, "triton", 16, 8, False),
    (FLASH, 1, HCA_4K, "triton", 16, 2, False),
    (FLASH, 1, HCA_128K, "triton", 16, 8, False),
    (FLASH, 4, CSA_FLASH, "triton", 16, 8, False),
    (FLASH, 8, CSA_FLASH, "hopper", 64, 16, False),  # 16 one-tile splits (40 rows each)
    (FLASH, 8, HCA_4K, "hopper", 64, 4, False),
    (FLASH, 8, HCA_32K, "hopper", 64, 8, False),
    (FLASH, 8, HCA_128K, "hopper", 64, 16, True),  # 72 rows per split: two tiles, a band
    (FLASH, 16, CSA_FLASH, "hopper", 64, 8, True),
    (FLASH, 64, CSA_FLASH, "hopper", 64, 2, True),
    (FLASH, 64, HCA_128K, "hopper", 64, 2, True),
    (FLASH, 32, HCA_4K, "hopper", 64, 4, False),  # one-tile splits of a short list
    (FLASH, 64, HCA_4K, "hopper", 64, 1, True),  # a short list is not cut into 2 + 1 tiles
    (PRO, 32, HCA_4K, "hopper", 64, 1, True),
    (FLASH, 256, CSA_FLASH, "hopper", 64, 1, True),
    (FLASH, 256, HCA_4K, "hopper", 64, 1, True),
    (FLASH, 4096, CSA_FLASH, "hopper", 64, 1, True),  # prefill
    (FLASH, 4096, HCA_32K, "hopper", 64, 1, True),
    (PRO, 1, CSA_PRO, "triton", 16, 8, False),
    (PRO, 2, HCA_4K, "triton", 16, 2, False),
    (PRO, 4, CSA_PRO, "hopper", 64, 16, True),
    (PRO, 8, CSA_PRO, "hopper", 64, 8, True),
    (PRO, 8, HCA_4K, "hopper", 64, 4, False),
    (PRO, 33, HCA_128K, "hopper", 64, 2, True),
    (PRO, 64, CSA_PRO, "hopper", 64, 1, True),
    (PRO, 256, HCA_4K, "hopper", 64, 1, True),
    (PRO, 4096, CSA_PRO, "hopper", 64, 1, True),
]


@pytest.mark.parametrize("heads,tokens,rows,kernel,block_h,splits,band", SELECTION_CELLS)
def test_selection_table_cell(heads, tokens, rows, kernel, block_h, splits, band):
    cfg = attention_config(tokens, heads, rows, 512, 132, hopper=True)
    launched_band = select_mod.needs_band_prepass(cfg, select_mod.split_length(rows, cfg))
    assert (cfg.kernel, cfg.block_h, cfg.num_splits, launched_band) == (kernel, block_h, splits, band)
    if cfg.kernel == "hopper":
        assert cfg.block_n == 64
        assert cfg.num_splits == 1 or tokens * heads // 64 * cfg.num_splits <= 132  # splits stay within one wave
    assert attention_config(tokens, heads, rows, 512, 132, hopper=True) == cfg  # static: same shapes, same config


@pytest.mark.parametrize("tokens,heads,rows,head_dim,expect", [
    (4096, 64, 640, 512, AttnConfig("triton", 64, 64, 8, 2, band_prepass=True)),  # >= 8 programs per SM
    (256, 64, 640, 512, AttnConfig("triton", 64, 32, 8, 3, band_prepass=True)),
    (256, 64, 640, 128, AttnConfig("triton", 64, 64, 4, 2, band_prepass=True)),
    (8, 64, 640, 512, AttnConfig("triton", 16, 64, 4, 2, 8)),
    (3, 4, 40, 64, AttnConfig("triton", 16, 64, 4, 2, 1)),  # few rows: no split
])
def test_selection_without_the_hopper_kernel(tokens, heads, rows, head_dim, expect):
    """Off Hopper (or with the Hopper kernel turned off) the Triton rows of the table."""
    assert attention_config(tokens, heads, rows, head_dim, 132, hopper=False) == expect


@pytest.mark.parametrize("tokens,heads,rows,expect", [
    (64, 64, 640, AttnConfig("triton", 64, 64, 8, 2, 2, band_prepass=True)),  # 64 programs: 2 splits fill a wave
    (256, 64, 1152, AttnConfig("triton", 64, 64, 8, 2, 1, band_prepass=True)),
    (1, 64, 640, AttnConfig("triton", 64, 64, 8, 2, 8, band_prepass=True)),  # >= 64 rows per split
    (1, 64, 100, AttnConfig("triton", 64, 64, 8, 2, 1, band_prepass=True)),
    (4, 16, 640, AttnConfig("triton", 16, 32, 4, 2, 8)),
])
def test_selection_for_fp8_rows(tokens, heads, rows, expect):
    """Packed FP8 rows take rows F1/F2 of the table (the Hopper kernel never), whatever `hopper` says; the engine's
    config for a uint8 pool is that one."""
    for hopper in (True, False):
        assert attention_config(tokens, heads, rows, 512, 132, hopper=hopper, fp8=True) == expect
    q = torch.zeros(tokens, heads, 512)
    pool = torch.zeros(4, KVFormat(512, 64).row_bytes, dtype=torch.uint8)
    assert triton_mod.engine_attention_config(q, pool, rows) == attention_config(
        tokens, heads, rows, 512, triton_mod.num_sms(q.device), fp8=True)


def test_hopper_needs_its_shapes():
    assert attention_config(64, 16, 640, 512, 132, hopper=True).kernel == "triton"  # 16 heads
    assert attention_config(64, 64, 640, 128, 132, hopper=True).kernel == "triton"  # D = 128
    assert attention_config(4, 64, 640, 512, 132, hopper=True) == attention_config(4, 64, 640, 512, 132)


def test_hopper_kernel_takes_only_rows_cp_async_can_read():
    """16-byte cp.async needs aligned rows: other views (an odd column offset, a row stride that is not a
    multiple of 16 elements) go to the Triton kernel instead of failing to compile."""
    cp_async_aligned = hopper_mod.cp_async_aligned
    base = torch.zeros(4, 64, 512 + 16, dtype=torch.bfloat16)
    assert cp_async_aligned(base[..., :512])
    assert not cp_async_aligned(base[..., 1:513])  # 2-byte offset
    assert not cp_async_aligned(torch.zeros(4, 64, 520, dtype=torch.bfloat16)[..., :512])  # head stride 520
    assert not cp_async_aligned(base.transpose(1, 2)[:, :64])
    assert cp_async_aligned(torch.zeros(1, 64, 512, dtype=torch.bfloat16)[:, :, :])


def test_hopper_output_store_by_tma_only_where_its_descriptor_fits():
    """The TMA store writes what a unit stores: out with one split, the 16-bit partial outputs with splits, each
    viewed as [rows, 512]; it needs that tensor contiguous and 16-bit (strided views store from registers, with out
    passed as an unread placeholder)."""
    if not hopper_mod.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    out = torch.zeros(3, 128, 512, dtype=torch.bfloat16)
    parts = torch.zeros(3, 4, 128, 512, dtype=torch.bfloat16)
    desc, use_tma = hopper_mod.out_descriptor(out, parts, 1)
    assert use_tma and list(desc.shape) == [3 * 128, 512] and list(desc.block_shape) == [64, 64]
    desc, use_tma = hopper_mod.out_descriptor(out, parts, 4)
    assert use_tma and list(desc.shape) == [3 * 4 * 128, 512]
    assert hopper_mod.out_descriptor(out, parts.float(), 4)[1] is False
    strided = torch.zeros(3, 128, 640, dtype=torch.bfloat16)[..., :512]
    assert hopper_mod.out_descriptor(strided, parts, 1)[1] is False
    assert hopper_mod.q_descriptor(strided)[1] is False and hopper_mod.q_descriptor(out)[1] is True


def test_band_prepass_skipped_only_for_one_tile_hopper_splits():
    """The Hopper kernel's one-tile splits read their own segments (the pre-pass and its graph node are saved);
    longer splits and the Triton kernel keep the pre-pass where their config asks for it."""
    one_tile = HOP(16)
    assert select_mod.split_length(640, one_tile) == 64 and select_mod.split_length(1152, one_tile) == 128
    assert not select_mod.needs_band_prepass(one_tile, 64)
    assert select_mod.needs_band_prepass(one_tile, 128)
    assert select_mod.needs_band_prepass(AttnConfig("triton", 64, 64, 8, 2, 4, band_prepass=True), 64)
    assert not select_mod.needs_band_prepass(T16(64, 4, 2, 4), 64)


def test_hopper_config_off_hopper_is_a_clear_error():
    q, kv = torch.randn(2, 64, 512), torch.randn(10, 512)
    rows = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="Hopper kernel"):
        sparse_mqa_attention_triton(q, kv, rows, torch.zeros(64), 0.1, HOP())
    with pytest.raises(ValueError, match="kernel must be"):
        sparse_mqa_attention_triton(q, kv, rows, torch.zeros(64), 0.1, AttnConfig("gluon", 16, 64, 4, 2))


def test_dispatch_uses_reference_on_cpu():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=gen)
    kv = torch.randn(10, 16, generator=gen)
    rows = torch.tensor([[0, 3, -1], [9, -1, 2]], dtype=torch.int32)
    sinks = torch.zeros(4)
    assert torch.equal(sparse_mqa_attention(q, kv, rows, sinks, 0.25), sparse_mqa_attention_ref(q, kv, rows, sinks, 0.25))


@cpu_interp
@pytest.mark.parametrize("cfg", [T16(16, 4, 2, 3), T16(16, 4, 2)])  # split (rope in the merge), unsplit
def test_attention_writes_into_a_given_buffer_cpu(cfg):
    """`out=` (a prefill graph's static buffer, sliced to the real tokens): the kernels and the reference
    write it and return it, with the values they would return; a wrong buffer is refused."""
    gen = torch.Generator().manual_seed(13)
    T, H, D, L = 5, 16, 32, 40
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    kv = torch.randn(3 * L, D, generator=gen).bfloat16()
    rows = _make_rows(T, L, 3 * L, gen)
    sinks = torch.randn(H, generator=gen)
    cos, sin = _rope_tables(T, 8, gen)
    want = sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg, inverse_rope=(cos, sin))
    buffer = torch.full((T + 3, H, D), 7.0, dtype=q.dtype)
    got = sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg, inverse_rope=(cos, sin), out=buffer[:T])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, want) and (buffer[T:] == 7.0).all()
    ref_buffer = torch.zeros(T, H, D)
    ref = sparse_mqa_attention(q.float(), kv.float(), rows, sinks, D**-0.5, inverse_rope=(cos, sin), out=ref_buffer)
    assert ref is ref_buffer and torch.equal(ref, sparse_mqa_attention(q.float(), kv.float(), rows, sinks, D**-0.5,
                                                                       inverse_rope=(cos, sin)))
    with pytest.raises(ValueError, match="attention out"):
        sparse_mqa_attention(q.float(), kv.float(), rows, sinks, D**-0.5, out=torch.zeros(T, H, D + 1))


# ---------------------------------------------------------------- GPU, real shapes
def _gpu_case(T: int, H: int, L: int, window: int, pool: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    D = 512
    q = torch.randn(T, H, D, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(pool, D, device="cuda", generator=gen).bfloat16()
    # window rows first (some -1 for young sequences), then compressed rows with holes.
    rows = torch.randint(0, pool, (T, L), device="cuda", generator=gen, dtype=torch.int32)
    young = torch.rand(T, 1, device="cuda", generator=gen) < 0.3
    rows[:, :window] = torch.where(young & (torch.arange(window, device="cuda") < window // 2), -1, rows[:, :window])
    rows[torch.rand(T, L, device="cuda", generator=gen) < 0.1] = -1
    rows[0] = -1
    sinks = torch.randn(H, device="cuda", generator=gen)
    return q, kv, rows, sinks, D**-0.5


def _rope_tables(num_tokens: int, half: int, gen: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of random angles (not a rope schedule: any angle must rotate the right pairs)."""
    angle = torch.rand(num_tokens, half, generator=gen) * 12.0 - 6.0
    return angle.cos().to(device), angle.sin().to(device)


@cpu_interp
@pytest.mark.parametrize("T,H,D,L,half,cfg", [
    (4, 16, 64, 70, 8, T16(16, 4, 2, 3)),  # fused in the merge (row splits)
    (3, 32, 64, 50, 16, AttnConfig("triton", 16, 16, 4, 2, 2)),  # fused, two head blocks
    (4, 16, 32, 70, 8, T16(16, 4, 2)),  # no split: the rope kernel's path after it
])
def test_attention_inverse_rope_matches_separate_rotation_cpu(T, H, D, L, half, cfg):
    """The output's rope channels rotated back inside the launches equal the attention output
    rotated by `apply_rope(..., inverse=True)` afterwards, in bf16 (the engine's dtype): the same
    rounding (the output first, then the rotated channels), so equal up to fp32 contraction
    (<= 1 bf16 ulp on the rotated channels); the other channels bit for bit."""
    from sparseserve.kernels.rope import apply_rope_ref

    gen = torch.Generator().manual_seed(77 + T * D + half)
    pool = 3 * L + 7
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    kv = torch.randn(pool, D, generator=gen).bfloat16()
    rows = _make_rows(T, L, pool, gen)
    sinks = torch.randn(H, generator=gen) * 2
    cos, sin = _rope_tables(T, half, gen)
    plain = sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg)
    fused = sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg, inverse_rope=(cos, sin))
    expect = apply_rope_ref(plain, cos, sin, inverse=True)
    assert torch.equal(fused[..., :-2 * half], plain[..., :-2 * half])
    diff = (fused[..., -2 * half:].float() - expect[..., -2 * half:].float()).abs()
    ulp = expect[..., -2 * half:].float().abs().clamp_min(1e-30) * 2.0**-7
    assert (diff <= ulp).all()
    assert not torch.equal(fused, plain)  # the rotation happened
    # the reference dispatch (CPU) rotates as well
    ref = sparse_mqa_attention(q.float(), kv.float(), rows, sinks, D**-0.5, inverse_rope=(cos, sin))
    base = sparse_mqa_attention_ref(q.float(), kv.float(), rows, sinks, D**-0.5)
    assert torch.allclose(ref, apply_rope_ref(base, cos, sin, inverse=True))


@cpu_interp
@pytest.mark.parametrize("half", [8, 16])
def test_merge_in_column_chunks_matches_one_chunk_cpu(monkeypatch, half):
    """The merge takes a head's columns in chunks (grid axis 2): every output element, the inverse-rotated
    pairs included (8 pairs: the last chunk; 16: across the last two), comes out bit for bit as from one
    program per head block, since each element sees the same operations in the same order."""
    gen = torch.Generator().manual_seed(500 + half)
    T, H, D, L = 3, 16, 64, 70
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    kv = torch.randn(3 * L + 7, D, generator=gen).bfloat16()
    rows = _make_rows(T, L, 3 * L + 7, gen)
    sinks = torch.randn(H, generator=gen) * 2
    cos, sin = _rope_tables(T, half, gen)
    cfg = T16(16, 4, 2, 4)
    outs = []
    for cols in (64, 16):
        monkeypatch.setattr(triton_mod, "MERGE_COLS", cols)
        outs.append(sparse_mqa_attention_triton(q, kv, rows, sinks, D**-0.5, cfg, inverse_rope=(cos, sin)))
    assert torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[1].float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
def test_attention_inverse_rope_real_shapes_gpu():
    """V4 shapes (head_dim 512, rope 64): the fused rotation (split configs) and the rope kernel after
    the direct config both match attention then `apply_rope(..., inverse=True)`."""
    from sparseserve.kernels.rope import apply_rope

    for T, H, L in ((1, 64, 128 + 512), (8, 64, 128 + 1024), (4, 128, 130)):
        q, kv, rows, sinks, scale = _gpu_case(T, H, L, 128, 50_000, seed=T + L)
        gen = torch.Generator().manual_seed(T * 3 + H)
        cos, sin = _rope_tables(T, 32, gen, "cuda")
        for cfg in (None, AttnConfig("triton", 64, 32, 8, 3, 1), T16(32, 4, 3, 4), AttnConfig("triton", 64, 16, 4, 3, 2)):
            plain = sparse_mqa_attention_triton(q, kv, rows, sinks, scale, cfg)
            fused = sparse_mqa_attention_triton(q, kv, rows, sinks, scale, cfg, inverse_rope=(cos, sin))
            expect = apply_rope(plain.clone(), cos, sin, inverse=True)
            torch.cuda.synchronize()
            assert torch.equal(fused[..., :-64], plain[..., :-64]), (T, H, cfg)
            diff = (fused.float() - expect.float()).abs()
            assert (diff <= expect.float().abs() * 2.0**-7 + 1e-30).all(), (T, H, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
@pytest.mark.parametrize(
    "name,T,H,L",
    [
        ("flash-csa-decode", 8, 64, 128 + 512),
        ("flash-csa-prefill", 300, 64, 128 + 512),
        ("flash-hca-decode-128k", 64, 64, 128 + 1024),
        ("pro-csa-decode", 4, 128, 128 + 1024),
        ("pro-csa-prefill", 200, 128, 128 + 1024),
        ("pro-hca-decode-4k", 256, 128, 128 + 32),
    ],
)
def test_attention_real_shapes_gpu(name, T, H, L):
    q, kv, rows, sinks, scale = _gpu_case(T, H, L, 128, 50_000, seed=T * 7 + L)
    ref = sparse_mqa_attention_ref(q.float(), kv.float(), rows, sinks, scale)
    out = sparse_mqa_attention(q, kv, rows, sinks, scale)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert out[0].abs().max().item() == 0.0
    assert _rel(out, ref) < 1e-2, name
    # every config path (direct, split) computes the same function
    for cfg in (AttnConfig("triton", 64, 32, 8, 3, 1), T16(32, 4, 3, 4), AttnConfig("triton", 32, 32, 4, 3, 2),
                AttnConfig("triton", 64, 16, 4, 3, 2), *(HOPPER_CONFIGS if _hopper() else ())):
        out2 = sparse_mqa_attention_triton(q, kv, rows, sinks, scale, cfg)
        assert _rel(out2, ref) < 1e-2, (name, cfg)
        assert out2[0].abs().max().item() == 0.0, (name, cfg)


# The Hopper kernel: one program walking every unit, a few, one per SM, one per unit; row splits (merged by the
# Triton merge kernel) including more splits than some tokens have tiles, and splits of exactly one tile (no band
# pre-pass: all-holes splits found from their row ids).
HOPPER_CONFIGS = (HOP(), HOP(1, max_programs=1), HOP(4, max_programs=7), HOP(2, max_programs=1 << 20), HOP(16),
                  HOP(16, max_programs=3), HOP(8))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET or not _hopper(), reason="the Hopper kernel needs a Hopper GPU")
def test_hopper_kernel_boundaries_gpu():
    """Row lists whose valid band ends exactly on, one before and one after a tile edge; the first
    and last pool rows; extreme sinks (two that dominate, one that vanishes); fp16 as well."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float16):
        for L in (63, 64, 65, 127, 128, 129, 640):
            T, H, pool = 6, 128, 9000
            q = (torch.randn(T, H, 512, generator=gen) * 2).to("cuda", dtype)
            kv = torch.randn(pool, 512, generator=gen).to("cuda", dtype)
            rows = torch.randint(0, pool, (T, L), generator=gen, dtype=torch.int32)
            rows[0] = -1
            rows[1, 0], rows[1, -1] = 0, pool - 1
            rows[2, : L // 2] = -1  # leading holes: the band starts mid-list
            rows[3, L - 1] = -1
            rows = rows.cuda()
            sinks = torch.randn(H, generator=gen) * 3
            # 200: the sink outweighs every logit of that head by far more than fp32's exponent range, so a split's
            # row sum underflows to 0 (its partial must not be 0/0).
            sinks[0], sinks[1], sinks[2] = 40.0, -40.0, 200.0
            sinks = sinks.cuda()
            ref = sparse_mqa_attention_ref(q.float(), kv.float(), rows, sinks, 512 ** -0.5)
            for cfg in HOPPER_CONFIGS:
                out = sparse_mqa_attention_triton(q, kv, rows, sinks, 512 ** -0.5, cfg)
                torch.cuda.synchronize()
                assert out.dtype == dtype and out[0].abs().max().item() == 0.0, (L, cfg)
                assert _rel(out, ref.to(dtype)) < 1e-2, (dtype, L, cfg)
            # q as a strided view (every other head of a wider tensor): loaded by cp.async where a contiguous q goes
            # by TMA
            q_view = torch.stack([q, torch.randn_like(q)], 2).flatten(1, 2)[:, ::2]
            for cfg in HOPPER_CONFIGS:
                out = sparse_mqa_attention_triton(q_view, kv, rows, sinks, 512 ** -0.5, cfg)
                assert out[0].abs().max().item() == 0.0 and _rel(out, ref.to(dtype)) < 1e-2, (dtype, L, cfg, "strided")


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
def test_attention_cuda_graph_replay_gpu():
    """Captured once, replayed with new rows/q written in place: no host sync, no stale state."""
    T, H, L = 8, 64, 640
    q, kv, rows, sinks, scale = _gpu_case(T, H, L, 128, 20_000, seed=5)
    sparse_mqa_attention(q, kv, rows, sinks, scale)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sparse_mqa_attention(q, kv, rows, sinks, scale)
    for seed in (1, 2):
        q2, _, rows2, _, _ = _gpu_case(T, H, L, 128, 20_000, seed=100 + seed)
        q.copy_(q2)
        rows.copy_(rows2)
        g.replay()
        torch.cuda.synchronize()
        ref = sparse_mqa_attention_ref(q.float(), kv.float(), rows, sinks, scale)
        assert _rel(out, ref) < 1e-2


@cpu_interp
@pytest.mark.parametrize("normalised", [False, True])
def test_merge_skips_a_split_marked_empty_cpu(normalised):
    """The Hopper kernel marks an empty row split with max -inf and sum 0 and leaves its output unwritten
    (garbage, here NaN): the merge must give it weight 0 without reading it. A raw accumulator weighs
    exp2(max - M); a normalised partial output (the Hopper kernel's) its share of the softmax denominator,
    exp2(max - M) * sum."""
    from sparseserve.kernels.attention.triton_kernel import _sparse_mqa_merge_kernel

    gen = torch.Generator().manual_seed(21)
    T, S, H, D = 2, 3, 4, 16
    part_acc = torch.randn(T, S, H, D, generator=gen)
    part_ml = torch.stack([torch.randn(T, S, H, generator=gen), torch.rand(T, S, H, generator=gen) + 0.5], dim=2)
    part_acc[0, 2] = float("nan")
    part_ml[0, 2, 0], part_ml[0, 2, 1] = float("-inf"), 0.0
    out = torch.empty(T, H, D)
    _sparse_mqa_merge_kernel[(T, H // 4)](part_acc, part_ml, out, out, out, H, D, out.stride(0), out.stride(1), -1.0,
                                          NUM_SPLITS=S, BLOCK_H=4, BLOCK_D=D, ROPE_HALF=0,
                                          PARTS_NORMALISED=normalised, PDL=0)
    m, l = part_ml[:, :, 0], part_ml[:, :, 1]
    w = torch.exp2(m - m.amax(dim=1, keepdim=True))  # [T, S, H]
    acc = torch.where(w.unsqueeze(-1) > 0, part_acc, 0.0)
    weight = w * l if normalised else w
    expect = (acc * weight.unsqueeze(-1)).sum(1) / (l * w).sum(1).unsqueeze(-1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
