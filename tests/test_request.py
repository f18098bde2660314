"""Request bookkeeping: the token window a step reads, without copying the whole sequence."""
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
