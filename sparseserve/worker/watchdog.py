"""Hang watchdog: a step that does not finish in time becomes an error, not a hang.

The host waits for a step by polling a CUDA event (never by a blocking sync), so a kernel
that never finishes is reported with what was running: the graph key, batch size,
lengths and top-k path.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepTimeoutError(RuntimeError):
    """A step did not finish within the watchdog's limit (likely a hung kernel)."""


class StepWatchdog:
    def __init__(self, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s

    def wait(self, event: torch.cuda.Event, describe: Callable[[], str]) -> None:
        """Return once `event` completed; raise StepTimeoutError after timeout_s."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                raise StepTimeoutError(
                    f"step did not finish within {self.timeout_s:g} s: {describe()}. The GPU may be hung "
                    "(run with enforce_eager=True and CUDA_LAUNCH_BLOCKING=1 to locate the kernel)")
            # Spin for the first 20 ms (steps end within microseconds of the poll), then doze.
            if now - start > 0.02:
                time.sleep(2e-4)
