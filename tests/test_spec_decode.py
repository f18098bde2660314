"""MTP speculative decoding (CPU, float32): lossless greedy outputs, acceptance accounting
with drafters whose proposals are known to be right or wrong, MTP weight loading."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR, CheckpointError
from sparseserve.spec_decode.spec_step import MTPSpeculator
from sparseserve.model.mtp import MTPModule, checkpoint_to_module_name, load_mtp_weights, module_to_checkpoint_name

TINY = str(CONFIGS_DIR / "tiny")
BASE = dict(device="cpu", dtype="float32", max_model_len=160)
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def prompts():
    gen = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (4, 31, 66, 12, 19)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TINY, **BASE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def spec(k, **kw):
    return LLM(TINY, **BASE, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)


@pytest.mark.parametrize("k, extra", [
    (1, {}),
    (2, {"max_num_batched_tokens": 24}),                       # chunked prefill
    (3, {"num_gpu_blocks_override": 8, "max_num_seqs": 3}),   # preemption, fewer slots than prompts
])
def test_greedy_with_speculation_equals_without(k, extra, reference):
    llm = spec(k, **extra)
    runner = llm.llm_engine.runner
    # The runner builds and owns the speculation; "auto" keeps speculative graphs on one stream.
    assert isinstance(runner.speculator, MTPSpeculator) and runner.speculator.k == k
    assert runner.model.side_streams.mode == "never"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == reference
    m = llm.llm_engine.spec_metrics
    assert m.num_draft_tokens > 0 and m.num_verify_steps > 0
    assert not runner.speculator.draft_probs  # forgotten as the requests finished
    assert llm.llm_engine.all_cache_free()
    if "num_gpu_blocks_override" in extra:
        assert llm.llm_engine.scheduler.num_preemptions > 0


class KnownDrafter:
    """Proposes the target's own greedy continuation (known in advance), or always a wrong token."""

    def __init__(self, inner, continuations, k, wrong=False):
        self.inner, self.continuations, self.k, self.wrong = inner, continuations, k, wrong

    def propose(self, requests, streams, sampling):
        drafting = [i for i, r in enumerate(requests) if r.draft_from is not None]
        drafts = []
        for i in drafting:
            r = requests[i]
            seq = self.continuations[r.request_id]
            pos = r.chunk.start_pos + r.draft_from  # its next token sits at pos + 1
            d = seq[pos + 2:pos + 2 + self.k]
            d = [(t + 1) % 512 if self.wrong else t for t in d]
            d += [0] * (self.k - len(d))  # past the known continuation: never needed (the request stops)
            drafts.append(d)
        return torch.tensor(drafts, dtype=torch.long).view(len(drafting), self.k), None, drafting


@pytest.mark.parametrize("wrong", [False, True])
def test_acceptance_accounting_with_known_drafters(wrong, reference):
    k = 3
    long_ref = LLM(TINY, **BASE).generate(prompts(), SamplingParams(temperature=0, max_tokens=14 + k + 1,
                                                                     ignore_eos=True), use_tqdm=False)
    llm = spec(k)
    engine = llm.llm_engine
    continuations = {}
    for i, (p, out) in enumerate(zip(prompts(), long_ref)):
        continuations[str(i + llm._next_id)] = p["prompt_token_ids"] + out.outputs[0].token_ids
    engine.runner.speculator.proposer = KnownDrafter(engine.runner.speculator.proposer, continuations, k, wrong)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == reference
    m = engine.spec_metrics
    if wrong:
        assert m.num_accepted_tokens == 0 and m.mean_accepted_length == 1.0
    else:
        assert m.num_accepted_tokens == m.num_draft_tokens == k * m.num_verify_steps
        assert m.mean_accepted_length == k + 1
        # 14 tokens: 1 from the prefill, then 4 per verify step.
        assert m.num_verify_steps == len(prompts()) * 4
    assert engine.all_cache_free()


def test_sampled_speculation_is_seeded_and_runs():
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in spec(2).generate(prompts(), params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec(2).generate(prompts(), params, use_tqdm=False)]
    assert a == b and all(len(t) == 12 for t in a)


def test_mtp_name_map_round_trips_and_errors_name_tensors():
    llm = LLM(TINY, **BASE)
    module = MTPModule(llm.llm_engine.model_config)
    for name in module.state_dict():
        assert checkpoint_to_module_name(module_to_checkpoint_name(name)) == name
    tensors = dict(llm.llm_engine.mtp_tensors)
    load_mtp_weights(module, tensors)
    del tensors["mtp.0.attn.sinks"]
    with pytest.raises(CheckpointError, match="mtp.0.attn.sinks"):
        load_mtp_weights(module, tensors)


