"""Resources of the engine's Triton kernels, compiled for sm_90a offline (no GPU needed: Triton
compiles to a cubin with its bundled ptxas; cuobjdump reads the resources).

    python tools/kernel_resources.py [--configs 64,64,8,2,1 16,64,4,2,4 ...]   # attention: registers, spills
    TRITON_INTERPRET=0 python tools/kernel_resources.py --mhc-shared          # one JSON line per config

Default: registers and spill stack of the portable Triton attention kernel's configs (`--fp8`: and of its variant
reading packed FP8 KV rows).

--fp8-engine: the FP8 variant at the configs `select.fp8_attention_config` launches for V4-Flash decode and prefill
shapes (64 heads, D = 512; and the 16-head row), one JSON line each: registers, spill stack, shared memory against
the sm_90 limit, the count of local-memory instructions (LDL/STL: spill traffic) in the SASS, and the instructions
of the main loop (per row tile and thread) with their local-memory ones. --sass-ops adds the SASS instruction counts
by opcode, whole kernel and loop (conversions F2F/F2FP, global loads, shared memory, tensor-core ops).

--hopper: the Hopper (Gluon) attention kernel as the engine launches it (registers, spill stack, the SASS's local
stores and loads, shared memory; a CI test runs it: it builds with this Triton, fits one block, spills at most a
few scalars). --hopper-fp8: the same for the role-split kernel's FP8 form (packed FP8 KV rows, dequantized by its
output warpgroups) in the forms its named config launches. Must run with TRITON_INTERPRET=0.

Each config is BLOCK_H,BLOCK_N,num_warps,num_stages,NUM_SPLITS. Arguments are specialised as the engine's launches
are on the H200 (pointers and int arguments divisible by 16, one head block for 64 heads), so the numbers match
the compile report of the kernel benchmark on the device. Run it under each Triton the engine supports (e.g. a
venv with triton==3.6.0): register allocation differs between versions. Diagnostic only.

--mhc-shared: shared memory per block of the fused mHC kernels (and the fused norm-rope and
embedding kernels) at the configs the engine picks,
against the 232,448 bytes an sm_90 SM gives one block (a CI test runs it). The first fused
expand+mix kernel failed to launch on the H200 with 366,592 bytes (its dot path pipelined in three
stages); the `expand_mix T=256 stages=3` line reproduces that number. Must run with
TRITON_INTERPRET=0 (the interpreter's functions cannot be compiled).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparseserve.kernels import mhc_fused
from sparseserve.kernels.attention import triton_kernel as attention_triton
from sparseserve.kernels.embed import _embed_streams_kernel
from sparseserve.kernels.mhc import _hc_finalize_kernel
from sparseserve.kernels.norm_rope import _norm_rope_kernel

SM90_SHARED_LIMIT = 232448

POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*bf16",
                 "part_ml_ptr": "*bf16", "rows_ptr": "*i32", "band_ptr": "*i32", "sinks_ptr": "*fp32"}


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: list[str], source_cls=ASTSource, **options):
    """fn compiled for sm_90a, the `aligned` arguments specialised as divisible by 16 (as the
    engine's launches are: 16-byte-aligned pointers, dims that are multiples of 16). Kernels with a
    PDL constexpr (the last argument) are compiled as the H200 launches them: with the wait.
    Gluon kernels: source_cls=GluonASTSource."""
    if "PDL" in fn.arg_names and "PDL" not in signature:
        signature, constexprs = {**signature, "PDL": "constexpr"}, {**constexprs, "PDL": 1}
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = source_cls(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_attention(block_h: int, block_n: int, warps: int, stages: int, splits: int, fp8: bool = False,
                      band_prepass: bool | None = None):
    """The portable attention kernel compiled for sm_90a as the engine launches it on bf16 q. fp8: the variant
    reading packed FP8 KV rows (V4: 448 e4m3 channels, scales at byte 576, the dequantizing product as on the GPU).
    band_prepass: default, as the engine's configs (64-head blocks)."""
    fn = attention_triton._sparse_mqa_fwd_kernel
    names = fn.arg_names
    constexprs = {"NUM_SPLITS": splits, "BLOCK_H": block_h, "BLOCK_N": block_n, "BLOCK_D": 512, "SCAN": 256,
                  "BAND_PREPASS": block_h == 64 if band_prepass is None else band_prepass, "FP8": fp8,
                  "NOPE": 448 if fp8 else 0, "SCALE_OFF": 576 if fp8 else 0, "F32_PRODUCT": False,
                  "PARTS_NORMALISED": fp8 and splits > 1, "PDL": 1}
    if block_h == 64:
        constexprs["head_blocks"] = 1  # 64 heads: the launch passes 1, which Triton specialises
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "*u8" if fp8 and name == "kv_ptr" else POINTER_TYPES.get(name, "i32")
    aligned = [name for name in names if signature[name] not in ("constexpr", "fp32") and name != "rows_per_split"]
    return compile_sm90(fn, signature, constexprs, aligned, num_warps=warps, num_stages=stages)


def resources(block_h: int, block_n: int, warps: int, stages: int, splits: int, fp8: bool = False) -> str:
    """One line: registers, spill stack and shared memory of compile_attention's kernel."""
    kernel = compile_attention(block_h, block_n, warps, stages, splits, fp8)
    regs, stack = _usage(kernel)
    return f"registers {regs}, spill stack {stack} B, shared memory {kernel.metadata.shared} B"


def sass_ops(kernel, loop_only: bool = False) -> dict[str, int]:
    """Static SASS instruction counts by opcode (without modifiers), most frequent first. loop_only: those of the
    main loop (the longest backward branch's body: the attention kernel's row tiles), i.e. per tile and thread."""
    lines = _cuobjdump(kernel, "-sass").splitlines()
    if loop_only:
        at = {int(m.group(1), 16): i for i, line in enumerate(lines) if (m := re.match(r"\s*/\*([0-9a-f]+)\*/", line))}
        loops = [(int(m.group(2), 16), int(m.group(1), 16)) for line in lines
                 if (m := re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA\s+.*?0x([0-9a-f]+)", line))
                 and int(m.group(2), 16) < int(m.group(1), 16)]
        if not loops:
            return {}
        start, end = max(loops, key=lambda se: se[1] - se[0])
        lines = lines[at[start]:at[end] + 1]
    counts: dict[str, int] = {}
    for line in lines:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def fp8_engine_configs() -> list[tuple[str, object]]:
    """(label, AttnConfig) of the FP8 configs the selection launches at V4-Flash shapes on 132 SMs, one per
    compiled form: split counts above 2 differ from 2 only in a constant of the partials' addressing."""
    from sparseserve.kernels.attention.select import fp8_attention_config

    seen, out = set(), []
    for heads in (64, 16):
        for tokens in (1, 4, 64, 256, 4096):
            for rows in (384, 640, 1152):
                cfg = fp8_attention_config(tokens, heads, rows, 132)
                form = (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, min(cfg.num_splits, 2))
                if form not in seen:
                    seen.add(form)
                    out.append((f"heads {heads}, tokens {tokens}, rows {rows}", cfg))
    return out


def fp8_engine_rows(with_ops: bool = False) -> list[dict]:
    """fp8_engine_configs compiled as launched (num_stages included): one dict each."""
    rows = []
    for label, cfg in fp8_engine_configs():
        kernel = compile_attention(cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.num_splits,
                                   fp8=True, band_prepass=cfg.band_prepass)
        regs, stack = _usage(kernel)
        ops, loop = sass_ops(kernel), sass_ops(kernel, loop_only=True)
        row = dict(first_shape=label, config=repr(cfg), registers=regs, spill_stack=stack,
                   local_memory_ops=ops.get("LDL", 0) + ops.get("STL", 0),
                   loop_instructions=sum(loop.values()), loop_local_memory_ops=loop.get("LDL", 0) + loop.get("STL", 0),
                   shared=kernel.metadata.shared, fits=kernel.metadata.shared <= SM90_SHARED_LIMIT)
        if with_ops:
            row["sass_ops"], row["loop_sass_ops"] = ops, loop
        rows.append(row)
    return rows


def expand_mix(tokens: int, **override) -> dict:
    sig = {"s_ptr": "*bf16", "o_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "new_ptr": "*bf16",
           "fn_ptr": "*fp32", "mix_ws_ptr": "*fp32", "sq_ws_ptr": "*fp32", "num_tokens": "i32", "D": "i32",
           "K": "i32", "M": "i32", "chunk": "i32", "splits": "i32", "HC": "constexpr", "BT": "constexpr",
           "BD": "constexpr", "MP": "constexpr", "FMA": "constexpr", "SPLIT_BF16": "constexpr",
           "PREC": "constexpr", "DOT_F32": "constexpr"}
    aligned = ["s_ptr", "o_ptr", "post_ptr", "comb_ptr", "new_ptr", "fn_ptr", "mix_ws_ptr", "sq_ws_ptr", "D", "K",
               "chunk"]
    cfg = dict(mhc_fused.expand_mix_config(tokens, 4096), **override)
    shared = compile_sm90(mhc_fused._hc_expand_mix_kernel, sig,
                          {"HC": 4, "BT": cfg["BT"], "BD": cfg["BD"], "MP": 32, "FMA": cfg["fma"], "SPLIT_BF16": True,
                           "PREC": "ieee", "DOT_F32": False}, aligned,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]).metadata.shared
    return {"kernel": "expand_mix", "tokens": tokens, "stages": cfg["num_stages"], "shared": shared}


def finalize_norm(warps: int) -> dict:
    sig = {n: "*fp32" for n in ("x_ptr", "mix_ws_ptr", "sq_ws_ptr", "base_ptr", "scale_ptr", "post_ptr", "comb_ptr",
                                "out_ptr", "norm_w_ptr")}
    sig.update(x_ptr="*bf16", out_ptr="*bf16", num_tokens="i32", D="i32", K="i32", splits="i32", norm_eps="fp32",
               hc_eps="fp32", block_eps="fp32")
    sig.update({n: "constexpr" for n in ("HC", "HP", "MP", "SP", "ITERS", "HEAD", "TB", "BD", "NORM")})
    consts = {"HC": 4, "HP": 4, "MP": 32, "SP": 64, "ITERS": 20, "HEAD": False, "TB": 1, "BD": 4096, "NORM": True}
    kernel = compile_sm90(_hc_finalize_kernel, sig, consts, ["x_ptr", "out_ptr", "D", "K"], num_warps=warps)
    shared = kernel.metadata.shared
    return {"kernel": "finalize_norm", "warps": warps, "shared": shared}


def norm_rope(weighted: bool, scatter: bool, fp8: bool = False) -> dict:
    """At V4 shapes: head dim 512, rope half-width 32 (fp8: the packed FP8 row, 592 B, written)."""
    row = "*u8" if fp8 else "*bf16"
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": row,
           "pool_ptr": row, "rows_ptr": "*i64", "heads": "i32", "dim": "i32", "stride_t": "i32", "stride_h": "i32",
           "eps": "fp32", "HAS_W": "constexpr", "HALF": "constexpr", "BLOCK": "constexpr", "SCATTER": "constexpr",
           "FP8": "constexpr", "NOPE": "constexpr", "SCALE_OFF": "constexpr", "ROW_BYTES": "constexpr"}
    aligned = ["x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "out_ptr", "pool_ptr", "rows_ptr", "dim", "stride_t",
               "stride_h"]
    consts = {"HAS_W": weighted, "HALF": 32, "BLOCK": 512, "SCATTER": scatter, "FP8": fp8,
              "NOPE": 448 if fp8 else 0, "SCALE_OFF": 576 if fp8 else 0, "ROW_BYTES": 592 if fp8 else 0}
    kernel = compile_sm90(_norm_rope_kernel, sig, consts, aligned, num_warps=4)
    return {"kernel": "norm_rope", "weighted": weighted, "scatter": scatter, "fp8": fp8,
            "shared": kernel.metadata.shared}


