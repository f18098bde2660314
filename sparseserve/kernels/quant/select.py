"""Tile configs of the quantized kernels, chosen from static shapes only (a captured graph keeps its launch,
docs/design.md invariant 3), from a short table so that few Triton specialisations exist: M is never a
specialisation key (``do_not_specialize``), only the row of the table it falls in.

Block-scaled linear (``linear_config``; M rows, N outputs; K is walked in 128-column groups):

| row | M        | form      | A operand                    | dot          | BLOCK_M x BLOCK_N | warps | stages |
|-----|----------|-----------|------------------------------|--------------|-------------------|-------|--------|
| 1   | <= 16    | streaming | act_quant codes + scales     | fp8          | 16 x 32 (64 when N >= 64 x SMs), 512 K columns a stage | 4 | 3 |
| 2   | <= 128   | tensor    | act_quant codes + scales     | fp8          | 64 x 64           | 4     | 4      |
| 3   | <= 1024  | tensor    | act_quant codes + scales     | fp8          | 64 x 128          | 4     | 4      |
| 4   | larger   | tensor    | act_quant codes + scales     | fp8          | 128 x 128         | 8     | 3      |

Row 1 is the weight-streaming form: one M tile, so W is read once; narrow N tiles give >= 1 program per SM
on every V4-Flash projection, and each pipeline stage covers four groups (16 KB of a 32-column tile) to keep
enough bytes in flight without split-K. Quantizing x inside the kernel instead (no act_quant launch) makes
every program quantize the whole row again, a serial chain per group that costs more than the launch
(``linear_variants`` keeps it as the benchmarked alternative, with the bf16, fp16 and fp8 mma).

Routed experts (``moe_quant_config``; by mean assignments per expert, like kernels/moe.py's table):

| row | mean rows/expert | BLOCK_M | gate-up BLOCK_N (per half) | output of gate-up    | down BLOCK_N | down A         |
|-----|------------------|---------|----------------------------|----------------------|--------------|----------------|
| 1   | <= 4             | 16      | 64                         | bf16 act             | 128          | act_quant      |
| 2   | <= 24            | 32      | 64                         | bf16 act             | 128          | act_quant      |
| 3   | <= 48; FP4 above | 64      | 128                        | e4m3 act + scales    | 128          | codes + scales |
| 4   | larger (FP8)     | 128     | 128                        | e4m3 act + scales    | 128          | codes + scales |

Every row quantizes x once with act_quant and uses the fp8 tensor-core dot. Rows 3-4 run 8 warps and 3
stages, rows 1-2 4 warps and 4 stages. Rows 3-4 quantize the activation in the gate-up epilogue (its
128 columns are one group); rows 1-2 pass the bf16 activation through act_quant; either way the down GEMM
reads e4m3 codes.

FP4 weights run on the fp8 tensor cores in every row (``MoeQuantConfig.fp4_fp8_mma``), in one of two forms
(``fp4_one_dot``; which rows take which: ``FP4_ONE_DOT_DECODE`` / ``FP4_ONE_DOT_PREFILL``, one line each). The
one-dot form (fp4_one_dot.py) folds a group's four per-32 scales into one and writes the codes
exponent-shifted, so a 128-column group is one K = 128 fp8 dot scaled once, as for FP8 weights; it is exact for
weights whose sub-scales span at most 14 binades in every group (formats.fp4_one_dot_exact, decided once per
tensor at load), and a weight that is not runs the four-dot form with the same config. The four-dot form
(fp4_fp8.py) moves each e2m1 code bit-wise to an e4m3 code and multiplies each K = 32 partial by its per-32
scale in fp32. Both give the reference's products. The alternatives ``moe_quant_variants`` names: the other
fp8 form, and two that multiply exact bf16 values through the bf16 mma: ``tl.dot_scaled`` (Triton's MX
upcast) or the scalar nibble decode (``fp4_scaled_dot``). With
128-row FP4 tiles the gate-up kernel spills (two [128, 128] fp32 accumulators beside the weight tiles), so FP4
keeps 64-row tiles at every prefill size. Under the Triton interpreter the FP4 form's dots run in fp32 on the
decoded values; an interpreter without ``tl.dot_scaled`` (triton 3.6's) refuses a config that asks for it.

FP4 experts at decode sizes (T <= ``GEMV_MAX_TOKENS``) also have a weight-streaming form (moe_gemv.py,
``MoeQuantConfig.gemv``): one program per routed row and weight-row tile, x and the act quantized in the kernels,
CUDA-core FMAs; a benchmarked variant, no row of the table.

``linear_variants`` and ``moe_quant_variants`` name the alternatives `benchmarks/quant_gemm.py` times beside
each size's table row (no row uses them until a run picks them); `tools/quant_kernel_resources.py` compiles
them for sm_90a and reports registers and spills.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DOT_FP8 = 0  # float8e4nv x float8e4nv tensor-core dot (Hopper)
DOT_BF16 = 1  # e4m3 codes and scaled e2m1 values as bf16 (exact), bf16 dot
DOT_FP32 = 2  # fp32 dot: the Triton interpreter (its 16-bit dot is wrong)
DOT_FP16 = 3  # linear only: e4m3 codes as fp16 (exact; one packed conversion), fp16 dot; benchmarked, no table row
STREAM_MAX_M = 16
# FP4 experts: the one-dot form (True) or the four-dot form (False) in the decode rows (1-2) and the prefill
# rows (3-4) of the experts' table; the other form stays a benchmarked variant. Measured by quant_gemm on the
# H200 (docs/performance.md): one-dot is about 1.7x faster in the prefill rows (no spill) and about 2x slower
# in the decode rows (the per-group LUT work outweighs the fewer dots when a tile has few rows).
FP4_ONE_DOT_DECODE = False
FP4_ONE_DOT_PREFILL = True
# FP4 experts' weight-streaming form (moe_gemv.py), a benchmarked variant up to this many tokens (each routed
# row rereads its expert: past a few tokens the grouped GEMM reads less): 16 weight rows of each half a
# program, 256 K columns a step (2 KB of packed bytes a half and step, two steps in flight), 4 warps: compiled
# for sm_90a the gate-up kernel takes 167 registers, no spill (tools/quant_kernel_resources.py --only gemv); 512
# columns at 4 warps spills, at 8 warps ("fp4_gemv_8_warps") it takes 191.
GEMV_MAX_TOKENS = 16


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
        cfg = GemmConfig(16, block_n, 4, 3, False, DOT_FP8, k_step=4)
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
    times beside it: 8 warps; 16-bit x quantized inside the kernel (no act_quant launch, but every program
    quantizes the whole row again) through the bf16 mma, the fp16 mma (e4m3 -> fp16 is one packed
    conversion) or, compiled, the fp8 mma on the hardware e4m3 conversion's codes (hw_round). Under the
    interpreter the 16-bit dots are the fp32 one and hw_round is left out (its conversion mis-rounds)."""
    cfg = linear_config(m, n, k, num_sms, interpret)
    if m > STREAM_MAX_M:
        return {"table": cfg}
    wide = DOT_FP32 if interpret else DOT_BF16
    fp16 = DOT_FP32 if interpret else DOT_FP16
    inner = replace(cfg, quant_a=True, dot=wide)
    out = {"table": cfg, "warps_8": replace(cfg, num_warps=8), "in_kernel_quant": inner,
           "in_kernel_quant_fp16_dot": replace(inner, dot=fp16)}
    if not interpret:
        out["in_kernel_quant_hw_round_fp8_dot"] = replace(inner, dot=DOT_FP8, hw_round=True)
    return out


