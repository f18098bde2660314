"""Top-k tests on the CPU: the reference, and both Triton paths under TRITON_INTERPRET=1.

The GPU tests (real shapes, CUDA-graph replay, the bug-switch regression) live in
tests/test_topk_gpu.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sparseserve.kernels.topk import (
    LB_STEPS,
    IndexerTopK,
    auto_path,
    topk_indices,
    topk_indices_ref,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="triton was imported before TRITON_INTERPRET=1 could be set (run this file alone)"
)


def assert_topk_valid(out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Exact sets against the reference, and sets-with-equal-scores against torch.topk."""
    ref = topk_indices_ref(scores, lengths, k)
    assert out.shape == ref.shape and out.dtype == torch.int32
    for r in range(out.shape[0]):
        n = int(min(max(int(lengths[r]), 0), scores.shape[1]))
        m = min(n, k)
        got = out[r].tolist()
        assert got[m:] == [-1] * (k - m), f"row {r}: slots past min(length, k) must be -1"
        assert sorted(got[:m]) == sorted(ref[r, :m].tolist()), f"row {r} (length {n}): index set differs"
        if m:
            top = torch.topk(scores[r, :n], m).values.sort().values
            mine = scores[r, torch.tensor(got[:m])].sort().values
            assert torch.equal(top, mine), f"row {r}: chosen scores differ from torch.topk"


def make_rows(rows: int, width: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, width, generator=gen)
    if kind == "ties":  # many equal values, so ties straddle the k-th score
        return torch.randint(0, 5, (rows, width), generator=gen).float() * 0.25
    if kind == "mixed":  # negatives, zeros of both signs, infinities among the valid entries
        x = torch.randn(rows, width, generator=gen)
        x[:, ::7] = 0.0
        x[:, 3::7] = -0.0
        x[:, 5::11] = float("-inf")
        x[:, 6::13] = float("inf")
        return x
    if kind == "equal":  # one value everywhere: the bound is the k-th score itself
        return torch.full((rows, width), 0.5)
    if kind == "fewfinite":  # a few finite scores, the rest -inf: the k-th score is -inf
        x = torch.full((rows, width), float("-inf"))
        x[:, 17::97] = torch.randn(rows, len(range(17, width, 97)), generator=gen)
        return x
    if kind == "relu":  # like the indexer: many exact zeros (of both signs), a positive tail
        x = torch.relu(torch.randn(rows, width, generator=gen) - 2.0)
        x[:, 1::5] = -0.0
        return x
    raise ValueError(kind)


# ----------------------------------------------------------------------------- reference


def test_reference_tie_rule_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 9.0], [5.0, 5.0, 5.0, 5.0, 0.0, 0.0]])
    lengths = torch.tensor([5, 3], dtype=torch.int32)  # column 5 of row 0 is ignored
    out = topk_indices_ref(scores, lengths, 4)
    assert sorted(out[0].tolist()) == [1, 2, 3, 4]
    assert out[1].tolist()[:3] == [0, 1, 2] and out[1, 3] == -1


def test_free_function_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 50, generator=gen)
    lengths = torch.tensor([50, 7, 0], dtype=torch.int32)
    assert torch.equal(topk_indices(scores, lengths, 8), topk_indices_ref(scores, lengths, 8))


# ----------------------------------------------------------------------------- Triton paths (interpreter)

CASES = [
    # rows, width, k, kind
    (4, 3000, 64, "random"),
    (3, 2500, 512, "random"),
    (4, 1500, 16, "ties"),
    (3, 2100, 100, "mixed"),
    (2, 4100, 1024, "random"),
]


