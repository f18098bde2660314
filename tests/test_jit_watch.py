"""TritonBuilds: records the kernels Triton builds inside a region, chains and restores the hook."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparseserve.benchmarks.jit_watch import TritonBuilds
from sparseserve.benchmarks.throughput import jit_warning_lines

knobs = pytest.importorskip("triton").knobs


def fire(name: str) -> None:
    """What Triton's JIT does after it builds a kernel (keyword arguments as in triton 3.6 and 3.9)."""
    hook = knobs.runtime.jit_post_compile_hook
    if hook is not None:
        hook(key=None, repr=name, fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
             already_compiled=False)


def test_records_builds_inside_only_and_restores_the_hook():
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["fn"].name)
    try:
        fire("before")
        with TritonBuilds() as builds:
            fire("_attn")
            fire("_topk")
            fire("_attn")
        fire("after")
        assert builds.kernels == ["_attn", "_topk", "_attn"]
        assert builds.count == 3 and builds.summary() == ["_attn x2", "_topk x1"]
        assert seen == ["before", "_attn", "_topk", "_attn", "after"]  # the installed hook kept seeing every build
    finally:
        knobs.runtime.jit_post_compile_hook = None
    with TritonBuilds() as empty:
        pass
    assert empty.count == 0 and knobs.runtime.jit_post_compile_hook is None


def test_throughput_report_warns_only_when_the_timed_run_built_kernels():
    assert jit_warning_lines({"triton_builds_in_timed_run": 0}) == []
    assert jit_warning_lines({}) == []
    lines = jit_warning_lines({"triton_builds_in_timed_run": 2, "triton_builds_timed_kernels": ["_attn x2"]})
    assert len(lines) == 1 and "2 Triton kernel build(s)" in lines[0] and "_attn x2" in lines[0]
