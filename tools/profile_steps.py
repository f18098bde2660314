"""Where the GPU time goes: a kernel-level profile of the seed workload and of a batch-1 decode step.

    PYTHONPATH=. python tools/profile_steps.py --out-dir $OUT

Writes `profile_seed.txt` (engine steps classified as prefill/mixed or pure decode, their wall
time, and the CUDA kernels by total time over a reduced seed workload) and `profile_decode.txt`
(one eager batch-1 decode step: kernel count, summed kernel time, the kernels by time; and the
graph replay time of the same step). Diagnostic only; the benchmarks hold the reported numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve import LLM, SamplingParams


def kernel_table(prof, rows: int) -> str:
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)


def shape_table(prof, rows: int) -> str:
    """Which call each kernel is: aten ops (not the step ranges) by input shape, by device time."""
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    lines = [f"{'op':<28} {'calls':>6} {'self device ms':>15} {'per call us':>12}  input shapes"]
    for e in ops[:rows]:
        lines.append(f"{e.key[:28]:<28} {e.count:>6} {e.self_device_time_total / 1e3:>15.3f} "
                     f"{e.self_device_time_total / e.count:>12.1f}  {str(e.input_shapes)[:150]}")
    return "\n".join(lines)


def gpu_busy_by_step(prof, step_kinds: list[str]) -> dict[str, tuple[float, float, int]]:
    """Per step kind: (summed CPU span of the recorded steps, GPU busy time inside them, in seconds;
    the number of recorded steps). Each step
    ends with a synchronize, so its kernels run inside its own CPU range; busy = union of kernel intervals."""
    events = prof.events()
    # The profiler mirrors each record_function range onto the GPU timeline (a user annotation):
    # steps are the CPU ranges, kernels the GPU events that are not such mirrors.
    cuda = torch.autograd.DeviceType.CUDA
    steps = sorted((e.time_range.start, e.time_range.end, int(e.name.rsplit("_", 1)[1])) for e in events
                   if e.name.startswith("sparseserve_step_") and e.device_type != cuda)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == cuda and not e.name.startswith("sparseserve_step_"))
    result: dict[str, list] = {}
    k = 0
    for start, end, index in steps:
        while k < len(kernels) and kernels[k][0] < start:
            k += 1
        busy, cursor = 0.0, start
        j = k
        while j < len(kernels) and kernels[j][0] <= end:
            s, e = max(kernels[j][0], cursor), kernels[j][1]
            if e > s:
                busy += e - s
                cursor = e
            j += 1
        span_busy = result.setdefault(step_kinds[index], [0.0, 0.0, 0])
        span_busy[0] += (end - start) / 1e6
        span_busy[1] += busy / 1e6
        span_busy[2] += 1
    return {kind: (v[0], v[1], v[2]) for kind, v in result.items()}


def seed_engine(args, **llm_kwargs):
    """The seed workload's engine (dummy weights, max_model_len 2048), its greedy sampling params
    and `args.num_prompts` random 1024-token prompts inside the model's vocabulary."""
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, enforce_eager=args.eager, **llm_kwargs)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = torch.randint(10, min(100000, engine.vocab_size), (args.num_prompts, 1024), generator=gen).tolist()
    return llm, engine, params, prompts