@needs_interpreter
@pytest.mark.parametrize("tile", [None, 1024])
@pytest.mark.parametrize("path", ["standard", "persistent"])
@pytest.mark.parametrize("rows,width,k,kind", CASES)
def test_triton_paths_match_reference(path, rows, width, k, kind, tile):
    """tile=None: the default plan (one block / chunk per row at these widths); 1024: rows of
    several blocks / chunks, items looping over programs."""
    gen = torch.Generator().manual_seed(rows * 1000 + width + k)
    scores = make_rows(rows, width, gen, kind)
    # Lengths: full, just above k, exactly k, just below k, a chunk boundary, zero.
    choices = [width, k + 1, k, k - 1, 1024, 1025, 0, width - 1]
    lengths = torch.tensor([min(choices[(i * 3 + k) % len(choices)], width) for i in range(rows)], dtype=torch.int32)
    lengths[0] = width
    # Garbage past the length must be ignored, even NaN and +inf.
    for r in range(rows):
        scores[r, int(lengths[r]):] = float("nan") if r % 2 else float("inf")
    if tile is not None and path == "persistent":
        tile = max(tile, 2 * k)  # persistent chunks hold whole strided groups (G = max(1024, 2k))
    op = IndexerTopK(rows, width, k, backend=path, device="cpu", num_programs=3, _tile=tile)
    assert op.path == path
    assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


@needs_interpreter
def test_paths_agree_exactly_including_order():
    """Both paths write the same slots: the entries above the k-th score, then the ties, by index."""
    gen = torch.Generator().manual_seed(7)
    for kind in ("random", "ties"):
        scores = make_rows(3, 2600, gen, kind)
        lengths = torch.tensor([2600, 1800, 300], dtype=torch.int32)
        outs = [
            IndexerTopK(3, 2600, 128, backend=p, device="cpu", num_programs=2, _tile=t)(scores, lengths).clone()
            for p in ("standard", "persistent")
            for t in (None, 1024)
        ]
        for other in outs[1:]:
            assert torch.equal(outs[0], other)


@needs_interpreter
@pytest.mark.parametrize("path", ["standard", "persistent"])
def test_select_starts_below_the_bits_candidates_share(path):
    """The exact search skips the leading bits that the bound and the largest candidate share:
    scores in a narrow band (many shared bits, with near-ties in the last bits), all negative,
    straddling zero, and with one huge outlier (few shared bits)."""
    gen = torch.Generator().manual_seed(12)
    k, width = 64, 2600
    base = torch.randn(4, width, generator=gen)
    rows = torch.stack([
        1000.0 + 1e-4 * base[0],                      # ~15 leading key bits shared
        -3.0 + 0.01 * base[1],                        # negative keys
        0.001 * base[2],                              # around zero, both signs
        torch.where(torch.arange(width) == 77, torch.tensor(3e38), base[3]),
    ])
    lengths = torch.tensor([width, width, 1900, width], dtype=torch.int32)
    op = IndexerTopK(4, width, k, backend=path, device="cpu", num_programs=3, _tile=1024)
    assert_topk_valid(op(rows, lengths).clone(), rows, lengths, k)


@needs_interpreter
@pytest.mark.parametrize("path", ["standard", "persistent"])
def test_search_stops_early_where_exactly_k_keys_reach_it(path):
    """The searches stop once exactly k keys reach the threshold: the select writes those k
    entries, the bound takes the k-th as their minimum. Distinct integer and dyadic scores have
    keys with many trailing zero bits, so the k-th key often equals a search threshold exactly
    (a strict comparison there would lose it); continuous scores stop early on most rows."""
    gen = torch.Generator().manual_seed(21)
    width = 2600
    rows = torch.stack([
        torch.randperm(width, generator=gen).float(),                    # 0 .. width-1
        torch.randperm(width, generator=gen).float() * 0.125 - 100.0,    # dyadic, negative and positive
        torch.randperm(width, generator=gen).float() + 4096.0,           # one binade: long shared prefix
        torch.randn(width, generator=gen),
    ])
    lengths = torch.tensor([width, 2000, width, 2500], dtype=torch.int32)
    for k in (64, 100, 256):
        op = IndexerTopK(4, width, k, backend=path, device="cpu", num_programs=3, _tile=1024)
        assert_topk_valid(op(rows, lengths).clone(), rows, lengths, k)
    # Fewer columns than groups: the group maxima are the scores, distinct integers of 8
    # significant bits, so the bound's 16-bit search meets a threshold with exactly k maxima
    # above it, equal to the k-th of them; a bound one above it would cut off a top-k entry.
    short = torch.cat([torch.arange(128, 256).float(), torch.rand(172, generator=gen) * 100.0])
    short = short[torch.randperm(300, generator=gen)].unsqueeze(0)
    short_lengths = torch.tensor([300], dtype=torch.int32)
    for k in (16, 37):
        op = IndexerTopK(1, 300, k, backend=path, device="cpu", num_programs=3)
        assert_topk_valid(op(short, short_lengths).clone(), short, short_lengths, k)


