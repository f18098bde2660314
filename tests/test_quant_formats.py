"""The release's weight formats (`sparseserve.quant_formats`): byte layouts decoded by hand,
partial FP8 blocks, encode/decode error bounds, and shape errors."""
import pytest
import torch

from sparseserve.quant_formats import (E2M1_VALUES, dequantize_fp4, dequantize_fp8_block, float_to_ue8m0,
                                       is_power_of_two, pack_e2m1, quantize_fp4, quantize_fp8_block,
                                       ue8m0_to_float, unpack_e2m1)


def test_ue8m0_bytes_are_powers_of_two():
    raw = torch.tensor([127, 130, 120], dtype=torch.uint8)
    assert ue8m0_to_float(raw).tolist() == [1.0, 8.0, 2.0 ** -7]
    assert ue8m0_to_float(raw.view(torch.float8_e8m0fnu)).tolist() == [1.0, 8.0, 2.0 ** -7]
    assert float_to_ue8m0(torch.tensor([1.0, 8.0, 0.25])).view(torch.uint8).tolist() == [127, 130, 125]
    assert is_power_of_two(torch.tensor([0.5, 4.0])) and not is_power_of_two(torch.tensor([0.5, 3.0]))


def test_fp4_nibbles_even_element_low():
    # 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = 1.0 (element 1); 0x71: 0.5 then 6; 0x08: -0 then 0.
    packed = torch.tensor([[0x2F, 0x71, 0x08]], dtype=torch.uint8).view(torch.int8)
    assert unpack_e2m1(packed).tolist() == [[-6.0, 1.0, 0.5, 6.0, -0.0, 0.0]]
    codes = torch.arange(16, dtype=torch.uint8)
    values = unpack_e2m1((codes | (codes.flip(0) << 4)).view(torch.int8))
    assert values[0::2].tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert torch.equal(unpack_e2m1(pack_e2m1(values)), values)


def test_fp4_scale_per_32_inputs():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8).view(torch.int8)  # 64 values of 1.0 per row
    scale = float_to_ue8m0(torch.tensor([[2.0, 0.5], [4.0, 1.0]]))
    out = dequantize_fp4(packed, scale)
    assert out[0, :32].eq(2.0).all() and out[0, 32:].eq(0.5).all() and out[1, :32].eq(4.0).all()
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp4(packed, scale[:, :1])


def test_fp8_partial_blocks_have_their_own_scale():
    weight = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    out = dequantize_fp8_block(weight, scale)
    assert out[0, 0] == 1 and out[127, 255] == 2 and out[127, 256] == 4 and out[128, 0] == 8 and out[129, 259] == 32
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequantize_fp8_block(weight, scale[:1])
    bf16 = torch.empty(130, 260, dtype=torch.bfloat16)
    dequantize_fp8_block(weight, float_to_ue8m0(scale), out=bf16)
    assert torch.equal(bf16.float(), out)


def test_encoders_round_trip_within_the_formats_precision():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 320, generator=gen)  # leading expert dim, partial blocks
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (3, 2, 3) and is_power_of_two(s)
    d = dequantize_fp8_block(q, s)
    block = ue8m0_to_float(s).repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[..., :320]
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0 ** -4, block * 2.0 ** -9)).all()
    assert torch.equal(dequantize_fp8_block(*quantize_fp8_block(d, scale_dtype=torch.float32)), d)
    p, s4 = quantize_fp4(w)
    assert p.dtype == torch.int8 and tuple(p.shape) == (3, 200, 160) and tuple(s4.shape) == (3, 200, 10)
    d4 = dequantize_fp4(p, s4)
    group = ue8m0_to_float(s4).repeat_interleave(32, -1)
    assert (w.abs() <= 6 * group).all() and ((d4 - w).abs() <= group).all()  # e2m1 steps are at most 2 x scale / 2
    assert torch.equal(dequantize_fp4(*quantize_fp4(d4)), d4)
    with pytest.raises(ValueError, match="even"):
        quantize_fp4(torch.randn(4, 63))
