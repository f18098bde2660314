"""Row-list construction: Triton kernels vs the plain-PyTorch references (exact, int64).

CPU tests run the kernels under TRITON_INTERPRET=1 on ragged batches (decode tokens and
prefill chunks side by side, chunks longer than the ring, positions at window boundaries,
block tables with -1 tails and holes, entry ids beyond the table). GPU tests do the same at
V4-Flash shapes (window 128, rates 4 and 128) and replay the builders from a CUDA graph.
"""
from __future__ import annotations

import os


import pytest
import torch

from sparseserve.kernels import rows as R

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _batch(chunk_lens: list[int], starts: list[int], gen: torch.Generator, device="cpu", max_slots: int | None = None):
    """Flat batch metadata for sequences with the given chunk lengths and start positions:
    tokens of a sequence are contiguous, slots are a shuffled subset of the slot space."""
    B = len(chunk_lens)
    nt = torch.tensor(chunk_lens)
    start = torch.tensor(starts)
    offset = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), nt[:-1]]), 0)
    slots = torch.randperm(max_slots or B + 3, generator=gen)[:B]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, chunk_lens)])
    token_seq = torch.repeat_interleave(torch.arange(B), nt)
    return [x.to(device) for x in (positions, token_seq, start, nt, offset, slots)]


