"""Continuous batching with chunked prefill and preemption by recompute.

Each step: running requests first (in arrival order), then waiting ones, under a token
budget of `max_num_batched_tokens` and at most `max_num_seqs` running. A request that
needs blocks when none are free preempts the newest running request (its blocks and slot
are freed and it restarts from scratch later), possibly itself.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..step_types import ScheduledChunk, SchedulerOutput
from .kv_cache import KVCacheManager
from .request import Request, RequestStatus


def make_chunk(request: Request, num_tokens: int, total: int, num_draft: int = 0) -> ScheduledChunk:
    """`total`: the request's num_tokens_with_pending (its last token closes the chunk that samples)."""
    start = request.num_computed_tokens
    return ScheduledChunk(request, num_tokens, start, start + num_tokens - num_draft == total, num_draft)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, max_model_len: int | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Adaptive speculation (spec_decode/adaptive.py): the step's draft limit from the number of
        # running requests, chosen before the step; None verifies every draft a request has.
        self.draft_limit: Callable[[int], int] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        block_size = self.kv.block_size
        chunks = out.chunks
        limit = out.num_propose = self.draft_limit(len(self.running)) if self.draft_limit is not None else None
        # This loop runs for every running request at every step while the GPU may be waiting, so
        # it reads fields directly instead of calling Request's helpers (same rules, spelled inline):
        # num_tokens_with_pending, ends_by_length_with_pending, KVCacheManager.holds, make_chunk.
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            computed = request.num_computed_tokens
            num_out = len(request.output_token_ids)
            pending = request.num_pending_tokens
            known = len(request.prompt_token_ids) + num_out
            total = known + pending
            n = min(total - computed, budget)
            if n <= 0:
                continue
            if pending:  # the pending tokens surely finish the request: a step more would be thrown away
                max_tokens = request.params.max_tokens
                if (max_tokens is not None and num_out + pending >= max_tokens) or (
                        max_len is not None and total >= max_len):
                    continue
            num_draft = 0
            if request.draft_token_ids and n == known - computed == 1:
                # Verify the drafts too, within the budget and without passing max_model_len.
                room = (max_len - known - 1) if max_len else len(request.draft_token_ids)
                num_draft = max(0, min(len(request.draft_token_ids), budget - 1, room))
                if limit is not None:
                    num_draft = min(num_draft, limit)
                n += num_draft
            need = computed + n
            if request.slot is None or need > len(request.block_ids) * block_size:
                while not self.kv.can_allocate(request, need):
                    victim = self.running[-1]
                    if any(c.request is victim for c in chunks):
                        # Never preempt a request already in this step; stop scheduling instead.
                        victim = request
                    self._preempt(victim, out)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    continue
                self.kv.allocate(request, need)
            chunks.append(ScheduledChunk(request, n, computed, computed + n - num_draft == total, num_draft))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            total = request.num_tokens_with_pending
            remaining = total - request.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.kv.can_allocate(request, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.kv.allocate(request, request.num_computed_tokens + n)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(make_chunk(request, n, total))
            budget -= n
        return out

    def finish(self, request: Request) -> None:
        """Free a finished request's blocks and slot."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
