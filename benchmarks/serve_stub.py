"""The host's cost alone, for `benchmarks/serve_overhead.py --stub-model`: the tiny checkpoint on the
CPU with its forward replaced by `host_overhead.FixedLogitsModel` (no compute), decode steps built
as on CUDA (padded to a bucket) and async scheduling on, either offline or served.

    python -m benchmarks.serve_stub offline --input-len 32 --output-len 64 --num-prompts 200 --out FILE
    python -m benchmarks.serve_stub serve --port 8000

What is left per token is the engine's Python, the server's (event loop, SSE, HTTP) and the GIL
they share; compare the CPU per output token of the two, not wall times, on a shared CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stub_llm(max_num_seqs: int, max_model_len: int):
    import torch

    from benchmarks.host_overhead import install_stub
    from sparseserve import LLM
    from sparseserve.model.loader import CONFIGS_DIR

    torch.set_num_threads(1)  # the ops are tiny: intra-op threads only add wake-up waits on a shared CPU
    llm = LLM(str(CONFIGS_DIR / "tiny"), device="cpu", dtype="float32", max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, async_scheduling=True)
    runner = llm.llm_engine.runner
    install_stub(runner, max_num_seqs * 8 + runner.max_num_batched_tokens)
    return llm


def offline(args) -> None:
    from sparseserve import SamplingParams
    from sparseserve.benchmarks.throughput import random_prompts

    llm = stub_llm(args.max_num_seqs, args.max_model_len)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, 500)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(args.out).write_text(json.dumps({"output_tokens_per_second": tokens / elapsed, "device": "cpu (stub model)",
                                          "cpu_us_per_output_token": 1e6 * cpu / tokens}))


def serve(args) -> None:
    import uvicorn

    from sparseserve.engine.async_engine import AsyncLLMEngine
    from sparseserve.entrypoints.openai.api_server import build_app, frozen_startup_heap

    llm = stub_llm(args.max_num_seqs, args.max_model_len)
    engine = AsyncLLMEngine(llm.llm_engine)
    app = build_app(engine, ["tiny"])
    engine.start()
    try:
        with frozen_startup_heap():  # as run_server
            uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=("offline", "serve"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--out", default="serve_stub_offline.json")
    args = ap.parse_args(argv)
    offline(args) if args.role == "offline" else serve(args)


if __name__ == "__main__":
    main()