@needs_interpreter
def test_lengths_around_k_and_chunk_edges():
    gen = torch.Generator().manual_seed(3)
    k, width = 32, 2200
    lens = [0, 1, k - 1, k, k + 1, 1023, 1024, 1025, 2047, 2048, 2049, width]
    scores = make_rows(len(lens), width, gen, "ties")
    lengths = torch.tensor(lens, dtype=torch.int32)
    for path in ("standard", "persistent"):
        op = IndexerTopK(len(lens), width, k, backend=path, device="cpu", num_programs=5, _tile=1024)
        assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


@needs_interpreter
def test_k_larger_than_width_and_fewer_rows_than_max():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 40, generator=gen)
    lengths = torch.tensor([40, 13], dtype=torch.int32)
    for path in ("standard", "persistent"):
        op = IndexerTopK(8, 64, 64, backend=path, device="cpu", num_programs=3)
        out = op(scores, lengths)
        assert out.shape == (2, 64)
        assert_topk_valid(out.clone(), scores, lengths, 64)


@needs_interpreter
def test_persistent_workspace_reset_every_call():
    """Repeated calls on one object stay right: the path zeroes its counters each call."""
    gen = torch.Generator().manual_seed(11)
    op = IndexerTopK(2, 3000, 64, backend="persistent", device="cpu", num_programs=3, _tile=1024)
    for i in range(4):
        scores = torch.randn(2, 3000, generator=gen)
        lengths = torch.tensor([3000 - 100 * i, 500 + i], dtype=torch.int32)
        assert_topk_valid(op(scores, lengths).clone(), scores, lengths, 64)


@needs_interpreter
def test_historical_bug_is_detected(historical_topk_bug):
    """The historical bug (zeroing skipped when the host's longest sequence is short) shows as -2 rows."""
    gen = torch.Generator().manual_seed(13)
    k = 64
    op = IndexerTopK(2, 3000, k, backend="persistent", device="cpu", num_programs=3, _tile=1024)
    lengths = torch.tensor([3000, 2000], dtype=torch.int32)
    scores = torch.randn(2, 3000, generator=gen)
    # A long call with the true host length zeroes and is right.
    historical_topk_bug.host_max_len = 3000
    assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)
    # Frozen at a short host length (as a graph captured at a short length would be): stale counters.
    scores = torch.randn(2, 3000, generator=gen)
    historical_topk_bug.host_max_len = k
    out = op(scores, lengths).clone()
    assert (out == -2).all(), "stale counters must poison the rows with -2"
    # The same object without the frozen short length recovers.
    historical_topk_bug.host_max_len = 3000
    assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


