"""MoE kernels against the plain-PyTorch reference.

CPU tests run the Triton kernels under TRITON_INTERPRET=1 (set before triton is imported) on
tiny shapes; `gpu` tests run the compiled kernels, CUDA-graph capture and the _grouped_mm path.
"""
import os

import torch

if not torch.cuda.is_available():  # importing torch does not import triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparseserve.kernels import moe  # noqa: E402

# The kernels run on the CPU only if TRITON_INTERPRET=1 was set before sparseserve was first
# imported (a test module collected earlier may have imported it): then run this file alone.
triton_needed = pytest.mark.skipif(
    not moe.HAS_TRITON or not (torch.cuda.is_available() or moe._INTERPRET),
    reason="needs triton, and on the CPU TRITON_INTERPRET=1 before sparseserve is imported (run this file alone)",
)
LIMIT = 1.5  # small enough that the clamps bite on these random inputs


def make_weights(num_experts: int, hidden: int, inter: int, dtype, device, gen):
    # Scaled so that gate/up values spread across the clamp limit.
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 2).to(dtype).to(device)
    w_down = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype).to(device)
    return w_gate_up, w_down


def random_routing(num_tokens: int, top_k: int, experts: list[int], gen) -> torch.Tensor:
    """Distinct experts per token, drawn from `experts` only (the rest receive no tokens)."""
    pool = torch.tensor(experts)
    rows = [pool[torch.randperm(len(experts), generator=gen)[:top_k]] for _ in range(num_tokens)]
    return torch.stack(rows)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def reference(x, w_gate_up, w_down, weights, ids, limit):
    """The reference in fp32 (the oracle for both fp32 and bf16 runs)."""
    return moe.fused_moe_ref(x.float(), w_gate_up.float(), w_down.float(), weights, ids, limit)


# ------------------------------------------------------------------ alignment


def align_oracle(ids: torch.Tensor, num_experts: int, block_m: int):
    flat = ids.reshape(-1).tolist()
    rows, tiles = [], []
    for e in range(num_experts):
        mine = [i for i, v in enumerate(flat) if v == e]
        if not mine:
            continue
        ntiles = -(-len(mine) // block_m)
        rows += mine + [len(flat)] * (ntiles * block_m - len(mine))
        tiles += [e] * ntiles
    return rows, tiles


ALIGNERS = {"torch": moe.moe_align_torch}
if moe.HAS_TRITON and (torch.cuda.is_available() or moe._INTERPRET):
    ALIGNERS["triton"] = moe.moe_align_triton


@pytest.mark.parametrize("impl", sorted(ALIGNERS))
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 6), (7, 2), (40, 6)])
def test_moe_align_matches_oracle(num_tokens, top_k, block_m, impl):
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    ids = random_routing(num_tokens, top_k, [0, 2, 3, 5, 7], gen) if top_k <= 5 else random_routing(
        num_tokens, top_k, list(range(8)), gen
    )
    sorted_ids, block_expert = ALIGNERS[impl](ids, 8, block_m)
    rows, tiles = align_oracle(ids, 8, block_m)
    padded_rows, num_blocks = moe.moe_align_sizes(ids.numel(), 8, block_m)
    assert sorted_ids.shape == (padded_rows,) and block_expert.shape == (num_blocks,)
    assert sorted_ids[: len(rows)].tolist() == rows
    assert (sorted_ids[len(rows):] == ids.numel()).all()
    assert block_expert[: len(tiles)].tolist() == tiles
    assert (block_expert[len(tiles):] == -1).all()


