"""Run by tests/test_prefill_pieces.py in a process of its own: the plain forward and the padded piecewise
forward (model/pieces.py, pieces run eagerly) over the same steps on two copies of the state; prints, as
JSON, per step and configuration, whether the real tokens' streams and logits are bitwise equal and
which state rows differ outside the trash rows.

A process of its own because of ATEN_CPU_CAPABILITY=default, which must be set before torch loads: torch's
vectorised CPU kernels compute the last elements of a tensor that fill no whole vector with the scalar
function (std::exp against SLEEF's, for one), so an elementwise op over [T, ...] rounds a token's values
differently when T changes; with the default capability both paths are the scalar function. Matrix
products are unaffected at these sizes."""
from __future__ import annotations

import json
import sys

import torch

from oracle import randomize, tiny_config
from sparseserve.config import ModelConfig, WeightFormat
from sparseserve.model.batch import SequenceChunk, build_batch
from sparseserve.model.layers.fused_linear import pack_projections
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from sparseserve.model.pieces import EagerPieces, PaddedInputs
from sparseserve.model.quantize import quantize_model
from sparseserve.model.state import ModelState, StateLayout

CONFIGS = {
    "all-kinds": {},
    # Widths of 128 so the linears and experts can hold block-FP8 weights (the quantized reference path).
    "fp8-weights": {"hidden_size": 128, "q_lora_rank": 128, "moe_intermediate_size": 128, "o_lora_rank": 128},
    "hc4-rates-2-8-deeper": {
        "hc_mult": 4, "num_hidden_layers": 5, "num_hash_layers": 2, "index_topk": 3, "sliding_window": 6,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        "layer_types": ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention"],
    },
}
BUCKETS = [8, 32, 64]
# Each step: (slot, first position, tokens, logits wanted). Chunked prefill beside decode rows, ragged
# lengths, chunks crossing compress windows (rates 2..16) and 16-token blocks; the steps shrink and grow,
# so padding rows hold earlier steps' ids and positions; one step fills its bucket exactly.
STEPS = [
    [(0, 0, 14, "all"), (1, 0, 5, "last")],
    [(0, 14, 27, "all"), (1, 5, 1, "last"), (2, 0, 7, "all")],
    [(0, 41, 1, "last"), (1, 6, 1, "last"), (2, 7, 17, "all"), (3, 0, 3, "none")],
    [(1, 7, 26, "all"), (0, 42, 1, "last"), (3, 3, 1, "last")],
    [(2, 24, 5, "all"), (3, 4, 3, "all")],
    [(0, 43, 32, "all")],  # exactly a bucket: no padding
]


def trash_rows(layout: StateLayout, name: str, rate: int, overlap: bool) -> set[int]:
    """The rows every write that must go nowhere lands in (plain and padded steps alike)."""
    if name == "kv_pool":
        return {layout.trash_row(layout.ring_rows)}
    if name in ("compressor_state", "indexer_state"):
        return {layout.trash_row(layout.compressor_ring_rows(rate, overlap))}
    return set()


@torch.no_grad()
def run(name: str) -> list[dict]:
    cfg = tiny_config(**CONFIGS[name])
    mc = ModelConfig(cfg, dtype=torch.float32)
    model = DeepseekV4ForCausalLM(mc)
    randomize(model, 3)
    if name.startswith("fp8"):
        assert quantize_model(model, "fp8", WeightFormat()), "nothing was quantized"
        pack_projections(model)
    model.eval()
    layout = StateLayout(num_blocks=32, block_size=16, num_slots=5, max_step_tokens=max(BUCKETS),
                         sliding_window=cfg.sliding_window)
    plain_state = ModelState(mc, layout, torch.device("cpu"), torch.float32)
    padded_state = ModelState(mc, layout, torch.device("cpu"), torch.float32)
    inputs = PaddedInputs.allocate(max(BUCKETS), cfg.num_attention_heads, cfg.head_dim, torch.float32,
                                   torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (80,), generator=gen).tolist() for _ in range(4)]
    blocks = {slot: list(range(6 * slot, 6 * slot + 6)) for slot in range(4)}
    results = []
    for step in STEPS:
        chunks = [SequenceChunk(s, start, prompts[s][start:start + n], blocks[s], want) for s, start, n, want in step]
        batch = build_batch(chunks, mc.rates, "cpu")
        n = batch.num_tokens
        bucket = min(b for b in BUCKETS if b >= n)
        streams = model(batch, plain_state)
        logits = model.compute_logits(batch.logits_streams(streams))
        carry = model.forward_padded(batch, padded_state, inputs.narrow(bucket),
                                     EagerPieces(model.side_streams, torch.device("cpu"), bucket))
        padded_logits = model.logits_of(batch.logits_streams(carry.hidden[:n]))
        differing = []
        for i, (a, b) in enumerate(zip(plain_state.layers, padded_state.layers)):
            rate = mc.compress_rate(i)
            for field in ("kv_pool", "index_pool", "index_scale", "compressor_state", "indexer_state"):
                x, y = getattr(a, field), getattr(b, field)
                if x is None:
                    continue
                rows = set((x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist())
                rows -= trash_rows(layout, field, rate, mc.is_csa(i))
                if rows:
                    differing.append(f"layer {i} {field} rows {sorted(rows)[:8]}")
        results.append({"tokens": n, "bucket": bucket, "streams_equal": torch.equal(streams, carry.streams[:n]),
                        "logits_equal": torch.equal(logits, padded_logits), "logits_rows": logits.shape[0],
                        "state_differs": differing})
    return results


if __name__ == "__main__":
    print(json.dumps({name: run(name) for name in sys.argv[1:] or CONFIGS}))
