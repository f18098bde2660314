"""`sparseserve bench serve`: a load generator against a running OpenAI-compatible server, reporting
as `vllm bench serve` does.

Workload: `--num-prompts` prompts of random token ids (`--input-len`, drawn in
[len * (1 - range_ratio), len * (1 + range_ratio)] with `--range-ratio`, seeded), each asking for
`--output-len` tokens (likewise) with `ignore_eos`, streamed from /v1/completions. Arrivals follow a
Poisson process at `--request-rate` (inf: all at once), at most `--max-concurrency` in flight.
Per request: TTFT (send to first token), ITL (gaps between streamed chunks), TPOT ((latency - TTFT) /
(output tokens - 1)) and E2E latency; the summary gives throughput and mean/median/p99 (and
`--percentiles`) of each, printed and, with `--save-result`, written as JSON (default
benchmarks/results/serve.json). The client's own CPU time per output token is reported too: it
shows whether the load generator, one process for every stream, set the pace (`sse_client.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..logger import progress_bar
from .sse_client import Endpoint, HTTPStatusError, stream_events


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="0: fixed lengths; r: uniform in len*(1±r)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: burst")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this "
                                                                    "(default: from /tokenize's model, else 500)")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    parser.add_argument("--save-result", action="store_true", help="write the JSON result")
    parser.add_argument("--result-file", default="benchmarks/results/serve.json")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar (as vLLM's; one is drawn "
                        "only on a terminal anyway)")


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    if ratio <= 0:
        return [mean] * n
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    vocab = args.vocab_size or 500
    ins = _lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outs = _lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    return [([rng.randrange(2, vocab) for _ in range(i)], o) for i, o in zip(ins, outs)]


async def _one(endpoint: Endpoint, model: str | None, prompt: list[int], max_tokens: int, headers: dict,
               timeout_s: float) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout_s):
            async for events in stream_events(endpoint, body, headers):
                now = time.perf_counter()  # the events of one read arrived together
                for data in events:
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = str(exc) if isinstance(exc, HTTPStatusError) else f"{exc.__class__.__name__}: {exc}"
    return result


def _stats(values: list[float], percentiles: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            **{f"p{p:g}": float(np.percentile(arr, p)) for p in percentiles}}


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok], percentiles), "tpot_ms": _stats(tpots, percentiles),
        "itl_ms": _stats([g for r in ok for g in r.itl], percentiles),
        "e2el_ms": _stats([r.latency for r in ok], percentiles),
    }


async def run_async(args) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = Endpoint.from_url(base, args.endpoint)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    percentiles = [float(p) for p in str(args.percentiles).split(",") if p.strip()]
    workload = make_workload(args)
    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = progress_bar(total=len(workload), enabled=not getattr(args, "disable_tqdm", False), desc="Requests")

    async def task(prompt, max_tokens):
        if limit is None:
            result = await _one(endpoint, args.model, prompt, max_tokens, headers, args.timeout_s)
        else:
            async with limit:
                result = await _one(endpoint, args.model, prompt, max_tokens, headers, args.timeout_s)
        bar.update(1)
        return result

    start, cpu_start = time.perf_counter(), time.process_time()
    tasks = []
    for prompt, max_tokens in workload:
        tasks.append(asyncio.create_task(task(prompt, max_tokens)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
    results = await asyncio.gather(*tasks)
    duration, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    bar.close()
    summary = summarize(list(results), duration, percentiles)
    # The load generator's own CPU time: near duration_s means the client, not the server, set the pace.
    summary["client_cpu_s"] = client_cpu
    summary["client_cpu_us_per_output_token"] = 1e6 * client_cpu / max(summary["total_output_tokens"], 1)
    summary["config"] = {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()
                         if isinstance(v, (int, float, str, bool, type(None)))}
    summary["requests"] = [asdict(r) | {"itl": None} for r in results]
    return summary


def report_lines(s: dict) -> list[str]:
    lines = ["============ Serving Benchmark Result ============",
             f"Successful requests:                     {s['completed']}",
             f"Failed requests:                         {s['failed']}",
             f"Benchmark duration (s):                  {s['duration_s']:.2f}",
             f"Total input tokens:                      {s['total_input_tokens']}",
             f"Total generated tokens:                  {s['total_output_tokens']}",
             f"Request throughput (req/s):              {s['request_throughput']:.2f}",
             f"Output token throughput (tok/s):         {s['output_throughput']:.2f}",
             f"Total token throughput (tok/s):          {s['total_token_throughput']:.2f}",
             f"Client CPU per output token (us):        {s.get('client_cpu_us_per_output_token', 0.0):.1f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        for stat, value in s[key].items():
            lines.append(f"{(stat.capitalize() + ' ' + key.split('_')[0].upper() + ' (ms):'):<41}{value:.2f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return lines + ["=" * 50]


def run(args) -> dict:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf for a burst), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    # The start-up heap (numpy, torch through the package) out of the collector's sight while the
    # streams run: every event allocates, and full collections would walk it (as in the server).
    gc.collect()
    gc.freeze()
    try:
        summary = asyncio.run(run_async(args))
    finally:
        gc.unfreeze()
    print("\n".join(report_lines(summary)))
    if args.save_result:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1))
        print(f"saved {path}")
    return summary
