"""LLM.beam_search against a plain beam search over the model's raw logits (vLLM's algorithm and
score), and LLM.chat through the model's chat format."""

import pytest
import torch

from sparseserve import LLM, BeamSearchParams, SamplingParams
from sparseserve.beam_search import get_beam_search_score
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.sampling_params import SamplingParamsError

from oracle import Driver

TINY = str(CONFIGS_DIR / "tiny")
EOS = 1


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, device="cpu", dtype="float32", max_model_len=96)


def reference_beam_search(model, prompt, width, max_tokens, length_penalty, ignore_eos=False):
    def logprobs(tokens):
        driver = Driver(model, num_slots=1, num_blocks=16)
        return torch.log_softmax(driver.step([(0, 0, tokens)], want="last")[0][-1], dim=-1)

    def score(beam):
        return get_beam_search_score(beam[0], beam[1], EOS, length_penalty)

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            lp = logprobs(tokens)
            top = lp.topk(2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (done if t == EOS and not ignore_eos else candidates).append((tokens + [t], cum + v))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (2, 0.5)])
def test_beam_search_equals_the_reference(llm, width, length_penalty):
    prompts = [[5, 77, 300, 12], [9, 8, 7, 6, 5, 4, 3, 200, 201]]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    model = llm.llm_engine.model
    for prompt, out in zip(prompts, outputs):
        ref = reference_beam_search(model, prompt, width, 5, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (_, cum) in zip(out.sequences, ref):
            assert abs(seq.cum_logprob - cum) < 1e-4
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert seq.text is not None and seq.finish_reason in ("stop", "length")
    if width == 1:  # beam width 1 is greedy decoding
        greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        for prompt, g, out in zip(prompts, greedy, outputs):
            if EOS not in out.sequences[0].tokens:
                assert out.sequences[0].tokens[len(prompt):] == g.outputs[0].token_ids


def test_beam_search_params_are_validated():
    with pytest.raises(SamplingParamsError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def test_chat_encodes_with_the_chat_format(tmp_path):
    """LLM.chat renders the model's chat format (DeepSeek-V4's, on a test tokenizer with its role tokens) and
    generates from exactly those tokens; the embedded models have no chat format and refuse chat."""
    from server_utils import write_v4_tokenizer

    from sparseserve.chat import ChatFormatError, render_chat

    demo = LLM(TINY, tokenizer=str(write_v4_tokenizer(tmp_path / "v4tok")), device="cpu", max_model_len=256)
    tok = demo.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    out = demo.chat(messages, params, use_tqdm=False)
    text = render_chat(messages, tok, add_generation_prompt=True)
    assert out[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)
    plain = demo.generate([{"prompt_token_ids": out[0].prompt_token_ids}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    both = demo.chat([messages, messages[1:]], params, use_tqdm=False)
    assert len(both) == 2 and both[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(ChatFormatError, match="no chat format"):
        LLM(TINY, device="cpu", max_model_len=256).chat(messages, params, use_tqdm=False)
