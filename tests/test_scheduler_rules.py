"""The scheduler's running loop spells Request's rules inline (it runs for every request at every
step); it must decide exactly what the helpers decide."""
import random

from sparseserve.engine.kv_cache import KVCacheManager
from sparseserve.engine.request import Request, RequestStatus
from sparseserve.engine.scheduler import Scheduler, make_chunk
from sparseserve.sampling_params import SamplingParams

BLOCK = 4


def expected_chunks(running: list[Request], budget: int, max_len: int | None, kv: KVCacheManager):
    """The running requests' chunks by the helpers (enough free blocks: no preemption)."""
    out = []
    for req in running:
        if budget == 0:
            break
        total = req.num_tokens_with_pending
        n = min(total - req.num_computed_tokens, budget)
        if n <= 0 or req.ends_by_length_with_pending(max_len):
            continue
        num_draft = 0
        if req.draft_token_ids and n == req.num_tokens - req.num_computed_tokens == 1:
            room = (max_len - req.num_tokens - 1) if max_len else len(req.draft_token_ids)
            num_draft = max(0, min(len(req.draft_token_ids), budget - 1, room))
            n += num_draft
        need = req.num_computed_tokens + n
        holds = kv.holds(req, need)
        c = make_chunk(req, n, total, num_draft)
        out.append((req.request_id, c.num_tokens, c.start_pos, c.completes, c.num_draft, holds))
        budget -= n
    return out


def random_running(rng: random.Random, count: int) -> list[Request]:
    reqs = []
    for i in range(count):
        prompt = [5] * rng.randint(1, 12)
        output = [6] * rng.randint(0, 6)
        max_tokens = rng.choice([None, len(output) + rng.randint(0, 3)]) or None
        req = Request(f"r{i}", None, prompt, SamplingParams(max_tokens=max_tokens), 0, i, output_token_ids=output)
        req.num_pending_tokens = rng.choice([0, 0, 1, 2])
        total = len(prompt) + len(output) + req.num_pending_tokens
        req.num_computed_tokens = rng.randint(max(0, total - 4), total)
        if rng.random() < 0.3 and req.num_computed_tokens == req.num_tokens - 1:
            req.draft_token_ids = [7] * rng.randint(1, 3)
        req.status = RequestStatus.RUNNING
        reqs.append(req)
    return reqs


def test_running_loop_matches_the_request_helpers():
    rng = random.Random(11)
    for trial in range(400):
        running = random_running(rng, rng.randint(1, 9))
        max_len = rng.choice([None, 14, 20, 40])
        budget = rng.choice([1, 3, 8, 64])
        kv = KVCacheManager(num_blocks=4096, block_size=BLOCK, num_slots=64)
        for req in running:  # a slot and the blocks of what is computed, sometimes a block more
            kv.allocate(req, req.num_computed_tokens + rng.choice([0, 0, BLOCK]))
        want = expected_chunks(running, budget, max_len, kv)
        sched = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                          max_model_len=max_len)
        sched.running = list(running)
        got = sched.schedule()
        assert not got.preempted
        assert [(c.request.request_id, c.num_tokens, c.start_pos, c.completes, c.num_draft) for c in got.chunks] \
            == [w[:5] for w in want], trial
        for c, w in zip(got.chunks, want):  # blocks were allocated where the helpers said they were missing
            assert kv.holds(c.request, c.start_pos + c.num_tokens)
