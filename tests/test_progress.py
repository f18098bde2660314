"""Progress a person can see: tqdm bars on a terminal only (never in logs or CI), and the start-up
report's line about the forwards start-up ran."""
import io
import logging
import sys

import pytest
import torch

from sparseserve import LLM
from sparseserve.errors import ConfigTypeError
from sparseserve.logger import progress_bar, show_progress
from sparseserve.model.loader import CONFIGS_DIR, load_model

TINY = CONFIGS_DIR / "tiny"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def info_level():
    logger = logging.getLogger("sparseserve")
    old = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(old)


def test_bars_only_on_a_terminal_at_info(monkeypatch, info_level):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not show_progress()
    for _ in progress_bar(range(3), desc="quiet"):
        pass
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert show_progress()
    info_level.setLevel(logging.WARNING)
    assert not show_progress()
    info_level.setLevel(logging.NOTSET)  # not set up (a bench client): SPARSESERVE_LOGGING_LEVEL decides
    monkeypatch.setenv("SPARSESERVE_LOGGING_LEVEL", "ERROR")
    assert not show_progress()
    monkeypatch.delenv("SPARSESERVE_LOGGING_LEVEL")
    assert show_progress()


def test_loading_and_dummy_weights_show_bars(monkeypatch, info_level):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # in the test body: pytest's capture resets it between phases
    load_model(str(TINY), torch.float32, torch.device("cpu"))
    text = terminal.getvalue()
    assert "Loading safetensors checkpoint (1 shards)" in text and "100%" in text, text
    load_model(str(TINY), torch.float32, torch.device("cpu"), load_format="dummy")
    assert "Initializing dummy weights" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    load_model(str(TINY), torch.float32, torch.device("cpu"), progress=False)  # LLM(use_tqdm_on_load=False)
    assert terminal.getvalue() == ""


def test_use_tqdm_on_load_is_checked():
    with pytest.raises(ConfigTypeError, match="use_tqdm_on_load"):
        LLM(str(TINY), device="cpu", use_tqdm_on_load="no")


def test_startup_report_names_the_forwards_it_ran(caplog, info_level):
    info_level.addHandler(caplog.handler)
    try:
        llm = LLM(str(TINY), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
    finally:
        info_level.removeHandler(caplog.handler)
    line = [r.getMessage() for r in caplog.records if "engine ready in" in r.getMessage()]
    assert line and "no warm-up request runs" in line[0], caplog.text
    assert "none (no cache profiling or graph capture here)" in line[0]  # the CPU runs no forward at start-up
    assert llm.llm_engine.runner.startup_steps == []
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_startup_steps_are_timed_on_cuda():
    llm = LLM(str(TINY), dtype="bfloat16", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.5)
    steps = dict(llm.llm_engine.runner.startup_steps)
    assert any(k.startswith("cache profiling") for k in steps) and all(s > 0 for s in steps.values())
    assert any(k.startswith("first graph warm-up: target") for k in steps)
    llm.shutdown()
