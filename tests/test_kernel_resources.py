"""The fused mHC kernels' launch configs fit an H100/H200 SM (`tools/kernel_resources.py --mhc-shared`
compiles them for sm_90 on the CPU, outside the interpreter, in a subprocess), and the check
catches the config that failed to launch on the H200."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile_report(flag: str) -> list[dict]:
    """`tools/kernel_resources.py <flag>` in a subprocess (outside the interpreter): its JSON lines."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_resources.py"), flag], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"cannot compile for sm_90 here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_launch_configs_fit_in_shared_memory():
    rows = _compile_report("--mhc-shared")
    assert len(rows) >= 7
    for row in rows:
        assert row["fits"] != row.get("expected_over", False), row


def test_hopper_attention_compiles_for_sm90():
    """The Hopper attention kernel compiles for sm_90a with this Triton (API drift between versions shows here, on
    the CPU), in every form the engine launches (the role-split kernel with q by TMA and by cp.async; the split
    kernel with a band and in one-tile splits without), and fits one block's shared memory. At 168 registers per
    warpgroup the role-split kernel's score warpgroup may spill a few scalars (tens of bytes, reloaded from L1),
    never an accumulator (that would be kilobytes); the split kernel spills nothing."""
    rows = _compile_report("--hopper")
    assert len(rows) == 4 and any(row["band"] is False for row in rows)
    for row in rows:
        spill_limit = 0 if row["kernel"] == "sparse_mqa_split" else 80
        assert row["fits"] and row["spill_stack"] <= spill_limit and row["registers"] <= 255, row


def test_fp8_attention_fits_the_sm():
    """The attention kernel reading packed FP8 KV rows, at the configs the selection launches (stages included),
    compiles for sm_90a, fits one block's shared memory and keeps its registers: under 1 KB of spills at the
    64-head, 64-row blocks (the bf16 64-head variants spill a few hundred bytes: the [64, 512] fp32 accumulator), never the
    kilobytes of a register allocation that gave up (the 16-head, 64-row, one-stage FP8 launch compiled to 32
    registers and 6,880 B of stack under Triton 3.6)."""
    rows = _compile_report("--fp8-engine")
    assert {row["config"].split("block_h=")[1].split(",")[0] for row in rows} == {"64", "16"}
    for row in rows:
        assert row["fits"] and row["spill_stack"] <= 1024 and row["registers"] > 128, row


def test_fp4_gemv_experts_compile_for_sm90_without_spills():
    """The FP4 experts' weight-streaming kernels (kernels/quant/moe_gemv.py) at the variants select.py names compile
    for sm_90a (`tools/quant_kernel_resources.py --only gemv`) and keep their tiles, the next step's bytes and the
    per-lane accumulators in registers: no spill."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "quant_kernel_resources.py"), "--only", "gemv"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"cannot compile for sm_90 here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {row["kernel"] for row in rows} == {"moe_gemv_gate_up", "moe_gemv_down"} and len(rows) >= 4
    for row in rows:
        assert row["fits"] and row["spill_stack"] == 0 and row["registers"] <= 255, row


def test_hopper_fp8_attention_compiles_for_sm90():
    """The role-split Hopper kernel's FP8 form (its output warpgroups dequantize packed FP8 rows into shared memory)
    compiles for sm_90a in the forms its named config launches (one split and two with a band, one-tile splits
    without, q by TMA and by cp.async), fits one block, and spills less than the bf16 form (24 B): its stack is
    the two kernel arguments the prologue stores (as in the bf16 form) and one scalar of the score warpgroup, 16 B;
    the output warpgroups, at FP8_WORKER_REGS, store nothing to local memory (at 168 registers they spilled 40 B of
    loop-invariant addresses). Under Triton 3.6 (168 registers there) the forms keep 16-40 B: a few scalars."""
    import triton

    limit = 16 if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9) else 48
    rows = _compile_report("--hopper-fp8")
    assert len(rows) == 4 and all(row["fp8"] for row in rows) and any(row["band"] is False for row in rows)
    for row in rows:
        assert row["fits"] and row["spill_stack"] <= limit and row["registers"] <= 255, row
