"""Structured outputs (xgrammar) on the demo model: 200 random requests (120 without MTP, 80 with
MTP k=1; half greedy, half sampled) against a set of JSON schemas all parse and validate; greedy
MTP equals plain decoding under a grammar; regex, choice and
grammar constraints hold; bad constraints are rejected with the field named."""
import json
import random

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from sparseserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from sparseserve.structured_output.bitmask import unpack_bitmask  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["ok", "tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}, "kind": {"enum": ["cat", "dog", "bird"]}}, "required": ["point", "kind"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "done": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["id", "done", "note"]},
]
WORDS = ["The import statement", "def main():", "A list of", "Return the", "In this case", "class Foo:", "x = "]
MAX_TOKENS = 48


def requests(seed: int, num: int):
    rng = random.Random(seed)
    prompts, params, schemas = [], [], []
    for i in range(num):
        schema = rng.choice(SCHEMAS)
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        if i % 2:
            sp = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=i,
                                max_tokens=MAX_TOKENS, structured_outputs=so)
        else:
            sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)
        prompts.append(rng.choice(WORDS) + " " * rng.randint(0, 2))
        params.append(sp)
        schemas.append(schema)
    return prompts, params, schemas


def check_all(outputs, schemas):
    for out, schema in zip(outputs, schemas):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, schema)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def spec_demo():
    return LLM(device="cpu", max_model_len=256, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_json_schemas_validate_greedy_and_sampled(demo):
    prompts, params, schemas = requests(0, 120)
    check_all(demo.generate(prompts, params, use_tqdm=False), schemas)


def test_json_schemas_validate_with_mtp(demo, spec_demo):
    prompts, params, schemas = requests(1, 80)
    outs = spec_demo.generate(prompts, params, use_tqdm=False)
    check_all(outs, schemas)
    assert spec_demo.llm_engine.spec_metrics.num_accepted_tokens > 0
    # Greedy speculation stays lossless under a grammar: the greedy half equals plain decoding.
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    plain = demo.generate([prompts[i] for i in greedy], [params[i] for i in greedy], use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in greedy] == [o.outputs[0].token_ids for o in plain]


def test_regex_choice_grammar_and_json_object(demo):
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5} [0-9]{2}"),
         lambda t: __import__("re").fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9] ("+" [0-9])? ")"'),
         lambda t: __import__("re").fullmatch(r"\([0-9](\+[0-9])?\)", t)),
    ]
    for so, ok in cases:
        for sp in (SamplingParams(temperature=0, max_tokens=24, structured_outputs=so),
                   SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=24, structured_outputs=so)):
            for out in demo.generate(WORDS[:3], sp, use_tqdm=False):
                for c in out.outputs:
                    assert ok(c.text), (so, c.text)
    sp = SamplingParams(temperature=0, max_tokens=64,
                        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    out = demo.generate(["{"], sp, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{")


def test_bad_constraints_are_rejected_and_the_engine_goes_on(demo):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        demo.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        demo.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")),
                      use_tqdm=False)
    assert demo.generate(["x"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_bitmask_unpacking():
    import torch

    mask = torch.tensor([[0b1011, -1], [0, -(1 << 31)]], dtype=torch.int32)  # -(1 << 31): only bit 31
    allowed = unpack_bitmask(mask, 40)
    assert allowed[0, :4].tolist() == [True, True, False, True] and allowed[0, 32:].all()
    assert not allowed[0, 4:32].any() and not allowed[1].any()
    assert unpack_bitmask(mask, 64)[1].nonzero().flatten().tolist() == [63]


def test_missing_xgrammar_gives_a_clear_error(monkeypatch):
    import builtins

    from sparseserve.structured_output import grammar

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("no xgrammar")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(grammar.StructuredOutputsUnavailable, match="pip install xgrammar"):
        grammar.GrammarCompilerCache(object(), 16)


def test_async_scheduling_gives_the_same_tokens_with_a_grammar_beside_other_fields():
    so = StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, bad_words=["the list"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, min_tokens=5)]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(device="cpu", max_model_len=128, async_scheduling=async_scheduling)
        runner, deferred = llm.llm_engine.runner, []
        launch = runner.launch

        def spy(sched, defer_sampling=False):
            deferred.append(defer_sampling)
            return launch(sched, defer_sampling)

        runner.launch = spy
        outs = llm.generate(WORDS[:3], params, use_tqdm=False)
        # Async steps keep overlapping: the forward is launched before the previous step is read back.
        assert any(deferred) == async_scheduling
        jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS[0])
        assert llm.llm_engine._num_host_state == 0 and llm.llm_engine.all_cache_free()
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
