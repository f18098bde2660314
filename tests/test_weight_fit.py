"""Weight bytes per GPU as held, the fit check before allocation, and the 43-layer V4-Flash presets.

The byte counts are checked against what the loader really allocates (TP=1), against shard sizes
computed by hand from the config (TP / EP = 2, 4, 8), and for quantized formats block by block."""
import json

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import ModelConfig
from sparseserve.engine import llm_engine
from sparseserve.entrypoints.cli import main
from sparseserve.errors import ConfigError, ModelTooLargeError
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from sparseserve.model.fit_check import check_weights_fit
from sparseserve.model.loader import load_hf_config, load_model
from sparseserve.model.meta_model import weight_plan
from sparseserve.model.mtp import MTPModule
from sparseserve.model.presets import CONFIGS_DIR, PRESETS, RELEASE_CHECKPOINT, resolve_model_dir
from sparseserve.model.weight_bytes import (
    FP4_E2M1, FP8_BLOCK, GiB, KEEP_FP32, ParallelLayout, TensorSpec, WeightPlan, checkpoint_format,
    checkpoint_policy, count_bytes, held_dtype, is_routed_expert,
)

TINY = CONFIGS_DIR / "tiny"
H200_FREE = 139 * GiB
PRESETS_43 = ("v4-flash-43l8e", "v4-flash-43l16e", "v4-flash-43l8e-fp8", "v4-flash-43l16e-fp8")
# Tiny widths on the 43-layer pattern (16 indexer heads: fewer make exact-zero score ties common).
SMALL_WIDTHS = {"hidden_size": 32, "head_dim": 32, "qk_rope_head_dim": 8, "num_attention_heads": 4, "o_groups": 2,
                "o_lora_rank": 16, "q_lora_rank": 16, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 4,
                "moe_intermediate_size": 16, "vocab_size": 256, "num_experts_per_tok": 2, "sliding_window": 8}


def model_config(name: str, extra: dict | None = None) -> ModelConfig:
    model_dir, overrides = resolve_model_dir(name)
    return ModelConfig(load_hf_config(model_dir, {**overrides, **(extra or {})}))


def direct_count(modules, dtype) -> int:
    """Every parameter at the dtype the loader holds it in, every buffer at its own."""
    total = 0
    for module in modules:
        total += sum(p.numel() * held_dtype(n, dtype).itemsize for n, p in module.named_parameters())
        total += sum(b.numel() * b.element_size() for b in module.buffers())
    return total


def real_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# ---- presets ----

def test_43_layer_presets_follow_the_release_layer_pattern():
    raw = json.loads((CONFIGS_DIR / "deepseek-v4-flash" / "config.json").read_text())
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    release = [kinds[r] for r in raw["compress_ratios"][:raw["num_hidden_layers"]]]
    assert release[:3] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention"]
    for name in ("v4-flash-2l16e", "v4-flash-4l64e"):
        assert checkpoint_format(model_config(name)).describe() == "bf16"
    for name in PRESETS_43:
        hf = model_config(name).hf_config
        assert hf.num_hidden_layers == 43 and hf.layer_types == release, name
        assert hf.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 40
        assert hf.n_routed_experts == (8 if "8e" in name else 16)
        fmt = checkpoint_format(model_config(name))
        if name.endswith("-fp8"):
            assert (fmt.linears, fmt.experts, fmt.block, fmt.scale_bytes) == ("fp8", "fp4", (128, 128), 1)
        else:
            assert (fmt.linears, fmt.experts) == ("bf16", "bf16")


# ---- byte arithmetic ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tp1_bytes_equal_a_direct_count_of_the_meta_model(dtype):
    config = model_config("v4-flash-43l16e")
    with torch.device("meta"):
        net, mtp = DeepseekV4ForCausalLM(config), MTPModule(config)
    plan = weight_plan(config, dtype, include_mtp=True)
    weights = plan.at()
    assert weights.per_gpu_bytes == weights.total_bytes == direct_count([net, mtp], dtype)
    assert weights.per_gpu_by_part["MTP layer"] == direct_count([mtp], dtype)
    assert weight_plan(config, dtype).at().total_bytes == direct_count([net], dtype)


def test_bytes_as_held_equal_what_the_loader_allocates():
    """bf16 on the CPU: the loader allocates the held dtypes directly (float32 islands only)."""
    net, config, _ = load_model(str(TINY), torch.bfloat16, torch.device("cpu"), load_format="dummy")
    for name, p in net.named_parameters():
        assert p.dtype == (torch.float32 if any(k in name for k in KEEP_FP32) else torch.bfloat16), name
    assert weight_plan(config, torch.bfloat16).at().per_gpu_bytes == real_bytes(net)


