"""Step metadata on the host: build_batch's fast paths and the per-slot block-table cache agree
with a plain per-token construction."""
import random

import numpy as np
import pytest

from sparseserve.model.batch import BlockTableCache, SequenceChunk, build_batch

RATES = [4, 128]


def expected_fields(chunks: list[SequenceChunk], width: int) -> dict[str, list]:
    """The metadata spelled out token by token."""
    out = {name: [] for name in ("input_ids", "positions", "token_seq", "logits_indices")}
    flat = 0
    for b, c in enumerate(chunks):
        for j, token in enumerate(c.token_ids):
            out["input_ids"].append(token)
            out["positions"].append(c.start_pos + j)
            out["token_seq"].append(b)
            last = j == len(c.token_ids) - 1
            if c.want_logits == "all" or (c.want_logits == "last" and last):
                out["logits_indices"].append(flat)
            flat += 1
    table = np.full((len(chunks), width), -1, dtype=np.int32)
    for b, c in enumerate(chunks):
        table[b, :len(c.block_ids)] = c.block_ids
    out["block_table"] = table.tolist()
    return out


def check(batch, chunks, width) -> None:
    want = expected_fields(chunks, width)
    for name in ("input_ids", "positions", "token_seq", "logits_indices"):
        assert getattr(batch, name).tolist() == want[name], name
    assert batch.block_table.tolist() == want["block_table"]
    assert batch.seq_slots.tolist() == [c.slot for c in chunks]
    for r in RATES:
        closing = [i for i, p in enumerate(want["positions"]) if (p + 1) % r == 0]
        assert batch.emit_tokens[r].tolist() == closing


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed_logits"])
def test_build_batch_matches_token_by_token(kind):
    rng = random.Random(7)
    width = 12
    chunks = []
    for slot in rng.sample(range(40), 9):
        n = 1 if kind == "decode" else rng.randint(1, 9)
        want = rng.choice(["last", "all", "none"]) if kind == "mixed_logits" else "last"
        chunks.append(SequenceChunk(slot=slot, start_pos=rng.randint(0, 150),
                                    token_ids=[rng.randint(1, 500) for _ in range(n)],
                                    block_ids=rng.sample(range(1000), rng.randint(0, width)), want_logits=want))
    check(build_batch(chunks, RATES, max_blocks=width), chunks, width)
    check(build_batch(chunks, RATES, max_blocks=width, tables=BlockTableCache(41, width)), chunks, width)


def test_block_table_cache_follows_growth_and_slot_reuse():
    """Rows follow lists that grow in place, a new request's list in a reused slot (shorter than the
    old one: the old tail must be cleared), and padding chunks with fresh empty lists."""
    width = 8
    cache = BlockTableCache(5, width)
    a, b = [3, 4], [9]
    for step in range(6):
        pad = SequenceChunk(slot=4, start_pos=0, token_ids=[0], block_ids=[])
        chunks = [SequenceChunk(slot=0, start_pos=step, token_ids=[1], block_ids=a),
                  SequenceChunk(slot=2, start_pos=step, token_ids=[1], block_ids=b), pad]
        assert cache.table(chunks).tolist() == expected_fields(chunks, width)["block_table"]
        a.append(10 + step)  # grows in place between steps
        b.append(20 + step)
        if step == 3:
            b = [77]  # slot 2 freed and taken by a request with a shorter, new list
    with pytest.raises(ValueError, match="columns"):
        cache.table([SequenceChunk(slot=1, start_pos=0, token_ids=[1], block_ids=list(range(width + 1)))])


@pytest.mark.parametrize("seed", range(6))
def test_logits_streams_equal_the_gather(seed):
    """`logits_streams` skips the gather exactly when every token wants logits; for any mix of
    chunks (decode, verify, prefill, none) it returns the rows the gather returns."""
    import torch

    rng = random.Random(seed)
    for _ in range(40):
        chunks = []
        for slot in range(rng.randint(1, 6)):
            n = rng.choice([1, 1, 2, 3, 7])
            want = rng.choice(["last", "all", "none"] if seed % 2 else ["last", "all"])
            chunks.append(SequenceChunk(slot=slot, start_pos=rng.randint(0, 50), token_ids=[5] * n,
                                        block_ids=[slot], want_logits=want))
        batch = build_batch(chunks, [4, 128])
        streams = torch.randn(batch.num_tokens, 2, 3)
        got = batch.logits_streams(streams)
        assert torch.equal(got, streams[batch.logits_indices])
        every = all(c.want_logits == "all" or (c.want_logits == "last" and len(c.token_ids) == 1) for c in chunks)
        assert (got is streams) == every
