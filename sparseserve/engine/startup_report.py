"""The start-up report's last lines: where start-up spent its time, and the forwards it ran."""
from __future__ import annotations

import logging

from ..config import EngineConfig

logger = logging.getLogger("sparseserve")

PHASES = ("kernel warm-up", "graph capture", "prefill graph capture", "capture audit")


def audit_mode(config: EngineConfig) -> str:
    """The capture audit the runner runs: "off", "sample" (each top-k path's buckets, every start-up)
    or "all" (every bucket; with `cudagraph_audit_replay`)."""
    if not config.cudagraph_audit and not config.cudagraph_audit_replay:
        return "off"
    return "all" if config.cudagraph_audit_replay else "sample"


def log_startup(seconds: float, load_s: float, runner) -> None:
    """The time breakdown (loading the weights, building the kernels of eager steps, capturing the decode and
    the prefill graphs, the capture audit), what was captured, and the forwards start-up ran, kernel builds
    included; no warm-up request runs."""
    phases = getattr(runner, "startup_phases", None)  # None: the ranks of a parallel layout ran them
    parts = [f"loading {load_s:.1f} s"] + [f"{name} {phases[name]:.1f} s" for name in PHASES
                                           if phases and name in phases]
    steps = getattr(runner, "startup_steps", None)
    ran = ("; ".join(f"{what}: {s * 1e3:.1f} ms" for what, s in steps) if steps else
           "none (no cache profiling or graph capture here): the first request's steps are the first forwards")
    breakdown = ", ".join(parts) if phases is not None else f"loading {load_s:.1f} s; the rest in the workers"
    graphs = getattr(runner, "startup_graphs", None)
    captured = "; ".join(graphs) if graphs else "none (enforce_eager, or not on CUDA)" if graphs is not None else \
        "by the workers"
    logger.info("engine ready in %.1f s (%s); CUDA graphs captured: %s; no warm-up request runs at start-up; its "
                "forwards: %s", seconds, breakdown, captured, ran if steps is not None else "run by the workers")
