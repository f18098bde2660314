"""Indexer top-k benchmark: standard and persistent paths against torch.topk, same run.

    python -m benchmarks.topk_bench [--out PATH]

Grid (issue 5): rows 1/8/64/256 x widths 8K/64K/256K x k 512/1024, random fp32 rows
(never zeros), full valid length. Each backend is timed eagerly (a Python call) and as a
CUDA-graph replay (the engine's decode step runs in graphs) with triton.testing.do_bench,
median; do_bench flushes L2 before every timed run, so every run reads its scores from HBM.
Correctness is checked on every shape against the reference (exact index sets), on random
rows and on rows with many equal values, half of them at random lengths.

Also: a sweep over more rows/widths (graph replay, both paths) that places the
standard/persistent crossover "auto" uses; tile/warp variants at a few shapes; and
index-like data (many zeros, ties at the k-th score, large scores clustered at the end).

Roofline per row: the scores read once plus the output written once, 4 * (W + k) bytes, at
4.2 TB/s. Speed is reported as time over that floor and as torch.topk's time over ours.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from benchmarks import result_file
from benchmarks.timing import capture_graph
from sparseserve.kernels.topk import IndexerTopK, _bound_chunk, auto_path, topk_indices_ref

HBM_BYTES_PER_S = 4.2e12
PATHS = ("standard", "persistent")


def _bench(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """Median microseconds of fn (do_bench: events, L2 flushed before each run)."""
    return 1000.0 * float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_us(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    graph, _ = capture_graph(fn)
    return _bench(graph.replay, warmup_ms, rep_ms)


def roofline_us(rows: int, width: int, k: int) -> float:
    return rows * 4 * (width + k) / HBM_BYTES_PER_S * 1e6


def make_scores(rows: int, width: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, width, generator=gen, device="cuda")
    if kind == "ties":  # 5 distinct values: ties straddle the k-th score
        return torch.randint(0, 5, (rows, width), generator=gen, device="cuda").float()
    if kind == "relu":  # indexer-like: most scores exactly 0, a positive tail (k-th score > 0)
        return torch.relu(torch.randn(rows, width, generator=gen, device="cuda") - 1.0)
    if kind == "sparse":  # fewer positives than k: the k-th score is 0.0, tied with most of the row
        return torch.relu(torch.randn(rows, width, generator=gen, device="cuda") - 3.5)
    if kind == "recent":  # the largest scores cluster at the end of the row
        return torch.randn(rows, width, generator=gen, device="cuda") + torch.linspace(0, 6, width, device="cuda")
    raise ValueError(kind)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.sort(dim=1).values, b.sort(dim=1).values))


def _check(ops: dict[str, IndexerTopK], rows: int, width: int, k: int, gen: torch.Generator) -> dict[str, bool]:
    """Exact index sets against the reference, on random rows and on rows of 5 distinct values."""
    result = {}
    for kind in ("random", "ties"):
        scores = make_scores(rows, width, kind, gen)
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        lengths[rows // 2:] = torch.randint(1, width + 1, (rows - rows // 2,), generator=gen, device="cuda").int()
        ref = topk_indices_ref(scores, lengths, k)
        for name, op in ops.items():
            result[f"{name}_{kind}"] = _same_sets(op(scores, lengths), ref)
    return result


def grid_cell(rows: int, width: int, k: int, gen: torch.Generator, warmup_ms: int, rep_ms: int,
              persistent_knobs: dict | None = None) -> dict:
    """persistent_knobs: benchmark knobs of the persistent path's IndexerTopK (an experiment's
    variant, timed against the same run's baseline below)."""
    scores = make_scores(rows, width, "random", gen)
    lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    ops = {p: IndexerTopK(rows, width, k, backend=p, **((persistent_knobs or {}) if p == "persistent" else {}))
           for p in PATHS}
    # The same run's baseline: the earlier persistent plan (select chunks one by one, each with its
    # own atomics; bound chunks of at most 16K columns; the finish reorders through memory).
    ops["persistent_session13"] = IndexerTopK(rows, width, k, backend="persistent", _pair_chunks=False,
                                              _bound_chunk=_bound_chunk(width, k, limit=16384),
                                              _finish_gather=False)
    e: dict = {"k": k, "rows": rows, "width": width, "auto_path": auto_path(rows, width)}
    e["correct"] = _check(ops, rows, width, k, gen)
    fns = {"torch_topk": lambda: torch.topk(scores, k, dim=1)}
    fns.update({p: (lambda op=op: op(scores, lengths)) for p, op in ops.items()})
    for name, fn in fns.items():
        e[f"{name}_eager_us"] = _bench(fn, warmup_ms, rep_ms)
        e[f"{name}_graph_us"] = _graph_us(fn, warmup_ms, rep_ms)
    e["roofline_us"] = roofline_us(rows, width, k)
    for mode in ("eager", "graph"):
        t = e[f"torch_topk_{mode}_us"]
        for p in PATHS:
            e[f"speedup_{p}_vs_torch_{mode}"] = t / e[f"{p}_{mode}_us"]
            e[f"roofline_ratio_{p}_{mode}"] = e[f"{p}_{mode}_us"] / e["roofline_us"]
        e[f"speedup_persistent_vs_standard_{mode}"] = e[f"standard_{mode}_us"] / e[f"persistent_{mode}_us"]
        auto_us = e[f"{e['auto_path']}_{mode}_us"]
        e[f"speedup_auto_vs_torch_{mode}"] = t / auto_us
    return e


