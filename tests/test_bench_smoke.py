"""Benchmarks that have no other CPU coverage run end to end on the tiny checkpoint (smoke tests:
they catch interface drift, e.g. a runner method whose signature changed under a timing wrapper)."""
import pytest

from sparseserve.benchmarks.decode_graphs import measure, measure_async
from sparseserve.benchmarks.host_overhead import measure as measure_host
from sparseserve.model.loader import CONFIGS_DIR


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
