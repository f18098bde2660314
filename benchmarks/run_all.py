"""The seed workload and its comparisons in one call (sized for one 10-minute H200 run).

    python benchmarks/run_all.py            # the seed workload: input 1024, output 128, 200 prompts
    python benchmarks/run_all.py --quick    # a smaller workload, for a first look or a tight budget
    python benchmarks/run_all.py --only graphs --kernels kernels,topk_bench   # then micro-benchmarks of benchmarks/

On `v4-flash-2l16e` with dummy weights (real V4-Flash layer shapes, 2 layers, 16 experts) it runs
`sparseserve bench throughput` for: this engine with CUDA graphs (the default, top-k `auto`), with
`--enforce-eager`, the `transformers` baseline (`--backend hf`, batches of 50), and each other
top-k backend (`standard`, `persistent`, `torch`); then `sparseserve bench latency` at batch 1, 8
and 64, and `transformers` latency at batch 1 and 8 if time is left.

Everything runs in this one process by default, sharing one copy of the dummy weights, and one
engine between consecutive runs with the same engine options (the latency runs share one;
`reused_engine` marks the runs that did not build their own). `--isolate` runs every
configuration as its own `python -m sparseserve.entrypoints.cli` process instead (slower: each
builds its engine and weights, but a crash cannot take the others down).

Each run has a time limit cut from `--budget-s`; a run that no longer fits is recorded as
skipped. `benchmarks/results/seed_workload.json` is rewritten after every run, so a cut-off call
still leaves its partial results. Last come the plots (matplotlib, if installed):
`seed_workload_throughput.png` (output tokens/s per configuration against the workload's floor)
and `seed_workload_latency_vs_batch.png` (decode tokens/s vs batch, decode step time and prefill
time vs their rooflines), then a short table. Every result records its equivalent command line.

`--kernels` then runs micro-benchmarks of this folder (`kernels`, `decode_graphs`, `topk_bench`, ...), each as its own
process writing `<out-dir>/<its name>.json`, in the budget that is left (`benchmarks/results/README.md` lists them).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "results"


class RunTimeout(Exception):
    pass


# ---- the plan ----
def plan(args) -> list[dict]:
    """(name, kind, flags) of every run, most important first."""
    if args.quick:
        num_prompts, output_len, lat_out, lat_iters = 50, 64, 16, 1
    else:
        num_prompts, output_len, lat_out, lat_iters = 200, 128, 64, 2
    num_prompts = args.num_prompts or num_prompts
    output_len = args.output_len or output_len
    lat_out = args.latency_output_len or lat_out
    lat_iters = args.latency_iters or lat_iters
    common = ["--model", args.model, "--load-format", "dummy", *args.engine_flag]
    workload = ["--input-len", str(args.input_len), "--output-len", str(output_len),
                "--num-prompts", str(num_prompts), "--num-warmup-prompts", str(args.warmup_prompts),
                *(["--warmup-full"] if args.warmup_full else [])]
    lat = ["--input-len", str(args.input_len), "--output-len", str(lat_out), "--num-iters", str(lat_iters),
           "--num-iters-warmup", "1"]
    tput = lambda *extra: ["bench", "throughput", *common, *workload, *extra]  # noqa: E731
    latency = lambda b, *extra: ["bench", "latency", *common, *lat, "--batch-size", str(b), *extra]  # noqa: E731
    # The acceptance comparisons first; the latency runs (same engine options, so one process shares
    # one engine between them) after them.
    out = [
        {"name": "graphs", "kind": "throughput", "argv": tput()},
        {"name": "graphs-sync", "kind": "throughput", "argv": tput("--async-scheduling", "false")},
        {"name": "eager", "kind": "throughput", "argv": tput("--enforce-eager")},
        {"name": "hf", "kind": "throughput", "argv": tput("--backend", "hf", "--hf-batch-size", str(args.hf_batch_size))},
        {"name": "topk-standard", "kind": "throughput", "argv": tput("--topk-backend", "standard")},
        {"name": "topk-persistent", "kind": "throughput", "argv": tput("--topk-backend", "persistent")},
        {"name": "topk-torch", "kind": "throughput", "argv": tput("--topk-backend", "torch")},
    ]
    out += [{"name": f"latency-b{b}", "kind": "latency", "argv": latency(b)} for b in args.latency_batches]
    if not args.skip_hf_latency:
        out += [{"name": f"hf-latency-b{b}", "kind": "latency", "argv": latency(b, "--backend", "hf")}
                for b in (1, 8)]
    if args.only:
        wanted = set(args.only.split(","))
        out = [r for r in out if r["name"] in wanted]
    if args.skip_hf:
        out = [r for r in out if "--backend" not in r["argv"]]
    return out


# ---- running one configuration ----
@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises RunTimeout in this (main) thread after `seconds`; the engine loop is Python, so it stops."""
    def handler(signum, frame):
        raise RunTimeout(f"stopped after {seconds:.0f} s (the run's share of --budget-s)")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_in_process(run: dict, limit_s: float) -> dict:
    from sparseserve.benchmarks import latency, throughput
    from sparseserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(run["argv"])
    module = throughput if run["kind"] == "throughput" else latency
    with time_limit(limit_s):
        return module.run(args)


