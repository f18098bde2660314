"""`LLM.shutdown()`, the context manager and `del`: the engine's model and state are freed, so a second
engine starts in the same process; a closed engine refuses work with `EngineClosedError`."""
import gc
import weakref

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.errors import EngineClosedError
from sparseserve.model.loader import CONFIGS_DIR

TINY = str(CONFIGS_DIR / "tiny")
KW = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
PROMPT = {"prompt_token_ids": [5, 9, 13, 17]}
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def _refs(llm: LLM) -> list[weakref.ref]:
    engine = llm.llm_engine
    return [weakref.ref(engine.model), weakref.ref(engine.runner), weakref.ref(engine.runner.state)]


def test_shutdown_frees_the_model_and_a_second_engine_starts():
    gc.disable()  # only the shutdown's own collection may free the cycles
    try:
        llm = LLM(TINY, **KW)
        first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        refs = _refs(llm)
        llm.shutdown()
        assert [r() for r in refs] == [None, None, None]
        llm.shutdown()  # a second call does nothing
    finally:
        gc.enable()
    with pytest.raises(EngineClosedError, match="shut down"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    with pytest.raises(EngineClosedError):
        llm.llm_engine.add_request("x", PROMPT, GREEDY)
    with pytest.raises(EngineClosedError):
        llm.llm_engine.step()
    assert not llm.llm_engine.has_unfinished_requests()
    again = LLM(TINY, **KW)
    assert again.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    again.shutdown()


def test_context_manager_and_del_free_the_engine():
    with LLM(TINY, **KW) as llm:
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].finished
        refs = _refs(llm)
    assert llm.llm_engine.closed and [r() for r in refs] == [None, None, None]
    gc.disable()  # `del` alone frees the engine: its finalizer drops the model and collects the cycles
    try:
        llm = LLM(TINY, **KW)
        refs = _refs(llm)
        del llm
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
    llm = LLM(TINY, **KW)
    engine = llm.llm_engine  # the engine outlives its LLM while someone holds it (as the server does)
    del llm
    assert not engine.closed
    engine.add_request("kept", PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()


def test_async_engine_releases_the_engine_when_asked():
    llm = LLM(TINY, **KW)
    engine = AsyncLLMEngine(llm.llm_engine)
    engine.start()
    engine.shutdown()
    assert not llm.llm_engine.closed  # by default the wrapped engine stays usable
    engine.shutdown(release_engine=True)
    assert llm.llm_engine.closed and llm.llm_engine.model is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shutdown_returns_cuda_memory():
    kwargs = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.5)

    def cycle() -> tuple[int, int]:
        llm = LLM(TINY, **kwargs)
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].finished
        held = torch.cuda.memory_allocated()
        llm.shutdown()
        torch.cuda.synchronize()
        return held, torch.cuda.memory_allocated()

    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    held, after = cycle()
    assert held - start > 1024**3  # the KV cache takes half the GPU
    held_again, after_again = cycle()  # the second start finds the memory the first one held
    assert held_again - start > 1024**3
    # What may stay is per process (cuBLAS workspaces per stream), never the model, the cache or the graphs.
    assert after - start < 256 * 1024**2 and after_again - start < 256 * 1024**2
