"""Benchmarks that have no other CPU coverage run end to end on the tiny checkpoint (smoke tests:
they catch interface drift, e.g. a runner method whose signature changed under a timing wrapper)."""
import importlib.util
import re
from pathlib import Path

import pytest

from benchmarks.decode_graphs import measure, measure_async
from benchmarks.host_overhead import measure as measure_host
from sparseserve.model.loader import CONFIGS_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec_k", [0, 1])
def test_decode_graphs_measure_runs_on_cpu(spec_k):
    result = measure(str(CONFIGS_DIR / "tiny"), batch=2, enforce_eager=True, steps=4, prompt_len=8, spec_k=spec_k,
                     kv_cache_bytes=64 * 1024**2)
    assert result["step_ms_median"] > 0 and result["forward_ms_median"] > 0 and result["weight_bytes"] > 0
    assert (result["acceptance_rate"] is not None) == bool(spec_k)


def test_decode_graphs_async_steps_run_on_cpu():
    result = measure_async(str(CONFIGS_DIR / "tiny"), batch=2, enforce_eager=True, steps=4, prompt_len=8,
                           kv_cache_bytes=64 * 1024**2)
    assert result["async_step_ms_median"] > 0
    assert result["async_tokens_per_s"] == pytest.approx(2 / (result["async_step_ms_median"] / 1e3))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_overhead_measure_runs(async_scheduling):
    result = measure_host(batch=4, steps=5, async_scheduling=async_scheduling)
    assert result["decode_steps"] >= 5 and result["step_ms_median"] > 0
    assert {"schedule", "runner.launch", "runner.collect"} <= set(result["phases_ms_median"])


@pytest.mark.parametrize("n", [1, 8191, 8192, 3 * 8192 + 517])
def test_read_sum_matches_its_reference(n):
    """The read ceiling's kernel (benchmarks/ceilings.py) against its reference, on random data with a ragged tail."""
    import torch

    from benchmarks.ceilings import read_sum, read_sum_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).to(device)
    got, want = read_sum(x), read_sum_ref(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)  # fp32 sums of 8192 terms in another order


def test_read_sum_rejects_a_strided_input():
    import torch

    from benchmarks.ceilings import read_sum

    with pytest.raises(ValueError, match="contiguous"):
        read_sum(torch.zeros(4, 8, dtype=torch.bfloat16).t())


def test_run_all_kernels_lists_every_micro_benchmark_with_its_indexed_result():
    """Every module `run_all.py --kernels` runs exists in benchmarks/ and its result file is in the results
    index; an unknown name stops the call before anything runs."""
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)

    results_index = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    for module, stem in run_all.KERNEL_BENCHMARKS:
        assert (ROOT / "benchmarks" / f"{module}.py").is_file(), module
        assert f"`{stem}.json`" in results_index, stem
    assert run_all.kernel_benchmark_names("all") == {m for m, _ in run_all.KERNEL_BENCHMARKS}
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.kernel_benchmark_names("kernels,no_such_bench")


def test_the_package_does_not_import_the_micro_benchmarks():
    """The wheel ships sparseserve/ only: nothing in it may import the top-level benchmarks/ folder."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "sparseserve").rglob("*.py")
                 if re.search(r"^\s*(from|import) benchmarks\b", p.read_text(), re.M)]
    assert offenders == []


def test_startup_benchmark_child_reports_a_start(tmp_path):
    """benchmarks/startup.py: one start in its own process with its own Triton cache, as the report records it."""
    import argparse

    from benchmarks.startup import run_start

    args = argparse.Namespace(model="tiny", load_format="dummy", max_model_len=256, smoke=True, timeout_s=120.0)
    result = run_start(args, audit=False, cache_dir=str(tmp_path / "triton"))
    assert "error" not in result, result
    assert result["import_and_llm_s"] > result["load_s"] > 0
    assert isinstance(result["phases_s"], dict) and isinstance(result["forwards"], list)
