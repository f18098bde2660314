"""Packed shared-input projections (one GEMM per input, `model/layers/fused_linear.py`):
packed and unpacked models give the same logits (float32, CPU), the weights stay parameters of
their own names viewing one matrix (no memory doubled), loading before or after packing
behaves, undone packing falls back, and a step runs fewer GEMMs and no kv||gate cats."""
import copy
import logging
from collections import Counter

import pytest
import torch
from oracle import Driver, make_pair, tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sparseserve.config import ModelConfig
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from sparseserve.model.layers.attention import Attention
from sparseserve.model.layers.fused_linear import (
    PackedWeight,
    pack_projections,
    shared_input_linear,
)
from sparseserve.model.layers.moe import SharedExpert
from sparseserve.model.loader import (
    CONFIGS_DIR,
    apply_weights,
    checkpoint_files,
    load_model,
    read_tensors,
)

TINY = CONFIGS_DIR / "tiny"


def oracle_forward_logits(oracle, ids):
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].float()


def attentions(model):
    return [m for m in model.modules() if isinstance(m, Attention)]


def expected_groups(model):
    """{layer: packed inputs}: x for every layer with 2+ linears on it, q for CSA layers."""
    return {a.layer_idx: (["x", "q"] if a.is_csa else ["x"]) for a in attentions(model)}


def shared_experts(model):
    return [m for m in model.modules() if isinstance(m, SharedExpert)]


def expected_count(model):
    """Groups packed in a whole model: the attention groups and each shared expert's gate | up."""
    return sum(len(v) for v in expected_groups(model).values()) + len(shared_experts(model))


def shared_experts_packed(model):
    return all(e._packed is not None and e._packed.holds([e.gate_proj, e.up_proj]) for e in shared_experts(model))


def run_plan(model, seqs):
    """Chunked prefill then token-by-token decode of several sequences; per-sequence logits."""
    driver = Driver(model)
    got = [[] for _ in seqs]
    pos = [0] * len(seqs)
    chunk = {0: 11, 1: 1, 2: 30}
    while any(p < len(s) for p, s in zip(pos, seqs)):
        step = []
        for i, s in enumerate(seqs):
            if pos[i] < len(s):
                n = chunk[i] if pos[i] < 20 else 1
                step.append((i, pos[i], s[pos[i]:pos[i] + n]))
                pos[i] += len(step[-1][2])
        for (slot, _, _), logits in zip(step, driver.step(step)):
            got[slot].append(logits)
    return [torch.cat(g) for g in got]


def test_packed_and_unpacked_models_give_the_same_logits():
    cfg = tiny_config()
    oracle, plain = make_pair(cfg, seed=7)
    packed = copy.deepcopy(plain)
    assert pack_projections(packed) == expected_count(packed) == 6 + 4
    assert {a.layer_idx: a.packed_groups() for a in attentions(packed)} == expected_groups(packed)
    assert shared_experts_packed(packed)
    assert all(a.packed_groups() == [] for a in attentions(plain)) and not any(e._packed for e in shared_experts(plain))
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (45, 26, 70)]
    want = run_plan(plain, seqs)
    got = run_plan(packed, seqs)
    for g, w, s in zip(got, want, seqs):
        assert (g - w).abs().max().item() < 1e-5
        assert (g - oracle_forward_logits(oracle, s)).abs().max().item() < 1e-4


