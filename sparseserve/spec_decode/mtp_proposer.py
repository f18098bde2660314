"""The MTP drafter: keeps the MTP layer's own window state in step with the target and
proposes k draft tokens per request.

Every target step also runs the MTP layer over the same positions, with the target's
residual streams h[t] and the sequence's next token t+1 (so its window state covers every
position). Positions past what the step accepted get placeholder tokens; they are re-run,
and so overwritten, once their real tokens are known (docs/design.md, invariant 4). From the last
accepted position the layer then drafts d_1, and feeds its own streams back for d_2..d_k.
A step that proposes nothing runs the state-only catch-up (`MTPModule.forward_state`): the same
state writes, none of the layer's other work.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.batch import SequenceChunk
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.host_copy import to_device
from ..model.mtp import MTPModule
from ..model.state import ModelState
from ..sample.sampler import SamplingTensors, filtered_probs, uniform_noise

DRAFT_SALT = 0x5BD1E995


@dataclass
class DraftRequest:
    """One sequence of this step, as the drafter needs it."""

    request_id: str
    chunk: SequenceChunk  # the target chunk (positions start_pos .. start_pos + n - 1)
    next_tokens: list[int]  # token at position p + 1 for each chunk position (placeholders past the known ones)
    draft_from: int | None  # index in the chunk of the last accepted position, or None: no draft


# forward(chunks, hidden, input_ids, positions) -> the MTP block's streams, real tokens' rows first (the
# runner's `mtp_forward`: graph replay, padded eager, or plain eager; device ids and positions, if
# given, replace the chunks').
MTPForward = Callable[[list[SequenceChunk], torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
# catch_up(chunks, hidden, input_ids): the layer's state writes alone over the chunks' positions, nothing
# returned (the runner's `mtp_catch_up`: graph replay or eager `MTPModule.forward_state`).
MTPCatchUp = Callable[[list[SequenceChunk], torch.Tensor, torch.Tensor | None], None]


class MTPProposer:
    def __init__(self, mtp: MTPModule, target: DeepseekV4ForCausalLM, state: ModelState, num_tokens: int,
                 forward: MTPForward, catch_up: MTPCatchUp | None = None) -> None:
        self.mtp = mtp
        self.target = target
        self.state = state
        self.k = num_tokens
        self.forward = forward
        # Without a state-only catch-up the full forward catches up (its streams unused).
        self.catch_up: MTPCatchUp = catch_up or (lambda chunks, hidden, ids: forward(chunks, hidden, ids, None))

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], target_streams: torch.Tensor,
                sampling: SamplingTensors | None, num: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Returns (drafts [D, num] int64, draft probs [D, num, V] or None when all greedy, indices of the
        requests that drafted). `sampling` holds one row per drafting request; `num`: drafts per request
        (default k; 0: the layer only catches up)."""
        device = target_streams.device
        num = self.k if num is None else num
        chunks = [SequenceChunk(r.chunk.slot, r.chunk.start_pos, r.next_tokens, r.chunk.block_ids, "none")
                  for r in requests]
        drafting = [i for i, r in enumerate(requests) if r.draft_from is not None] if num else []
        if not drafting:
            self.catch_up(chunks, target_streams, None)  # the window state still follows the target
            return torch.empty(0, num, dtype=torch.long, device=device), None, []
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + len(chunk.token_ids))
        rows = to_device([offsets[i] + requests[i].draft_from for i in drafting], device)
        positions = to_device([requests[i].chunk.start_pos + requests[i].draft_from for i in drafting], device)
        drafts, probs = self.draft(chunks, target_streams, None, rows, [requests[i].chunk for i in drafting],
                                   positions, sampling, num)
        return drafts, probs, drafting

    @torch.no_grad()
    def draft(self, chunks: list[SequenceChunk], target_streams: torch.Tensor, input_ids: torch.Tensor | None,
              rows: torch.Tensor, drafting: list[SequenceChunk], positions: torch.Tensor,
              sampling: SamplingTensors | None, num: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layer over the step's `chunks` (their next tokens: `input_ids` on the device, or the
        chunks' own ids), then draft `num` (default k) tokens for the `drafting` sequences (their slots
        and blocks), from the catch-up rows `rows` at `positions` (both on the device: the general path
        fills them from the host, the fused greedy path from the acceptance counts). Returns (drafts
        [D, num], probs [D, num, V] or None when all greedy)."""
        num = self.k if num is None else num
        if num == 0:
            self.catch_up(chunks, target_streams, input_ids)
            return torch.empty(len(drafting), 0, dtype=torch.long, device=target_streams.device), None
        h = self.forward(chunks, target_streams, input_ids, None)[rows]
        one_token = [SequenceChunk(c.slot, c.start_pos, [0], c.block_ids, "last") for c in drafting]
        drafts, probs = [], []
        for j in range(num):
            token, p = self._sample(self.mtp.compute_logits(h, self.target), sampling, j)
            drafts.append(token)
            probs.append(p)
            if j + 1 == num:
                break
            # Feed the draft back: position + j + 1 sees the block's own streams as h.
            h = self.forward(one_token, h, token, positions + j + 1)[: len(drafting)]
        all_greedy = sampling is None or sampling.all_greedy
        return torch.stack(drafts, dim=1), None if all_greedy else torch.stack(probs, dim=1)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors | None, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        greedy = logits.argmax(dim=-1)
        if st is None or st.all_greedy:
            return greedy, None
        probs = filtered_probs(logits, st)
        noise = -torch.log(uniform_noise(st.seeds ^ DRAFT_SALT, st.counters * 8 + j, logits.shape[1]))
        sampled = (probs / noise).argmax(dim=-1)
        token = torch.where(st.temperature > 0, sampled, greedy)
        # Greedy rows draft deterministically: their q is one-hot on the draft.
        one_hot = torch.nn.functional.one_hot(token, logits.shape[1]).float()
        return token, torch.where((st.temperature > 0).unsqueeze(1), probs, one_hot)
