"""Penalties, logit_bias, bad_words, allowed_token_ids and min_tokens (vLLM semantics) against a
plain reference computed from the model's raw logits (float32, CPU; the model alone, one sequence
at a time, through tests/oracle.py's Driver): greedy and seeded,
n > 1, preemption, async scheduling and MTP speculation; requests that use none of them are unchanged."""
from collections import Counter

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.sampling_checks import tokenize_bad_words
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.sampling_params import SamplingParamsError
from sparseserve.sample.logits_processors import banned_bad_words
from sparseserve.sample.sampler import SamplingTensors, sample

from oracle import Driver

TINY = str(CONFIGS_DIR / "tiny")
BASE = dict(device="cpu", dtype="float32", max_model_len=96)
EOS = 1
NEW = 8


def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (6, 19, 33)]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, **BASE)


@pytest.fixture(scope="module")
def oracle(llm):
    """prompt -> a function of the tokens so far giving the raw next-token logits (decoding incrementally)."""
    model = llm.llm_engine.model

    def start(prompt):
        driver = Driver(model, num_slots=1, num_blocks=16)
        state = {"len": 0}

        def next_logits(tokens):
            new = tokens[state["len"]:]
            logits = driver.step([(0, state["len"], new)], want="last")[0][-1]
            state["len"] = len(tokens)
            return logits

        return next_logits

    return start


def reference_process(logits, p: SamplingParams, prompt, output):
    """The fields' definitions, one token at a time."""
    x = logits.clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for word in p.bad_words_token_ids:
        if len(word) == 1 or output[-(len(word) - 1):] == word[:-1]:
            x[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else [EOS]):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


@torch.no_grad()
def reference_generate(oracle, prompt, p: SamplingParams, seed: int | None = None):
    out = []
    next_logits = oracle(prompt)
    for step in range(p.max_tokens):
        logits = next_logits(prompt + out)
        x = reference_process(logits, p, prompt, out)
        if p.temperature == 0:
            token = int(x.argmax())
        else:
            one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
            st = SamplingTensors(one(p.temperature, torch.float32), one(0, torch.int64), one(1.0, torch.float32),
                                 one(0.0, torch.float32), one(seed, torch.int64), one(step, torch.int64),
                                 False, False, False, False)
            token = int(sample(x.unsqueeze(0), st)[0])
        out.append(token)
        if token == EOS and not p.ignore_eos:
            break
    return out


def child_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0xFFFFFFFF


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_1": dict(repetition_penalty=0.6),
    "frequency_presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
    "logit_bias": dict(logit_bias={17: 6.0, 44: 4.5, 300: -100.0}),
    "allowed": dict(allowed_token_ids=[3, 17, 44, 90, 91, 92, 300]),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={17: 3.0}),
}


def test_greedy_fields_equal_the_reference(oracle, llm):
    # Every case in one batch, and the three prompts of each: the engine batches them, the reference does not.
    cases = [(name, p) for name in CASES for p in prompts()]
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **CASES[name]) for name, _ in cases]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in cases], params, use_tqdm=False)
    for (name, prompt), sp, out in zip(cases, params, outs):
        assert out.outputs[0].token_ids == reference_generate(oracle, prompt, sp), name


def test_seeded_n2_fields_equal_the_reference(oracle, llm):
    params = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True,
                            repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={17: 2.0})
    prompt = prompts()[1]
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    for index, completion in enumerate(out.outputs):
        assert completion.token_ids == reference_generate(oracle, prompt, params, child_seed(7, index))


def test_bad_words_single_and_multi_token(oracle, llm):
    tok = llm.get_tokenizer()
    prompt = prompts()[0]
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW,
                                                                         ignore_eos=True), use_tqdm=False)
    plain = plain[0].outputs[0].token_ids
    # A two-token word taken from the plain output: its second token is banned right after its first.
    pair = next(plain[i:i + 2] for i in range(len(plain) - 1)
                if tok.encode(tok.decode(plain[i:i + 2]).lstrip(), add_special_tokens=False) == plain[i:i + 2])
    single = tok.decode([plain[0]]).strip() or tok.decode([plain[1]]).strip()
    for words in ([tok.decode(pair).lstrip()], [single]):
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, bad_words=words)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        banned = tokenize_bad_words(tok, words)
        assert banned
        params.bad_words_token_ids = banned  # for the reference (the engine fills its own copy of the params)
        assert out == reference_generate(oracle, prompt, params)
        for word in banned:
            assert not any(out[i:i + len(word)] == word for i in range(len(out)))
    assert out != plain


