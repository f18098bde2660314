"""Decode step time with CUDA graphs vs eager (V4-Flash layer shapes, dummy weights).

    python -m benchmarks.decode_graphs [--batches 1,8,64] [--spec-k 1,2] [--out PATH]

For each batch size: B prompts are prefilled, then every following engine step is a pure
decode step; we time whole engine steps (schedule + metadata + forward + sampling) and
the forward alone (replay or eager; each forward is synchronised on both sides, so it includes the
host's metadata build), and with graphs the replay alone (from the replay call to the end of its
GPU work), median over the steps, and "b2b": the last step's graph replayed 20 times in a row
between CUDA events (its GPU execution without the launch latency). With --async-steps, also the
interval between step() returns with async scheduling and no per-step sync (how a server runs
decode: its time per token). Floor: the weight bytes a
decode step must read (every parameter except the embedding table; the experts a batch
touches) over the measured HBM copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks import result_file
from benchmarks.ceilings import hbm_bandwidth
from sparseserve import LLM, RequestOutputKind, SamplingParams
from sparseserve.benchmarks.throughput import free_device_memory, synchronize


def weight_floor_bytes(llm: LLM, batch: int) -> int:
    model = llm.llm_engine.model
    hf = llm.llm_engine.model_config.hf_config
    touched = min(hf.n_routed_experts, batch * hf.num_experts_per_tok)  # the experts a batch can reach
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            total += p.shape[1] * p.element_size() * batch  # only the rows looked up
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            total += p.numel() // hf.n_routed_experts * touched * p.element_size()
            continue
        total += p.numel() * p.element_size()
    for module in model.modules():  # quantized execution: the held FP8/FP4 codes and scales
        if getattr(module, "qweight", None) is not None:
            total += module.qweight.nbytes
        for name in ("q_gate_up", "q_down"):
            held = getattr(module, name, None)
            if held is not None:
                total += held.nbytes // hf.n_routed_experts * touched
    return total


def engine_with_requests(model: str, batch: int, enforce_eager: bool, steps: int, prompt_len: int,
                         kv_cache_bytes: int, async_scheduling: bool, **engine_kwargs) -> LLM:
    """An engine with one graph bucket (the batch) and `batch` random prompts of `prompt_len`
    tokens queued, each generating enough tokens for `steps` decode steps."""
    llm = LLM(model, load_format="dummy", enforce_eager=enforce_eager, max_model_len=4096, max_num_seqs=max(batch, 1),
              cuda_graph_sizes=[batch], kv_cache_memory_bytes=kv_cache_bytes, async_scheduling=async_scheduling,
              **engine_kwargs)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, engine.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    return llm


def measure(model: str, batch: int, enforce_eager: bool, steps: int, prompt_len: int, spec_k: int = 0,
            kv_cache_bytes: int = 8 * 1024**3, **engine_kwargs) -> dict:
    # adaptive=False: every step verifies spec_k drafts (the verify + draft step is what is timed).
    spec = ({"speculative_config": {"method": "mtp", "num_speculative_tokens": spec_k, "adaptive": False}}
            if spec_k else {})
    # Synchronous steps: "step" is one whole engine step (async scheduling would overlap two).
    llm = engine_with_requests(model, batch, enforce_eager, steps, prompt_len, kv_cache_bytes, False, **spec,
                               **engine_kwargs)
    engine = llm.llm_engine
    device = engine.device
    sync = lambda: synchronize(device)  # noqa: E731
    engine.step()  # prefill
    if spec_k:
        engine.step()  # the first verify step (drafts exist from here on)
    step_times, forward_times, replay_times = [], [], []
    runner = engine.runner
    original = runner.forward
    replay_called: list[float] = []
    last_graph: list = []
    graph_cls = torch.cuda.CUDAGraph if torch.cuda.is_available() else None
    original_replay = graph_cls.replay if graph_cls is not None else None

    def timed_replay(graph):
        replay_called.append(time.perf_counter())
        last_graph[:] = [graph]
        return original_replay(graph)

    def timed_forward(chunks, fix_inputs=None):
        sync()
        replay_called.clear()
        t = time.perf_counter()
        result = original(chunks, fix_inputs)
        sync()
        end = time.perf_counter()
        forward_times.append(end - t)
        if replay_called:  # from the replay call to its end: the graph's GPU time, without the host's build
            replay_times.append(end - replay_called[-1])
        return result

    runner.forward = timed_forward
    if graph_cls is not None:
        graph_cls.replay = timed_replay
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
    finally:
        runner.forward = original
        if graph_cls is not None:
            graph_cls.replay = original_replay
    back_to_back = replay_back_to_back_ms(last_graph[0], original_replay) if last_graph and not spec_k else None
    floor = weight_floor_bytes(llm, batch)
    acceptance = engine.spec_metrics.acceptance_rate if spec_k else None
    while engine.has_unfinished_requests():
        engine.step()
    del llm, engine, runner
    free_device_memory()
    return {"batch": batch, "mode": "eager" if enforce_eager else "graph", "spec_k": spec_k,
            "acceptance_rate": acceptance,
            "step_ms_median": 1e3 * statistics.median(step_times[2:]),
            "forward_ms_median": 1e3 * statistics.median(forward_times[2:]),
            # graph mode: the replay alone (forward less the host's metadata build and copies)
            "replay_ms_median": 1e3 * statistics.median(replay_times[2:]) if len(replay_times) > 2 else None,
            "replay_back_to_back_ms": back_to_back,
            "weight_bytes": floor}


def replay_back_to_back_ms(graph, replay, reps: int = 20) -> float:
    """GPU time per replay of the last decode step's graph, replayed `reps` times in a row between
    two CUDA events: the host queues each launch while the GPU runs the previous one, so this is
    the graph's execution alone, without the launch latency that the host-timed replay includes.
    Replaying a decode step again is idempotent (the same inputs, the same rows written with the
    same values; the top-k workspace is zeroed inside the graph)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay(graph)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure_async(model: str, batch: int, enforce_eager: bool, steps: int, prompt_len: int,
                  kv_cache_bytes: int = 8 * 1024**3, **engine_kwargs) -> dict:
    """Decode steps as a server runs them: async scheduling (the host prepares step n + 1 while the
    GPU runs step n) and no per-step sync. The interval between successive `step()` returns, median
    over the steady-state decode steps, is the time per generated token of each sequence: it is the
    larger of the host's and the GPU's share, whichever bounds decode throughput."""
    llm = engine_with_requests(model, batch, enforce_eager, steps, prompt_len, kv_cache_bytes, True, **engine_kwargs)
    engine = llm.llm_engine
    for _ in range(3):  # the prefill, then the pipeline fills
        engine.step()
    synchronize(engine.device)
    returns = [time.perf_counter()]
    for _ in range(steps):
        engine.step()
        returns.append(time.perf_counter())
    intervals = [b - a for a, b in zip(returns, returns[1:])]
    while engine.has_unfinished_requests():
        engine.step()
    del llm, engine
    free_device_memory()
    return {"async_step_ms_median": 1e3 * statistics.median(intervals[1:]),
            "async_tokens_per_s": batch / statistics.median(intervals[1:])}


