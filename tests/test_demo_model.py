"""The embedded demo model (sparseserve/configs/demo, trained by tools/train_tiny.py):
a fixed greedy continuation (regenerated only by retraining), and held-out perplexity that
equals the transformers oracle's on the same checkpoint."""
import math
import sys
from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR, DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from train_tiny import corpus, encode  # noqa: E402

DEMO = str(CONFIGS_DIR / "demo")
EXPECTED = [294, 296, 568, 608, 466, 15, 222, 384, 1524, 2031, 537, 200, 481, 1308, 813, 1313, 262, 537, 309, 826,
            918, 346, 1183, 1932]


def test_demo_is_the_default_and_continues_a_fixed_prompt():
    assert DEFAULT_MODEL == "demo"
    llm = LLM(device="cpu", dtype="float32")
    out = llm.generate(["A class definition"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == EXPECTED
    assert out.outputs[0].text.startswith(" is an executable statement.")


def test_held_out_perplexity_equals_the_oracle():
    llm = LLM(DEMO, device="cpu", dtype="float32", max_model_len=512)
    _, held_docs = corpus()
    held = encode(llm.get_tokenizer(), held_docs).tolist()
    chunks = [held[i:i + 128] for i in range(0, 4 * 128, 128)]
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    ours = -sum(e[t].logprob for o in outs for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]))
    oracle = HFDeepseekV4.from_pretrained(DEMO, dtype=torch.float32).eval()
    ref = 0.0
    with torch.no_grad():
        for c in chunks:
            logp = torch.log_softmax(oracle(torch.tensor([c])).logits[0].float(), dim=-1)
            ref -= float(logp[:-1].gather(1, torch.tensor(c[1:]).unsqueeze(1)).sum())
    n = sum(len(c) - 1 for c in chunks)
    assert abs(math.exp(ours / n) / math.exp(ref / n) - 1) < 1e-4  # the issue asks 0.5%; float32 gives ~1e-8
