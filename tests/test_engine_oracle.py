"""Engine outputs equal the oracle's greedy continuations and logprobs (float32, CPU), and
are identical with chunked prefill, with max_num_seqs below the batch, and under preemption."""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR

TINY = str(CONFIGS_DIR / "tiny")
PROMPT_LENGTHS = [3, 17, 40, 70, 9]
NEW_TOKENS = 10
LOGPROB_ATOL = 1e-4


def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def oracle_results():
    oracle = HFDeepseekV4.from_pretrained(TINY, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts():
            seq = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = oracle(torch.tensor([seq])).logits[0, -1].float()
                seq.append(int(logits.argmax()))
            logprobs = torch.log_softmax(oracle(torch.tensor([seq])).logits[0].float(), dim=-1)
            out = seq[len(prompt):]
            chosen = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]
            results.append((out, chosen))
    return results


SETTINGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16},
    "few-seqs": {"max_num_seqs": 2, "max_num_batched_tokens": 24},
    "preempt": {"num_gpu_blocks_override": 9, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_outputs_and_logprobs_equal_oracle(setting, oracle_results):
    llm = LLM(TINY, device="cpu", dtype="float32", max_model_len=128, **SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for out, (ref_tokens, ref_logprobs) in zip(outputs, oracle_results):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, setting
        got = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, ref_logprobs)) < LOGPROB_ATOL
        assert all(comp.logprobs[i][t].rank == 1 for i, t in enumerate(comp.token_ids))  # greedy
        assert abs(comp.cumulative_logprob - sum(got)) < 1e-6
        assert comp.finish_reason == "length"
    engine = llm.llm_engine
    assert engine.all_cache_free()
    if setting == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if setting == "chunked":
        assert engine.max_num_batched_tokens == 16
