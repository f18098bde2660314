"""The one-dot FP4 form of the routed-expert kernels (kernels/quant/fp4_one_dot.py: a group's four sub-scales
folded into one, exponent-shifted e4m3 codes, one K = 128 fp8 dot): the shift tables against torch's e4m3 cast
for every byte and shift (elements of different shifts side by side, so the compiled lookup cannot lean on
Triton's packing); a group's codes and scale against reference.fp4_one_dot_operands, bit for bit, at the exact
bound and for ragged K and fp32 scales; the load-time exactness check (formats.fp4_one_dot_exact) on crafted
scales, at and past the boundary; the full experts against fused_moe_quant_ref through the decode and prefill
paths; a weight past the bound taking the four-dot form; the launches independent of the routing; the table and
its variants; on a GPU, V4-Flash expert shapes with graph replay.

CPU runs use the Triton interpreter (conftest.py sets TRITON_INTERPRET=1): the dots run in fp32 on the codes'
values, the shift-table lookup as plain Triton ops (the compiled form's inline PTX runs on the GPU tests)."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from sparseserve.kernels.quant import moe_quant, select
from sparseserve.kernels.quant import reference as ref
from sparseserve.kernels.quant.formats import ONE_DOT_MAX_SHIFT, QuantFormatError, QuantWeight, fp4_one_dot_exact
from sparseserve.kernels.quant.moe_quant import HAS_TRITON, fused_moe_quant_triton
from sparseserve.kernels.quant.select import DOT_FP32, MoeQuantConfig, moe_quant_config, moe_quant_variants
from quant_checks import (assert_moe_close, expert_routing, launches_match_across_routings, record_expert_launches,
                          scaled_rows)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not HAS_TRITON or not (CUDA or INTERPRET),
                                   reason="runs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on the CPU)")
ONE_DOT = {"fp4_scaled_dot": False, "fp4_fp8_mma": True, "fp4_one_dot": True}
ASM_FORMS = [False, True] if CUDA else [False]  # the compiled lookup (inline PTX) runs on the GPU only


def e8m0(exps: torch.Tensor) -> torch.Tensor:
    return exps.to(torch.uint8).view(torch.float8_e8m0fnu)


def spanned_fp4(gen: torch.Generator, shape: tuple[int, ...], lo: int, hi: int, span: int = ONE_DOT_MAX_SHIFT,
                fp32: bool = False) -> QuantWeight:
    """Random e2m1 bytes (every code) with scales spread over [lo, hi + span] binades, each 128-column group's
    four within `span` of each other: a base per (row, group) in [lo, hi], plus 0 .. span per sub-group, one
    sub-group of every group at +span where the group has four (so the bound is reached everywhere)."""
    *lead, n, k = shape
    k32, groups = k // 32, -(-k // 128)
    dev = gen.device
    data = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    base = torch.randint(lo, hi + 1, (*lead, n, groups), generator=gen, device=dev).repeat_interleave(4, -1)
    offset = torch.randint(0, span + 1, (*lead, n, k32), generator=gen, device=dev)
    offset[..., 0 : 4 * (k32 // 4) : 4] = 0
    offset[..., 1 : 4 * (k32 // 4) : 4] = span
    exps = base[..., :k32] + offset
    scale = torch.ldexp(torch.ones(exps.shape, device=dev), exps - 127) if fp32 else e8m0(exps)
    return QuantWeight(data.to(DEVICE), scale.to(DEVICE), "fp4")


# ------------------------------------------------------------------ the load-time check


def _crafted(exps: list[list[int]], codes: list[list[int]] | None = None, fp32: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of sub-group exponents (K = 32 x len) and each sub-group's byte (all 16 bytes alike; default 0x21:
    codes 1 (0.5) and 2 (1.0))."""
    e = torch.tensor(exps)
    byte = torch.full(e.shape, 0x21) if codes is None else torch.tensor(codes)
    data = byte.repeat_interleave(16, -1).to(torch.uint8)
    return data, (e8m0(e) if fp32 is None else fp32)


