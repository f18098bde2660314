"""The sampler's filters and its counter-based exponential race."""
import torch

from sparseserve.sample.sampler import SamplingTensors, filtered_probs, sample, uniform_noise


def tensors(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counters=None):
    def full(v, dtype):
        return torch.full((batch,), v, dtype=dtype)

    return SamplingTensors(full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                           full(min_p, torch.float32),
                           seeds if seeds is not None else torch.arange(batch),
                           counters if counters is not None else torch.zeros(batch, dtype=torch.int64),
                           top_k > 0, top_p < 1, min_p > 0, temperature == 0)


def test_filters_keep_the_expected_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    assert (filtered_probs(logits, tensors(1, top_k=2)) > 0).tolist() == [[True, True, False, False, False]]
    # top_p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.2 is needed too.
    assert (filtered_probs(logits, tensors(1, top_p=0.75)) > 0).tolist() == [[True, True, True, False, False]]
    assert (filtered_probs(logits, tensors(1, min_p=0.2)) > 0).tolist() == [[True, True, True, False, False]]
    p = filtered_probs(logits, tensors(1, temperature=0.5))
    ref = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(p, ref, atol=1e-6)


def test_exponential_race_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    draws = 20000
    logits = torch.log(probs).expand(draws, -1)
    st = tensors(draws, seeds=torch.full((draws,), 99), counters=torch.arange(draws))
    counts = torch.bincount(sample(logits, st), minlength=5).float()
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_noise_is_uniform_and_deterministic():
    u = uniform_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 0, 0]), 4096)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    st = tensors(4, temperature=0.0)
    assert torch.equal(sample(logits, st), logits.argmax(-1))