def test_packed_weights_are_views_of_one_matrix_under_their_own_names():
    _, model = make_pair(tiny_config(), seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    pack_projections(model)
    after = model.state_dict()
    assert list(after) == list(before) and [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn = attentions(model)[1]  # CSA
    assert attn.is_csa
    idx = attn.compressor.indexer
    x_linears = [attn.q_a_proj, attn.kv_proj, attn.compressor.kv_proj, attn.compressor.gate_proj,
                 idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
    matrix = attn._packed["x"].weight
    assert matrix.shape[0] == sum(lin.out_features for lin in x_linears)
    row = 0
    for lin in x_linears:
        assert isinstance(lin.weight, nn.Parameter) and lin.weight.is_contiguous()
        assert lin.weight.data_ptr() == matrix[row].data_ptr()
        row += lin.out_features
    # No memory doubled: every parameter byte lives in exactly one storage.
    storages = {}
    for p in model.parameters():
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    # Packing again changes nothing.
    assert pack_projections(model) == 0 and attn._packed["x"].weight is matrix


def test_loading_after_packing_writes_into_the_packed_matrix():
    cfg = tiny_config()
    _, source = make_pair(cfg, seed=2)
    _, model = make_pair(cfg, seed=3)
    pack_projections(model)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in m for m in missing)
    assert {a.layer_idx: a.packed_groups() for a in attentions(model)} == expected_groups(model)
    ids = list(range(3, 50))
    assert (Driver(model).step([(0, 0, ids)])[0] - Driver(source).step([(0, 0, ids)])[0]).abs().max() < 1e-5


def test_checkpoint_loads_packed_and_reloads_into_a_packed_model():
    from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

    model = load_model(str(TINY), torch.float32, torch.device("cpu"))[0]
    assert {a.layer_idx: a.packed_groups() for a in attentions(model)} == expected_groups(model)
    oracle = HFDeepseekV4.from_pretrained(str(TINY), dtype=torch.float32).eval()
    ids = list(range(7, 60))
    ref = oracle_forward_logits(oracle, ids)
    first = Driver(model).step([(0, 0, ids)])[0]
    assert (first - ref).abs().max().item() < 1e-4
    # Scramble the packed weights in place, then load the checkpoint again into the packed model.
    with torch.no_grad():
        for a in attentions(model):
            for packed in a._packed.values():
                packed.weight.normal_()
    assert (Driver(model).step([(0, 0, ids)])[0] - ref).abs().max().item() > 1e-2
    apply_weights(model, read_tensors(checkpoint_files(TINY)))
    assert {a.layer_idx: a.packed_groups() for a in attentions(model)} == expected_groups(model)
    assert torch.equal(Driver(model).step([(0, 0, ids)])[0], first)


def test_dummy_weights_are_packed():
    model = load_model(str(TINY), torch.float32, torch.device("cpu"), load_format="dummy")[0]
    assert {a.layer_idx: a.packed_groups() for a in attentions(model)} == expected_groups(model)
    assert shared_experts_packed(model)


def test_undone_packing_falls_back_and_can_be_packed_again(caplog):
    cfg = tiny_config()
    _, plain = make_pair(cfg, seed=4)
    packed = copy.deepcopy(plain)
    pack_projections(packed)
    packed.double()  # replaces every weight: the packed matrices no longer hold them
    plain.double()
    ids = list(range(9, 40))
    driver_kw = {"dtype": torch.float64}
    logger = logging.getLogger("sparseserve.model.layers.attention")
    logger.addHandler(caplog.handler)  # other tests may stop "sparseserve" logs from propagating
    try:
        with caplog.at_level("WARNING", logger=logger.name):
            got = Driver(packed, **driver_kw).step([(0, 0, ids)])[0]
    finally:
        logger.removeHandler(caplog.handler)
    assert "no longer hold the weights" in caplog.text
    assert all(a.packed_groups() == [] and not a._packed for a in attentions(packed))
    want = Driver(plain, **driver_kw).step([(0, 0, ids)])[0]
    assert torch.equal(got, want)
    assert pack_projections(packed) == expected_count(packed)
    again = Driver(packed, **driver_kw).step([(0, 0, ids)])[0]
    assert (again - want).abs().max().item() < 1e-10


def test_a_model_that_cannot_pack_is_left_alone():
    lins = [nn.Linear(8, 4, bias=False), nn.Linear(8, 3, bias=True)]
    assert PackedWeight.pack(lins) is None
    lins = [nn.Linear(8, 4, bias=False), nn.Linear(6, 3, bias=False)]
    assert PackedWeight.pack(lins) is None
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(ModelConfig(tiny_config()))
    assert pack_projections(model) == 0


def test_gradients_reach_packed_weights():
    torch.manual_seed(0)
    lins = [nn.Linear(8, n, bias=False) for n in (4, 3, 5)]
    ref = copy.deepcopy(lins)
    packed = PackedWeight.pack(lins)
    x = torch.randn(6, 8)
    spans = [(0, 1), (1, 3)]
    with torch.no_grad():
        fused = shared_input_linear(x, lins, packed, spans)
        plain = shared_input_linear(x, ref, None, spans)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fused, plain))
    # Under autograd the linears run one by one, so each weight gets its gradient.
    sum(o.square().sum() for o in shared_input_linear(x, lins, packed, spans)).backward()
    sum(o.square().sum() for o in shared_input_linear(x, ref, None, spans)).backward()
    for a, b in zip(lins, ref):
        assert torch.allclose(a.weight.grad, b.weight.grad, atol=1e-6)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_packed_step_runs_one_gemm_per_shared_input_and_no_kv_gate_cats():
    cfg = tiny_config()
    _, plain = make_pair(cfg, seed=5)
    packed = copy.deepcopy(plain)
    pack_projections(packed)
    counts = []
    for model in (plain, packed):
        driver = Driver(model)
        driver.step([(0, 0, list(range(3, 20)))])
        with OpCounter() as c:
            driver.step([(0, 17, [5])])
        counts.append(c.counts)
    gemms = [c["mm"] + c["addmm"] for c in counts]
    # Layers: sliding (x: 2 linears), CSA (x: 7, q: 2), HCA (x: 4), CSA (x: 7, q: 2); and in each
    # of the 4 layers the shared expert's gate and up.
    assert gemms[0] - gemms[1] == (2 - 1) + (7 - 1) + (2 - 1) + (4 - 1) + (7 - 1) + (2 - 1) + 4 * (2 - 1)
    # kv||gate staged straight from the GEMM output: no cat per compressor (2 per CSA, 1 per HCA),
    # nor per shared expert's gate | up (4).
    assert counts[0]["cat"] - counts[1]["cat"] == 5 + 4
    assert counts[1]["index_select"] == counts[0]["index_select"]


