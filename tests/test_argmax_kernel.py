"""The two-launch greedy argmax equals torch.argmax (interpreter on CPU; GPU too), ties included."""
import pytest
import torch

from sparseserve.kernels.argmax import BLOCK, greedy_tokens_ref, greedy_tokens_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [BLOCK - 5, 3 * BLOCK + 17])
def test_greedy_tokens_equal_argmax_with_ties_and_edges(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 7
    wide = torch.randn(rows, vocab + 9, generator=gen)  # rows read through a stride larger than V
    logits = wide[:, :vocab]
    top = logits.max() + 1
    logits[0, vocab - 1] = top  # the last column
    logits[1, 0] = top  # the first column
    if vocab > BLOCK:
        logits[2, BLOCK + 3] = top  # equal maxima in two chunks: the earlier chunk's index wins
        logits[2, 2 * BLOCK + 1] = top
        logits[3, BLOCK - 1] = top  # the two sides of a chunk boundary
        logits[3, BLOCK] = top
    logits[4, 10] = logits[4, 11] = top  # equal maxima inside one chunk
    logits[5] = -1e30  # a flat row: index 0
    logits[6, vocab // 2] = float("-inf")
    x = logits.to(DEVICE)
    got = greedy_tokens_triton(x)
    assert got.dtype == torch.int64
    assert got.tolist() == greedy_tokens_ref(x).tolist()


def test_greedy_tokens_of_no_rows():
    assert greedy_tokens_triton(torch.randn(0, 100, device=DEVICE)).shape == (0,)
