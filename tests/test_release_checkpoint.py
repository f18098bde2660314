"""Release-format checkpoints (written by `write_release_checkpoint`) and what `transformers`'
`save_pretrained` writes load in the engine as in `transformers` 5.17 (CPU, float32).

`transformers` dequantizes the release's FP8 linears and FP4 (or FP8) routed experts on the CPU
(`accelerate` installed); both sides decode into float32, where every FP8/FP4 value times its
power-of-two scale is exact, so the decoded tensors must be bit-identical. With identical weights
the logits can differ only by float32 operation order, as in the parity tests: 1e-4 on logits of
magnitude ~5. (Its quantized load keeps the unquantized bf16 tensors in bf16 whatever `dtype`
asks for; `.float()` makes the oracle one float32 model, exactly.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from oracle import Driver, randomize, tiny_config
from sparseserve import LLM, SamplingParams
from sparseserve.entrypoints.cli import main
from sparseserve.model.loader import CONFIGS_DIR, load_model
from sparseserve.model.mtp import MTPModule, load_mtp_weights
from sparseserve.model.release_writer import write_release_checkpoint
from sparseserve.quant_formats import dequantize_fp4, dequantize_fp8_block

TINY = CONFIGS_DIR / "tiny"
ATOL = 1e-4
IDS = list(range(3, 70))


@pytest.fixture(scope="module")
def release_dirs(tmp_path_factory):
    """One tiny release checkpoint per expert format, sharded (small shards)."""
    root = tmp_path_factory.mktemp("release")
    return {fmt: write_release_checkpoint(root / fmt, TINY, expert_dtype=fmt, seed=1, max_shard_bytes=300_000)
            for fmt in ("fp4", "fp8", "bf16")}


def stored(path):
    """name -> (dtype, shape) of every tensor of a sharded checkpoint."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        with safe_open(str(path / shard), framework="pt") as f:
            out[name] = (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
    return out, len(set(index.values()))


def oracle_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_written_checkpoint_is_stored_as_the_release_stores_it(release_dirs):
    tensors, shards = stored(release_dirs["fp4"])
    assert shards >= 3
    config = json.loads((release_dirs["fp4"] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["expert_dtype"] == "fp4"
    assert tensors["embed.weight"] == ("BF16", (512, 128)) and tensors["head.weight"][0] == "BF16"
    assert tensors["layers.1.attn.wq_b.weight"] == ("F8_E4M3", (256, 64))
    assert tensors["layers.1.attn.wq_b.scale"] == ("F8_E8M0", (2, 1))
    assert tensors["layers.1.attn.wo_a.weight"][0] == "BF16"
    assert tensors["layers.1.ffn.experts.7.w2.weight"] == ("I8", (128, 32))    # [out, in / 2]
    assert tensors["layers.1.ffn.experts.7.w2.scale"] == ("F8_E8M0", (128, 2))  # one per 32 inputs
    assert tensors["layers.0.ffn.gate.tid2eid"][0] == "I64" and tensors["layers.1.ffn.gate.bias"][0] == "F32"
    assert tensors["layers.1.hc_attn_fn"][0] == "F32" and tensors["layers.1.attn.compressor.ape"][0] == "F32"
    assert tensors["mtp.0.e_proj.weight"][0] == "F8_E4M3" and tensors["mtp.0.ffn.experts.0.w1.weight"][0] == "I8"
    fp8, _ = stored(release_dirs["fp8"])
    assert fp8["layers.1.ffn.experts.0.w1.weight"][0] == "F8_E4M3" and fp8["layers.1.attn.wq_a.scale"][0] == "F32"
    bf16, _ = stored(release_dirs["bf16"])
    assert not any(n.endswith(".scale") for n in bf16) and bf16["layers.1.attn.wq_a.weight"][0] == "BF16"
    assert "quantization_config" not in json.loads((release_dirs["bf16"] / "config.json").read_text())


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_release_checkpoint_loads_as_in_transformers(fmt, release_dirs):
    path = release_dirs[fmt]
    ours, model_config, mtp_tensors = load_model(str(path), torch.float32, torch.device("cpu"))
    assert model_config.weight_format.experts == fmt
    hf = HFDeepseekV4.from_pretrained(str(path), dtype=torch.float32).float().eval()
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert set(theirs) <= set(mine)
    different = [n for n in theirs if not torch.equal(theirs[n].to(mine[n].dtype), mine[n])]
    assert not different, different[:5]
    assert (Driver(ours).step([(0, 0, IDS)])[0] - oracle_logits(hf, IDS)).abs().max().item() < ATOL
    # The MTP layer loads from the release names too, each tensor a decode of its stored bytes.
    mtp = MTPModule(model_config)
    load_mtp_weights(mtp, mtp_tensors)
    e_proj, w3, w2 = (mtp_tensors[f"mtp.0.{n}.weight"] for n in ("e_proj", "ffn.experts.6.w3", "ffn.experts.6.w2"))
    if fmt == "bf16":
        assert torch.equal(mtp.e_proj.weight, e_proj.float()) and torch.equal(mtp.block.mlp.experts.down_proj[6], w2.float())
    else:
        scale = {n: mtp_tensors[f"mtp.0.{n}.scale"] for n in ("e_proj", "ffn.experts.6.w3", "ffn.experts.6.w2")}
        assert torch.equal(mtp.e_proj.weight, dequantize_fp8_block(e_proj, scale["e_proj"]))
        expert = dequantize_fp4 if fmt == "fp4" else dequantize_fp8_block
        assert torch.equal(mtp.block.mlp.experts.gate_up_proj[6, 64:], expert(w3, scale["ffn.experts.6.w3"]))
        assert torch.equal(mtp.block.mlp.experts.down_proj[6], expert(w2, scale["ffn.experts.6.w2"]))


def test_save_pretrained_checkpoint_loads(tmp_path):
    cfg = tiny_config()
    torch.manual_seed(0)
    hf = HFDeepseekV4(cfg).eval()
    randomize(hf, 2)
    hf.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "head.weight" in names and "model.layers.1.attn.wq_a.weight" in names  # the release's names
    assert "model.layers.1.ffn.experts.3.w1.weight" in names and "model.layers.0.attn.norm.weight" in names
    ours, _, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    mine = ours.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in hf.state_dict().items())
    assert (Driver(ours).step([(0, 0, IDS)])[0] - oracle_logits(hf, IDS)).abs().max().item() < ATOL


def test_greedy_generation_with_mtp_from_release_checkpoint(release_dirs):
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (5, 27, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=128)
    path = str(release_dirs["fp4"])
    reference = [o.outputs[0].token_ids for o in LLM(path, **base).generate(prompts, params, use_tqdm=False)]
    for k in (1, 2):
        llm = LLM(path, **base, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == reference, k
        assert llm.llm_engine.spec_metrics.num_draft_tokens > 0


def test_cli_generate_on_release_checkpoint(release_dirs, capsys):
    assert main(["generate", "--model", str(release_dirs["fp4"]), "--prompt", "Flat is better than",
                 "--max-tokens", "3", "--ignore-eos", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Prompt: 'Flat is better than'" in out and "[3 tokens, length]" in out


def test_writer_tool_with_fewer_layers_and_experts(tmp_path):
    out = tmp_path / "two-layers"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tools/write_release_checkpoint.py"), "--out", str(out),
                           "--num-layers", "2", "--num-experts", "4", "--expert-dtype", "fp8", "--shard-size-mb", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}") and (out / "model.safetensors.index.json").is_file()
    ours, model_config, mtp = load_model(str(out), torch.float32, torch.device("cpu"))
    hf = model_config.hf_config
    assert hf.num_hidden_layers == 2 and hf.n_routed_experts == 4 and model_config.weight_format.experts == "fp8"
    assert hf.layer_types == ["sliding_attention", "compressed_sparse_attention"]
    assert "mtp.0.ffn.experts.3.w2.scale" in mtp and "mtp.0.ffn.experts.4.w2.weight" not in mtp
    assert Driver(ours).step([(0, 0, IDS[:20])])[0].isfinite().all()
