"""Where the GPU time goes: a kernel-level profile of the seed workload and of a batch-1 decode step.

    PYTHONPATH=. python tools/profile_steps.py --out-dir $OUT

Writes `profile_seed.txt` (engine steps classified as prefill/mixed or pure decode, their wall
time, and the CUDA kernels by total time over a reduced seed workload) and `profile_decode.txt`
(one eager batch-1 decode step: kernel count, summed kernel time, the kernels by time; and the
graph replay time of the same step). Diagnostic only; the benchmarks hold the reported numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve import LLM, SamplingParams


def kernel_table(prof, rows: int) -> str:
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)


def seed_profile(args, out) -> None:
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, enforce_eager=args.eager)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = torch.randint(10, 100000, (args.num_prompts, 1024), generator=gen).tolist()
    # Warm-up at the workload's step shapes (full 8192-token prefill steps) so compilation is outside the timing.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": ids}, params)
    kinds: dict[str, list[float]] = {"prefill/mixed": [], "decode": []}
    scheduled_tokens: dict[str, int] = {"prefill/mixed": 0, "decode": 0}
    original_schedule = engine.scheduler.schedule
    last_kind = ["decode"]

    def schedule():
        sched = original_schedule()
        decode = all(c.num_tokens == 1 + c.num_draft for c in sched.chunks) and all(
            c.request.num_computed_tokens >= len(c.request.prompt_token_ids) for c in sched.chunks)
        last_kind[0] = "decode" if decode else "prefill/mixed"
        scheduled_tokens[last_kind[0]] += sum(c.num_tokens for c in sched.chunks)
        return sched

    engine.scheduler.schedule = schedule
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if args.profiler \
            else contextlib.nullcontext() as prof:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            kinds[last_kind[0]].append(time.perf_counter() - t)
    total = time.perf_counter() - start
    lines = [f"seed-like workload: {args.num_prompts} prompts x 1024 in, {args.output_len} out, eager={args.eager}",
             f"wall ({'profiled' if args.profiler else 'not profiled'}) {total:.2f} s"]
    for kind, times in kinds.items():
        if times:
            lines.append(f"{kind}: {len(times)} steps, {sum(times):.2f} s, median {1e3 * statistics.median(times):.1f} ms, "
                         f"{scheduled_tokens[kind]} tokens")
    if args.profiler:
        lines.append(kernel_table(prof, 45))
    text = "\n".join(lines)
    print(text[:6000])
    name = f"profile_seed{'_eager' if args.eager else ''}{'' if args.profiler else '_timing'}.txt"
    with open(os.path.join(out, name), "w") as f:
        f.write(text)
    del llm, engine


def decode_profile(args, out) -> None:
    lines = []
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": args.spec_k}} if args.spec_k else {}
    for eager in ((False,) if args.spec_k else (True, False)):
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
        del llm, engine
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text[:8000])
    with open(os.path.join(out, f"profile_decode{f'_spec{args.spec_k}' if args.spec_k else ''}.txt"), "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--spec-k", type=int, default=0, help="profile speculative (MTP) decode steps, graphs only")
    parser.add_argument("--no-profiler", dest="profiler", action="store_false",
                        help="time the steps only (the profiler's per-op overhead inflates host-bound steps)")
    parser.add_argument("--only", default="seed,decode")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if "decode" in args.only:
        decode_profile(args, args.out_dir)
    if "seed" in args.only:
        seed_profile(args, args.out_dir)


if __name__ == "__main__":
    main()