def test_banned_bad_words_rule():
    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_bad_words(words, []) == [5]
    assert banned_bad_words(words, [4, 7]) == [5, 8]
    assert banned_bad_words(words, [1, 2]) == [5, 3]
    assert banned_bad_words(words, [2, 1]) == [5]


def test_min_tokens_masks_eos_and_stop_tokens(oracle, llm):
    prompt = prompts()[2]
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    stops = plain[:3]  # the plain run's first tokens become stop tokens: masked below min_tokens
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=stops)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ref = reference_generate(oracle, prompt, params)
    assert not set(out.token_ids[:5]) & set(stops + [EOS])
    # The reference stops at EOS only; the engine also stops at a stop token from min_tokens on.
    cut = next((i + 1 for i, t in enumerate(ref) if i >= 5 and t in stops), len(ref))
    assert out.token_ids == ref[:cut]
    # With a large EOS bias, EOS comes exactly at min_tokens + 1.
    eager = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logit_bias={EOS: 100.0})
    got = llm.generate([{"prompt_token_ids": prompt}], eager, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) == 5 and got.token_ids[-1] == EOS and got.finish_reason == "stop"


def test_requests_without_fields_are_unchanged_beside_ones_with_them(llm):
    ps = [{"prompt_token_ids": p} for p in prompts()]
    plain = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, max_tokens=NEW, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=NEW, ignore_eos=True)]
    alone = llm.generate(ps, plain, use_tqdm=False)
    mixed = llm.generate(ps + ps, plain + [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                                          **CASES["all"])] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:3]]


def test_preemption_and_async_scheduling_keep_the_tokens(llm):
    ps = [{"prompt_token_ids": p} for p in prompts()] * 2
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **CASES["all"]),
              SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.3)] * 3
    roomy = llm.generate(ps, params, use_tqdm=False)
    tight = LLM(TINY, **BASE, num_gpu_blocks_override=6, max_num_batched_tokens=32)
    got = tight.generate(ps, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    # The per-request prompt masks of the repetition penalty are dropped with their requests.
    assert tight.llm_engine.debug_state_counts()["prompt_masks"] == 0
    asyn = LLM(TINY, **BASE, async_scheduling=True).generate(ps, params, use_tqdm=False)
    for a, b, c in zip(roomy, got, asyn):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


@pytest.mark.parametrize("k", [1, 2])
def test_speculation_with_penalties_is_lossless_for_greedy(k, llm):
    ps = [{"prompt_token_ids": p} for p in prompts()]
    greedy = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **CASES[name])
              for name in ("all", "repetition", "allowed")]
    plain = llm.generate(ps, greedy, use_tqdm=False)
    spec = LLM(TINY, **BASE, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = spec.generate(ps, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.llm_engine.spec_metrics.num_draft_tokens > 0
    sampled = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=10, ignore_eos=True,
                             allowed_token_ids=[3, 17, 44, 90], min_tokens=3, presence_penalty=1.0)
    for o in spec.generate(ps, sampled, use_tqdm=False):
        for c in o.outputs:
            assert len(c.token_ids) == 10 and set(c.token_ids) <= {3, 17, 44, 90}


def test_include_stop_str_in_output(llm):
    prompt = {"prompt_token_ids": prompts()[0]}
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[3:5]
    assert stop.strip()
    cut = text.find(stop)
    for include, expected in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.text == expected and out.stop_reason == stop


@pytest.mark.parametrize("kwargs, match", [
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty="x"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(bad_words="word"), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "exactly one"),
])
def test_bad_fields_raise(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_bias_clamp_and_vocabulary_checks(llm):
    assert SamplingParams(logit_bias={"5": 250, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    with pytest.raises(ValueError, match="logit_bias token id 100000"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(allowed_token_ids=[3, 9999]), use_tqdm=False)


def test_batches_without_fields_launch_no_processing(llm, monkeypatch):
    from sparseserve.worker import model_runner

    calls = []
    real = model_runner.process_logits
    monkeypatch.setattr(model_runner, "process_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    ps = [{"prompt_token_ids": p} for p in prompts()]
    llm.generate(ps, SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=1), use_tqdm=False)
    assert not calls
    llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5), use_tqdm=False)
    assert len(calls) == 4
