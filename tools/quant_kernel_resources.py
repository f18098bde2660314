"""Resources of the quantized kernels (sparseserve/kernels/quant/) at the configs their table picks for
V4-Flash shapes, compiled for sm_90a offline (no GPU needed; tools/kernel_resources.py's compile_sm90).

    TRITON_INTERPRET=0 python tools/quant_kernel_resources.py [--only linear,moe,gemv]

One JSON line per kernel and config (the table's, "variant": "table", and the alternatives
benchmarks/quant_gemm.py times, select.linear_variants / moe_quant_variants; FP4's one-dot form as for a weight
that is exact in it, QuantWeight.fp4_one_dot_exact): registers, spill stack (bytes),
shared memory, whether the dots became wgmma (Hopper's warpgroup MMA) or mma, and `fits` (shared memory within
the 232,448 bytes of an sm_90 SM).
Exits 1 if a config does not fit. Diagnostic: run it under each Triton the engine supports.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton.language as tl  # noqa: E402
from kernel_resources import SM90_SHARED_LIMIT, _usage, compile_sm90  # noqa: E402

from sparseserve.kernels.quant import linear, moe_gemv, moe_quant  # noqa: E402
from sparseserve.kernels.quant.select import DOT_FP8, linear_variants, moe_quant_variants  # noqa: E402

act_quant = importlib.import_module("sparseserve.kernels.quant.act_quant")  # the package exports a function so named
NOT_ALIGNED = {"M", "num_assign", "top_k", "num_m_blocks"}  # runtime values, not specialised


def _compile(fn, ptrs: dict, constexprs: dict, warps: int, stages: int, floats: tuple[str, ...] = ()) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs or name == "PDL":
            sig[name] = "constexpr"
        else:
            sig[name] = ptrs.get(name, "fp32" if name in floats else "i32")
    constexprs = {"PDL": 1, **constexprs}
    aligned = [n for n in fn.arg_names if sig[n] not in ("constexpr", "fp32") and n not in NOT_ALIGNED]
    kernel = compile_sm90(fn, sig, constexprs, aligned, num_warps=warps, num_stages=stages)
    regs, stack = _usage(kernel)
    shared = kernel.metadata.shared
    return {"registers": regs, "spill_stack": stack, "shared": shared, "fits": shared <= SM90_SHARED_LIMIT,
            "mma": "wgmma" if "wgmma" in kernel.asm["ptx"] else "mma"}


def linear_rows() -> list[dict]:
    rows = [{"kernel": "act_quant", **_compile(act_quant._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                                                             "s_ptr": "*fp32"},
                                               {"BLOCK_M": act_quant.ACT_BLOCK_M, "UE8M0": True}, 4, 1)}]
    for m, n, k in ((1, 4096, 4096), (1, 32768, 1024), (64, 4096, 4096), (512, 4096, 4096), (2048, 4096, 4096)):
        for variant, cfg in linear_variants(m, n, k).items():
            ptrs = {"a_ptr": "*bf16" if cfg.quant_a else "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                    "ws_ptr": "*u8", "c_ptr": "*bf16"}
            cx = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "GROUP_M": cfg.group_m, "QUANT_A": cfg.quant_a,
                  "UE8M0": True, "W_E8M0": True, "DOT": cfg.dot, "K_STEP": cfg.k_step, "HW_ROUND": cfg.hw_round}
            rows.append({"kernel": "linear", "m": m, "n": n, "k": k, "variant": variant,
                         "config": list(cfg.__dict__.values()),
                         **_compile(linear._fp8_linear_kernel, ptrs, cx, cfg.num_warps, cfg.num_stages)})
    return rows


def _gemv_rows(tokens: int, variant: str, cfg) -> list[dict]:
    """The FP4 weight-streaming form's two kernels (moe_gemv.py) at a MoeQuantConfig with gemv=True."""
    common = {"BLOCK_K": cfg.gemv_block_k, "UE8M0": True, "W_E8M0": True, "ACT_DTYPE": tl.bfloat16}
    gu = _compile(moe_gemv._moe_gemv_gate_up_kernel,
                  {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "h_ptr": "*bf16", "topk_ids_ptr": "*i64",
                   "topk_w_ptr": "*fp32"}, {"BLOCK_N": cfg.gu_block_n, **common}, cfg.gu_warps, cfg.gu_stages,
                  floats=("limit",))
    dn = _compile(moe_gemv._moe_gemv_down_kernel,
                  {"h_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "y_ptr": "*bf16", "topk_ids_ptr": "*i64"},
                  {"BLOCK_N": cfg.dn_block_n, **common}, cfg.dn_warps, cfg.dn_stages)
    tag = {"fmt": "fp4", "tokens": tokens, "variant": variant, "gemv": True,
           "block_n": [cfg.gu_block_n, cfg.dn_block_n], "block_k": cfg.gemv_block_k}
    return [{"kernel": "moe_gemv_gate_up", **tag, **gu}, {"kernel": "moe_gemv_down", **tag, **dn}]


def _moe_row(fmt: str, tokens: int, variant: str, cfg) -> list[dict]:
    if cfg.gemv:
        return _gemv_rows(tokens, variant, cfg)
    w = "*u8" if fmt == "fp4" else "*fp8e4nv"
    a16 = "*bf16"
    gu_ptrs = {"x_ptr": "*fp8e4nv" if cfg.x_quant else a16, "xs_ptr": "*fp32", "w_ptr": w, "ws_ptr": "*u8",
               "out_ptr": "*fp8e4nv" if cfg.out_quant else a16, "outs_ptr": "*fp32",
               "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32"}
    mma = fmt == "fp4" and cfg.fp4_fp8_mma
    one_dot = mma and cfg.fp4_one_dot  # as for a weight that passes QuantWeight.fp4_one_dot_exact
    scaled = fmt == "fp4" and cfg.fp4_scaled_dot and not mma
    codes_down = cfg.out_quant or cfg.down_act_quant
    common = {"FP4": fmt == "fp4", "UE8M0": True, "W_E8M0": True, "DOT": cfg.dot, "M_FASTEST": False,
              "FP4_SCALED_DOT": scaled, "EVEN_K": True,  # V4-Flash: D and I multiples of 128
              "FP4_FP8": mma, "FP4_ONE_DOT": one_dot, "INTERPRET": False}
    gu = _compile(moe_quant._moe_q_gate_up_kernel, gu_ptrs,
                  {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.gu_block_n, "QUANT_A": not cfg.x_quant,
                   "OUT_QUANT": cfg.out_quant, "ACT_DTYPE": tl.bfloat16, **common},
                  cfg.gu_warps, cfg.gu_stages, floats=("limit",))
    dn_ptrs = {"a_ptr": "*fp8e4nv" if codes_down else a16, "as_ptr": "*fp32", "w_ptr": w, "ws_ptr": "*u8",
               "y_ptr": a16, "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}
    dn = _compile(moe_quant._moe_q_down_kernel, dn_ptrs,
                  {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.dn_block_n, "QUANT_A": not codes_down, **common},
                  cfg.dn_warps, cfg.dn_stages)
    tag = {"fmt": fmt, "tokens": tokens, "variant": variant, "block_m": cfg.block_m, "fp4_scaled_dot": scaled,
           "fp4_fp8_mma": mma, "fp4_one_dot": one_dot, "fp8_dot": cfg.dot == DOT_FP8}
    return [{"kernel": "moe_gate_up", **tag, **gu}, {"kernel": "moe_down", **tag, **dn}]


def moe_rows() -> list[dict]:
    """The table's config and its benchmarked alternatives (select.moe_quant_variants) per format and size."""
    return [row for fmt in ("fp4", "fp8_block") for tokens in (1, 512, 2048, 8192)
            for variant, cfg in moe_quant_variants(tokens, 6, 256, fmt).items()
            for row in _moe_row(fmt, tokens, variant, cfg)]


def gemv_rows() -> list[dict]:
    """The FP4 weight-streaming variants alone (select.moe_quant_variants' gemv configs at T = 1 and 8)."""
    return [row for tokens in (1, 8) for variant, cfg in moe_quant_variants(tokens, 6, 256, "fp4").items()
            if cfg.gemv for row in _gemv_rows(tokens, variant, cfg)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="linear,moe", help="comma-separated: linear, moe, gemv (moe includes gemv)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    rows = (linear_rows() if "linear" in only else []) + (moe_rows() if "moe" in only else [])
    rows += gemv_rows() if "gemv" in only and "moe" not in only else []
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
