"""Request bookkeeping: the token window a step reads, without copying the whole sequence; pending tokens."""
import random

from sparseserve.engine.request import Request
from sparseserve.sampling_params import SamplingParams


def test_token_ids_between_matches_slicing_the_whole_sequence():
    rng = random.Random(0)
    for _ in range(2000):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(100) for _ in range(rng.randint(0, 5))]
        drafts = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
        req = Request("r", None, prompt, SamplingParams(), 0, 0, output_token_ids=output, draft_token_ids=drafts)
        num_draft = rng.randint(0, len(drafts))
        whole = prompt + output + drafts[:num_draft]
        start = rng.randint(0, len(whole))
        end = rng.randint(start, len(whole))
        assert req.token_ids_between(start, end, num_draft) == whole[start:end]


def test_pending_tokens_are_placeholders_and_counted():
    """Tokens sampled by a launched step but not read back: counted by the scheduler, given as
    placeholders (the runner fills them in on the device)."""
    from sparseserve.engine.request import PENDING_TOKEN_ID

    req = Request("r", None, [7, 8, 9], SamplingParams(max_tokens=3), 0, 0, output_token_ids=[4])
    req.num_pending_tokens = 1
    assert req.num_tokens == 4 and req.num_tokens_with_pending == 5
    assert req.token_ids_between(2, 5) == [9, 4, PENDING_TOKEN_ID]
    assert req.token_ids_between(4, 5) == [PENDING_TOKEN_ID]
    assert not req.ends_by_length_with_pending(None)  # 2 outputs of max_tokens 3
    req.output_token_ids.append(5)
    assert req.ends_by_length_with_pending(None)  # the pending token is the third
    req.num_pending_tokens = 0
    assert not req.ends_by_length_with_pending(None)  # nothing pending: the engine decides
    long = Request("l", None, [1] * 9, SamplingParams(max_tokens=None), 0, 0, num_pending_tokens=1)
    assert long.ends_by_length_with_pending(10) and not long.ends_by_length_with_pending(11)


def test_scheduler_skips_a_request_its_pending_token_finishes():
    from sparseserve.engine.kv_cache import KVCacheManager
    from sparseserve.engine.scheduler import Scheduler

    sched = Scheduler(KVCacheManager(num_blocks=8, block_size=4, num_slots=2), max_num_seqs=2,
                      max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=64)
    done = Request("done", None, [1, 2], SamplingParams(max_tokens=1), 0, 0)
    more = Request("more", None, [1, 2], SamplingParams(max_tokens=5), 0, 1)
    for req in (done, more):
        sched.add(req)
    first = sched.schedule()
    assert [(c.request.request_id, c.num_tokens, c.completes) for c in first.chunks] == [("done", 2, True),
                                                                                          ("more", 2, True)]
    for chunk in first.chunks:  # what the engine does at launch
        chunk.request.num_computed_tokens += chunk.num_tokens
        chunk.request.num_pending_tokens += 1
    second = sched.schedule()  # before the first step is read back
    assert [(c.request.request_id, c.num_tokens, c.start_pos, c.completes) for c in second.chunks] == [
        ("more", 1, 2, True)]
