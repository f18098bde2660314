"""CPU tests of the start-up kernel builds: the buckets, the plan's coverage of the engine's limits,
the aligned metadata views, the kernels' unspecialised arguments, and a warm-up run through the runner."""
import inspect

import pytest

from sparseserve.model.batch import SequenceChunk, aligned_offsets, build_batch
from sparseserve.worker.kernel_warmup import (CROSS_MAX_TOKENS, SMALL_TOKENS, WarmupStep, length_buckets, run_warmup,
                                              fit_to_cache, runner_plan, token_buckets, warmup_plan)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_token_buckets_hit_every_small_count_and_every_power_of_two_class():
    buckets = token_buckets(8192)
    assert buckets[:SMALL_TOKENS] == list(range(1, SMALL_TOKENS + 1)) and buckets[-1] == 8192
    # next_power_of_2(T) and min(cap, next_power_of_2(T)) take every value they can take for T <= 8192
    assert {next_pow2(t) for t in buckets} == {next_pow2(t) for t in range(1, 8193)}
    for p in (16, 64, 1024, 4096):
        assert {p, p + 1, p + p // 2} <= set(buckets)
    assert token_buckets(100)[-1] == 100 and all(t <= 100 for t in token_buckets(100))
    assert token_buckets(0) == []


def test_length_buckets_reach_every_power_of_two_width():
    lengths = length_buckets(65536)
    assert lengths[-1] == 65536 and min(lengths) == 16
    for rate in (4, 128):
        widths = {next_pow2(max(1, n // rate)) for n in lengths}
        assert widths == {next_pow2(max(1, n // rate)) for n in range(16, 65537)}
    assert length_buckets(1000)[-1] == 1000


@pytest.mark.parametrize("tokens, model_len", [(8192, 65536), (2048, 1024), (512, 4096)])
def test_plan_covers_every_bucket_within_the_limits(tokens, model_len):
    plan = warmup_plan(tokens, model_len, max_num_seqs=64)
    limit = min(tokens, model_len * 64)
    assert all(1 <= s.num_tokens <= limit and s.end <= model_len and s.num_seqs <= 64 for s in plan)
    assert all(s.num_tokens <= s.end for s in plan if not s.packed)
    prefills = {s.num_tokens for s in plan if (s.num_seqs == 1 and s.end == s.num_tokens) or s.packed}
    assert prefills == set(token_buckets(limit)) - {1}  # one token is a decode graph's
    # a step of more tokens than one sequence holds: whole prompts, every chunk within max_model_len
    for step in (s for s in plan if s.packed):
        chunks = step.chunks(block_size=64, num_blocks=10**6)
        assert sum(len(c.token_ids) for c in chunks) == step.num_tokens and len(chunks) == step.num_seqs
        assert all(c.start_pos == 0 and 1 <= len(c.token_ids) <= model_len for c in chunks)
    # every power-of-two step of the length sweep at every power-of-two length (and the longest)
    cross = {(s.num_tokens, s.end) for s in plan if s.num_seqs == 1}
    for length in length_buckets(model_len):
        if length & (length - 1) == 0 or length == model_len:
            for t in (2, 4, 8, min(CROSS_MAX_TOKENS, limit)):
                if t <= length and t & (t - 1) == 0:
                    assert (t, length) in cross, (t, length)
    assert any(s.num_seqs > 1 for s in plan)
    assert len(plan) < 200  # bounded: a few hundred eager steps at most


def test_plan_without_graphs_has_decode_steps_of_every_bucket():
    plan = warmup_plan(2048, 1024, 64, decode_graphs=False, eager_decode={1: [1, 2, 4, 8, 64], 3: [1, 8]})
    decode = {(s.num_seqs, s.query_len) for s in plan if s.query_len}
    assert decode == {(1, 1), (2, 1), (4, 1), (8, 1), (64, 1), (1, 3), (8, 3)}
    assert any(s.num_tokens == 1 and s.num_seqs == 1 and not s.query_len for s in plan)
    chunks = WarmupStep(24, 1024, 8, 3).chunks(block_size=128, num_blocks=4)
    assert [len(c.token_ids) for c in chunks] == [3] * 8 and {c.want_logits for c in chunks} == {"all"}
    assert chunks[0].block_ids == [0, 1, 2, 3]  # capped by the cache's blocks


def test_plan_holds_a_step_of_every_prefill_graph_bucket():
    """The pieces of a prefill graph run at its bucket's token count: each bucket gets a step of exactly
    that many tokens (several prompts above max_model_len), so the capture builds no kernel."""
    from sparseserve.worker.prefill_graphs import default_prefill_graph_sizes

    buckets = default_prefill_graph_sizes(2048)
    plan = warmup_plan(2048, 1024, 16, prefill_buckets=buckets)
    sizes = {s.num_tokens for s in plan if not s.query_len}
    assert set(buckets) <= sizes and {384, 640, 896, 1280, 1792} <= sizes - set(warmup_plan(2048, 1024, 16))
    assert {s.num_seqs for s in plan if s.num_tokens == 1792} == {2}


def test_steps_above_the_model_length_pack_several_prompts():
    """With max_num_batched_tokens above max_model_len a step holds several prompts: its token count
    picks the large-M tiles (the mixes above 2,048 tokens, the quantized GEMMs above 1,024)."""
    plan = warmup_plan(8192, 1024, max_num_seqs=16)
    packed = {s.num_tokens: s for s in plan if s.packed}
    assert {1025, 2049, 4097, 8192} <= set(packed) and max(s.num_tokens for s in plan) == 8192
    assert packed[2049].num_seqs == 3 and packed[8192].num_seqs == 8 and packed[8192].end == 1024
    assert max(s.num_tokens for s in warmup_plan(8192, 1024, max_num_seqs=2)) == 2048  # two slots at most
    fitted = fit_to_cache(plan, cache_tokens=512)
    assert all(s.end <= 512 for s in fitted) and max(s.num_tokens for s in fitted) == 4096
    assert max(s.num_seqs for s in fitted) == 8


def test_mixed_step_chunks_fit_the_step():
    chunks = WarmupStep(19, 300, 4).chunks(block_size=64, num_blocks=100)
    assert sum(len(c.token_ids) for c in chunks) == 19 and [c.slot for c in chunks] == [0, 1, 2, 3]
    assert chunks[0].start_pos + len(chunks[0].token_ids) == 300
    assert all(c.start_pos + len(c.token_ids) < 300 for c in chunks[1:]) and len(chunks[0].block_ids) == 5


def test_metadata_views_are_16_byte_aligned():
    """Triton specialises pointers on 16-byte alignment: every view of the one int64 buffer starts at an
    even index whatever the step's token and sequence counts."""
    assert aligned_offsets([3, 3, 1, 2]) == [0, 4, 8, 10]
    for counts in ([3], [1, 2], [5, 1, 1], [2, 2, 2]):
        chunks = [SequenceChunk(i, 7, [1] * n, [0], "last") for i, n in enumerate(counts)]
        batch = build_batch(chunks, [4, 128], "cpu", max_blocks=2)
        views = [getattr(batch, name) for name in ("input_ids", "positions", "token_seq", "seq_slots", "seq_start",
                                                  "seq_num_tokens", "seq_token_offset", "logits_indices")]
        views += list(batch.emit_tokens.values())
        assert all(v.data_ptr() % 16 == 0 for v in views)
        assert batch.seq_num_tokens.tolist() == counts and batch.positions[: counts[0]].tolist() == list(
            range(7, 7 + counts[0]))


UNSPECIALISED = {
    "sparseserve.kernels.rope": {"_rope_kernel": ["rows"], "_rope_tables_kernel": ["T"]},
    "sparseserve.kernels.router": {"_router_partials_kernel": ["num_tokens"]},
    "sparseserve.kernels.rows": {"_source_rows_kernel": ["num_tokens"], "_ring_write_rows_kernel": ["num_tokens"],
                                 "_entry_rows_kernel": ["num_tokens", "num_cols", "stride_out"],
                                 "_emit_pool_rows_kernel": ["num_tokens"],
                                 "_visible_counts_kernel": ["num_tokens", "num_entries"]},
    "sparseserve.kernels.mhc": {"_hc_mix_partial_kernel": ["num_tokens", "splits"],
                                "_hc_finalize_kernel": ["num_tokens", "splits"], "_hc_expand_kernel": ["num_tokens"]},
    "sparseserve.kernels.mhc_fused": {"_hc_expand_mix_kernel": ["num_tokens", "splits"]},
    "sparseserve.kernels.indexer": {"_indexer_scores_kernel": ["num_entries", "stride_ot", "chunks"]},
    "sparseserve.kernels.attention.triton_kernel": {"_valid_band_kernel": ["num_rows", "stride_rt"],
                                                    "_sparse_mqa_fwd_kernel": ["num_rows", "stride_rt"]},
    "sparseserve.kernels.topk.standard": {"_topk_standard_kernel": ["stride_s", "R", "W"]},
    "sparseserve.kernels.topk.persistent": {"_p_bound_kernel": ["stride_s", "W", "n_items"],
                                            "_p_select_kernel": ["stride_s", "W", "n_items"]},
    "sparseserve.kernels.moe": {"_moe_gate_up_kernel": ["num_assign", "num_m_blocks"],
                                "_moe_down_kernel": ["num_assign", "num_m_blocks"]},
    "sparseserve.kernels.moe_align": {"_moe_align_kernel": ["num_assign", "padded_rows", "num_blocks"]},
    "sparseserve.kernels.quant.linear": {"_fp8_linear_kernel": ["M"]},
    "sparseserve.kernels.quant.act_quant": {"_act_quant_kernel": ["M"]},
}


def _find(module, name):
    if hasattr(module, name):
        return getattr(module, name)
    for value in vars(module).values():  # kernels made inside a factory
        if inspect.isclass(value) and hasattr(value, name):
            return getattr(value, name)
    pytest.fail(f"{module.__name__} has no kernel {name}")


@pytest.mark.parametrize("module_name", sorted(UNSPECIALISED))
def test_request_varying_arguments_are_not_specialised(module_name):
    """Token counts, row-list widths and their strides vary per step: an integer argument that Triton
    specialises (== 1, divisible by 16) would build a kernel per class of value while requests wait."""
    triton = pytest.importorskip("triton")
    import importlib

    module = importlib.import_module(module_name)
    for name, args in UNSPECIALISED[module_name].items():
        unspecialised, constexprs = _arguments(_find(module, name), triton)
        for arg in args:
            assert arg in unspecialised and arg not in constexprs, (name, arg)


def _arguments(kernel, triton) -> tuple[set[str], set[str]]:
    """(the do_not_specialize arguments, the constexpr ones) of a kernel, compiled or interpreted
    (TRITON_INTERPRET=1 wraps the function and keeps the decorator's keywords)."""
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.is_constexpr})
    names = list(inspect.signature(kernel.fn).parameters)
    dns = {names[a] if isinstance(a, int) else a for a in kernel.kwargs.get("do_not_specialize") or ()}
    constexprs = {n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(p.annotation)}
    return dns, constexprs


def test_indexer_chunk_count_is_a_runtime_argument():
    triton = pytest.importorskip("triton")
    from sparseserve.kernels import indexer

    unspecialised, constexprs = _arguments(indexer._indexer_scores_kernel, triton)
    assert "CHUNKS" not in constexprs and "chunks" in unspecialised


def test_warmup_runs_its_steps_through_the_runner():
    """The warm-up's steps are valid engine steps (on the CPU the references run, nothing is built), and
    the engine's cache is untouched by them."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.model.loader import CONFIGS_DIR

    llm = LLM(str(CONFIGS_DIR / "tiny"), device="cpu", dtype="float32", max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=64, enable_chunked_prefill=True)
    runner = llm.llm_engine.runner
    before = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].token_ids
    full = runner_plan(runner)  # no graphs on the CPU: the eager decode buckets are planned too
    assert {(s.num_seqs, s.query_len) for s in full if s.query_len} == {(n, 1) for n in runner.graph_sizes_for(1)}
    plan = [WarmupStep(3, 3), WarmupStep(16, 96), WarmupStep(9, 96, 4), WarmupStep(8, 96, 4, 2)]
    report = run_warmup(runner, plan)
    assert report.steps == 4 and report.builds == 0 and "built 0 kernels" in report.line()
    after = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0, max_tokens=6),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert after == before and llm.llm_engine.all_cache_free()
    llm.shutdown()


def test_steps_longer_than_the_cache_end_at_its_length():
    plan = [WarmupStep(64, 4096), WarmupStep(8, 100), WarmupStep(2048, 2048), WarmupStep(24, 4096, 8, 3)]
    fitted = fit_to_cache(plan, 1024)
    assert fitted == sorted([WarmupStep(64, 1024), WarmupStep(8, 100), WarmupStep(1024, 1024),
                             WarmupStep(24, 1024, 8, 3)], key=lambda s: (s.num_tokens, s.end, s.num_seqs, s.query_len))
    assert all(s.end <= 1024 for s in fitted)


def _flash_profile():
    from sparseserve.config import ModelConfig
    from sparseserve.model.loader import load_hf_config
    from sparseserve.model.presets import resolve_model_dir
    from sparseserve.worker.kernel_warmup import JointProfile

    path, overrides = resolve_model_dir("v4-flash-43l8e")
    config = ModelConfig(load_hf_config(path, overrides))
    return config, JointProfile(config, 132)


def _launch_keys(config, profile, tokens: int, length: int) -> list:
    """Every launch choice of an eager step that is a constexpr or a specialised argument: the token-count
    tables (mHC mix and row tiles, the MoE and quantized GEMM tables, rope blocks, the router's and the
    fused mHC's small steps) and the profile's attention and indexer launches."""
    import triton

    from sparseserve.kernels import mhc, moe
    from sparseserve.kernels.quant.select import linear_config, moe_quant_config

    hf = config.hf_config
    hc, dim = hf.hc_mult, hf.hidden_size
    mix = mhc.mix_config(tokens, hc * dim)
    keys = [tuple(sorted((k, v) for k, v in mix.items() if k not in ("chunk", "splits"))),  # runtime args
            max(2, triton.next_power_of_2(mix["splits"])), mhc.row_config(tokens, dim),
            moe.moe_config(tokens, hf.num_experts_per_tok, hf.n_routed_experts, dim, hf.moe_intermediate_size),
            linear_config(tokens, 4096, 1024), linear_config(tokens, 1024, 4096),
            moe_quant_config(tokens, hf.num_experts_per_tok, hf.n_routed_experts, "fp4"),
            max(1, min(64, triton.next_power_of_2(tokens * hf.num_attention_heads))),
            max(1, min(64, triton.next_power_of_2(tokens))), tokens <= 16, tokens <= 4]
    return keys + list(profile(tokens, length))


def test_plan_meets_every_launch_choice_at_v4_flash_shapes():
    """Each kernel's launch choices over a sample of the steps an engine with these limits admits (token
    counts 1..2048, longest sequences up to 16K) are all met by some step of the plan."""
    import random

    config, profile = _flash_profile()
    tokens, model_len = 2048, 16384
    plan = warmup_plan(tokens, model_len, 64, profile=profile)
    met = None
    for step in plan:
        keys = _launch_keys(config, profile, step.num_tokens, step.end)
        met = met or [set() for _ in keys]
        for seen, key in zip(met, keys):
            seen.add(key)
    rng = random.Random(0)
    sample = sorted(set(range(2, 33)) | {rng.randint(33, tokens) for _ in range(60)})
    for t in sample:
        for length in sorted({t, model_len, *range(max(t, 16), model_len + 1, 256)}):
            for i, key in enumerate(_launch_keys(config, profile, t, length)):
                assert key in met[i], f"a step of {t} tokens at length {length}: launch {i} ({key}) is never warmed up"
