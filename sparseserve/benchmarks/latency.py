"""`sparseserve bench latency`: time per prefill step and per decode step, with percentiles.

One iteration submits `batch_size` random-token prompts of `input_len` tokens, each asked for
exactly `output_len` tokens (greedy, `ignore_eos`), and runs `LLMEngine.step()` until all are
done, reading the clock around every step (after synchronising CUDA; steps run synchronously, without
async scheduling, unless `--async-scheduling` is given). A step that carries any
prompt tokens is a *prefill* step (with chunked prefill a batch's prompts may take several; the
last one also samples the first token); every other step is a *decode* step. A request's *time to
first token* (TTFT) is the time to add the iteration's requests plus every step up to the one that
gave it its first token; the batch's TTFT is its last request's (the whole prefill of the batch and
its first tokens). `--num-iters-warmup` iterations run first and are not counted. `--backend hf` times `transformers` `generate` on the
same prompts and weights: prefill = call to first token (every request's TTFT), decode step = token to token.

The figures are printed with roofline floors from the model's shapes (weights read once per
decode step at the HBM rate; prefill matmul FLOPs at the bf16 tensor-core rate); the default
rates are the H200 ceilings of docs/performance.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ..logger import progress_bar
from ..model.loader import DEFAULT_MODEL
from .throughput import (load_hf_for, run_with_engine, add_workload_args, device_name, free_device_memory, jsonable,
                         random_prompts, run_and_report, synchronize)

HBM_BYTES_PER_S = 4.23e12  # H200 copy bandwidth (docs/performance.md, card and ceilings)
BF16_FLOPS_PER_S = 790e12  # H200 dense bf16 GEMM rate (docs/performance.md, card and ceilings)
PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, input_len=32, output_len=128)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per iteration, submitted together")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=3, help="timed iterations")


def summarize(seconds: list[float]) -> dict:
    """Milliseconds: mean, p50, p90, p99, min, max, and the count."""
    if not seconds:
        return {"count": 0}
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {"count": int(ms.size), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99)),
            "min_ms": float(ms.min()), "max_ms": float(ms.max())}


# ---- roofline facts from the model's shapes (no weights are made) ----
def model_facts(model: str | None, hf_overrides: dict | None = None) -> dict:
    """Parameter counts by role, counted on a meta-device model built from the config."""
    from ..config import ModelConfig
    from ..model.deepseek_v4 import DeepseekV4ForCausalLM
    from ..model.loader import load_hf_config, resolve_model_dir

    model_dir, overrides = resolve_model_dir(model)
    overrides.update(hf_overrides or {})
    config = ModelConfig(load_hf_config(model_dir, overrides))
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(config)
    hf = config.hf_config
    total = embed = lm_head = experts = 0
    expert_layers = set()
    for name, p in net.named_parameters():
        n = p.numel()
        total += n
        if name.endswith("embed_tokens.weight"):
            embed += n
        elif name.startswith("lm_head"):
            lm_head += n
        elif ".mlp.experts." in name:
            experts += n
            expert_layers.add(name.split(".mlp.experts.")[0])
    num_moe = len(expert_layers)
    per_expert = experts // max(num_moe * hf.n_routed_experts, 1)
    return {"params": total, "embedding_params": embed, "lm_head_params": lm_head,
            "dense_params": total - embed - lm_head - experts,  # attention, shared experts, mixing, norms
            "routed_expert_params": experts, "params_per_expert": per_expert, "moe_layers": num_moe,
            "n_routed_experts": int(hf.n_routed_experts), "num_experts_per_tok": int(hf.num_experts_per_tok)}


def expected_experts(facts: dict, num_tokens: int) -> float:
    """Distinct experts a MoE layer reads for `num_tokens` tokens, each routed to k of E at random."""
    e, k = facts["n_routed_experts"], facts["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** num_tokens) if e else 0.0


def decode_weight_bytes(facts: dict, batch: int, dtype_bytes: int = 2) -> float:
    """Weight bytes one decode step must read at batch `batch` (the embedding is a gather, not read)."""
    params = facts["dense_params"] + facts["lm_head_params"]
    params += facts["moe_layers"] * expected_experts(facts, batch) * facts["params_per_expert"]
    return params * dtype_bytes


def prefill_flops(facts: dict, num_tokens: int, num_sequences: int) -> float:
    """Matmul FLOPs of prefilling `num_tokens` prompt tokens (attention scores excluded; the LM head
    only for each sequence's last token)."""
    active = facts["dense_params"] + facts["moe_layers"] * facts["num_experts_per_tok"] * facts["params_per_expert"]
    return 2.0 * (num_tokens * active + num_sequences * facts["lm_head_params"])


def roofline(model: str | None, hf_overrides: dict | None, batch: int, input_len: int, dtype_bytes: int,
             hbm_bytes_per_s: float = HBM_BYTES_PER_S, flops_per_s: float = BF16_FLOPS_PER_S) -> dict:
    facts = model_facts(model, hf_overrides)
    wbytes = decode_weight_bytes(facts, batch, dtype_bytes)
    flops = prefill_flops(facts, batch * input_len, batch)
    return {"model_facts": facts, "hbm_bytes_per_s": hbm_bytes_per_s, "flops_per_s": flops_per_s,
            "decode_weight_bytes": wbytes, "decode_step_floor_ms": wbytes / hbm_bytes_per_s * 1e3,
            "prefill_flops": flops, "prefill_floor_ms": flops / flops_per_s * 1e3}


# ---- the two backends ----
def _engine_iterations(args, llm, prompts_for) -> dict[str, list]:
    from ..sampling_params import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=not args.disable_detokenize, output_kind=RequestOutputKind.FINAL_ONLY)
    # Under async scheduling a step launches one step and reads back the one before, so its time would
    # mix two steps: time synchronous steps unless --async-scheduling was given explicitly.
    was_async = engine.async_scheduling
    if getattr(args, "async_scheduling", None) is None:
        engine.async_scheduling = False
    try:
        return _timed_iterations(args, engine, params, prompts_for)
    finally:
        engine.async_scheduling = was_async