def packed_vs_unpacked(monkeypatch, model, device, dtype, num_blocks, block_size, length, decode):
    """Logits of an unpacked and a packed copy of `model` (dummy weights) over a prefill of
    `length - decode` tokens and `decode` single-token steps."""
    from sparseserve.model import loader

    monkeypatch.setattr(loader, "pack_projections", lambda m: 0)
    plain = load_model(model, dtype, torch.device(device), load_format="dummy")[0]
    monkeypatch.undo()
    packed = copy.deepcopy(plain)
    assert pack_projections(packed) == expected_count(packed)
    vocab = plain.model_config.hf_config.vocab_size
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for net in (plain, packed):
        driver = Driver(net, num_slots=2, num_blocks=num_blocks, block_size=block_size, max_step_tokens=length,
                        device=device, dtype=dtype)
        logits = [driver.step([(0, 0, ids[:length - decode])])[0]]
        for p in range(length - decode, length):
            logits.append(driver.step([(0, p, [ids[p]])])[0])
        outs.append(torch.cat(logits))
    return outs


def test_packed_equals_unpacked_through_the_loader(monkeypatch):
    plain, packed = packed_vs_unpacked(monkeypatch, str(TINY), "cpu", torch.float32, 16, 16, 60, 5)
    assert (plain - packed).abs().max().item() < 1e-5


@pytest.mark.gpu
def test_packed_equals_unpacked_on_gpu_at_flash_shapes(monkeypatch):
    """bf16, V4-Flash layer shapes: a prefill (strided views of the GEMM outputs) and decode steps."""
    plain, packed = packed_vs_unpacked(monkeypatch, "v4-flash-2l16e", "cuda", torch.bfloat16, 8, 128, 300, 10)
    rel = float((packed - plain).norm() / plain.norm())
    agree = float((packed.argmax(-1) == plain.argmax(-1)).float().mean())
    print(f"packed vs unpacked: rel {rel:.2e}, top-1 agreement {agree:.4f}")
    assert rel < 0.02 and agree >= 0.97


@pytest.mark.parametrize("quantized", [False, True])
def test_rows_of_a_pack_compute_those_linears_alone(quantized):
    """`PackedWeight.rows(i, j)`: a view of linears i..j-1's rows (and block scales), whose GEMM gives
    those linears' columns of the whole group's GEMM, bit for bit (the attention's state-only
    projections use it)."""
    from sparseserve.kernels.quant import reference as quant_ref

    gen = torch.Generator().manual_seed(5)
    rows = (128, 256, 128, 384)
    linears = [nn.Linear(256, r, bias=False) for r in rows]
    for lin in linears:
        w = torch.randn(lin.out_features, 256, generator=gen) * 0.05
        if quantized:
            lin.qweight = quant_ref.quantize_fp8_block(w)
            lin.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            lin.weight = nn.Parameter(w, requires_grad=False)
    packed = PackedWeight.pack(linears)
    sub = packed.rows(1, 3)
    assert sub.bounds == [0, 256, 384]
    data = sub.quant.data if quantized else sub.weight
    whole = packed.quant.data if quantized else packed.weight
    assert data.data_ptr() == whole[128:].data_ptr() and data.shape[0] == 384
    x = torch.randn(7, 256, generator=gen)
    with torch.no_grad():
        want = shared_input_linear(x, linears, packed, [(1, 2), (2, 3)])
        got = shared_input_linear(x, linears[1:3], sub, [(0, 1), (1, 2)])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [t.shape[-1] for t in got] == [256, 128]
