"""Can Gluon split QK^T along D between two warpgroups on Hopper? (issue 4's next structural step)

    TRITON_INTERPRET=0 PYTHONPATH=. python tools/gluon_ws_probe.py          # offline sm_90a compile, no GPU
    PYTHONPATH=. python tools/gluon_ws_probe.py --run                        # on the H200: also check the numbers

The wgmma attention kernel (kernels/sparse_attention_wgmma.py) spends ~30% of its time in QK^T because
both warpgroups read all of q from shared memory for half of the tile's rows (docs/performance.md,
"Attention: the Hopper wgmma kernel"). Splitting D instead (warpgroup w: q[:, 256w:256w+256] against
the same half of the tile, all 64 rows, then S = S_0 + S_1 through shared memory) reads a third less
and issues 64-column instructions, but the two warpgroups then run different code, which one Gluon
layout cannot say: it needs `gl.warp_specialize` (a default partition and a worker partition of 4
warps each). This probe builds that minimal step, [64 x 512] . [512 x 64] with an mbarrier between
the partitions, and reports whether it compiles for sm_90a (registers, shared memory) under the
installed Triton and, with --run, whether it computes q k^T.
"""
from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from kernel_resources import _usage, compile_sm90  # tools/ is the script's directory

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _half_qk(q_smem, k_smem, s_smem, done, HALF: gl.constexpr):
    """One warpgroup's half of D: S_half = q[:, half] . k[:, half]^T into s_smem[HALF], then arrive."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem.slice(HALF * 256, 256, dim=1), k_smem.slice(HALF * 256, 256, dim=1).permute((1, 0)),
                      zero, use_acc=False)
    s_smem.index(HALF).store(s)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _split_d_qk_kernel(q_ptr, k_ptr, s_ptr):
    io: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, io))
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, io))
    offs = gl.expand_dims(rows, 1) * 512 + gl.expand_dims(cols, 0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], tile, gl.load(q_ptr + offs))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], tile, gl.load(k_ptr + offs))
    s_smem = gl.allocate_shared_memory(gl.float32, [2, 64, 64], plain)
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=2)  # one arrival per partition: Gluon syncs the partition, then one thread arrives
    fence_async_shared()
    _barrier()
    gl.warp_specialize([(_half_qk, (q_smem, k_smem, s_smem, done, 0)), (_half_qk, (q_smem, k_smem, s_smem, done, 1))],
                       [4], [232])
    mbarrier.wait(done, 0)
    sum_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    s = s_smem.index(0).load(sum_layout) + s_smem.index(1).load(sum_layout)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, sum_layout))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, sum_layout))
    gl.store(s_ptr + gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0), s)


def compile_report() -> dict:
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "s_ptr": "*fp32"}
    kernel = compile_sm90(_split_d_qk_kernel, signature, {}, list(signature), source_cls=GluonASTSource, num_warps=4)
    registers, spill_stack = _usage(kernel)
    ptx = kernel.asm["ptx"]
    return dict(triton=triton.__version__, registers=registers, spill_stack=spill_stack,
                shared=kernel.metadata.shared, wgmma=ptx.count("wgmma.mma_async"), setmaxnreg=ptx.count("setmaxnreg"))


def run_on_gpu() -> float:
    q = torch.randn(64, 512, device="cuda").bfloat16()
    k = torch.randn(64, 512, device="cuda").bfloat16()
    s = torch.empty(64, 64, device="cuda")
    _split_d_qk_kernel[(1,)](q, k, s, num_warps=4)
    ref = q.float() @ k.float().T
    return ((s - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="also run it on the GPU and compare with q @ k^T")
    args = ap.parse_args()
    try:
        print("compile:", compile_report())
    except Exception as exc:  # noqa: BLE001 - the answer to the probe's question
        print("compile failed:", type(exc).__name__, str(exc)[:2000])
    if args.run:
        print("relative error vs q @ k^T:", run_on_gpu())


if __name__ == "__main__":
    main()
