"""The runner's cached logits processing (sparseserve/worker/sampling_state.py): a plan kept per batch
composition, with penalty counts kept on the device across steps, gives the logits a from-scratch
reference gives, step after step, when the batch changes, when a pending token is counted from the
device, when a request is forgotten (finished, preempted) and comes back, and when a counted token
never reaches the host. Also the per-composition sampling parameters and the bitmask buffers."""
from collections import Counter
from dataclasses import dataclass, field

import torch

from sparseserve import SamplingParams
from sparseserve.structured_output.bitmask import BitmaskStaging
from sparseserve.worker.sampling_state import LogitsState, SamplingTensorCache

V = 48
EOS = 1


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0
    is_finished: bool = False
    grammar: object | None = None
    sample_seed: int = 0


def f32(value):
    return torch.tensor(value, dtype=torch.float32)


def reference(logits, req, pending_token=None):
    """The fields' definitions on one row (the output counted with a pending token after it), in fp32."""
    p, x = req.params, logits.clone()
    output = req.output_token_ids + ([pending_token] if pending_token is not None else [])
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for word in p.bad_words_token_ids:
        if len(word) == 1 or req.output_token_ids[-(len(word) - 1):] == word[:-1]:
            x[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        x[EOS] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(req.prompt_token_ids) | set(output):
            x[t] = x[t] / f32(p.repetition_penalty) if x[t] > 0 else x[t] * f32(p.repetition_penalty)
    for t, c in Counter(output).items():
        if p.frequency_penalty:
            x[t] = x[t] - f32(p.frequency_penalty) * f32(c)
        if p.presence_penalty:
            x[t] = x[t] - f32(p.presence_penalty)
    return x


def params(**kw):
    return SamplingParams(temperature=0, ignore_eos=False, **kw)


KINDS = [{}, dict(repetition_penalty=1.4), dict(frequency_penalty=0.6, presence_penalty=-0.3),
         dict(logit_bias={3: 2.5, 40: -4.0}, presence_penalty=0.8), dict(allowed_token_ids=[2, 3, 5, 8, 13, 21]),
         dict(min_tokens=4, repetition_penalty=0.7), dict(frequency_penalty=1.1)]


def make_requests(gen, n, start=0):
    reqs = []
    for i in range(start, start + n):
        p = params(**KINDS[i % len(KINDS)])
        if i % 3 == 0:  # bad words as the engine fills them from the tokenizer
            p.bad_words_token_ids = [[7], [9, 10]]
            p.needs_logits_processing = True
        prompt = torch.randint(0, V, (5 + i % 4,), generator=gen).tolist()
        reqs.append(FakeRequest(f"r{i}", p, prompt, torch.randint(0, V, (i % 3,), generator=gen).tolist()))
    return reqs


def check_step(state, reqs, gen, pending=False):
    """One step: the processed logits equal the reference; then every request gains a token."""
    logits = torch.randn(len(reqs), V, generator=gen)
    last_rows, pending_tokens = {}, None
    if pending:  # each request's last token is still on the device (async scheduling)
        pending_tokens = torch.randint(0, V, (len(reqs) + 2,), generator=gen)
        for j, r in enumerate(reversed(reqs)):  # rows of the last step in another order
            last_rows[r], r.num_pending_tokens = j + 2, 1
    plan = state.plan(reqs, last_rows, V, logits.device)
    got = plan.apply(logits, pending_tokens)
    for i, r in enumerate(reqs):
        tok = int(pending_tokens[last_rows[r]]) if pending else None
        want = reference(logits[i], r, tok) if r.params.needs_logits_processing else logits[i]
        assert torch.equal(got[i], want), (r.request_id, r.params)
    for r in reqs:  # the step's token reaches the host
        if pending:
            r.output_token_ids.append(int(pending_tokens[last_rows[r]]))
            r.num_pending_tokens = 0
        else:
            r.output_token_ids.append(int(torch.randint(0, V, (1,), generator=gen)))
    return plan


def test_kept_counts_follow_the_reference_across_steps_and_batch_changes():
    gen = torch.Generator().manual_seed(0)
    state = LogitsState(EOS)
    reqs = make_requests(gen, 9)
    first = check_step(state, reqs, gen)
    assert check_step(state, reqs, gen) is first  # the same composition keeps its plan
    for _ in range(3):
        check_step(state, reqs, gen, pending=True)
    # A request finishes, two join, the order changes: a new plan, counts carried for the others.
    state.forget(reqs[2].request_id)
    reqs = [reqs[5], reqs[0]] + reqs[6:] + make_requests(gen, 2, start=20) + [reqs[1], reqs[3], reqs[4]]
    for pending in (False, True, True, False):
        check_step(state, reqs, gen, pending=pending)
    assert check_step(state, reqs[:4], gen) is not first


def test_a_forgotten_request_is_counted_again_from_the_host():
    gen = torch.Generator().manual_seed(1)
    state = LogitsState(EOS)
    reqs = make_requests(gen, 7)
    for _ in range(3):
        check_step(state, reqs, gen, pending=True)
    assert state.prompt_masks  # the repetition penalty's prompt masks are kept
    # Preempted: forgotten, and its tokens replaced while it was out (the counts must not be carried).
    victim = reqs[1]
    state.forget(victim.request_id)
    assert victim.request_id not in state.prompt_masks
    victim.output_token_ids[:] = [4, 4, 4]
    check_step(state, reqs, gen)
    # A new request under a finished one's id: nothing of the old one is used.
    old = reqs[2]
    state.forget(old.request_id)
    new = FakeRequest(old.request_id, old.params, [11, 12], [11, 11, 11, 11])
    reqs[2] = new
    check_step(state, reqs, gen, pending=True)
    check_step(state, reqs, gen)


def test_a_counted_pending_token_that_never_reaches_the_host_is_dropped():
    gen = torch.Generator().manual_seed(2)
    state = LogitsState(EOS)
    reqs = make_requests(gen, 7)
    check_step(state, reqs, gen, pending=True)
    logits = torch.randn(len(reqs), V, generator=gen)
    pending_tokens = torch.randint(0, V, (len(reqs),), generator=gen)
    for r in reqs:
        r.num_pending_tokens = 1
    state.plan(reqs, {r: i for i, r in enumerate(reqs)}, V, logits.device).apply(logits, pending_tokens)
    for r in reqs:  # the step failed: its tokens are dropped and the requests recomputed synchronously
        r.num_pending_tokens = 0
    check_step(state, reqs, gen)
    check_step(state, reqs, gen, pending=True)


class FakeGrammar:
    """Allows the tokens in `allowed` until terminated."""

    def __init__(self, allowed):
        self.allowed, self.terminated = allowed, False

    def fill(self, mask, index, prefix):
        assert not prefix
        row = torch.zeros(V, dtype=torch.bool)
        row[self.allowed] = True
        bits = torch.zeros(mask.shape[1] * 32, dtype=torch.int64)
        bits[:V] = row.long()
        words = (bits.view(-1, 32) << torch.arange(32)).sum(1)
        mask[index] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    def batch_matcher(self):
        return None


def test_grammar_rows_through_the_reused_buffers_and_finished_grammars():
    gen = torch.Generator().manual_seed(3)
    state = LogitsState(EOS)
    reqs = make_requests(gen, 4)
    so = params(repetition_penalty=1.3)
    so.needs_logits_processing = True
    grammars = [FakeGrammar([2, 5, 31, 32, 47]), FakeGrammar([0, 1, 40])]
    reqs += [FakeRequest("g0", so, [2, 3], grammar=grammars[0]), FakeRequest("g1", params(), [4], grammar=grammars[1])]
    reqs[-1].params.needs_logits_processing = True
    for step in range(4):
        if step == 2:
            grammars[0].terminated = True  # every token allowed from now on
        if step == 3:
            reqs[-1].is_finished = True  # a finished request's grammar is not applied
        logits = torch.randn(len(reqs), V, generator=gen)
        got = state.plan(reqs, {}, V, logits.device).apply(logits)
        for i, r in enumerate(reqs):
            want = reference(logits[i], r) if r.params.needs_logits_processing else logits[i].clone()
            g = r.grammar
            if g is not None and not g.terminated and not r.is_finished:
                banned = torch.ones(V, dtype=torch.bool)
                banned[g.allowed] = False
                want[banned] = float("-inf")
            assert torch.equal(got[i], want), (step, r.request_id)
        for r in reqs:
            r.output_token_ids.append(int(torch.randint(0, V, (1,), generator=gen)))


def test_bitmask_buffers_alternate():
    staging = BitmaskStaging()
    cpu = torch.device("cpu")
    a = staging.host_rows(3, 100, cpu)
    assert a.shape == (3, 4) and a.dtype == torch.int32
    assert staging.to_device(a, cpu) is a  # on the CPU the host rows are the device's
    b = staging.host_rows(20, 100, cpu)  # a larger batch: a larger buffer
    assert b.shape == (20, 4)


def test_sampling_parameters_are_copied_once_per_composition():
    cache = SamplingTensorCache()
    reqs = [FakeRequest(f"r{i}", SamplingParams(temperature=0.5 * i, top_k=i, top_p=1 - 0.1 * i, seed=i),
                        [1], sample_seed=100 + i) for i in range(3)]
    cpu = torch.device("cpu")
    st = cache.get(reqs, [4, 5, 6], cpu)
    assert st.temperature.tolist() == [0.0, 0.5, 1.0] and st.top_k.tolist() == [0, 1, 2]
    assert st.seeds.tolist() == [100, 101, 102] and st.counters.tolist() == [4, 5, 6]
    assert st.any_top_k and st.any_top_p and not st.any_min_p and not st.all_greedy
    again = cache.get(reqs, [5, 6, 7], cpu)
    assert again.temperature is st.temperature and again.counters.tolist() == [5, 6, 7]
    other = cache.get(reqs[:1], [9], cpu)
    assert other.temperature.tolist() == [0.0] and other.all_greedy and not other.any_top_k
    cache.forget("r0")  # the cached composition's request finished: nothing of it is kept
    assert cache.get(reqs[1:], [1, 2], cpu).temperature.tolist() == [0.5, 1.0]


def test_forgetting_every_request_frees_the_plan():
    gen = torch.Generator().manual_seed(4)
    state = LogitsState(EOS)
    reqs = make_requests(gen, 5)
    check_step(state, reqs, gen)
    for r in reqs:
        state.forget(r.request_id)
    assert state._plan is None and not state.prompt_masks
    check_step(state, reqs, gen)
