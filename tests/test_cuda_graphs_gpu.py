"""CUDA graphs on the GPU: graph replay equals the eager step token for token, the audit
passes, and the historical top-k bug (workspace zeroing behind a host `if`) is caught."""
import gc
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.worker.cuda_graph import GraphCaptureError
from sparseserve.engine.graph_audit import audit_graph_replays
from sparseserve.worker.watchdog import StepTimeoutError

pytestmark = pytest.mark.gpu
TINY = str(CONFIGS_DIR / "tiny")
MAX_LEN = 1024
COMMON = dict(dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=64, kv_cache_memory_bytes=2 * 1024**3)


def prompt_set(n=64, seed=0):
    rng = random.Random(seed)
    # Lengths at window/compress/top-k-reach boundaries of the tiny model, then random ones.
    special = [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, MAX_LEN - 20]
    lengths = special + [rng.randint(1, MAX_LEN - 20) for _ in range(n - len(special))]
    return [{"prompt_token_ids": [rng.randrange(2, 512) for _ in range(n_tok)]} for n_tok in lengths]


def generate(enforce_eager, **kw):
    llm = LLM(TINY, enforce_eager=enforce_eager, **COMMON, **kw)
    outs = llm.generate(prompt_set(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    free = llm.llm_engine.all_cache_free()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert free
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["auto", "standard", "persistent", "torch"])
def test_graph_replay_equals_eager_token_for_token(backend):
    eager = generate(True, topk_backend=backend)
    graph = generate(False, topk_backend=backend)
    mismatched = [i for i, (a, b) in enumerate(zip(eager, graph)) if a != b]
    assert not mismatched, f"{len(mismatched)} of 64 prompts differ, first {mismatched[:5]}"


def test_async_scheduling_equals_sync_under_graphs():
    """Async scheduling (the CUDA default: step n + 1 is launched before step n is read back, its
    input tokens taken from the device) gives the tokens of a synchronous engine, graphs and eager."""
    async_graph = generate(False)
    sync_graph = generate(False, async_scheduling=False)
    sync_eager = generate(True, async_scheduling=False)
    assert async_graph == sync_graph == sync_eager


def test_audit_passes_with_every_path():
    """Both halves of the audit (every bucket's capture compared, and replays against eager) pass."""
    for backend in ("standard", "persistent", "auto"):
        llm = LLM(TINY, cudagraph_audit_replay=True, cuda_graph_sizes=[1, 4, 8], topk_backend=backend, **COMMON)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_default_startup_refuses_the_historical_topk_bug(historical_topk_bug):
    """The capture audit is on by default: the seed's bug class stops start-up without being asked for,
    with the missing node named."""
    with pytest.raises(GraphCaptureError, match="different kernels") as caught:
        LLM(TINY, topk_backend="persistent", **COMMON)
    assert "only in the second" in str(caught.value) and "topk_path=persistent" in str(caught.value)
    gc.collect()
    torch.cuda.empty_cache()
    # Without the capture comparison, the replay comparison catches the stale counters.
    llm = LLM(TINY, cudagraph_audit=False, cuda_graph_sizes=[1, 4], topk_backend="persistent", **COMMON)
    with pytest.raises(GraphCaptureError, match="replay differs from the eager step"):
        audit_graph_replays(llm.llm_engine.runner, llm.llm_engine.kv, seed=1)
    assert llm.llm_engine.all_cache_free()


def test_capture_audit_is_a_small_share_of_capture():
    """The default audit (a second, recorded-only capture of each top-k path's first bucket and of the
    largest) costs a fraction of the capture time; the start-up report breaks the time down."""
    llm = LLM(TINY, topk_backend="auto", **COMMON)  # default buckets up to 64: 11 graphs
    phases = llm.llm_engine.runner.startup_phases
    print("start-up phases:", phases)
    assert phases["capture audit"] > 0 and phases["graph capture"] > 0
    assert phases["capture audit"] <= 0.25 * phases["graph capture"], phases
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_watchdog_reports_a_step_that_does_not_finish():
    llm = LLM(TINY, step_timeout_s=0.3, cuda_graph_sizes=[1], **COMMON)
    torch.cuda._sleep(int(4e9))  # ~2 s of GPU time queued ahead of the step's event
    with pytest.raises(StepTimeoutError, match="graph batch=1"):
        llm.llm_engine.runner.wait(lambda: "graph batch=1, query_len=1, topk_path=standard, lengths 9/9")
    torch.cuda.synchronize()


def spec_config(k, adaptive=False):
    # adaptive=False: k drafts every step, so graph and eager engines verify the same drafts.
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}}


