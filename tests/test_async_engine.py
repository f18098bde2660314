"""AsyncLLMEngine's delivery: one hand-off to the event loop per engine step, and the outputs a slow
reader has not taken merged into one (DELTA joined), with the same tokens and text as offline."""
import asyncio

from sparseserve import LLM, RequestOutputKind, SamplingParams
from sparseserve.engine.async_engine import AsyncLLMEngine, merge_outputs
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.outputs import CompletionOutput, Logprob, RequestOutput

TINY = str(CONFIGS_DIR / "tiny")
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8)
PROMPTS = ["Beautiful is better", "Flat is", "Errors should never", "Now is better than never"]


def _out(completions, finished=False):
    return RequestOutput("r", "p", [1, 2], completions, finished)


def test_merge_outputs_joins_deltas_per_completion():
    lp = lambda t: {t: Logprob(-0.5, 1)}  # noqa: E731
    a = _out([CompletionOutput(0, "ab", [1, 2], -1.0, [lp(1), lp(2)]), CompletionOutput(1, "x", [7], -0.5, [lp(7)])])
    b = _out([CompletionOutput(1, "y", [8], -1.0, [lp(8)])])
    c = _out([CompletionOutput(0, "c", [3], -1.5, [lp(3)], "length")], finished=True)
    m = merge_outputs([a, b, c], RequestOutputKind.DELTA)
    assert m.finished and [x.index for x in m.outputs] == [0, 1]
    first, second = m.outputs
    assert (first.text, first.token_ids, first.finish_reason) == ("abc", [1, 2, 3], "length")
    assert first.cumulative_logprob == -1.5
    assert [list(e) for e in first.logprobs] == [[1], [2], [3]]
    assert (second.text, second.token_ids, second.finish_reason) == ("xy", [7, 8], None)
    assert a.outputs[0].token_ids == [1, 2] and a.outputs[0].text == "ab"  # the inputs are not changed
    assert merge_outputs([a, b], RequestOutputKind.CUMULATIVE) is b
    assert merge_outputs([a], RequestOutputKind.DELTA) is a


def test_slow_readers_get_merged_outputs_and_one_wakeup_per_step():
    llm = LLM(TINY, **ENGINE)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    engine = AsyncLLMEngine(llm.llm_engine)
    steps = []
    engine.step_observers.append(lambda outputs, seconds: steps.append(len(outputs)))
    wakeups = []

    async def read(i, prompt, delay):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        text, ids, chunks = "", [], 0
        async for out in engine.generate(prompt, params, f"r{i}"):
            chunks += 1
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
            await asyncio.sleep(delay)
        return text, ids, chunks

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            wakeups.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(read(i, p, 0.25 if i % 2 else 0.0) for i, p in enumerate(PROMPTS)))

    engine.start()
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (text, ids, chunks), exp, i in zip(results, expected, range(len(PROMPTS))):
        assert text == exp.outputs[0].text and ids == exp.outputs[0].token_ids
        if i % 2:
            assert chunks < len(ids)  # the slow readers got several tokens per output
    # One call_soon_threadsafe per step that had outputs for these streams (not one per request).
    assert 0 < len(wakeups) <= sum(1 for n in steps if n)
    assert sum(steps) > len(wakeups)
    assert llm.llm_engine.all_cache_free() and not llm.llm_engine.groups