def run_isolated(run: dict, limit_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "sparseserve.entrypoints.cli", *run["argv"], "--output-json", str(out)]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=limit_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            raise RunTimeout(f"stopped after {limit_s:.0f} s (the run's share of --budget-s)") from exc
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())


# ---- the kernel micro-benchmarks (--kernels) ----
# (module in benchmarks/, result file stem), in the order --kernels all runs them.
KERNEL_BENCHMARKS = (
    ("kernels", "kernels"), ("decode_graphs", "decode_graphs"), ("topk_bench", "topk"), ("moe_bench", "moe"),
    ("gemv_bench", "gemv"), ("pdl_bench", "pdl"), ("compressor_bench", "compressor"), ("rope_bench", "rope"),
    ("mhc_bench", "mhc"), ("hbm_size_ceiling", "hbm_size_ceiling"),
)


def kernel_benchmark_names(wanted: str) -> set[str]:
    """The modules `--kernels` names ('all' or a comma list); an unknown name stops the call before any run."""
    known = {m for m, _ in KERNEL_BENCHMARKS}
    names = known if wanted == "all" else set(wanted.split(","))
    if names - known:
        raise SystemExit(f"--kernels: unknown benchmark(s) {sorted(names - known)}; "
                         f"known: {', '.join(m for m, _ in KERNEL_BENCHMARKS)} or 'all'")
    return names


def run_kernel_benchmarks(wanted: str, out_dir: Path, deadline: float) -> dict:
    """Each selected micro-benchmark as its own process, writing `<out_dir>/<stem>.json`; its status by module."""
    names = kernel_benchmark_names(wanted)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    status = {}
    for module, stem in KERNEL_BENCHMARKS:
        if module not in names:
            continue
        left = deadline - time.perf_counter()
        if left < 30:
            status[module] = "skipped: out of time (--budget-s)"
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{module}", "--out", str(out_dir / f"{stem}.json")]
        print(f"\n[run_all] {shlex.join(cmd[1:])} (limit {left:.0f} s)", flush=True)
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=left).returncode
            status[module] = "ok" if code == 0 else f"failed: exit code {code}"
        except subprocess.TimeoutExpired:
            status[module] = "timeout"
    return status


