"""API behaviour: validation, stops, sampling options, KV report, cache hygiene."""
import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.config import ModelConfig
from sparseserve.engine.kv_cache import RequestTooLargeError, plan_kv
from sparseserve.config import EngineConfig
from sparseserve.engine.llm_engine import InvalidRequestError
from sparseserve.model.loader import CONFIGS_DIR, load_hf_config, resolve_model_dir
from sparseserve.sampling_params import SamplingParamsError

TINY = str(CONFIGS_DIR / "tiny")


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8)


def ids(n, start=5):
    return {"prompt_token_ids": [(start + 7 * i) % 500 + 2 for i in range(n)]}


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n must"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("keep-1", ids(12), good)
    engine.add_request("keep-2", ids(30), good)
    engine.step()  # both are mid-flight when the bad requests arrive
    bad_cases = [
        ({"prompt_token_ids": []}, InvalidRequestError, "empty"),
        ({"prompt_token_ids": [3, 512]}, InvalidRequestError, "vocabulary"),
        ({"prompt_token_ids": [-1]}, InvalidRequestError, "vocabulary"),
        (ids(96), RequestTooLargeError, "max_model_len"),
        (12345, InvalidRequestError, "prompt must be"),
    ]
    for i, (prompt, exc, match) in enumerate(bad_cases):
        with pytest.raises(exc, match=match):
            engine.add_request(f"bad-{i}", prompt, good)
        with pytest.raises(exc, match=match):
            llm.generate([ids(5), prompt], good, use_tqdm=False)  # nothing of this call is queued
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert set(finished) == {"keep-1", "keep-2"}
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())
    assert engine.all_cache_free()
    assert len(llm.generate([ids(8)], good, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_request_that_can_never_fit_the_cache_is_rejected():
    small = LLM(TINY, device="cpu", dtype="float32", max_model_len=96, num_gpu_blocks_override=2)
    with pytest.raises(RequestTooLargeError, match="cache blocks"):
        small.generate([ids(40)], SamplingParams(max_tokens=20), use_tqdm=False)


def test_prompt_formats_and_per_prompt_params(llm):
    tok = llm.get_tokenizer()
    text = "Beautiful is better than"
    outs = llm.generate([text, {"prompt_token_ids": tok.encode(text)}],
                        [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=3)],
                        use_tqdm=False)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == tok.encode(text)
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    single = llm.generate(text, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate([text, text], [SamplingParams()], use_tqdm=False)


def greedy_tokens(llm, prompt, n=12):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_stop_token_ids_min_tokens_and_eos(llm):
    base = greedy_tokens(llm, ids(10))
    target = base[4]
    first = base.index(target)
    out = llm.generate([ids(10)], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens as vLLM defines it: stop tokens are masked (never sampled) until 7 outputs exist.
    out = llm.generate([ids(10)], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target],
                                                 min_tokens=7), use_tqdm=False)[0].outputs[0]
    assert target not in out.token_ids[:7] and out.token_ids[:4] == base[:4] and len(out.token_ids) >= 7
    assert (out.finish_reason, out.token_ids[-1]) == ("stop", target) or len(out.token_ids) == 12
    # eos: the model's eos id (1) is treated as a stop unless ignore_eos.
    engine = llm.llm_engine
    engine.eos_token_id = target
    try:
        out = llm.generate([ids(10)], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
        out = llm.generate([ids(10)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base
    finally:
        engine.eos_token_id = 1


def test_stop_strings_are_excluded_from_text(llm):
    full = llm.generate(["Flat is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert len(stop) == 3
    out = llm.generate(["Flat is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]


def test_max_model_len_finishes_with_length(llm):
    out = llm.generate([ids(90)], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=123, max_tokens=10,
                            ignore_eos=True)
    alone = llm.generate([ids(15)], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([ids(30, 3), ids(15), ids(7, 9)], params, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched
    other = llm.generate([ids(15)], SamplingParams(temperature=1.0, seed=124, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_n_completions_and_prompt_logprobs(llm):
    out = llm.generate([ids(20)], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                                                 prompt_logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 20
    prompt = out.prompt_token_ids
    assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, 20))
    assert llm.llm_engine.all_cache_free()


def test_unsupported_options_are_loud():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads"):
        LLM(TINY, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(TINY, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config must be"):
        LLM(TINY, device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 1})
    with pytest.raises(TypeError, match="unsupported arguments: bogus"):
        LLM(TINY, bogus=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(TINY, block_size=24)


def test_llm_keywords_are_engine_config_fields():
    """LLM(model, **kwargs) is EngineConfig(model=model, **kwargs); unknown keywords name the valid ones."""
    with pytest.raises(TypeError, match=r"unsupported arguments: bogus, nope; the supported ones are model and .*side_stream"):
        LLM(TINY, bogus=1, nope=2)
    with pytest.raises(ValueError, match="side_stream must be one of"):
        LLM(TINY, device="cpu", side_stream="sometimes")
    llm = LLM(TINY, device="cpu", dtype="float32", max_model_len=64, side_stream="always", seed=3)
    assert llm.engine_config == EngineConfig(model=TINY, device="cpu", dtype="float32", max_model_len=64,
                                             side_stream="always", seed=3)
    runner = llm.llm_engine.runner
    assert runner.model.side_streams.mode == "always" and runner.speculator is None


def test_cache_config_and_kv_report(llm):
    cc = llm.llm_engine.cache_config
    assert cc.block_size == 16 and cc.num_gpu_blocks > 0 and cc.num_cpu_blocks == 0
    assert set(cc.bytes_per_block_by_kind) == {"csa", "hca"}
    assert "max concurrency" in llm.llm_engine.kv_report()


@pytest.mark.parametrize("preset, per_token, gib", [("deepseek-v4-flash", 6880, 6.72), ("deepseek-v4-pro", 9848, 9.62)])
def test_published_configs_compressed_bytes(preset, per_token, gib):
    model_dir, overrides = resolve_model_dir(preset)
    plan = plan_kv(ModelConfig(load_hf_config(model_dir, overrides)), 2, 128, 8192)
    assert plan.bytes_per_token == per_token
    assert round(plan.bytes_per_token * 1048576 / 1024**3, 2) == gib
    assert plan.dense_mla_bytes_per_token > 8 * per_token
    assert f"{per_token:,} B/token" in plan.report(1048576, 80 * 1024**3)



def test_preemption_keeps_prompt_logprobs_and_parallel_samples_whole():
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    prompts_ = [ids(31, 1), ids(30, 2), ids(29, 3)]  # 2 blocks each, a third once they grow
    roomy = LLM(TINY, device="cpu", dtype="float32", max_model_len=96).generate(prompts_, params, use_tqdm=False)
    tight = LLM(TINY, device="cpu", dtype="float32", max_model_len=96, num_gpu_blocks_override=6,
                max_num_batched_tokens=32)
    outs = tight.generate(prompts_, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert all(abs(a.prompt_logprobs[i][t].logprob - b.prompt_logprobs[i][t].logprob) < 1e-4
                   for i, t in enumerate(b.prompt_token_ids) if i > 0)
    assert tight.llm_engine.all_cache_free()


def test_abort_frees_everything_and_others_continue(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("stay", ids(20), params)
    engine.add_request("go", ids(25), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    engine.step()
    engine.abort_request("go")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]  # step() also returns running requests' outputs
    assert [o.request_id for o in done] == ["stay"] and len(done[0].outputs[0].token_ids) == 6
    assert engine.all_cache_free()
