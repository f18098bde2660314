"""SPARSESERVE_SM_CARVEOUT: validated, applied on CUDA only."""
import pytest
import torch

from sparseserve.worker.sm_carveout import ENV, apply_sm_carveout


def test_unset_or_cpu_leaves_everything(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert apply_sm_carveout(torch.device("cpu")) == 0
    monkeypatch.setenv(ENV, "8")
    assert apply_sm_carveout(torch.device("cpu")) == 0


@pytest.mark.parametrize("raw", ["eight", "1.5"])
def test_a_bad_value_says_what_to_change(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match="whole number of SMs"):
        apply_sm_carveout(torch.device("cpu"))


@pytest.mark.gpu
def test_out_of_range_on_the_gpu(monkeypatch):
    monkeypatch.setenv(ENV, "100000")
    with pytest.raises(ValueError, match="must lie in"):
        apply_sm_carveout(torch.device("cuda"))
