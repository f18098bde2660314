"""Tensor and expert parallelism on the CPU: gloo, one worker process per rank.

Every parallel engine is compared with a one-process engine of the same options: the prompt
logprobs (every prefill position's logits, through chunked prefill), the logprobs of the
greedy tokens (decode, verification of MTP drafts) and the tokens themselves. The tiny model's
indexer top-k has near ties (a 4e-7 gap between the k-th and the next score is seen after some
prompts), which any change of rounding flips; the prompts below keep every gap above 1e-3 over
their greedy continuations.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig
from sparseserve.config_checks import check_parallel_layout
from sparseserve.distributed.process_group import free_port
from sparseserve.errors import (CollectiveTimeoutError, ConfigError, InvalidRequestError, WorkerConfigError,
                                WorkerDiedError)
from sparseserve.model.loader import CONFIGS_DIR, load_hf_config

TINY = str(CONFIGS_DIR / "tiny")
# Chunked prefill (32-token budget), few blocks (preemption by recompute), float32 on the CPU.
COMMON = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, step_timeout_s=30.0)
PROMPTS = [[228, 445, 268, 135, 33, 414, 472, 282, 470, 9, 49, 370, 432, 206, 365, 424, 403, 344, 322, 2, 315, 254,
            425, 446, 172, 126, 375, 168, 362, 447, 34, 99, 471, 292, 115, 124, 413, 497, 74, 413],
           list(range(50, 61)), [7, 300, 21, 99, 4, 5, 6, 400, 12, 77, 250, 31, 8]]
TOL = 2e-4


def _params(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, prompt_logprobs=3, ignore_eos=True)


def _run(llm: LLM, max_tokens: int = 24):
    return llm.generate(PROMPTS, _params(max_tokens), use_tqdm=False)


def _assert_same(ref_outs, outs) -> None:
    for ref, out in zip(ref_outs, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, got in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:]):
            assert want.keys() == got.keys()
            assert max(abs(want[t].logprob - got[t].logprob) for t in want) < TOL
        for want, got in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert want.keys() == got.keys()
            assert max(abs(want[t].logprob - got[t].logprob) for t in want) < TOL


def _compare(options: dict, max_tokens: int = 24):
    ref = LLM(TINY, **COMMON, **{k: v for k, v in options.items()
                                 if k not in ("tensor_parallel_size", "enable_expert_parallel")})
    want = _run(ref, max_tokens)
    del ref
    llm = LLM(TINY, **COMMON, **options)
    procs = llm.llm_engine.runner.procs.procs  # shutdown drops the executor
    try:
        got = _run(llm, max_tokens)
        _assert_same(want, got)
        assert llm.llm_engine.all_cache_free()
        return got
    finally:
        llm.shutdown()
        assert all(not p.is_alive() for p in procs)


def test_tensor_parallel_2_matches_one_process():
    _compare(dict(tensor_parallel_size=2))


def test_expert_parallel_2_with_preemption_matches_one_process():
    # 12 blocks of 16 tokens for three sequences of up to 61 tokens: some are preempted and recomputed.
    outs = _compare(dict(tensor_parallel_size=2, enable_expert_parallel=True, num_gpu_blocks_override=7))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_mtp_speculation_with_expert_parallel_matches_one_process():
    _compare(dict(tensor_parallel_size=2, enable_expert_parallel=True,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2}), max_tokens=16)


def test_tensor_and_expert_parallel_4_match_one_process():
    # 4 ranks: more ranks than the tiny model's 2 output groups (each group's heads on 2 ranks).
    _compare(dict(tensor_parallel_size=4, enable_expert_parallel=True), max_tokens=12)


def test_a_killed_worker_is_a_named_error_not_a_hang():
    llm = LLM(TINY, **{**COMMON, "step_timeout_s": 10.0}, tensor_parallel_size=2)
    engine = llm.llm_engine
    procs = engine.runner.procs.procs
    try:
        with pytest.raises(InvalidRequestError, match="structured_outputs are not supported with tensor_parallel"):
            engine.add_request("json", PROMPTS[1], SamplingParams(structured_outputs={"json_object": True}))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10.0
        with pytest.raises(WorkerDiedError):  # the engine stays failed; nothing waits
            engine.step()
        assert all(not p.is_alive() for p in procs)
    finally:
        llm.shutdown()


def test_a_hung_worker_is_a_collective_timeout():
    llm = LLM(TINY, **{**COMMON, "step_timeout_s": 4.0}, tensor_parallel_size=2)
    engine = llm.llm_engine
    procs = engine.runner.procs.procs
    try:
        engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        engine.step()
        os.kill(procs[1].pid, signal.SIGSTOP)  # alive but never answers: rank 0 waits in a collective
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="within 4 s"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 4.0 + 3.0  # the deadline, plus the diagnosis and stopping the workers
        assert all(not p.is_alive() for p in procs)
    finally:
        llm.shutdown()


def test_a_failed_start_stops_the_workers():
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        LLM(TINY, **COMMON, tensor_parallel_size=2, kv_cache_memory_bytes=1)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("sparseserve-rank")]


def test_layout_checks_name_the_field():
    hf = load_hf_config(CONFIGS_DIR / "tiny")  # 4 heads, 2 output groups, 8 experts, intermediate 64
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ConfigError, match="num_attention_heads"):
        check_parallel_layout(EngineConfig(tensor_parallel_size=3), hf, cpu)
    with pytest.raises(ConfigError, match="n_routed_experts"):
        hf6 = load_hf_config(CONFIGS_DIR / "tiny", {"n_routed_experts": 6})
        check_parallel_layout(EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True), hf6, cpu)
    check_parallel_layout(EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True), hf, cpu)
    with pytest.raises(ConfigError, match="sees 1 GPU"):
        check_parallel_layout(EngineConfig(tensor_parallel_size=2), hf, cuda, visible_gpus=1)
    check_parallel_layout(EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=1), hf, cuda,
                          visible_gpus=1)
    with pytest.raises(ConfigError, match="node_rank=2 must be below nnodes=2"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_addr="h", master_port=1).validate()
    with pytest.raises(ConfigError, match="multiple of nnodes=2"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_addr="h", master_port=1).validate()
    with pytest.raises(ConfigError, match="needs master_addr"):
        EngineConfig(tensor_parallel_size=2, nnodes=2).validate()


def _start_node(rank: int, port: int, extra: list[str] = ()) -> subprocess.Popen:
    """Another "node" on this machine: the CLI with --node-rank, running workers only."""
    cmd = [sys.executable, "-m", "sparseserve.entrypoints.cli", "generate", "--model", TINY, "--device", "cpu",
           "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
           "--step-timeout-s", "30", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    # One thread: both "nodes" share this machine's cores.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_through_the_rendezvous():
    ref = LLM(TINY, **COMMON)
    want = _run(ref, 8)
    del ref
    port = free_port()
    node1 = _start_node(1, port)
    try:
        llm = LLM(TINY, **COMMON, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port)
        assert len(llm.llm_engine.runner.procs.procs) == 1  # this node's rank; rank 1 is node 1's
        try:
            _assert_same(want, _run(llm, 8))
        finally:
            llm.shutdown()
        assert node1.wait(timeout=30) == 0  # node 1 stops when node 0's engine does
    finally:
        node1.kill()
        node1.communicate()


def test_nodes_started_with_different_options_fail_at_start_up():
    port = free_port()
    node1 = _start_node(1, port, ["--max-num-seqs", "2"])
    try:
        with pytest.raises(WorkerConfigError, match="different options.*max_num_seqs"):
            LLM(TINY, **COMMON, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                master_port=port)
        assert node1.wait(timeout=30) == 2  # a ConfigError there too: the CLI's exit code for a bad value
    finally:
        node1.kill()
        node1.communicate()