# ---- summary, plots, table ----
def workload_floor(model: str, input_len: int, output_len: int, num_prompts: int, max_num_seqs: int = 256) -> dict:
    """Prefill FLOPs at the bf16 rate plus one weight read per decode step (the H200 ceilings in docs/performance.md)."""
    from sparseserve.benchmarks.latency import (BF16_FLOPS_PER_S, HBM_BYTES_PER_S, decode_weight_bytes,
                                                model_facts, prefill_flops)

    facts = model_facts(model)
    batch = min(num_prompts, max_num_seqs)
    waves = -(-num_prompts // batch)
    prefill_s = prefill_flops(facts, num_prompts * input_len, num_prompts) / BF16_FLOPS_PER_S
    decode_s = waves * (output_len - 1) * decode_weight_bytes(facts, batch) / HBM_BYTES_PER_S
    total = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": total,
            "output_tokens_per_s": num_prompts * output_len / total,
            "note": "bf16 GEMM 790 TFLOP/s for prefill matmuls + HBM 4.23 TB/s weight reads per decode step "
                    "(H200 ceilings, docs/performance.md); attention and activations not counted"}


def summarize(results: dict) -> dict:
    tput = {k: v for k, v in results["throughput"].items() if "output_tokens_per_second" in v}
    out: dict = {}
    hf = tput.get("hf", {}).get("output_tokens_per_second")
    if hf:
        out["speedup_vs_hf"] = {k: v["output_tokens_per_second"] / hf for k, v in tput.items() if k != "hf"}
    if "graphs" in tput and "eager" in tput:
        out["graphs_over_eager"] = tput["graphs"]["output_tokens_per_second"] / tput["eager"]["output_tokens_per_second"]
    goals = {}
    if hf and "graphs" in tput:
        goals["20x_transformers"] = out["speedup_vs_hf"]["graphs"] >= 20
    if "graphs_over_eager" in out:
        goals["graphs_2x_eager"] = out["graphs_over_eager"] >= 2
    out["goals"] = goals
    return out


