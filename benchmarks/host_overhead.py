"""Host time of an engine step without the model: scheduling, metadata, sampling bookkeeping.

    python -m benchmarks.host_overhead [--batch 200] [--steps 64] [--async-scheduling]

The tiny checkpoint runs the prefill; then its forward is replaced by a stub that returns fixed
logits, so what is timed per decode step is the engine's own Python and numpy work (on the CPU;
on a GPU machine the graph launch and copies add to it). With async scheduling on a GPU, a
decode step costs about max(this, the replay's GPU time), so this is the number to shrink when
decode is host-bound. Phases are timed by wrapping the engine's methods.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from sparseserve import LLM, RequestOutputKind, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.worker import model_runner


class FixedLogitsModel:
    """Stands in for the model: streams of zeros and fixed random logits (no compute)."""

    def __init__(self, hf, max_rows: int) -> None:
        self.shape = (hf.hc_mult, hf.hidden_size)
        self.logits = torch.rand(max_rows, hf.vocab_size)

    def __call__(self, batch, state, topk=None) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, *self.shape)

    def compute_logits(self, hidden: torch.Tensor, out=None) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


def install_stub(runner, max_rows: int) -> None:
    """Replace `runner`'s model by a FixedLogitsModel and build its decode steps as on CUDA (padded
    to a bucket), so what runs per step is the host's work alone."""
    runner.model = FixedLogitsModel(runner.model_config.hf_config, max_rows)
    runner.pad_like_graphs = True


def timed(phases: dict, owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[key].append(time.perf_counter() - t)

    setattr(owner, name, wrapper)


def measure(batch: int, steps: int, async_scheduling: bool, prompt_len: int = 20) -> dict:
    llm = LLM(str(CONFIGS_DIR / "tiny"), device="cpu", max_model_len=2048, max_num_seqs=max(batch, 1),
              skip_tokenizer_init=True, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    runner = engine.runner
    runner.pad_like_graphs = True  # decode steps built as on CUDA (padded to a bucket)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [10 + (i + j) % 400 for j in range(prompt_len)]}, params)
    while not all(r.output_token_ids for r in engine.requests.values()):
        engine.step()  # the prefills, with the real model: every step timed below is a decode step
    runner.model = FixedLogitsModel(runner.model_config.hf_config, max(batch, 1))
    phases: dict[str, list[float]] = collections.defaultdict(list)
    timed(phases, engine.scheduler, "schedule", "schedule")
    timed(phases, runner, "launch", "runner.launch")
    timed(phases, runner, "forward", "runner.launch: forward (metadata, model stub)")
    timed(phases, runner, "collect", "runner.collect")
    timed(phases, model_runner, "decode_batch", "forward: decode_batch")
    step_times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    result = {"batch": batch, "prompt_len": prompt_len, "decode_steps": len(step_times), "async_scheduling": async_scheduling,
              "step_ms_median": 1e3 * statistics.median(step_times)}
    result["phases_ms_median"] = {k: 1e3 * statistics.median(v) for k, v in phases.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=20,
                        help="prompt tokens per request (1024 for the seed workload: long block tables)")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = measure(args.batch, args.steps, args.async_scheduling, args.prompt_len)
    print(f"batch {result['batch']}, prompts of {result['prompt_len']}: {result['decode_steps']} decode steps, host time per step "
          f"{result['step_ms_median']:.3f} ms (median)")
    for name, ms in result["phases_ms_median"].items():
        print(f"  {name}: {ms:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
