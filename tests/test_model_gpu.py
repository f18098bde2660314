"""On the GPU (bf16): parity with the oracle at V4-Flash layer shapes (2 layers: CSA + HCA,
16 experts, shared dummy weights).

Tolerance: bf16 rounding differs between the implementations (the oracle even takes its
attention softmax in bf16) and can flip near-tied expert or indexer picks, so both bf16
runs are measured against the oracle in float32 on the same weights: ours must be at least
about as close to that truth as the oracle's own bf16 run."""
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
    """Every parameter and the routing buffers random (norms near 1); rope buffers untouched. `model`:
    the transformers oracle or ours."""
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
            hf = model.config if hasattr(model, "config") else model.model_config.hf_config
            n_exp = hf.n_routed_experts
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
        ref_bf16 = oracle(torch.tensor([ids], device="cuda")).logits[0].float()
        oracle.float()
        truth = oracle(torch.tensor([ids], device="cuda")).logits[0].float()
    del oracle
    driver = Driver(ours, num_slots=2, num_blocks=length // 128 + 2, block_size=128, max_step_tokens=length,
                    device="cuda", dtype=torch.bfloat16)
    got = driver.step([(0, 0, ids)])[0]

    def rel(x):
        return float((x - truth).norm() / truth.norm())

    def agree(x):
        return float((x.argmax(-1) == truth.argmax(-1)).float().mean())

    print(f"length {length}: vs fp32 oracle: ours bf16 rel {rel(got):.4f} top-1 {agree(got):.4f}; "
          f"oracle bf16 rel {rel(ref_bf16):.4f} top-1 {agree(ref_bf16):.4f}; "
          f"ours vs oracle bf16 rel {float((got - ref_bf16).norm() / ref_bf16.norm()):.4f}")
    assert rel(got) <= 1.25 * rel(ref_bf16) + 0.005
    assert agree(got) >= agree(ref_bf16) - 0.02