@needs_interpreter
@pytest.mark.parametrize("per_item, pair", [(2, None), (3, None), (4, None), (2, False), (3, False), (1, True)])
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "relu"])
def test_items_of_several_chunks_match_one_chunk_items(per_item, pair, kind, historical_topk_bug):
    """The persistent select with several adjacent chunks per item (3 does not divide the 4
    chunks of a row: its second item has one chunk), done as pairs of chunks (the default there:
    one candidate-count atomic and one arrival per pair) or one chunk at a time, and pairs even in
    items of one chunk (the row's 4 chunks and 2 units; a 3500-column row of 1024-column chunks
    also has a pair whose second chunk is past the length) write exactly what one chunk per item
    writes, on ragged rows (several chunks, fewer than k, none); the historical bug still poisons."""
    gen = torch.Generator().manual_seed(per_item * 7 + len(kind) + 100 * bool(pair))
    k, width = 48, 3500
    scores = make_rows(5, width, gen, kind)
    lengths = torch.tensor([width, 2100, k + 3, k - 5, 0], dtype=torch.int32)
    one = IndexerTopK(5, width, k, backend="persistent", device="cpu", num_programs=3, _tile=1024)
    several = IndexerTopK(5, width, k, backend="persistent", device="cpu", num_programs=3, _tile=1024,
                          _chunks_per_item=per_item, _pair_chunks=pair)
    assert one.chunks_per_unit(5, width) == 1
    assert several.chunks_per_unit(5, width) == (2 if (pair is None and per_item >= 2) or pair else 1)
    historical_topk_bug.host_max_len = width
    expected = one(scores, lengths).clone()
    assert_topk_valid(expected, scores, lengths, k)
    assert torch.equal(several(scores, lengths).clone(), expected)
    historical_topk_bug.host_max_len = k  # frozen short length: stale counters
    out = several(scores, lengths).clone()
    assert (out[:3] == -2).all(), "rows longer than k must be poisoned by stale counters"


@needs_interpreter
def test_pair_past_the_row_end_keeps_the_next_rows_records():
    """A row of 3 chunks ends in a pair whose second chunk is past the row: its record slot is the
    next row's first. With 2 programs the interpreter runs row 0's last pair after row 1's first
    chunk wrote that record, so writing it there would corrupt row 1."""
    gen = torch.Generator().manual_seed(5)
    k, width = 48, 2600
    scores = make_rows(3, width, gen, "random")
    lengths = torch.tensor([width, width, 2100], dtype=torch.int32)
    op = IndexerTopK(3, width, k, backend="persistent", device="cpu", num_programs=2, _tile=1024, _pair_chunks=True)
    expected = IndexerTopK(3, width, k, backend="persistent", device="cpu", num_programs=2, _tile=1024)(scores, lengths)
    assert op.chunks_per_unit(3, width) == 2
    assert torch.equal(op(scores, lengths).clone(), expected.clone())


@needs_interpreter
@pytest.mark.parametrize("select_chunk, per_item", [(1024, 1), (1024, 3), (2048, 2)])
def test_select_chunk_override_matches_the_default(select_chunk, per_item):
    """The benchmark knobs for the select kernel alone (its CHUNK, warps, chunks per item) leave
    the output as the default plan writes it (the bound kernel keeps its 4K chunks here)."""
    gen = torch.Generator().manual_seed(select_chunk + per_item)
    k, width = 48, 3500
    scores = make_rows(4, width, gen, "ties")
    lengths = torch.tensor([width, 2100, k + 3, 0], dtype=torch.int32)
    default = IndexerTopK(4, width, k, backend="persistent", device="cpu", num_programs=3)
    expected = default(scores, lengths).clone()
    assert_topk_valid(expected, scores, lengths, k)
    op = IndexerTopK(4, width, k, backend="persistent", device="cpu", num_programs=5, _select_chunk=select_chunk,
                     _select_warps=4, _chunks_per_item=per_item)
    assert torch.equal(op(scores, lengths).clone(), expected)


@needs_interpreter
@pytest.mark.parametrize("knobs", [{"_bound_chunk": 1024}, {"_bound_chunk": 8192, "_bound_warps": 4},
                                   {"_bound_chunk": 2048}])
