"""Async scheduling with MTP speculation (engine/spec_async.py) changes when the host records a
step, never which tokens a request gets: the same as the synchronous speculative engine and, when
greedy, as plain decoding, with drafts accepted in part (a drafter that is right at known
positions), stops and max_tokens inside accepted drafts, preemption and sampling."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR

TINY = str(CONFIGS_DIR / "tiny")
BASE = dict(device="cpu", dtype="float32", max_model_len=64)
MAX_TOKENS = 10


def prompts():
    gen = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (3, 21, 9, 14)]


class PartlyRightDrafter:
    """Proposes the target's greedy continuation, with the draft for position p + 1 + j made wrong
    when (p + j) % 3 == 0: steps accept 0..k drafts."""

    def __init__(self, continuations: dict[str, list[int]], k: int) -> None:
        self.continuations, self.k = continuations, k

    def propose(self, requests, streams, sampling):
        drafting = [i for i, r in enumerate(requests) if r.draft_from is not None]
        drafts = []
        for i in drafting:
            r = requests[i]
            pos = r.chunk.start_pos + r.draft_from
            seq = self.continuations[r.request_id]
            d = [t if (pos + j) % 3 else (t + 1) % 512 for j, t in enumerate(seq[pos + 2:pos + 2 + self.k])]
            drafts.append(d + [0] * (self.k - len(d)))
        return torch.tensor(drafts, dtype=torch.long).view(len(drafting), self.k), None, drafting


@pytest.fixture(scope="module")
def plain():
    """Plain decoding's greedy tokens, long enough to serve as the drafter's continuations."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + 4, ignore_eos=True)
    outs = LLM(TINY, **BASE).generate(prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run(k: int, async_scheduling: bool, params, plain=None, **engine):
    llm = LLM(TINY, **BASE, async_scheduling=async_scheduling,
              speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
    eng = llm.llm_engine
    assert eng.async_scheduling is async_scheduling
    if plain is not None:
        first = llm._next_id
        conts = {str(first + i): p["prompt_token_ids"] + t for i, (p, t) in enumerate(zip(prompts(), plain))}
        eng.runner.speculator.proposer = PartlyRightDrafter(conts, k)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert eng.all_cache_free() and not any(eng.debug_state_counts().values())
    m = eng.spec_metrics
    summary = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]
    return summary, (m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens), eng


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_async_speculation_equals_sync_and_plain(k, plain):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, metrics, _ = run(k, True, params, plain)
    want, want_metrics, _ = run(k, False, params, plain)
    assert got == want and metrics == want_metrics
    assert [t for t, _, _ in got] == [t[:MAX_TOKENS] for t in plain]
    assert 0 < metrics[2] < metrics[1]  # some drafts accepted, some rejected


def test_greedy_async_speculation_with_the_mtp_drafter(plain):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, metrics, _ = run(2, True, params)
    assert got == run(2, False, params)[0]
    assert [t for t, _, _ in got] == [t[:MAX_TOKENS] for t in plain] and metrics[0] > 0


def test_sampled_async_speculation_equals_sync():
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True) for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # a greedy request among them
    got = run(2, True, params)[0]
    assert got == run(2, False, params)[0]
    assert all(len(t) == 8 for t, _, _ in got)


def test_stops_and_max_tokens_inside_accepted_drafts(plain):
    """A stop token, a max_tokens limit and max_model_len that fall inside a step's accepted drafts:
    the request ends where plain decoding ends it, while its next step is already in flight."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[plain[0][4]]),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[plain[3][1]])]
    got, metrics, _ = run(2, True, params, plain)
    want = run(2, False, params, plain)[0]
    assert got == want
    assert got[0][1:] == ("stop", plain[0][4]) and got[0][0] == plain[0][:plain[0].index(plain[0][4]) + 1]
    assert [len(t) for t, _, _ in got[1:3]] == [3, 7]
    near_end = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    short = dict(max_model_len=28)
    outs = [LLM(TINY, **{**BASE, **short}, async_scheduling=a,
                speculative_config={"method": "mtp", "num_speculative_tokens": 2}).generate(
        prompts(), near_end, use_tqdm=False) for a in (True, False)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert all(o.outputs[0].finish_reason == "length" for o in outs[0])


def test_async_speculation_under_preemption(plain):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, _, eng = run(2, True, params, plain, num_gpu_blocks_override=3, max_num_seqs=3)
    assert eng.scheduler.num_preemptions > 0
    assert [t for t, _, _ in got] == [t[:MAX_TOKENS] for t in plain]
    # Sampled drafts depend on the steps a request ran (a recompute drafts afresh): the same
    # preemptions as the synchronous engine, the same tokens.
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, _, eng = run(2, True, sampled, num_gpu_blocks_override=3, max_num_seqs=3)
    assert eng.scheduler.num_preemptions > 0
    b, _, sync = run(2, False, sampled, num_gpu_blocks_override=3, max_num_seqs=3)
    assert a == b and sync.scheduler.num_preemptions == eng.scheduler.num_preemptions
