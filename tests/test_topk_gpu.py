"""Top-k GPU tests: real shapes against the reference and torch.topk, and CUDA-graph replay.

Run with TRITON_INTERPRET unset (or 0): ``PYTHONPATH=. TRITON_INTERPRET=0 pytest -m gpu tests/test_topk_gpu.py``.
"""
from __future__ import annotations

import os

import pytest
import torch

from sparseserve.kernels.topk import (
    _AUTO_MAX_ROWS_PERSISTENT,
    IndexerTopK,
    auto_path,
    topk_indices,
    topk_indices_ref,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")]


def _rows(rows: int, width: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, width, generator=gen, device="cuda")
    if kind == "ties":  # 5 distinct values: ties straddle the k-th score in every row
        return torch.randint(0, 5, (rows, width), generator=gen, device="cuda").float()
    if kind == "relu":  # like the indexer: many exact zeros, then a positive tail
        return torch.relu(torch.randn(rows, width, generator=gen, device="cuda") - 1.0)
    if kind == "sparse":  # fewer positives than k in long rows: the k-th score is 0.0 (ties)
        return torch.relu(torch.randn(rows, width, generator=gen, device="cuda") - 3.5)
    if kind == "fewfinite":  # a few finite scores, the rest -inf: the k-th score is -inf
        x = torch.full((rows, width), float("-inf"), device="cuda")
        x[:, 5::301] = torch.randn(rows, len(range(5, width, 301)), generator=gen, device="cuda")
        return x
    if kind == "periodic":  # large scores on a period dividing G: few groups, candidates overflow
        x = torch.randn(rows, width, generator=gen, device="cuda")
        x[:, ::64] += 10.0
        return x
    if kind == "recent":  # the largest scores clustered at the end of the valid range
        return torch.randn(rows, width, generator=gen, device="cuda") + torch.linspace(0, 6, width, device="cuda")
    raise ValueError(kind)


def _mismatched_rows(out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> list[int]:
    """Rows whose index set differs from the reference, or whose scores differ from torch.topk's."""
    ref = topk_indices_ref(scores, lengths, k)
    bad = (out.sort(dim=1).values != ref.sort(dim=1).values).any(dim=1)
    # Sets with equal scores against torch.topk (on -inf-masked rows; -1 slots compare as -inf).
    width = scores.shape[1]
    valid = torch.arange(width, device=scores.device)[None] < lengths.long()[:, None]
    masked = scores.masked_fill(~valid, float("-inf"))
    kk = min(k, width)
    top = torch.topk(masked, kk, dim=1).values
    slot_valid = torch.arange(kk, device=scores.device)[None] < lengths.long().clamp(max=kk)[:, None]
    top = top.masked_fill(~slot_valid, float("-inf")).sort(dim=1).values
    idx = out[:, :kk].long()
    mine = masked.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf")).sort(dim=1).values
    bad |= (top != mine).any(dim=1)
    return bad.nonzero().flatten().tolist()


SHAPES = [
    # rows, width, k, kind
    (1, 8192, 512, "random"),
    (3, 65536, 1024, "random"),
    (8, 262144, 512, "relu"),
    (64, 16384, 512, "ties"),
    (5, 300001, 1024, "ties"),
    (256, 8192, 1024, "random"),
    (4, 262144, 512, "sparse"),
    (3, 100000, 512, "fewfinite"),
    (2, 262144, 512, "periodic"),
    (16, 65536, 1024, "recent"),
]


@pytest.mark.parametrize("path", ["standard", "persistent"])
@pytest.mark.parametrize("rows,width,k,kind", SHAPES)
def test_paths_match_reference_gpu(path, rows, width, k, kind):
    gen = torch.Generator(device="cuda").manual_seed(rows + width + k)
    scores = _rows(rows, width, gen, kind)
    lens = [width, k - 1, k, k + 1, 0, 2048, 2049, width - 1, 8191, 8193]
    lengths = torch.tensor([min(lens[i % len(lens)], width) for i in range(rows)], dtype=torch.int32, device="cuda")
    lengths[0] = width
    rand_rows = torch.arange(rows, device="cuda") >= len(lens)
    rand_len = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda").int()
    lengths = torch.where(rand_rows, rand_len, lengths)
    # Garbage past each length must be ignored.
    past = torch.arange(width, device="cuda")[None] >= lengths.long()[:, None]
    scores = scores.masked_fill(past, float("inf"))
    op = IndexerTopK(rows, width, k, backend=path)
    out = op(scores, lengths).clone()
    assert _mismatched_rows(out, scores, lengths, k) == []


@pytest.mark.parametrize("rows,width,k,kind", SHAPES[:4])
def test_paths_agree_exactly_gpu(rows, width, k, kind):
    gen = torch.Generator(device="cuda").manual_seed(99)
    scores = _rows(rows, width, gen, kind)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda").int()
    a = IndexerTopK(rows, width, k, backend="standard")(scores, lengths)
    b = IndexerTopK(rows, width, k, backend="persistent")(scores, lengths)
    assert torch.equal(a, b)
    assert torch.equal(topk_indices(scores, lengths, k), a)


@pytest.mark.parametrize("path", ["standard", "persistent"])
def test_forced_overflow_fallback_gpu(path):
    """A capacity below k sends every row to the exact fallback: same slots as the usual run."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    rows, width, k = 4, 65536, 512
    scores = _rows(rows, width, gen, "random")
    lengths = torch.tensor([width, 40000, 513, 9000], dtype=torch.int32, device="cuda")
    got = IndexerTopK(rows, width, k, backend=path, _cap=256)(scores, lengths).clone()
    assert _mismatched_rows(got, scores, lengths, k) == []
    assert torch.equal(got, IndexerTopK(rows, width, k, backend=path)(scores, lengths))


def test_standard_more_rows_than_programs_gpu():
    gen = torch.Generator(device="cuda").manual_seed(9)
    rows, width, k = 300, 8192, 512
    scores = _rows(rows, width, gen, "random")
    lengths = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda").int()
    out = IndexerTopK(rows, width, k, backend="standard", num_programs=37)(scores, lengths).clone()
    assert _mismatched_rows(out, scores, lengths, k) == []


def test_auto_around_the_crossover_gpu():
    """Shapes just below and above each measured crossover: auto picks statically and is right."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for width_limit, rows_limit in _AUTO_MAX_ROWS_PERSISTENT:
        width = min(width_limit, 262144)
        for rows in sorted({max(1, rows_limit), rows_limit + 1}):
            op = IndexerTopK(rows, width, 512)
            assert op.path == auto_path(rows, width)
            scores = _rows(rows, width, gen, "random")
            lengths = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda").int()
            assert _mismatched_rows(op(scores, lengths).clone(), scores, lengths, 512) == []


def _graph_replay_mismatches(path: str, bug=None, replays: int = 24) -> int:
    """Capture at a short length, replay at long lengths and back; count replays != eager.
    `bug`: the `historical_topk_bug` fixture, or None for the real path."""
    rows, width, k = 4, 131072, 512
    short = 300  # < k: the capture-time batch is short
    gen = torch.Generator(device="cuda").manual_seed(1234)
    scores = torch.randn(rows, width, generator=gen, device="cuda")
    lengths = torch.full((rows,), short, dtype=torch.int32, device="cuda")
    op = IndexerTopK(rows, width, k, backend=path)
    eager = IndexerTopK(rows, width, k, backend=path)
    if bug is not None:
        bug.host_max_len = short  # the host sees a short longest sequence while capturing
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compiles the kernels outside the capture
            op(scores, lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(scores, lengths)
    if bug is not None:
        bug.host_max_len = None  # eager calls below see their real lengths and zero
    bad = 0
    pattern = [width, short, width, width - 7, 5000, k, k + 1, width]
    for i in range(replays):
        kind = ("random", "ties", "relu")[i % 3]
        scores.copy_(_rows(rows, width, gen, kind))
        base = pattern[i % len(pattern)]
        lengths.copy_(torch.tensor([base, max(0, base - 1000), min(width, base + 3), base // 2], dtype=torch.int32))
        graph.replay()
        got = out.clone()
        want = eager(scores, lengths).clone()
        if not torch.equal(got, want) or _mismatched_rows(got, scores, lengths, k):
            bad += 1
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("path", ["standard", "persistent", "torch"])
def test_graph_replay_equals_eager_gpu(path):
    assert _graph_replay_mismatches(path) == 0


def test_historical_bug_is_detected_by_graph_replay_gpu(historical_topk_bug):
    """The historical bug (zeroing skipped at a short capture) must be caught, not hang."""
    assert _graph_replay_mismatches("persistent", historical_topk_bug) > 0

