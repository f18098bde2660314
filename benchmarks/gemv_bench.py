"""Batch-1 projections: the weight-stream kernel (kernels/gemv.py) against cuBLAS, same run (H200).

For each V4-Flash projection of a batch-1 decode step, two timings per path, each a CUDA graph
replayed back to back (kernel time without host launch cost):
  * `cold`: calls that cycle through copies of the weight (>= 256 MB in all), so every call reads
    its weight from HBM, not L2;
  * `chain`: each call preceded by a dependent RMSNorm of x (a Triton PDL kernel, as in the step),
    cold weights too: what the kernel's first-tile read before the PDL wait buys, against cuBLAS,
    which starts reading only after the norm has completed.
Reported: us per call, TB/s of weight read, ratio to the weight-read floor at the copy rate
measured in the same process, and kernel vs cuBLAS. `--sweep` times other tile configs.

    python -m benchmarks.gemv_bench [--sweep] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from benchmarks import result_file
from benchmarks.ceilings import hbm_bandwidth
from benchmarks.timing import capture_graph, replay_ms
from sparseserve.kernels import gemv
from sparseserve.kernels.rmsnorm import rms_norm_triton

# (case, N, K, groups): the projections of a V4-Flash layer at batch 1 (LM head: cuBLAS, at 4.3 TB/s).
CASES = [
    ("CSA x-projections (packed)", 4160, 4096, 1),
    ("HCA x-projections (packed)", 2560, 4096, 1),
    ("q_b + indexer q_b (packed)", 40960, 1024, 1),
    ("o_a (8 groups)", 8192, 4096, 8),
    ("o_b", 4096, 8192, 1),
    ("shared expert gate+up (packed)", 4096, 4096, 1),
    ("shared expert down", 4096, 2048, 1),
]
SWEEP = [(4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 4),
         (4, 1024, 4), (8, 1024, 8)]


def cublas(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return F.linear(x, w)
    n, k = w.shape  # the model's grouped path: one batched GEMM into the group-major output
    out = torch.empty(1, groups, n // groups, dtype=x.dtype, device=x.device)
    torch.bmm(x.view(1, groups, k).transpose(0, 1), w.view(groups, n // groups, k).transpose(1, 2),
              out=out.transpose(0, 1))
    return out.view(1, n)


def time_calls(fn, copies: list[torch.Tensor], x: torch.Tensor, norm_w: torch.Tensor | None) -> float:
    """us per call: one graph of len(copies) calls (each on its own weight copy), replayed."""
    def body():
        for w in copies:
            inp = rms_norm_triton(x, norm_w, 1e-6) if norm_w is not None else x
            fn(inp, w)

    graph, _ = capture_graph(body, warmup=1)
    return replay_ms(graph, reps=5) * 1e3 / len(copies)


def run_case(name: str, n: int, k: int, groups: int, copy_bps: float, sweep: bool, log) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, groups * k, device="cuda", generator=gen).bfloat16()
    w0 = (torch.randn(n, k, device="cuda", generator=gen) / 32).bfloat16()
    copies = [w0] + [w0.clone() for _ in range(max(1, (256 << 20) // w0.nbytes + 1) - 1)]
    norm_w = torch.rand(groups * k, device="cuda", generator=gen) + 0.5
    bytes_read = w0.nbytes + x.nbytes + n * 2
    floor_us = bytes_read / copy_bps * 1e6
    want = cublas(x, w0, groups)
    got = gemv.gemv_triton(x, w0, groups)
    scale = want.float().abs().max().item()
    correct = bool(((got.float() - want.float()).abs() <= 2 ** -6 * scale).all())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"case": name, "n": n, "k": k, "groups": groups, "weight_bytes": w0.nbytes, "floor_us": floor_us,
           "config": list(gemv.gemv_config(n, k, groups, num_sms)), "correct": correct}
    for mode, nw in (("cold", None), ("chain", norm_w)):
        row[f"cublas_{mode}_us"] = time_calls(lambda a, w: cublas(a, w, groups), copies, x, nw)
        row[f"kernel_{mode}_us"] = time_calls(lambda a, w: gemv.gemv_triton(a, w, groups), copies, x, nw)
    row["kernel_tb_s"] = w0.nbytes / row["kernel_cold_us"] / 1e6
    row["cublas_tb_s"] = w0.nbytes / row["cublas_cold_us"] / 1e6
    row["kernel_over_floor"] = row["kernel_cold_us"] / floor_us
    row["speedup_vs_cublas_cold"] = row["cublas_cold_us"] / row["kernel_cold_us"]
    row["speedup_vs_cublas_chain"] = row["cublas_chain_us"] / row["kernel_chain_us"]
    log(f"{name:<32} floor {floor_us:6.1f} | cuBLAS {row['cublas_cold_us']:6.1f} ({row['cublas_tb_s']:.2f} TB/s), "
        f"chain {row['cublas_chain_us']:6.1f} | kernel {row['kernel_cold_us']:6.1f} ({row['kernel_tb_s']:.2f} TB/s), "
        f"chain {row['kernel_chain_us']:6.1f} | x{row['speedup_vs_cublas_cold']:.2f} / "
        f"x{row['speedup_vs_cublas_chain']:.2f} | {row['config']} ok {correct}")
    if sweep:
        row["sweep"] = []
        for cfg in SWEEP:
            if (n // groups) % cfg[0] or triton.next_power_of_2(k) < cfg[1]:
                continue
            us = time_calls(lambda a, w, cfg=cfg: gemv.gemv_triton(a, w, groups, config=cfg), copies, x, None)
            row["sweep"].append({"config": list(cfg), "cold_us": us})
            log(f"    {cfg}: {us:6.1f} us ({w0.nbytes / us / 1e6:.2f} TB/s)")
    del copies
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=result_file("gemv"))
    ap.add_argument("--sweep", action="store_true", help="also time the configs of SWEEP (cold weights)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_bench needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    copy_bps = hbm_bandwidth()
    result = {"card": props.name, "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__, "copy_bytes_per_s": copy_bps,
              "command": "python -m benchmarks.gemv_bench "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "timing": "CUDA graph of calls over >= 256 MB of weight copies, replayed back to back", "cases": []}
    t0 = datetime.datetime.now()

    def log(msg: str) -> None:
        print(f"[{(datetime.datetime.now() - t0).total_seconds():6.1f}s] {msg}", flush=True)

    log(f"copy rate {copy_bps / 1e12:.2f} TB/s")
    for case in CASES:
        result["cases"].append(run_case(*case, copy_bps, args.sweep, log))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r["correct"] for r in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
