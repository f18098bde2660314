"""Registers and spill stack of the sparse-attention kernel's configs, compiled for sm_90a offline
(no GPU needed: Triton compiles to a cubin with its bundled ptxas; cuobjdump reads the resources).

    python tools/kernel_resources.py [--configs 64,64,8,2,1 16,64,4,2,4 ...]

Each config is BLOCK_H,BLOCK_N,num_warps,num_stages,NUM_SPLITS[,DV_SPLIT[,PREFETCH]]. Arguments are specialised as the
engine's launches are on the H200 (pointers and int arguments divisible by 16, one head block for
64 heads), so the numbers match the compile report of `sparseserve.benchmarks.kernels` on the
device. Run it under each Triton the engine supports (e.g. a venv with triton==3.6.0): register
allocation differs between versions. Diagnostic only.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparseserve.kernels import sparse_attention

POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*bf16",
                 "part_ml_ptr": "*bf16", "rows_ptr": "*i32", "band_ptr": "*i32", "sinks_ptr": "*fp32"}


def resources(block_h: int, block_n: int, warps: int, stages: int, splits: int, dv_split: int = 1,
              prefetch: bool = False) -> str:
    fn = sparse_attention._sparse_mqa_fwd_kernel
    names = fn.arg_names
    constexprs = {"NUM_SPLITS": splits, "DV_SPLIT": dv_split, "PREFETCH": prefetch, "BLOCK_H": block_h,
                  "BLOCK_N": block_n, "BLOCK_D": 512}
    if "SCAN" in names:
        constexprs["SCAN"] = 256
    if "BAND_PREPASS" in names:  # a branch's variant: valid-row bands from a pre-pass for 64-head programs
        constexprs["BAND_PREPASS"] = block_h == 64
    if block_h == 64:
        constexprs["head_blocks"] = 1  # 64 heads: the launch passes 1, which Triton specialises
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = POINTER_TYPES.get(name, "i32")
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32") and name != "rows_per_split"}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=divisible)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    bindir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    dump = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name],
                          capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    return f"registers {usage.group(1)}, spill stack {usage.group(2)} B, shared memory {kernel.metadata.shared} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["64,64,8,2,1", "64,32,8,3,1", "16,64,4,2,4", "16,64,4,2,1"],
                        help="the engine's defaults; e.g. 64,64,8,2,1,2 (column split), 16,16,4,1,4,1,1 (prefetch)")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90a, _sparse_mqa_fwd_kernel")
    for config in args.configs:
        values = [int(x) for x in config.split(",")]
        block_h, block_n, warps, stages, splits = values[:5]
        dv_split = values[5] if len(values) > 5 else 1
        prefetch = bool(values[6]) if len(values) > 6 else False
        print(f"  (H{block_h}, N{block_n}, w{warps}, st{stages}, S{splits}, dv{dv_split}, prefetch={prefetch}): "
              f"{resources(block_h, block_n, warps, stages, splits, dv_split, prefetch)}")


if __name__ == "__main__":
    main()
