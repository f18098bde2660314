"""What programmatic dependent launch saves per kernel edge, in a captured CUDA graph (needs sm_90+).

Two chains, each replayed back to back with and without PDL, in the same process:
  * `norms`: N RMSNorm launches on one [1, 4096] bf16 row, each reading the previous one's output
    (the latency-bound small kernels of a batch-1 decode step);
  * `norm_gemm`: N pairs of an RMSNorm and a cuBLAS [1, 4096] x [4096, 4096] GEMM (the PDL kernel
    follows a kernel that knows nothing of PDL, and the GEMM follows a PDL kernel).
Each chain runs without PDL and with each trigger (`exit`: dependents launch as this kernel's
programs end; `start`: right after the wait). Both chains' outputs must be bitwise equal with and
without PDL (each kernel reads its predecessor's output, so a missing wait would show as a difference).

    python -m benchmarks.pdl_bench [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

from benchmarks import result_file
from benchmarks.timing import capture_graph, replay_ms
from sparseserve.kernels.pdl import TRIGGERS, pdl_enabled
from sparseserve.kernels.rmsnorm import _rms_norm_kernel


def norm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: int) -> torch.Tensor:
    """pdl: the kernel's PDL constexpr (0 off, else a value of TRIGGERS)."""
    launch = {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": 0}
    _rms_norm_kernel[(x.shape[0],)](x, w, out, x.shape[1], 1, x.shape[1], 0, 1e-6, HAS_W=True,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4, **launch)
    return out


def chain(kind: str, n: int, x: torch.Tensor, w: torch.Tensor, mats: list[torch.Tensor], bufs: list[torch.Tensor],
          pdl: int) -> torch.Tensor:
    h = x
    for i in range(n):
        h = norm(h, w, bufs[i % 2], pdl)
        if kind == "norm_gemm":
            h = h @ mats[i % len(mats)]
    return h


def measure(kind: str, n: int, pdl: int, reps: int) -> tuple[float, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()
    w = torch.rand(4096, device="cuda", generator=gen) + 0.5
    mats = [(torch.randn(4096, 4096, device="cuda", generator=gen) / 64).bfloat16() for _ in range(4)]
    bufs = [torch.empty_like(x), torch.empty_like(x)]
    graph, out = capture_graph(lambda: chain(kind, n, x, w, mats, bufs, pdl), warmup=1)
    result = out.clone()
    return replay_ms(graph, reps) * 1e3, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=result_file("pdl"))
    ap.add_argument("--n", type=int, default=100, help="kernels (or norm+GEMM pairs) per chain")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pdl_bench needs a CUDA GPU")
    device = torch.device("cuda")
    if not pdl_enabled(device):
        raise SystemExit("PDL is off here (below sm_90, the interpreter, or SPARSESERVE_DISABLE_KERNELS=pdl)")
    props = torch.cuda.get_device_properties(0)
    result = {"card": props.name, "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": "python -m benchmarks.pdl_bench "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "timing": "CUDA graph of the chain, replayed back to back; median of 5 rounds", "rows": []}
    ok = True
    for kind in ("norms", "norm_gemm"):
        row = {"chain": kind, "kernels": args.n * (1 if kind == "norms" else 2)}
        outs = {}
        modes = {"plain": 0, **{f"pdl_{name}": value for name, value in TRIGGERS.items()}}
        for _ in range(2):  # alternate, to see drift between runs
            for name, mode in modes.items():
                us, out = measure(kind, args.n, mode, args.reps)
                row.setdefault(f"{name}_us", []).append(round(us, 2))
                outs.setdefault(name, out)
        row["equal"] = all(torch.equal(outs["plain"], out) for out in outs.values())
        ok = ok and row["equal"]
        plain = min(row["plain_us"])
        for name in modes:
            if name != "plain":
                row[f"{name}_saved_us_per_edge"] = round((plain - min(row[f"{name}_us"])) / row["kernels"], 3)
        print(f"{kind:>9}: {row['kernels']} kernels, " + ", ".join(f"{n} {row[n + '_us']} us" for n in modes)
              + ", saved per edge: "
              + ", ".join(f"{n} {row[n + '_saved_us_per_edge']} us" for n in modes if n != "plain")
              + f", outputs equal: {row['equal']}", flush=True)
        result["rows"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
