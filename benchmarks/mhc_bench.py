"""Benchmark of the fused mHC kernels against the unfused PyTorch path (H200).

    python -m benchmarks.mhc_bench [--tokens 1,64,8192] [--sweep] [--decode old|new|ab]
                                                         [--between 1,2,4] [--out PATH]

V4-Flash shapes: hc 4, D 4096, bf16 streams, fp32 fn [24, 16384] (the head: [4, 16384]).
"old" is the reference path exactly as the model ran it before the fused kernels (fp32 copy of
the streams, the Triton RMSNorm, an fp32 F.linear, the Triton Sinkhorn kernel, the collapse in
PyTorch; the expand as a batched 4x4 matmul); "new" the Triton path. Each case is captured as a
CUDA graph of `reps` back-to-back calls and replayed (so launch overhead does not dominate);
ms per call = median replay time / reps. At T=1 and 64 the inputs stay in L2 across calls.
Roofline bytes (the minimum): collapse (2*hc + 1)*T*D*2 + fn, expand (2*hc + 1)*T*D*2 (see
kernels/mhc.py), against the measured device copy rate (4.23 TB/s).

--sweep times the collapse with alternative mix-kernel configs (BT, BK, warps, K chunks, and the
product: FMA, or a dot as three exact bf16 products, tf32x3 or ieee fp32), with the largest
difference from the default config's post / comb / collapsed.
--between T,... times the steps between two blocks (expand, collapse, RMSNorm) at T tokens: the
unfused kernels against kernels/mhc_fused.py with its finalize at 1, 2, 4 and 8 warps.
--decode old|new|ab times the batch-1 decode forward (graph replay, decode_graphs.measure) with the
fused path off (the unfused mHC path, as before), on, or both in one process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from benchmarks import result_file
from sparseserve.kernels import mhc

HBM_BPS = 4.23e12
HC, DIM, ITERS, EPS = 4, 4096, 20, 1e-6


def graph_ms(fn, reps: int, trials: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def inputs(tokens: int, mixes: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = HC * DIM
    streams = torch.randn(tokens, HC, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    fn = torch.randn(mixes, k, generator=gen, device="cuda") * k ** -0.5
    base = 0.5 * torch.randn(mixes, generator=gen, device="cuda")
    scale = 0.5 + torch.rand(3 if mixes > HC else 1, generator=gen, device="cuda")
    return streams, fn, base, scale


def bench_tokens(tokens: int, sweep: bool) -> list[dict]:
    reps = 5 if tokens >= 4096 else 50
    rows = []
    streams, fn, base, scale = inputs(tokens, (2 + HC) * HC)
    _, hfn, hbase, hscale = inputs(1, HC, seed=1)
    out = torch.randn(tokens, DIM, device="cuda").to(torch.bfloat16)
    post, comb, _ = mhc.hc_collapse_ref(streams, fn, base, scale, HC, ITERS, EPS, EPS)
    k = HC * DIM
    collapse_bytes = (2 * HC + 1) * tokens * DIM * 2 + fn.numel() * 4
    head_bytes = (2 * HC + 1) * tokens * DIM * 2 + hfn.numel() * 4
    expand_bytes = (2 * HC + 1) * tokens * DIM * 2 + tokens * (HC + HC * HC) * 4
    cases = {
        "collapse": (collapse_bytes,
                     lambda: mhc.hc_collapse_ref(streams, fn, base, scale, HC, ITERS, EPS, EPS),
                     lambda: mhc.hc_collapse_triton(streams, fn, base, scale, HC, ITERS, EPS, EPS)),
        "head": (head_bytes,
                 lambda: mhc.hc_head_collapse_ref(streams, hfn, hbase, hscale, EPS, EPS),
                 lambda: mhc.hc_head_collapse_triton(streams, hfn, hbase, hscale, EPS, EPS)),
        "expand": (expand_bytes,
                   lambda: mhc.hc_expand_ref(streams, out, post, comb),
                   lambda: mhc.hc_expand_triton(streams, out, post, comb)),
    }
    for name, (nbytes, old, new) in cases.items():
        old_ms, new_ms = graph_ms(old, reps), graph_ms(new, reps)
        floor_ms = 1e3 * nbytes / HBM_BPS
        rows.append({"case": name, "tokens": tokens, "old_ms": old_ms, "new_ms": new_ms, "floor_ms": floor_ms,
                     "speedup": old_ms / new_ms, "new_over_floor": new_ms / floor_ms,
                     "config": mhc.mix_config(tokens, k) if name != "expand" else dict(zip(
                         ("TB", "BD"), mhc.row_config(tokens, DIM)))})
        print(json.dumps(rows[-1]), flush=True)
    if sweep:
        ref = mhc.hc_collapse_triton(streams, fn, base, scale, HC, ITERS, EPS, EPS)
        # (BT, BK, warps, fma, prec, K chunks or None for the default rule)
        if tokens <= 4:
            variants = [(1, 64, 4, True, "ieee", None), (1, 128, 4, True, "ieee", None), (1, 64, 4, True, "ieee", 64),
                        (1, 64, 4, True, "ieee", 256), (16, 64, 4, False, "ieee", None),
                        (16, 64, 4, False, "tf32x3", None), (16, 64, 4, False, "bf16x3", None)]
        elif tokens <= 2048:
            variants = [(32, 64, 4, False, "bf16x3", None), (16, 64, 4, False, "bf16x3", None),
                        (64, 64, 4, False, "bf16x3", None), (32, 64, 4, False, "ieee", None),
                        (32, 64, 4, False, "tf32x3", None), (32, 64, 4, False, "bf16x3", 64)]
        else:
            variants = [(128, 64, 8, False, "bf16x3", None), (128, 64, 8, False, "tf32x3", None),
                        (64, 64, 4, False, "bf16x3", None), (128, 128, 8, False, "bf16x3", None),
                        (256, 64, 8, False, "bf16x3", None), (128, 32, 4, False, "bf16x3", None)]
        for bt, bk, warps, fma, prec, splits_target in variants:
            tiles = triton.cdiv(tokens, bt)
            want = splits_target or max(1, min(128, triton.cdiv(mhc.TARGET_PROGRAMS, tiles), triton.cdiv(k, bk)))
            chunk = triton.cdiv(triton.cdiv(k, want), bk) * bk
            cfg = {"BT": bt, "BK": bk, "chunk": chunk, "splits": triton.cdiv(k, chunk), "num_warps": warps,
                   "fma": fma, "prec": prec}
            try:
                got = mhc.hc_collapse_triton(streams, fn, base, scale, HC, ITERS, EPS, EPS, cfg)
                diffs = [float((a - b).abs().max()) for a, b in zip(got, ref)]  # post, comb, collapsed
                ms = graph_ms(lambda cfg=cfg: mhc.hc_collapse_triton(streams, fn, base, scale, HC, ITERS, EPS,
                                                                      EPS, cfg), reps)
            except Exception as exc:  # noqa: BLE001 (a config that does not compile is data, not a failure)
                diffs, ms = [float("nan")] * 3, float("nan")
                print(f"config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
            rows.append({"case": "collapse-sweep", "tokens": tokens, "new_ms": ms, "diff_vs_default": diffs,
                         "config": cfg})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_between(tokens: int) -> list[dict]:
    """The steps between two blocks (expand, collapse, the next block's RMSNorm): the unfused
    kernels in order against `mhc_fused` with the finalize at 1-8 warps (its default: 8)."""
    from sparseserve.kernels import mhc_fused
    from sparseserve.kernels.rmsnorm import rms_norm_triton

    streams, fn, base, scale = inputs(tokens, (2 + HC) * HC)
    out = torch.randn(tokens, DIM, device="cuda").to(torch.bfloat16)
    post, comb, _ = mhc.hc_collapse_ref(streams, fn, base, scale, HC, ITERS, EPS, EPS)
    weight = 0.5 + torch.rand(DIM, device="cuda")

    def unfused():
        new = mhc.hc_expand_triton(streams, out, post, comb)
        _, _, collapsed = mhc.hc_collapse_triton(new, fn, base, scale, HC, ITERS, EPS, EPS)
        return rms_norm_triton(collapsed, weight, EPS)

    rows = [{"case": "between-unfused", "tokens": tokens, "ms": graph_ms(unfused, 50)}]
    for warps in (1, 2, 4, 8):
        ms = graph_ms(lambda warps=warps: mhc_fused.hc_expand_collapse_norm_triton(
            streams, out, post, comb, fn, base, scale, HC, ITERS, EPS, EPS, weight, EPS, norm_warps=warps), 50)
        rows.append({"case": "between-fused", "tokens": tokens, "norm_warps": warps, "ms": ms})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def decode_ab(steps: int, which: str) -> list[dict]:
    from benchmarks.decode_graphs import measure

    fused = mhc._fused
    rows = []
    paths = {"old": lambda streams: False, "new": fused}
    for label in (("old", "new") if which == "ab" else (which,)):
        fn = paths[label]
        mhc._fused = fn
        try:
            row = measure("v4-flash-2l16e", 1, False, steps, 256)
        finally:
            mhc._fused = fused
        row["mhc"] = label
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,64,8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--decode", choices=("none", "old", "new", "ab"), default="none",
                        help="batch-1 decode forward (graph replay) with the fused mHC path off (old), on (new) or both")
    parser.add_argument("--between", default="", help="token counts for the between-blocks chain, e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=result_file("mhc"))
    args = parser.parse_args()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        rows += bench_tokens(tokens, args.sweep)
    for tokens in [int(t) for t in args.between.split(",") if t]:
        rows += bench_between(tokens)
    decode = decode_ab(args.steps, args.decode) if args.decode != "none" else []
    print(f"{'case':>9}{'T':>6}{'old ms':>10}{'new ms':>10}{'floor ms':>10}{'speedup':>9}{'new/floor':>10}")
    for r in rows:
        if "old_ms" in r:
            print(f"{r['case']:>9}{r['tokens']:>6}{r['old_ms']:>10.4f}{r['new_ms']:>10.4f}{r['floor_ms']:>10.4f}"
                  f"{r['speedup']:>9.1f}{r['new_over_floor']:>10.2f}")
    sweep = [r for r in rows if r["case"] == "collapse-sweep"]
    for r in sorted(sweep, key=lambda r: (r["tokens"], r["new_ms"])):
        c = r["config"]
        d = r["diff_vs_default"]
        print(f"sweep T={r['tokens']}: {r['new_ms']:.4f} ms  BT {c['BT']} BK {c['BK']} splits {c['splits']} "
              f"warps {c['num_warps']} {'fma' if c['fma'] else c['prec']}  diff post {d[0]:.1e} comb {d[1]:.1e} "
              f"out {d[2]:.1e}")
    for r in decode:
        print(f"decode batch 1 graph, mhc {r['mhc']}: forward {r['forward_ms_median']:.3f} ms, "
              f"step {r['step_ms_median']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "torch": torch.__version__, "triton": triton.__version__, "rows": rows, "decode": decode},
                      f, indent=2)


if __name__ == "__main__":
    main()
