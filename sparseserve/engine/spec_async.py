"""Async scheduling with speculative decoding (docs/design.md, "Async scheduling with speculation").

A verify step's result decides the next step's positions and inputs (how many drafts were
accepted, the next drafts), so step n + 1 is scheduled after step n is read back. What overlaps
the GPU is the rest of the host's work on step n: the engine records n's counts and tokens
(`advance`), schedules and launches n + 1, and only then runs n's bookkeeping (detokenisation,
stop checks, logprob records, outputs) while the device runs n + 1. A request that n finishes
has its row of n + 1 dropped at collect, as with plain async scheduling.

Requests whose sampling needs host state (a grammar, a multi-token bad word) and requests of a
failed step run synchronously.
"""
from __future__ import annotations

from ..step_types import RunnerOutput
from . import isolation


def advance(engine, launched, result: RunnerOutput) -> None:
    """Record what scheduling the next step needs from a collected step: the pending count, the
    accepted drafts, the emitted tokens (appended without stop checks: `_apply` re-appends them
    one by one with the checks) and the next drafts. Leaves `_apply` the rest."""
    plain = not (result.num_accepted or result.drafts or result.prompt_logprobs)
    for chunk in launched.sched.chunks:
        req = chunk.request
        if chunk.completes:
            req.num_pending_tokens -= 1
        if req.is_finished:
            continue
        rid = req.request_id
        if chunk.num_draft or not plain:
            accepted = result.num_accepted.get(rid, 0)
            req.num_computed_tokens += accepted  # rejected drafts' positions are re-run (position-addressed)
            if chunk.num_draft:
                engine.spec_metrics.record(chunk.num_draft, accepted)
        req.output_token_ids.extend(t.token_id for t in result.sampled.get(rid, ()))
        req.draft_token_ids = result.drafts.get(rid, []) if not plain else []
    engine._advanced_step = launched


def step(engine) -> list:
    """One engine step of async scheduling with speculation (see the module docstring)."""
    previous, engine._in_flight = engine._in_flight, None
    result = None
    if previous is not None:
        try:
            result = engine.runner.collect(previous)
        except Exception as exc:  # noqa: BLE001 - isolation.py re-raises engine faults
            return isolation.requeue_after_failure(engine, exc, [previous.sched])
        if engine._num_host_state or engine._suspects:
            outputs = isolation.apply_isolated(engine, previous, result)  # then synchronous steps
            return outputs + isolation.run_step(engine, engine.scheduler.schedule())
        advance(engine, previous, result)
    elif engine._num_host_state or engine._suspects:
        return isolation.run_step(engine, engine.scheduler.schedule())
    sched = engine.scheduler.schedule()
    failure = None
    try:
        engine._in_flight = engine._launch(sched) if sched.chunks else None
    except Exception as exc:  # noqa: BLE001 - handled after the collected step is applied
        failure = exc
    outputs = []
    if previous is not None:
        try:
            outputs = isolation.apply_isolated(engine, previous, result)
        finally:
            engine._advanced_step = None
    if failure is not None:
        return outputs + isolation.requeue_after_failure(engine, failure, [sched])
    if previous is None and engine._in_flight is None and engine.scheduler.has_unfinished():
        raise RuntimeError("the scheduler could schedule nothing while requests wait; this is a bug")
    return outputs