@pytest.mark.parametrize("impl", sorted(ALIGNERS))
def test_moe_align_worst_case_fills_buffer(impl):
    # Every assignment on its own expert: each pads to a full tile, the static bound is reached.
    ids = torch.arange(8).view(8, 1)
    sorted_ids, block_expert = ALIGNERS[impl](ids, 8, 16)
    assert block_expert.tolist() == list(range(8))
    assert sorted_ids.view(8, 16)[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("impl", sorted(ALIGNERS))
@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_align_skips_negative_expert_ids(impl, block_m):
    """A negative expert id (a prefill graph's padding token) gets no row: the layout is the oracle's over
    the other assignments, in the same static buffer."""
    gen = torch.Generator().manual_seed(3 + block_m)
    ids = torch.randint(0, 8, (13, 2), generator=gen)
    ids[5:9] = -1  # padding tokens
    ids[2, 1] = -1
    sorted_ids, block_expert = ALIGNERS[impl](ids, 8, block_m)
    rows, tiles = align_oracle(ids, 8, block_m)
    padded_rows, num_blocks = moe.moe_align_sizes(ids.numel(), 8, block_m)
    assert sorted_ids.shape == (padded_rows,) and block_expert.shape == (num_blocks,)
    assert sorted_ids[: len(rows)].tolist() == rows and (sorted_ids[len(rows):] == ids.numel()).all()
    assert block_expert[: len(tiles)].tolist() == tiles and (block_expert[len(tiles):] == -1).all()


@triton_needed
@pytest.mark.parametrize("num_experts,num_tokens", [(6, 50), (256, 20), (384, 3)])
def test_moe_align_triton_equals_torch_cpu(num_experts, num_tokens):
    # Wide and non-power-of-two expert counts (V4-Flash 256, V4-Pro 384); duplicates allowed.
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (num_tokens, 6), generator=gen)
    for block_m in (16, 64):
        got = moe.moe_align_triton(ids, num_experts, block_m)
        want = moe.moe_align_torch(ids, num_experts, block_m)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------ Triton path (interpreter on CPU)

CPU_D, CPU_I, CPU_E = 64, 32, 8