@dataclass(frozen=True)
class MoeQuantConfig:
    """One call of the quantized routed experts. out_quant: the gate-up epilogue writes e4m3 act codes and
    scales (needs gu_block_n == 128) and the down GEMM reads them; else bf16 act, quantized by act_quant
    (down_act_quant) or inside the down GEMM.
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
    fp4_fp8_mma: bool = False  # FP4: codes moved to e4m3, K = 32 fp8 dots (fp4_fp8.py); over fp4_scaled_dot
    # With fp4_fp8_mma: one K = 128 fp8 dot a group on exponent-shifted codes (fp4_one_dot.py) for each weight
    # that is exact in it (QuantWeight.fp4_one_dot_exact), the four-dot form for the others.
    fp4_one_dot: bool = False
    down_act_quant: bool = False  # not out_quant: the bf16 act goes through act_quant before the down GEMM
    # FP4: the weight-streaming form (moe_gemv.py): one program per (routed row, gu_block_n / dn_block_n weight
    # rows) walking K in gemv_block_k steps, x and the act quantized in the kernels; block_m, out_quant, x_quant,
    # dot and the fp4_* fields do not apply.
    gemv: bool = False
    gemv_block_k: int = 256


def moe_quant_config(num_tokens: int, top_k: int, num_experts: int, fmt: str, interpret: bool = False
                     ) -> MoeQuantConfig:
    """The experts' table above: static shapes only, never the routing (`interpret` changes no row: every
    row's dot is the fp8 one, which the interpreter runs as it is; kept for the callers)."""
    avg = num_tokens * top_k / num_experts
    fp4 = fmt == "fp4"
    if avg <= 4:
        cfg = MoeQuantConfig(16, 64, 4, 4, 128, 4, 4, False, True, DOT_FP8, down_act_quant=True)
    elif avg <= 24:
        cfg = MoeQuantConfig(32, 64, 4, 4, 128, 4, 4, False, True, DOT_FP8, down_act_quant=True)
    elif avg <= 48 or fp4:
        cfg = MoeQuantConfig(64, 128, 8, 3, 128, 8, 3, True, True, DOT_FP8)
    else:
        cfg = MoeQuantConfig(128, 128, 8, 3, 128, 8, 3, True, True, DOT_FP8)
    if fp4:  # the fp8 tensor cores in every row; dot then applies to no FP4 operand
        one_dot = FP4_ONE_DOT_PREFILL if cfg.out_quant else FP4_ONE_DOT_DECODE
        cfg = replace(cfg, fp4_scaled_dot=False, fp4_fp8_mma=True, fp4_one_dot=one_dot)
    return cfg


