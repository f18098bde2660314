"""The `sparseserve` command on the embedded tiny model (CPU, small sizes): every command runs and
prints the fields it promises; bad flags and unsupported options are clean errors."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparseserve.config import EngineConfig
from sparseserve.entrypoints.cli import build_parser, engine_kwargs, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--input-len", "16", "--output-len", "4", "--dtype", "float32", "--device", "cpu"]
THROUGHPUT_RE = re.compile(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$",
                           re.M)
STEP_RE = r"^{}: mean ([\d.]+), p50 ([\d.]+), p90 ([\d.]+), p99 ([\d.]+) \((\d+) steps\)$"


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model gains nothing from intra-op threads, and they slow down badly on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def check_throughput_output(out: str, prompts: int, input_len: int, output_len: int) -> tuple[float, float, float]:
    m = THROUGHPUT_RE.search(out)
    assert m, out
    req_s, total_s, out_s = map(float, m.groups())
    assert req_s > 0 and total_s > out_s > 0
    assert f"Total num prompt tokens:  {prompts * input_len}\n" in out
    assert f"Total num output tokens:  {prompts * output_len}\n" in out
    # The three rates share one elapsed time (2-decimal printing limits the precision).
    assert total_s / req_s == pytest.approx(input_len + output_len, rel=0.05)
    return req_s, total_s, out_s


@pytest.mark.parametrize("backend", ["sparseserve", "hf"])
def test_bench_throughput(backend, capsys, tmp_path):
    out_json = tmp_path / "t.json"
    rc = main(["bench", "throughput", *SMALL, "--num-prompts", "4", "--backend", backend, "--hf-batch-size", "3",
               "--output-json", str(out_json)])
    assert rc == 0
    check_throughput_output(capsys.readouterr().out, 4, 16, 4)
    result = json.loads(out_json.read_text())
    assert result["backend"] == backend and result["num_requests"] == 4
    assert result["total_prompt_tokens"] == 64 and result["total_output_tokens"] == 16
    assert result["total_num_tokens"] == 80
    if backend == "sparseserve":  # the timed run's Triton builds are recorded (none on the CPU path)
        assert result["triton_builds_in_timed_run"] == 0 and result["triton_builds_timed_kernels"] == []
    assert result["output_tokens_per_second"] == pytest.approx(16 / result["elapsed_time"])
    assert result["device"] == "cpu"


@pytest.mark.parametrize("backend", ["sparseserve", "hf"])
def test_bench_latency(backend, capsys, tmp_path):
    out_json = tmp_path / "l.json"
    rc = main(["bench", "latency", *SMALL, "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "0",
               "--backend", backend, "--output-json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    prefill = re.search(STEP_RE.format(re.escape("Prefill step latency (ms)")), out, re.M)
    decode = re.search(STEP_RE.format(re.escape("Decode step latency (ms)")), out, re.M)
    assert prefill and decode, out
    p50, p90, p99 = map(float, decode.groups()[1:4])
    assert 0 < p50 <= p90 <= p99
    # Two timed iterations; the prompts fit one step; 4 tokens = 1 from prefill + 3 decode steps.
    assert int(prefill.group(5)) == 2 and int(decode.group(5)) == 2 * 3
    assert re.search(r"^Avg latency: [\d.]+ seconds$", out, re.M)
    assert re.search(r"^99% percentile latency: [\d.]+ seconds$", out, re.M)
    assert "Decode throughput:" in out and "Floors at" in out
    ttft = re.search(STEP_RE.format(re.escape("Time to first token (ms)")).replace("steps", "requests"), out, re.M)
    batch_ttft = re.search(STEP_RE.format(re.escape("Time to first token of the batch (ms)"))
                           .replace("steps", "iterations"), out, re.M)
    assert ttft and batch_ttft, out
    assert int(ttft.group(5)) == 2 * 2 and int(batch_ttft.group(5)) == 2
    result = json.loads(out_json.read_text())
    assert result["output_tokens_per_iteration"] == [8, 8]
    # The first token comes with the prefill: TTFT covers the prefill step, never a whole iteration.
    assert result["ttft"]["count"] == 4 and result["batch_ttft"]["count"] == 2
    assert result["prefill_step"]["min_ms"] <= result["batch_ttft"]["min_ms"] < result["iteration"]["min_ms"]
    assert result["ttft"]["max_ms"] == pytest.approx(result["batch_ttft"]["max_ms"])
    assert result["decode_step"]["count"] == 6 and len(result["latencies"]) == 2
    assert result["roofline"]["decode_weight_bytes"] > 0


def test_generate_prints_completions(capsys):
    assert main(["generate", "--prompt", "Flat is better than", "--max-tokens", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "Prompt: 'Flat is better than'" in out and "Generated: " in out and "[3 tokens, length]" in out


@pytest.mark.parametrize("model,gib", [("deepseek-v4-flash", "6.72"), ("deepseek-v4-pro", "9.62")])
def test_kv_plan_full_configs(model, gib, capsys):
    assert main(["kv-plan", "--model", model, "--max-model-len", "1048576", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if l.startswith("per sequence at 1,048,576 tokens (bfloat16)")]
    assert line, out
    assert f"compressed state {gib} GiB" in line[0] and "dense-MLA" in line[0]
    assert "dense-MLA estimate" in out and "max concurrency" in out


def test_kv_plan_default_model(capsys):
    assert main(["kv-plan", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: demo (4 layers)") and "compressed state" in out


def test_speculative_tokens_run_or_fail_cleanly(capsys, tmp_path):
    """--num-speculative-tokens N is MTP speculation: it runs, or (where the engine lacks it) is an
    `error: ...` exit, never a traceback."""
    out_json = tmp_path / "s.json"
    rc = main(["bench", "throughput", *SMALL, "--num-prompts", "2", "--num-speculative-tokens", "2",
               "--output-json", str(out_json)])
    captured = capsys.readouterr()
    if rc == 0:
        check_throughput_output(captured.out, 2, 16, 4)
        assert json.loads(out_json.read_text())["engine_args"]["speculative_config"] == {
            "method": "mtp", "num_speculative_tokens": 2}
    else:
        assert rc == 2 and captured.err.startswith("error: ") and "speculative" in captured.err


@pytest.mark.parametrize("extra", [
    ["--backend", "hf", "--num-speculative-tokens", "1"],
    ["--num-speculative-tokens", "1", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
    ["--tensor-parallel-size", "3"],  # does not divide the heads: ConfigError
])
def test_unsupported_options_are_clean_errors(extra, capsys):
    rc = main(["bench", "latency", *SMALL, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err


def test_engine_value_errors_are_clean(capsys):
    rc = main(["bench", "throughput", *SMALL, "--num-prompts", "2", "--topk-backend", "nope"])
    assert rc == 2 and "topk_backend" in capsys.readouterr().err
    rc = main(["bench", "throughput", *SMALL, "--num-prompts", "0"])
    assert rc == 2 and "--num-prompts" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench"],
    ["bench", "throughput", "--input-len", "x"],
    ["bench", "throughput", "--no-such-flag"],
    ["bench", "latency", "--backend", "vllm"],
    ["kv-plan"],  # --max-model-len is required
])
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate"], ["bench", "throughput"], ["bench", "latency"]])
def test_every_engine_option_is_a_flag(command):
    parser = build_parser()
    args = parser.parse_args(command)
    for f in dataclasses.fields(EngineConfig):
        assert hasattr(args, f.name), f"{' '.join(command)} lacks --{f.name.replace('_', '-')}"
    # Only options that differ from their defaults reach LLM(...).
    assert engine_kwargs(args) == {"model": None}
    args = parser.parse_args([*command, "--enforce-eager", "--gpu-memory-utilization", "0.5",
                              "--max-num-batched-tokens", "64", "--max-model-len", "128", "--load-format", "dummy",
                              "--hf-overrides", '{"num_hidden_layers": 2}', "--model", "v4-flash-2l16e"])
    assert engine_kwargs(args) == {"model": "v4-flash-2l16e", "enforce_eager": True, "gpu_memory_utilization": 0.5,
                                   "max_num_batched_tokens": 64, "max_model_len": 128, "load_format": "dummy",
                                   "hf_overrides": {"num_hidden_layers": 2}}


def test_speculative_tokens_map_to_mtp_config():
    from sparseserve.benchmarks.throughput import engine_kwargs as bench_kwargs

    args = build_parser().parse_args(["bench", "throughput", "--num-speculative-tokens", "3"])
    assert bench_kwargs(args)["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}


def test_hf_baseline_matches_engine_greedy():
    """The baseline computes the same function: same weights, same greedy tokens (tiny, float32)."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.benchmarks.hf_baseline import hf_generate, load_hf_model
    from sparseserve.benchmarks.throughput import random_prompts

    prompts = random_prompts(3, 16, 512, seed=3)
    hf = load_hf_model(None, torch.float32, torch.device("cpu"))
    ref = hf_generate(hf, prompts, 4, batch_size=2)
    llm = LLM(dtype="float32", device="cpu")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_roofline_anchor():
    """The weight-read floor of one batch-1 decode step of v4-flash-2l16e is ~0.53 ms (docs/performance.md)."""
    from sparseserve.benchmarks.latency import HBM_BYTES_PER_S, decode_weight_bytes, model_facts

    facts = model_facts("v4-flash-2l16e")
    assert facts["params"] == pytest.approx(2.15e9, rel=0.01)
    assert decode_weight_bytes(facts, 1) / HBM_BYTES_PER_S * 1e3 == pytest.approx(0.53, rel=0.02)