def run_seed_pass(engine, prompts, params, profiled: bool, shapes: bool = False, decode_only: bool = False):
    """One pass of the workload, step by step; returns (wall, per-kind step times, tokens, kinds, profiler)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}-{profiled}", {"prompt_token_ids": ids}, params)
    kinds: dict[str, list[float]] = {"prefill/mixed": [], "decode": []}
    scheduled_tokens: dict[str, int] = {"prefill/mixed": 0, "decode": 0}
    step_kinds: list[str] = []
    original_schedule = engine.scheduler.schedule

    def schedule():
        sched = original_schedule()
        decode = all(c.num_tokens == 1 + c.num_draft for c in sched.chunks) and all(
            c.request.num_computed_tokens >= len(c.request.prompt_token_ids) for c in sched.chunks)
        step_kinds.append("decode" if decode else "prefill/mixed")
        scheduled_tokens[step_kinds[-1]] += sum(c.num_tokens for c in sched.chunks)
        return sched

    engine.scheduler.schedule = schedule
    torch.cuda.synchronize()
    start = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) if profiled else None
    recording = False
    while engine.has_unfinished_requests():
        # decode_only: record from the step after the first pure decode step on (the decode phase).
        if prof is not None and not recording and (not decode_only or step_kinds[-1:] == ["decode"]):
            prof.start()
            recording = True
        t = time.perf_counter()
        with torch.profiler.record_function(f"sparseserve_step_{len(step_kinds)}"):
            engine.step()
            torch.cuda.synchronize()
        kinds[step_kinds[-1]].append(time.perf_counter() - t)
    if recording:
        prof.stop()
    total = time.perf_counter() - start
    engine.scheduler.schedule = original_schedule
    return total, kinds, scheduled_tokens, step_kinds, prof


def seed_profile(args, out) -> None:
    llm, engine, params, prompts = seed_engine(args, async_scheduling=False if args.sync else None)
    lines = [f"seed-like workload: {args.num_prompts} prompts x 1024 in, {args.output_len} out, eager={args.eager}, "
             f"async_scheduling={engine.async_scheduling}"]
    # Pass 1 pays compilation at every step shape; pass 2 is the timing; pass 3 (optional) the profile.
    passes = [("first pass (compiles)", False), ("warm, not profiled", False)]
    if args.profiler:
        passes.append(("warm, profiled", True))
    for label, profiled in passes:
        total, kinds, tokens, step_kinds, prof = run_seed_pass(engine, prompts, params, profiled, args.shapes,
                                                                args.decode_only)
        lines.append(f"{label}: wall {total:.3f} s")
        for kind, times in kinds.items():
            if times:
                lines.append(f"  {kind}: {len(times)} steps, {sum(times):.3f} s, median "
                             f"{1e3 * statistics.median(times):.2f} ms, {tokens[kind]} tokens")
        if profiled:
            for kind, (span, busy, count) in gpu_busy_by_step(prof, step_kinds).items():
                lines.append(f"  {kind}: GPU busy {busy:.3f} s of {span:.3f} s profiled step time over {count} steps "
                             f"({busy / count * 1e3:.2f} ms per step)")
            lines.append(kernel_table(prof, 45))
            if args.shapes:
                lines.append(shape_table(prof, 70))
    text = "\n".join(lines)
    print(text[:6000])
    name = f"profile_seed{'_decode' if args.decode_only else ''}{'_eager' if args.eager else ''}{'_sync' if args.sync else ''}{'' if args.profiler else '_timing'}.txt"
    with open(os.path.join(out, name), "w") as f:
        f.write(text)
    del llm, engine


def kernel_timeline(events, steps: int) -> str:
    """The GPU ops of the last recorded step in launch order: start offset, duration and the idle gap
    before each, so a replay's time splits into kernel time and the gaps between kernels."""
    ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    per_step = len(ops) // steps
    last = ops[-per_step:]
    t0 = last[0][0]
    busy = sum(end - start for start, end, _ in last)
    span = last[-1][1] - t0
    lines = [f"last step: {len(last)} GPU ops, span {span:.1f} us, kernel time {busy:.1f} us, "
             f"gaps {span - busy:.1f} us",
             f"{'start us':>9} {'dur us':>8} {'gap us':>7}  name"]
    prev_end = t0
    for start, end, name in last:
        lines.append(f"{start - t0:>9.1f} {end - start:>8.1f} {start - prev_end:>7.1f}  {name[:110]}")
        prev_end = max(prev_end, end)
    return "\n".join(lines)


def decode_profile(args, out) -> None:
    lines = []
    spec = ({"speculative_config": {"method": "mtp", "num_speculative_tokens": args.spec_k, "adaptive": False}}
            if args.spec_k else {})  # every step verifies spec_k drafts
    for eager in ((False,) if args.spec_k or args.graphs_only else (True, False)):
        llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_seqs=1, cuda_graph_sizes=[1],
                  enforce_eager=eager, kv_cache_memory_bytes=4 * 1024**3, **spec)
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": list(range(100, 356))},
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_us = sum(e.device_time for e in events)
        lines.append(f"batch-1 decode, eager={eager}, spec_k={args.spec_k}: {len(events) / 5:.0f} GPU ops per step, "
                     f"summed GPU op time {kernel_us / 5 / 1e3:.3f} ms per step")
        lines.append(kernel_table(prof, 60))
        lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90))
        if not eager:
            lines.append(kernel_timeline(events, steps=5))
        del llm, engine
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text[:8000])
    with open(os.path.join(out, f"profile_decode{f'_spec{args.spec_k}' if args.spec_k else ''}.txt"), "w") as f:
        f.write(text)


