"""Checkpoint loading: the tiny checkpoint, a sharded copy, and clear errors for bad files."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from oracle import Driver
from sparseserve.errors import ModelTooLargeError
from sparseserve.model.loader import CONFIGS_DIR, CheckpointError, load_model

TINY = CONFIGS_DIR / "tiny"


def logits_of(model, ids):
    return Driver(model).step([(0, 0, ids)])[0]


def load(path, **kw):
    return load_model(str(path), torch.float32, torch.device("cpu"), **kw)[0]


def test_tiny_checkpoint_matches_oracle_from_pretrained():
    ours = load(TINY)
    oracle = HFDeepseekV4.from_pretrained(str(TINY), dtype=torch.float32).eval()
    ids = list(range(3, 60))
    with torch.no_grad():
        ref = oracle(torch.tensor([ids])).logits[0].float()
    assert (logits_of(ours, ids) - ref).abs().max().item() < 1e-4


def test_sharded_copy_gives_identical_logits(tmp_path):
    tensors = load_file(str(TINY / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (("model-00001-of-00002.safetensors", names[:half]),
                        ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: tensors[n] for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    ids = list(range(5, 40))
    assert torch.equal(logits_of(load(TINY), ids), logits_of(load(tmp_path), ids))


def copy_tiny(tmp_path):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(TINY / f, tmp_path / f)
    return tmp_path


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = copy_tiny(tmp_path) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load(tmp_path)


def test_corrupted_header_is_a_clear_error(tmp_path):
    path = copy_tiny(tmp_path) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    copy_tiny(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="indexer.q_b_proj.weight"):
        load(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    copy_tiny(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.sinks"] = torch.zeros(7)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.sinks has shape \(7,\)"):
        load(tmp_path)


def test_unexpected_tensor_is_named_but_mtp_tensors_are_kept(tmp_path):
    copy_tiny(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("mtp.0.") for k in tensors)  # the tiny checkpoint ships its MTP layer
    tensors["mtp.0.extra.weight"] = torch.randn(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, _, mtp = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "mtp.0.extra.weight" in mtp and all(k.startswith("mtp.") for k in mtp)
    tensors["model.layers.0.bogus"] = torch.randn(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.bogus"):
        load(tmp_path)


def test_missing_files_and_unknown_model_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load(tmp_path)
    with pytest.raises(CheckpointError, match="neither a directory nor a preset"):
        load(tmp_path / "nope")


def test_dummy_weights_have_the_real_shapes_and_no_zeros():
    model, cfg, _ = load_model(str(TINY), torch.float32, torch.device("cpu"), load_format="dummy")
    for name, p in model.named_parameters():
        assert p.abs().sum() > 0, name
    tid = model.model.layers[0].mlp.gate.tid2eid
    assert int(tid.max()) < cfg.hf_config.n_routed_experts
    assert logits_of(model, [1, 2, 3]).isfinite().all()


def test_weights_that_cannot_fit_fail_before_allocating():
    with pytest.raises(ModelTooLargeError, match="needs .* GiB per GPU for its weights as held"):
        load_model("deepseek-v4-pro", torch.float32, torch.device("cpu"), load_format="dummy")