def test_exactness_check_at_and_past_the_bound():
    exact = lambda data, scale, **kw: fp4_one_dot_exact(data, scale, **kw)  # noqa: E731
    assert exact(*_crafted([[127, 127 - 14, 127, 127]]))  # d = 14: 0.5 x 2^-8 = 2^-9, the smallest subnormal
    assert not exact(*_crafted([[127, 127 - 15, 127, 127]]))  # d = 15: 2^-10 is not representable
    assert not exact(*_crafted([[127, 127 - 15, 127, 127]], [[0x21, 0x03, 0x21, 0x21]]))  # 1.5 alone too
    # An all-zero sub-group (+0 and -0 codes) is exact at any shift; it still counts for e_max, as in the kernel.
    assert exact(*_crafted([[127, 1, 127, 127]], [[0x21, 0x00, 0x21, 0x21]]))
    assert exact(*_crafted([[127, 1, 127, 127]], [[0x21, 0x88, 0x21, 0x21]]))
    assert not exact(*_crafted([[127 + 20, 127, 127, 127]], [[0x00, 0x21, 0x21, 0x21]]))
    # Groups are 4 sub-groups: spans across groups do not count; a last group of one sub-group is alone.
    assert exact(*_crafted([[100, 100, 110, 114, 200], [127, 127, 127, 127, 3]]))
    assert not exact(*_crafted([[100, 100, 110, 115, 200]]))
    assert not exact(*_crafted([[127, 127, 255, 127]], [[0x21, 0x21, 0x00, 0x21]]))  # e8m0 NaN anywhere
    # fp32 scales: powers of two where a sub-group holds a nonzero code.
    pow2 = torch.tensor([[2.0 ** -3, 2.0 ** -14, 1.0, 0.5]])
    assert exact(*_crafted([[0, 0, 0, 0]], fp32=pow2))
    assert not exact(*_crafted([[0, 0, 0, 0]], fp32=pow2 * 2.0 ** -1 * torch.tensor([[1.0, 1.0, 1.0, 1.5]])))
    assert exact(*_crafted([[0, 0, 0, 0]], [[0x21, 0x21, 0x21, 0x00]], fp32=pow2 * torch.tensor([[1, 1, 1, 0.75]])))
    assert not exact(*_crafted([[0, 0, 0, 0]], fp32=torch.tensor([[1.0, 2.0 ** -15, 1.0, 1.0]])))
    assert not exact(*_crafted([[0, 0, 0, 0]], fp32=torch.tensor([[1.0, -1.0, 1.0, 1.0]])))
    assert not exact(*_crafted([[0, 0, 0, 0]], fp32=torch.tensor([[1.0, 2.0 ** -130, 2.0 ** -126, 2.0 ** -126]])))


def test_exactness_check_on_expert_tensors_in_passes():
    """A leading expert dimension and the pass size change nothing; one bad group anywhere decides the tensor;
    QuantWeight reads it once (fp8_block: False)."""
    gen = torch.Generator().manual_seed(3)
    w = spanned_fp4(gen, (3, 40, 288), 100, 140)
    codes, scale = w.codes.cpu(), w.scale.cpu()
    assert all(fp4_one_dot_exact(codes, scale, rows_per_pass=p) for p in (1, 7, 1 << 16))
    e = scale.view(torch.uint8).clone()
    e[2, 39, 4:8] = torch.tensor([140, 140, 125, 140], dtype=torch.uint8)  # d = 15 in the last row's group 1
    codes[2, 39, 4 * 16:8 * 16] = 0x11
    assert not any(fp4_one_dot_exact(codes, e.view(torch.float8_e8m0fnu), rows_per_pass=p) for p in (1, 7, 1 << 16))
    held = QuantWeight(codes, e.view(torch.float8_e8m0fnu), "fp4")
    assert held.fp4_one_dot_exact is False and "fp4_one_dot_exact" in held.__dict__
    fp8 = ref.quantize_fp8_block(torch.randn(128, 128, generator=gen))
    assert fp8.fp4_one_dot_exact is False


def test_the_one_dot_operands_are_the_weights_values():
    """reference.fp4_one_dot_operands: codes x group scale == the weight at the bound (fp32 and e8m0 scales,
    a partial last group); past it the smallest codes are lost."""
    gen = torch.Generator().manual_seed(4)
    for fp32 in (False, True):
        w = spanned_fp4(gen, (2, 24, 224), 27, 210, fp32=fp32)
        codes, scale = ref.fp4_one_dot_operands(w)
        values = codes.float() * scale.repeat_interleave(128, -1)[..., :224]
        assert torch.equal(values, ref.dequant_weight(w)) and w.fp4_one_dot_exact
    w = spanned_fp4(gen, (24, 256), 100, 110, span=ONE_DOT_MAX_SHIFT + 1)
    codes, scale = ref.fp4_one_dot_operands(w)
    assert not w.fp4_one_dot_exact and not torch.equal(codes.float() * scale.repeat_interleave(128, -1),
                                                       ref.dequant_weight(w))


