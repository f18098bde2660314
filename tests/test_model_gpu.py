"""On the GPU (bf16): parity with the oracle at V4-Flash layer shapes (2 layers: CSA + HCA,
16 experts, shared dummy weights). bf16 rounding differs between the implementations (and can
flip near-tied indexer picks), so the check is a relative logit error and top-1 agreement."""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from oracle import Driver
from sparseserve.config import ModelConfig
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from sparseserve.model.loader import PRESETS, load_hf_config, resolve_model_dir

pytestmark = pytest.mark.gpu


@torch.no_grad()
def randomize_on_device(model, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device="cuda"))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.5)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            n_exp = model.config.n_routed_experts
            first = torch.randint(0, n_exp, (b.shape[0], 1), generator=gen, device="cuda")
            b.copy_((first + torch.arange(b.shape[1], device="cuda")) % n_exp)
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.01 * torch.randn(b.shape, generator=gen, device="cuda"))


@pytest.mark.parametrize("length", [700, 2600])
def test_flash_shapes_bf16_parity(length):
    assert "v4-flash-2l16e" in PRESETS
    model_dir, overrides = resolve_model_dir("v4-flash-2l16e")
    cfg = load_hf_config(model_dir, overrides)
    with torch.device("cuda"):
        oracle = HFDeepseekV4(cfg).to(torch.bfloat16).eval()
    randomize_on_device(oracle, 0)
    ours = DeepseekV4ForCausalLM(ModelConfig(cfg, dtype=torch.bfloat16)).cuda()
    ours.load_state_dict(oracle.state_dict(), strict=False)
    ours.to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = oracle(torch.tensor([ids], device="cuda")).logits[0].float()
    driver = Driver(ours, num_slots=2, num_blocks=length // 128 + 2, block_size=128, max_step_tokens=length,
                    device="cuda", dtype=torch.bfloat16)
    got = driver.step([(0, 0, ids)])[0]
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"length {length}: relative logit error {rel:.4f}, top-1 agreement {agree:.4f}")
    assert rel < 0.03
    assert agree > 0.95