def test_stop_token_inside_accepted_drafts_truncates_like_plain_decoding(reference):
    k = 3
    stop_at = reference[2][5]  # the 6th token of the third prompt
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[stop_at])
    plain = [o.outputs[0].token_ids for o in LLM(TINY, **BASE).generate(prompts(), params, use_tqdm=False)]
    long_ref = LLM(TINY, **BASE).generate(prompts(), SamplingParams(temperature=0, max_tokens=14 + k + 1,
                                                                     ignore_eos=True), use_tqdm=False)
    llm = spec(k)
    continuations = {str(i): p["prompt_token_ids"] + o.outputs[0].token_ids
                     for i, (p, o) in enumerate(zip(prompts(), long_ref))}
    llm.llm_engine.runner.speculator.proposer = KnownDrafter(llm.llm_engine.runner.speculator.proposer, continuations, k)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert outs[2].outputs[0].stop_reason == stop_at and outs[2].outputs[0].token_ids[-1] == stop_at
    assert llm.llm_engine.all_cache_free()


def test_speculation_near_max_model_len_trims_drafts():
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    short = [{"prompt_token_ids": p["prompt_token_ids"][:40]} for p in prompts()]
    plain = LLM(TINY, device="cpu", dtype="float32", max_model_len=48).generate(short, params, use_tqdm=False)
    llm = LLM(TINY, device="cpu", dtype="float32", max_model_len=48,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outs = llm.generate(short, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 48 for o in outs if len(o.prompt_token_ids) < 48)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.llm_engine.all_cache_free()


@pytest.mark.parametrize("k", [0, 1, 3])
def test_steps_padded_like_graphs_give_the_same_tokens(k, reference):
    """On CUDA, decode and verify steps run padded to a graph bucket (by replay, or eagerly in the
    same form); the padding sequences live in the dummy slot and must not change any real token."""
    kw = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    llm = LLM(TINY, **BASE, max_num_seqs=8, cuda_graph_sizes=[2, 8], **kw)
    runner = llm.llm_engine.runner
    runner.pad_like_graphs = True
    shapes = []
    original = runner.graph_shape

    def spy(chunks, check_logits=True):
        shape = original(chunks, check_logits)
        shapes.append(shape)
        return shape

    runner.graph_shape = spy
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == reference
    assert (1 + k) in {s[1] for s in shapes if s is not None}  # padded steps of the graph query length ran
    assert {s[0] for s in shapes if s is not None} <= {2, 8}
    assert llm.llm_engine.all_cache_free()


@pytest.mark.parametrize("k, padded", [(1, False), (3, False), (2, True)])
def test_fused_greedy_step_equals_the_general_path(k, padded, monkeypatch):
    """All-greedy verify steps take the device-side path (acceptance, catch-up and drafts with one
    host read); it must give the general path's tokens and the same drafts (same acceptance)."""
    import sparseserve.spec_decode.spec_step as spec_step

    def run(fused: bool):
        calls = []
        original = spec_step.fused_greedy_launch

        def wrapped(*args):
            took = original(*args) if fused else None
            calls.append(took is not None)
            return took

        monkeypatch.setattr(spec_step, "fused_greedy_launch", wrapped)
        llm = spec(k, max_num_seqs=8, cuda_graph_sizes=[2, 8])
        llm.llm_engine.runner.pad_like_graphs = padded
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        m = llm.llm_engine.spec_metrics
        assert llm.llm_engine.all_cache_free()
        return got, (m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens), calls

    fused, fused_metrics, fused_calls = run(True)
    general, general_metrics, _ = run(False)
    assert fused == general and fused_metrics == general_metrics
    assert any(fused_calls)  # the fused path ran


def test_fused_greedy_step_with_accepted_drafts_on_the_demo_model(monkeypatch):
    """The demo checkpoint's MTP layer is trained (about half its drafts are accepted), so this
    covers the accepted-draft branches of the device-side path: same tokens as plain decoding and
    the same acceptance as the general path."""
    import sparseserve.spec_decode.spec_step as spec_step

    texts = ["The return statement", "A class definition", "Exceptions are", "The for statement is used to"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = dict(device="cpu", dtype="float32", max_model_len=256)
    plain = [o.outputs[0].token_ids for o in LLM("demo", **base).generate(texts, params, use_tqdm=False)]
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(spec_step, "fused_greedy_launch", lambda *args: None)
        llm = LLM("demo", **base, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        got = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
        m = llm.llm_engine.spec_metrics
        results.append((got, m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens))
    assert results[0][0] == plain
    assert results[0] == results[1]
    assert results[0][3] > 0
