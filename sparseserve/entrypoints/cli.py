"""The `sparseserve` command: generate, serve, bench throughput, bench latency, bench serve, kv-plan.

Every option of `LLM(...)` is a flag with the same name (dashes for underscores), for
`generate` and both `bench` commands. Errors are one line on stderr: exit code 2 for a bad value
(checked before the model loads where it can be), 1 for a run that failed;
SPARSESERVE_LOGGING_LEVEL=DEBUG prints the traceback too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback
from typing import TYPE_CHECKING

from .. import envs
from ..config import EngineConfig, ModelConfig
from ..engine_args import parse_bool, add_engine_args, engine_kwargs
from ..names import QUANTIZATION_MODES
from ..kv_format import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from ..model.weight_bytes import ParallelLayout

DEFAULT_PROMPTS = ["A class definition", "The for statement is used to", "The import statement"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that says what to change (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def check_engine_args(kwargs: dict) -> None:
    """The engine options' values, and the limits the model's config.json sets, before any weights load."""
    from ..config_checks import check_model_limits, check_parallel_layout
    from ..model.loader import load_hf_config, resolve_model_dir

    config = EngineConfig(**{k: v for k, v in kwargs.items() if k in {f.name for f in dataclasses.fields(EngineConfig)}})
    config.validate()
    model_dir, overrides = resolve_model_dir(config.model)
    hf = load_hf_config(model_dir, {**overrides, **(config.hf_overrides or {})})
    check_model_limits(config, hf)
    check_parallel_layout(config, hf, config.resolve_device())  # the GPU count is checked by the engine


def serve_worker_node(kwargs: dict) -> int:
    """`--node-rank` > 0: this node runs its ranks' workers only, until node 0's engine stops them."""
    from ..executor.node import serve_worker_node as serve

    serve(EngineConfig(**kwargs))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    kwargs = engine_kwargs(args)
    check_engine_args(kwargs)
    if kwargs.get("node_rank", 0) > 0:
        return serve_worker_node(kwargs)
    llm = LLM(**kwargs)
    prompts = args.prompt or DEFAULT_PROMPTS
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}  "
              f"[{len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason}]\n")
    return 0


def weights_report(model_config: ModelConfig, dtype_name: str, layout: ParallelLayout, include_mtp: bool,
                   quantization: str = "none") -> str:
    """The weights as held for `layout`, and per GPU at the other even layouts (meta device: no memory)."""
    import torch

    from ..model.fit_check import candidate_layouts
    from ..model.meta_model import weight_plan

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]
    plan = weight_plan(model_config, dtype, include_mtp, quantization)
    others = {}
    for other in candidate_layouts(model_config.hf_config, 8)[1:]:
        key = "with enable_expert_parallel" if other.enable_expert_parallel else "tensor_parallel_size"
        others.setdefault(key, []).append(f"{other.tensor_parallel_size}: {plan.at(other).per_gpu_bytes / 1024**3:.2f}")
    lines = [plan.report(layout)]
    if others:
        lines.append("weights per GPU (GiB) at " + "; ".join(f"{k} {', '.join(v)}" for k, v in others.items()))
    return "\n".join(lines)


def cmd_kv_plan(args: argparse.Namespace) -> int:
    from ..engine.kv_cache import plan_kv
    from ..model.loader import DEFAULT_MODEL, load_hf_config, resolve_model_dir
    from ..model.weight_bytes import ParallelLayout, layout_problem

    model_dir, overrides = resolve_model_dir(args.model)
    overrides.update(args.hf_overrides or {})
    model_config = ModelConfig(load_hf_config(model_dir, overrides))
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}[args.dtype]
    block_size = args.block_size or max(model_config.lcm_rate, 16)
    plan = plan_kv(model_config, dtype_bytes, block_size, args.max_num_batched_tokens or 8192,
                   args.num_speculative_tokens, args.kv_cache_dtype)
    cache_bytes = int(args.gpu_memory_gb * 1024**3) if args.gpu_memory_gb else None
    positions = model_config.hf_config.max_position_embeddings
    if args.max_model_len > positions:
        print(f"note: --max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
              f"({positions}); the engine refuses it", file=sys.stderr)
    print(f"model: {args.model or DEFAULT_MODEL} ({model_config.num_layers} layers)")
    dtype_name = "bfloat16" if args.dtype == "auto" else args.dtype
    layout = ParallelLayout(args.tensor_parallel_size, args.enable_expert_parallel)
    if layout_problem(model_config.hf_config, layout):
        print(f"note: {layout_problem(model_config.hf_config, layout)}; the weights per GPU count the largest "
              "shard", file=sys.stderr)
    print(weights_report(model_config, dtype_name, layout, args.num_speculative_tokens > 0, args.quantization))
    print(plan.report(args.max_model_len, cache_bytes))
    gib = 1024**3
    compressed = plan.bytes_per_token * args.max_model_len
    dense = plan.dense_mla_bytes_per_token * args.max_model_len
    kv_name = dtype_name if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    print(f"per sequence at {args.max_model_len:,} tokens ({kv_name}): compressed state {compressed / gib:.2f} GiB "
          f"(+ {plan.bytes_per_slot / 1024**2:.2f} MiB fixed window/compressor rows); "
          f"dense-MLA {dense / gib:.2f} GiB ({dense / max(compressed, 1e-9):.1f}x)")
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from ..benchmarks import throughput

    if getattr(args, "backend", "engine") == "engine":
        check_engine_args(engine_kwargs(args))

    throughput.run(args)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from ..benchmarks import latency

    if getattr(args, "backend", "engine") == "engine":
        check_engine_args(engine_kwargs(args))

    latency.run(args)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .openai.api_server import ServerConfig, run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}); give one")
        args.model = args.model_tag
    names = args.served_model_name
    if engine_kwargs(args).get("node_rank", 0) > 0:
        return serve_worker_node(engine_kwargs(args))
    run_server(engine_kwargs(args), ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                                 served_model_names=names,
                                                 max_waiting_requests=args.max_waiting_requests,
                                                 log_level=args.uvicorn_log_level))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..benchmarks import serve

    summary = serve.run(args)
    return 0 if summary["failed"] == 0 else 1


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory or preset (the embedded demo model when absent)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=envs.api_key(),
                        help="clients must send 'Authorization: Bearer KEY' (default: $SPARSESERVE_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model names the API accepts (the first is reported); default: the model argument")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="requests waiting for a seat at most; more are answered 503 at once")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="sparseserve", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"sparseserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions (the embedded model when --model is absent)",
                         allow_abbrev=False)
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

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)", allow_abbrev=False)
    add_serve_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve", allow_abbrev=False)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ..benchmarks.latency import add_latency_args
    from ..benchmarks.throughput import add_throughput_args

    tput = bench_sub.add_parser("throughput", help="offline throughput on random-token prompts (vLLM's output)",
                                allow_abbrev=False)
    add_engine_args(tput)
    add_throughput_args(tput)
    tput.set_defaults(func=cmd_bench_throughput)

    lat = bench_sub.add_parser("latency", help="time per prefill and per decode step, with percentiles",
                               allow_abbrev=False)
    add_engine_args(lat)
    add_latency_args(lat)
    lat.set_defaults(func=cmd_bench_latency)

    from ..benchmarks.serve import add_serve_args as add_bench_serve_args

    bsrv = bench_sub.add_parser("serve", help="load generator against a running server (TTFT, TPOT, ITL, throughput)",
                                allow_abbrev=False)
    add_bench_serve_args(bsrv)
    bsrv.set_defaults(func=cmd_bench_serve)

    kv = sub.add_parser("kv-plan", help="bytes per token and per sequence by layer kind, without loading weights",
                        allow_abbrev=False)
    kv.add_argument("--model", default=None, help="checkpoint directory or preset (default: demo)")
    kv.add_argument("--max-model-len", type=_int_at_least(2), required=True)
    kv.add_argument("--gpu-memory-gb", type=_positive_float, default=None, help="cache memory to plan concurrency for")
    kv.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    kv.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="KV rows and indexer keys as LLM(kv_cache_dtype=...) stores them (docs/kv-cache.md)")
    kv.add_argument("--block-size", type=_int_at_least(1), default=None)
    kv.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=None)
    kv.add_argument("--hf-overrides", type=json.loads, default=None)
    kv.add_argument("--num-speculative-tokens", type=_int_at_least(0), default=0,
                    help="window rings hold this many rows more; the MTP layer's weights are counted")
    kv.add_argument("--tensor-parallel-size", type=_int_at_least(1), default=1,
                    help="the layout the weights per GPU are given for")
    kv.add_argument("--enable-expert-parallel", type=parse_bool, nargs="?", const=True, default=False,
                    help="routed experts whole on each rank (with --tensor-parallel-size > 1)")
    kv.add_argument("--quantization", default="none", choices=list(QUANTIZATION_MODES),
                    help="the weights as held under LLM(quantization=...): FP8/FP4 tensors counted as such")
    kv.set_defaults(func=cmd_kv_plan)
    return parser


USAGE_ERRORS = (ValueError, TypeError, NotImplementedError)  # a value to change: exit code 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every error becomes one line (and an exit code)
        if envs.logging_level() == "DEBUG":
            traceback.print_exc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, USAGE_ERRORS):
            message = f"{type(exc).__name__}: {message}"
        print(f"error: {message}", file=sys.stderr)
        return 2 if isinstance(exc, USAGE_ERRORS) else 1


if __name__ == "__main__":
    sys.exit(main())
