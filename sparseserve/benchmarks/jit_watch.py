"""The Triton build counter, as the benchmarks use it (it lives with the kernels: start-up counts its
builds too)."""
from ..kernels.jit_builds import TritonBuilds, built_count, engine_kernels

__all__ = ["TritonBuilds", "built_count", "engine_kernels"]
