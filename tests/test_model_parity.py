"""The model's logits equal the transformers oracle's (float32, CPU), for one full prefill
and for chunked prefill followed by token-by-token decode through the position-addressed
state. Tolerance: 1e-4 absolute on logits of magnitude ~5; float32 reorderings give ~1e-5."""
import pytest
import torch

from oracle import Driver, make_pair, tiny_config

ATOL = 1e-4

CONFIGS = {
    "base": {},
    "hc1": {"hc_mult": 1},
    "hc4-rates-2-8": {
        "hc_mult": 4,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
    },
    "softmax-sigmoid": {"scoring_func": "sigmoid", "num_hash_layers": 2},
    "all-kinds-deeper": {
        "num_hidden_layers": 5,
        "layer_types": ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention"],
        "index_topk": 3, "sliding_window": 6,
    },
}


def oracle_logits(oracle, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_prefill_matches_oracle(name):
    cfg = tiny_config(**CONFIGS[name])
    oracle, ours = make_pair(cfg, seed=3)
    gen = torch.Generator().manual_seed(5)
    # Shorter than the window, between window and top-k reach, and several compress windows long.
    for length in (5, 23, 75):
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist()
        ref = oracle_logits(oracle, ids)
        got = Driver(ours).step([(0, 0, ids)])[0]
        assert (got - ref).abs().max().item() < ATOL, (name, length)


@pytest.mark.parametrize("name", ["base", "hc4-rates-2-8", "all-kinds-deeper"])
def test_chunked_prefill_and_decode_match_oracle_full_forward(name):
    cfg = tiny_config(**CONFIGS[name])
    oracle, ours = make_pair(cfg, seed=4)
    gen = torch.Generator().manual_seed(6)
    lengths = [70, 33, 5, 50]
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    refs = [oracle_logits(oracle, s) for s in seqs]
    driver = Driver(ours)
    # Per sequence: prefill chunk size, then one token per step once `decode_from` is reached.
    plan = {0: (13, 40), 1: (20, 20), 2: (1, 0), 3: (7, 10_000)}
    pos = [0] * len(seqs)
    got = [[] for _ in seqs]
    while any(p < n for p, n in zip(pos, lengths)):
        step = []
        for i, (chunk, decode_from) in plan.items():
            if pos[i] >= lengths[i]:
                continue
            n = 1 if pos[i] >= decode_from else min(chunk, lengths[i] - pos[i])
            n = min(n, lengths[i] - pos[i])
            step.append((i, pos[i], seqs[i][pos[i]:pos[i] + n]))
            pos[i] += n
        for (slot, _, _), logits in zip(step, driver.step(step)):
            got[slot].append(logits)
    for i, ref in enumerate(refs):
        err = (torch.cat(got[i]) - ref).abs().max().item()
        assert err < ATOL, (name, i, err)
