"""Token bitmasks: filled on the host (while the device runs the step's forward, which the
runner queues first) and applied to the logits rows on the device. Bit t of word t // 32 set
means token t is allowed."""
from __future__ import annotations

import torch


def fill_bitmask(rows: list[tuple[object, list[int]]], vocab: int) -> torch.Tensor:
    """int32 [len(rows), ceil(vocab / 32)] on the host: row i from (GrammarState, draft prefix)."""
    mask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for i, (state, prefix) in enumerate(rows):
        state.fill(mask, i, prefix)
    return mask


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, vocab] of allowed tokens from an int32 bitmask [R, W]."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Set to -inf, in place, the disallowed tokens of `logits[rows]`."""
    allowed = unpack_bitmask(mask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
