"""The state-only forward (`MTPModule.forward_state`, `DecoderLayer.forward_state`) leaves the layer's
state bit-equal to the full forward's (CPU, float32), over prefill and decode steps of several
sequences that cross window and compress boundaries and re-run positions; for the MTP layer
(sliding window) and for CSA and HCA decoder layers (compressor, indexer keys), packed and unpacked
projections, bf16 and FP8 KV rows. And an engine whose steps propose nothing never runs the MTP
layer's attention or MoE, yet drafts as a full catch-up would."""
import copy

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.model.batch import SequenceChunk, build_batch
from sparseserve.model.layers.attention import Attention
from sparseserve.model.loader import CONFIGS_DIR, load_model
from sparseserve.model.mtp import load_mtp
from sparseserve.model.state import ModelState, StateLayout
from sparseserve.model.step_context import build_step_context
from sparseserve.worker.cuda_graph import decode_batch

TINY = str(CONFIGS_DIR / "tiny")
CPU = torch.device("cpu")
BLOCK, BLOCKS_PER_SEQ = 16, 6  # 96 positions a sequence
# (slot, start, tokens) per step: prompts that cross the window (16) and both compress rates (4, 16),
# decode and verify-like steps, a re-run of rejected positions (slot 0 at 41 again), a chunk of one
# sequence next to decodes of others.
STEPS = [
    [(0, 0, 37), (1, 0, 5)],
    [(0, 37, 1), (1, 5, 20), (2, 0, 3)],
    [(0, 38, 3), (1, 25, 1), (2, 3, 14)],
    [(0, 41, 3), (1, 26, 3), (2, 17, 1)],
    [(0, 41, 1), (1, 29, 1), (2, 18, 1)],
    [(0, 42, 1), (1, 30, 1), (2, 19, 1)],
    [(0, 43, 22), (1, 31, 2)],
    [(0, 65, 1), (1, 33, 1), (2, 20, 1)],
]


def layout(num_slots: int = 4, spec: int = 3) -> StateLayout:
    return StateLayout(num_blocks=num_slots * BLOCKS_PER_SEQ, block_size=BLOCK, num_slots=num_slots,
                       max_step_tokens=64, sliding_window=16, num_speculative_tokens=spec)