def break_even_rate(step_ratio: float, k: int) -> float:
    """The i.i.d. per-draft acceptance a at which 1 + a + ... + a^k tokens per step equal the step-time ratio."""
    lo, hi = 0.0, 1.0
    if 1 + k < step_ratio:
        return float("nan")  # not reachable even at full acceptance
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < step_ratio:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--spec-k", default="", help="also time verify steps with these numbers of MTP drafts, "
                        "e.g. 1,2 (dummy weights: the drafts are almost never accepted, so every step pays "
                        "the whole verify + draft cost)")
    parser.add_argument("--no-eager", action="store_true", help="graphs only")
    parser.add_argument("--quantization", default="none",
                        help="the engine's quantization: 'auto' holds the preset's FP8 linears and FP4 experts as the "
                             "release stores them (dummy weights encoded at load)")
    parser.add_argument("--async-steps", action="store_true",
                        help="also time plain decode steps with async scheduling and no per-step sync (a "
                             "server's step interval: decode throughput), in another engine per batch and mode")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/decode_graphs.json (decode_graphs_spec.json with --spec-k)")
    args = parser.parse_args()
    bw = hbm_bandwidth()
    rows = []
    spec_ks = [int(k) for k in args.spec_k.split(",") if k]
    for batch in [int(b) for b in args.batches.split(",")]:
        for eager in ((False,) if args.no_eager else (True, False)):
            for k in [0] + spec_ks:
                row = measure(args.model, batch, eager, args.steps, args.prompt_len, k, quantization=args.quantization)
                if args.async_steps and k == 0:
                    row.update(measure_async(args.model, batch, eager, args.steps, args.prompt_len,
                                             quantization=args.quantization))
                row["floor_ms"] = 1e3 * row["weight_bytes"] / bw
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "model": args.model, "quantization": args.quantization, "hbm_bytes_per_s": bw,
              "prompt_len": args.prompt_len, "rows": rows}
    print(f"{'batch':>6}{'mode':>7}{'k':>3}{'step ms':>10}{'fwd ms':>9}{'replay ms':>11}{'b2b ms':>9}{'async ms':>10}"
          f"{'floor ms':>10}{'fwd/floor':>10}{'async/floor':>12}")
    for r in rows:
        replay = f"{r['replay_ms_median']:>11.3f}" if r.get("replay_ms_median") is not None else f"{'-':>11}"
        replay += f"{r['replay_back_to_back_ms']:>9.3f}" if r.get("replay_back_to_back_ms") is not None else f"{'-':>9}"
        async_ms = r.get("async_step_ms_median")
        async_cols = (f"{async_ms:>10.3f}", f"{async_ms / r['floor_ms']:>12.2f}") if async_ms else (f"{'-':>10}", f"{'-':>12}")
        print(f"{r['batch']:>6}{r['mode']:>7}{r['spec_k']:>3}{r['step_ms_median']:>10.3f}{r['forward_ms_median']:>9.3f}"
              f"{replay}{async_cols[0]}{r['floor_ms']:>10.3f}{r['forward_ms_median'] / r['floor_ms']:>10.2f}{async_cols[1]}")
    for b in sorted({r["batch"] for r in rows}):
        pick = {(r["mode"], r["spec_k"]): r for r in rows if r["batch"] == b}
        e, g = pick.get(("eager", 0)), pick.get(("graph", 0))
        if e and g:
            async_speedup = (f", {e['async_step_ms_median'] / g['async_step_ms_median']:.2f}x per async step"
                             if e.get("async_step_ms_median") and g.get("async_step_ms_median") else "")
            print(f"batch {b}: graph speedup {e['step_ms_median'] / g['step_ms_median']:.2f}x per engine step, "
                  f"{e['forward_ms_median'] / g['forward_ms_median']:.2f}x per forward{async_speedup}")
        for mode in ("eager", "graph"):
            plain = pick.get((mode, 0))
            for k in spec_ks:
                s = pick.get((mode, k))
                if plain and s:
                    # A step emits 1 + (accepted drafts): speculation pays once that mean exceeds the step-time ratio.
                    ratio = s["step_ms_median"] / plain["step_ms_median"]
                    s["verify_over_plain_step"] = ratio
                    s["break_even_mean_accepted_drafts"] = ratio - 1
                    print(f"batch {b} {mode} k={k}: verify+draft step {s['step_ms_median']:.3f} ms = {ratio:.2f}x a plain "
                          f"step; break-even at {ratio - 1:.2f} accepted drafts per step "
                          f"(per-draft acceptance {break_even_rate(ratio, k):.2f} if i.i.d.)")
    out = args.out or result_file("decode_graphs_spec" if spec_ks else "decode_graphs")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
