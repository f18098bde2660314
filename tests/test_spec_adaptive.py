"""Adaptive speculation (spec_decode/adaptive.py): the policy's choice on synthetic step-cost
tables, its acceptance estimate, and losslessness when the number of drafts changes from step to
step (greedy tokens equal plain decoding's, sync and async, under preemption, with the tiny
model's dummy MTP layer and the demo checkpoint's trained one; rejection sampling keeps the
target distribution when requests verify different numbers of drafts)."""
import itertools
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.errors import ConfigError
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.spec_decode.adaptive import AdaptivePolicy, StepCosts, expected_tokens, model_costs
from sparseserve.spec_decode.metrics import SpecDecodeMetrics
from sparseserve.spec_decode.rejection_sampler import verify

TINY = str(CONFIGS_DIR / "tiny")
BASE = dict(device="cpu", dtype="float32", max_model_len=160)
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def table(costs: dict[int, list[float]]) -> StepCosts:
    """{bucket: [cost of d = 0, 1, ...]} -> StepCosts."""
    return StepCosts(sorted(costs), {(b, d): c for b, row in costs.items() for d, c in enumerate(row)}, "test")


def policy(costs: StepCosts, k: int = 3, **kw) -> AdaptivePolicy:
    return AdaptivePolicy(k, costs, SpecDecodeMetrics(), **kw)


def test_expected_tokens_is_the_iid_geometric_sum():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.8, 0) == pytest.approx(1.0)
    assert expected_tokens(0.7, 3) == pytest.approx(1 + 0.7 + 0.49 + 0.343)


def test_policy_choice_on_synthetic_cost_tables():
    # Weight-bound small batches (verify almost free), compute-bound large ones (cost grows with tokens).
    costs = table({1: [1.0, 1.05, 1.1, 1.15], 8: [1.0, 1.1, 1.2, 1.3], 64: [1.0, 1.9, 2.8, 3.7]})
    p = policy(costs)
    assert p.best(1, 0.9) == 3 and p.best(8, 0.9) == 3  # cheap and accepted: every draft
    assert p.best(1, 0.02) == 0 and p.best(8, 0.05) == 0  # rarely accepted: plain steps
    assert p.best(64, 0.9) == 0  # verify costs more than the accepted drafts give back
    assert p.best(200, 0.7) == 0 and p.best(200, 0.99) == 3  # past the largest bucket: its costs
    middle = table({1: [1.0, 1.1, 1.6, 2.3]})  # a second and third draft are dear
    assert policy(middle).best(1, 0.8) == 1
    assert policy(middle).best(1, 0.8) == max(range(4), key=lambda d: expected_tokens(0.8, d) / middle.cost(1, d))
    # A d whose graph is missing at a bucket (no entry) is never chosen there.
    holes = StepCosts([1], {(1, 0): 1.0, (1, 1): 1.05}, "test")
    assert policy(holes).best(1, 0.99) == 1
    # The margin: a gain below it keeps plain steps.
    close = table({1: [1.0, 1.0 * expected_tokens(0.5, 1) / 1.01]})
    assert policy(close, k=1, margin=0.02).best(1, 0.5) == 0
    assert policy(close, k=1, margin=0.0).best(1, 0.5) == 1


def test_model_costs_shape():
    costs = model_costs([1, 8, 64, 256], 3, num_layers=43)
    p = policy(costs)
    assert p.best(1, 0.8) == 3  # weight-bound: verifying is almost free
    assert p.best(256, 0.8) == 0  # compute-bound: a verify step costs its tokens
    assert costs.source == "model"


def test_acceptance_estimate_follows_iid_drafts_whatever_d():
    rng = random.Random(0)
    metrics = SpecDecodeMetrics()
    p = AdaptivePolicy(3, table({1: [1.0, 1.0, 1.0, 1.0]}), metrics, horizon=1e9)
    assert p.acceptance == pytest.approx(0.6)  # the prior
    for _ in range(4000):
        d = rng.randint(1, 3)
        accepted = next((j for j in range(d) if rng.random() >= 0.7), d)
        metrics.record(d, accepted)
    assert abs(p.acceptance - 0.7) < 0.02
    # accepted / drafted would be biased low under prefix acceptance; the estimate is not.
    assert metrics.acceptance_rate < 0.65


