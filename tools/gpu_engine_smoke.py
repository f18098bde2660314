"""Engine smoke and eager throughput on a GPU (V4-Flash layer shapes, dummy weights).

    PYTHONPATH=. python tools/gpu_engine_smoke.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from sparseserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="v4-flash-2l16e")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, enforce_eager=True,
              gpu_memory_utilization=0.85)
    init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 100000, (args.input_len,), generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cc = llm.llm_engine.cache_config
    result = {
        "card": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "init_s": init_s, "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed, "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_out + args.num_prompts * args.input_len) / elapsed,
        "num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
        "all_cache_free": llm.llm_engine.all_cache_free(),
        "first_tokens": outs[0].outputs[0].token_ids[:8],
    }
    print(json.dumps(result, indent=2))
    print(llm.llm_engine.kv_report())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
