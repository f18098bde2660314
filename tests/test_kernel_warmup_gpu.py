"""On the GPU: once `LLM(...)` has returned, no request builds a Triton kernel, whatever its length
and whatever the batch it lands in (issue: the first prompt of each new length waited seconds).

Each case runs in a fresh Python process, so the kernels it finds built are the ones its own start-up
built (Triton keeps built kernels per process; a disk-cache hit counts as a build too)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = textwrap.dedent("""
    import json, random, sys, time
    from sparseserve import LLM, SamplingParams
    from sparseserve.kernels.jit_builds import TritonBuilds
    from sparseserve.model.loader import CONFIGS_DIR

    model, kwargs, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    if model == "tiny":
        model = str(CONFIGS_DIR / "tiny")
    started = time.perf_counter()
    with TritonBuilds() as startup:
        llm = LLM(model, **kwargs)
    startup_s = time.perf_counter() - started
    max_len, vocab = kwargs["max_model_len"], llm.llm_engine.vocab_size
    rng = random.Random(0)
    special = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
               1023, 1024, 1025, 2047, 2048, 2049, max_len // 2, max_len - 9]
    special = [n for n in special if 1 <= n <= max_len - 9]
    with TritonBuilds() as serving:
        for r in range(rounds):
            batch = rng.choice([1, 1, 2, 3, 5, 8, 13, 24, kwargs["max_num_seqs"]])
            lengths = [rng.choice(special) if rng.random() < 0.3 else rng.randint(1, max_len - 9)
                       for _ in range(batch)]
            prompts = [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(n)]} for n in lengths]
            params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                                     max_tokens=min(rng.randint(1, 8), max_len - n), ignore_eos=True,
                                     logprobs=rng.choice([None, None, 2]), seed=r)
                      for n in lengths]
            llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    print(json.dumps({"startup_builds": startup.count, "startup_s": startup_s, "builds": serving.count,
                      "kernels": serving.summary(20), "new_keys": serving.new_keys[:8], "phases": getattr(engine.runner, "startup_phases", {}),
                      "steps": [s for s, _ in engine.runner.startup_steps]}))
    llm.shutdown()
""")


def run_case(model: str, kwargs: dict, rounds: int) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, json.dumps(kwargs), str(rounds)],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = {
    # the tiny model, chunked prefill with a budget below max_model_len, async scheduling (the CUDA default)
    "tiny": ("tiny", dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512,
                          enable_chunked_prefill=True, kv_cache_memory_bytes=2 * 1024**3), 40),
    # V4-Flash shapes (64 heads, D = 512: the Hopper attention kernels), 2 layers, 16 experts
    "v4-flash-2l16e": ("v4-flash-2l16e", dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                                              max_num_batched_tokens=2048, enable_chunked_prefill=True,
                                              load_format="dummy", gpu_memory_utilization=0.6), 30),
    # speculation (MTP, 2 drafts): verify and drafter graphs, the drafter's eager catch-up over prompts
    "tiny-mtp": ("tiny", dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=2 * 1024**3,
                              speculative_config={"method": "mtp", "num_speculative_tokens": 2}), 25),
    # adaptive speculation: graphs of every 1 + d, the drafter's state-only catch-up (graphs and eager prompts)
    "tiny-mtp-adaptive": ("tiny", dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
                                       kv_cache_memory_bytes=2 * 1024**3,
                                       speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                           "adaptive": True}), 25),
    # no graphs: decode steps run eagerly, padded to their buckets
    "tiny-eager": ("tiny", dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, enforce_eager=True,
                                kv_cache_memory_bytes=2 * 1024**3), 25),
    # async scheduling with speculation (engine/spec_async.py: the fused greedy verify + draft queued at launch)
    "tiny-mtp-async": ("tiny", dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, async_scheduling=True,
                                    kv_cache_memory_bytes=2 * 1024**3,
                                    speculative_config={"method": "mtp", "num_speculative_tokens": 2}), 25),
    # FP8 KV rows and indexer keys: the packed-row writers and the Triton readers
    "tiny-fp8kv": ("tiny", dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, kv_cache_dtype="fp8",
                                kv_cache_memory_bytes=2 * 1024**3), 25),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_kernel_is_built_after_startup(case):
    model, kwargs, rounds = CASES[case]
    result = run_case(model, kwargs, rounds)
    print(f"{case}: start-up {result['startup_s']:.1f} s, {result['startup_builds']} builds, phases "
          f"{result['phases']}")
    assert result["builds"] == 0, (f"{result['builds']} Triton builds after start-up: {result['kernels']} "
                                   f"{result['new_keys']} (start-up built {result['startup_builds']}; its steps: "
                                   f"{result['steps']})")
    assert "kernel warm-up" in result["phases"] and result["startup_builds"] > 0


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_no_kernel_is_built_after_startup_quantized(tmp_path, expert_dtype):
    """Quantized weights (FP8 linears, FP4 or FP8 experts): the quantized GEMM and activation kernels."""
    from sparseserve.model.loader import CONFIGS_DIR
    from sparseserve.model.release_writer import write_release_checkpoint

    ckpt = write_release_checkpoint(tmp_path / expert_dtype, CONFIGS_DIR / "tiny", expert_dtype=expert_dtype, seed=2)
    result = run_case(str(ckpt), dict(dtype="bfloat16", quantization="auto", max_model_len=1024, max_num_seqs=16,
                                      kv_cache_memory_bytes=2 * 1024**3), 25)
    assert result["builds"] == 0, (f"{result['builds']} Triton builds after start-up: {result['kernels']} "
                                   f"{result['new_keys']} (start-up built {result['startup_builds']})")
