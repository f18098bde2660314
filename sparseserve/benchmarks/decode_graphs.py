"""Decode step time with CUDA graphs vs eager (V4-Flash layer shapes, dummy weights).

    PYTHONPATH=. python -m sparseserve.benchmarks.decode_graphs --out decode_graphs.json

For each batch size: B prompts are prefilled, then every following engine step is a pure
decode step; we time whole engine steps (schedule + metadata + forward + sampling) and
the forward alone (replay or eager), median over the steps. Floor: the weight bytes a
decode step must read (every parameter except the embedding table; the experts a batch
touches) over the measured HBM copy bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from sparseserve import LLM, SamplingParams


def hbm_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)


def weight_floor_bytes(llm: LLM, batch: int) -> int:
    model = llm.llm_engine.model
    hf = llm.llm_engine.model_config.hf_config
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            total += p.shape[1] * p.element_size() * batch  # only the rows looked up
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            touched = min(hf.n_routed_experts, batch * hf.num_experts_per_tok)
            total += p.numel() // hf.n_routed_experts * touched * p.element_size()
            continue
        total += p.numel() * p.element_size()
    return total


def measure(model: str, batch: int, enforce_eager: bool, steps: int, prompt_len: int) -> dict:
    llm = LLM(model, load_format="dummy", enforce_eager=enforce_eager, max_model_len=4096, max_num_seqs=max(batch, 1),
              cuda_graph_sizes=[batch], kv_cache_memory_bytes=8 * 1024**3)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, 100000, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    engine.step()  # prefill
    step_times, forward_times = [], []
    runner = engine.runner
    original = runner.forward

    def timed_forward(chunks):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = original(chunks)
        torch.cuda.synchronize()
        forward_times.append(time.perf_counter() - t)
        return result

    runner.forward = timed_forward
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    runner.forward = original
    floor = weight_floor_bytes(llm, batch)
    while engine.has_unfinished_requests():
        engine.step()
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": batch, "mode": "eager" if enforce_eager else "graph",
            "step_ms_median": 1e3 * statistics.median(step_times[2:]),
            "forward_ms_median": 1e3 * statistics.median(forward_times[2:]),
            "weight_bytes": floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bw = hbm_bandwidth()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for eager in (True, False):
            row = measure(args.model, batch, eager, args.steps, args.prompt_len)
            row["floor_ms"] = 1e3 * row["weight_bytes"] / bw
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "model": args.model, "hbm_bytes_per_s": bw, "prompt_len": args.prompt_len, "rows": rows}
    print(f"{'batch':>6}{'mode':>7}{'step ms':>10}{'fwd ms':>9}{'floor ms':>10}{'fwd/floor':>10}")
    for r in rows:
        print(f"{r['batch']:>6}{r['mode']:>7}{r['step_ms_median']:>10.3f}{r['forward_ms_median']:>9.3f}"
              f"{r['floor_ms']:>10.3f}{r['forward_ms_median'] / r['floor_ms']:>10.2f}")
    for b in sorted({r["batch"] for r in rows}):
        e = next(r for r in rows if r["batch"] == b and r["mode"] == "eager")
        g = next(r for r in rows if r["batch"] == b and r["mode"] == "graph")
        print(f"batch {b}: graph speedup {e['step_ms_median'] / g['step_ms_median']:.2f}x per engine step, "
              f"{e['forward_ms_median'] / g['forward_ms_median']:.2f}x per forward")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