def _timed_iterations(args, engine, params, prompts_for) -> dict[str, list]:
    """Seconds per prefill and decode step, per iteration (all steps, prefill steps), each request's
    TTFT and each iteration's batch TTFT, and output tokens per iteration (timed iterations only)."""
    m: dict[str, list] = {k: [] for k in ("prefill", "decode", "iteration", "iteration_prefill", "tokens", "ttft",
                                          "batch_ttft")}
    total_iters = args.num_iters_warmup + args.num_iters
    for it in progress_bar(range(total_iters), desc=f"Iterations ({args.num_iters_warmup} warm-up first)"):
        timed = it >= args.num_iters_warmup
        synchronize(engine.device)
        t0 = time.perf_counter()
        waiting_first = []
        for i, prompt in enumerate(prompts_for(it)):
            engine.add_request(f"latency-{it}-{i}", {"prompt_token_ids": prompt}, params)
            waiting_first.append(f"latency-{it}-{i}")
        total = time.perf_counter() - t0  # adding the requests counts towards their TTFT
        pre = 0.0
        ttfts: list[float] = []
        outputs = []
        while engine.has_unfinished_requests():
            is_prefill = any(r.num_computed_tokens < len(r.prompt_token_ids)
                             for r in engine.requests.values() if not r.is_finished)
            synchronize(engine.device)
            t0 = time.perf_counter()
            outputs.extend(engine.step())
            synchronize(engine.device)
            dt = time.perf_counter() - t0
            total += dt
            if is_prefill:
                pre += dt
            if timed:
                m["prefill" if is_prefill else "decode"].append(dt)
            if waiting_first:  # a finished request has left engine.requests: it had its first token
                got = [rid for rid in waiting_first
                       if rid not in engine.requests or engine.requests[rid].output_token_ids]
                ttfts += [total] * len(got)
                waiting_first = [rid for rid in waiting_first if rid not in got]
        if timed:
            m["iteration"].append(total)
            m["iteration_prefill"].append(pre)
            m["tokens"].append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
            m["ttft"] += ttfts
            m["batch_ttft"].append(max(ttfts, default=0.0))
    return m


def run_engine(args: argparse.Namespace) -> dict:
    return run_with_engine(args, _measure_engine)


def _measure_engine(args: argparse.Namespace, llm, kwargs: dict, **extra) -> dict:
    engine = llm.llm_engine
    vocab = engine.vocab_size
    measured = _engine_iterations(
        args, llm, lambda it: random_prompts(args.batch_size, args.input_len, vocab, args.seed + it))
    extra.update(device=device_name(engine.device), dtype=str(engine.dtype),
                 dtype_bytes=torch.tensor([], dtype=engine.dtype).element_size(), engine_args=jsonable(kwargs))
    return _result(args, measured, **extra)


