"""Tile configs of the quantized kernels, chosen from static shapes only (a captured graph keeps its launch,
docs/design.md invariant 3), from a short table so that few Triton specialisations exist: M is never a
specialisation key (``do_not_specialize``), only the row of the table it falls in.

Block-scaled linear (``linear_config``; M rows, N outputs; K is walked in 128-column groups):

| row | M        | form      | A operand                    | dot          | BLOCK_M x BLOCK_N | warps | stages |
|-----|----------|-----------|------------------------------|--------------|-------------------|-------|--------|
| 1   | <= 16    | streaming | bf16 x, quantized in-kernel  | bf16 (exact) | 16 x 32 (64 when N >= 64 x SMs), 512 K columns a stage | 4 | 3 |
| 2   | <= 128   | tensor    | act_quant codes + scales     | fp8          | 64 x 64           | 4     | 4      |
| 3   | <= 1024  | tensor    | act_quant codes + scales     | fp8          | 64 x 128          | 4     | 4      |
| 4   | larger   | tensor    | act_quant codes + scales     | fp8          | 128 x 128         | 8     | 3      |

Row 1 is the weight-streaming form: one M tile, so W is read once; narrow N tiles give >= 1 program per SM
on every V4-Flash projection; the activation is quantized inside the kernel (the release's numerics, no extra
launch per projection: a decode step has ~250 of them), and the e4m3 codes go through the bf16 mma at M = 16
(exact products, fp32 accumulation): at 16 rows the dot's rate is irrelevant, the weight read is all, so each
pipeline stage covers four groups (16 KB of a 32-column tile) to keep enough bytes in flight without split-K.

Routed experts (``moe_quant_config``; by mean assignments per expert, like kernels/moe.py's table):

| row | mean rows/expert | BLOCK_M | gate-up BLOCK_N (per half) | output of gate-up    | down BLOCK_N | down A         |
|-----|------------------|---------|----------------------------|----------------------|--------------|----------------|
| 1   | <= 4             | 16      | 64                         | bf16 act             | 128          | quantized here |
| 2   | <= 24            | 32      | 64                         | bf16 act             | 128          | quantized here |
| 3   | <= 48; FP4 above | 64      | 128                        | e4m3 act + scales    | 128          | codes + scales |
| 4   | larger (FP8)     | 128     | 128                        | e4m3 act + scales    | 128          | codes + scales |

Rows 3-4 run 8 warps and 3 stages; row 2 runs 8 warps for FP4, 4 for FP8.

Rows 3-4 quantize the activation in the gate-up epilogue (its 128 columns are one group), so the down GEMM
reads e4m3 codes; x is quantized once by act_quant before the gate-up GEMM there. FP8 expert weights use the
fp8 dot in rows 3-4. FP4 weights multiply exact bf16 values (e2m1 x 2^e) in one of two forms
(``MoeQuantConfig.fp4_scaled_dot``, every row True): ``tl.dot_scaled`` on the packed bytes and their ue8m0
scale bytes (Triton's MX upcast: on sm_90 a packed e2m1 -> bf16 conversion, the scale multiply and the bf16
mma), or the scalar nibble decode, which fp32-scaled FP4 always takes. Compiled for sm_90a
(`tools/quant_kernel_resources.py`), the dot_scaled form's main loop has about half the instructions of the
decode form in every row; with 128-row FP4 tiles the gate-up kernel spills hundreds of bytes in either form
(two [128, 128] fp32 accumulators beside the weight tiles), so FP4 keeps 64-row tiles at every prefill size.
Hopper has no FP4 tensor cores, and e2m1 x 2^e scaled to fp8 is exact only within 8 binades of the group's
largest scale, so FP4 never takes the fp8 dot. Under the Triton interpreter every dot runs in fp32 unless a
test asks for the fp8 dot; an interpreter without ``tl.dot_scaled`` (triton 3.6's) takes the decode form.

``linear_variants`` and ``moe_quant_variants`` name the alternatives `benchmarks/quant_gemm.py` times beside
each size's table row (no row uses them until a run picks them): the other FP4 form, x through act_quant in
the decode rows, 4 warps in FP4's row 2, 128-row FP4 tiles at prefill, and in the linear's streaming row the
fp16 dot (``DOT_FP16``: e4m3 -> fp16 is one packed conversion, e4m3 -> bf16 goes through fp16), 8 warps and
the hardware e4m3 conversion of the activation codes (``GemmConfig.hw_round``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DOT_FP8 = 0  # float8e4nv x float8e4nv tensor-core dot (Hopper)
DOT_BF16 = 1  # e4m3 codes and scaled e2m1 values as bf16 (exact), bf16 dot
DOT_FP32 = 2  # fp32 dot: the Triton interpreter (its 16-bit dot is wrong)
DOT_FP16 = 3  # linear only: e4m3 codes as fp16 (exact; one packed conversion), fp16 dot; benchmarked, no table row
STREAM_MAX_M = 16


@dataclass(frozen=True)
class GemmConfig:
    """One launch of the block-scaled linear. quant_a: the kernel quantizes 16-bit activations itself;
    dot: DOT_FP8 / DOT_BF16 / DOT_FP32 (above)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    quant_a: bool
    dot: int
    group_m: int = 8  # M tiles per L2 swizzle group
    k_step: int = 1  # 128-column groups of K per loop iteration (pipeline stage)
    hw_round: bool = False  # quant_a: e4m3 codes by the hardware conversion (compiled kernels only)