def hand_sharded_bytes(hf) -> int:
    """bf16 bytes of the tensors split over tensor-parallel ranks, from the config alone (the
    embedding and the indexers are replicated)."""
    d, heads, hd = hf.hidden_size, hf.num_attention_heads, hf.head_dim
    attention = (heads * hd * hf.q_lora_rank  # q_b
                 + hf.o_groups * hf.o_lora_rank * (heads * hd // hf.o_groups)  # o_a, grouped
                 + d * hf.o_groups * hf.o_lora_rank) * 2 + heads * 4  # o_b; sinks in float32
    shared = 3 * hf.moe_intermediate_size * hf.n_shared_experts * d * 2
    experts = hf.n_routed_experts * 3 * hf.moe_intermediate_size * d * 2
    vocab = hf.vocab_size * d * 2  # the LM head
    return vocab + hf.num_hidden_layers * (attention + shared + experts)


@pytest.mark.parametrize("ways", [2, 4, 8])
@pytest.mark.parametrize("ep", [False, True])
def test_bytes_per_gpu_match_hand_computed_shards(ways, ep):
    config = model_config("deepseek-v4-flash")
    plan = weight_plan(config, torch.bfloat16)
    whole = plan.at().total_bytes
    sharded = hand_sharded_bytes(config.hf_config)
    assert sharded % ways == 0
    weights = plan.at(ParallelLayout(ways, ep))
    assert weights.total_bytes == whole
    assert weights.per_gpu_bytes == whole - sharded + sharded // ways
    hf = config.hf_config
    expert_share = hf.num_hidden_layers * hf.n_routed_experts * 3 * hf.moe_intermediate_size * hf.hidden_size * 2
    assert weights.per_gpu_by_part["routed experts"] == expert_share // ways


def test_quantized_formats_count_values_and_block_scales_per_shard():
    o_b = TensorSpec("model.layers.0.self_attn.o_b_proj.weight", (4096, 8192), torch.bfloat16, True)
    down = TensorSpec("model.layers.0.mlp.experts.down_proj", (8, 4096, 2048), torch.bfloat16, True)
    bias = TensorSpec("model.layers.0.mlp.gate.e_score_correction_bias", (8,), torch.float32, False)

    def policy(name, shape):
        return FP4_E2M1 if is_routed_expert(name) else FP8_BLOCK

    def held(layout):
        return count_bytes([o_b, down, bias], policy, layout, "fp8/fp4").per_gpu_bytes

    # FP8: a byte per value + a 4-byte scale per 128x128 block; FP4: half a byte + a byte per 32 values.
    assert held(ParallelLayout()) == (4096 * 8192 + 32 * 64 * 4) + (8 * 4096 * 2048 // 2 + 8 * 4096 * 64) + 32
    assert held(ParallelLayout(4)) == (4096 * 2048 + 32 * 16 * 4) + (8 * 4096 * 512 // 2 + 8 * 4096 * 16) + 32
    assert held(ParallelLayout(4, True)) == (4096 * 2048 + 32 * 16 * 4) + (2 * 4096 * 2048 // 2 + 2 * 4096 * 64) + 32
    assert FP8_BLOCK.nbytes((100, 300)) == 100 * 300 + 1 * 3 * 4  # partial blocks count whole


def test_release_checkpoint_size_is_about_the_published_one():
    config = model_config("deepseek-v4-flash", RELEASE_CHECKPOINT)
    size = weight_plan(config, torch.bfloat16, include_mtp=True).checkpoint_bytes()
    assert 145 * GiB < size < 155 * GiB  # the release's files, MTP layer included: about 160 GB (149 GiB)


# ---- the fit check ----

def test_release_v4_flash_does_not_fit_one_h200_and_the_error_says_what_would():
    plan = weight_plan(model_config("deepseek-v4-flash", RELEASE_CHECKPOINT), torch.bfloat16, include_mtp=True)
    need = plan.at().per_gpu_bytes
    with pytest.raises(ModelTooLargeError) as info:
        check_weights_fit(plan, ParallelLayout(), H200_FREE, "deepseek-v4-flash", "cuda:0")
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert f"model 'deepseek-v4-flash' needs {need / GiB:.2f} GiB per GPU" in message
    assert "cuda:0 has 139.00 GiB free" in message and "bfloat16" in message and "fp4 routed experts" in message
    assert plan.at(ParallelLayout(2)).per_gpu_bytes > H200_FREE >= plan.at(ParallelLayout(4)).per_gpu_bytes
    assert "tensor_parallel_size=4, with or without enable_expert_parallel" in message
    assert "set tensor_parallel_size" in message
    # The same weights fit with room to spare, and an unknown free memory is not checked.
    assert check_weights_fit(plan, ParallelLayout(8, True), H200_FREE, "x").per_gpu_bytes < H200_FREE
    assert check_weights_fit(plan, ParallelLayout(), None, "x").per_gpu_bytes == need


def test_held_as_released_it_still_needs_two_h200s():
    """With FP8/FP4 kept on the GPU (a held policy the next step will pass), V4-Flash needs TP/EP=2."""
    config = model_config("deepseek-v4-flash", RELEASE_CHECKPOINT)
    base = weight_plan(config, torch.bfloat16)
    plan = WeightPlan(base.specs, checkpoint_policy(base.checkpoint), "fp8 linears, fp4 experts", config.hf_config,
                      base.checkpoint)
    with pytest.raises(ModelTooLargeError, match="tensor_parallel_size=2"):
        check_weights_fit(plan, ParallelLayout(), H200_FREE, "deepseek-v4-flash")


def test_a_model_no_even_split_fits_says_so():
    plan = weight_plan(model_config("deepseek-v4-pro"), torch.bfloat16)
    with pytest.raises(ModelTooLargeError, match="no even split fits: the largest, tensor_parallel_size=16"):
        check_weights_fit(plan, ParallelLayout(), H200_FREE, "deepseek-v4-pro")


def test_43_layer_presets_fit_one_h200_in_bf16():
    for name in PRESETS_43:
        plan = weight_plan(model_config(name), torch.bfloat16, include_mtp=True)
        assert check_weights_fit(plan, ParallelLayout(), H200_FREE, name).per_gpu_bytes < 60 * GiB


def test_engine_checks_before_loading(monkeypatch):
    monkeypatch.setattr(llm_engine, "available_memory_bytes", lambda device: 1024**2)

    def never(*args, **kwargs):
        raise AssertionError("load_model ran although the weights cannot fit")
    monkeypatch.setattr(llm_engine, "load_model", never)
    message = r"model '.*tiny' needs \d+\.\d\d MiB per GPU .* but cpu has 1\.00 MiB free"
    with pytest.raises(ModelTooLargeError, match=message):
        LLM(str(TINY), device="cpu", dtype="float32", max_model_len=64)


def test_start_up_report_gives_the_weights_as_held_with_mtp(caplog):
    logger = llm_engine.logger
    logger.addHandler(caplog.handler)  # the package logger does not propagate
    try:
        with caplog.at_level("INFO", logger=logger.name):
            llm = LLM(str(TINY), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    finally:
        logger.removeHandler(caplog.handler)
    engine = llm.llm_engine
    assert engine.weight_bytes.per_gpu_bytes == real_bytes(engine.model) + real_bytes(engine.runner.mtp)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights as held")]
    assert lines == [engine.weight_plan.report(ParallelLayout())]
    assert "per GPU with tensor_parallel_size=1" in lines[0] and "MTP layer" in lines[0]


# ---- kv-plan ----

def test_kv_plan_reports_a_43_layer_preset(capsys):
    assert main(["kv-plan", "--model", "v4-flash-43l8e-fp8", "--max-model-len", "65536"]) == 0
    out = capsys.readouterr().out
    plan = weight_plan(model_config("v4-flash-43l8e-fp8"), torch.bfloat16)
    assert out.startswith("model: v4-flash-43l8e-fp8 (43 layers)")
    assert plan.report(ParallelLayout()) in out
    assert "fp8 e4m3 linears (ue8m0 scale per 128x128), fp4 routed experts" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ")}
    assert (rows["csa"], rows["hca"], rows["sliding"]) == ("21", "20", "2")
    assert f"tensor_parallel_size 2: {plan.at(ParallelLayout(2)).per_gpu_bytes / GiB:.2f}" in out


def test_kv_plan_full_flash_per_gpu_for_a_layout_with_mtp(capsys):
    assert main(["kv-plan", "--model", "deepseek-v4-flash", "--max-model-len", "1048576", "--tensor-parallel-size",
                 "4", "--enable-expert-parallel", "--num-speculative-tokens", "1"]) == 0
    out = capsys.readouterr().out
    plan = weight_plan(model_config("deepseek-v4-flash"), torch.bfloat16, include_mtp=True)
    per_gpu = plan.at(ParallelLayout(4, True)).per_gpu_bytes
    assert f"{per_gpu / GiB:.2f} GiB per GPU with tensor_parallel_size=4, enable_expert_parallel=True" in out
    assert "MTP layer" in out


# ---- the 43-layer pattern end to end ----

def test_a_small_43_layer_model_generates_as_the_oracle():
    """The release's 43-layer pattern at tiny widths: the engine's greedy tokens equal transformers'."""
    from sparseserve.benchmarks.hf_baseline import load_hf_model

    assert "v4-flash-43l8e" in PRESETS
    llm = LLM("v4-flash-43l8e", load_format="dummy", device="cpu", dtype="float32", hf_overrides=SMALL_WIDTHS,
              max_model_len=256, max_num_seqs=2)
    assert len(llm.llm_engine.model.model.layers) == 43
    prompt = [(7 * i) % 250 + 2 for i in range(140)]  # past an HCA window (128) and the CSA top-k (4 of 35)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    oracle = load_hf_model("v4-flash-43l8e", torch.float32, torch.device("cpu"), "dummy", SMALL_WIDTHS, 0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            seq.append(int(oracle(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out == seq[len(prompt):]
