"""Which Triton kernels are built while a timed region runs.

Triton builds a kernel the first time a launch meets a new specialisation (new constexprs, or an
integer argument that is newly 1 or divisible by 16): it compiles it, or loads it from its disk
cache. Inside a timed run that adds from tens of milliseconds to seconds to a sub-second figure,
and on a fresh machine (empty cache) it can decide the result. Benchmarks wrap their timed region
in ``TritonBuilds`` and report what it saw; a non-empty list means the warm-up missed those
specialisations and the figure is not a steady-state one.

    with TritonBuilds() as builds:
        run()
    builds.kernels  # names of the kernels built inside, in order
"""
from __future__ import annotations


class TritonBuilds:
    """Records the Triton kernels built while the context is active (chains any installed hook)."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._knobs = None
        self._previous = None

    def __enter__(self) -> "TritonBuilds":
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU-only install): nothing can be built
            return self
        self._knobs = knobs
        self._previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            function = kwargs.get("fn")
            self.kernels.append(str(getattr(function, "name", function)))
            if self._previous is not None:
                return self._previous(*args, **kwargs)
            return None

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc) -> bool:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous
            self._knobs = None
        return False

    @property
    def count(self) -> int:
        return len(self.kernels)

    def summary(self, most: int = 8) -> list[str]:
        """The distinct kernel names, most frequent first (at most `most`)."""
        counts: dict[str, int] = {}
        for name in self.kernels:
            counts[name] = counts.get(name, 0) + 1
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return [f"{name} x{n}" for name, n in ranked[:most]]
