"""Rejection sampling keeps the target distribution; greedy verification accepts prefixes."""
import torch

from sparseserve.spec_decode.rejection_sampler import verify


def test_emitted_first_token_follows_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])
    draws = 20000
    drafts = torch.multinomial(q.expand(draws, -1), 1, generator=gen)  # d ~ q
    target = torch.stack([p, p], dim=0).expand(draws, -1, -1)  # [B, k+1, V]
    res = verify(target, target.argmax(-1), drafts, q.expand(draws, 1, -1), torch.zeros(draws, dtype=torch.bool),
                 torch.rand(draws, 1, generator=gen), -torch.log(torch.rand(draws, 2, 5, generator=gen)))
    first = res.tokens[:, 0]
    counts = torch.bincount(first, minlength=5).float()
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.28, chi2  # 4 degrees of freedom, p = 0.01
    accept_rate = float((res.num_accepted == 1).float().mean())
    assert abs(accept_rate - float(torch.minimum(p, q).sum())) < 0.02  # P(accept) = sum min(p, q)


def test_greedy_accepts_the_matching_prefix_and_emits_the_argmax():
    logits = torch.tensor([[[0.0, 3, 1], [5, 0, 0], [0, 0, 9], [1, 7, 0]]])  # argmax 1, 0, 2, 1
    probs = torch.softmax(logits, -1)
    greedy = torch.ones(1, dtype=torch.bool)
    noise = torch.ones(1, 4, 3)
    for drafts, accepted, tokens in (([1, 0, 2], 3, [1, 0, 2, 1]), ([1, 2, 2], 1, [1, 0, -1, -1]),
                                     ([0, 0, 2], 0, [1, -1, -1, -1]), ([1, 0, -1], 2, [1, 0, 2, -1])):
        res = verify(probs, logits.argmax(-1), torch.tensor([drafts]), None, greedy, torch.zeros(1, 3), noise)
        assert int(res.num_accepted) == accepted and res.tokens[0].tolist() == tokens