def run_grid(rows_list, widths, ks, warmup_ms, rep_ms, log, persistent_knobs: dict | None = None) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    entries = []
    for k in ks:
        for width in widths:
            for rows in rows_list:
                e = grid_cell(rows, width, k, gen, warmup_ms, rep_ms, persistent_knobs)
                entries.append(e)
                log(
                    f"k={k:5d} R={rows:4d} W={width:7d} | torch {e['torch_topk_eager_us']:7.1f}/{e['torch_topk_graph_us']:7.1f}"
                    f" | std {e['standard_eager_us']:7.1f}/{e['standard_graph_us']:7.1f}"
                    f" | pers {e['persistent_eager_us']:7.1f}/{e['persistent_graph_us']:7.1f} us (eager/graph)"
                    f" | roof {e['roofline_us']:6.2f} | auto {e['auto_path'][:4]} | ok {all(e['correct'].values())}"
                    + f" | pers, earlier plan {e['persistent_session13_graph_us']:7.1f}"
                )
    return entries


def run_sweep(rows_list, widths, ks, warmup_ms, rep_ms, log) -> list[dict]:
    """Graph-replay times of both paths over more shapes, for the auto crossover."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for k in ks:
        for width in widths:
            for rows in rows_list:
                scores = make_scores(rows, width, "random", gen)
                lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
                e: dict = {"k": k, "rows": rows, "width": width}
                for p in PATHS:
                    op = IndexerTopK(rows, width, k, backend=p)
                    e[f"{p}_graph_us"] = _graph_us(lambda op=op, s=scores, n=lengths: op(s, n), warmup_ms, rep_ms)
                e["faster"] = "persistent" if e["persistent_graph_us"] < e["standard_graph_us"] else "standard"
                e["auto_path"] = auto_path(rows, width)
                out.append(e)
                log(f"sweep k={k} R={rows} W={width}: std {e['standard_graph_us']:.1f} pers {e['persistent_graph_us']:.1f}"
                    f" -> {e['faster']} (auto {e['auto_path']})")
    return out


def run_variants(warmup_ms, rep_ms, log) -> list[dict]:
    """Graph-replay times of tile/warp variants (standard BLOCK, persistent CHUNK); each checked exactly."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    cases = [  # the default first
        (64, 262144, 512, "standard", ((4096, 8), (4096, 16), (8192, 8))),
        (256, 262144, 512, "standard", ((4096, 8), (4096, 16), (8192, 8))),
        (256, 8192, 512, "standard", ((4096, 8), (4096, 16), (8192, 8))),
        (1, 262144, 512, "persistent", ((4096, 8), (2048, 8))),
        (8, 65536, 512, "persistent", ((4096, 8), (2048, 8), (8192, 8))),
        (32, 262144, 512, "persistent", ((8192, 8), (4096, 8))),
    ]
    out = []
    for rows, width, k, path, tiles in cases:
        scores = make_scores(rows, width, "random", gen)
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        want = topk_indices_ref(scores, lengths, k)
        for tile, warps in tiles:
            op = IndexerTopK(rows, width, k, backend=path, _tile=tile, _warps=warps)
            ok = _same_sets(op(scores, lengths), want)
            us = _graph_us(lambda op=op, s=scores, n=lengths: op(s, n), warmup_ms, rep_ms)
            out.append({"rows": rows, "width": width, "k": k, "path": path, "tile": tile, "warps": warps,
                        "graph_us": us, "correct": ok})
            log(f"variant R={rows} W={width} k={k} {path} tile={tile} warps={warps}: {us:.1f} us ok={ok}")
    return out


