"""`sparseserve bench throughput`: offline throughput on random-token prompts, like vLLM's.

The workload: `num_prompts` prompts of exactly `input_len` random token ids (seeded by `--seed`),
each asked for exactly `output_len` tokens (`ignore_eos=True`, greedy), all submitted at once;
the wall clock is read around `generate` only (engine construction, weight loading and any
warm-up are outside it). `--backend hf` runs the same prompts through `transformers`
(see `hf_baseline.py`), so the baseline is measured in the same run on the same weights.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch

from ..config import EngineConfig
from ..logger import show_progress
from ..model.loader import DEFAULT_MODEL
from .jit_watch import TritonBuilds

BACKENDS = ("sparseserve", "hf")


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` lists of `input_len` token ids, uniform over the vocabulary (reproducible)."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts and input_len must be >= 1, got {num_prompts} and {input_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, input_len), generator=gen).tolist()


def vocab_size_of(model: str | None, hf_overrides: dict | None) -> int:
    """The model's vocabulary size from its config alone (no weights are read)."""
    from ..model.loader import load_hf_config, resolve_model_dir

    model_dir, overrides = resolve_model_dir(model)
    overrides.update(hf_overrides or {})
    return int(load_hf_config(model_dir, overrides).vocab_size)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` keyword arguments the engine flags set (those left at their defaults are not
    passed), plus `--num-speculative-tokens` as an MTP `speculative_config`."""
    from ..engine_args import engine_kwargs as from_flags

    kwargs = from_flags(args)
    spec = getattr(args, "num_speculative_tokens", None)
    if spec:
        if kwargs.get("speculative_config"):
            raise ValueError("give either --num-speculative-tokens or --speculative-config, not both")
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": int(spec)}
    return kwargs


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def add_workload_args(parser: argparse.ArgumentParser, *, input_len: int, output_len: int) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="sparseserve",
                        help="sparseserve (this engine) or hf (transformers DeepseekV4ForCausalLM.generate)")
    parser.add_argument("--input-len", type=int, default=input_len, help="prompt length in tokens")
    parser.add_argument("--output-len", type=int, default=output_len, help="tokens generated per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="> 0: speculative_config={'method': 'mtp', 'num_speculative_tokens': N}")
    parser.add_argument("--hf-batch-size", "--hf-max-batch-size", dest="hf_batch_size", type=int, default=50,
                        help="--backend hf: prompts per transformers generate() call")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="do not detokenize the outputs (the hf backend never does)")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, input_len=1024, output_len=128)
    parser.add_argument("--num-prompts", type=int, default=200, help="number of prompts")
    parser.add_argument("--num-warmup-prompts", type=int, default=0,
                        help="untimed generate() of this many prompts (output 4 tokens) before the timed one, "
                             "so one-time JIT compilation is not in the figure")
    parser.add_argument("--warmup-full", action="store_true",
                        help="untimed run of the whole workload (other prompts, same lengths) before the timed "
                             "one: every step shape it produces is compiled first, whichever engine runs first")


def check_workload(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "num_prompts", "batch_size", "num_iters", "hf_batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("num_warmup_prompts", "num_iters_warmup", "num_speculative_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.backend == "hf" and args.num_speculative_tokens:
        raise ValueError("--num-speculative-tokens is not supported with --backend hf")


def report_lines(result: dict) -> list[str]:
    """vLLM's `benchmark_throughput` summary lines."""
    return [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens:  {result['total_prompt_tokens']}",
        f"Total num output tokens:  {result['total_output_tokens']}",
    ] + jit_warning_lines(result)


def jit_warning_lines(result: dict) -> list[str]:
    """A warning when Triton built kernels inside the timed run (the figure then includes JIT time)."""
    builds = result.get("triton_builds_in_timed_run", 0)
    if not builds:
        return []
    return [f"WARNING: {builds} Triton kernel build(s) inside the timed run (the warm-up missed these "
            f"specialisations, so this figure includes JIT time): {', '.join(result['triton_builds_timed_kernels'])}"]


def _result(args, elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int, **extra) -> dict:
    total = prompt_tokens + output_tokens
    out = {
        "benchmark": "throughput",
        "backend": args.backend,
        "model": args.model or DEFAULT_MODEL,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "torch": torch.__version__,
    }
    out.update(extra)
    return out


def run_with_engine(args: argparse.Namespace, measure) -> dict:
    """Build (or reuse) the engine for `args`, run `measure(args, llm, kwargs, **extra)`, then release it."""
    kwargs = engine_kwargs(args)
    t0 = time.perf_counter()
    llm, reused = acquire_llm(kwargs)
    init_s = time.perf_counter() - t0
    failed = True
    try:
        result = measure(args, llm, kwargs, init_time_s=init_s, reused_engine=reused)
        failed = False
        return result
    finally:
        kept = keep_llm(llm, failed)
        if not kept:
            llm.shutdown()
        del llm
        if not kept:
            free_device_memory()


def run_engine(args: argparse.Namespace) -> dict:
    return run_with_engine(args, _measure_engine)


def _measure_engine(args: argparse.Namespace, llm, kwargs: dict, **extra) -> dict:
    from ..sampling_params import SamplingParams

    engine = llm.llm_engine
    prompts = random_prompts(args.num_prompts, args.input_len, engine.vocab_size, args.seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    detok = not args.disable_detokenize
    params = SamplingParams(n=1, temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=detok)
    warmup_s = 0.0
    if args.num_warmup_prompts or getattr(args, "warmup_full", False):
        full = getattr(args, "warmup_full", False)
        count = args.num_prompts if full else args.num_warmup_prompts
        warm = random_prompts(count, args.input_len, engine.vocab_size, args.seed + 1)
        t0 = time.perf_counter()
        with TritonBuilds() as warmup_builds:
            llm.generate([{"prompt_token_ids": p} for p in warm],
                         SamplingParams(temperature=0.0, max_tokens=args.output_len if full else min(4, args.output_len),
                                        ignore_eos=True, detokenize=detok), use_tqdm=show_progress())
        warmup_s = time.perf_counter() - t0
        extra["triton_builds_in_warmup"] = warmup_builds.count
    synchronize(engine.device)
    start = time.perf_counter()
    with TritonBuilds() as timed_builds:
        outputs = llm.generate(inputs, params, use_tqdm=show_progress())  # as vLLM's: a bar only on a terminal
        synchronize(engine.device)
    elapsed = time.perf_counter() - start
    extra["triton_builds_in_timed_run"] = timed_builds.count
    extra["triton_builds_timed_kernels"] = timed_builds.summary()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_preemptions = sum(o.metrics.get("num_preemptions", 0) for o in outputs if o.metrics)
    cache = engine.cache_config
    return _result(args, elapsed, len(outputs), prompt_tokens, output_tokens, **extra, warmup_time_s=warmup_s,
                   device=device_name(engine.device), dtype=str(engine.dtype),
                   detokenize=detok and engine.tokenizer is not None, num_preemptions=num_preemptions,
                   num_gpu_blocks=cache.num_gpu_blocks, block_size=cache.block_size,
                   engine_args=jsonable(kwargs))


def load_hf_for(args: argparse.Namespace):
    """The `transformers` model for a benchmark's engine flags: (model, device, dtype, init seconds)."""
    from .hf_baseline import load_hf_model

    config = EngineConfig(**engine_kwargs(args))
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    release_shared_engine()  # a kept engine's cache would leave no memory for transformers
    t0 = time.perf_counter()
    model = load_hf_model(args.model, dtype, device, args.load_format, args.hf_overrides, args.seed)
    return model, device, dtype, time.perf_counter() - t0


def run_hf(args: argparse.Namespace) -> dict:
    from .hf_baseline import hf_generate

    model, device, dtype, init_s = load_hf_for(args)
    try:
        prompts = random_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
        warmup_s = 0.0
        if args.num_warmup_prompts:
            warm = random_prompts(args.num_warmup_prompts, args.input_len, model.config.vocab_size, args.seed + 1)
            t0 = time.perf_counter()
            hf_generate(model, warm, min(4, args.output_len), args.hf_batch_size)
            warmup_s = time.perf_counter() - t0
        synchronize(device)
        start = time.perf_counter()
        outputs = hf_generate(model, prompts, args.output_len, args.hf_batch_size)
        synchronize(device)
        elapsed = time.perf_counter() - start
        output_tokens = sum(len(o) for o in outputs)
        return _result(args, elapsed, len(outputs), sum(len(p) for p in prompts), output_tokens,
                       init_time_s=init_s, warmup_time_s=warmup_s, device=device_name(device), dtype=str(dtype),
                       hf_batch_size=args.hf_batch_size,
                       engine_args=jsonable({"model": args.model, "load_format": args.load_format,
                                             "hf_overrides": args.hf_overrides, "seed": args.seed,
                                             "dtype": str(dtype), "device": str(device)}))
    finally:
        del model
        free_device_memory()


def run(args: argparse.Namespace) -> dict:
    """Runs the workload the parsed flags describe; prints vLLM's summary lines; returns the result."""
    return run_and_report(args, run_engine, run_hf, report_lines)


def run_and_report(args: argparse.Namespace, engine_fn, hf_fn, report) -> dict:
    """The shape of every `bench` command: check the flags, run on the chosen backend, print the
    summary lines, write the JSON if asked."""
    check_workload(args)
    result = hf_fn(args) if args.backend == "hf" else engine_fn(args)
    for line in report(result):
        print(line)
    if args.output_json:
        write_json(args.output_json, result)
    return result


def write_json(path: str, data) -> None:
    from pathlib import Path

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(data), indent=2) + "\n")
    tmp.replace(path)


# ---- sharing across the configurations of a suite (benchmarks/run_all.py) ----
_SHARED: dict | None = None  # {"key": ..., "llm": LLM} while shared_weights() is active


def acquire_llm(kwargs: dict):
    """(LLM, reused): a new engine, or inside `shared_weights()` the last one when the options match."""
    from ..llm import LLM

    if _SHARED is None:
        return LLM(**kwargs), False
    key = json.dumps(jsonable(kwargs), sort_keys=True)
    if _SHARED.get("key") == key and not _SHARED["llm"].llm_engine.has_unfinished_requests():
        return _SHARED["llm"], True
    release_shared_engine()
    free_device_memory()  # size the new engine's cache against memory the old one no longer holds
    llm = LLM(**kwargs)
    _SHARED.update(key=key, llm=llm)
    return llm, False


def keep_llm(llm, failed: bool = False) -> bool:
    """After a run: whether the engine stays for the next run (shared, and its run went well).
    The caller drops its own reference and, when this says False, calls `free_device_memory()`."""
    if _SHARED is not None and _SHARED.get("llm") is llm:
        if not failed:
            return True
        _SHARED.clear()
    return False


def release_shared_engine() -> None:
    """Frees the kept engine (its KV cache holds most of the GPU's memory)."""
    if _SHARED:
        _SHARED.clear()
        free_device_memory()


@contextlib.contextmanager
def shared_weights():
    """Within this block, engines (and the hf baseline) built with the same model, dtype, device,
    load format, overrides and seed share one loaded model instead of loading it again, and a run
    whose engine options equal the previous run's reuses that engine (its init, cache sizing and
    graph capture are then not repeated; `reused_engine` says so in the result).

    For benchmark suites only: loading weights at V4 layer shapes and building an engine take
    seconds to tens of seconds per configuration. The model is only read by the engine, so sharing
    it does not change what a step computes; an engine is reused only when it has no request left.
    """
    global _SHARED
    from ..engine import llm_engine

    original = llm_engine.load_model
    cache: dict = {}

    def cached(model, dtype, device, load_format="auto", hf_overrides=None, seed=0, quantization="none",
               progress=True):
        key = (str(model), str(dtype), str(torch.device(device)), load_format,
               json.dumps(hf_overrides, sort_keys=True, default=str), seed, quantization)
        if key not in cache:
            cache.clear()
            free_device_memory()
            cache[key] = original(model, dtype, device, load_format, hf_overrides, seed, quantization, progress)
        return cache[key]

    llm_engine.load_model = cached
    _SHARED = {}
    try:
        yield
    finally:
        release_shared_engine()
        _SHARED = None
        llm_engine.load_model = original
        cache.clear()
        free_device_memory()