def step_batch(step, rates, gen, decode_form: bool):
    chunks = [SequenceChunk(slot, start, torch.randint(2, 512, (n,), generator=gen).tolist(),
                            list(range(slot * BLOCKS_PER_SEQ, (slot + 1) * BLOCKS_PER_SEQ)), "none")
              for slot, start, n in step]
    if decode_form and len({len(c.token_ids) for c in chunks}) == 1:  # as a padded graph step builds it
        return decode_batch(chunks, rates, CPU, BLOCKS_PER_SEQ, {r: 96 // r for r in rates})
    return build_batch(chunks, rates, CPU)


def state_tensors(state: ModelState, layer: int) -> dict[str, torch.Tensor]:
    ls = state.layers[layer]
    names = ("kv_pool", "index_pool", "compressor_state", "indexer_state", "index_scale")
    return {n: getattr(ls, n) for n in names if getattr(ls, n) is not None}


def assert_equal_states(full: ModelState, lean: ModelState, layer: int, where: str) -> None:
    a, b = state_tensors(full, layer), state_tensors(lean, layer)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{where}: {name} differs"


def unpack(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Attention):
            m._packed.clear()


@pytest.fixture(scope="module")
def tiny():
    model, mc, _ = load_model(TINY, torch.float32, CPU, load_format="dummy", progress=False)
    return model, mc


@pytest.mark.parametrize("packed, kv", [(True, "auto"), (False, "auto"), (True, "fp8")])
@torch.no_grad()
def test_mtp_state_only_catch_up_equals_the_full_forward(tiny, packed, kv):
    model, mc = tiny
    mtp = load_mtp(mc, {}, CPU, torch.float32, "dummy", seed=3)
    if not packed:
        unpack(mtp)
    assert ("x" in mtp.block.self_attn.packed_groups()) == packed
    full, lean = (ModelState(mtp.config, layout(), CPU, torch.float32, kv) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    hc, dim = mc.hf_config.hc_mult, mc.hf_config.hidden_size
    for i, step in enumerate(STEPS):
        batch = step_batch(step, mtp.config.rates, gen, decode_form=i % 2 == 1)
        hidden = torch.randn(batch.num_tokens, hc, dim, generator=gen)
        mtp(batch, hidden, full, model)
        assert mtp.forward_state(batch, hidden, lean, model) is None
        assert_equal_states(full, lean, 0, f"step {i}")
    written = lean.layers[0].kv_pool
    assert bool((written != 0).any(dim=-1).sum() >= sum(n for step in STEPS for *_, n in step) // 2)


@pytest.mark.parametrize("kind, packed, kv", [("csa", True, "auto"), ("hca", True, "auto"), ("csa", False, "auto"),
                                              ("csa", True, "fp8"), ("hca", True, "fp8")])
@torch.no_grad()
def test_decoder_layer_state_only_forward_equals_the_full_forward(tiny, kind, packed, kv):
    """The compressor's staging, emitted entries and ring, and the indexer's keys (CSA) too."""
    model, mc = tiny
    index = next(i for i in range(mc.num_layers) if mc.compress_rate(i) and mc.is_csa(i) == (kind == "csa"))
    layer = model.model.layers[index]
    if not packed:
        layer = copy.deepcopy(layer)
        unpack(layer)
    assert ("x" in layer.self_attn.packed_groups()) == packed
    full, lean = (ModelState(mc, layout(), CPU, torch.float32, kv) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    hc, dim = mc.hf_config.hc_mult, mc.hf_config.hidden_size
    for i, step in enumerate(STEPS):
        batch = step_batch(step, mc.rates, gen, decode_form=i % 2 == 1)
        streams = torch.randn(batch.num_tokens, hc, dim, generator=gen)
        layer(streams, model.prepare(batch, full), full.layers[index])
        lean_ctx = build_step_context(batch, lean, mc, model.rope_plan(), None, attention=False)
        assert lean_ctx.window_rows is None
        layer.forward_state(streams, lean_ctx, lean.layers[index])
        assert_equal_states(full, lean, index, f"{kind} layer {index}, step {i}")
    entries = lean.layers[index].kv_pool[lean.layout.comp_base():]
    assert bool((entries != 0).any())  # compressed entries were emitted
    if kind == "csa":
        assert bool((lean.layers[index].index_pool != 0).any())


def calls_of(module: torch.nn.Module, counts: dict, name: str):
    original = module.forward

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    module.forward = counted


def test_steps_that_propose_nothing_skip_the_layers_attention_and_moe():
    """Draft limit 0 at every step: the drafter only catches up, through the state-only forward; the MTP
    layer's attention and MoE never run, its KV ring still fills, and the tokens are plain decoding's."""
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=96)
    plain = [o.outputs[0].token_ids for o in LLM(TINY, **base).generate(prompts, params, use_tqdm=False)]
    llm = LLM(TINY, **base, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": True})
    engine = llm.llm_engine
    engine.scheduler.draft_limit = lambda batch: 0
    runner = engine.runner
    counts: dict[str, int] = {}
    calls_of(runner.mtp.block.self_attn, counts, "attention")
    calls_of(runner.mtp.block.mlp, counts, "moe")
    state_only = []
    original = runner.mtp.forward_state

    def spy(batch, *args):
        state_only.append(batch.num_tokens)
        return original(batch, *args)

    runner.mtp.forward_state = spy
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert counts == {} and state_only  # the state-only forward ran, the full layer never
    assert sum(state_only) >= sum(len(p["prompt_token_ids"]) for p in prompts) + 3 * 8
    assert bool((runner.speculator.state.layers[0].kv_pool != 0).any())
    assert engine.spec_metrics.num_verify_steps == 0


def test_state_only_catch_up_drafts_as_the_full_catch_up_would():
    """The demo checkpoint (a trained MTP layer, drafts accepted in part), drafts per step varying with
    0 among them: catching up through the full forward instead gives the same tokens and the same
    acceptance, step for step (the state the drafts read is the same)."""
    import itertools

    texts = ["The return statement", "A class definition", "Exceptions are"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=256)
    results = []
    for full in (False, True):
        llm = LLM("demo", **base, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": True})
        engine = llm.llm_engine
        proposer = engine.runner.speculator.proposer
        if full:
            proposer.catch_up = lambda chunks, hidden, ids: proposer.forward(chunks, hidden, ids, None)
        cycle = itertools.cycle([2, 0, 0, 1, 0, 2])
        engine.scheduler.draft_limit = lambda batch: next(cycle)
        got = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
        m = engine.spec_metrics
        results.append((got, m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens))
    assert results[0] == results[1]
    assert results[0][3] > 0