class _Experts(nn.Module):
    def __init__(self, gu: torch.Tensor, dn: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(gu, requires_grad=False), nn.Parameter(dn, requires_grad=False)


def test_quantize_model_decides_the_form_at_load():
    from sparseserve.config import WeightFormat
    from sparseserve.model.quantize import quantize_model

    gen = torch.Generator().manual_seed(5)
    model = nn.Module()
    model.experts = _Experts(torch.randn(4, 128, 64, generator=gen), torch.randn(4, 64, 64, generator=gen))
    quantize_model(model, "auto", WeightFormat(quant_method="fp8", expert_dtype="fp4"))
    for w in (model.experts.q_gate_up, model.experts.q_down):
        assert w.fmt == "fp4" and w.__dict__["fp4_one_dot_exact"] is True


# ------------------------------------------------------------------ inside a kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from sparseserve.kernels.quant.fp4_one_dot import e2m1_bytes_to_shifted_e4m3, one_dot_weight_group, shift_lut

    @triton.jit
    def _lut_probe_kernel(out_ptr, USE_ASM: tl.constexpr):
        """Element i: byte i // 16 under shift k = (i + 5 (i // 128)) % 16 - 3 -> out[i, 0 / 1] = its even / odd
        e4m3 code. Neighbours and elements 128 apart (which Triton packs into one asm call here) differ in k."""
        i = tl.arange(0, 4096)
        lo_w, hi_w = shift_lut((i + 5 * (i // 128)) % 16 - 3)
        lo, hi = e2m1_bytes_to_shifted_e4m3((i // 16).to(tl.uint8), lo_w, hi_w, USE_ASM)
        tl.store(out_ptr + i * 2, lo)
        tl.store(out_ptr + i * 2 + 1, hi)

    @triton.jit
    def _group_probe_kernel(w_ptr, ws_ptr, codes_ptr, scale_ptr, N, K, stride_wn, stride_wsn, stride_cn,
                            W_E8M0: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
        """Group program_id(0) of 16 weight rows (N of them real) -> its codes (uint8) and scales."""
        g = tl.program_id(0)
        offs_n = tl.arange(0, 16)
        n_ok = offs_n < N
        w, s = one_dot_weight_group(g, w_ptr, ws_ptr, offs_n, n_ok, K, stride_wn, stride_wsn, W_E8M0, EVEN_K,
                                    USE_ASM)
        cols = g * 128 + tl.arange(0, 128)
        tl.store(codes_ptr + offs_n[:, None] * stride_cn + cols[None, :], w.to(tl.uint8, bitcast=True),
                 mask=n_ok[:, None] & (cols[None, :] < K))
        tl.store(scale_ptr + offs_n * tl.num_programs(0) + g, s, mask=n_ok)


@needs_kernels
@pytest.mark.parametrize("use_asm", ASM_FORMS)
def test_shift_tables_give_the_e4m3_codes_of_every_shifted_value(use_asm):
    """Every byte (both nibbles, signs, -0) under every shift k = 12 - d_q of the bound (d_q = 0 .. 14),
    against torch's float8_e4m3fn cast of e2m1 x 2^(k - 6); past the bound (k = -3, only ever read by all-zero
    sub-groups) zeros stay zeros."""
    out = torch.empty(4096, 2, dtype=torch.uint8, device=DEVICE)
    _lut_probe_kernel[(1,)](out, USE_ASM=use_asm)
    out = out.cpu()
    i = torch.arange(4096)
    k = (i + 5 * (i // 128)) % 16 - 3
    assert all(set(k[i // 16 == b].tolist()) == set(range(-3, 13)) for b in (0, 77, 255))  # every shift, every byte
    values = ref.unpack_fp4((i // 16).to(torch.uint8)[:, None])  # [4096, 2]: the low nibble first
    want = (values * torch.exp2((k - 6).float())[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out[k >= -2], want[k >= -2])
    zeros = values[k == -3] == 0
    assert torch.equal(out[k == -3][zeros], want[k == -3][zeros])


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """The PTX subset LUT_PTX uses (and/or/shl/shr/prmt .b32; prmt in its default mode), run on Python ints."""
    def val(op: str) -> int:
        return int(op, 0) if op[0].isdigit() else regs[op]

    for line in text.split(";"):
        line = line.strip(" \n{}")
        if not line or line.startswith(".reg"):
            continue
        opcode, rest = line.split(None, 1)
        dst, *src = [x.strip() for x in rest.split(",")]
        a = [val(x) for x in src]
        if opcode == "and.b32":
            out = a[0] & a[1]
        elif opcode == "or.b32":
            out = a[0] | a[1]
        elif opcode == "shl.b32":
            out = a[0] << a[1]
        elif opcode == "shr.b32":
            out = a[0] >> a[1]
        elif opcode == "prmt.b32":
            pool = a[0] | (a[1] << 32)  # bytes 0-3 from a, 4-7 from b
            out = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        else:
            raise AssertionError(f"unexpected PTX {opcode}")
        regs[dst] = out & 0xFFFFFFFF
    return regs


def test_the_compiled_lookup_emulated_gives_the_tables_codes():
    """fp4_one_dot.LUT_PTX (the inline PTX, which only a GPU runs) emulated instruction by instruction: every
    byte, with the four elements of a pack under four different shifts, gives the e4m3 codes torch's cast does."""
    from sparseserve.kernels.quant.fp4_one_dot import LUT_PTX

    text = LUT_PTX.value
    gen = torch.Generator().manual_seed(6)
    ks = torch.arange(-2, 13)

    def words(k: int) -> tuple[int, int]:  # shift_lut's words, from the cast
        codes = (torch.tensor(ref.E2M1_VALUES) * 2.0 ** (k - 6)).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        return sum(c << (8 * j) for j, c in enumerate(codes[:4])), sum(c << (8 * j) for j, c in enumerate(codes[4:]))

    table = {k: words(k) for k in ks.tolist()}
    for trial in range(256):
        pack = [(trial + 64 * j) % 256 for j in range(4)]  # every byte in every position
        shifts = ks[torch.randint(0, len(ks), (4,), generator=gen)].tolist()
        regs = {"$2": sum(b << (8 * j) for j, b in enumerate(pack))}
        regs.update({f"${3 + j}": table[k][0] for j, k in enumerate(shifts)})
        regs.update({f"${7 + j}": table[k][1] for j, k in enumerate(shifts)})
        out = _run_ptx(text, regs)
        for j, (b, k) in enumerate(zip(pack, shifts)):
            values = ref.unpack_fp4(torch.tensor([[b]], dtype=torch.uint8))[0] * 2.0 ** (k - 6)
            want = values.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
            assert [(out["$0"] >> (8 * j)) & 0xFF, (out["$1"] >> (8 * j)) & 0xFF] == want, (b, k)


@needs_kernels
@pytest.mark.parametrize("use_asm", ASM_FORMS)
@pytest.mark.parametrize("k,fp32", [(256, False), (224, False), (96, False), (256, True)])
def test_a_group_gives_the_reference_operands_bit_for_bit(k, fp32, use_asm):
    """13 of 16 rows real, scales from 2^-100 to 2^97 with every group at the 14-binade bound: the whole-group
    word loads (K = 256), a partial last group (224, 96) and fp32 scales; codes bitwise, scales exact."""
    gen = torch.Generator().manual_seed(k + fp32)
    w = spanned_fp4(gen, (13, k), 27, 210, fp32=fp32)
    assert w.fp4_one_dot_exact
    groups = -(-k // 128)
    codes = torch.full((16, k), 0xFF, dtype=torch.uint8, device=DEVICE)
    scale = torch.full((16, groups), float("nan"), device=DEVICE)
    _group_probe_kernel[(groups,)](w.codes, w.scale_bits, codes, scale, 13, k, w.data.stride(0), w.scale.stride(0),
                                   codes.stride(0), W_E8M0=not fp32, EVEN_K=k % 128 == 0, USE_ASM=use_asm)
    want_codes, want_scale = ref.fp4_one_dot_operands(QuantWeight(w.data.cpu(), w.scale.cpu(), "fp4"))
    assert torch.equal(codes[:13].cpu(), want_codes.view(torch.uint8))
    assert torch.equal(scale[:13].cpu(), want_scale)


# ------------------------------------------------------------------ the experts

E, TOP_K, LIMIT = 8, 3, 1.5
SHAPES = {"ragged": (96, 160), "even": (256, 128)}  # (D, I): not multiples of 128 / multiples (scale words)
PATHS = {  # the activation paths at tiny tiles, as in test_quant_fp4_forms.py
    "decode": MoeQuantConfig(16, 64, 4, 2, 64, 4, 2, False, True, DOT_FP32, down_act_quant=True, **ONE_DOT),
    "decode_in_kernel_quant": MoeQuantConfig(16, 64, 4, 2, 64, 4, 2, False, False, DOT_FP32, **ONE_DOT),
    "prefill": MoeQuantConfig(32, 128, 4, 2, 64, 4, 2, True, True, DOT_FP32, **ONE_DOT),
}


def _experts_case(num_tokens: int, shape: str, skewed: bool = True, gate_up_span: int = ONE_DOT_MAX_SHIFT,
                  fp32: bool = False):
    """Random FP4 experts within the bound, scales over 2^-45 .. 2^-3 (gate-up) and 2^-40 .. 2^16 (down), x rows
    over 15 binades; skewed: expert 0 takes every token and experts 6, 7 none; else a uniform random routing."""
    hidden, inter = SHAPES[shape]
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden)
    x = scaled_rows(gen, num_tokens, hidden)
    w_gu = spanned_fp4(gen, (E, 2 * inter, hidden), 127 - 45, 127 - 3 - gate_up_span, gate_up_span, fp32)
    w_dn = spanned_fp4(gen, (E, hidden, inter), 127 - 40, 127 + 2, fp32=fp32)
    weights, ids = expert_routing(gen, num_tokens, E, TOP_K, skewed)
    return x.to(DEVICE), w_gu, w_dn, weights.to(DEVICE), ids.to(DEVICE)


_CASES = [(path, shape, t) for path in sorted(PATHS) for shape in sorted(SHAPES) for t in (1, 3)]
_CASES += [("prefill", "ragged", 64)]


@needs_kernels
@pytest.mark.parametrize("path,shape,num_tokens", _CASES)
def test_the_one_dot_form_matches_the_reference(path, shape, num_tokens, monkeypatch):
    gate_up, down = record_expert_launches(monkeypatch)
    x, w_gu, w_dn, weights, ids = _experts_case(num_tokens, shape)
    assert w_gu.fp4_one_dot_exact and w_dn.fp4_one_dot_exact
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=PATHS[path])
    assert dict(gate_up.launches[0][1])["FP4_ONE_DOT"] and dict(down.launches[0][1])["FP4_ONE_DOT"]
    assert_moe_close(y, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))


@needs_kernels
def test_the_one_dot_form_with_fp32_power_of_two_scales():
    x, w_gu, w_dn, weights, ids = _experts_case(3, "ragged", fp32=True)
    assert w_gu.scale.dtype == torch.float32 and w_gu.fp4_one_dot_exact and w_dn.fp4_one_dot_exact
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=PATHS["prefill"])
    assert_moe_close(y, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))


@needs_kernels
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_a_weight_past_the_bound_takes_the_four_dot_form(path, monkeypatch):
    """Gate-up scales spanning 15 binades in every group: that tensor runs the four-dot form (FP4_ONE_DOT off,
    FP4_FP8 on) and still matches the reference; the down weight, within the bound, keeps the one-dot form."""
    gate_up, down = record_expert_launches(monkeypatch)
    x, w_gu, w_dn, weights, ids = _experts_case(3, "even", gate_up_span=ONE_DOT_MAX_SHIFT + 1)
    assert not w_gu.fp4_one_dot_exact and w_dn.fp4_one_dot_exact
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, LIMIT, config=PATHS[path])
    gu, dn = dict(gate_up.launches[0][1]), dict(down.launches[0][1])
    assert (gu["FP4_ONE_DOT"], gu["FP4_FP8"], dn["FP4_ONE_DOT"]) == (False, True, True)
    assert_moe_close(y, ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, LIMIT))


@needs_kernels
@pytest.mark.parametrize("num_tokens", [3, 64])
def test_one_dot_launches_depend_on_static_shapes_only(num_tokens, monkeypatch):
    """Graph safety: with the table's row for the size in the one-dot form, the grids and constexprs are the
    same for a skewed and a uniform routing."""
    cfg = replace(moe_quant_config(num_tokens, TOP_K, E, "fp4", interpret=not CUDA), fp4_one_dot=True)
    gate_up, down, _ = launches_match_across_routings(monkeypatch, cfg, _experts_case, num_tokens, LIMIT)
    for launches in (gate_up.launches, down.launches):
        constexprs = dict(launches[0][1])
        assert constexprs["FP4_ONE_DOT"] and constexprs["FP4_FP8"] and constexprs["EVEN_K"]


# ------------------------------------------------------------------ the table and its variants


def test_the_table_takes_the_one_dot_form_where_its_switches_say(monkeypatch):
    for tokens in (1, 8, 64, 512, 2048, 8192):
        table = moe_quant_config(tokens, 6, 256, "fp4")
        variants = moe_quant_variants(tokens, 6, 256, "fp4")
        want = select.FP4_ONE_DOT_PREFILL if table.out_quant else select.FP4_ONE_DOT_DECODE
        assert table.fp4_fp8_mma and table.fp4_one_dot is want
        other = variants["fp4_four_dot" if want else "fp4_one_dot"]
        assert other == replace(table, fp4_one_dot=not want) and other.fp4_fp8_mma
        assert not variants["fp4_decode"].fp4_one_dot and not variants["fp4_scaled_dot"].fp4_one_dot
    assert not moe_quant_config(2048, 6, 256, "fp8_block").fp4_one_dot
    monkeypatch.setattr(select, "FP4_ONE_DOT_PREFILL", True)  # one switch moves the prefill rows
    assert moe_quant_config(2048, 6, 256, "fp4").fp4_one_dot and "fp4_four_dot" in moe_quant_variants(2048, 6, 256, "fp4")
    assert not moe_quant_config(2048, 6, 256, "fp8_block").fp4_one_dot
    monkeypatch.setattr(select, "FP4_ONE_DOT_DECODE", True)  # one switch moves the decode rows
    assert moe_quant_config(1, 6, 256, "fp4").fp4_one_dot and "fp4_four_dot" in moe_quant_variants(1, 6, 256, "fp4")


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512, 2048])
def test_gpu_one_dot_form_at_v4_flash_expert_shapes_and_graph_replay(num_tokens):
    """D 4096, I 2048, 256 experts, top-6, scales spread over 60 binades with every group at the 14-binade
    bound (every shift table in use): the one-dot form (the table's row with fp4_one_dot on) against the
    reference and against the four-dot form; replayed from a CUDA graph it gives the same bits as eager. A
    weight whose exactness was never read is refused inside a capture (a host sync)."""
    hidden, inter, experts, top_k = 4096, 2048, 256, 6
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w_gu = spanned_fp4(gen, (experts, 2 * inter, hidden), 127 - 30, 127 - 10 - ONE_DOT_MAX_SHIFT)
    w_dn = spanned_fp4(gen, (experts, hidden, inter), 127 - 30, 127 - 10 - ONE_DOT_MAX_SHIFT)
    assert w_gu.fp4_one_dot_exact and w_dn.fp4_one_dot_exact
    gen_cuda = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = (torch.randn(num_tokens, hidden, device="cuda", generator=gen_cuda) * 4).bfloat16()
    weights, ids = torch.rand(num_tokens, experts, device="cuda", generator=gen_cuda).topk(top_k, dim=1)
    table = moe_quant_config(num_tokens, top_k, experts, "fp4")
    one_dot, four_dot = replace(table, fp4_one_dot=True), replace(table, fp4_one_dot=False)
    want = ref.fused_moe_quant_ref(x, w_gu, w_dn, weights, ids, 10.0).float()
    y = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=one_dot)
    y4 = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=four_dot)
    assert ((y.float() - want).norm() / want.norm()).item() < 2e-2
    assert ((y.float() - y4.float()).norm() / y4.float().norm()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, 10.0, config=one_dot)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)
    fresh = QuantWeight(w_gu.data, w_gu.scale, "fp4")
    with pytest.raises(QuantFormatError, match="fp4_one_dot_exact"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused_moe_quant_triton(x, fresh, w_dn, weights, ids, 10.0, config=one_dot)