FP4_GEMV = MoeQuantConfig(1, 16, 4, 1, 16, 4, 1, False, False, DOT_FP32, fp4_scaled_dot=False, gemv=True,
                          gemv_block_k=256)


def moe_quant_variants(num_tokens: int, top_k: int, num_experts: int, fmt: str, interpret: bool = False
                       ) -> dict[str, MoeQuantConfig]:
    """The table's config ("table") and the alternatives benchmarks/quant_gemm.py times beside it
    (tools/quant_kernel_resources.py compiles them): in the decode rows x and the act quantized inside the
    GEMMs (no act_quant launches, every program quantizes its rows again), the act alone and, for FP8, the bf16 mma on the exact
    e4m3 values; for FP4 the other fp8 form ("fp4_one_dot" or "fp4_four_dot", whichever the row does not take),
    the two bf16 forms (tl.dot_scaled, the scalar nibble decode; under the interpreter only where it has
    tl.dot_scaled / always), 4 warps where the row runs 8, and narrower gate-up tiles in the decode rows (twice
    the programs: more weight bytes in flight per SM); for FP4 at T <= GEMV_MAX_TOKENS the weight-streaming form
    (moe_gemv.py: "fp4_gemv", "fp4_gemv_8_warps")."""
    cfg = moe_quant_config(num_tokens, top_k, num_experts, fmt, interpret)
    out = {"table": cfg}
    decode_row = not cfg.out_quant
    if decode_row:
        out["in_kernel_quant"] = replace(cfg, x_quant=False, down_act_quant=False)
        out["down_in_kernel_quant"] = replace(cfg, down_act_quant=False)
    if fmt != "fp4":
        if decode_row:
            out["bf16_dot"] = replace(cfg, dot=DOT_FP32 if interpret else DOT_BF16)
        return out
    other = "fp4_four_dot" if cfg.fp4_one_dot else "fp4_one_dot"
    out[other] = replace(cfg, fp4_one_dot=not cfg.fp4_one_dot)
    wide = DOT_FP32 if interpret else DOT_BF16
    bf16_form = replace(cfg, fp4_fp8_mma=False, fp4_one_dot=False, dot=wide, x_quant=cfg.out_quant,
                        down_act_quant=False)
    out["fp4_scaled_dot"] = replace(bf16_form, fp4_scaled_dot=True)
    out["fp4_decode"] = bf16_form
    if cfg.gu_warps == 8:
        out["warps_4"] = replace(cfg, gu_warps=4, dn_warps=4)
    if decode_row:
        out["gate_up_block_n_32"] = replace(cfg, gu_block_n=32)
    if num_tokens <= GEMV_MAX_TOKENS:
        out["fp4_gemv"] = FP4_GEMV
        out["fp4_gemv_8_warps"] = replace(FP4_GEMV, gu_warps=8, dn_warps=8, gemv_block_k=512)
    return out