def linear_config(m: int, n: int, k: int, num_sms: int = 132, interpret: bool = False) -> GemmConfig:
    """The table above (m, n, k: static shapes)."""
    if m <= STREAM_MAX_M:
        block_n = 64 if n >= 64 * num_sms else 32
        cfg = GemmConfig(16, block_n, 4, 3, True, DOT_BF16, k_step=4)
    elif m <= 128:
        cfg = GemmConfig(64, 64, 4, 4, False, DOT_FP8)
    elif m <= 1024:
        cfg = GemmConfig(64, 128, 4, 4, False, DOT_FP8)
    else:
        cfg = GemmConfig(128, 128, 8, 3, False, DOT_FP8)
    if interpret and cfg.dot == DOT_BF16:
        cfg = replace(cfg, dot=DOT_FP32)
    return cfg


def linear_variants(m: int, n: int, k: int, num_sms: int = 132, interpret: bool = False
                    ) -> dict[str, GemmConfig]:
    """The table's config ("table") and, in the streaming row, the alternatives benchmarks/quant_gemm.py
    times beside it: the fp16 dot (e4m3 -> fp16 is one packed conversion, e4m3 -> bf16 goes through fp16),
    8 warps (the in-kernel activation quantization spread over twice the threads), both, and on compiled
    kernels the activation codes from the hardware e4m3 conversion (hw_round) alone and with the other two.
    Under the interpreter the fp16 dot is replaced by the fp32 one, like the bf16 dot, and hw_round is left
    out (its conversion mis-rounds)."""
    cfg = linear_config(m, n, k, num_sms, interpret)
    if not cfg.quant_a:
        return {"table": cfg}
    fp16 = DOT_FP32 if interpret else DOT_FP16
    out = {"table": cfg, "fp16_dot": replace(cfg, dot=fp16), "warps_8": replace(cfg, num_warps=8),
           "fp16_dot_warps_8": replace(cfg, dot=fp16, num_warps=8)}
    if not interpret:
        out["hw_round"] = replace(cfg, hw_round=True)
        out["hw_round_fp16_dot_warps_8"] = replace(cfg, dot=DOT_FP16, num_warps=8, hw_round=True)
    return out


@dataclass(frozen=True)
class MoeQuantConfig:
    """One call of the quantized routed experts. out_quant: the gate-up epilogue writes e4m3 act codes and
    scales (needs gu_block_n == 128) and the down GEMM reads them; else bf16 act, quantized by the down GEMM.
    x_quant: x goes through act_quant first (else the gate-up GEMM quantizes its rows itself)."""

    block_m: int
    gu_block_n: int
    gu_warps: int
    gu_stages: int
    dn_block_n: int
    dn_warps: int
    dn_stages: int
    out_quant: bool
    x_quant: bool
    dot: int
    fp4_scaled_dot: bool = True  # FP4 with ue8m0 scales: tl.dot_scaled (else the scalar nibble decode)


def moe_quant_config(num_tokens: int, top_k: int, num_experts: int, fmt: str, interpret: bool = False
                     ) -> MoeQuantConfig:
    """The experts' table above: static shapes only, never the routing."""
    avg = num_tokens * top_k / num_experts
    big_dot = DOT_FP8 if fmt == "fp8_block" else DOT_BF16
    if avg <= 4:
        cfg = MoeQuantConfig(16, 64, 4, 4, 128, 4, 4, False, False, DOT_BF16)
    elif avg <= 24:
        warps = 8 if fmt == "fp4" else 4  # the decode form's FP4 tiles need 8 warps' registers (4: benchmarked)
        cfg = MoeQuantConfig(32, 64, warps, 4, 128, warps, 4, False, False, DOT_BF16)
    elif avg <= 48 or fmt == "fp4":
        cfg = MoeQuantConfig(64, 128, 8, 3, 128, 8, 3, True, True, big_dot)
    else:
        cfg = MoeQuantConfig(128, 128, 8, 3, 128, 8, 3, True, True, big_dot)
    if interpret and cfg.dot == DOT_BF16:
        cfg = replace(cfg, dot=DOT_FP32)
    return cfg


def moe_quant_variants(num_tokens: int, top_k: int, num_experts: int, fmt: str, interpret: bool = False
                       ) -> dict[str, MoeQuantConfig]:
    """The table's config ("table") and, for FP4, the alternatives benchmarks/quant_gemm.py times beside it
    (tools/quant_kernel_resources.py compiles them): the other FP4 partial form; in the decode rows x
    quantized by act_quant first (the gate-up loop then skips the per-program quantization of its rows), and
    where the row runs 8 warps, 4 (a 64-column half is one warpgroup's tile: compiled for sm_90, the second
    warpgroup repeats the FP4 conversion); in the prefill rows 128-row tiles."""
    cfg = moe_quant_config(num_tokens, top_k, num_experts, fmt, interpret)
    out = {"table": cfg}
    if fmt != "fp4":
        return out
    other = "fp4_decode" if cfg.fp4_scaled_dot else "fp4_scaled_dot"
    out[other] = replace(cfg, fp4_scaled_dot=not cfg.fp4_scaled_dot)
    if not cfg.x_quant:
        out["x_act_quant"] = replace(cfg, x_quant=True)
        if cfg.gu_warps == 8:
            out["warps_4"] = replace(cfg, gu_warps=4, dn_warps=4)
    elif cfg.block_m != 128:
        out["block_m_128"] = replace(cfg, block_m=128)
    return out
