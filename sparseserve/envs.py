"""The environment variables sparseserve reads: the one place that reads them.

Engine choices are `LLM(...)` options, not variables; what is here serves diagnosis.

    SPARSESERVE_LOGGING_LEVEL    the package logger's level (DEBUG, INFO, WARNING, ERROR; default INFO)
    SPARSESERVE_DISABLE_KERNELS  comma-separated kernel names (or `all`) that run their plain-PyTorch
                                 reference on CUDA too (names: kernels/dispatch.py); read at import
    SPARSESERVE_API_KEY          the key `sparseserve serve` requires when --api-key is not given (vLLM's
                                 VLLM_API_KEY); unset: no key
    TRITON_INTERPRET             Triton's own switch (1: kernels run on the CPU in its interpreter);
                                 read here so that kernels can tell, never set here
"""
from __future__ import annotations

import os


def logging_level() -> str:
    """SPARSESERVE_LOGGING_LEVEL, upper-case ("INFO" when unset)."""
    return os.environ.get("SPARSESERVE_LOGGING_LEVEL", "INFO").strip().upper() or "INFO"


def disabled_kernels() -> frozenset[str]:
    """SPARSESERVE_DISABLE_KERNELS as a set of names."""
    raw = os.environ.get("SPARSESERVE_DISABLE_KERNELS", "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def triton_interpret() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET set to anything but 0)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def api_key() -> str | None:
    """SPARSESERVE_API_KEY, or None when unset or empty."""
    return os.environ.get("SPARSESERVE_API_KEY", "").strip() or None
