"""Speculative decoding counters, exposed on the engine and logged periodically."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("sparseserve")


@dataclass
class SpecDecodeMetrics:
    log_interval_s: float = 10.0
    num_verify_steps: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Drafts examined: the accepted ones plus the first rejected one of a step, if any (the drafts
    # after it are never looked at); accepted / examined estimates an i.i.d. per-draft acceptance.
    num_checked_tokens: int = 0
    _last_log: float = field(default_factory=time.monotonic)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_checked_tokens += num_accepted + (num_accepted < num_draft)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the next token."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"draft_tokens": self.num_draft_tokens, "accepted_tokens": self.num_accepted_tokens,
                "verify_steps": self.num_verify_steps, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.num_verify_steps and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            logger.info("speculative decoding: %d draft tokens, %d accepted (rate %.3f), mean accepted length %.2f",
                        self.num_draft_tokens, self.num_accepted_tokens, self.acceptance_rate,
                        self.mean_accepted_length)
