"""Where a top-k call's time goes: each kernel's GPU duration, and the whole call as a graph replay.

    PYTHONPATH=. python tools/topk_phases.py --out $OUT/topk_phases.json

For each (rows, width, k) and path: the device time of every kernel of one call (torch.profiler,
mean over the profiled calls; a kernel's duration includes its last-arriving program's tail), their
sum, and the replay time of the call captured alone in a CUDA graph (median of CUDA-event timed
replays of 20 calls each; scores stay in L2, unlike topk_bench's flushed runs). The difference
between the replay and the kernel sum is launch and dependency latency. --flush adds each kernel's
time with L2 flushed before every call, as topk_bench times it. Diagnostic only; the benchmark holds
the reported numbers.
"""
from __future__ import annotations

import argparse
import json
import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve.benchmarks.mhc_bench import graph_ms
from sparseserve.kernels.topk import IndexerTopK, topk_indices_ref

SHAPES = ((1, 8192), (1, 65536), (1, 262144), (8, 65536), (8, 262144), (64, 65536))


FLUSH_KERNEL = "distribution_elementwise"  # the kernel of Tensor.random_, the L2 flush below


# Variant sets the runs may add (each: store_true).
VARIANT_FLAGS = {
    "--variants": "also the persistent path with other grids, chunks and register caps",
    "--select-variants": "also the persistent select kernel at 4K/2K chunks and 4 warps (two programs per SM)",
    "--step-cost": "also the persistent path with fewer search steps (inexact; timing only) and other warps",
    "--pair-variants": "also the persistent path with its select chunks never / always paired",
    "--bound-variants": "also the persistent bound kernel with other chunks and warps",
    "--finish-variants": "also the persistent path whose finish reorders the candidates through memory (_finish_gather=False, before session 15)",
    "--flush": "also each kernel's time with L2 flushed before every call (scores read from HBM)",
}


def kernel_times(fn, calls: int, flush: torch.Tensor | None = None) -> dict[str, float]:
    """Mean device microseconds per call of each kernel name. flush: a buffer larger than L2,
    rewritten before every call (its kernel is left out), so that the scores come from HBM as
    in topk_bench's timings."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if flush is not None:
                flush.random_()
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.self_device_time_total > 0 and FLUSH_KERNEL not in event.key:
            times[event.key[:60]] = event.self_device_time_total / calls
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="topk_phases.json")
    ap.add_argument("--paths", default="persistent,standard")
    for flag, help_text in VARIANT_FLAGS.items():
        ap.add_argument(flag, action="store_true", help=help_text)
    ap.add_argument("--ks", default="512,1024")
    ap.add_argument("--shapes", default=None, help="e.g. 8x262144,1x65536 (default: the built-in list)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs = [(path, {}) for path in args.paths.split(",")]
    if args.variants:
        runs += [("persistent", {"num_programs": sms}), ("persistent", {"_maxnreg": 128}),
                 ("persistent", {"_maxnreg": 128, "_tile": 4096, "num_programs": 4 * sms}),
                 ("persistent", {"_tile": 4096, "num_programs": 4 * sms}), ("persistent", {"_chunks_per_item": 1})]
    if args.select_variants:  # the select kernel alone: smaller programs, two per SM, items of 1-4 chunks
        for chunk, per_item, programs in ((4096, 2, 2 * sms), (4096, 1, 4 * sms), (4096, 4, sms), (2048, 4, 2 * sms)):
            runs.append(("persistent", {"_select_chunk": chunk, "_select_warps": 4, "_chunks_per_item": per_item,
                                        "num_programs": programs}))
    if args.step_cost:  # what one search step costs: fewer steps (inexact results), other warp counts
        runs += [("persistent", {"_lb_steps": 4}), ("persistent", {"_exact_steps": 8}),
                 ("persistent", {"_lb_steps": 4, "_exact_steps": 8}), ("persistent", {"_warps": 4}),
                 ("persistent", {"_warps": 16})]
    if args.pair_variants:
        runs += [("persistent", {"_pair_chunks": False}), ("persistent", {"_pair_chunks": True})]
    if args.bound_variants:
        runs += [("persistent", {"_bound_chunk": chunk, "_bound_warps": warps})
                 for chunk, warps in ((8192, 8), (32768, 8), (32768, 16))]
    if args.finish_variants:
        runs += [("persistent", {"_finish_gather": False})]
    shapes = SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(","))
    # 256 MiB int32 (L2 is 50 MiB): rewritten before each flushed call
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda") if args.flush else None
    results = []
    for k in (int(x) for x in args.ks.split(",")):
        for rows, width in shapes:
            scores = torch.randn(rows, width, device="cuda")
            lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
            want = topk_indices_ref(scores, lengths, k).sort(dim=1).values
            for path, options in runs:
                topk = IndexerTopK(rows, width, k, backend=path, device="cuda", **options)
                fn = lambda: topk(scores, lengths)  # noqa: E731
                exact = bool(torch.equal(fn().sort(dim=1).values, want))  # the variants are checked too
                torch.cuda.synchronize()
                kernels = kernel_times(fn, 10)
                flushed = kernel_times(fn, 10, flush) if args.flush else {}
                entry = {"k": k, "rows": rows, "width": width, "path": path, "options": options, "kernels_us": kernels,
                         "kernels_l2_flushed_us": flushed, "exact": exact,
                         "kernel_sum_us": sum(kernels.values()), "graph_replay_us": 1000.0 * graph_ms(fn, 20, 30)}
                results.append(entry)
                names = ", ".join(f"{name.split('(')[0][:28]} {us:.1f}" for name, us in kernels.items())
                label = path + "".join(f" {key.strip('_')}={value}" for key, value in options.items())
                print(f"k={k} {rows}x{width} {label:<34} replay {entry['graph_replay_us']:7.1f} us  "
                      f"kernels {entry['kernel_sum_us']:7.1f} us: {names}" + ("" if exact else "  NOT EXACT"), flush=True)
                if flushed:
                    names = ", ".join(f"{name.split('(')[0][:28]} {us:.1f}" for name, us in flushed.items())
                    print(f"{'':>20} L2 flushed: kernels {sum(flushed.values()):7.1f} us: {names}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