def run_data_kinds(warmup_ms, rep_ms, log) -> list[dict]:
    """Graph-replay times on index-like data (the tie and clustered cases), both paths, checked."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    out = []
    for rows, width, k in ((1, 262144, 512), (64, 262144, 512)):
        ops = {p: IndexerTopK(rows, width, k, backend=p) for p in PATHS}
        for kind in ("random", "relu", "sparse", "recent", "ties"):
            scores = make_scores(rows, width, kind, gen)
            lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
            want = topk_indices_ref(scores, lengths, k)
            e: dict = {"rows": rows, "width": width, "k": k, "kind": kind}
            e["torch_topk_graph_us"] = _graph_us(lambda s=scores, kk=k: torch.topk(s, kk, dim=1), warmup_ms, rep_ms)
            for p, op in ops.items():
                e[f"{p}_correct"] = _same_sets(op(scores, lengths), want)
                e[f"{p}_graph_us"] = _graph_us(lambda op=op, s=scores, n=lengths: op(s, n), warmup_ms, rep_ms)
            out.append(e)
            log(f"data {kind:7s} R={rows} W={width}: torch {e['torch_topk_graph_us']:.1f} std {e['standard_graph_us']:.1f}"
                f" pers {e['persistent_graph_us']:.1f} ok {e['standard_correct'] and e['persistent_correct']}")
    return out


def suggest_auto_table(sweep: list[dict], min_speedup: float = 1.3) -> list[tuple[int, int]]:
    """(width, max_rows) per swept width: the largest row count such that the persistent path is
    at least min_speedup x faster than the standard one at it and at every smaller count swept.
    This is what kernels/topk.py's _AUTO_MAX_ROWS_PERSISTENT encodes (issue 5: persistent >= 1.3x
    the standard path wherever auto picks it)."""
    table = []
    for width in sorted({e["width"] for e in sweep}):
        best = 0
        for e in sorted((e for e in sweep if e["width"] == width), key=lambda e: e["rows"]):
            if e["standard_graph_us"] / e["persistent_graph_us"] < min_speedup:
                break
            best = e["rows"]
        table.append((width, best))
    return table


def summary_table(grid: list[dict]) -> str:
    """Markdown table of the grid (graph replay; eager in the JSON)."""
    header = (
        "| k | rows x width | torch.topk graph us | standard graph us | persistent graph us | auto | auto vs torch.topk"
        " (graph / eager torch) | auto time / roofline | pers vs std | correct |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for e in grid:
        a = e["auto_path"]
        lines.append(
            f"| {e['k']} | {e['rows']} x {e['width']} | {e['torch_topk_graph_us']:.1f} | {e['standard_graph_us']:.1f}"
            f" | {e['persistent_graph_us']:.1f} | {a} | {e['torch_topk_graph_us'] / e[f'{a}_graph_us']:.2f}x /"
            f" {e['torch_topk_eager_us'] / e[f'{a}_graph_us']:.2f}x | {e[f'{a}_graph_us'] / e['roofline_us']:.0f}x"
            f" | {e['speedup_persistent_vs_standard_graph']:.2f}x | {'yes' if all(e['correct'].values()) else 'NO'} |"
        )
    return "\n".join(lines)


# Kernel variants the GPU tests and this benchmark compile: (path, k, width, tile, cap, warps[, other knobs]).
# Shape ints are not specialised (do_not_specialize), so one small call per variant fills
# Triton's on-disk cache; --precompile does them in parallel processes (a fresh device
# machine otherwise spends most of a short call compiling them one after another).
PRECOMPILE = [
    *[("standard", k, w, None, None, None) for k in (512, 1024) for w in (8192, 300001)],
    ("standard", 512, 8192, None, 256, None),
    ("standard", 512, 262144, 4096, None, 16),
    ("standard", 512, 262144, 8192, None, 8),
    *[("persistent", k, 262144, t, None, None) for k in (512, 1024) for t in (4096, 8192)],
    *[("persistent", k, 262144, None, None, None, {"_pair_chunks": True, "_bound_chunk": 32768})
      for k in (512, 1024)],  # paired chunks, long bound chunks (many rows)
    # The finish that reorders through memory (--persistent-knobs '{"_finish_gather": false}').
    *[("persistent", k, 262144, None, None, None, {"_finish_gather": False, "_pair_chunks": pair})
      for k in (512, 1024) for pair in (False, True)],
    # The grid's same-run baseline (the earlier plan).
    *[("persistent", k, w, None, None, None, {"_pair_chunks": False, "_bound_chunk": _bound_chunk(w, k, limit=16384),
                                              "_finish_gather": False})
      for k in (512, 1024) for w in (8192, 262144)],
    ("persistent", 1024, 300001, 8192, None, None),
    ("persistent", 512, 65536, 4096, 256, None),
    ("persistent", 512, 262144, 2048, None, None),
]


def _precompile_one(cfg: tuple) -> str:
    path, k, width, tile, cap, warps, *knobs = cfg
    t = time.time()
    scores = torch.randn(2, width, device="cuda")
    lengths = torch.full((2,), width, dtype=torch.int32, device="cuda")
    IndexerTopK(2, width, k, backend=path, _tile=tile, _cap=cap, _warps=warps, **(knobs[0] if knobs else {}))(
        scores, lengths)
    torch.cuda.synchronize()
    return f"{cfg}: {time.time() - t:.1f}s"


def precompile(processes: int, log) -> None:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(processes) as pool:
        for line in pool.imap_unordered(_precompile_one, PRECOMPILE):
            log(f"compiled {line}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=result_file("topk"))
    ap.add_argument("--quick", action="store_true", help="small grid, no sweep/variants (smoke run)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-data", action="store_true")
    ap.add_argument("--sweep-ks", default="512", help="k values of the crossover sweep (comma-separated)")
    ap.add_argument("--precompile", type=int, default=0, metavar="N",
                    help="only fill Triton's kernel cache, with N processes, and exit")
    ap.add_argument("--persistent-knobs", type=json.loads, default=None, metavar="JSON",
                    help='benchmark knobs of the persistent path in the grid, e.g. \'{"_finish_gather": false}\'')
    ap.add_argument("--warmup-ms", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("topk_bench needs a CUDA GPU")
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    if args.precompile:
        precompile(args.precompile, log)
        return 0
    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "card": props.name,
        "sm_count": props.multi_processor_count,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python -m benchmarks.topk_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "timing": "triton.testing.do_bench median (L2 flushed before each run); eager = Python call, graph = CUDA-graph replay",
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "roofline": "rows * 4 * (width + k) bytes (scores read once, output written once) at hbm_bytes_per_s",
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.quick:
        rows_list, widths, ks = [1, 64], [8192, 262144], [512]
    else:
        rows_list, widths, ks = [1, 8, 64, 256], [8192, 65536, 262144], [512, 1024]
    result["persistent_knobs"] = args.persistent_knobs or {}
    result["grid"] = run_grid(rows_list, widths, ks, args.warmup_ms, args.rep_ms, log, args.persistent_knobs)
    save()
    if not args.quick and not args.no_data:
        result["data_kinds"] = run_data_kinds(args.warmup_ms, args.rep_ms, log)
        save()
    if not args.quick and not args.no_sweep:
        sweep_ks = [int(k) for k in args.sweep_ks.split(",")]
        result["sweep"] = run_sweep(
            [1, 2, 4, 8, 16, 32, 64, 128, 256], [8192, 16384, 32768, 65536, 131072, 262144], sweep_ks,
            args.warmup_ms, args.rep_ms, log,
        )
        # Per k, then the smaller row limit of the two at each width (auto does not know k's speed).
        per_k = {k: suggest_auto_table([e for e in result["sweep"] if e["k"] == k]) for k in sweep_ks}
        result["suggested_auto_max_rows_persistent_per_k"] = {str(k): table for k, table in per_k.items()}
        result["suggested_auto_max_rows_persistent"] = [
            (width, min(dict(table)[width] for table in per_k.values())) for width, _ in per_k[sweep_ks[0]]]
        log(f"suggested auto table (width, max rows for persistent): {result['suggested_auto_max_rows_persistent']}"
            f" (per k: {per_k})")
        save()
    if not args.quick and not args.no_variants:
        result["variants"] = run_variants(args.warmup_ms, args.rep_ms, log)
        save()
    ok = all(all(e["correct"].values()) for e in result["grid"])
    ok = ok and all(e["standard_correct"] and e["persistent_correct"] for e in result.get("data_kinds", []))
    ok = ok and all(e["correct"] for e in result.get("variants", []))
    print(summary_table(result["grid"]), flush=True)
    log(f"all correct: {ok}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
