"""The engine's MTP layer equals an independent implementation built from `transformers`
modules (the one `tools/train_tiny.py` trains), on the trained demo checkpoint, float32."""
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from oracle import Driver
from sparseserve.model.batch import SequenceChunk, build_batch
from sparseserve.model.loader import CONFIGS_DIR, load_model
from sparseserve.model.mtp import MTPModule, load_mtp_weights
from sparseserve.model.state import ModelState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from train_tiny import MTPHead, export_mtp  # noqa: E402

DEMO = CONFIGS_DIR / "demo"


@torch.no_grad()
def test_mtp_logits_match_the_transformers_built_head():
    tensors = load_file(str(DEMO / "model.safetensors"))
    mtp_tensors = {k: v.float() for k, v in tensors.items() if k.startswith("mtp.")}
    ids = list(range(40, 140))

    oracle = HFDeepseekV4.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    head = MTPHead(oracle.config).eval()
    # export_mtp walks the head's state dict in order, so the two name lists line up.
    state = {name: mtp_tensors[ckpt] for name, ckpt in zip(head.state_dict(), export_mtp(head))}
    head.load_state_dict(state, strict=True)
    captured = {}
    oracle.model.layers[-1].register_forward_hook(lambda _m, _i, o: captured.__setitem__("streams", o))
    oracle(torch.tensor([ids]), use_cache=False)
    ref = head(oracle, captured["streams"][:, :-1], torch.tensor([ids[1:]]))[0].float()  # predicts t + 2

    model, mc, mtp_raw = load_model(str(DEMO), torch.float32, torch.device("cpu"))
    mtp = MTPModule(mc).float()
    load_mtp_weights(mtp, {k: v.float() for k, v in mtp_raw.items()})
    driver = Driver(model)
    chunk = SequenceChunk(0, 0, ids, driver._blocks_for(0, len(ids)), "none")
    streams = model(build_batch([chunk], mc.rates), driver.state)
    mtp_state = ModelState(mtp.config, driver.layout, torch.device("cpu"), torch.float32)
    mtp_batch = build_batch([SequenceChunk(0, 0, ids[1:], [], "none")], mtp.config.rates)
    got = mtp.compute_logits(mtp(mtp_batch, streams[:-1], mtp_state, model), model)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    print(f"max |logit diff| {err:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert err < 1e-4, err
