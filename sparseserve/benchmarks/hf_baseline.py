"""The `transformers` baseline: `DeepseekV4ForCausalLM.generate` on the same weights as the engine.

The weights are made exactly as the engine makes them (`sparseserve.model.loader.load_model`:
`init_dummy_weights` for `load_format="dummy"`, or the checkpoint directory's tensors) and then
copied into a `transformers` model built from the same config, so both backends compute the
same function. The whole model is in the benchmark dtype (bf16 on CUDA by default, float32 on
the CPU): built with `_from_config`, it cannot keep `from_pretrained`'s float32 islands (a
float32 norm output would meet a bf16 projection).

Generation is greedy with `max_new_tokens = min_new_tokens = output_len`, in batches of
`batch_size` prompts, left-padded with an attention mask (the random-token workloads have
prompts of one length, so no padding is actually added there).
"""
from __future__ import annotations

import copy
import time

import torch


def load_hf_model(model: str | None, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
                  hf_overrides: dict | None = None, seed: int = 0):
    """A `transformers` DeepseekV4ForCausalLM holding the weights the engine would load."""
    from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

    from ..engine import llm_engine  # looked up at call time, so `shared_weights()` applies here too

    ours, model_config, _ = llm_engine.load_model(model, dtype, device, load_format, hf_overrides, seed)
    hf_config = copy.deepcopy(model_config.hf_config)
    with torch.device(device):
        hf = HFDeepseekV4._from_config(hf_config, dtype=dtype)
    # One dtype throughout: a model built with _from_config does not get from_pretrained's fp32
    # islands wired up, and mixing them fails at the first projection (fp32 input, bf16 weight).
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the transformers model and the engine's differ: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    del ours
    hf.generation_config.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(hf.generation_config, name):
            setattr(hf.generation_config, name, None)
    return hf.eval()


def pad_token_id(model) -> int:
    cfg = model.config
    for value in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(value, int):
            return value
    return 0


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, longest - len(p):] = 1
    return ids, mask


class StepTimer:
    """A logits processor that reads the clock once per generated token (after each forward)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def _generate_batch(model, prompts: list[list[int]], output_len: int, processors=None) -> list[list[int]]:
    from transformers import LogitsProcessorList

    device = model.device
    pad = pad_token_id(model)
    ids, mask = left_pad(prompts, pad)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad, use_cache=True,
                         logits_processor=LogitsProcessorList(processors or []))
    return out[:, ids.shape[1]:].tolist()


def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations of every prompt, `batch_size` prompts per `generate` call."""
    outputs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        outputs.extend(_generate_batch(model, prompts[i:i + batch_size], output_len))
    return outputs


def hf_step_times(model, prompts: list[list[int]], output_len: int) -> tuple[float, list[float], list[list[int]]]:
    """One `generate` call over `prompts` as one batch: (prefill seconds, decode step seconds, outputs).

    Prefill is the time from the call to the first token's logits; each decode step is the time
    between two consecutive tokens' logits (forward + generate's own bookkeeping).
    """
    timer = StepTimer(model.device)
    if timer.cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = _generate_batch(model, prompts, output_len, [timer])
    times = [start] + timer.times
    return times[1] - times[0], [b - a for a, b in zip(times[1:], times[2:])], outputs
