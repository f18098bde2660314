"""Bad input never takes the engine down (DESIGN.md invariant 6): typed errors at the boundary,
a failing request isolated from the others, nothing leaked (see tests/bad_inputs.py)."""
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.entrypoints.cli import main
from sparseserve.worker import model_runner

sys.path.insert(0, str(Path(__file__).parent))
from bad_inputs import CASES, ENGINE_KW, TINY, leaks, run_all  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's steps are far faster on one thread than on cores shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(one_thread):
    return LLM(str(TINY), **ENGINE_KW)


def prompt(n, start=5):
    return {"prompt_token_ids": [(start + 7 * i) % 500 + 2 for i in range(n)]}


def finish_all(engine, limit=500):
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            outs[o.request_id] = o
    raise AssertionError("requests did not finish")


def test_every_bad_input_is_refused_and_the_engine_is_unharmed(llm, tmp_path):
    assert len(CASES) >= 60
    logging.getLogger("sparseserve").setLevel(logging.ERROR)
    try:
        assert run_all(llm, tmp_path) == []
    finally:
        logging.getLogger("sparseserve").setLevel(logging.INFO)


def _poison_logprobs(monkeypatch, poison=7):
    """The sampler fails whenever a step holds the rows of a request asking for `poison` logprobs."""
    real = model_runner.token_logprobs

    def failing(logits, tokens, num_top):
        if num_top == poison:
            raise RuntimeError("selected index k out of range (injected)")
        return real(logits, tokens, num_top)

    monkeypatch.setattr(model_runner, "token_logprobs", failing)


@pytest.mark.parametrize("extra", [{}, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
                                   {"async_scheduling": True}])
def test_a_request_that_cannot_be_computed_never_stops_the_others(monkeypatch, extra):
    llm = LLM(str(TINY), **{**ENGINE_KW, **extra})
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    expected = {f"g{i}": o.outputs[0].token_ids
                for i, o in enumerate(llm.generate([prompt(9, 1), prompt(17, 2), prompt(5, 3)], good, use_tqdm=False))}
    expected["s"] = llm.generate(prompt(11, 4), sampled, use_tqdm=False)[0].outputs[0].token_ids
    _poison_logprobs(monkeypatch)
    engine.add_request("g0", prompt(9, 1), good)
    engine.add_request("bad", prompt(13, 6), SamplingParams(temperature=0, max_tokens=5, logprobs=7))
    engine.add_request("g1", prompt(17, 2), good)
    engine.add_request("s", prompt(11, 4), sampled)
    engine.add_request("g2", prompt(5, 3), good)
    outs = finish_all(engine)
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "selected index k out of range" in outs["bad"].outputs[0].stop_reason
    for rid, tokens in expected.items():
        assert outs[rid].outputs[0].token_ids == tokens and outs[rid].outputs[0].finish_reason == "length"
    assert leaks(llm) == {}


def test_an_engine_fault_is_raised_not_hidden(llm, monkeypatch):
    engine = llm.llm_engine

    def broken(*args, **kwargs):
        raise RuntimeError("engine fault (injected)")

    engine.add_request("a", prompt(8), SamplingParams(max_tokens=3))
    engine.add_request("b", prompt(9), SamplingParams(max_tokens=3))
    monkeypatch.setattr(engine.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="engine fault"):
        engine.step()
    monkeypatch.undo()
    # The failed step was rolled back: the requests finish normally once the fault is gone.
    outs = finish_all(engine)
    assert {o.outputs[0].finish_reason for o in outs.values()} <= {"length", "stop"}
    assert leaks(llm) == {}


