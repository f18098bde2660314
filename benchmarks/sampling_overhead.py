"""Decode step time with logits processing: a batch where a quarter of the requests use penalties
(repetition, frequency, presence), a logit bias and a JSON-schema structured output, against the
same batch where none do.

    python benchmarks/sampling_overhead.py [--model PATH_OR_PRESET] [--tokenizer DIR] [--load-format dummy] [--batch 64]
    python benchmarks/sampling_overhead.py --smoke          # CPU, tiny model, a few steps (CI)
    python benchmarks/sampling_overhead.py --profile        # also: where the host's time per step goes
    python benchmarks/sampling_overhead.py --stub-model --profile --repeat 5   # CPU: the host's cost alone

Writes benchmarks/results/sampling_overhead.json (or --out). A step's time is the wall time of
`LLMEngine.step()` once every request is decoding (the prefill steps and the steps after the
first request finished are left out). Nothing synchronises between steps: in steady state each
`step()` waits for the step before it, so its wall time is the period at which steps complete,
with the async overlap of host and device as a server gets it. A grammar needs the previous token
on the host, so those steps read the previous step back while the next forward runs and queue
the sampling after it; the JSON shows what that costs.

`--stub-model` measures the host's cost alone on the CPU: the tiny checkpoint (its tokenizer drives
the grammars) with the model replaced by benchmarks/host_overhead.py's FixedLogitsModel, decode
steps built as on CUDA (padded to a bucket) and async scheduling on, as on CUDA. Every step's
device work is then a few small CPU ops, so what is timed is the engine's Python, the torch
dispatch of the sampling ops and the grammar work. On a shared CPU, compare medians of several
runs (`--repeat`), the thread CPU time, the profile's call counts and `--count-ops`."""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparseserve import LLM, RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402

# Unbounded, so the requests of the timed steps do not end early by completing the grammar.
SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}}},
          "required": ["values"]}


# The feature sets timed: none, each kind alone on a quarter of the batch, and both (the goal's case).
FEATURES = {"none": (), "quarter_penalties": ("penalties",), "quarter_json": ("json",),
            "quarter_penalties_and_json": ("penalties", "json")}


