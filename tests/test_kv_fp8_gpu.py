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


@pytest.mark.parametrize("T,L", [(1, 640), (64, 640), (256, 2176)])
def test_fp8_attention_flash_shapes_gpu(T, L):
    gen = torch.Generator().manual_seed(T + L)
    fmt = KVFormat(512, 64)
    pool = quantize_kv_rows(torch.randn(4 * L, 512, generator=gen), fmt).cuda()
    q = torch.randn(T, 64, 512, generator=gen).to("cuda", torch.bfloat16)
    rows = torch.randint(0, 4 * L, (T, L), generator=gen, dtype=torch.int32)
    rows[:, L - 100:] = -1
    sinks = torch.randn(64, generator=gen).cuda()
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
