"""The decode-step benchmark runs end to end (CPU smoke test on the tiny checkpoint: plain and speculative)."""
import pytest

from sparseserve.benchmarks.decode_graphs import measure
from sparseserve.model.loader import CONFIGS_DIR


@pytest.mark.parametrize("spec_k", [0, 1])
def test_decode_graphs_measure_runs_on_cpu(spec_k):
    result = measure(str(CONFIGS_DIR / "tiny"), batch=2, enforce_eager=True, steps=4, prompt_len=8, spec_k=spec_k,
                     kv_cache_bytes=64 * 1024**2)
    assert result["step_ms_median"] > 0 and result["forward_ms_median"] > 0 and result["weight_bytes"] > 0
    assert (result["acceptance_rate"] is not None) == bool(spec_k)