def generate_with_draft_cycle(llm, limits: list[int]):
    """Greedy generation of prompt_set() with the scheduler's draft limit cycling through `limits` (one per
    step): (token ids, drafts, accepted), after checking that drafts were verified and the cache is free."""
    import itertools

    engine = llm.llm_engine
    cycle = itertools.cycle(limits)
    engine.scheduler.draft_limit = lambda batch: next(cycle)
    outs = llm.generate(prompt_set(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    m = engine.spec_metrics
    assert m.num_verify_steps > 0 and engine.all_cache_free()
    return [o.outputs[0].token_ids for o in outs], m.num_draft_tokens, m.num_accepted_tokens


@pytest.mark.parametrize("k, extra", [(1, {}), (2, {}), (3, {}),
                                      (2, {"num_gpu_blocks_override": 400})])  # preemption under graphs
def test_speculative_graphs_equal_eager_token_for_token(k, extra):
    """Verify steps (1 + k tokens) and the MTP drafter replay as graphs; on CUDA the eager steps
    are padded the same way, so greedy tokens (and acceptance) must agree exactly."""
    results = {}
    for eager in (True, False):
        llm = LLM(TINY, enforce_eager=eager, **COMMON, **spec_config(k), **extra)
        runner = llm.llm_engine.runner
        if not eager:
            assert sorted(runner.graphs) == [1, 1 + k] and sorted(runner.mtp_graphs) == [1, 1 + k]
        outs = llm.generate(prompt_set(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
        m = llm.llm_engine.spec_metrics
        results[eager] = ([o.outputs[0].token_ids for o in outs], m.num_draft_tokens, m.num_accepted_tokens)
        assert m.num_verify_steps > 0 and llm.llm_engine.all_cache_free()
        if extra:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    mismatched = [i for i, (a, b) in enumerate(zip(results[True][0], results[False][0])) if a != b]
    assert not mismatched, f"{len(mismatched)} of 64 prompts differ, first {mismatched[:5]}"
    assert results[True][1:] == results[False][1:]


def test_adaptive_speculation_graphs_equal_eager_and_costs_are_timed():
    """Adaptive speculation captures graphs for every 1 + d and times them at start-up; with the
    same drafts per step (a fixed cycle in place of the policy) graphs and padded eager steps give
    the same tokens and acceptance."""
    from sparseserve.spec_decode.adaptive import AdaptivePolicy

    k, results = 3, {}
    for eager in (True, False):
        llm = LLM(TINY, enforce_eager=eager, **COMMON, **spec_config(k, adaptive=True))
        engine = llm.llm_engine
        assert isinstance(engine.spec_policy, AdaptivePolicy)
        if not eager:
            runner = engine.runner
            assert sorted(runner.graphs) == sorted(runner.mtp_graphs) == [1, 2, 3, 4]
            costs = runner.step_costs
            assert costs.source == "measured" and engine.spec_policy.costs is costs
            assert {(b, d) for b in costs.buckets for d in range(k + 1)} <= set(costs.seconds)
            assert all(s > 0 for s in costs.seconds.values())
        else:
            engine.runner.pad_like_graphs = True
        results[eager] = generate_with_draft_cycle(llm, [3, 1, 0, 2])
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    assert results[True] == results[False]


def test_state_only_catch_up_graphs_equal_eager_under_adaptive_speculation():
    """Adaptive speculation's plain steps (d = 0) catch the drafter up through its state-only graph
    (query length 1), which takes the plain target graph's metadata (copied on the device) and
    streams (in place): with the drafts per step mostly 0, graph and padded eager engines give the
    same tokens and acceptance (the drafts read the state the catch-ups wrote)."""
    k, results = 2, {}
    for eager in (True, False):
        llm = LLM(TINY, enforce_eager=eager, **COMMON, **spec_config(k, adaptive=True))
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        replays = []
        if eager:
            runner.pad_like_graphs = True
            assert not runner.mtp_state_graphs
        else:
            assert sorted(runner.mtp_state_graphs) == [1]
            assert runner.mtp_state_graphs[1].hidden is runner.graphs[1].outputs[1]
            catch_up = runner.mtp_state_graphs[1]
            original = catch_up.run

            def run(chunks, *args, **kw):
                replays.append(kw.get("like") is not None)
                return original(chunks, *args, **kw)

            catch_up.run = run
        # A step's limit caps both the drafts it verifies and the drafts it proposes, so a nonzero limit
        # verifies only after a nonzero one (2, 1 and 1, 1 below); the zeros are the catch-up steps.
        results[eager] = generate_with_draft_cycle(llm, [0, 2, 1, 0, 0, 1, 1, 0])
        if not eager:
            assert any(replays)  # plain steps' catch-ups replayed, with the target graph's metadata
        del llm, engine, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert results[True] == results[False]


def test_audit_passes_with_adaptive_speculation():
    """The replay audit covers the state-only catch-up graphs: the KV rows each replay writes equal
    the eager catch-up's."""
    llm = LLM(TINY, cudagraph_audit_replay=True, cuda_graph_sizes=[1, 4, 8], **COMMON, **spec_config(2, adaptive=True))
    assert sorted(llm.llm_engine.runner.mtp_state_graphs) == [1]
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_speculation_equals_without_on_gpu(k):
    """fp32 on the GPU (reference kernels, eager, steps padded as graphs would be): speculation is
    lossless. (In bf16 a verify step's GEMMs have other shapes than a plain step's, so near-tied
    logits may round differently; the bf16 graph path is held to the eager one above.)"""
    kw = dict(COMMON, dtype="float32", max_num_seqs=16)
    prompts = prompt_set(16, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(TINY, enforce_eager=True, **kw).generate(prompts, params,
                                                                                            use_tqdm=False)]
    gc.collect()
    llm = LLM(TINY, enforce_eager=True, **kw, **spec_config(k))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert llm.llm_engine.spec_metrics.num_verify_steps > 0
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_audit_passes_with_mtp_1():
    """The reference article's configuration: MTP=1, persistent top-k path; capture audit and replay
    audit (decode, verify and drafter graphs) must pass."""
    llm = LLM(TINY, cudagraph_audit_replay=True, cuda_graph_sizes=[1, 4, 8], topk_backend="persistent", **COMMON,
              **spec_config(1))
    assert sorted(llm.llm_engine.runner.graphs) == [1, 2]
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_dropped_graphs_leave_their_pool_empty():
    """Nothing made inside a capture (a library workspace, a cached tensor) outlives the graphs:
    once a runner's graphs are gone, their pool holds no memory. (torch refuses to capture into a
    pool whose graphs are all gone but which still holds memory: the MTP=1 audit hit that when
    cuBLAS made its workspace for the capture stream inside the first capture.)"""
    llm = LLM(TINY, cuda_graph_sizes=[1, 4], **COMMON, **spec_config(1))
    runners = llm.llm_engine.runner._new_graph_runners(pool_per_runner=True)
    runners = [on_fresh_stream(r) for r in runners]
    pools = set()
    for graph_runner in runners:
        graph_runner.capture_all()
        pools.add(tuple(graph_runner.pool))
        assert graph_runner.graphs
    del runners, graph_runner
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = [(s["segment_pool_id"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) in pools]
    assert not left, f"memory left in dropped graphs' pools: {left}"
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def on_fresh_stream(runner):
    """The runner, on a stream no GEMM has run on yet (a priority no other code uses)."""
    runner.stream = torch.cuda.Stream(device=runner.device, priority=-1)
    return runner


def test_audit_detects_the_historical_topk_bug_with_mtp_1(historical_topk_bug):
    with pytest.raises(GraphCaptureError, match="different kernels"):
        LLM(TINY, cudagraph_audit=True, cuda_graph_sizes=[1, 4], topk_backend="persistent", **COMMON,
            **spec_config(1))
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("k", [1, 2])
def test_async_speculation_equals_sync_under_graphs(k):
    """Async scheduling with speculation (engine/spec_async.py; the fused greedy verify + draft
    queued at launch): graph replay with async scheduling gives the tokens and acceptance of a
    synchronous engine, graph and eager, greedy and seeded sampling."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(32)]
    results = {}
    for eager, mode in ((False, True), (False, False), (True, False)):
        llm = LLM(TINY, enforce_eager=eager, async_scheduling=mode, **COMMON, **spec_config(k))
        assert llm.llm_engine.async_scheduling is mode
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompt_set(), greedy, use_tqdm=False)]
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompt_set(32, seed=2), sampled, use_tqdm=False)]
        m = llm.llm_engine.spec_metrics
        results[(eager, mode)] = (tokens, m.num_draft_tokens, m.num_accepted_tokens)
        assert m.num_verify_steps > 0 and llm.llm_engine.all_cache_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[(False, True)] == results[(False, False)] == results[(True, False)]
