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
        emitted = [t.token_id for t in result.sampled.get(rid, ())]
        req.output_token_ids.extend(emitted)
        req.draft_token_ids = result.drafts.get(rid, []) if not plain else []
        if emitted and req in engine.scheduler.running and surely_finishes(engine, req, len(emitted)):
            # `_apply` finishes it: its seat and blocks are given back before the next schedule,
            # as a synchronous engine would, so admissions and preemptions (and with them a
            # sampled request's drafts) follow the same steps.
            engine.scheduler.running.remove(req)
            engine.kv.free(req)
    engine._advanced_step = launched


def surely_finishes(engine, req, num_new: int) -> bool:
    """True when `_apply` will finish the request whose last `num_new` outputs were just appended:
    a length limit, eos or a stop token id. A stop string is found by `_apply` only."""
    if req.reaches_length_limit(engine.max_model_len):
        return True
    params, outputs = req.params, req.output_token_ids
    eos = None if params.ignore_eos else engine.eos_token_id
    stops = params.stop_token_ids or ()
    for index in range(max(len(outputs) - num_new, params.min_tokens - 1), len(outputs)):
        token = outputs[index]
        if token == eos or token in stops:
            return True
    return False


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
