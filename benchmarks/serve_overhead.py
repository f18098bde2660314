"""The server's cost per token: `sparseserve bench throughput` offline, then `sparseserve serve` on a
free port with `sparseserve bench serve` against it at concurrencies 1, 8, 64 and 200, in one run.

    python -m benchmarks.serve_overhead --tokenizer DIR          # v4-flash-2l16e, dummy weights, the GPU
    python -m benchmarks.serve_overhead --smoke                  # CPU, the tiny model, seconds (CI)
    python -m benchmarks.serve_overhead --stub-model             # CPU: the host's cost alone (serve_stub.py)

Each phase runs in its own process: the offline benchmark (its engine freed when it exits), the
server, and the load generator (this process: it loads no model). The workload is the seed
workload's, 1024 prompt tokens -> 128 output tokens of random token ids with `ignore_eos`; each
concurrency c runs its own prompt count (6, 32, 128, 200) after one untimed warm-up run against the
server. Written to benchmarks/results/serve_overhead.json (or --out): offline output tok/s; per
concurrency output tok/s, TTFT / TPOT / ITL median and p99, the load generator's CPU per output
token, the server process's CPU per output token (from /proc), and the server's extra time per
output token against offline, 1e6 / server tok/s - 1e6 / offline tok/s (offline runs all 200
prompts at once, so the c = 200 row is the like-for-like one).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import result_file, write_result  # noqa: E402

CLI = [sys.executable, "-m", "sparseserve.entrypoints.cli"]
# (concurrency, prompts) of the timed runs.
RUNS = ((1, 6), (8, 32), (64, 128), (200, 200))
SMOKE_RUNS = ((1, 2), (4, 6))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args) -> list[str]:
    flags = ["--model", args.model, "--load-format", args.load_format, "--seed", "0"]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    if args.smoke:
        flags += ["--device", "cpu", "--dtype", "float32"]
    return flags + shlex.split(args.engine_args)


STUB = [sys.executable, "-m", "benchmarks.serve_stub"]


def run_offline(args, flags: list[str], work: Path) -> dict:
    out = work / "offline.json"
    if args.stub_model:
        cmd = STUB + ["offline", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--num-prompts", str(args.offline_prompts), "--out", str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT, timeout=args.phase_timeout_s, stdout=sys.stderr)
        return json.loads(out.read_text())
    cmd = CLI + ["bench", "throughput", *flags, "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--num-prompts", str(args.offline_prompts), "--num-warmup-prompts",
                 str(args.warmup_prompts), "--output-json", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=args.phase_timeout_s, stdout=sys.stderr)
    return json.loads(out.read_text())


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def running_server(args, flags: list[str], log_path: Path):
    """`sparseserve serve` on a free localhost port: yields (base_url, process); stopped on exit."""
    port = free_port()
    with open(log_path, "w") as log:
        cmd = (STUB + ["serve", "--port", str(port)] if args.stub_model else
               CLI + ["serve", *flags, "--port", str(port), "--uvicorn-log-level", "warning"])
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.phase_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n"
                                   f"{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready in {args.phase_timeout_s:.0f} s:\n"
                                   f"{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def bench_serve(url: str, args, concurrency: int, prompts: int, vocab: int, output_len: int | None = None) -> dict:
    from sparseserve.benchmarks import serve
    from sparseserve.entrypoints.cli import build_parser

    bench_args = build_parser().parse_args([
        "bench", "serve", "--base-url", url, "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--input-len", str(args.input_len), "--output-len", str(output_len or args.output_len),
        "--vocab-size", str(vocab), "--disable-tqdm", "--timeout-s", str(args.phase_timeout_s)])
    summary = serve.run(bench_args)
    if summary["failed"]:
        raise RuntimeError(f"bench serve at concurrency {concurrency}: {summary['failed']} requests failed: "
                           f"{summary['errors']}")
    return summary


def row(summary: dict, offline_tps: float, server_cpu_s: float | None) -> dict:
    tps = summary["output_throughput"]
    out = {"num_prompts": summary["completed"], "output_tok_s": tps, "ratio_to_offline": tps / offline_tps,
           "extra_us_per_output_token": 1e6 / tps - 1e6 / offline_tps,
           "client_cpu_us_per_output_token": summary["client_cpu_us_per_output_token"],
           "server_cpu_us_per_output_token": (1e6 * server_cpu_s / summary["total_output_tokens"]
                                              if server_cpu_s is not None else None)}
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[key] = {"median": summary[key]["median"], "p99": summary[key]["p99"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="v4-flash-2l16e", help="preset or checkpoint directory")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (the preset's 129,280-token one)")
    ap.add_argument("--engine-args", default="--max-model-len 2048",
                    help="more engine flags for both the offline run and the server (one string)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--offline-prompts", type=int, default=200)
    ap.add_argument("--warmup-prompts", type=int, default=16, help="untimed prompts before the timed runs")
    ap.add_argument("--phase-timeout-s", type=float, default=600.0,
                    help="the longest a phase (offline run, server start, one bench run) may take")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, short prompts: seconds")
    ap.add_argument("--stub-model", action="store_true",
                    help="CPU, the tiny model with its forward stubbed (benchmarks/serve_stub.py), 32 in / 64 out: "
                         "the host's cost per token alone; compare the CPU per token figures")
    ap.add_argument("--out", default=None, help="the report's path (default: benchmarks/results/serve_overhead.json; "
                                               "with --smoke a file in the temporary directory)")
    args = ap.parse_args(argv)
    runs = RUNS
    if args.smoke:
        from sparseserve.model.loader import CONFIGS_DIR

        args.model, args.load_format, args.tokenizer = str(CONFIGS_DIR / "tiny"), "auto", None
        args.engine_args = "--max-model-len 64 --max-num-seqs 8"
        args.input_len, args.output_len, args.offline_prompts, args.warmup_prompts = 16, 8, 8, 2
        args.phase_timeout_s = min(args.phase_timeout_s, 120.0)
        runs = SMOKE_RUNS
    elif args.stub_model:
        from sparseserve.model.loader import CONFIGS_DIR

        args.model, args.load_format, args.tokenizer, args.engine_args = str(CONFIGS_DIR / "tiny"), "auto", None, ""
        args.input_len, args.output_len = 32, 64
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "serve_overhead_smoke.json") if args.smoke
                            else result_file("serve_overhead_cpu_stub") if args.stub_model
                            else result_file("serve_overhead"))
    from sparseserve.benchmarks.throughput import vocab_size_of

    vocab = vocab_size_of(args.model, None)
    flags = engine_flags(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        offline = run_offline(args, flags, work)
        offline_tps = offline["output_tokens_per_second"]
        results = {}
        with running_server(args, flags, work / "server.log") as (url, proc):
            bench_serve(url, args, max(c for c, _ in runs), args.warmup_prompts, vocab, output_len=8)  # warm-up
            for concurrency, prompts in runs:
                cpu_before = process_cpu_s(proc.pid)
                summary = bench_serve(url, args, concurrency, prompts, vocab)
                cpu_after = process_cpu_s(proc.pid)
                server_cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
                results[str(concurrency)] = row(summary, offline_tps, server_cpu)
    report = {"benchmark": "serve_overhead", "model": args.model, "load_format": args.load_format,
              "tokenizer": args.tokenizer, "engine_args": flags, "device": offline.get("device"),
              "input_len": args.input_len, "output_len": args.output_len, "smoke": args.smoke,
              "stub_model": args.stub_model,
              "offline": {"num_prompts": args.offline_prompts, "output_tok_s": offline_tps,
                          "cpu_us_per_output_token": offline.get("cpu_us_per_output_token")},
              "by_concurrency": results, "wall_s": time.perf_counter() - started,
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "command": " ".join(["python -m benchmarks.serve_overhead",
                                   *(argv if argv is not None else sys.argv[1:])])}
    write_result(out_path, report)
    print(json.dumps({k: v for k, v in report.items() if k != "engine_args"}, indent=1))
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
