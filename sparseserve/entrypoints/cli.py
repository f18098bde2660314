"""The `sparseserve` command: generate, bench throughput, bench latency, kv-plan.

Every option of `LLM(...)` is a flag with the same name (dashes for underscores), for
`generate` and both `bench` commands.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import ModelConfig
from ..engine_args import parse_bool, add_engine_args, engine_kwargs

DEFAULT_PROMPTS = ["A class definition", "The for statement is used to", "The import statement"]


def cmd_generate(args: argparse.Namespace) -> int:
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or DEFAULT_PROMPTS
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}  "
              f"[{len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason}]\n")
    return 0


def cmd_kv_plan(args: argparse.Namespace) -> int:


    from ..engine.kv_cache import plan_kv
    from ..model.loader import load_hf_config, resolve_model_dir

    model_dir, overrides = resolve_model_dir(args.model)
    overrides.update(args.hf_overrides or {})
    model_config = ModelConfig(load_hf_config(model_dir, overrides))
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}[args.dtype]
    block_size = args.block_size or max(model_config.lcm_rate, 16)
    plan = plan_kv(model_config, dtype_bytes, block_size, args.max_num_batched_tokens or 8192,
                   args.num_speculative_tokens)
    cache_bytes = int(args.gpu_memory_gb * 1024**3) if args.gpu_memory_gb else None
    print(f"model: {args.model or 'tiny (embedded)'} ({model_config.num_layers} layers)")
    print(plan.report(args.max_model_len, cache_bytes))
    gib = 1024**3
    dtype_name = "bfloat16" if args.dtype == "auto" else args.dtype
    compressed = plan.bytes_per_token * args.max_model_len
    dense = plan.dense_mla_bytes_per_token * args.max_model_len
    print(f"per sequence at {args.max_model_len:,} tokens ({dtype_name}): compressed state {compressed / gib:.2f} GiB "
          f"(+ {plan.bytes_per_slot / 1024**2:.2f} MiB fixed window/compressor rows); "
          f"dense-MLA {dense / gib:.2f} GiB ({dense / max(compressed, 1e-9):.1f}x)")
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from ..benchmarks import throughput

    throughput.run(args)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from ..benchmarks import latency

    latency.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions (the embedded model when --model is absent)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", type=parse_bool, nargs="?", const=True, default=False)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ..benchmarks.latency import add_latency_args
    from ..benchmarks.throughput import add_throughput_args

    tput = bench_sub.add_parser("throughput", help="offline throughput on random-token prompts (vLLM's output)")
    add_engine_args(tput)
    add_throughput_args(tput)
    tput.set_defaults(func=cmd_bench_throughput)

    lat = bench_sub.add_parser("latency", help="time per prefill and per decode step, with percentiles")
    add_engine_args(lat)
    add_latency_args(lat)
    lat.set_defaults(func=cmd_bench_latency)

    kv = sub.add_parser("kv-plan", help="bytes per token and per sequence by layer kind, without loading weights")
    kv.add_argument("--model", default=None, help="checkpoint directory or preset")
    kv.add_argument("--max-model-len", type=int, required=True)
    kv.add_argument("--gpu-memory-gb", type=float, default=None, help="cache memory to plan concurrency for")
    kv.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    kv.add_argument("--block-size", type=int, default=None)
    kv.add_argument("--max-num-batched-tokens", type=int, default=None)
    kv.add_argument("--hf-overrides", type=json.loads, default=None)
    kv.add_argument("--num-speculative-tokens", type=int, default=0, help="window rings hold this many rows more")
    kv.set_defaults(func=cmd_kv_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
