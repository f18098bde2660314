"""Indexer top-k benchmark: standard and persistent paths against torch.topk, same run.

    PYTHONPATH=. python -m sparseserve.benchmarks.topk_bench --out benchmarks/results/topk.json

Grid (issue 5): rows 1/8/64/256 x widths 8K/64K/256K x k 512/1024, random fp32 rows
(never zeros), full valid length. Each backend is timed eagerly and as a CUDA-graph replay
(the engine's decode step runs in graphs) with triton.testing.do_bench, median; do_bench
flushes L2 before every timed run, so every run reads its scores from HBM. Correctness is
checked on every shape against the reference (exact index sets), on random rows and on
rows with many equal values. A sweep over more rows/widths (graph replay) places the
standard/persistent crossover that "auto" uses. Roofline: R*W*4 bytes at 4.2 TB/s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Callable

import torch
import triton
import triton.testing

from sparseserve.kernels.topk import IndexerTopK, auto_path, topk_indices_ref

HBM_BYTES_PER_S = 4.2e12


def _bench(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """Median microseconds of fn (do_bench: events, L2 flushed before each run)."""
    return 1000.0 * float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.sort(dim=1).values, b.sort(dim=1).values))


def _check(ops: dict[str, IndexerTopK], rows: int, width: int, k: int, gen: torch.Generator) -> dict[str, bool]:
    """Exact index sets against the reference, on random rows and on rows of 5 distinct values."""
    result = {}
    for kind in ("random", "ties"):
        if kind == "random":
            scores = torch.randn(rows, width, generator=gen, device="cuda")
        else:
            scores = torch.randint(0, 5, (rows, width), generator=gen, device="cuda").float()
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        lengths[rows // 2:] = torch.randint(1, width + 1, (rows - rows // 2,), generator=gen, device="cuda").int()
        ref = topk_indices_ref(scores, lengths, k)
        for name, op in ops.items():
            result[f"{name}_{kind}"] = _same_sets(op(scores, lengths), ref)
    return result


def run_grid(rows_list, widths, ks, warmup_ms, rep_ms, log) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    entries = []
    for k in ks:
        for width in widths:
            for rows in rows_list:
                scores = torch.randn(rows, width, generator=gen, device="cuda")
                lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
                ops = {p: IndexerTopK(rows, width, k, backend=p) for p in ("standard", "persistent")}
                e: dict = {"k": k, "rows": rows, "width": width, "auto_path": auto_path(rows, width)}
                e["correct"] = _check(ops, rows, width, k, gen)
                fns = {
                    "torch_topk": lambda: torch.topk(scores, k, dim=1),
                    "standard": lambda: ops["standard"](scores, lengths),
                    "persistent": lambda: ops["persistent"](scores, lengths),
                }
                for name, fn in fns.items():
                    e[f"{name}_eager_us"] = _bench(fn, warmup_ms, rep_ms)
                    graph = _graph_of(fn)
                    e[f"{name}_graph_us"] = _bench(graph.replay, warmup_ms, rep_ms)
                    del graph
                e["roofline_us"] = rows * width * 4 / HBM_BYTES_PER_S * 1e6
                for mode in ("eager", "graph"):
                    t = e[f"torch_topk_{mode}_us"]
                    e[f"speedup_standard_vs_torch_{mode}"] = t / e[f"standard_{mode}_us"]
                    e[f"speedup_persistent_vs_torch_{mode}"] = t / e[f"persistent_{mode}_us"]
                    e[f"speedup_persistent_vs_standard_{mode}"] = e[f"standard_{mode}_us"] / e[f"persistent_{mode}_us"]
                    best = min(e[f"standard_{mode}_us"], e[f"persistent_{mode}_us"])
                    e[f"roofline_ratio_best_{mode}"] = best / e["roofline_us"]
                entries.append(e)
                log(
                    f"k={k:5d} R={rows:4d} W={width:7d} | torch {e['torch_topk_eager_us']:8.1f}/{e['torch_topk_graph_us']:8.1f}"
                    f" | std {e['standard_eager_us']:8.1f}/{e['standard_graph_us']:8.1f}"
                    f" | pers {e['persistent_eager_us']:8.1f}/{e['persistent_graph_us']:8.1f} us (eager/graph)"
                    f" | roof {e['roofline_us']:6.1f} | ok {all(e['correct'].values())}"
                )
                del scores, lengths, ops
    return entries


MINI = [  # (rows, width, k, paths): few compiles, for a short device call
    (1, 262144, 512, ("standard", "persistent")),
    (8, 65536, 512, ("standard", "persistent")),
    (256, 8192, 512, ("standard",)),
    (256, 262144, 512, ("standard",)),
]


def run_mini(warmup_ms, rep_ms, log) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    entries = []
    for rows, width, k, paths in MINI:
        scores = torch.randn(rows, width, generator=gen, device="cuda")
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        ops = {p: IndexerTopK(rows, width, k, backend=p) for p in paths}
        e: dict = {"k": k, "rows": rows, "width": width, "auto_path": auto_path(rows, width)}
        e["correct"] = _check(ops, rows, width, k, gen)
        fns = {"torch_topk": lambda: torch.topk(scores, k, dim=1)}
        fns.update({p: (lambda op=op: op(scores, lengths)) for p, op in ops.items()})
        for name, fn in fns.items():
            e[f"{name}_eager_us"] = _bench(fn, warmup_ms, rep_ms)
            graph = _graph_of(fn)
            e[f"{name}_graph_us"] = _bench(graph.replay, warmup_ms, rep_ms)
            del graph
        e["roofline_us"] = rows * width * 4 / HBM_BYTES_PER_S * 1e6
        entries.append(e)
        log("mini " + json.dumps({key: (round(v, 1) if isinstance(v, float) else v) for key, v in e.items()}))
        del scores, lengths, ops
    return entries


def run_sweep(rows_list, widths, ks, warmup_ms, rep_ms, log) -> list[dict]:
    """Graph-replay times of both paths over more shapes, for the auto crossover."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for k in ks:
        for width in widths:
            for rows in rows_list:
                scores = torch.randn(rows, width, generator=gen, device="cuda")
                lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
                e: dict = {"k": k, "rows": rows, "width": width}
                for p in ("standard", "persistent"):
                    op = IndexerTopK(rows, width, k, backend=p)
                    graph = _graph_of(lambda: op(scores, lengths))
                    e[f"{p}_graph_us"] = _bench(graph.replay, warmup_ms, rep_ms)
                    del graph, op
                e["faster"] = "persistent" if e["persistent_graph_us"] < e["standard_graph_us"] else "standard"
                out.append(e)
                log(f"sweep k={k} R={rows} W={width}: std {e['standard_graph_us']:.1f} pers {e['persistent_graph_us']:.1f} -> {e['faster']}")
    return out