def test_bound_kernel_knobs_keep_the_output(knobs):
    """The bound kernel's chunk and warps change only how its group maxima are gathered: the
    row's bound, and so the output, stay the same (ragged rows, several chunks)."""
    gen = torch.Generator().manual_seed(len(str(knobs)))
    k, width = 48, 20000
    scores = make_rows(3, width, gen, "relu")
    lengths = torch.tensor([width, 9000, k + 2], dtype=torch.int32)
    expected = IndexerTopK(3, width, k, backend="persistent", device="cpu")(scores, lengths).clone()
    assert_topk_valid(expected, scores, lengths, k)
    op = IndexerTopK(3, width, k, backend="persistent", device="cpu", **knobs)
    assert torch.equal(op(scores, lengths).clone(), expected)


@needs_interpreter
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "relu"])
@pytest.mark.parametrize("knobs", [{}, {"_tile": 1024, "_chunks_per_item": 2}, {"_tile": 1024, "_pair_chunks": False}])
def test_finish_by_gathers_matches_the_reordering_finish(kind, knobs):
    """The default finish (tie-free rows written from buffer order through the chunk records) writes
    exactly what the reordering finish (_finish_gather=False) writes, slot for slot, on ragged rows
    of several chunks (paired or not), rows with ties at the k-th score and rows of equal scores."""
    gen = torch.Generator().manual_seed(len(kind) + len(knobs))
    k, width = 48, 5000
    scores = make_rows(4, width, gen, kind)
    lengths = torch.tensor([width, 3000, 2051, k + 1], dtype=torch.int32)
    expected = IndexerTopK(4, width, k, backend="persistent", device="cpu", num_programs=3, _finish_gather=False,
                           **knobs)(scores, lengths).clone()
    assert_topk_valid(expected, scores, lengths, k)
    op = IndexerTopK(4, width, k, backend="persistent", device="cpu", num_programs=3, **knobs)
    assert torch.equal(op(scores, lengths).clone(), expected)


def test_bound_chunks_grow_to_32k_only_past_one_wave():
    """16K-column bound chunks, or 32K where 16K chunks outnumber the programs (fewer contending
    atomics; with few rows the extra programs reading the scores win)."""
    from sparseserve.kernels.topk import _bound_chunk
    assert _bound_chunk(262144, 1024, rows=8, programs=264) == 16384  # 128 items of 16K
    assert _bound_chunk(262144, 1024, rows=64, programs=264) == 32768  # 1024 items of 16K
    assert _bound_chunk(262144, 512, rows=64, programs=264, limit=16384) == 16384
    assert _bound_chunk(5000, 512) == 8192 and _bound_chunk(100, 1024) == 2048  # at least G columns


def test_persistent_plan_makes_one_wave_of_items():
    """Where 8K chunks make more items than resident programs, items take several chunks so that
    the grid is one wave (8 x 256K on 132 SMs: 32 chunks a row, 2 per item, 128 items)."""
    from sparseserve.kernels.topk import _persistent_config
    assert _persistent_config(8, 262144, 132, 1024) == (8192, 32, 2, 8)
    assert _persistent_config(1, 262144, 132, 1024)[1:3] == (64, 1)  # 4K chunks
    assert _persistent_config(8, 65536, 132, 1024)[1:3] == (16, 1)
    for rows, width in ((8, 262144), (32, 262144), (3, 100000), (64, 65536)):
        chunk, cpr, per_item, _ = _persistent_config(rows, width, 132, 512)
        assert rows * -(-cpr // per_item) <= 132 and cpr * chunk >= width


@needs_interpreter
def test_default_plan_with_several_chunks_per_item():
    """No overrides: on the CPU (4 'SMs') a few long rows plan several chunks per item."""
    gen = torch.Generator().manual_seed(17)
    k, width = 64, 40000
    scores = make_rows(3, width, gen, "random")
    lengths = torch.tensor([width, 30001, 8193], dtype=torch.int32)
    op = IndexerTopK(3, width, k, backend="persistent", device="cpu")
    assert op.chunks_per_item(3, width) >= 2 and op.chunks_per_unit(3, width) == 2
    assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


@needs_interpreter
@pytest.mark.parametrize("path", ["standard", "persistent"])
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "fewfinite", "relu", "mixed"])
def test_multi_block_rows_every_kind(path, kind):
    """Rows of several 1024-column blocks/chunks: the strided group maxima span blocks, the
    bound and the compaction run over several blocks, and ties at the bound (equal, relu,
    fewfinite: T is 0.5, 0.0 or -inf) take the tie path."""
    gen = torch.Generator().manual_seed(len(kind) * 31 + len(path))
    k = 48
    width = 3500
    scores = make_rows(3, width, gen, kind)
    lengths = torch.tensor([width, 2100, k + 3], dtype=torch.int32)
    op = IndexerTopK(3, width, k, backend=path, device="cpu", num_programs=2, _tile=1024)
    assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


