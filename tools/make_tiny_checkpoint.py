"""Make the embedded `tiny` checkpoint: a random DeepSeek-V4 with every layer kind
(sliding, CSA, HCA), hash-MoE and top-k MoE, hc_mult 2, plus a small byte-level BPE tokenizer.

    python tools/make_tiny_checkpoint.py [--out sparseserve/configs/tiny]

Deterministic: the same seed writes the same files.
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from train_tiny import SMALL_LAYOUT, make_tokenizer  # noqa: E402  (tools/ is on sys.path when run as a script)

from sparseserve.config import ModelConfig
from sparseserve.model.mtp import MTPModule, module_to_checkpoint_name

TINY_CONFIG = dict(
    SMALL_LAYOUT, vocab_size=512, hidden_size=128, moe_intermediate_size=64, q_lora_rank=64, o_lora_rank=32,
    index_topk=8, sliding_window=16, rope_theta=10000.0, compress_rope_theta=160000.0,
)


def training_text() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # the Zen of Python (public domain text) trains the tokenizer
    zen = codecs.decode(this.s, "rot13")
    return [line for line in zen.splitlines() if line] * 4


@torch.no_grad()
def randomize(model: torch.nn.Module, config: DeepseekV4Config, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(config.n_routed_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "sparseserve/configs/tiny"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    config = DeepseekV4Config(**TINY_CONFIG)
    torch.manual_seed(args.seed)
    model = DeepseekV4ForCausalLM(config)
    randomize(model, config, gen)
    # Stored in bf16 like a real checkpoint (integer tables as they are).
    state = dict(model.state_dict())
    # The MTP layer (speculative decoding), named as released checkpoints name it (mtp.0.*).
    mtp = MTPModule(ModelConfig(config, dtype=torch.float32))
    randomize(mtp, config, gen)
    state.update({module_to_checkpoint_name(k): v for k, v in mtp.state_dict().items()})
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads(config.to_json_string())
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    raw["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    make_tokenizer(training_text(), config.vocab_size).save_pretrained(str(out))
    print(f"wrote {out} ({sum(t.numel() for t in tensors.values()) / 1e6:.2f} M parameters)")


if __name__ == "__main__":
    main()
