"""Evaluate the embedded demo model: held-out perplexity by this engine and by the
`transformers` oracle (they must agree), MTP acceptance at k = 1 and 2 (greedy), and a few
sample continuations.

    python tools/eval_demo.py [--model sparseserve/configs/demo] [--out demo_eval.json]
"""
from __future__ import annotations

import argparse
import hashlib
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import corpus, encode  # noqa: E402  (the same held-out split as training)

from sparseserve import LLM, SamplingParams  # noqa: E402

SAMPLE_PROMPTS = ["The return statement", "A class definition", "Exceptions are", "The for statement is used to"]


def nll_engine(llm: LLM, chunks: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    total = 0.0
    for out in llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False):
        total -= sum(entry[tok].logprob for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
    return total


@torch.no_grad()
def nll_oracle(model_dir: str, chunks: list[list[int]]) -> float:
    from transformers import DeepseekV4ForCausalLM

    oracle = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    for c in chunks:
        logp = torch.log_softmax(oracle(torch.tensor([c])).logits[0].float(), dim=-1)
        total -= float(logp[:-1].gather(1, torch.tensor(c[1:]).unsqueeze(1)).sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "sparseserve/configs/demo"))
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="where to time generation with and without speculation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = LLM(args.model, device="cpu", dtype="float32", max_model_len=1024)
    tokenizer = base.get_tokenizer()
    _, held_docs = corpus()
    held = encode(tokenizer, held_docs).tolist()
    chunks = [held[i:i + args.chunk] for i in range(0, len(held) - args.chunk + 1, args.chunk)]
    tokens = sum(len(c) - 1 for c in chunks)
    ours = nll_engine(base, chunks)
    ref = nll_oracle(args.model, chunks)
    # The corpus is this Python's `pydoc_data.topics`: another CPython version ships other text, whose
    # "held-out" paragraphs may be training paragraphs of the checkpoint (trained on Python 3.11's).
    result = {"python": platform.python_version(),
              "held_out_sha256": hashlib.sha256(repr(held_docs).encode()).hexdigest()[:16],
              "held_out_tokens_scored": tokens, "chunk": args.chunk,
              "perplexity_engine": math.exp(ours / tokens), "perplexity_oracle": math.exp(ref / tokens)}
    result["perplexity_rel_diff"] = abs(result["perplexity_engine"] / result["perplexity_oracle"] - 1)

    prompts = [{"prompt_token_ids": c[:64]} for c in chunks[:16]]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # The default mode of the device: CUDA graphs on the GPU (verify and drafter steps too), eager on the CPU.
    timed = dict(device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16", max_model_len=1024,
                 max_num_seqs=len(prompts))
    if args.device != "cpu":
        # Three engines live one after another in this process: each gets a small cache, not 90% of the card.
        timed["kv_cache_memory_bytes"] = 2 * 1024**3
    result["generation"] = {"device": args.device, "dtype": timed["dtype"], "prompts": len(prompts),
                            "cuda_graphs": args.device != "cpu"}

    def run(llm, batch: int) -> tuple[list[list[int]], float]:
        """Greedy outputs of the prompts, `batch` at a time, and the seconds it took."""
        llm.generate(prompts[:batch], greedy, use_tqdm=False)  # warm-up
        llm.llm_engine.spec_metrics = type(llm.llm_engine.spec_metrics)()
        outs = []
        t = time.perf_counter()
        for i in range(0, len(prompts) if batch > 1 else 4, batch):
            outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], greedy, use_tqdm=False)]
        return outs, time.perf_counter() - t

    for k in (0, 1, 2):
        # adaptive=False: every step verifies k drafts (the acceptance at k is what is reported).
        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}} if k else {}
        llm = LLM(args.model, **timed, **spec)
        for batch in (1, len(prompts)):
            outs, seconds = run(llm, batch)
            n_out = sum(len(o) for o in outs)
            entry = {"batch": batch, "output_tokens": n_out, "tok_per_s": n_out / seconds}
            if k:
                m = llm.llm_engine.spec_metrics
                plain = result["generation"][f"plain_batch{batch}"]
                entry.update(acceptance_rate=m.acceptance_rate, mean_accepted_length=m.mean_accepted_length,
                             speedup=entry["tok_per_s"] / plain["tok_per_s"],
                             same_tokens_as_plain=sum(a == b for a, b in zip(outs, plain["tokens"])) / len(outs))
                result[f"mtp_k{k}_batch{batch}"] = entry
            else:
                result["generation"][f"plain_batch{batch}"] = dict(entry, tokens=outs)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.device != "cpu":
        # bf16 on the GPU against fp32 on the CPU: greedy continuations agree until a near-tie.
        reference = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
        got = result["generation"][f"plain_batch{len(prompts)}"]["tokens"]
        agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(reference, got)]
        result["generation"]["mean_leading_tokens_equal_to_cpu_fp32"] = sum(agree) / len(agree)
    for entry in result["generation"].values():
        if isinstance(entry, dict):
            entry.pop("tokens", None)
    samples = base.generate(SAMPLE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    result["samples"] = {o.prompt: o.outputs[0].text for o in samples}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
