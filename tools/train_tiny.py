"""Train the embedded demo model: a small DeepSeek-V4 (every layer kind, hash-MoE and MoE,
mHC) plus its MTP layer, on the English text of CPython's `pydoc_data.topics` (the language
reference and library topics that `help()` shows; PSF License 2.0, shipped with every CPython,
Debian's python3 packages included), with a byte-level BPE tokenizer trained on the same text.

    python tools/train_tiny.py --out sparseserve/configs/demo            # the committed model (CPU, ~20 min)
    python tools/train_tiny.py --device cuda --steps 4000 --out /tmp/demo # on a GPU, minutes
    python tools/train_tiny.py --steps 3 --out /tmp/smoke                 # smoke test

Every 20th paragraph is held out: the tokenizer and the model never see it.
The loss is next-token cross-entropy plus 0.3 x the MTP layer's (token t+2) cross-entropy.
Routing uses DeepSeek's bias balancing for the top-k MoE layers (no auxiliary loss).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4TopKRouter,
)

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>"]
# The four-layer layout (every layer kind, a hash layer, one MTP layer) the tiny and demo models share.
SMALL_LAYOUT = dict(
    num_hidden_layers=4, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, o_groups=2,
    index_n_heads=16, index_head_dim=32,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=20, max_position_embeddings=4096,
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
)
DEMO_CONFIG = dict(
    SMALL_LAYOUT, vocab_size=2048, hidden_size=192, moe_intermediate_size=128, q_lora_rank=96, o_lora_rank=64,
    index_topk=16, sliding_window=32,
)


def corpus() -> tuple[list[str], list[str]]:
    """(train documents, held-out documents): the topics (sorted by name) cut into paragraphs;
    every 20th paragraph is held out."""
    import pydoc_data.topics as topics

    paragraphs = [p.strip("\n") for name in sorted(topics.topics) for p in topics.topics[name].split("\n\n")]
    paragraphs = [p for p in paragraphs if p.strip()]
    train = [p for i, p in enumerate(paragraphs) if i % 20 != 7]
    held = [p for i, p in enumerate(paragraphs) if i % 20 == 7]
    return train, held


def make_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1])


def encode(tokenizer, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc) + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


class MTPHead(nn.Module):
    """The MTP layer for training, built from `transformers` modules; exported as mtp.0.*."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        mtp_config = DeepseekV4Config(**{**config.to_dict(), "num_hidden_layers": 1,
                                         "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]})
        dim = config.hidden_size
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.enorm = DeepseekV4RMSNorm(dim, config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(dim, config.rms_norm_eps)
        self.norm = DeepseekV4RMSNorm(dim, config.rms_norm_eps)
        self.hc_head = DeepseekV4HyperHead(mtp_config)
        self.block = DeepseekV4DecoderLayer(mtp_config, 0)
        self.window = config.sliding_window

    def forward(self, model: DeepseekV4ForCausalLM, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """streams [B, S, hc, D] at positions 0..S-1, next_ids [B, S] tokens at 1..S -> logits for 2..S+1."""
        batch, seq = next_ids.shape
        e = self.enorm(model.model.embed_tokens(next_ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0).expand(batch, -1)
        rope = {name: model.model.rotary_emb(e, position_ids=position_ids, layer_type=name)
                for name in ("main", "compress")}
        i = torch.arange(seq, device=x.device)
        visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
        mask = torch.zeros(seq, seq, device=x.device).masked_fill(~visible, float("-inf"))[None, None]
        x = self.block(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask,
                       past_key_values=None)
        return model.lm_head(self.norm(self.hc_head(x)))


def export_mtp(head: MTPHead) -> dict[str, torch.Tensor]:
    renames = [("block.self_attn.", "attn."), ("block.mlp.", "ffn."), ("block.input_layernorm.", "attn_norm."),
               ("block.post_attention_layernorm.", "ffn_norm."), ("block.attn_hc.", "hc_attn_"),
               ("block.ffn_hc.", "hc_ffn_"), ("hc_head.hc_", "hc_head_")]
    out = {}
    for name, value in head.state_dict().items():
        if name == "window":
            continue
        for src, dst in renames:
            if name.startswith(src):
                name = dst + name[len(src):]
                break
        out["mtp.0." + name] = value
    return out


def balance_routers(model: nn.Module, loads: dict[nn.Module, torch.Tensor], rate: float) -> None:
    """DeepSeek's auxiliary-loss-free balancing: nudge each expert's selection bias toward even load."""
    with torch.no_grad():
        for router, counts in loads.items():
            router.e_score_correction_bias += rate * torch.sign(counts.float().mean() - counts.float())
    loads.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_docs, held_docs = corpus()
    tokenizer = make_tokenizer(train_docs, DEMO_CONFIG["vocab_size"])
    train_ids, held_ids = encode(tokenizer, train_docs), encode(tokenizer, held_docs)
    print(f"corpus: {len(train_docs)} train / {len(held_docs)} held-out topics, "
          f"{len(train_ids)} / {len(held_ids)} tokens", flush=True)

    config = DeepseekV4Config(**DEMO_CONFIG)
    model = DeepseekV4ForCausalLM(config).to(args.device)
    head = MTPHead(config).to(args.device)
    for module in head.modules():  # the transformers model's own initialisation, for the MTP layer too
        model._init_weights(module)
    bad = [n for n, p in head.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"MTP parameters left uninitialised: {bad}")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "tid2eid"):  # hash routing: distinct random experts per token
                rows = [torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                        for _ in range(config.vocab_size)]
                module.tid2eid.copy_(torch.stack(rows))
    loads: dict[nn.Module, torch.Tensor] = {}

    def count_load(router, _inputs, output):
        idx = output[2]
        loads[router] = loads.get(router, 0) + torch.bincount(idx.reshape(-1), minlength=router.num_experts)

    for module in list(model.modules()) + list(head.modules()):
        if isinstance(module, DeepseekV4TopKRouter):
            module.register_forward_hook(count_load)
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _i, o: captured.__setitem__("streams", o))

    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = max(1, min(100, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    span = args.seq_len + 2
    skipped = 0
    start_time = time.time()
    model.train()
    head.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - span, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s:s + span] for s in starts.tolist()]).to(args.device)
        inputs = batch[:, : args.seq_len]
        logits = model(inputs, use_cache=False).logits
        loss_main = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:args.seq_len + 1].flatten())
        mtp_logits = head(model, captured["streams"], batch[:, 1:args.seq_len + 1])
        loss_mtp = F.cross_entropy(mtp_logits.flatten(0, 1), batch[:, 2:args.seq_len + 2].flatten())
        loss = loss_main + args.mtp_weight * loss_mtp
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            skipped += 1  # a non-finite batch is dropped rather than poisoning the weights
            loads.clear()
            continue
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance_routers(model, loads, 1e-3)
        if step % 50 == 0 or step == args.steps - 1 or not math.isfinite(loss.item()):
            print(f"step {step:5d}  loss {loss_main.item():.3f}  mtp {loss_mtp.item():.3f}  "
                  f"lr {lr_at(step):.2e}  skipped {skipped}  {time.time() - start_time:.0f}s", flush=True)

    model.eval()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    state.update({k: v.detach().cpu() for k, v in export_mtp(head).items()})
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads(config.to_json_string())
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    raw["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update({"python": sys.version.split()[0], "torch": torch.__version__, "train_tokens": len(train_ids),
                     "held_out_tokens": len(held_ids), "final_loss": loss_main.item(),
                     "final_mtp_loss": loss_mtp.item(), "skipped_steps": skipped,
                     "train_seconds": time.time() - start_time})
    (out / "training.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
