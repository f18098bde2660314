"""Token bitmasks: filled on the host (while the device runs the step's forward, which the
runner queues first) and applied to the logits rows on the device. Bit t of word t // 32 set
means token t is allowed."""
from __future__ import annotations

import torch


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] on the host, every token allowed."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask_into(rows: list[tuple[object | None, list[int]]], mask: torch.Tensor) -> None:
    """Write row i of the host bitmask `mask` from rows[i] = (GrammarState, draft prefix); a state of
    None allows every token. Rows without a prefix whose grammar goes on are filled in one batch."""
    batch: list[tuple[object, int]] = []
    words = mask.numpy()  # the same memory: a row write without a tensor op
    for i, (state, prefix) in enumerate(rows):
        if state is None or (not prefix and state.terminated):
            words[i] = -1
        elif prefix:
            state.fill(mask, i, prefix)
        else:
            batch.append((state, i))
    if batch:
        fill_batch(batch, mask)


def fill_batch(states: list[tuple[object, int]], mask: torch.Tensor) -> None:
    """Fill mask[i] for each (GrammarState, i) of grammars that go on (no prefix): one call into
    xgrammar's batch matcher where the installed version has it."""
    first = states[0][0]
    batch = first.batch_matcher()
    if batch is None or len(states) == 1:
        for state, i in states:
            state.fill(mask, i, [])
        return
    batch.batch_fill_next_token_bitmask([s.matcher for s, _ in states], mask, [i for _, i in states])


def fill_bitmask(rows: list[tuple[object, list[int]]], vocab: int) -> torch.Tensor:
    """int32 [len(rows), ceil(vocab / 32)] on the host: row i from (GrammarState, draft prefix)."""
    mask = new_bitmask(len(rows), vocab)
    fill_bitmask_into(rows, mask)
    return mask


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, vocab] of allowed tokens from an int32 bitmask [R, W]."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def word_bits(device: torch.device) -> torch.Tensor:
    """int32 [32]: word i has only bit i set (bit 31 is the sign bit)."""
    return torch.tensor([(1 << i) - (1 << 32 if i == 31 else 0) for i in range(32)], dtype=torch.int32, device=device)


def disallowed_tokens(mask: torch.Tensor, vocab: int, bits: torch.Tensor) -> torch.Tensor:
    """bool [R, vocab] of the tokens an int32 bitmask [R, W] bans; `bits`: `word_bits` on its device."""
    return ((mask.unsqueeze(-1) & bits) == 0).view(mask.shape[0], -1)[:, :vocab]


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Set to -inf, in place, the disallowed tokens of `logits[rows]`."""
    allowed = unpack_bitmask(mask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class BitmaskStaging:
    """Reused buffers for a step's grammar bitmasks: filled on the host into pinned memory and copied
    to a device buffer in one copy. Two host buffers alternate, and one is filled again only after
    its last copy has run (an event recorded after it), so a queued copy never reads a row being
    refilled. On the CPU the host buffer is the device's."""

    def __init__(self) -> None:
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._device: torch.Tensor | None = None
        self._turn = 0

    def host_rows(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """int32 [rows, ceil(vocab / 32)] on the host, free to fill (contents undefined)."""
        words = (vocab + 31) // 32
        k = self._turn
        buf = self._host[k]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            grown = 2 * buf.shape[0] if buf is not None and buf.shape[1] == words else 8
            buf = self._host[k] = torch.empty((max(rows, grown), words), dtype=torch.int32,
                                              pin_memory=device.type == "cuda")
            self._events[k] = None
        if self._events[k] is not None:
            self._events[k].synchronize()
        return buf[:rows]

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The filled rows from `host_rows` on `device` (one non-blocking copy on CUDA)."""
        if device.type != "cuda":
            return host
        dev = self._device
        if dev is None or dev.device != device or dev.shape[0] < host.shape[0] or dev.shape[1] != host.shape[1]:
            dev = self._device = torch.empty(self._host[self._turn].shape, dtype=torch.int32, device=device)
        out = dev[:host.shape[0]]
        out.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
        self._turn ^= 1
        return out