def run_hf(args: argparse.Namespace) -> dict:
    from .hf_baseline import hf_step_times

    model, device, dtype, init_s = load_hf_for(args)
    try:
        m: dict[str, list] = {k: [] for k in ("prefill", "decode", "iteration", "iteration_prefill", "tokens",
                                              "ttft", "batch_ttft")}
        for it in progress_bar(range(args.num_iters_warmup + args.num_iters),
                               desc=f"Iterations ({args.num_iters_warmup} warm-up first)"):
            prompts = random_prompts(args.batch_size, args.input_len, model.config.vocab_size, args.seed + it)
            pre, steps, outputs = hf_step_times(model, prompts, args.output_len)
            if it >= args.num_iters_warmup:
                m["prefill"].append(pre)
                m["decode"].extend(steps)
                m["iteration_prefill"].append(pre)
                m["iteration"].append(pre + sum(steps))
                m["tokens"].append(sum(len(o) for o in outputs))
                m["ttft"] += [pre] * len(prompts)  # one batched call: every request's first token at once
                m["batch_ttft"].append(pre)
        extra = {"init_time_s": init_s, "device": device_name(device), "dtype": str(dtype),
                 "dtype_bytes": torch.tensor([], dtype=dtype).element_size(),
                 "engine_args": jsonable({"model": args.model, "load_format": args.load_format,
                                          "hf_overrides": args.hf_overrides, "seed": args.seed,
                                          "dtype": str(dtype), "device": str(device)})}
        return _result(args, m, **extra)
    finally:
        del model
        free_device_memory()


def _result(args, m: dict[str, list], **extra) -> dict:
    decode, iter_total = m["decode"], m["iteration"]
    decode_stats = summarize(decode)
    out = {
        "benchmark": "latency", "backend": args.backend, "model": args.model or DEFAULT_MODEL,
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
        "prefill_step": summarize(m["prefill"]), "decode_step": decode_stats,
        "prefill_per_iteration": summarize(m["iteration_prefill"]), "iteration": summarize(iter_total),
        "ttft": summarize(m["ttft"]), "batch_ttft": summarize(m["batch_ttft"]),
        "avg_latency": float(np.mean(iter_total)),
        "percentiles": {str(p): float(np.percentile(iter_total, p)) for p in PERCENTILES},
        "output_tokens_per_iteration": m["tokens"],
        "decode_tokens_per_s": (args.batch_size / (decode_stats["p50_ms"] / 1e3)) if decode else None,
        "latencies": list(iter_total), "torch": torch.__version__,
    }
    out.update(extra)
    try:
        out["roofline"] = roofline(args.model, args.hf_overrides, args.batch_size, args.input_len,
                                   extra.get("dtype_bytes", 2))
    except Exception as exc:  # the floors are a guide; never fail a measurement over them
        out["roofline"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _stat_line(label: str, s: dict) -> str:
    if not s.get("count"):
        return f"{label}: none"
    return (f"{label}: mean {s['mean_ms']:.3f}, p50 {s['p50_ms']:.3f}, p90 {s['p90_ms']:.3f}, "
            f"p99 {s['p99_ms']:.3f} ({s['count']} steps)")


def report_lines(r: dict) -> list[str]:
    lines = [
        f"Latency ({r['backend']}, batch {r['batch_size']}, input {r['input_len']}, output {r['output_len']}, "
        f"{r['num_iters']} iterations):",
        _stat_line("Prefill step latency (ms)", r["prefill_step"]),
        _stat_line("Decode step latency (ms)", r["decode_step"]),
        _stat_line("Prefill per iteration (ms)", r["prefill_per_iteration"]).replace(" steps)", " iterations)"),
    ]
    if "ttft" in r:
        lines += [_stat_line("Time to first token (ms)", r["ttft"]).replace(" steps)", " requests)"),
                  _stat_line("Time to first token of the batch (ms)", r["batch_ttft"]).replace(" steps)",
                                                                                          " iterations)")]
    if r.get("decode_tokens_per_s"):
        lines.append(f"Decode throughput: {r['decode_tokens_per_s']:.2f} output tokens/s "
                     f"(batch {r['batch_size']} / p50 decode step)")
    roof = r.get("roofline", {})
    if "decode_step_floor_ms" in roof:
        lines.append(f"Floors at {roof['hbm_bytes_per_s'] / 1e12:.2f} TB/s and {roof['flops_per_s'] / 1e12:.0f} "
                     f"TFLOP/s: decode step {roof['decode_step_floor_ms']:.3f} ms "
                     f"({roof['decode_weight_bytes'] / 1e9:.3f} GB of weights), "
                     f"prefill of the batch {roof['prefill_floor_ms']:.3f} ms")
    lines.append(f"Avg latency: {r['avg_latency']:.4f} seconds")
    for p, value in r["percentiles"].items():
        lines.append(f"{p}% percentile latency: {value:.4f} seconds")
    return lines


def run(args: argparse.Namespace) -> dict:
    return run_and_report(args, run_engine, run_hf, report_lines)