def test_acceptance_estimate_forgets_and_probes_after_plain_steps():
    metrics = SpecDecodeMetrics()
    costs = table({1: [1.0, 1.05, 1.1, 1.15]})
    p = AdaptivePolicy(3, costs, metrics, horizon=50.0, probe_interval=5)
    for _ in range(100):
        metrics.record(3, 3)
    assert p.choose(1) == 3
    for _ in range(400):  # the drafter stops being right: the old counts are forgotten
        metrics.record(3, 0)
    choices = [p.choose(1) for _ in range(14)]
    assert choices[:4] == [0] * 4
    assert choices[4:6] == [1, 1]  # the probe: propose one draft, verify it
    assert choices[6:10] == [0] * 4 and choices[10:12] == [1, 1]
    p.reset()  # the prior again, the counts so far ignored
    assert p.acceptance == pytest.approx(0.6) and p.choose(1) == 3


def test_adaptive_option_is_validated():
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": "yes"}
    with pytest.raises(ConfigError, match="adaptive"):
        LLM(TINY, **BASE, speculative_config=spec)


@pytest.fixture(scope="module")
def reference():
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (4, 31, 66, 12, 19)]
    llm = LLM(TINY, **BASE)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def cycling(limits):
    """A draft limit that changes every step (0 included), in place of the policy's choice."""
    it = itertools.cycle(limits)
    return lambda batch: next(it)


@pytest.mark.parametrize("async_scheduling, extra", [
    (False, {}),
    (True, {}),
    (False, {"num_gpu_blocks_override": 8, "max_num_seqs": 3}),  # preemption
    (True, {"num_gpu_blocks_override": 8, "max_num_seqs": 3}),
])
def test_greedy_with_varying_drafts_equals_plain(async_scheduling, extra, reference):
    prompts, expected = reference
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}
    llm = LLM(TINY, **BASE, speculative_config=spec, async_scheduling=async_scheduling, **extra)
    engine = llm.llm_engine
    assert isinstance(engine.spec_policy, AdaptivePolicy) and engine.spec_policy.costs.source == "model"
    assert engine.runner.query_lens == [1, 2, 3, 4]
    verified = []
    original = engine.runner.launch

    def spy(sched, *args, **kw):
        verified.append({c.num_draft for c in sched.chunks})
        return original(sched, *args, **kw)

    engine.runner.launch = spy
    engine.scheduler.draft_limit = cycling([3, 0, 1, 2, 0, 0, 2])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    seen = set().union(*verified)
    assert {1, 2} <= seen  # steps verified different numbers of drafts
    assert engine.all_cache_free() and not engine.runner.draft_probs
    if extra:
        assert engine.scheduler.num_preemptions > 0