def run_variants(shapes, warmup_ms, rep_ms, log) -> list[dict]:
    """Graph-replay times of tile variants (standard BLOCK, persistent CHUNK); each checked exactly."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = []
    for rows, width, k in shapes:
        scores = torch.randn(rows, width, generator=gen, device="cuda")
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        want = IndexerTopK(rows, width, k, backend="standard")(scores, lengths).clone()
        for path, tiles in (("standard", (2048, 4096, 8192)), ("persistent", (1024, 2048, 4096, 8192))):
            for tile in tiles:
                op = IndexerTopK(rows, width, k, backend=path, _tile=tile)
                ok = bool(torch.equal(op(scores, lengths), want))
                graph = _graph_of(lambda: op(scores, lengths))
                us = _bench(graph.replay, warmup_ms, rep_ms)
                del graph, op
                out.append({"rows": rows, "width": width, "k": k, "path": path, "tile": tile, "graph_us": us, "correct": ok})
                log(f"variant R={rows} W={width} k={k} {path} tile={tile}: {us:.1f} us ok={ok}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/topk.json")
    ap.add_argument("--quick", action="store_true", help="small grid, short timings (smoke run)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--mini", action="store_true", help="four shapes, k=512 only (a short device call)")
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("topk_bench needs a CUDA GPU")

    def log(msg: str) -> None:
        print(msg, flush=True)

    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "card": props.name,
        "sm_count": props.multi_processor_count,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python -m sparseserve.benchmarks.topk_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "timing": "triton.testing.do_bench median (L2 flushed before each run); eager = Python call, graph = CUDA-graph replay",
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.mini:
        result["mini"] = run_mini(args.warmup_ms, args.rep_ms, log)
        save()
        ok = all(all(e["correct"].values()) for e in result["mini"])
        log(f"all correct: {ok}; wrote {args.out}")
        return 0 if ok else 1
    if args.quick:
        rows_list, widths, ks = [1, 64], [8192, 262144], [512]
    else:
        rows_list, widths, ks = [1, 8, 64, 256], [8192, 65536, 262144], [512, 1024]
    result["grid"] = run_grid(rows_list, widths, ks, args.warmup_ms, args.rep_ms, log)
    save()
    if not args.quick:
        result["variants"] = run_variants(
            [(1, 262144, 512), (8, 65536, 512), (64, 262144, 512), (256, 262144, 512)], 5, 20, log
        )
        save()
    if not args.no_sweep and not args.quick:
        result["sweep"] = run_sweep(
            [1, 2, 4, 8, 16, 32, 64, 128, 256], [8192, 16384, 32768, 65536, 131072, 262144], [512, 1024],
            5, 20, log,
        )
        save()
    ok = all(all(e["correct"].values()) for e in result["grid"])
    log(f"all correct: {ok}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
