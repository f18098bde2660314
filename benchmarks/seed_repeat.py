"""The seed workload repeated in one engine, for comparing two trees of the engine on one card.

    PYTHONPATH=<tree> python benchmarks/seed_repeat.py [--runs 5] [--tag NAME] [--out FILE]

One untimed run of the whole workload (200 prompts x 1,024 tokens -> 128, greedy, `v4-flash-2l16e`,
dummy weights), then `--runs` timed runs, each on new prompts of the same lengths; prints one JSON
line with every run's output tok/s and the median. A single run lasts about a second on an H200, so
one figure varies by up to 15% between processes: compare medians of processes that alternate
between the two trees (A, B, A, B). It uses only `LLM`, `SamplingParams` and `bench throughput`'s
prompt generator (`random_prompts`), so it runs against older trees of the engine too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparseserve import LLM, SamplingParams
from sparseserve.benchmarks.throughput import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--out", default=None, help="append the JSON line to this file")
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, skip_tokenizer_init=True)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
    rates = []
    for run in range(args.runs + 1):  # run 0 is the untimed warm-up
        batch = [{"prompt_token_ids": p} for p in random_prompts(200, 1024, vocab, 100 + run)]
        sync()
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        sync()
        elapsed = time.perf_counter() - start
        if run:
            rates.append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed)
    line = json.dumps({"tag": args.tag, "output_tok_s": [round(r) for r in rates],
                       "median": round(statistics.median(rates))})
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
