"""Which Triton kernels are built while a region runs (start-up counts its builds; benchmarks check
that their timed region built none).

Triton builds a kernel the first time a launch meets a new specialisation (new constexprs, or an
integer argument that is newly 1 or divisible by 16): it compiles it, or loads it from its disk
cache. Inside a timed run that adds from tens of milliseconds to seconds to a sub-second figure,
and on a fresh machine (empty cache) it can decide the result. Benchmarks wrap their timed region
in ``TritonBuilds`` and report what it saw; a non-empty list means the warm-up missed those
specialisations and the figure is not a steady-state one.

    with TritonBuilds() as builds:
        run()
    builds.kernels  # names of the kernels built inside (one entry per build)

It counts each kernel's compiled specialisations (every device's cache) on entry and on exit. It does
not install Triton's ``jit_post_compile_hook``: under triton 3.6 any such hook makes every Gluon kernel
with layout arguments (the Hopper attention kernels) fail to build, since Triton serialises the
kernel's constexprs to JSON for the hook and a layout does not serialise (the seed workload's
throughput run then crashes on the H200).
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable


def engine_kernels() -> list:
    """Every Triton and Gluon kernel defined at the top level of a loaded `sparseserve` module."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton (CPU-only install): nothing can be built
        return []
    found: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "sparseserve" or name.startswith("sparseserve.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction):
                found[id(value)] = value
    return list(found.values())


def built_count(kernel) -> int:
    """Specialisations `kernel` holds compiled, over its devices (Triton keeps (cache, ...) per device)."""
    return sum(len(entry[0]) for entry in list(getattr(kernel, "device_caches", {}).values()))


def built_keys(kernel) -> set[str]:
    """The cache keys of `kernel`'s compiled specialisations (argument types, their 1 / divisible-by-16
    specialisations, constexpr values and launch options), over its devices."""
    return {str(key) for entry in list(getattr(kernel, "device_caches", {}).values()) for key in list(entry[0])}


def key_difference(new: str, known: set[str]) -> str:
    """What sets key `new` apart from the nearest of `known`: the differing comma-separated fields."""
    fields = new.split(", ")
    best: list[str] | None = None
    for other in known:
        other_fields = other.split(", ")
        diff = [f"{a} (was {b})" for a, b in zip(fields, other_fields) if a != b]
        if len(fields) != len(other_fields):
            diff.append(f"{len(fields)} fields (was {len(other_fields)})")
        if best is None or len(diff) < len(best):
            best = diff
    return "no earlier build" if best is None else "; ".join(best)


def _kernel_name(kernel) -> str:
    return str(getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", kernel))


class TritonBuilds:
    """Records the Triton kernels built while the context is active. `kernels`: which kernels to watch
    (default: those of the loaded `sparseserve` modules, collected on entry)."""

    def __init__(self, kernels: Callable[[], Iterable] = engine_kernels) -> None:
        self._find = kernels
        self._before: list[tuple[object, int, set[str]]] = []
        self.kernels: list[str] = []
        self.new_keys: list[tuple[str, str]] = []  # (kernel, what sets its new build apart from earlier ones)

    def __enter__(self) -> "TritonBuilds":
        self.kernels, self.new_keys = [], []
        self._before = [(kernel, built_count(kernel), built_keys(kernel)) for kernel in self._find()]
        return self

    def __exit__(self, *exc) -> bool:
        for kernel, before, keys in self._before:
            added = built_count(kernel) - before
            if added <= 0:
                continue
            name = _kernel_name(kernel)
            self.kernels += [name] * added
            self.new_keys += [(name, key_difference(key, keys)) for key in sorted(built_keys(kernel) - keys)]
        self._before = []
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
