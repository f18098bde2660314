"""One failing request never stops the others.

A step that raises is not retried blindly: its requests are restored to where they were before the
step (state is position-addressed, so re-running a position overwrites what the failed step wrote)
and run again in halves, down to single requests, so the request(s) that make a step fail are found
and finished with `finish_reason="error"` (the message in `stop_reason`, the traceback in the log)
while the others go on. When every request fails alone, a probe step (one token on the padding
slot, no request) tells a request fault from an engine fault: if the probe fails too, the original
exception is raised, so a real engine bug is never hidden. A hung step (`StepTimeoutError`) is
always raised, and so is a failed rank of a parallel layout (`DistributedError`: the executor has
stopped its workers).

With async scheduling a failure drops the step in flight and sends its requests (and the failing
step's) back to the waiting queue to be recomputed; those requests then run in synchronous steps
(bisected as above) until they finish. Counter-based sampling recomputes the same tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import FINISH_ERROR, DistributedError
from ..model.batch import SequenceChunk
from ..worker.watchdog import StepTimeoutError
from .request import Request, RequestStatus
from .scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger("sparseserve")


@dataclass
class _Saved:
    request: Request
    num_computed_tokens: int
    num_pending_tokens: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None


def _snapshot(engine, chunks: list[ScheduledChunk]) -> list[_Saved]:
    probs = engine.runner.draft_probs
    return [_Saved(c.request, c.request.num_computed_tokens, c.request.num_pending_tokens,
                   list(c.request.draft_token_ids), probs.get(c.request.request_id)) for c in chunks]


def _restore(engine, saved: list[_Saved]) -> None:
    probs = engine.runner.draft_probs
    for s in saved:
        req = s.request
        req.num_computed_tokens, req.num_pending_tokens = s.num_computed_tokens, s.num_pending_tokens
        req.draft_token_ids = s.draft_token_ids
        if s.draft_probs is None:
            probs.pop(req.request_id, None)
        else:
            probs[req.request_id] = s.draft_probs


def _launch_and_collect(engine, sched: SchedulerOutput):
    launched = engine._launch(sched)
    return launched, engine.runner.collect(launched)


def run_step(engine, sched: SchedulerOutput) -> list:
    """A synchronous step (launch, read back, apply) whose failure is isolated to its culprits."""
    if not sched.chunks:
        if engine.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could schedule nothing while requests wait; this is a bug")
        return []
    saved = _snapshot(engine, sched.chunks)
    try:
        launched, result = _launch_and_collect(engine, sched)
    except (StepTimeoutError, DistributedError):
        raise
    except Exception as exc:  # noqa: BLE001 - narrowed down below, re-raised if it is the engine's
        _restore(engine, saved)
        return _bisect(engine, sched.chunks, exc)
    return apply_isolated(engine, launched, result)


def _bisect(engine, chunks: list[ScheduledChunk], exc: Exception) -> list:
    logger.warning("a step of %d request(s) failed (%s: %s); running them in smaller groups to find the "
                   "failing request(s)", len(chunks), type(exc).__name__, exc)
    outputs: list = []
    failed: list[tuple[Request, Exception]] = []
    any_ok = False

    def run(part: list[ScheduledChunk]) -> None:
        nonlocal any_ok
        saved = _snapshot(engine, part)
        try:
            launched, result = _launch_and_collect(engine, SchedulerOutput(chunks=part))
        except (StepTimeoutError, DistributedError):
            raise
        except Exception as part_exc:  # noqa: BLE001
            _restore(engine, saved)
            if len(part) == 1:
                failed.append((part[0].request, part_exc))
                return
            run(part[:len(part) // 2])
            run(part[len(part) // 2:])
            return
        any_ok = True
        outputs.extend(apply_isolated(engine, launched, result))

    if len(chunks) == 1:
        failed.append((chunks[0].request, exc))
    else:
        run(chunks[:len(chunks) // 2])
        run(chunks[len(chunks) // 2:])
    if failed and not any_ok and not probe(engine):
        raise exc  # even a step of no request fails: an engine fault, not a request's
    for req, req_exc in failed:
        outputs.extend(fail_request(engine, req, req_exc))
    return outputs


@torch.no_grad()
def probe(engine) -> bool:
    """True when the model runs a one-token step on the padding slot (no request involved)."""
    runner = engine.runner
    chunk = SequenceChunk(slot=runner.max_num_seqs, start_pos=0, token_ids=[0], block_ids=[], want_logits="last")
    try:
        logits, _ = runner.forward([chunk])
        logits.argmax(dim=-1).tolist()
    except Exception:  # noqa: BLE001 - the answer is the point
        logger.exception("the probe step failed too: the engine, not a request, is at fault")
        return False
    return True


def apply_isolated(engine, launched, result) -> list:
    """The engine's host bookkeeping of a collected step; a request whose bookkeeping raises
    (detokenisation, stop checks) is finished with an error and the others are applied."""
    chunks = launched.sched.chunks
    outputs: list = []
    while True:
        try:
            return outputs + engine._apply(launched, result, chunks)
        except Exception as exc:  # noqa: BLE001 - host bookkeeping of one request
            i = engine._applying
            if i < 0:
                raise  # outside the per-request bookkeeping: an engine bug
            culprit = chunks[i].request
            done = [c.request for c in chunks[:i]]
            chunks = chunks[i + 1:]
            outputs += fail_request(engine, culprit, exc)
            for req in done:  # groups those requests finished before the failure
                outputs += _group_output_if_done(engine, req)


def _group_output_if_done(engine, req: Request) -> list:
    group = engine._group_of(req)
    children = engine.groups.get(group)
    if children and all(r.is_finished for r in children):
        return [engine._make_output(group)]
    return []


def fail_request(engine, req: Request, exc: Exception) -> list:
    """Finish a request with finish_reason "error" (the message in stop_reason) and free its state;
    returns its group's output once every sibling has finished."""
    message = f"{type(exc).__name__}: {exc}"
    logger.error("request %s failed and is finished with finish_reason=%r: %s", req.request_id, FINISH_ERROR,
                 message, exc_info=exc)
    engine._suspects.discard(req)
    if req.is_finished:
        return []
    req.finish_reason, req.stop_reason = FINISH_ERROR, message
    req.draft_token_ids = []
    engine.scheduler.finish(req)
    engine.runner.draft_probs.pop(req.request_id, None)
    return _group_output_if_done(engine, req)


def requeue_after_failure(engine, exc: Exception, scheds: list[SchedulerOutput | None]) -> list:
    """An async step failed: drop what is in flight and recompute its requests (synchronously)."""
    if isinstance(exc, (StepTimeoutError, DistributedError)):
        raise exc
    logger.warning("an async step failed (%s: %s); its requests are recomputed in synchronous steps",
                   type(exc).__name__, exc)
    involved: dict[int, Request] = {}
    if engine._in_flight is not None:
        scheds = [*scheds, engine._in_flight.sched]
        engine._in_flight = None
    for sched in scheds:
        for chunk in (sched.chunks if sched is not None else ()):
            involved[id(chunk.request)] = chunk.request
    engine.runner._last_sampled = None
    scheduler = engine.scheduler
    for req in sorted(involved.values(), key=lambda r: r.arrival, reverse=True):
        req.num_pending_tokens = 0
        if req.is_finished:
            continue
        if req in scheduler.running:
            scheduler.running.remove(req)
            scheduler.waiting.appendleft(req)
        scheduler.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        engine.runner.draft_probs.pop(req.request_id, None)
        engine._suspects.add(req)
    return []
