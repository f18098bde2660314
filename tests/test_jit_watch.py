"""TritonBuilds: counts the kernels Triton builds inside a region, without Triton's post-compile hook."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparseserve.benchmarks.jit_watch import TritonBuilds, built_count, engine_kernels
from sparseserve.benchmarks.throughput import jit_warning_lines

triton = pytest.importorskip("triton")


def fake_kernel(name: str) -> SimpleNamespace:
    """A kernel as TritonBuilds sees it: per device, a tuple whose first item is the compiled-kernel cache
    (as `JITFunction.device_caches` holds it in triton 3.6 and 3.9)."""
    return SimpleNamespace(__name__=name, device_caches={0: ({}, {}, None, None, None)})


def build(kernel, device: int = 0) -> None:
    kernel.device_caches.setdefault(device, ({}, {}, None, None, None))[0][object()] = "compiled"


def test_counts_builds_inside_only():
    attn, topk = fake_kernel("_attn"), fake_kernel("_topk")
    build(attn)  # before: not counted
    with TritonBuilds(lambda: [attn, topk]) as builds:
        build(attn)
        build(topk)
        build(attn, device=1)  # another device's cache counts too
    build(topk)  # after: not counted
    assert sorted(builds.kernels) == ["_attn", "_attn", "_topk"]
    assert builds.count == 3 and builds.summary() == ["_attn x2", "_topk x1"]
    assert built_count(attn) == 3 and built_count(topk) == 2
    with TritonBuilds(lambda: [attn, topk]) as empty:
        pass
    assert empty.count == 0


def test_new_builds_name_what_sets_them_apart():
    """A build the warm-up missed is reported with the key fields that differ from the nearest earlier
    build (here an integer argument newly divisible by 16)."""
    kern = fake_kernel("_mix")
    kern.device_caches[0][0]["[('*bf16', 'D'), ('i32', '')]{'num_warps': 4}"] = "compiled"
    with TritonBuilds(lambda: [kern]) as builds:
        kern.device_caches[0][0]["[('*bf16', 'D'), ('i32', 'D')]{'num_warps': 4}"] = "compiled"
    assert builds.kernels == ["_mix"]
    assert builds.new_keys == [("_mix", "'D')]{'num_warps': 4} (was '')]{'num_warps': 4})")]


def test_installs_no_post_compile_hook():
    """Under triton 3.6 any jit_post_compile_hook makes Gluon kernels with layout constexprs fail to build
    (Triton serialises their constexprs to JSON for it): the watch must not install one."""
    assert triton.knobs.runtime.jit_post_compile_hook is None
    with TritonBuilds():
        assert triton.knobs.runtime.jit_post_compile_hook is None
    assert triton.knobs.runtime.jit_post_compile_hook is None


def test_watches_the_engine_kernels():
    """Every compiled kernel object of the loaded engine modules, once (under TRITON_INTERPRET=1 the Triton
    kernels are interpreted functions with no cache, and only the Gluon ones are JIT functions)."""
    from triton.runtime.jit import JITFunction

    from sparseserve.kernels.attention import hopper, hopper_split, triton_kernel

    kernels = engine_kernels()
    ids = {id(k) for k in kernels}
    assert len(kernels) == len(ids) and all(isinstance(k, JITFunction) for k in kernels)
    for module in (triton_kernel, hopper, hopper_split):
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                assert id(value) in ids, value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon attention kernels need a Hopper GPU")
def test_a_gluon_kernel_builds_inside_the_watch_gpu():
    """A Gluon kernel builds inside the watch (a hook-based watch made the Hopper attention kernel fail to build:
    a BlockedLayout is not JSON serializable), and the watch counts the build."""
    from sparseserve.kernels.attention import AttnConfig, hopper, sparse_mqa_attention_ref, sparse_mqa_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(37, 64, 512, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(777, 512, device="cuda", generator=gen).bfloat16()
    rows = torch.randint(0, 777, (37, 93), device="cuda", generator=gen, dtype=torch.int32)
    sinks = torch.randn(64, device="cuda", generator=gen)
    cfg = AttnConfig("hopper", 64, 64, 4, 2, 1, band_prepass=True, max_programs=3)
    # Forget the kernel's compiled specialisations (an earlier test may have built this one), so that the build
    # happens inside the watch (from Triton's disk cache: quick).
    for device_cache in hopper._sparse_mqa_hopper_kernel.device_caches.values():
        for cache in device_cache:
            if isinstance(cache, dict):
                cache.clear()
    with TritonBuilds() as builds:
        out = sparse_mqa_attention_triton(q, kv, rows, sinks, 512 ** -0.5, cfg)
        torch.cuda.synchronize()
    ref = sparse_mqa_attention_ref(q, kv, rows, sinks, 512 ** -0.5)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert "_sparse_mqa_hopper_kernel" in builds.kernels, builds.summary()


def test_throughput_report_warns_only_when_the_timed_run_built_kernels():
    assert jit_warning_lines({"triton_builds_in_timed_run": 0}) == []
    assert jit_warning_lines({}) == []
    lines = jit_warning_lines({"triton_builds_in_timed_run": 2, "triton_builds_timed_kernels": ["_attn x2"]})
    assert len(lines) == 1 and "2 Triton kernel build(s)" in lines[0] and "_attn x2" in lines[0]