def make_plots(results: dict, out_dir: Path, stem: str = "seed_workload") -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # matplotlib is optional
        print(f"[run_all] no plots: matplotlib is not available ({exc})")
        return []
    from sparseserve.benchmarks.latency import (BF16_FLOPS_PER_S, HBM_BYTES_PER_S, decode_weight_bytes,
                                                model_facts, prefill_flops)

    written = []
    tput = {k: v for k, v in results["throughput"].items() if "output_tokens_per_second" in v}
    if tput:
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(tput) + 1.8))
        names = list(tput)
        values = [tput[n]["output_tokens_per_second"] for n in names]
        colors = ["tab:gray" if n == "hf" else "tab:blue" for n in names]
        ax.barh(names, values, color=colors)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
        floor = results.get("workload_floor", {}).get("output_tokens_per_s")
        if floor:
            ax.axvline(floor, color="tab:red", linestyle="--", label=f"workload floor {floor:,.0f}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xscale("log")
        ax.invert_yaxis()
        w = results["meta"]["workload"]
        ax.set_xlabel("output tokens/s (log)")
        ax.set_title(f"{results['meta']['model']}: {w['num_prompts']} prompts, in {w['input_len']}, "
                     f"out {w['output_len']}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{stem}_throughput.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    lat = {k: v for k, v in results["latency"].items() if v.get("decode_step", {}).get("count")}
    if lat:
        facts = model_facts(results["meta"]["model"])
        series: dict[str, list] = {}
        for v in lat.values():
            series.setdefault(v["backend"], []).append(v)
        batches = sorted({v["batch_size"] for v in lat.values()})
        grid = sorted(set(batches) | {1, 2, 4, 8, 16, 32, 64, 128, 256})
        grid = [b for b in grid if b <= max(batches) * 2]
        floor_ms = [decode_weight_bytes(facts, b, 2) / HBM_BYTES_PER_S * 1e3 for b in grid]
        input_len = next(iter(lat.values()))["input_len"]
        prefill_floor_ms = [prefill_flops(facts, b * input_len, b) / BF16_FLOPS_PER_S * 1e3 for b in grid]
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4))
        for backend, vs in series.items():
            vs = sorted(vs, key=lambda v: v["batch_size"])
            bs = [v["batch_size"] for v in vs]
            a1.plot(bs, [v["decode_tokens_per_s"] for v in vs], "o-", label=backend)
            a2.plot(bs, [v["decode_step"]["p50_ms"] for v in vs], "o-", label=f"{backend} p50")
            a2.fill_between(bs, [v["decode_step"]["min_ms"] for v in vs], [v["decode_step"]["p99_ms"] for v in vs],
                            alpha=0.2)
            a3.plot(bs, [v["prefill_per_iteration"]["p50_ms"] for v in vs], "o-", label=f"{backend} p50")
        a1.plot(grid, [b / (f / 1e3) for b, f in zip(grid, floor_ms)], "--", color="tab:red",
                label="weight-read floor")
        a2.plot(grid, floor_ms, "--", color="tab:red", label="weight-read floor (4.23 TB/s)")
        a3.plot(grid, prefill_floor_ms, "--", color="tab:red", label="matmul floor (790 TFLOP/s)")
        for ax, ylabel, title in ((a1, "decode output tokens/s", "decode throughput vs batch"),
                                  (a2, "decode step (ms)", "decode step time vs roofline"),
                                  (a3, "prefill of the batch (ms)", f"prefill ({input_len} tokens/seq) vs roofline")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch (sequences)")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}_latency_vs_batch.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def table(results: dict) -> str:
    lines = []
    tput = results["throughput"]
    hf = tput.get("hf", {}).get("output_tokens_per_second")
    lines.append(f"{'throughput':<17}{'req/s':>9}{'total tok/s':>14}{'output tok/s':>14}{'time s':>9}{'vs hf':>8}")
    for name, r in tput.items():
        if "same_as" in r:
            lines.append(f"{name:<17}= {r['same_as']}")
            continue
        if "output_tokens_per_second" not in r:
            lines.append(f"{name:<17}{r.get('status', 'failed')}: {str(r.get('error', ''))[:70]}")
            continue
        vs = f"{r['output_tokens_per_second'] / hf:.1f}x" if hf and name != "hf" else ""
        earlier = ", ".join(f"{e['output_tokens_per_second']:,.0f}" for e in r.get("earlier_rounds", [])
                            if "output_tokens_per_second" in e)
        jit = r.get("triton_builds_in_timed_run", 0)
        lines.append(f"{name:<17}{r['requests_per_second']:>9.2f}{r['tokens_per_second']:>14,.0f}"
                     f"{r['output_tokens_per_second']:>14,.0f}{r['elapsed_time']:>9.2f}{vs:>8}"
                     + (f"   (earlier rounds: {earlier})" if earlier else "")
                     + (f"   [{jit} Triton builds in the timed run: includes JIT time]" if jit else ""))
    floor = results.get("workload_floor")
    if floor:
        lines.append(f"{'floor':<17}{'':>9}{'':>14}{floor['output_tokens_per_s']:>14,.0f}{floor['total_s']:>9.2f}")
    lat = results["latency"]
    if lat:
        lines.append(f"{'latency':<17}{'batch':>6}{'prefill/it ms':>15}{'decode p50':>12}{'p90':>9}{'p99':>9}"
                     f"{'floor ms':>10}{'tok/s':>10}")
        for name, r in lat.items():
            if not r.get("decode_step", {}).get("count"):
                lines.append(f"{name:<17}{r.get('status', 'failed')}: {str(r.get('error', ''))[:70]}")
                continue
            d = r["decode_step"]
            fl = r.get("roofline", {}).get("decode_step_floor_ms")
            lines.append(f"{name:<17}{r['batch_size']:>6}{r['prefill_per_iteration']['p50_ms']:>15.2f}"
                         f"{d['p50_ms']:>12.3f}{d['p90_ms']:>9.3f}{d['p99_ms']:>9.3f}"
                         f"{(f'{fl:.3f}' if fl else ''):>10}{r['decode_tokens_per_s']:>10,.0f}")
    s = results.get("summary", {})
    if "speedup_vs_hf" in s and "graphs" in s["speedup_vs_hf"]:
        lines.append(f"graphs vs transformers: {s['speedup_vs_hf']['graphs']:.1f}x output tok/s (goal >= 20x)")
    if "graphs_over_eager" in s:
        lines.append(f"graphs vs eager: {s['graphs_over_eager']:.2f}x (goal >= 2x)")
    return "\n".join(lines)


def environment() -> dict:
    env = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:
        pass
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        # A copied working tree (the device machine's) can differ from its HEAD: say so.
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout
        env["git_tree_differs_from_commit"] = bool(status.strip())
    except Exception:
        env["git_commit"] = None
    return env


def record_skip(section: dict, name: str, command: str) -> None:
    """A run cut by the budget: recorded as skipped, unless an earlier round of it has a result,
    which is kept (and counts the skipped later rounds)."""
    earlier = section.get(name)
    if earlier is not None and earlier.get("status") not in (None, "skipped"):
        earlier["later_rounds_skipped"] = earlier.get("later_rounds_skipped", 0) + 1
    else:
        section[name] = {"status": "skipped", "error": "out of time (--budget-s)", "command": command}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="50 prompts, output 64; shorter latency runs")
    p.add_argument("--model", default="v4-flash-2l16e", help="preset or checkpoint directory (dummy weights)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=None, help="default 128 (64 with --quick)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 200 (50 with --quick)")
    p.add_argument("--hf-batch-size", type=int, default=50)
    p.add_argument("--warmup-prompts", type=int, default=8, help="untimed prompts per throughput run")
    p.add_argument("--no-warmup-full", dest="warmup_full", action="store_false",
                   help="skip the untimed full pass of the workload before each timed throughput run (then the "
                        "first run in the process pays the JIT compilation of step shapes the warm-up missed)")
    p.add_argument("--latency-output-len", type=int, default=None, help="default 64 (16 with --quick)")
    p.add_argument("--latency-iters", type=int, default=None, help="timed iterations, default 2 (1 with --quick)")
    p.add_argument("--latency-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    p.add_argument("--engine-flag", action="append", default=[],
                   help="extra flag passed to every run, e.g. --engine-flag=--max-num-seqs=256")
    p.add_argument("--only", default=None, help="comma-separated run names (graphs, graphs-sync, eager, hf, topk-standard, "
                   "topk-persistent, topk-torch, latency-b1, ..., hf-latency-b1, hf-latency-b8)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers runs")
    p.add_argument("--skip-hf-latency", action="store_true", help="no transformers latency runs")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for the whole call")
    p.add_argument("--max-run-s", type=float, default=150.0, help="limit for any one run")
    p.add_argument("--isolate", action="store_true", help="one process per run (each loads the weights)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--name", default="seed_workload", help="results file stem")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole list this many times, round-robin; each run reports its last round "
                        "(the machine's first minutes were measured ~20%% slower) and keeps the earlier ones")
    p.add_argument("--kernels", default="", metavar="NAMES",
                   help="after the workload, also run these micro-benchmarks of benchmarks/ ('all' or a comma list of "
                        "kernels, decode_graphs, topk_bench, moe_bench, gemv_bench, pdl_bench, compressor_bench, "
                        "rope_bench, mhc_bench, hbm_size_ceiling), each writing <out-dir>/<name>.json in the budget left")
    p.add_argument("--fresh", action="store_true",
                   help="with --only: do not keep the other runs' results already in the results file")
    args = p.parse_args(argv)
    if args.kernels:
        kernel_benchmark_names(args.kernels)

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    reserve_s = 15.0  # plots, table, last write
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    runs = plan(args) * max(args.rounds, 1)
    first = next((r for r in runs if r["kind"] == "throughput"), None)
    workload = {}
    if first is not None:
        argv_ = first["argv"]
        workload = {k: int(argv_[argv_.index(f"--{k.replace('_', '-')}") + 1])
                    for k in ("input_len", "output_len", "num_prompts")}
    results = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "model": args.model, "load_format": "dummy", "quick": args.quick, "workload": workload,
                 "command": "python benchmarks/run_all.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
                 "mode": "isolated processes" if args.isolate else "one process, shared dummy weights",
                 "environment": environment()},
        "throughput": {}, "latency": {}, "summary": {}, "plots": [],
    }
    if workload:
        try:
            results["workload_floor"] = workload_floor(args.model, **workload)
        except Exception as exc:
            results["workload_floor"] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.only and json_path.is_file() and not args.fresh:
        # A follow-up call for some runs: keep the other runs' results of the earlier call.
        try:
            earlier = json.loads(json_path.read_text())
        except (OSError, ValueError):
            earlier = None
        if earlier:
            for section in ("throughput", "latency"):
                for name, value in earlier.get(section, {}).items():
                    results[section].setdefault(name, value)
            results["meta"]["merged_with"] = {k: earlier.get("meta", {}).get(k) for k in ("date", "command")}
            if earlier.get("meta", {}).get("workload") != workload and workload:
                results["meta"]["warning"] = "the earlier call's workload differs; compare with care"

    from sparseserve.benchmarks.throughput import shared_weights, write_json

    def save():
        results["summary"] = summarize(results)
        results["elapsed_s"] = time.perf_counter() - t_start
        write_json(str(json_path), results)

    save()
    sharing = contextlib.nullcontext() if args.isolate else shared_weights()
    with sharing:
        for i, run in enumerate(runs):
            section = results["throughput" if run["kind"] == "throughput" else "latency"]
            command = "sparseserve " + shlex.join(run["argv"])
            remaining = deadline - time.perf_counter() - reserve_s
            limit = min(args.max_run_s, remaining)
            if limit < 20:
                record_skip(section, run["name"], command)
                print(f"[run_all] {run['name']}: skipped, {remaining:.0f} s left")
                save()
                continue
            print(f"\n[run_all] {run['name']} ({i + 1}/{len(runs)}, limit {limit:.0f} s): {command}", flush=True)
            t0 = time.perf_counter()
            try:
                runner = run_isolated if args.isolate else run_in_process
                result = runner(run, limit)
                result["status"] = "ok"
            except RunTimeout as exc:
                result = {"status": "timeout", "error": str(exc)}
            except BaseException as exc:  # one failing configuration must not stop the others
                if isinstance(exc, KeyboardInterrupt):
                    raise
                tb = io.StringIO()
                traceback.print_exc(file=tb)
                result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": tb.getvalue()[-4000:]}
                print(f"[run_all] {run['name']} failed: {type(exc).__name__}: {exc}", flush=True)
                del exc
            if result["status"] != "ok":
                from sparseserve.benchmarks.throughput import free_device_memory

                free_device_memory()
            result["command"] = command
            result["wall_s"] = time.perf_counter() - t0
            result["round"] = i // (len(runs) // max(args.rounds, 1)) + 1
            earlier = section.get(run["name"])
            if earlier is not None and earlier.get("round") is not None and earlier["round"] < result["round"]:
                result["earlier_rounds"] = earlier.pop("earlier_rounds", []) + [earlier]
            section[run["name"]] = result
            if run["name"] == "graphs" and result["status"] == "ok":
                section["topk-auto"] = {"same_as": "graphs", "note": "topk_backend='auto' is the default run",
                                        "command": command}
            save()
    try:
        results["plots"] = make_plots(results, args.out_dir, args.name)
    except Exception as exc:
        results["plots"] = [f"plotting failed: {type(exc).__name__}: {exc}"]
    save()
    print(f"\n[run_all] wrote {json_path}" + (f" and {len(results['plots'])} plot(s)" if results["plots"] else "")
          + f" in {time.perf_counter() - t_start:.0f} s\n")
    print(table(results))
    if args.kernels:
        status = run_kernel_benchmarks(args.kernels, args.out_dir, deadline)
        print("\n[run_all] micro-benchmarks: " + ", ".join(f"{m} {st}" for m, st in status.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
