"""Shared memory of the engine's Triton kernels at their launch configs, compiled for sm_90 on the
CPU (no GPU needed), with the argument specialisations a real launch gets (16-byte-aligned pointers,
dims divisible by 16). An H100/H200 SM gives one block at most 232,448 bytes.

    TRITON_INTERPRET=0 PYTHONPATH=. python tools/kernel_resources.py      # one JSON line per config

The first fused expand+mix kernel failed to launch on the H200 with 366,592 bytes (its dot path
pipelined in three stages); the `expand_mix T=256 stages=3` line reproduces that number. Must run
with TRITON_INTERPRET=0 (the interpreter's functions cannot be compiled)."""
from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparseserve.kernels import mhc_fused
from sparseserve.kernels.mhc import _hc_finalize_kernel

SM90_SHARED_LIMIT = 232448


def shared_bytes(fn, signature: dict, constexprs: dict, aligned: list[str], **options) -> int:
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.metadata.shared


def expand_mix(tokens: int, **override) -> dict:
    sig = {"s_ptr": "*bf16", "o_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "new_ptr": "*bf16",
           "fn_ptr": "*fp32", "mix_ws_ptr": "*fp32", "sq_ws_ptr": "*fp32", "num_tokens": "i32", "D": "i32",
           "K": "i32", "M": "i32", "chunk": "i32", "splits": "i32", "HC": "constexpr", "BT": "constexpr",
           "BD": "constexpr", "MP": "constexpr", "FMA": "constexpr", "SPLIT_BF16": "constexpr",
           "PREC": "constexpr", "DOT_F32": "constexpr"}
    aligned = ["s_ptr", "o_ptr", "post_ptr", "comb_ptr", "new_ptr", "fn_ptr", "mix_ws_ptr", "sq_ws_ptr", "D", "K",
               "chunk"]
    cfg = dict(mhc_fused.expand_mix_config(tokens, 4096), **override)
    shared = shared_bytes(mhc_fused._hc_expand_mix_kernel, sig,
                          {"HC": 4, "BT": cfg["BT"], "BD": cfg["BD"], "MP": 32, "FMA": cfg["fma"], "SPLIT_BF16": True,
                           "PREC": "ieee", "DOT_F32": False}, aligned,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return {"kernel": "expand_mix", "tokens": tokens, "stages": cfg["num_stages"], "shared": shared}


def finalize_norm(warps: int) -> dict:
    sig = {n: "*fp32" for n in ("x_ptr", "mix_ws_ptr", "sq_ws_ptr", "base_ptr", "scale_ptr", "post_ptr", "comb_ptr",
                                "out_ptr", "norm_w_ptr")}
    sig.update(x_ptr="*bf16", out_ptr="*bf16", num_tokens="i32", D="i32", K="i32", splits="i32", norm_eps="fp32",
               hc_eps="fp32", block_eps="fp32")
    sig.update({n: "constexpr" for n in ("HC", "HP", "MP", "SP", "ITERS", "HEAD", "TB", "BD", "NORM")})
    consts = {"HC": 4, "HP": 4, "MP": 32, "SP": 64, "ITERS": 20, "HEAD": False, "TB": 1, "BD": 4096, "NORM": True}
    shared = shared_bytes(_hc_finalize_kernel, sig, consts, ["x_ptr", "out_ptr", "D", "K"], num_warps=warps)
    return {"kernel": "finalize_norm", "warps": warps, "shared": shared}


def rows() -> list[dict]:
    """Every config above; `expected_over` marks the one known not to fit."""
    out = [expand_mix(t) for t in (1, 4, 16, 256)]
    out.append(dict(expand_mix(256, num_stages=3), expected_over=True))
    out += [finalize_norm(w) for w in (1, 8)]
    return out


if __name__ == "__main__":
    for row in rows():
        row["fits"] = row["shared"] <= SM90_SHARED_LIMIT
        print(json.dumps(row))