def workload(batch: int, prompt_len: int, max_tokens: int, vocab: int, features: tuple[str, ...]):
    gen = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(batch):
        prompts.append({"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()})
        extra = {}
        if i % 4 == 0 and "penalties" in features:
            extra.update(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2, logit_bias={5: 1.0})
        if i % 4 == 0 and "json" in features:
            extra["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                     output_kind=RequestOutputKind.FINAL_ONLY, **extra))
    return prompts, params


# The sampling path's entry points, whose cumulative time per step the profile reports.
SAMPLING_FUNCTIONS = ("step", "launch_sampling", "_process_logits", "process_logits", "fill_bitmask", "accept",
                      "sample", "_append_token")


def host_profile(profile: cProfile.Profile, steps: int, top: int = 15) -> dict:
    """Per decode step: the functions with the most host time (cProfile's own time) with their calls,
    the function calls in all, and the cumulative time of the sampling path's entry points."""
    stats = pstats.Stats(profile).stats
    steps = max(steps, 1)
    rows = sorted(((vals[2], vals[1], f"{Path(f).name}:{line}:{fn}") for (f, line, fn), vals in stats.items()),
                  reverse=True)
    cumulative: dict[str, float] = {}
    for (f, line, fn), vals in stats.items():
        if fn in SAMPLING_FUNCTIONS and "sparseserve" in f:
            key = f"{Path(f).name}:{fn}"
            cumulative[key] = cumulative.get(key, 0.0) + 1e6 * vals[3] / steps
    return {"host_profile": [{"function": name, "us_per_step": 1e6 * t / steps, "calls_per_step": n / steps}
                             for t, n, name in rows[:top]],
            "host_calls_per_step": sum(vals[1] for vals in stats.values()) / steps,
            "host_cumulative_us_per_step": dict(sorted(cumulative.items()))}


class OpCounter:
    """Counts the aten ops run (on a GPU each is a kernel launch or a copy) while enabled; `torch.tensor`
    from host values shows as lift_fresh (a host -> device copy on a GPU)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.__name__.split(".")[0]] += 1
                return func(*args, **(kwargs or {}))

        self._new_mode = Mode
        self._mode = None

    def enable(self) -> None:
        self._mode = self._new_mode()
        self._mode.__enter__()

    def disable(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def report(self, steps: int) -> dict:
        steps = max(steps, 1)
        ops = {k: v / steps for k, v in self.counts.most_common()}
        return {"aten_ops_per_step": sum(ops.values()), "host_tensors_per_step": ops.get("lift_fresh", 0.0),
                "aten_ops": ops}


def time_steps(llm: LLM, prompts, params, profile: cProfile.Profile | OpCounter | None = None) -> dict:
    engine = llm.llm_engine
    for n, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{n}", p, sp)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times, cpu_times = [], []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running) and \
            len(engine.scheduler.running) == len(prompts)
        if profile is not None and decoding:
            profile.enable()
        start, cpu_start = time.perf_counter(), time.thread_time()
        finished = engine.step()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        if profile is not None:
            profile.disable()
        if decoding and not finished:
            times.append(elapsed)
            cpu_times.append(cpu)
    times, cpu_times = times[2:] or times, cpu_times[2:] or cpu_times  # the first decode steps may build kernels
    # thread_cpu_ms: the CPU time of this thread per step, which other processes on a shared CPU do not inflate.
    result = {"steps": len(times), "median_ms": 1e3 * statistics.median(times),
              "mean_ms": 1e3 * statistics.fmean(times),
              "thread_cpu_ms": 1e3 * statistics.median(cpu_times)}
    if isinstance(profile, OpCounter):
        result.update(profile.report(len(times) + 2))
    elif profile is not None:
        result.update(host_profile(profile, len(times) + 2))
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: the demo model)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (structured outputs need one)")
    ap.add_argument("--load-format", default="auto", help="'dummy' for a preset without weights")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, batch 4, a few steps")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, run each workload again under cProfile and record where the host's "
                         "time per decode step goes (the timed figures are not profiled)")
    ap.add_argument("--count-ops", action="store_true",
                    help="after the timed runs, count the torch ops per decode step of each workload (deterministic, "
                         "unlike times on a shared CPU)")
    ap.add_argument("--stub-model", action="store_true",
                    help="CPU, the tiny model with its forward stubbed by fixed logits: the host's cost alone")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per workload (the median of their medians)")
    ap.add_argument("--out", default=None, help="the report's path (default: benchmarks/results/"
                    "sampling_overhead.json, or sampling_overhead_cpu_stub.json with --stub-model)")
    args = ap.parse_args(argv)
    kwargs = {"load_format": args.load_format}
    if args.tokenizer:
        kwargs["tokenizer"] = args.tokenizer
    if args.smoke:
        from sparseserve.model.loader import CONFIGS_DIR

        args.model, args.batch, args.prompt_len, args.steps, args.device = str(CONFIGS_DIR / "tiny"), 4, 8, 6, "cpu"
        kwargs["dtype"] = "float32"
    if args.stub_model:
        from sparseserve.model.loader import CONFIGS_DIR

        args.model, args.device, kwargs["dtype"] = str(CONFIGS_DIR / "tiny"), "cpu", "float32"
        kwargs["async_scheduling"] = True  # as on CUDA: pending tokens, and deferred sampling for grammars
        torch.set_num_threads(1)  # the ops are tiny: intra-op threads only add wake-up waits on a shared CPU
    llm = LLM(args.model, device=args.device, max_model_len=args.prompt_len + args.steps + 8,
              max_num_seqs=max(args.batch, 1), **kwargs)
    vocab = llm.llm_engine.vocab_size
    if args.stub_model:
        from benchmarks.host_overhead import install_stub

        install_stub(llm.llm_engine.runner, max(args.batch, 1))
    results = {}
    for name, features in FEATURES.items():
        prompts, params = workload(args.batch, args.prompt_len, args.steps, vocab, features)
        runs = [time_steps(llm, prompts, params) for _ in range(max(args.repeat, 1))]
        results[name] = {"steps": runs[0]["steps"], "median_ms": statistics.median(r["median_ms"] for r in runs),
                         "mean_ms": statistics.fmean(r["mean_ms"] for r in runs),
                         "thread_cpu_ms": statistics.median(r["thread_cpu_ms"] for r in runs)}
        if len(runs) > 1:
            results[name]["run_medians_ms"] = [r["median_ms"] for r in runs]
            results[name]["run_thread_cpu_ms"] = [r["thread_cpu_ms"] for r in runs]
    if args.profile:
        for name, features in FEATURES.items():
            prompts, params = workload(args.batch, args.prompt_len, args.steps, vocab, features)
            profiled = time_steps(llm, prompts, params, cProfile.Profile())
            results[name].update({k: v for k, v in profiled.items() if k.startswith("host_")})
    if args.count_ops:
        for name, features in FEATURES.items():
            prompts, params = workload(args.batch, args.prompt_len, args.steps, vocab, features)
            counted = time_steps(llm, prompts, params, OpCounter())
            results[name].update({k: v for k, v in counted.items() if "ops" in k or "host_tensors" in k})
    base, other = results["none"]["median_ms"], results["quarter_penalties_and_json"]["median_ms"]
    report = {"device": torch.cuda.get_device_name() if llm.llm_engine.device.type == "cuda" else "cpu",
              "model": args.model or "demo", "stub_model": args.stub_model, "batch": args.batch,
              "prompt_len": args.prompt_len,
              "decode_steps": args.steps, "async_scheduling": llm.llm_engine.async_scheduling,
              "results": results, "slowdown": other / base - 1.0,
              "slowdown_by_feature": {k: v["median_ms"] / base - 1.0 for k, v in results.items() if k != "none"}}
    out = Path(args.out or ROOT / "benchmarks" / "results" /
               ("sampling_overhead_cpu_stub.json" if args.stub_model else "sampling_overhead.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
