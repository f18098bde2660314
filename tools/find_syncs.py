"""Where a step makes the host wait for the GPU: runs a prefill step, a mixed step and decode steps with
`torch.cuda.set_sync_debug_mode("warn")` and prints each synchronising call's sparseserve frames.

    PYTHONPATH=. python tools/find_syncs.py [--model v4-flash-2l16e] [--eager]

Diagnostic only (CUDA). The one expected sync per step is the host reading the sampled tokens.
"""
from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from sparseserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, enforce_eager=args.eager,
              kv_cache_memory_bytes=8 * 1024**3)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        engine.add_request(f"w{i}", {"prompt_token_ids": torch.randint(10, 9999, (1000,), generator=gen).tolist()},
                           params)
    while engine.has_unfinished_requests():  # warm-up: compile every step shape first
        engine.step()
    for i in range(12):
        engine.add_request(f"r{i}", {"prompt_token_ids": torch.randint(10, 9999, (1000,), generator=gen).tolist()},
                           params)
    sites: collections.Counter = collections.Counter()
    step_name = ["?"]

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{f.filename.split('sparseserve/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if "/sparseserve/" in f.filename]
        sites[(step_name[0], str(message)[:60], " <- ".join(reversed(frames[-4:])))] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    index = 0
    while engine.has_unfinished_requests():
        step_name[0] = f"step {index}"
        engine.step()
        index += 1
    torch.cuda.set_sync_debug_mode(0)
    for (step, message, where), count in sorted(sites.items()):
        print(f"{step}: {count}x {message} at {where}")


if __name__ == "__main__":
    main()