@pytest.mark.parametrize("spec_k", [0, 1, 2])
def test_randomized_aborts_preemption_and_speculation_leak_nothing(spec_k, monkeypatch):
    extra = {"speculative_config": {"method": "mtp", "num_speculative_tokens": spec_k}} if spec_k else {}
    llm = LLM(str(TINY), **{**ENGINE_KW, "num_gpu_blocks_override": 8, "max_num_batched_tokens": 48, **extra})
    engine = llm.llm_engine
    _poison_logprobs(monkeypatch)
    rng = random.Random(spec_k)
    live, next_id = set(), 0
    for step in range(60):
        if rng.random() < 0.5 and len(live) < 10:
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99),
                                    max_tokens=rng.randrange(1, 12), ignore_eos=True, n=rng.choice([1, 1, 2]),
                                    logprobs=rng.choice([None, None, 2, 7]))
            engine.add_request(str(next_id), prompt(rng.randrange(3, 40), next_id), params)
            live.add(str(next_id))
            next_id += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if not out.finished:
                continue  # a running request's progress (step() reports every request that advanced)
            live.discard(out.request_id)
            reasons = {c.finish_reason for c in out.outputs}
            assert reasons <= {"length", "error"}
    finish_all(engine)
    assert engine.scheduler.num_preemptions > 0
    assert leaks(llm) == {}


def test_aborting_a_sampled_speculative_request_frees_its_draft_probs():
    llm = LLM(str(TINY), **{**ENGINE_KW, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    engine = llm.llm_engine
    engine.add_request("x", prompt(10), SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.runner.draft_probs  # a sampled request keeps its drafts' distribution
    engine.abort_request("x")
    assert leaks(llm) == {}


def test_start_up_report_and_kv_report_agree(llm, caplog):
    engine = llm.llm_engine
    expected = engine.kv_plan.report(engine.max_model_len, engine.cache_bytes)
    assert engine.kv_report() == expected
    blocks = engine.cache_config.num_gpu_blocks
    slots_bytes = engine.config.max_num_seqs * engine.kv_plan.bytes_per_slot + engine.kv_plan.fixed_bytes
    assert engine.cache_bytes == slots_bytes + blocks * engine.kv_plan.bytes_per_block


@pytest.mark.parametrize("argv, code, text", [
    (["generate", "--n", "2"], 2, "unrecognized arguments: --n"),
    (["generate", "--num-gpu", "2"], 2, "unrecognized arguments: --num-gpu"),
    (["kv-plan", "--max-model-len", "0"], 2, "--max-model-len"),
    (["kv-plan", "--max-model-len", "-5"], 2, "--max-model-len"),
    (["kv-plan", "--max-model-len", "96", "--block-size", "0"], 2, "--block-size"),
    (["--version"], 0, "sparseserve 0."),
])
def test_cli_usage_errors(argv, code, text, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == code
    captured = capsys.readouterr()
    assert text in captured.err + captured.out


@pytest.mark.parametrize("flags, field", [
    (["--max-model-len", "0"], "max_model_len"),
    (["--max-model-len", "100000"], "max_position_embeddings"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--kv-cache-memory-bytes", "1000"], "kv_cache_memory_bytes"),
    (["--temperature", "nan"], "temperature"),
    (["--hf-overrides", '{"index_topk": 0}'], "index_topk"),
])
def test_cli_errors_are_one_line(flags, field, capsys):
    rc = main(["generate", "--model", str(TINY), "--device", "cpu", "--max-tokens", "2", *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and field in lines[0] and "Traceback" not in err


def test_cli_kv_plan_names_the_default_model(capsys):
    assert main(["kv-plan", "--max-model-len", "4096"]) == 0
    assert capsys.readouterr().out.startswith("model: demo ")


def test_a_request_whose_bookkeeping_fails_is_finished_alone(llm, monkeypatch):
    """A host-side failure (detokenisation, stop checks) of one request: it alone finishes with an error."""
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([prompt(7, 1), prompt(9, 2)], good, use_tqdm=False)]
    real = engine._append_token

    def append(req, sampled):
        if req.request_id.startswith("bad") and len(req.output_token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, sampled)

    monkeypatch.setattr(engine, "_append_token", append)
    engine.add_request("g0", prompt(7, 1), good)
    engine.add_request("bad", prompt(8, 3), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))
    engine.add_request("g1", prompt(9, 2), good)
    outs = finish_all(engine)
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error", "error"]
    assert [outs["g0"].outputs[0].token_ids, outs["g1"].outputs[0].token_ids] == expected
    assert leaks(llm) == {}
