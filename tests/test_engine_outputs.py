"""`LLMEngine.step()` output kinds (CUMULATIVE, DELTA, FINAL_ONLY) and the asynchronous engine front."""
import asyncio

import pytest

from sparseserve import LLM, RequestOutputKind, SamplingParams
from sparseserve.engine.async_engine import AsyncLLMEngine, QueueFullError
from sparseserve.engine.llm_engine import InvalidRequestError
from sparseserve.model.loader import CONFIGS_DIR

TINY = str(CONFIGS_DIR / "tiny")
PROMPTS = ["Beautiful is better", "Flat is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8)


def run_engine(engine, kind, n=1, max_tokens=6, stop=None):
    params = SamplingParams(temperature=0 if n == 1 else 1.0, seed=3, n=n, max_tokens=max_tokens, output_kind=kind,
                            stop=stop)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_output_kinds_agree_with_generate(llm):
    engine = llm.llm_engine
    final = {f"r{i}": o for i, o in enumerate(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6),
                                                           use_tqdm=False))}
    only = run_engine(engine, RequestOutputKind.FINAL_ONLY)
    assert all(len(v) == 1 and v[0].finished for v in only.values())
    cumulative = run_engine(engine, RequestOutputKind.CUMULATIVE)
    delta = run_engine(engine, RequestOutputKind.DELTA)
    for rid, ref in final.items():
        want = ref.outputs[0]
        assert only[rid][0].outputs[0].token_ids == want.token_ids
        outs = cumulative[rid]
        assert len(outs) == 6 and [o.finished for o in outs] == [False] * 5 + [True]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
        assert outs[-1].outputs[0].text == want.text
        assert "".join(o.outputs[0].text for o in delta[rid]) == want.text
        assert sum((o.outputs[0].token_ids for o in delta[rid]), []) == want.token_ids
    assert engine.all_cache_free()


def test_delta_with_n_and_stop_strings(llm):
    engine = llm.llm_engine
    ref = run_engine(engine, RequestOutputKind.FINAL_ONLY, n=2, max_tokens=8)
    delta = run_engine(engine, RequestOutputKind.DELTA, n=2, max_tokens=8)
    for rid, (final,) in ref.items():
        for c in final.outputs:
            parts = [x for o in delta[rid] for x in o.outputs if x.index == c.index]
            assert "".join(x.text for x in parts) == c.text
            assert [x.finish_reason for x in parts][-1] == c.finish_reason
    text = ref["r0"][0].outputs[0].text
    stop = text[2:5]
    cut = run_engine(engine, RequestOutputKind.DELTA, n=2, max_tokens=8, stop=[stop])
    joined = "".join(x.text for o in cut["r0"] for x in o.outputs if x.index == 0)
    assert joined == text[:text.index(stop)]  # text that could start the stop string was held back


def test_async_engine_isolates_errors_aborts_and_bounds_the_queue(llm):
    engine = AsyncLLMEngine(llm.llm_engine, max_waiting_requests=100)
    engine.start()

    async def collect(prompt, params, rid):
        return [o async for o in engine.generate(prompt, params, rid)]

    async def main():
        good = asyncio.create_task(collect(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                                      output_kind=RequestOutputKind.DELTA), "a"))
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            await collect({"prompt_token_ids": [10**6]}, SamplingParams(), "bad")
        stream = engine.generate(PROMPTS[1], SamplingParams(max_tokens=80, ignore_eos=True,
                                                            output_kind=RequestOutputKind.DELTA), "cut")
        await stream.__anext__()
        await stream.aclose()  # a client that goes away
        outs = await good
        engine.max_waiting_requests = 0
        with pytest.raises(QueueFullError):
            await collect(PROMPTS[0], SamplingParams(max_tokens=2), "full")
        engine.max_waiting_requests = 100
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 5
        for _ in range(200):
            if llm.llm_engine.all_cache_free():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert llm.llm_engine.all_cache_free() and not llm.llm_engine.groups
    finally:
        engine.shutdown()
    assert not engine.is_running
