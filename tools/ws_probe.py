"""Does Triton warp-specialize a gathered-row attention loop on Hopper? (offline, no GPU needed)

Compiles a minimal sparse-MQA loop (row ids, then a gather of those KV rows, QK^T, online softmax, PV)
with `tl.range(..., warp_specialize=True)` for sm_90a and reports whether the TTGIR has a
warp-specialized region, cp.async copies and wgmma dots. This is issue 4's structural question: the
decode and prefill goals need a producer warp gathering rows ahead of two consumer warpgroups.

    TRITON_INTERPRET=0 python tools/ws_probe.py

Session 16 (2026-11-30), triton 3.6.0 and 3.9.0: at 4 warps (one warpgroup, D = 256) the compile fails
in the Hopper warp-specialization pass on the gathered load (3.6: WSLowerToken.cpp, processProducerCommitOp,
"Assertion `false' failed"; 3.9: "unsupported load type for producer commit"); at 8 warps (D = 512) it
compiles without any warp-specialized region (cp.async and wgmma, as without the flag).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _gathered_attention_loop(q_ptr, kv_ptr, rows_ptr, out_ptr, n_rows, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + h[:, None] * D + d[None, :])
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in tl.range(0, n_rows, BLOCK_N, warp_specialize=True):
        rows = tl.load(rows_ptr + start + tl.arange(0, BLOCK_N))
        kv = tl.load(kv_ptr + rows[:, None].to(tl.int64) * D + d[None, :])
        s = tl.dot(q, tl.trans(kv))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        m = m_new
    tl.store(out_ptr + h[:, None] * D + d[None, :], (acc / l[:, None]).to(tl.bfloat16))


def probe(block_h: int, block_n: int, dim: int, warps: int) -> str:
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "rows_ptr": "*i32", "out_ptr": "*bf16", "n_rows": "i32",
           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr"}
    names = list(sig)
    consts = {(names.index("BLOCK_H"),): block_h, (names.index("BLOCK_N"),): block_n, (names.index("D"),): dim}
    src = ASTSource(fn=_gathered_attention_loop, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    head = f"triton {triton.__version__}, H {block_h}, N {block_n}, D {dim}, {warps} warps:"
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    except Exception as exc:  # the pass may abort the compile; report it as the finding
        return f"{head} compile failed ({str(exc).splitlines()[0][:200]})"
    ttgir = kernel.asm["ttgir"]
    return (f"{head} warp-specialized region {'ttg.warp_specialize' in ttgir}, cp.async "
            f"{'async_copy_global_to_local' in ttgir}, wgmma {'warp_group_dot' in ttgir}")


if __name__ == "__main__":
    for args in [(64, 32, 256, 4), (64, 32, 512, 8)]:
        print(probe(*args), flush=True)
