"""Write a DeepSeek-V4 checkpoint in the release's format (docs/checkpoints.md): the release's
tensor names, FP8 block linears with FP4 (as V4-Flash) or FP8 (as V4-Flash-Base) routed experts,
or all bf16; sharded with a model.safetensors.index.json; MTP layer included. Random weights, or
with `--weights model` the model's own (e.g. the trained demo model, quantized as the release
stores its weights).

    python tools/write_release_checkpoint.py --out /tmp/tiny-release                  # the tiny config
    python tools/write_release_checkpoint.py --out /tmp/flash-4l16e --model deepseek-v4-flash \\
        --num-layers 4 --num-experts 16 --expert-dtype fp4                            # V4-Flash layer shapes
    python tools/write_release_checkpoint.py --out /tmp/demo-release --model demo --weights model

Deterministic: the same arguments on the same kind of device write the same files; `--device cuda` draws and
encodes on a GPU (V4-Flash-sized files in seconds, bounded by the disk).
"""
from __future__ import annotations

import argparse
import json
import time

from sparseserve.model.loader import load_hf_config, resolve_model_dir
from sparseserve.model.release_writer import EXPERT_DTYPES, WEIGHT_SOURCES, write_release_checkpoint


def fewer(model: str, num_layers: int | None, num_experts: int | None) -> dict:
    """hf_overrides keeping the first `num_layers` layers (their kinds as in the full config) and
    `num_experts` routed experts."""
    model_dir, preset = resolve_model_dir(model)
    base = load_hf_config(model_dir, preset)
    overrides: dict = {}
    if num_layers is not None:
        overrides.update(num_hidden_layers=num_layers, layer_types=list(base.layer_types[:num_layers]),
                         mlp_layer_types=list(base.mlp_layer_types[:num_layers]))
    if num_experts is not None:
        overrides.update(n_routed_experts=num_experts,
                         num_experts_per_tok=min(base.num_experts_per_tok, num_experts))
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write (created)")
    parser.add_argument("--model", default="tiny", help="a preset or a checkpoint directory whose config.json "
                        "gives the shapes (default: tiny)")
    parser.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="fp4")
    parser.add_argument("--num-layers", type=int, help="keep the first N decoder layers")
    parser.add_argument("--num-experts", type=int, help="routed experts per layer")
    parser.add_argument("--hf-overrides", type=json.loads, default={}, help="JSON object of config.json keys")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size-mb", type=int, default=4096)
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer (mtp.0.*)")
    parser.add_argument("--tokenizer", help="directory whose tokenizer files are copied (default: the model's)")
    parser.add_argument("--device", default="cpu", help="where values are drawn and encoded (cuda: much faster)")
    parser.add_argument("--weights", choices=WEIGHT_SOURCES, default="random",
                        help="random values, or the model's own weights (its checkpoint must have them)")
    args = parser.parse_args()
    overrides = {**fewer(args.model, args.num_layers, args.num_experts), **args.hf_overrides}
    start = time.perf_counter()
    out = write_release_checkpoint(args.out, args.model, overrides, args.expert_dtype, args.seed,
                                   args.shard_size_mb << 20, not args.no_mtp, args.tokenizer, args.device,
                                   args.weights)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    print(f"wrote {out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size'] / 2**30:.2f} GiB "
          f"in {shards} shard(s), {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
