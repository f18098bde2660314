"""Adaptive speculation: the number of drafts a step verifies (0..k), chosen on the host before
the step is scheduled, from the measured acceptance rate and the batch's step costs.

Model (i.i.d. acceptance): each draft is accepted with probability a, independently of the
others, and verification stops at the first rejection. A step that verifies d drafts then emits
    E(d) = 1 + a + ... + a^d = (1 - a^(d+1)) / (1 - a)
tokens per sequence (the accepted drafts and the target's next token). With c(b, d) the time of
such a step at batch b (`StepCosts`), the policy takes the d that maximises E(d) / c(b, d);
d = 0 is a plain decode step (the drafter only catches up, proposing nothing). A d > 0 must beat
d = 0 by `margin` to be taken, so that noise in the estimate does not buy a slower step.

Acceptance estimate: from the engine's verify counts (`SpecDecodeMetrics`): successes are the
accepted drafts, trials the drafts examined (the accepted ones, plus one per step that rejected
one: the drafts after a rejection are never looked at). successes / trials is the maximum-
likelihood a of the i.i.d. model whatever d each step had. Old counts are forgotten
exponentially (`horizon` trials) and a prior of `prior_trials` trials at `prior` starts it.

Probing: while d = 0 is chosen nothing is measured, so after `probe_interval` such steps the
policy takes d = 1 for two steps (the first proposes a draft, the second verifies it), and an
acceptance that has risen is seen again.

The choice is a host decision per step: each d runs its own captured graph (query length 1 + d)
or the plain graph; nothing inside a capture branches on device data (docs/design.md,
"Adaptive speculation").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .metrics import SpecDecodeMetrics

logger = logging.getLogger("sparseserve")


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a sequence emits in a step verifying `num_drafts` drafts, at i.i.d. per-draft acceptance."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(num_drafts + 1)
    return (1.0 - a ** (num_drafts + 1)) / (1.0 - a)


@dataclass
class StepCosts:
    """The time of one decode step per (batch-size bucket, drafts verified): measured from the
    captured graphs (`step_costs.measure_graph_costs`) or modelled (`model_costs`). A missing
    (bucket, d) has no graph of that shape: the policy does not choose it there."""

    buckets: list[int]
    seconds: dict[tuple[int, int], float]
    source: str = "measured"  # "measured" (graph replays) or "model"

    def bucket(self, batch: int) -> int:
        """The smallest bucket holding `batch` sequences (the largest one past it)."""
        for size in self.buckets:
            if size >= batch:
                return size
        return self.buckets[-1]

    def cost(self, batch: int, num_drafts: int) -> float | None:
        return self.seconds.get((self.bucket(batch), num_drafts))

    def as_dict(self) -> dict:
        return {"source": self.source, "buckets": self.buckets,
                "seconds": {f"{b},{d}": s for (b, d), s in sorted(self.seconds.items())}}


def model_costs(buckets: list[int], k: int, num_layers: int, balance_tokens: int = 64) -> StepCosts:
    """A cost model for eager steps, where no graph is timed: a forward over t tokens costs
    max(1, t / balance_tokens) per layer (weight reads bound it up to `balance_tokens`, compute
    past it); a d-draft step is the target over 1 + d tokens, the drafter's catch-up over the
    same positions and its d - 1 single-token draft steps (one layer each)."""
    def layer(tokens: int) -> float:
        return max(1.0, tokens / balance_tokens)

    seconds = {}
    for b in buckets:
        for d in range(k + 1):
            seconds[(b, d)] = (num_layers + 1) * layer(b * (1 + d)) + max(d - 1, 0) * layer(b)
    return StepCosts(sorted(buckets), seconds, "model")


@dataclass
class AdaptivePolicy:
    """Picks each step's number of drafts (see the module docstring)."""

    k: int
    costs: StepCosts
    metrics: SpecDecodeMetrics
    prior: float = 0.6
    prior_trials: float = 8.0
    horizon: float = 2000.0
    margin: float = 0.02
    probe_interval: int = 128
    _successes: float = field(init=False)
    _trials: float = field(init=False)
    _seen: tuple[int, int] = field(init=False, default=(0, 0))
    _idle_steps: int = field(init=False, default=0)
    _probe_left: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start the acceptance estimate again from the prior; the counts recorded so far are ignored."""
        self._successes, self._trials = self.prior * self.prior_trials, self.prior_trials
        self._seen = (self.metrics.num_accepted_tokens, self.metrics.num_checked_tokens)
        self._idle_steps = self._probe_left = 0

    @property
    def acceptance(self) -> float:
        """The running estimate of the per-draft acceptance rate (counts read from the metrics)."""
        accepted, checked = self.metrics.num_accepted_tokens, self.metrics.num_checked_tokens
        new_accepted, new_checked = accepted - self._seen[0], checked - self._seen[1]
        if new_checked > 0:
            keep = math.exp(-new_checked / self.horizon)
            self._successes = self._successes * keep + new_accepted
            self._trials = self._trials * keep + new_checked
            self._seen = (accepted, checked)
        return self._successes / self._trials

    def best(self, batch: int, acceptance: float) -> int:
        """The d in 0..k with the most expected tokens per second at this batch and acceptance."""
        plain = self.costs.cost(batch, 0)
        if plain is None:
            return 0
        best_d, best_rate = 0, (1.0 + self.margin) / plain
        for d in range(1, self.k + 1):
            cost = self.costs.cost(batch, d)
            if cost is not None and expected_tokens(acceptance, d) / cost > best_rate:
                best_d, best_rate = d, expected_tokens(acceptance, d) / cost
        return best_d

    def choose(self, batch: int) -> int:
        """This step's limit on the drafts verified (and proposed for the next step)."""
        if self._probe_left:
            self._probe_left -= 1
            return 1
        d = self.best(max(batch, 1), self.acceptance)
        self._idle_steps = self._idle_steps + 1 if d == 0 else 0
        if self._idle_steps >= self.probe_interval:
            self._idle_steps, self._probe_left = 0, 1
            return 1
        return d

    def table(self, acceptance: float) -> dict[int, int]:
        """The choice per bucket at one acceptance rate (the start-up log, the benchmark's report)."""
        return {b: self.best(b, acceptance) for b in self.costs.buckets}


def attach_policy(scheduler, config, device_type: str, runner, metrics: SpecDecodeMetrics) -> AdaptivePolicy | None:
    """The engine's policy (`config.adaptive_speculation_on`), set as the scheduler's `draft_limit`:
    on the step costs the runner measured from its graphs where there are some, else on the eager
    model. None (and no limit) when off."""
    k = config.num_speculative_tokens
    if not config.adaptive_speculation_on(device_type):
        return None
    measured: StepCosts | None = getattr(runner, "step_costs", None)
    if measured is None:
        seqs = scheduler.max_num_seqs
        buckets = sorted({min(2 ** i, seqs) for i in range(seqs.bit_length() + 1)})
        measured = model_costs(buckets, k, runner.model_config.num_layers)
    policy = AdaptivePolicy(k, measured, metrics)
    scheduler.draft_limit = policy.choose
    logger.info("adaptive speculation: step costs %s; drafts per step by batch bucket at acceptance 0.5 / 0.8: "
                "%s / %s", measured.source, policy.table(0.5), policy.table(0.8))
    return policy