def test_run_all_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    rc = run_all.main(["--model", "tiny", "--input-len", "8", "--output-len", "2", "--num-prompts", "3",
                       "--warmup-prompts", "0", "--latency-batches", "2", "--latency-output-len", "3",
                       "--latency-iters", "1", "--only", "graphs,eager,hf,latency-b2",
                       "--engine-flag=--device=cpu", "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "seed_workload.json").read_text())
    for name in ("graphs", "eager", "hf"):
        assert results["throughput"][name]["status"] == "ok", results["throughput"][name]
        assert results["throughput"][name]["total_output_tokens"] == 6
        assert results["throughput"][name]["command"].startswith("sparseserve bench throughput --model tiny")
    assert results["latency"]["latency-b2"]["decode_step"]["count"] == 2
    assert "speedup_vs_hf" in results["summary"] and "graphs_over_eager" in results["summary"]
    assert "graphs vs transformers:" in out and "graphs vs eager:" in out


def test_run_all_keeps_an_earlier_round_when_a_later_one_is_skipped():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    section = {"graphs": {"status": "ok", "round": 1, "output_tokens_per_second": 123.0}}
    run_all.record_skip(section, "graphs", "cmd")
    run_all.record_skip(section, "graphs", "cmd")
    run_all.record_skip(section, "eager", "cmd")
    assert section["graphs"]["status"] == "ok" and section["graphs"]["output_tokens_per_second"] == 123.0
    assert section["graphs"]["later_rounds_skipped"] == 2
    assert section["eager"]["status"] == "skipped"
    section["hf"] = {"status": "timeout", "round": 1}
    run_all.record_skip(section, "hf", "cmd")
    assert section["hf"]["status"] == "timeout" and section["hf"]["later_rounds_skipped"] == 1


def test_console_script_subprocess(tmp_path):
    """The installed `sparseserve` script when it is on PATH, else the same entry point via -m."""
    exe = shutil.which("sparseserve")
    cmd = [exe] if exe else [sys.executable, "-m", "sparseserve.entrypoints.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([*cmd, "bench", "throughput", *SMALL, "--num-prompts", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_throughput_output(proc.stdout, 2, 16, 4)


def test_run_all_table_flags_runs_that_built_kernels_while_timed():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    run = {"requests_per_second": 100.0, "tokens_per_second": 1e5, "output_tokens_per_second": 1e4,
           "elapsed_time": 1.0}
    results = {"throughput": {"graphs": {**run, "triton_builds_in_timed_run": 3}, "eager": dict(run)}, "latency": {}}
    lines = run_all.table(results).splitlines()
    graphs = next(line for line in lines if line.startswith("graphs"))
    eager = next(line for line in lines if line.startswith("eager"))
    assert "3 Triton builds in the timed run" in graphs and "Triton" not in eager
