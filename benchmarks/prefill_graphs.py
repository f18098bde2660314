"""Prefill steps with and without the piecewise prefill graphs: wall time against GPU busy time and the
compute floor, for one prompt of each length (worker/prefill_graphs.py; issue goals: a 512-token
prefill's wall time <= 1.2x its GPU time, a 2,048-token prefill <= 1.3x its compute floor).

    PYTHONPATH=. python -m benchmarks.prefill_graphs --model v4-flash-43l8e --lengths 512 2048

For each mode ("graphs": the default engine; "eager": `cudagraph_mode="full_decode_only"`, prefill steps
as plain eager forwards) one engine starts, then each length runs `--repeats` prefill steps through the
runner (one fresh prompt from position 0, its logits and greedy token, synchronised): the wall time is
their median; the GPU busy time is the union of the kernel intervals of one more step under the
profiler; the floor is the step's matmul FLOPs at the bf16 rate (`bench latency`'s roofline). Writes a
JSON file with `--out`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve import LLM
from sparseserve.benchmarks.latency import BF16_FLOPS_PER_S, model_facts, prefill_flops
from sparseserve.kernels.argmax import greedy_tokens
from sparseserve.model.batch import SequenceChunk


def busy_seconds(prof) -> float:
    """The union of the CUDA kernel intervals the profiler recorded, in seconds."""
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda)
    busy, cursor = 0.0, float("-inf")
    for start, end in spans:
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    return busy * 1e-6  # the profiler's times are in microseconds


def measure(llm: LLM, length: int, repeats: int, seed: int) -> dict:
    runner = llm.llm_engine.runner
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.llm_engine.vocab_size
    blocks = list(range(-(-length // runner.block_size)))

    def step() -> str:
        ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        logits, describe = runner.forward([SequenceChunk(0, 0, ids, blocks, "last")])
        greedy_tokens(logits)
        return describe()

    mode = step()  # one untimed step
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {"length": length, "step": mode, "wall_ms": statistics.median(walls) * 1e3,
            "wall_ms_all": [w * 1e3 for w in walls], "gpu_busy_ms": busy_seconds(prof) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="v4-flash-43l8e")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"])
    parser.add_argument("--prefill-sizes", type=int, nargs="+", default=None,
                        help="prefill_cuda_graph_sizes (default: the engine's list)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    facts = model_facts(args.model)
    engine_args = dict(load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=4, cuda_graph_sizes=[1],
                       max_num_batched_tokens=max(args.lengths), prefill_cuda_graph_sizes=args.prefill_sizes)
    rows = []
    for mode in args.modes:
        started = time.perf_counter()
        llm = LLM(args.model, **engine_args,
                  cudagraph_mode="full_and_piecewise" if mode == "graphs" else "full_decode_only")
        startup_s = time.perf_counter() - started
        phases = dict(llm.llm_engine.runner.startup_phases)
        for length in args.lengths:
            row = measure(llm, length, args.repeats, seed=length)
            floor = prefill_flops(facts, length, 1) / BF16_FLOPS_PER_S * 1e3
            row.update(mode=mode, startup_s=startup_s, phases=phases, floor_ms=floor,
                       wall_over_gpu=row["wall_ms"] / row["gpu_busy_ms"], wall_over_floor=row["wall_ms"] / floor)
            rows.append(row)
            if args.out:  # rewritten after every row, so a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"model": args.model, "engine_args": engine_args, "rows": rows}, f, indent=1)
            print(f"{mode:6} {length:5} tokens: wall {row['wall_ms']:7.1f} ms, GPU busy {row['gpu_busy_ms']:7.1f} ms "
                  f"(wall/GPU {row['wall_over_gpu']:.2f}), floor {floor:6.1f} ms (wall/floor "
                  f"{row['wall_over_floor']:.2f}); {row['step']}", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