def run_case(num_tokens, top_k, experts, dtype, device, seed, config=None, tol=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, CPU_D if device == "cpu" else 512, generator=gen).to(dtype).to(device)
    hidden = x.shape[1]
    inter = CPU_I if device == "cpu" else 256
    num_experts = CPU_E if device == "cpu" else 64
    w_gate_up, w_down = make_weights(num_experts, hidden, inter, dtype, device, gen)
    ids = random_routing(num_tokens, top_k, experts, gen).to(device)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device) + 0.1
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, ids, LIMIT, config=config)
    ref = reference(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    assert err < (tol or (1e-5 if dtype == torch.float32 else 2e-2)), err
    if dtype != torch.float32:  # no worse than the reference run in the same low precision
        ref_lp = moe.fused_moe_ref(x, w_gate_up, w_down, weights, ids, LIMIT)
        assert err < 2 * rel_err(ref_lp, ref) + 1e-3


@triton_needed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_triton_matches_ref_cpu(top_k, dtype):
    # Experts 1 and 4 receive no tokens.
    run_case(13, top_k, [0, 2, 3, 5, 6, 7], dtype, "cpu", seed=top_k)


@triton_needed
def test_triton_skips_padding_tokens_cpu():
    """Tokens whose every assignment is -1 (a prefill graph's padding) take no expert row; the real tokens'
    output is the reference's, and the padding never shifts it (same output with and without them)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(12, CPU_D, generator=gen)
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", gen)
    ids = random_routing(12, 2, list(range(CPU_E)), gen)
    weights = torch.rand(12, 2, generator=gen) + 0.1
    padded_ids = ids.clone()
    padded_ids[7:] = -1
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, padded_ids, LIMIT)
    real = moe.fused_moe_triton(x[:7], w_gate_up, w_down, weights[:7], ids[:7], LIMIT)
    assert torch.equal(out[:7], real)
    assert rel_err(out[:7], reference(x[:7], w_gate_up, w_down, weights[:7], ids[:7], LIMIT)) < 1e-5
    assert torch.equal(moe.fused_moe_ref(x, w_gate_up, w_down, weights, padded_ids, LIMIT)[7:], torch.zeros(5, CPU_D))


@triton_needed
@pytest.mark.parametrize("top_k", [1, 2])
def test_triton_all_tokens_one_expert_cpu(top_k):
    # Every token routes to expert 3 (with top_k 2 the second slot is expert 5): 40 rows on one
    # expert span several 16-row tiles, the other experts get nothing.
    num_tokens = 40
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, CPU_D, generator=gen)
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", gen)
    ids = torch.tensor([[3, 5][:top_k]] * num_tokens)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    cfg = moe.MoeConfig(16, 32, 64, 4, 2, 64, 32, 4, 2)
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, ids, LIMIT, config=cfg)
    ref = reference(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert rel_err(out, ref) < 1e-5


@triton_needed
@pytest.mark.parametrize("m_fastest", [True, False])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_triton_tile_configs_cpu(block_m, m_fastest):
    cfg = moe.MoeConfig(block_m, 16, 32, 4, 2, 32, 16, 4, 2, m_fastest)
    run_case(21, 6, list(range(CPU_E)), torch.float32, "cpu", seed=block_m, config=cfg)


@triton_needed
def test_triton_duplicate_experts_in_a_row_cpu():
    # Hash routing could name one expert twice for a token: each slot still counts once.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, CPU_D, generator=gen)
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", gen)
    ids = torch.tensor([[1, 1], [2, 1], [0, 0], [7, 6], [1, 1]])
    weights = torch.rand(5, 2, generator=gen)
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert rel_err(out, reference(x, w_gate_up, w_down, weights, ids, LIMIT)) < 1e-5


@triton_needed
def test_triton_empty_batch_cpu():
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", torch.Generator().manual_seed(0))
    out = moe.fused_moe_triton(
        torch.empty(0, CPU_D), w_gate_up, w_down, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long), LIMIT
    )
    assert out.shape == (0, CPU_D)


@triton_needed
def test_swiglu_triton_cpu():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(9, 2 * 48, generator=gen) * 3
    out = moe.swiglu_triton(h, LIMIT)
    ref = moe.swiglu_clamped(h[:, :48], h[:, 48:], LIMIT)
    assert torch.allclose(out, ref, atol=1e-6)


@triton_needed
@pytest.mark.parametrize("top_k, hidden, with_shared", [(1, 96, True), (2, 1500, True), (6, 64, False),
                                                        (6, 2100, True)])
def test_moe_combine_triton_cpu(top_k, hidden, with_shared):
    """The combine pass: k slot rows (+ the shared expert's row) per token, hidden sizes that leave
    a ragged last block; fp32 here, so only the summation order differs from the reference."""
    gen = torch.Generator().manual_seed(top_k * hidden)
    y = torch.randn(7 * top_k, hidden, generator=gen) * 3
    shared = torch.randn(7, hidden, generator=gen) if with_shared else None
    out = moe.moe_combine_triton(y, top_k, shared)
    assert out.shape == (7, hidden)
    assert torch.allclose(out, moe.moe_combine_ref(y, top_k, shared), atol=1e-5)


@triton_needed
def test_triton_adds_the_shared_expert_in_its_combine_cpu():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, CPU_D, generator=gen)
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", gen)
    ids = random_routing(6, 2, list(range(CPU_E)), gen)
    weights = torch.rand(6, 2, generator=gen)
    shared = torch.randn(6, CPU_D, generator=gen)
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, ids, LIMIT, shared=shared)
    assert rel_err(out, reference(x, w_gate_up, w_down, weights, ids, LIMIT) + shared) < 1e-5
    empty = moe.fused_moe_triton(torch.empty(0, CPU_D), w_gate_up, w_down, torch.empty(0, 2),
                                 torch.empty(0, 2, dtype=torch.long), LIMIT, shared=torch.empty(0, CPU_D))
    assert empty.shape == (0, CPU_D)


def test_dispatch_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, CPU_D, generator=gen)
    w_gate_up, w_down = make_weights(CPU_E, CPU_D, CPU_I, torch.float32, "cpu", gen)
    ids = random_routing(4, 2, list(range(CPU_E)), gen)
    weights = torch.rand(4, 2, generator=gen)
    out = moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert torch.equal(out, moe.fused_moe_ref(x, w_gate_up, w_down, weights, ids, LIMIT))
    shared = torch.randn(4, CPU_D, generator=gen)
    out = moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT, shared=shared)
    assert torch.equal(out, moe.fused_moe_ref(x, w_gate_up, w_down, weights, ids, LIMIT) + shared)
    logits = torch.randn(4, CPU_E, generator=gen)
    bias = torch.randn(CPU_E, generator=gen) * 0.1
    for got, want in zip(
        moe.select_experts(logits, 2, "sqrtsoftplus", 2.5, bias),
        moe.select_experts_ref(logits, 2, "sqrtsoftplus", 2.5, bias),
    ):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ expert selection


def check_selection(logits, top_k, scoring, scale, bias, hash_ids):
    """Fused selection against select_experts_ref, tie-aware: the chosen experts' biased scores
    must be the top-k values, and the weights are the reference formula on the chosen ids."""
    w, ids = moe.select_experts_triton(logits, top_k, scoring, scale, bias, hash_ids)
    w_ref, ids_ref = moe.select_experts_ref(logits, top_k, scoring, scale, bias, hash_ids)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == ids_ref.shape
    scores = moe.score_experts(logits, scoring)
    if hash_ids is not None:
        assert torch.equal(ids, hash_ids.long())
    else:
        biased = scores.float() + (bias if bias is not None else 0)
        got = biased.gather(1, ids).sort(dim=1).values
        want = biased.gather(1, ids_ref).sort(dim=1).values
        assert torch.equal(got, want)
        assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct experts
    chosen = scores.gather(1, ids).float()
    expect = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * scale
    assert torch.allclose(w, expect, rtol=1e-6, atol=1e-7)
    if logits.dtype == torch.float32 and hash_ids is None:  # no ties in fp32 random logits
        assert torch.equal(ids.sort(dim=1).values, ids_ref.sort(dim=1).values)
        torch.testing.assert_close(w.gather(1, ids.argsort(1)), w_ref.gather(1, ids_ref.argsort(1)))


@triton_needed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("num_experts", [8, 256, 384])
def test_select_experts_triton_cpu(num_experts, scoring, dtype):
    gen = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(5, num_experts, generator=gen) * 4).to(dtype)
    logits[0, :3] = torch.tensor([30.0, -30.0, 25.0])  # softplus's linear and tiny ranges
    bias = torch.randn(num_experts, generator=gen) * 0.1
    hash_ids = torch.randint(0, num_experts, (5, 6), generator=gen)
    check_selection(logits, 6, scoring, 2.5, bias, None)
    check_selection(logits, 6, scoring, 2.5, None, None)
    check_selection(logits, 6, scoring, 2.5, None, hash_ids)
    check_selection(logits, 1, scoring, 1.0, bias, None)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_experts_gpu(dtype):
    gen = torch.Generator().manual_seed(5)
    for num_experts, num_tokens in ((256, 64), (384, 3)):
        logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(dtype).cuda()
        bias = (torch.randn(num_experts, generator=gen) * 0.1).cuda()
        hash_ids = torch.randint(0, num_experts, (num_tokens, 6), generator=gen).cuda()
        for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
            check_selection(logits, 6, scoring, 2.5, bias, None)
            check_selection(logits, 6, scoring, 2.5, None, hash_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 85])
def test_moe_align_triton_equals_torch_gpu(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    for num_experts in (256, 384):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:6] for _ in range(num_tokens)]).cuda()
        for block_m in (16, 32):
            got = moe.moe_align_triton(ids, num_experts, block_m)
            want = moe.moe_align_torch(ids, num_experts, block_m)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_triton_matches_ref_gpu(num_tokens, top_k):
    # Half of the 64 experts receive nothing; the default (static) config for each size.
    run_case(num_tokens, top_k, list(range(0, 64, 2)), torch.bfloat16, "cuda", seed=num_tokens + top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,m_fastest", [(16, True), (32, True), (64, True), (128, False)])
def test_triton_all_tokens_one_expert_gpu(block_m, m_fastest):
    num_tokens, top_k = 333, 2
    gen = torch.Generator().manual_seed(block_m)
    x = torch.randn(num_tokens, 512, generator=gen).bfloat16().cuda()
    w_gate_up, w_down = make_weights(64, 512, 256, torch.bfloat16, "cuda", gen)
    ids = torch.stack([torch.full((num_tokens,), 9), torch.randint(10, 64, (num_tokens,), generator=gen)], 1).cuda()
    weights = (torch.rand(num_tokens, top_k, generator=gen) + 0.1).cuda()
    cfg = moe.MoeConfig(block_m, 32, 64, 4, 3, 64, 64, 4, 3, m_fastest)
    out = moe.fused_moe_triton(x, w_gate_up, w_down, weights, ids, LIMIT, config=cfg)
    assert rel_err(out, reference(x, w_gate_up, w_down, weights, ids, LIMIT)) < 2e-2


def capture_and_replay(fn, num_tokens, top_k, num_experts=64, bitwise=False):
    """Capture fn on static buffers, replay with fresh routings, compare with eager fn."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 512, generator=gen).bfloat16().cuda()
    w_gate_up, w_down = make_weights(num_experts, 512, 256, torch.bfloat16, "cuda", gen)
    ids = random_routing(num_tokens, top_k, list(range(num_experts)), gen).cuda()
    weights = torch.rand(num_tokens, top_k, generator=gen).cuda()
    args = (x, w_gate_up, w_down, weights, ids, LIMIT)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capture
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    routings = [
        random_routing(num_tokens, top_k, list(range(num_experts)), gen),
        random_routing(num_tokens, top_k, [5, 6, 7, 8, 9, 10][: max(top_k, 1) + 1], gen),  # most experts empty
        torch.stack([torch.arange(top_k)] * num_tokens),  # all tokens on the same experts
    ]
    for new_ids in routings:
        ids.copy_(new_ids)
        x.copy_(torch.randn(num_tokens, 512, generator=gen).bfloat16())
        weights.copy_(torch.rand(num_tokens, top_k, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        eager = fn(*args)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        if bitwise:  # no atomics, no split reductions: the replay is the eager function exactly
            assert torch.equal(out, eager)
        assert torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-3)
        assert rel_err(out, reference(*args)) < 2e-2
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k", [(1, 6), (8, 6), (200, 2), (64, 1), (700, 6)])
def test_triton_cuda_graph_replay(num_tokens, top_k):
    capture_and_replay(moe.fused_moe_triton, num_tokens, top_k, bitwise=True)


@pytest.mark.gpu
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("num_tokens,top_k", [(1, 6), (300, 2)])
def test_grouped_mm_path_gpu(num_tokens, top_k):
    if not moe.grouped_mm_available(torch.device("cuda")):
        pytest.skip("_grouped_mm needs sm90+")
    run_case_fn = moe.fused_moe_grouped
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 512, generator=gen).bfloat16().cuda()
    w_gate_up, w_down = make_weights(64, 512, 256, torch.bfloat16, "cuda", gen)
    ids = random_routing(num_tokens, top_k, list(range(0, 64, 3)), gen).cuda()
    weights = torch.rand(num_tokens, top_k, generator=gen).cuda()
    out = run_case_fn(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert rel_err(out, reference(x, w_gate_up, w_down, weights, ids, LIMIT)) < 2e-2
    capture_and_replay(moe.fused_moe_grouped, num_tokens, top_k)


@pytest.mark.gpu
def test_dispatch_gpu_matches_ref():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(33, 512, generator=gen).bfloat16().cuda()
    w_gate_up, w_down = make_weights(64, 512, 256, torch.bfloat16, "cuda", gen)
    logits = torch.randn(33, 64, generator=gen).cuda()
    weights, ids = moe.select_experts(logits, 6, "sqrtsoftplus", 1.5, torch.randn(64, generator=gen).cuda() * 0.1)
    out = moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT)
    assert rel_err(out, reference(x, w_gate_up, w_down, weights, ids, LIMIT)) < 2e-2


def test_tile_sizes_are_powers_of_two_that_divide_odd_model_widths():
    """The demo model (hidden 192, intermediate 128) once got a 192-wide tile, which Triton rejects."""
    from sparseserve.kernels.moe import moe_config

    for hidden, inter in ((192, 128), (4096, 2048), (96, 48), (7168, 2048)):
        for tokens in (1, 64, 200, 4096):
            cfg = moe_config(tokens, 2, 8, hidden, inter)
            for block, size in ((cfg.gu_block_n, inter), (cfg.gu_block_k, hidden), (cfg.dn_block_n, hidden),
                                (cfg.dn_block_k, inter)):
                assert block & (block - 1) == 0 and block <= size, (hidden, inter, tokens, cfg)
                assert size % block == 0 or block == 16, (hidden, inter, tokens, cfg)