def _block_table(B: int, max_blocks: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Shuffled blocks, -1 tails of random length, one hole inside a table."""
    table = torch.randperm(B * max_blocks + 5, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    used = torch.randint(1, max_blocks + 1, (B,), generator=gen)
    table[torch.arange(max_blocks).unsqueeze(0) >= used.unsqueeze(1)] = -1
    if max_blocks > 2:
        table[0, 1] = -1
    return table.to(device)


def _boundary_starts(rate: int, B: int, gen: torch.Generator) -> list[int]:
    """Start positions at and around window boundaries (0, rate-1, rate, 2*rate-1, ...)."""
    base = [0, rate - 1, rate, 2 * rate - 1, 2 * rate, 5 * rate - 1, 300]
    return [base[i] if i < len(base) else int(torch.randint(0, 4 * rate + 200, (1,), generator=gen)) for i in range(B)]


def _eq(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.int64 and out.shape == ref.shape
    assert torch.equal(out.cpu(), ref.cpu().long()), (out - ref).abs().max()


CHUNKS = [1, 1, 9, 1, 70, 3, 1]  # decode tokens beside prefill chunks; 70 > the small rings below


@pytest.mark.parametrize("window,ring", [(128, 131), (8, 10), (4, 4), (16, 19)])
def test_source_rows_cpu(window, ring):
    gen = torch.Generator().manual_seed(window)
    pos, seq, start, nt, off, slots = _batch(CHUNKS, _boundary_starts(4, len(CHUNKS), gen), gen)
    offsets = torch.arange(-window + 1, 1)
    args = (pos, seq, start, off, slots, offsets, ring, 1000)
    _eq(R.source_rows_triton(*args), R.source_rows_ref(*args))
    # The compressor's sources: only the emitting tokens, span 2*rate (overlap) or rate.
    emit = torch.nonzero((pos + 1) % 4 == 0).flatten()
    args = (pos[emit], seq[emit], start, off, slots, torch.arange(-7, 1), 12, 77)
    _eq(R.source_rows_triton(*args), R.source_rows_ref(*args))


def test_ring_write_rows_cpu():
    gen = torch.Generator().manual_seed(1)
    pos, seq, start, nt, off, slots = _batch(CHUNKS, _boundary_starts(128, len(CHUNKS), gen), gen)
    for ring, trash in [(16, 999), (131, 5000), (4, 3)]:
        args = (pos, seq, start, nt, slots, ring, trash)
        ref = R.ring_write_rows_ref(*args)
        assert (ref == trash).any() or ring > max(CHUNKS)
        _eq(R.ring_write_rows_triton(*args), ref)


def test_ring_write_rows_multi_cpu():
    """Several rings in one launch (and a second launch past four) equal one reference per ring."""
    gen = torch.Generator().manual_seed(2)
    pos, seq, start, nt, off, slots = _batch(CHUNKS, _boundary_starts(128, len(CHUNKS), gen), gen)
    rings = [(16, 999), (131, 5000), (4, 3), (10, 77), (2, 1)]
    for count in (1, 3, 4):
        got = R.ring_write_rows_multi_triton(pos, seq, start, nt, slots, rings[:count])
        assert len(got) == count
        for rows, (ring, trash) in zip(got, rings):
            _eq(rows, R.ring_write_rows_ref(pos, seq, start, nt, slots, ring, trash))
    with pytest.raises(ValueError, match="1 to 4 rings"):
        R.ring_write_rows_multi_triton(pos, seq, start, nt, slots, rings)
    # The dispatch on the CPU: the reference per ring, any number of rings.
    for rows, (ring, trash) in zip(R.ring_write_rows_multi(pos, seq, start, nt, slots, rings), rings):
        _eq(rows, R.ring_write_rows_ref(pos, seq, start, nt, slots, ring, trash))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("K,epb", [(33, 4), (300, 16), (5, 1)])
def test_entry_pool_rows_cpu(id_dtype, K, epb):
    gen = torch.Generator().manual_seed(K + epb)
    pos, seq, *_ = _batch(CHUNKS, _boundary_starts(4, len(CHUNKS), gen), gen)
    T, B, max_blocks = pos.shape[0], len(CHUNKS), 6
    table = _block_table(B, max_blocks, gen)
    # Ids up to beyond the table (clamped column), with -1 holes.
    ids = torch.randint(-1, epb * max_blocks + 2 * epb, (T, K), generator=gen).to(id_dtype)
    args = (ids, seq, table, epb, 123)
    ref = R.entry_pool_rows_ref(*args)
    assert (ref == -1).any() and (ref >= 0).any()
    _eq(R.entry_pool_rows_triton(*args), ref)
    # A strided (column-sliced) id list.
    wide = torch.randint(-1, epb * max_blocks, (T, K + 3), generator=gen).to(id_dtype)
    _eq(R.entry_pool_rows_triton(wide[:, 3:], seq, table, epb, 0), R.entry_pool_rows_ref(wide[:, 3:], seq, table, epb, 0))
    # After prefix rows (the window rows; here a strided slice with -1 holes): the concatenation.
    prefix = torch.randint(-1, 10_000, (T, 140), generator=gen)[:, 3:]
    got = R.entry_pool_rows_triton(*args, prefix=prefix)
    _eq(got, R.entry_pool_rows_ref(*args, prefix=prefix))
    _eq(got, torch.cat([prefix, ref], dim=1))


@pytest.mark.parametrize("rate,epb,num_entries", [(2, 8, 70), (4, 16, 300), (16, 4, 9), (128, 1, 5), (4, 3, 1)])
def test_visible_pool_rows_cpu(rate, epb, num_entries):
    gen = torch.Generator().manual_seed(rate * 7 + num_entries)
    pos, seq, *_ = _batch(CHUNKS, _boundary_starts(rate, len(CHUNKS), gen), gen)
    table = _block_table(len(CHUNKS), max(1, (num_entries + epb - 1) // epb), gen)
    args = (pos, seq, table, rate, num_entries, epb, 40)
    ref = R.visible_pool_rows_ref(*args)
    assert torch.equal(ref, R.entry_pool_rows_ref(R.visible_entry_ids(pos, rate, num_entries), seq, table, epb, 40))
    _eq(R.visible_pool_rows_triton(*args), ref)
    prefix = torch.randint(-1, 10_000, (pos.shape[0], 37), generator=gen)
    got = R.visible_pool_rows_triton(*args, prefix=prefix)
    _eq(got, R.visible_pool_rows_ref(*args, prefix=prefix))
    _eq(got, torch.cat([prefix, ref], dim=1))


@pytest.mark.parametrize("rate,epb", [(2, 8), (4, 16), (16, 4), (128, 1)])
@pytest.mark.parametrize("trash", [-1, 4321])
def test_emit_pool_rows_cpu(rate, epb, trash):
    gen = torch.Generator().manual_seed(rate + trash)
    pos, seq, *_ = _batch(CHUNKS, _boundary_starts(rate, len(CHUNKS), gen), gen)
    table = _block_table(len(CHUNKS), 5, gen)
    args = (pos, seq, table, rate, epb, 50, trash)
    ref = R.emit_pool_rows_ref(*args)
    assert (ref == trash).any()
    _eq(R.emit_pool_rows_triton(*args), ref)
    # The pair: the same rows at a second base of a pool paged alike, one launch.
    first, second = R.emit_pool_rows_triton(*args, second_base=7)
    _eq(first, ref)
    _eq(second, R.emit_pool_rows_ref(pos, seq, table, rate, epb, 7, trash))
    for got, want in zip(R.emit_pool_rows_pair(pos, seq, table, rate, epb, (50, 7), trash),
                         (ref, R.emit_pool_rows_ref(pos, seq, table, rate, epb, 7, trash))):
        _eq(got, want)


@pytest.mark.parametrize("rate,num_entries", [(4, 1000), (4, 3), (128, 2), (1, 7)])
def test_visible_counts_cpu(rate, num_entries):
    gen = torch.Generator().manual_seed(rate * 10 + num_entries)
    pos, *_ = _batch(CHUNKS, _boundary_starts(rate, len(CHUNKS), gen), gen)
    pos = torch.cat([pos, torch.tensor([-1, -2, -rate - 1])])  # padding-like negatives: floor division
    ref = R.visible_counts_ref(pos, rate, num_entries)
    assert ref.dtype == torch.int32
    if num_entries < 10:
        assert (ref == num_entries).any()  # the clamp is exercised
    got = R.visible_counts_triton(pos, rate, num_entries)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    assert R.visible_counts_triton(pos[:0], rate, num_entries).shape == (0,)


def test_empty_and_dispatch_cpu():
    gen = torch.Generator().manual_seed(3)
    e = torch.zeros(0, dtype=torch.long)
    table = _block_table(2, 3, gen)
    assert R.source_rows_triton(e, e, e, e, e, torch.arange(-3, 1), 8, 0).shape == (0, 4)
    assert R.entry_pool_rows_triton(torch.zeros(0, 5, dtype=torch.long), e, table, 4, 0).shape == (0, 5)
    assert R.visible_pool_rows_triton(e, e, table, 4, 7, 4, 0).shape == (0, 7)
    assert R.visible_pool_rows_triton(e, e, table, 4, 7, 4, 0, prefix=torch.zeros(0, 3, dtype=torch.long)).shape == (0, 10)
    assert R.emit_pool_rows_triton(e, e, table, 4, 4, 0, -1).shape == (0,)
    assert R.ring_write_rows_triton(e, e, e, e, e, 8, 0).shape == (0,)
    # On the CPU the public names are the references (the model's CPU parity path).
    pos, seq, start, nt, off, slots = _batch([3, 1], [0, 7], gen)
    args = (pos, seq, start, off, slots, torch.arange(-4, 1), 8, 20)
    _eq(R.source_rows(*args), R.source_rows_ref(*args))
    _eq(R.visible_pool_rows(pos, seq, table, 2, 6, 2, 9), R.visible_pool_rows_ref(pos, seq, table, 2, 6, 2, 9))


# --------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes (window 128, CSA rate 4 with top-512 ids, HCA rate 128), graph replay
# --------------------------------------------------------------------------------------------


def _flash_batch(kind: str, gen: torch.Generator):
    if kind == "decode-256":
        return [1] * 256, [int(x) for x in torch.randint(0, 131072, (256,), generator=gen)]
    if kind == "prefill-4k":
        return [4096], [0]
    return [1] * 60 + [2000, 37], [int(x) for x in torch.randint(0, 32768, (60,), generator=gen)] + [127, 65535]


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
@pytest.mark.parametrize("kind", ["decode-256", "prefill-4k", "mixed"])
def test_rows_flash_shapes_gpu(kind):
    gen = torch.Generator().manual_seed(len(kind))
    chunks, starts = _flash_batch(kind, gen)
    pos, seq, start, nt, off, slots = _batch(chunks, starts, gen, device="cuda", max_slots=300)
    window, ring = 128, 131
    staging = 300 * ring
    args = (pos, seq, start, off, slots, torch.arange(-window + 1, 1, device="cuda"), ring, staging)
    _eq(R.source_rows(*args), R.source_rows_ref(*args))
    args = (pos, seq, start, nt, slots, ring, staging + 4096)
    _eq(R.ring_write_rows(*args), R.ring_write_rows_ref(*args))
    rings = [(ring, staging + 4096), (11, staging + 4097), (259, staging + 4098)]
    for rows, (ring_rows, trash) in zip(R.ring_write_rows_multi(pos, seq, start, nt, slots, rings), rings):
        _eq(rows, R.ring_write_rows_ref(pos, seq, start, nt, slots, ring_rows, trash))
    block_size = 128
    for rate in (4, 128):
        epb = block_size // rate
        num_entries = 131072 // rate + 64
        table = _block_table(len(chunks), (num_entries + epb - 1) // epb, gen, device="cuda")
        emit_args = (pos, seq, table, rate, epb, staging + 4097, -1)
        _eq(R.emit_pool_rows(*emit_args), R.emit_pool_rows_ref(*emit_args))
        kv_rows, index_rows = R.emit_pool_rows_pair(pos, seq, table, rate, epb, (staging + 4097, 0), -1)
        _eq(kv_rows, R.emit_pool_rows_ref(*emit_args))
        _eq(index_rows, R.emit_pool_rows_ref(pos, seq, table, rate, epb, 0, -1))
        span = torch.arange(-2 * rate + 1, 1, device="cuda")  # the compressor's sources (overlap span)
        src = (pos, seq, start, off, slots, span, 2 * rate + 3, 300 * (2 * rate + 3))
        _eq(R.source_rows(*src), R.source_rows_ref(*src))
        if rate == 128:
            vis = (pos, seq, table, rate, num_entries, epb, staging + 4097)
            _eq(R.visible_pool_rows(*vis), R.visible_pool_rows_ref(*vis))
            window = R.source_rows(*src)[:, :128].contiguous()  # stands in for the window rows
            _eq(R.visible_pool_rows(*vis, prefix=window), R.visible_pool_rows_ref(*vis, prefix=window))
        else:
            assert torch.equal(R.visible_counts(pos, rate, num_entries), R.visible_counts_ref(pos, rate, num_entries))
            lengths = ((pos + 1) // rate).clamp(min=1)
            ids = (torch.rand(pos.shape[0], 512, device="cuda") * lengths.unsqueeze(1)).long()
            ids[:, 500:] = -1
            ids = ids.int()  # top-k hands out int32
            _eq(R.entry_pool_rows(ids, seq, table, epb, staging + 4097),
                R.entry_pool_rows_ref(ids, seq, table, epb, staging + 4097))
            window = R.source_rows(*src)[:, :128].contiguous()
            _eq(R.entry_pool_rows(ids, seq, table, epb, staging + 4097, prefix=window),
                R.entry_pool_rows_ref(ids, seq, table, epb, staging + 4097, prefix=window))


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRET, reason="GPU tests need TRITON_INTERPRET=0")
def test_rows_cuda_graph_replay_gpu():
    """All builders captured once; new positions/slots/tables written in place replay right
    (no host sync, no data-dependent host branch)."""
    gen = torch.Generator().manual_seed(11)
    chunks, starts = [1] * 30 + [34], [int(x) for x in torch.randint(0, 40000, (31,), generator=gen)]
    pos, seq, start, nt, off, slots = _batch(chunks, starts, gen, device="cuda", max_slots=64)
    offsets = torch.arange(-127, 1, device="cuda")
    table = _block_table(len(chunks), 400, gen, device="cuda")
    ids = torch.randint(-1, 9000, (pos.shape[0], 512), device="cuda", dtype=torch.int32)
    tensors = (pos, seq, start, nt, off, slots, table, ids)

    def build():
        return (
            R.source_rows(pos, seq, start, off, slots, offsets, 131, 9000),
            R.ring_write_rows(pos, seq, start, nt, slots, 131, 9064),
            R.entry_pool_rows(ids, seq, table, 32, 9065),
            R.visible_pool_rows(pos, seq, table, 128, 400, 1, 9065),
            R.emit_pool_rows(pos, seq, table, 4, 32, 9065, -1),
        )

    def refs():
        return (
            R.source_rows_ref(pos, seq, start, off, slots, offsets, 131, 9000),
            R.ring_write_rows_ref(pos, seq, start, nt, slots, 131, 9064),
            R.entry_pool_rows_ref(ids, seq, table, 32, 9065),
            R.visible_pool_rows_ref(pos, seq, table, 128, 400, 1, 9065),
            R.emit_pool_rows_ref(pos, seq, table, 4, 32, 9065, -1),
        )

    build()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = build()
    for step in range(3):
        starts = [int(x) for x in torch.randint(0, 40000, (31,), generator=gen)]
        new = _batch(chunks, starts, gen, device="cuda", max_slots=64)
        for dst, src in zip(tensors, (*new, _block_table(len(chunks), 400, gen, device="cuda"),
                                      torch.randint(-1, 9000, ids.shape, device="cuda", dtype=torch.int32))):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, refs()):
            _eq(out, ref)
