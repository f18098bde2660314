"""Async scheduling (step n + 1 launched before step n is read back) changes when the host learns
each token, never which tokens, logprobs, texts or finish reasons a request gets."""
import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR

TINY = str(CONFIGS_DIR / "tiny")
BASE = dict(device="cpu", dtype="float32", max_model_len=96)


def ids(n, start=5):
    return {"prompt_token_ids": [(start + 7 * i) % 500 + 2 for i in range(n)]}


def summary(outputs):
    """Everything a caller sees, logprobs included (exactly: same kernels, same batches)."""
    result = []
    for out in outputs:
        prompt_lp = [None if e is None else sorted((t, lp.logprob, lp.rank) for t, lp in e.items())
                     for e in (out.prompt_logprobs or [])]
        completions = []
        for c in out.outputs:
            lps = [sorted((t, lp.logprob, lp.rank) for t, lp in e.items()) for e in (c.logprobs or [])]
            completions.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
        result.append((out.request_id, completions, prompt_lp))
    return result


def assert_same(a, b):
    """Tokens, texts and finish reasons exactly; logprobs to 1e-4 (a finished request frees its seat
    one step later under async scheduling, so batches, and fp32 rounding, can differ)."""
    def split(summ):
        exact = [(rid, [c[:4] for c in comps]) for rid, comps, _ in summ]
        floats = [(rid, [c[4] for c in comps], plp) for rid, comps, plp in summ]
        return exact, floats

    (exact_a, floats_a), (exact_b, floats_b) = split(a), split(b)
    assert exact_a == exact_b

    def close(x, y):
        if isinstance(x, float):
            return abs(x - y) < 1e-4
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
        return x == y

    assert close(floats_a, floats_b)


def both(prompts, params, **engine):
    runs = {}
    for mode in (False, True):
        llm = LLM(TINY, **BASE, async_scheduling=mode, **engine)
        assert llm.llm_engine.async_scheduling is mode
        runs[mode] = (summary(llm.generate(prompts, params, use_tqdm=False)), llm.llm_engine)
        assert llm.llm_engine.all_cache_free()
    return runs


PROMPTS = [ids(n, s) for s, n in enumerate((3, 40, 17, 64, 1, 29, 50, 8))]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 9, 12, 1, 5, 3, 7)],
    SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=3,
                   prompt_logprobs=2),
    SamplingParams(n=2, temperature=1.0, seed=4, top_k=20, max_tokens=6, ignore_eos=True),
], ids=["greedy", "ragged-max-tokens", "seeded-logprobs", "n2"])
def test_async_equals_sync_with_chunked_prefill(params):
    runs = both(PROMPTS, params, max_num_batched_tokens=48, max_num_seqs=6)
    assert_same(runs[True][0], runs[False][0])


def test_async_equals_sync_under_preemption():
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    prompts = [ids(31, 1), ids(30, 2), ids(29, 3)]
    runs = both(prompts, params, num_gpu_blocks_override=6, max_num_batched_tokens=32)
    assert runs[True][1].scheduler.num_preemptions > 0
    assert_same(runs[True][0], runs[False][0])


def test_async_stops_equal_sync():
    """Stops the host discovers only after the next step was launched (stop tokens, strings, eos)."""
    probe = LLM(TINY, **BASE, async_scheduling=False)
    base = probe.generate([ids(10)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    text = probe.generate(["Flat is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    prompts = [ids(10), "Flat is", ids(10), ids(12, 3)]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base.token_ids[4]]),
              SamplingParams(temperature=0, max_tokens=16, stop=text[5:8]),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base.token_ids[4]], min_tokens=7),
              SamplingParams(temperature=0, max_tokens=20)]
    runs = both(prompts, params)
    assert_same(runs[True][0], runs[False][0])
    assert [c[2] for _, comps, _ in runs[True][0] for c in comps][:2] == ["stop", "stop"]


def test_async_abort_in_flight_and_max_model_len():
    llm = LLM(TINY, **BASE, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("stay", ids(20), params)
    engine.add_request("go", ids(25), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    assert engine.step() == []  # launched, not yet read back
    engine.step()
    engine.abort_request("go")  # its next step is in flight
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]  # step() also returns running requests' outputs
    assert [o.request_id for o in done] == ["stay"] and len(done[0].outputs[0].token_ids) == 6
    assert engine.all_cache_free()
    sync = LLM(TINY, **BASE, async_scheduling=False)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a = llm.generate([ids(90)], long, use_tqdm=False)[0].outputs[0]
    b = sync.generate([ids(90)], long, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
    assert len(a.token_ids) == 96 - 90


def test_a_bad_async_scheduling_value_is_refused():
    with pytest.raises(ValueError, match="async_scheduling must be"):
        LLM(TINY, **BASE, async_scheduling="yes")


def test_logits_rows_per_chunk():
    from sparseserve.model.batch import SequenceChunk
    from sparseserve.worker.model_runner import logits_rows

    chunk = lambda want: SequenceChunk(slot=0, start_pos=0, token_ids=[1, 2, 3], block_ids=[], want_logits=want)  # noqa: E731
    assert [logits_rows(chunk(w)) for w in ("all", "last", "none")] == [3, 1, 0]
