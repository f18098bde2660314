"""Start-up from a release-format checkpoint on disk: wall time of `import sparseserve` + `LLM(...)`,
the process's peak resident memory and the GPU's peak allocation.

    python tools/write_release_checkpoint.py --out DIR --model deepseek-v4-flash --num-layers 43 \
        --num-experts 8 --expert-dtype fp4 --device cuda
    python benchmarks/release_load.py DIR [--out FILE]

The engine is built with CUDA graphs off (`enforce_eager=True`: graph capture is not loading) and half
the GPU (`gpu_memory_utilization=0.5`), so the GPU peak is the weights plus that KV cache.
"""
from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a release-format checkpoint directory")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    start = time.perf_counter()
    import torch

    from sparseserve import LLM

    LLM(args.checkpoint, enforce_eager=True, skip_tokenizer_init=True, max_model_len=args.max_model_len,
        gpu_memory_utilization=0.5)
    result = {"checkpoint": args.checkpoint, "load_s": time.perf_counter() - start,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