def embed() -> dict:
    sig = {"ids_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "D": "i32", "stride_w": "i32",
           "HC": "constexpr", "BD": "constexpr"}
    kernel = compile_sm90(_embed_streams_kernel, sig, {"HC": 4, "BD": 1024},
                          ["ids_ptr", "w_ptr", "out_ptr", "D", "stride_w"], num_warps=4)
    return {"kernel": "embed_streams", "shared": kernel.metadata.shared}


def _cuobjdump(kernel, flag: str) -> str:
    """The bundled cuobjdump's output for a compiled kernel's cubin."""
    bindir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([os.path.join(bindir, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def _usage(kernel) -> tuple[int, int]:
    """(registers, spill stack bytes) of a compiled kernel."""
    usage = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(kernel, "--dump-resource-usage"))
    return int(usage.group(1)), int(usage.group(2))


def _gluon_attention_row(fn, constexprs: dict, num_warps: int, types: dict | None = None,
                         **label) -> dict:
    """One Gluon attention kernel compiled for sm_90a (Gluon compiles offline too): registers, spill stack and
    shared memory against the sm_90 limit. `types`: argument types other than pointers, ints and qk_scale."""
    from triton.experimental.gluon._runtime import GluonASTSource

    pointers = {**POINTER_TYPES, "part_ml_ptr": "*fp32", **(types or {})}
    signature = {n: "constexpr" if n in constexprs else "fp32" if n == "qk_scale" else pointers.get(n, "i32")
                 for n in fn.arg_names}
    aligned = [n for n in signature if signature[n] not in ("constexpr", "fp32") and n not in ("num_heads", "num_units")
               and not signature[n].startswith("tensordesc")]
    kernel = compile_sm90(fn, signature, constexprs, aligned, source_cls=GluonASTSource, num_warps=num_warps)
    regs, stack = _usage(kernel)
    ops = sass_ops(kernel)
    row = dict(**label, registers=regs, spill_stack=stack, local_stores=ops.get("STL", 0),
               local_loads=ops.get("LDL", 0), shared=kernel.metadata.shared,
               fits=kernel.metadata.shared <= SM90_SHARED_LIMIT)
    return row


def _desc_type(tma: bool) -> str:
    """A descriptor argument's type: the TMA descriptor that `hopper.box_descriptor` builds (bf16, 64 x 64 boxes,
    128-byte swizzle), or the tensor itself (a placeholder the kernel does not read)."""
    from sparseserve.kernels.attention.hopper_common import tile_layout
    return f"tensordesc<bf16[64,64],{tile_layout()!r}>" if tma else "*bf16"


def hopper_attention_rows() -> list[dict]:
    """The Hopper attention kernel as `launch_hopper_attention` builds it: one split and splits with a band, one-tile
    splits without (small decode batches), q by TMA (contiguous) and by cp.async (strided)."""
    from sparseserve.kernels.attention import hopper, hopper_split

    rows = []
    for splits, band in ((4, True), (16, False)):
        gather, s, o, tile, p = hopper_split._layouts()
        constexprs = dict(NUM_SPLITS=splits, BLOCK_N=64, OUT_TMA=True, BAND=band, gather_layout=gather, s_layout=s,
                          o_layout=o, tile_smem=tile, p_smem_layout=p, PDL=1)
        types = {"out_desc": _desc_type(True), "part_acc_ptr": "*bf16"}
        rows.append(_gluon_attention_row(hopper_split._sparse_mqa_split_kernel, constexprs, 8, types,
                                         kernel="sparse_mqa_split", splits=splits, band=band))
    for splits, band in ((1, True),):
        for q_tma in (True, False):
            rows.append(_hopper_row(splits, band, q_tma, fp8=False))
    return rows


def hopper_fp8_attention_rows() -> list[dict]:
    """The role-split Hopper kernel's FP8 form (packed rows dequantized by its output warpgroups) as the named FP8
    config `select.fp8_hopper_attention_config` launches it: one split with a band (batch 256), two splits with a
    band (batch 64), one-tile splits without (small batches), q by TMA; and q by cp.async (a strided q)."""
    return [_hopper_row(1, True, True, fp8=True), _hopper_row(2, True, True, fp8=True),
            _hopper_row(16, False, True, fp8=True), _hopper_row(1, True, False, fp8=True)]


def _hopper_row(splits: int, band: bool, q_tma: bool, fp8: bool) -> dict:
    from sparseserve.kernels.attention import hopper

    constexprs = dict(NUM_SPLITS=splits, WORKER_REGS=hopper.FP8_WORKER_REGS if fp8 else hopper.WORKER_REGS,
                      OUT_TMA=True, Q_TMA=q_tma, BAND=band, FP8=fp8, PDL=1)
    types = {"out_desc": _desc_type(True), "q_desc": _desc_type(q_tma), "part_acc_ptr": "*bf16",
             "kv_ptr": "*u8" if fp8 else "*bf16"}
    return _gluon_attention_row(hopper._sparse_mqa_hopper_kernel, constexprs, 4, types, kernel="sparse_mqa_hopper",
                                splits=splits, band=band, q_tma=q_tma, fp8=fp8)


def mhc_shared_rows() -> list[dict]:
    """Every config above; `expected_over` marks the one known not to fit."""
    out = [expand_mix(t) for t in (1, 4, 16, 256)]
    out.append(dict(expand_mix(256, num_stages=3), expected_over=True))
    out += [finalize_norm(w) for w in (1, 8)]
    out += [norm_rope(False, False), norm_rope(True, True), norm_rope(True, True, fp8=True), embed()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["64,64,8,2,1", "64,32,8,3,1", "16,64,4,2,4", "16,64,4,2,1"],
                        help="BLOCK_H,BLOCK_N,num_warps,num_stages,NUM_SPLITS of the Triton kernel (default: the "
                             "engine's)")
    parser.add_argument("--mhc-shared", action="store_true",
                        help="shared memory of the fused mHC kernels' configs instead, one JSON line each")
    parser.add_argument("--fp8", action="store_true",
                        help="the attention configs reading packed FP8 KV rows (kv_cache_dtype='fp8') as well")
    parser.add_argument("--fp8-engine", action="store_true",
                        help="the FP8 attention configs the engine launches, as launched, one JSON line each")
    parser.add_argument("--sass-ops", action="store_true", help="with --fp8-engine: SASS instruction counts")
    parser.add_argument("--hopper", action="store_true",
                        help="the Hopper (Gluon) attention kernel instead, one JSON line each")
    parser.add_argument("--hopper-fp8", action="store_true",
                        help="the Hopper kernel's FP8 form (packed FP8 KV rows) instead, one JSON line each")
    args = parser.parse_args()
    if args.fp8_engine:
        for row in fp8_engine_rows(args.sass_ops):
            print(json.dumps(row))
        return
    if args.hopper or args.hopper_fp8:
        for row in hopper_fp8_attention_rows() if args.hopper_fp8 else hopper_attention_rows():
            print(json.dumps(row))
        return
    if args.mhc_shared:
        for row in mhc_shared_rows():
            row["fits"] = row["shared"] <= SM90_SHARED_LIMIT
            print(json.dumps(row))
        return
    print(f"triton {triton.__version__}, sm_90a, _sparse_mqa_fwd_kernel")
    for config in args.configs:
        block_h, block_n, warps, stages, splits = (int(x) for x in config.split(","))
        print(f"  (H{block_h}, N{block_n}, w{warps}, st{stages}, S{splits}): "
              f"{resources(block_h, block_n, warps, stages, splits)}")
        if args.fp8:
            print(f"  (H{block_h}, N{block_n}, w{warps}, st{stages}, S{splits}) FP8 KV: "
                  f"{resources(block_h, block_n, warps, stages, splits, fp8=True)}")


if __name__ == "__main__":
    main()