def phase_timers(engine) -> tuple[dict[str, dict[str, list[float]]], list[str | None]]:
    """Wrap the engine's host phases with timers that record, under the step kind in timing[0],
    while it is set."""
    from sparseserve.worker import cuda_graph, model_runner

    phases: dict[str, dict[str, list[float]]] = {}
    timing: list[str | None] = [None]

    def wrap(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            kind = timing[0]
            if kind is None:
                return original(*a, **k)
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                phases.setdefault(kind, {}).setdefault(key, []).append(time.perf_counter() - t)

        setattr(owner, name, wrapper)

    runner = engine.runner
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine, "_launch", "engine._launch")
    wrap(runner, "launch", "  runner.launch")
    wrap(runner, "forward", "    runner.forward")
    wrap(cuda_graph, "build_batch", "      graph: build_batch")
    wrap(cuda_graph.StaticBatch, "fill", "      graph: StaticBatch.fill")
    wrap(torch.cuda.CUDAGraph, "replay", "      graph: CUDAGraph.replay")
    wrap(model_runner, "to_host", "    to_host copies")
    wrap(engine, "_collect", "engine._collect")
    wrap(runner, "collect", "  runner.collect")
    wrap(runner.watchdog, "wait", "    watchdog.wait (GPU)")
    return phases, timing


def async_timing(args, out) -> None:
    """The seed-like workload as the benchmark runs it (async scheduling, no per-step sync): the
    interval between successive step() returns, by the kind of step each call launched, and a
    cProfile of the host during the decode phase. Shows whether decode is host- or GPU-bound."""
    import cProfile
    import io
    import pstats

    llm, engine, params, prompts = seed_engine(args)
    lines = [f"async timing: {args.num_prompts} prompts x 1024 in, {args.output_len} out, eager={args.eager}, "
             f"async_scheduling={engine.async_scheduling}"]
    phases, timing = phase_timers(engine)
    for label in ("first pass (compiles)", "warm", "warm, host profiled in decode"):
        for i, ids in enumerate(prompts):
            engine.add_request(f"{label}-{i}", {"prompt_token_ids": ids}, params)
        intervals: dict[str, list[float]] = {"prefill/mixed": [], "decode": []}
        profiler = cProfile.Profile() if "profiled" in label else None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = last = time.perf_counter()
        while engine.has_unfinished_requests():
            decode = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running) \
                and not engine.scheduler.waiting
            if profiler is not None and decode:
                profiler.enable()
            timing[0] = ("decode" if decode else "prefill/mixed") if label == "warm" else None
            engine.step()
            if profiler is not None:
                profiler.disable()
            now = time.perf_counter()
            intervals["decode" if decode else "prefill/mixed"].append(now - last)
            last = now
        total = time.perf_counter() - start
        lines.append(f"{label}: wall {total:.3f} s")
        for kind, times in intervals.items():
            if times:
                lines.append(f"  {kind}: {len(times)} steps, {sum(times):.3f} s, median "
                             f"{1e3 * statistics.median(times):.2f} ms")
        if label == "warm":
            for kind, by_key in phases.items():
                lines.append(f"  host phases of the {kind} steps (median ms per call; calls per step):")
                steps = max(len(intervals[kind]), 1)
                for key, times in by_key.items():
                    lines.append(f"    {key:<44} {1e3 * statistics.median(times):8.3f}  {len(times) / steps:5.2f}")
        if profiler is not None:
            buf = io.StringIO()
            pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(40)
            lines.append(buf.getvalue())
    text = "\n".join(lines)
    print(text[:6000])
    with open(os.path.join(out, f"profile_async{'_eager' if args.eager else ''}.txt"), "w") as f:
        f.write(text)
    del llm, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--sync", action="store_true", help="seed profile with async scheduling off")
    parser.add_argument("--spec-k", type=int, default=0, help="profile speculative (MTP) decode steps, graphs only")
    parser.add_argument("--no-profiler", dest="profiler", action="store_false",
                        help="time the steps only (the profiler's per-op overhead inflates host-bound steps)")
    parser.add_argument("--graphs-only", action="store_true", help="decode profile: the graph replay only")
    parser.add_argument("--decode-only", action="store_true", help="seed profile: record only the decode phase")
    parser.add_argument("--shapes", action="store_true", help="seed profile: also aten ops grouped by input shape")
    parser.add_argument("--only", default="seed,decode")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if "decode" in args.only:
        decode_profile(args, args.out_dir)
    if "seed" in args.only:
        seed_profile(args, args.out_dir)
    if "async" in args.only:
        async_timing(args, args.out_dir)


if __name__ == "__main__":
    main()
