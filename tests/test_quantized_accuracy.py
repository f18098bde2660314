"""Accuracy of quantized execution (`quantization="auto"`) against the decoded path (`"none"`) on
release-format checkpoints, float32 on the CPU.

The held weights are exact (tests/test_quantized_execution.py), so the only difference is the
activations' e4m3 rounding (per token and 128 columns, power-of-two scales) before every FP8/FP4
GEMM. Round to nearest on 3 mantissa bits moves each element by at most half an ulp, 2^-4 of its
binade's lower bound: a relative error uniform in +-2^-4 / m (m the mantissa in [1, 2)), of RMS
at most 2^-4 / sqrt(3) = 0.036 (about 0.027 on Gaussian rows). The bounds below follow from that:

* one GEMM: its output's relative error is its input's (independent element errors average
  through the weight), so at most 2^-4 / sqrt(3); the routed experts quantize twice in sequence
  (x, then the SwiGLU output before w2) and the two add, so at most twice that;
* the logits: the model makes what it makes of those errors (its gain, and its discrete choices:
  a router's top-k that flips under the perturbation). That is measured, not assumed: the decoded
  path is run with every quantized GEMM's input perturbed by random errors of exactly e4m3
  rounding's size and distribution ("e4m3 noise"), and quantized execution must do as well as
  that noise within its sampling spread;
* greedy generation: likewise against the agreement e4m3 noise gives.

The checkpoints: the trained demo model (hidden size 192: K not a multiple of 128 in every
projection reading the hidden state) written in the release's format (FP8 linears, FP4 experts),
and the random tiny model's (whose logits have small margins and a large gain; docs/quantization.md).
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from oracle import Driver
from sparseserve import LLM, SamplingParams
from sparseserve.kernels.moe import fused_moe
from sparseserve.kernels.quant import dequant_weight
from sparseserve.kernels.quant import reference as quant_ref
from sparseserve.model.layers import fused_linear, moe
from sparseserve.model.loader import CONFIGS_DIR, load_model
from sparseserve.model.release_writer import write_release_checkpoint
from sparseserve.model.weight_bytes import held_quant
from sparseserve.quant_formats import dequantize_fp4, dequantize_fp8_block, pack_e2m1, quantize_fp4, quantize_fp8_block

CPU = torch.device("cpu")
E4M3_RMS = 2.0 ** -4 / math.sqrt(3)  # the largest RMS relative error of e4m3 rounding (module docstring)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qacc")
    return {"demo": write_release_checkpoint(root / "demo", CONFIGS_DIR / "demo", expert_dtype="fp4", weights="model"),
            "tiny": write_release_checkpoint(root / "tiny", CONFIGS_DIR / "tiny", expert_dtype="fp4", seed=1)}


def e4m3_noise(seed: int):
    """A stand-in for `act_fake_quant_ref`: x plus, per element, an error uniform within half an e4m3
    ulp of its own binade (ulp 2^(e - 4) for |x| in [2^(e-1), 2^e)): rounding's size, drawn at random."""
    gen = torch.Generator().manual_seed(seed)

    def perturb(x: torch.Tensor, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
        xf = x.float()
        _, exponent = torch.frexp(xf)
        return xf + (torch.rand(xf.shape, generator=gen) - 0.5) * torch.ldexp(torch.ones_like(xf), exponent - 4)

    return perturb


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def load_both(path):
    """The decoded and the quantized model, after checking that every held weight decodes to the
    decoded model's parameter bit for bit: the quantized model with its activations unquantized (or
    under e4m3 noise) is then the decoded path (with that noise)."""
    plain = load_model(str(path), torch.float32, CPU, quantization="none")[0]
    quant = load_model(str(path), torch.float32, CPU, quantization="auto")[0]
    params = dict(plain.named_parameters())
    held = 0
    for name, m in quant.named_modules():
        pairs = [(fused_linear.qweight_of(m), name + ".weight")]
        if getattr(m, "q_gate_up", None) is not None:
            pairs += [(m.q_gate_up, name + ".gate_up_proj"), (m.q_down, name + ".down_proj")]
        for qw, pname in pairs:
            if qw is not None:
                assert torch.equal(dequant_weight(qw), params[pname]), pname
                held += 1
    assert held
    return plain, quant


def test_demo_release_checkpoint_holds_the_demo_weights(checkpoints):
    """weights="model": each tensor is the demo's own, encoded as the release stores it."""
    demo, config, demo_mtp = load_model("demo", torch.float32, CPU)
    written, written_config, written_mtp = load_model(str(checkpoints["demo"]), torch.float32, CPU)
    fmt = written_config.weight_format
    assert (fmt.linears, fmt.experts) == ("fp8", "fp4") and written_mtp.keys() and demo_mtp.keys()
    encoded = {"fp8": lambda w: dequantize_fp8_block(*quantize_fp8_block(w)),
               "fp4": lambda w: dequantize_fp4(*quantize_fp4(w))}
    kinds = set()
    for (name, want), (_, got) in zip(demo.named_parameters(), written.named_parameters()):
        kind = held_quant(name, "auto", fmt, tuple(want.shape))
        kinds.add(kind)
        assert torch.equal(got, want if kind is None else encoded[kind](want)), name
    assert kinds == {None, "fp8", "fp4"}


def test_reencoding_decoded_weights_is_exact():
    """quantize_model re-encodes the loader's decoded values: decode(encode(decode(x))) == decode(x)
    bit for bit for any codes and power-of-two scales, also where a block's largest code is small
    (the new scale is then a power of two smaller) or subnormal, and for partial blocks."""
    gen = torch.Generator().manual_seed(0)
    n, k = 300, 200
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = torch.nan_to_num(codes.float(), nan=0.0)  # every finite e4m3 value
    caps = torch.tensor([448.0, 224.0, 13.0, 3.0, 2.0 ** -7, 0.0])[torch.randint(0, 6, (3, 2), generator=gen)]
    cap = caps.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    codes = torch.where(codes.abs() <= cap, codes, codes.sign() * cap).to(torch.float8_e4m3fn)
    scale = torch.ldexp(torch.ones(3, 2), torch.randint(-40, 10, (3, 2), generator=gen)).to(torch.float8_e8m0fnu)
    decoded = dequantize_fp8_block(codes, scale)
    again = quant_ref.quantize_fp8_block(decoded)
    assert torch.equal(dequant_weight(again), decoded)
    assert (again.scale.float() < scale.float()).any()  # the small-code blocks took smaller scales

    packed = torch.randint(0, 256, (64, 96), generator=gen, dtype=torch.int32).to(torch.uint8)
    values = quant_ref.unpack_fp4(packed)
    caps = torch.tensor([6.0, 4.0, 3.0, 1.5, 1.0, 0.5, 0.0])[torch.randint(0, 7, (64, 6), generator=gen)]
    values = torch.where(values.abs() <= caps.repeat_interleave(32, 1), values, torch.zeros_like(values))
    scale4 = torch.ldexp(torch.ones(64, 6), torch.randint(-30, 5, (64, 6), generator=gen))
    decoded4 = dequantize_fp4(pack_e2m1(values), scale4)
    again4 = quant_ref.quantize_fp4(decoded4)
    assert torch.equal(dequant_weight(again4), decoded4)
    assert (again4.scale.float() < scale4).any()


def test_each_quantized_gemm_within_the_e4m3_bound(checkpoints, monkeypatch):
    """Every quantized GEMM of a forward on the demo checkpoint against the same GEMM on the decoded
    weights (equal to the held ones, checked), for the same input."""
    model = load_both(checkpoints["demo"])[1]
    linear_errors, moe_errors = [], []
    quant_linear, fused_moe_quant = fused_linear.quant_linear, moe.fused_moe_quant

    def checked_linear(x, w, scale_fmt="ue8m0"):
        y = quant_linear(x, w, scale_fmt)
        linear_errors.append((tuple(w.shape), rel(y, x @ dequant_weight(w).t())))
        return y

    def checked_moe(x, w_gate_up, w_down, weights, ids, limit, shared=None):
        y = fused_moe_quant(x, w_gate_up, w_down, weights, ids, limit)
        want = fused_moe(x, dequant_weight(w_gate_up), dequant_weight(w_down), weights, ids, limit)
        moe_errors.append(rel(y, want))
        return fused_moe_quant(x, w_gate_up, w_down, weights, ids, limit, shared=shared)

    monkeypatch.setattr(fused_linear, "quant_linear", checked_linear)
    monkeypatch.setattr(moe, "fused_moe_quant", checked_moe)
    gen = torch.Generator().manual_seed(2)
    Driver(model).step([(0, 0, torch.randint(2, 2048, (40,), generator=gen).tolist())])
    layers = model.model_config.hf_config.num_hidden_layers
    # q_a and kv (96 and 64 rows: too few to pack), q_b (| the indexer's q_b), o_b, the shared
    # expert's gate | up and its down: 6 per layer.
    assert len(linear_errors) == 6 * layers and len(moe_errors) == layers
    assert any(k % 128 for (_, k), _ in linear_errors)  # partial 128-column groups are covered
    errors = [e for _, e in linear_errors]
    print(f"relative error per GEMM: linears {min(errors):.4f}-{max(errors):.4f}, routed experts "
          f"{min(moe_errors):.4f}-{max(moe_errors):.4f} (bounds {E4M3_RMS:.4f}, {2 * E4M3_RMS:.4f})")
    assert all(0.0 < e <= E4M3_RMS for _, e in linear_errors), linear_errors
    assert all(0.0 < e <= 2 * E4M3_RMS for e in moe_errors), moe_errors


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_logits_error_is_that_of_e4m3_rounding(checkpoints, name, monkeypatch):
    plain, quant = load_both(checkpoints[name])
    vocab = plain.model_config.hf_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    chunks = [(slot, 0, torch.randint(2, vocab, (24,), generator=gen).tolist()) for slot in range(8)]

    def logits(model):
        return torch.cat(Driver(model, num_slots=8).step(chunks))

    want = logits(plain)
    error = rel(logits(quant), want)
    noise = []
    for seed in range(4):
        monkeypatch.setattr(quant_ref, "act_fake_quant_ref", e4m3_noise(seed))
        noise.append(rel(logits(quant), want))
    print(f"{name}: logits error {error:.4f}; under e4m3 noise {statistics.mean(noise):.4f} "
          f"(min {min(noise):.4f}, max {max(noise):.4f})")
    # Measured (8 seeds, FP4 and FP8 experts): the noise's error spreads by 2-8% of its mean, and
    # quantized execution lies within 3 standard deviations of it; 1.5x the mean leaves room and
    # still fails on a real error (a coarser rounding, e5m2 for e4m3, gives 1.75x on the demo).
    assert 0.0 < error <= 1.5 * statistics.mean(noise), (error, noise)
    if name == "demo":  # the trained model: a few percent (about 0.07); the random tiny one about 0.3
        assert error < 0.15


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_greedy_agreement_is_that_of_e4m3_rounding(checkpoints, name, monkeypatch):
    """64 random prompts, 4 greedy tokens: quantized execution against the decoded path, and the
    decoded path under e4m3 noise against the unperturbed one (what rounding allows)."""
    # The held weights are the decoded ones: the noise runs below are the decoded path's.
    vocab = load_both(checkpoints[name])[0].model_config.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (64,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    base = dict(device="cpu", dtype="float32", max_model_len=64)
    plain = LLM(str(checkpoints[name]), quantization="none", **base).generate(prompts, params, use_tqdm=False)
    auto = LLM(str(checkpoints[name]), quantization="auto", **base)
    want = [o.outputs[0].token_ids for o in plain]

    def agreement(runs) -> tuple[int, int]:
        got = [o.outputs[0].token_ids for o in runs]
        return sum(a == b for a, b in zip(got, want)), sum(a[0] == b[0] for a, b in zip(got, want))

    quant_runs = auto.generate(prompts, params, use_tqdm=False)
    same, first = agreement(quant_runs)
    margins = []  # the decoded path's top-1 - top-2 logit margin where the quantized path first differs
    for p, q in zip(plain, quant_runs):
        step = next((i for i, (a, b) in enumerate(zip(p.outputs[0].token_ids, q.outputs[0].token_ids)) if a != b), None)
        if step is not None:
            top = sorted((lp.logprob for lp in p.outputs[0].logprobs[step].values()), reverse=True)
            margins.append(top[0] - top[1])
    noise = []
    for seed in range(3):
        monkeypatch.setattr(quant_ref, "act_fake_quant_ref", e4m3_noise(seed))
        noise.append(agreement(auto.generate(prompts, params, use_tqdm=False)))
    noise_same = statistics.mean(n[0] for n in noise)
    noise_first = statistics.mean(n[1] for n in noise)
    print(f"{name} greedy: {same} of 64 identical (first token {first}); under e4m3 noise {noise} (identical, first); "
          f"margins where they part: median {statistics.median(margins):.3f}, max {max(margins):.3f}")
    assert len(margins) == 64 - same
    # A count over 64 prompts spreads by about sqrt(64 p (1 - p)): 3.7 at p = 0.7, 2.4 at p = 0.9;
    # two of those below the noise's mean still fails on any real error, which leaves few prompts
    # identical. Measured (identical, first token): demo 42, 58 against 42-47, 54-57 under noise;
    # tiny 14, 39 against 7-15, 38-44. The 60 of 64 is out of e4m3 rounding's reach on both.
    assert same >= noise_same - 8 and first >= noise_first - 5, (same, first, noise)


def test_mtp_speculation_under_auto_equals_plain_decoding(checkpoints):
    """The MTP layer stays in the compute dtype; verifying its drafts on the quantized target gives
    what decoding without speculation gives (activations are quantized per token: batch-invariant)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(2, 2048, (n,), generator=gen).tolist()} for n in (5, 19)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=64, quantization="auto")
    runs = [[o.outputs[0].token_ids for o in LLM(str(checkpoints["demo"]), **base, **extra).generate(
        prompts, params, use_tqdm=False)]
        for extra in ({}, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})]
    assert runs[0] == runs[1]