def test_the_policy_drives_the_engine_losslessly(reference):
    prompts, expected = reference
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": True}
    llm = LLM(TINY, **BASE, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.spec_metrics.num_verify_steps > 0  # the prior speculates until measured
    off = LLM(TINY, **BASE, speculative_config={**spec, "adaptive": False})
    assert off.llm_engine.spec_policy is None and off.llm_engine.runner.query_lens == [1, 3]
    default = LLM(TINY, **BASE, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert default.llm_engine.spec_policy is None  # the default: on where step costs are measured (CUDA graphs)


def test_sampled_with_varying_drafts_is_seeded():
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (5, 17, 9)]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}
    runs = []
    for _ in range(2):
        llm = LLM(TINY, **BASE, speculative_config=spec)
        llm.llm_engine.scheduler.draft_limit = cycling([2, 0, 3, 1])
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.llm_engine.all_cache_free() and not llm.llm_engine.runner.draft_probs
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_greedy_with_varying_drafts_on_the_demo_model(monkeypatch):
    """The demo checkpoint's trained MTP layer: drafts are accepted in part, so varying d covers
    accepted and rejected drafts in the fused and general paths. A plain step's drafter catch-up
    queued at launch (from the device tokens) gives the general path's drafts: the same acceptance."""
    from sparseserve.spec_decode.spec_step import CAUGHT_UP, MTPSpeculator

    texts = ["The return statement", "A class definition", "Exceptions are"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=256)
    plain = [o.outputs[0].token_ids for o in LLM("demo", **base).generate(texts, params, use_tqdm=False)]
    original = MTPSpeculator.launch_catch_up
    results = []
    for at_launch in (True, False):
        caught_up = []

        def launch_catch_up(self, runner, step):
            took = original(self, runner, step) if at_launch else None
            caught_up.append(took is CAUGHT_UP)
            return took

        monkeypatch.setattr(MTPSpeculator, "launch_catch_up", launch_catch_up)
        llm = LLM("demo", **base, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": True})
        llm.llm_engine.scheduler.draft_limit = cycling([3, 1, 0, 2, 0])
        assert [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)] == plain
        m = llm.llm_engine.spec_metrics
        results.append((m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens))
        assert any(caught_up) == at_launch
    assert results[0] == results[1] and results[0][2] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_keeps_the_target_when_requests_verify_different_numbers_of_drafts(seed):
    """Rows verify 0..k real drafts (the rest -1, their q uniform, as the runner pads them): every
    emitted token of a context-free target p still follows p."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab, draws = 3, 5, 12000
    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])
    num_real = torch.randint(0, k + 1, (draws,), generator=gen)
    drafts = torch.multinomial(q.expand(draws * k, -1), 1, generator=gen).view(draws, k)
    real = torch.arange(k).unsqueeze(0) < num_real.unsqueeze(1)
    drafts = torch.where(real, drafts, torch.full_like(drafts, -1))
    draft_probs = torch.where(real.unsqueeze(-1), q, torch.full((vocab,), 1.0 / vocab)).expand(draws, k, vocab)
    target = p.expand(draws, k + 1, vocab)
    res = verify(target, target.argmax(-1), drafts, draft_probs, torch.zeros(draws, dtype=torch.bool),
                 torch.rand(draws, k, generator=gen), -torch.log(torch.rand(draws, k + 1, vocab, generator=gen)))
    assert bool((res.num_accepted <= num_real).all())
    emitted = res.tokens[res.tokens >= 0]
    counts = torch.bincount(emitted, minlength=vocab).float()
    expected = p * emitted.numel()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.28, chi2  # 4 degrees of freedom, p = 0.01
    for d in range(k + 1):  # the first token, per number of drafts
        first = res.tokens[num_real == d, 0]
        c = torch.bincount(first, minlength=vocab).float()
        e = p * first.numel()
        assert float(((c - e) ** 2 / e).sum()) < 13.28


def test_adaptive_with_tensor_parallelism_is_refused():
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": True}
    with pytest.raises(ConfigError, match="adaptive.*tensor_parallel_size=2"):
        LLM(TINY, **BASE, tensor_parallel_size=2, speculative_config=spec)


def test_graph_costs_compose_a_d_draft_step(monkeypatch):
    """step_costs.measure_graph_costs: a d-draft step is the target graph of 1 + d, the drafter's
    catch-up graph of 1 + d, d - 1 single-token draft graphs and d draft heads (d = 0: its state-only
    catch-up graph where there is one); a bucket without a graph of some length has no entry for that d
    (replay timing stubbed: each replay returns its time)."""
    from types import SimpleNamespace

    from sparseserve.spec_decode import step_costs
    from sparseserve.worker.cuda_graph import GraphKey

    def runner(times: dict[int, float], hidden=None):
        graphs = {GraphKey(b, 1): SimpleNamespace(graph=SimpleNamespace(replay=lambda t=t: t))
                  for b, t in times.items()}
        return SimpleNamespace(graphs=graphs, hidden=hidden)

    target = {1: runner({1: 1.0, 8: 2.0}), 2: runner({1: 1.1, 8: 2.4}), 3: runner({1: 1.2})}
    mtp = {1: runner({1: 0.1, 8: 0.2}, hidden=torch.zeros(8, 2, 4)), 2: runner({1: 0.12, 8: 0.25}),
           3: runner({1: 0.14})}
    monkeypatch.setattr(step_costs, "_replay_seconds", lambda replay, reps: replay())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    costs = step_costs.measure_graph_costs(target, mtp, lambda h: 0.01 * h.shape[0], k=2)
    assert costs.buckets == [1, 8] and costs.source == "measured"
    assert costs.seconds[(1, 0)] == pytest.approx(1.0 + 0.1)
    assert costs.seconds[(1, 1)] == pytest.approx(1.1 + 0.12 + 0.01)
    assert costs.seconds[(1, 2)] == pytest.approx(1.2 + 0.14 + 0.1 + 2 * 0.01)
    assert costs.seconds[(8, 1)] == pytest.approx(2.4 + 0.25 + 0.08)
    assert (8, 2) not in costs.seconds and policy(costs, k=2).best(8, 0.99) in (0, 1)
    assert step_costs.measure_graph_costs({}, {}, lambda h: None, k=2) is None
    # The drafter's state-only catch-up graphs price d = 0 where they hold the bucket; d > 0 is unchanged.
    lean = step_costs.measure_graph_costs(target, mtp, lambda h: 0.01 * h.shape[0], k=2,
                                          catch_up_graphs={1: runner({1: 0.03})})
    assert lean.seconds[(1, 0)] == pytest.approx(1.0 + 0.03)
    assert lean.seconds[(8, 0)] == pytest.approx(2.0 + 0.2)  # no state-only graph at 8: the full catch-up
    assert {key: v for key, v in lean.seconds.items() if key[1]} == {key: v for key, v in costs.seconds.items()
                                                                      if key[1]}