@needs_interpreter
@pytest.mark.parametrize("path", ["standard", "persistent"])
def test_candidate_overflow_takes_the_exact_fallback(path):
    """A capacity below k sends every row with >= k candidates to the exact radix fallback;
    its output equals the reference and the other path's (same slots)."""
    gen = torch.Generator().manual_seed(21)
    k = 64
    for kind in ("random", "ties", "mixed"):
        scores = make_rows(3, 2600, gen, kind)
        lengths = torch.tensor([2600, 1500, 70], dtype=torch.int32)
        small = IndexerTopK(3, 2600, k, backend=path, device="cpu", num_programs=2, _cap=32)
        got = small(scores, lengths).clone()
        assert_topk_valid(got, scores, lengths, k)
        usual = IndexerTopK(3, 2600, k, backend=path, device="cpu", num_programs=2)(scores, lengths)
        assert torch.equal(got, usual)


def candidate_totals(scores: torch.Tensor, k: int, groups: int) -> list[int]:
    """How many candidates each full-length row has: its entries above the bound, the k-th
    largest of the strided group maxima with all but the key's top 2 * LB_STEPS bits cleared
    (as both paths)."""
    totals = []
    for row in scores:
        width = row.shape[0]
        padded = torch.full((-(-width // groups) * groups,), float("-inf"))
        padded[:width] = row
        gmax = padded.view(-1, groups).max(dim=0).values
        bits = gmax.view(torch.int32).long()
        bits = torch.where(bits == -(2**31), 0, bits)
        keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        u = torch.sort(keys + 2**31, descending=True).values[k - 1].item()
        lo_key = max((u & ~((1 << (32 - 2 * LB_STEPS)) - 1)) - 2**31, -2139095041)
        lo_bits = lo_key ^ ((lo_key >> 31) & 0x7FFFFFFF)
        lo = torch.tensor([lo_bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
        totals.append(int((row > lo).sum()))
    return totals


@needs_interpreter
@pytest.mark.parametrize("path", ["standard", "persistent"])
def test_select_on_half_and_whole_candidate_blocks(path):
    """Rows whose candidates fit half the buffer are selected on a half-width block, the others
    on the whole buffer: both give the reference's sets and each other's exact output."""
    k, width, rows = 64, 3000, 6
    scores = torch.randn(rows, width, generator=torch.Generator().manual_seed(8))
    lengths = torch.full((rows,), width, dtype=torch.int32)
    totals = candidate_totals(scores, k, groups=1024)  # G = _tile for standard, 1024 for persistent at k=64
    whole = 1 << (max(totals) - 1).bit_length()
    assert whole // 2 < max(totals) <= whole and min(totals) >= k
    outs = []
    for cap in (whole, 2 * whole):  # the largest row on the whole block; then every row on the half block
        op = IndexerTopK(rows, width, k, backend=path, device="cpu", num_programs=3, _tile=1024, _cap=cap)
        outs.append(op(scores, lengths).clone())
        assert_topk_valid(outs[-1], scores, lengths, k)
    assert torch.equal(outs[0], outs[1])


@needs_interpreter
def test_periodic_rows_overflow_naturally():
    """Large scores on a period that divides G crowd into few groups: the bound is weak, the
    candidates overflow C, and the exact fallback still gives the right answer."""
    k, width = 64, 6144
    scores = torch.randn(2, width, generator=torch.Generator().manual_seed(4))
    scores[:, ::32] += 10.0  # 192 large scores in 32 < k of the 1024 strided groups
    lengths = torch.tensor([width, width - 5], dtype=torch.int32)
    for path in ("standard", "persistent"):
        op = IndexerTopK(2, width, k, backend=path, device="cpu", num_programs=2, _tile=1024, _cap=128)
        assert_topk_valid(op(scores, lengths).clone(), scores, lengths, k)


# ----------------------------------------------------------------------------- interface


def test_auto_picks_from_static_facts_only():
    assert auto_path(1, 262144) == "persistent"
    assert auto_path(4096, 262144) == "standard"
    assert auto_path(4096, 8192) == "standard"
    for rows, width in [(1, 8192), (8, 65536), (64, 262144), (256, 262144)]:
        assert auto_path(rows, width) in ("standard", "persistent")


def test_auto_on_cpu_without_interpreter_falls_back_to_torch():
    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import torch\n"
        "from sparseserve.kernels.topk import IndexerTopK, topk_indices_ref\n"
        "op = IndexerTopK(2, 100, 8, device='cpu')\n"
        "assert op.path == 'torch', op.path\n"
        "s = torch.randn(2, 100); l = torch.tensor([100, 5], dtype=torch.int32)\n"
        "assert torch.equal(op(s, l), topk_indices_ref(s, l, 8))\n"
        "try:\n"
        "    IndexerTopK(2, 100, 8, backend='standard', device='cpu')\n"
        "    raise SystemExit('expected ValueError')\n"
        "except ValueError:\n"
        "    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr


def test_torch_backend_matches_reference():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 300, generator=gen)
    lengths = torch.tensor([300, 20, 0], dtype=torch.int32)
    op = IndexerTopK(4, 300, 32, backend="torch", device="cpu")
    assert torch.equal(op(scores, lengths), topk_indices_ref(scores, lengths, 32))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_rows": 0, "max_width": 10, "k": 4},
        {"max_rows": 2, "max_width": 10, "k": 0},
        {"max_rows": 2, "max_width": 10, "k": 4, "backend": "fast"},
        {"max_rows": 2, "max_width": 10, "k": 4.0},
        {"max_rows": 2, "max_width": 10, "k": 4, "_lb_steps": 0},
        {"max_rows": 2, "max_width": 10, "k": 4, "_exact_steps": 17},
        {"max_rows": 2, "max_width": 10, "k": 4, "_chunks_per_item": 0},
        {"max_rows": 2, "max_width": 10, "k": 4, "_select_chunk": 3000},
        {"max_rows": 2, "max_width": 10, "k": 4, "_select_warps": 2},
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        IndexerTopK(device="cpu", **kwargs)


def test_bad_call_arguments():
    op = IndexerTopK(2, 100, 8, backend="torch", device="cpu")
    good_l = torch.tensor([10, 10], dtype=torch.int32)
    with pytest.raises(ValueError):
        op(torch.randn(2, 100, dtype=torch.float64), good_l)
    with pytest.raises(ValueError):
        op(torch.randn(2, 100), good_l.long())
    with pytest.raises(ValueError):
        op(torch.randn(3, 100), torch.tensor([1, 2, 3], dtype=torch.int32))  # more rows than max_rows
    with pytest.raises(ValueError):
        op(torch.randn(2, 101), good_l)  # wider than max_width
    with pytest.raises(ValueError):
        op(torch.randn(100, 2).t(), good_l)  # non-contiguous rows
    with pytest.raises(ValueError):
        topk_indices(torch.randn(2, 10), good_l, 0)


def test_auto_on_cpu_is_the_reference_even_under_the_interpreter():
    op = IndexerTopK(2, 5000, 16, device="cpu")
    assert op.path == "torch"
