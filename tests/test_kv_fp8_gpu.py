"""kv_cache_dtype="fp8" on the GPU: graph replay equals the eager step token for token (with and without MTP, on
both top-k paths, prompts at the window / compress / top-k-reach lengths of tests/test_cuda_graphs_gpu.py), the
audit passes, and the compiled kernels write and read the packed rows as the reference does at V4-Flash shapes.

The kernel checks: the writers round on the fp32 bits, so the GPU's bytes equal the reference's for the same bf16
rows (norm_rope) up to one-code flips where the compiled summation order moves a value (compressor); the readers
dequantize exactly, so they meet the bf16 kernels' tolerances against the reference on the dequantized rows.
"""
import gc

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.kernels.attention import sparse_mqa_attention_ref, sparse_mqa_attention_triton
from sparseserve.kernels.norm_rope import norm_rope_ref, norm_rope_triton
from sparseserve.kv_format import KVFormat, dequantize_kv_rows, quantize_index_rows, quantize_kv_rows
from sparseserve.kernels.indexer import indexer_scores_ref, indexer_scores_triton

from test_cuda_graphs_gpu import COMMON, TINY, prompt_set, spec_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP8 = dict(COMMON, kv_cache_dtype="fp8")


def _generate(enforce_eager: bool, **kw) -> tuple[list[list[int]], tuple]:
    llm = LLM(TINY, enforce_eager=enforce_eager, **FP8, **kw)
    assert llm.llm_engine.runner.state.layers[0].kv_pool.dtype == torch.uint8
    outs = llm.generate(prompt_set(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    m = llm.llm_engine.spec_metrics
    counts = (m.num_draft_tokens, m.num_accepted_tokens)
    assert llm.llm_engine.all_cache_free()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], counts


@pytest.mark.parametrize("backend", ["standard", "persistent"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_fp8_graphs_equal_eager(backend, k):
    kw = dict(topk_backend=backend, **(spec_config(k) if k else {}))
    eager = _generate(True, **kw)
    graph = _generate(False, **kw)
    mismatched = [i for i, (a, b) in enumerate(zip(eager[0], graph[0])) if a != b]
    assert not mismatched, f"{len(mismatched)} of 64 prompts differ, first {mismatched[:5]}"
    assert eager[1] == graph[1]


@pytest.mark.parametrize("k", [0, 1])
def test_fp8_audit_passes(k):
    llm = LLM(TINY, cudagraph_audit=True, cuda_graph_sizes=[1, 4, 8], topk_backend="persistent", **FP8,
              **(spec_config(k) if k else {}))
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_fp8_norm_rope_bytes_equal_the_reference_gpu():
    gen = torch.Generator().manual_seed(0)
    fmt = KVFormat(512, 64)
    x = (torch.randn(300, 512, generator=gen) * 5).to("cuda", torch.bfloat16)
    weight = (0.5 + torch.rand(512, generator=gen)).to("cuda")
    angle = (torch.rand(300, 32, generator=gen) * 6.3).cuda()
    rows = torch.randperm(400, generator=gen)[:300].cuda()
    pools = [torch.zeros(400, fmt.row_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    got = norm_rope_triton(x, weight, 1e-6, angle.cos(), angle.sin(), pools[0], rows, kv_format=fmt)
    want = norm_rope_ref(x, weight, 1e-6, angle.cos(), angle.sin(), pools[1], rows, kv_format=fmt)
    # The bf16 rows themselves may differ in the last bit (rsqrt); compare what they quantize to.
    assert (got == want).float().mean().item() > 0.99
    torch.testing.assert_close(dequantize_kv_rows(got, fmt), dequantize_kv_rows(want, fmt), rtol=0.13, atol=1e-2)


@pytest.mark.parametrize("T,H,L", [(1, 64, 640), (64, 64, 640), (64, 64, 384), (256, 64, 2176), (4, 16, 1152)])
def test_fp8_attention_flash_shapes_gpu(T, H, L):
    """The engine's FP8 configs (select.py rows F1 with and without splits, F2 at 16 heads) against the reference:
    ragged lists, holes leading (a sequence's first window rows) and trailing."""
    gen = torch.Generator().manual_seed(T + L + H)
    fmt = KVFormat(512, 64)
    pool = quantize_kv_rows(torch.randn(4 * L, 512, generator=gen), fmt).cuda()
    q = torch.randn(T, H, 512, generator=gen).to("cuda", torch.bfloat16)
    rows = torch.randint(0, 4 * L, (T, L), generator=gen, dtype=torch.int32)
    rows[:, L - 100:] = -1
    rows[::2, :37] = -1
    rows[torch.rand(T, L, generator=gen) < 0.05] = -1
    sinks = torch.randn(H, generator=gen).cuda()
    out = sparse_mqa_attention_triton(q, pool.cuda(), rows.cuda(), sinks, 512**-0.5, kv_format=fmt)
    ref = sparse_mqa_attention_ref(q.float(), dequantize_kv_rows(pool, fmt), rows.cuda(), sinks, 512**-0.5)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and rel < 1e-2, rel


def test_fp8_indexer_flash_shapes_gpu():
    gen = torch.Generator().manual_seed(1)
    T, B, epb, max_blocks, E = 64, 8, 32, 64, 2048
    codes, scales = quantize_index_rows(torch.randn(B * max_blocks * epb, 128, generator=gen) * 3)
    q = torch.randn(T, 64, 128, generator=gen).to("cuda", torch.bfloat16)
    weights = torch.randn(T, 64, generator=gen).cuda()
    table = torch.randperm(B * max_blocks, generator=gen).view(B, max_blocks).int().cuda()
    token_seq = torch.randint(0, B, (T,), generator=gen).cuda()
    positions = torch.randint(0, 4 * E, (T,), generator=gen).cuda()
    args = (q, weights, codes.cuda(), table, token_seq, positions, 4, epb, 128**-0.5, E)
    out = indexer_scores_triton(*args, index_scale=scales.cuda())
    ref = indexer_scores_ref(q.float(), *args[1:], index_scale=scales.cuda())
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert ((out[fin] - ref[fin]).norm() / ref[fin].norm()).item() < 1e-2


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _fp8_hopper_case(T: int, H: int, L: int, pool_rows: int, seed: int):
    """Random packed rows (never zeros; values of several magnitudes, so the scales differ per group), bf16 q, and
    row lists with every boundary the kernel walks: one token all holes (output exactly 0), the pool's first and
    last rows, ragged valid lengths (top-k lists cut short), leading holes (a young sequence's window), a band that
    ends on, one before and one after a tile edge, and scattered holes."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(512, 64)
    magnitudes = torch.exp2(torch.randint(-6, 7, (pool_rows, 8), generator=gen).float()).repeat_interleave(64, 1)
    values = torch.randn(pool_rows, 512, generator=gen) * magnitudes
    pool = quantize_kv_rows(values.bfloat16(), fmt)
    q = (torch.randn(T, H, 512, generator=gen) * 2).bfloat16()
    rows = torch.randint(0, pool_rows, (T, L), generator=gen, dtype=torch.int32)
    keep = torch.randint(1, L + 1, (T, 1), generator=gen)
    rows[torch.arange(L).unsqueeze(0) >= keep] = -1  # ragged top-k lengths
    rows[torch.rand(T, L, generator=gen) < 0.1] = -1
    if T > 1:
        rows[0] = -1
        rows[1, 0], rows[1, -1] = 0, pool_rows - 1
    if T > 2:
        rows[2, : L // 2] = -1  # leading holes: the band starts mid-list
    for t, end in zip(range(3, T), (64, 63, 65, 128, 127, 129)):
        rows[t] = torch.randint(0, pool_rows, (L,), generator=gen, dtype=torch.int32)
        rows[t, min(end, L):] = -1  # bands ending at and around tile edges
    sinks = torch.randn(H, generator=gen) * 3
    sinks[0], sinks[1] = 40.0, -40.0  # a sink that dominates, one that vanishes
    return q.cuda(), pool.cuda(), rows.cuda(), sinks.cuda(), fmt


@pytest.mark.skipif(not _hopper(), reason="the Hopper kernel's FP8 form needs a Hopper GPU")
@pytest.mark.parametrize("T,H,L", [(256, 64, 640), (64, 64, 640), (64, 64, 1152), (8, 64, 384), (1, 64, 640),
                                   (6, 128, 63), (6, 128, 129), (16, 64, 100), (32, 128, 1152)])
def test_fp8_hopper_attention_matches_the_reference_gpu(T, H, L):
    """The role-split Hopper kernel's FP8 form (select.fp8_hopper_attention_config, and forced split counts and
    few persistent programs, so units stream through programs and splits end empty) against the plain-PyTorch
    reference on the dequantized rows (kv_format.dequantize_kv_rows), and against the bf16 Hopper kernel on the same
    rows stored in bf16 (exact: the dequantized values are bf16 values, so the slots hold the same tile)."""
    from sparseserve.kernels.attention import AttnConfig
    from sparseserve.kernels.attention.select import fp8_hopper_attention_config

    q, pool, rows, sinks, fmt = _fp8_hopper_case(T, H, L, 9000, seed=T * 31 + L + H)
    scale = 512**-0.5
    dequantized = dequantize_kv_rows(pool, fmt)
    ref = sparse_mqa_attention_ref(q.float(), dequantized, rows, sinks, scale)
    named = fp8_hopper_attention_config(T, H, L, torch.cuda.get_device_properties(0).multi_processor_count)
    configs = [named] + [AttnConfig("hopper", 64, 64, 4, 2, s, band_prepass=True, max_programs=p)
                         for s, p in ((1, 3), (2, 0), (16, 5))]
    for cfg in configs:
        out = sparse_mqa_attention_triton(q, pool, rows, sinks, scale, cfg, kv_format=fmt)
        torch.cuda.synchronize()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert out.dtype == torch.bfloat16 and (T == 1 or out[0].abs().max().item() == 0.0), cfg
        assert torch.isfinite(out).all() and rel < 1e-2, (cfg, rel)
        if cfg.num_splits == 1:  # the bf16 role-split kernel on the same values
            bf16 = sparse_mqa_attention_triton(q, dequantized.bfloat16(), rows, sinks, scale, cfg)
            torch.testing.assert_close(out, bf16, rtol=1e-2, atol=1e-3)
    # q as a strided view: loaded by cp.async where a contiguous q goes by TMA
    q_view = torch.stack([q, torch.randn_like(q)], 2).flatten(1, 2)[:, ::2]
    out = sparse_mqa_attention_triton(q_view, pool, rows, sinks, scale, named, kv_format=fmt)
    assert (T == 1 or out[0].abs().max().item() == 0.0) and ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not _hopper(), reason="the Hopper kernel's FP8 form needs a Hopper GPU")
def test_fp8_hopper_attention_graph_replay_gpu():
    """Captured once, replayed with new q and rows written in place: equals eager on the new inputs."""
    from sparseserve.kernels.attention.select import fp8_hopper_attention_config

    T, H, L = 64, 64, 640
    q, pool, rows, sinks, fmt = _fp8_hopper_case(T, H, L, 9000, seed=3)
    cfg = fp8_hopper_attention_config(T, H, L, torch.cuda.get_device_properties(0).multi_processor_count)
    run = lambda: sparse_mqa_attention_triton(q, pool, rows, sinks, 512**-0.5, cfg, kv_format=fmt)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q2, _, rows2, _, _ = _fp8_hopper_case(T, H, L, 9000, seed=4)
    q.copy_(q2)
    rows.copy_(rows2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
