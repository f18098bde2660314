"""What the driver sends its workers each step, and how a worker turns it back into a step.

The runner reads a step's requests (their tokens, slot, blocks, sampling parameters). A worker
keeps one mirror of each request, sent whole the first time it is scheduled and then updated by
small deltas: the output tokens appended since the last step, the slot, the block list when it
changed, the pending and draft tokens. The mirror is a copy of the engine's request without what
only the engine reads (detokenised text, logprob records, the grammar matcher), so it pickles
small and the runner sees the same fields it sees in one process.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass, field

from ..step_types import ScheduledChunk, SchedulerOutput


@dataclass
class RequestUpdate:
    key: int  # the driver's number for this request object
    new: object | None = None  # the whole mirror, the first time
    output_start: int = 0  # index in output_token_ids of output_tail[0]
    output_tail: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0
    slot: int | None = None
    block_ids: list[int] | None = None  # None: unchanged since the last step
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepMessage:
    # (key, num_tokens, start_pos, completes, num_draft) per scheduled chunk
    chunks: list[tuple[int, int, int, bool, int]]
    updates: list[RequestUpdate]
    forget: list[str] = field(default_factory=list)  # runner.forget(request_id) before the step
    dropped: list[int] = field(default_factory=list)  # mirrors the driver no longer holds


@dataclass
class _Sent:
    key: int
    num_outputs: int
    block_ids: list[int]  # the list object last sent, and its length then
    num_blocks: int


def _mirror_of(req) -> object:
    return dataclasses.replace(req, prompt=None, output_token_ids=list(req.output_token_ids),
                               block_ids=list(req.block_ids), draft_token_ids=list(req.draft_token_ids),
                               grammar=None, logprobs=None, prompt_logprobs=None, text="")


class StepEncoder:
    """Driver side: a `SchedulerOutput` as a `StepMessage` (deltas against what was sent)."""

    def __init__(self) -> None:
        self._keys = itertools.count()
        self._sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._forget: list[str] = []
        self._dropped: list[int] = []

    def forget(self, request_id: str) -> None:
        self._forget.append(request_id)

    def _drop(self, key: int) -> None:
        self._dropped.append(key)

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        chunks, updates = [], []
        for sc in sched.chunks:
            req = sc.request
            sent = self._sent.get(req)
            outputs = req.output_token_ids
            if sent is None or len(outputs) < sent.num_outputs:
                key = next(self._keys) if sent is None else sent.key
                if sent is None:
                    weakref.finalize(req, self._drop, key)
                update = RequestUpdate(key, new=_mirror_of(req), output_start=len(outputs))
                self._sent[req] = sent = _Sent(key, len(outputs), req.block_ids, len(req.block_ids))
            else:
                update = RequestUpdate(sent.key, output_start=sent.num_outputs,
                                       output_tail=outputs[sent.num_outputs:])
                if req.block_ids is not sent.block_ids or len(req.block_ids) != sent.num_blocks:
                    update.block_ids = list(req.block_ids)
                sent.num_outputs, sent.block_ids, sent.num_blocks = len(outputs), req.block_ids, len(req.block_ids)
            update.num_pending_tokens, update.slot = req.num_pending_tokens, req.slot
            update.draft_token_ids = list(req.draft_token_ids) if sc.num_draft else []
            updates.append(update)
            chunks.append((sent.key, sc.num_tokens, sc.start_pos, sc.completes, sc.num_draft))
        msg = StepMessage(chunks, updates, self._forget, self._dropped)
        self._forget, self._dropped = [], []
        return msg

    def pending_housekeeping(self) -> StepMessage:
        """A message of no step that carries the queued forgets and drops (for calls between steps)."""
        msg = StepMessage([], [], self._forget, self._dropped)
        self._forget, self._dropped = [], []
        return msg


class StepDecoder:
    """Worker side: the mirrors, and a `StepMessage` as the `SchedulerOutput` the runner reads."""

    def __init__(self) -> None:
        self.mirrors: dict[int, object] = {}

    def decode(self, msg: StepMessage, forget) -> SchedulerOutput:
        for request_id in msg.forget:
            forget(request_id)
        for key in msg.dropped:
            self.mirrors.pop(key, None)
        for u in msg.updates:
            if u.new is not None:
                self.mirrors[u.key] = u.new
            req = self.mirrors[u.key]
            if u.output_tail:
                del req.output_token_ids[u.output_start:]
                req.output_token_ids.extend(u.output_tail)
            if u.block_ids is not None:
                req.block_ids = u.block_ids
            req.num_pending_tokens, req.slot, req.draft_token_ids = u.num_pending_tokens, u.slot, u.draft_token_ids
        return SchedulerOutput(chunks=[ScheduledChunk(self.mirrors[key], n, start, completes, draft)
                                       for key, n, start, completes, draft in msg.chunks])
