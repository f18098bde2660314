"""Programmatic dependent launch (kernels/pdl.py): the rule that keeps it safe, checked on the
source, and the launch options on the CPU; on a GPU, chains of dependent kernels give the same
bits with and without PDL, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from sparseserve.kernels import pdl

KERNELS_DIR = Path(__file__).resolve().parent.parent / "sparseserve" / "kernels"


def _jit_functions_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found.append((f"{path.name}:{node.name}", node))
    return found


# Kernels that read their weight before the wait (read-only during a step; nothing a previous
# kernel writes): before the wait they may only compute addresses and load through these names.
READS_BEFORE_WAIT = {"_gemv_kernel": ("w_rows",), "_router_partials_kernel": ("w_ptr",)}


def _is_wait(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and ast.unparse(stmt.value) == "wait_for_prior_grid(PDL)")


def test_every_pdl_kernel_waits_before_anything_else():
    """A kernel launched with PDL may start before its predecessor completes: its first statement
    (after the docstring) must be the wait, before any load, store or early return; the kernels
    of READS_BEFORE_WAIT may load only their weight before it, and store nothing."""
    kernels = [(name, node) for name, node in _jit_functions_with_pdl() if node.name != "wait_for_prior_grid"]
    assert len(kernels) >= 25, [name for name, _ in kernels]  # the decode step's kernels
    for name, node in kernels:
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        waits = [i for i, stmt in enumerate(body) if _is_wait(stmt)]
        assert waits, f"{name} never waits"
        allowed = READS_BEFORE_WAIT.get(node.name)
        if allowed is None:
            assert waits[0] == 0, f"{name} starts with {ast.unparse(body[0])}"
            continue
        for stmt in body[:waits[0]]:
            assert isinstance(stmt, ast.Assign), f"{name}: {ast.unparse(stmt)} before the wait"
            for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                fn = ast.unparse(call.func)
                assert not fn.startswith(("tl.store", "tl.atomic")), f"{name} writes before the wait"
                if fn == "tl.load":
                    assert ast.unparse(call.args[0]).startswith(allowed), f"{name} loads {ast.unparse(call.args[0])}"


def test_every_launch_of_a_pdl_kernel_passes_the_launch_options():
    """Each launch of a kernel with a PDL argument passes **pdl_args(...) (the constexpr and, on
    Hopper, launch_pdl), so the wait and the launch attribute always go together."""
    names = {node.name for _, node in _jit_functions_with_pdl()}
    launches = 0
    for path in sorted(KERNELS_DIR.glob("*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
                launches += 1
                starred = [k for k in node.keywords if k.arg is None]
                assert starred and ast.unparse(starred[0].value).startswith("pdl_args("), \
                    f"{path.name}: {node.func.value.id} launched without **pdl_args"
    assert launches >= 25


def test_pdl_is_off_on_the_cpu():
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": 0}
    assert not pdl.pdl_enabled(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dependent_chains_equal_with_and_without_pdl():
    """Each kernel of the chain reads the previous one's output: a missing wait would read stale
    values. Eager and graph replays, RMSNorm chains and RMSNorm/cuBLAS chains."""
    from benchmarks.pdl_bench import measure

    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL is off on this device")
    for kind in ("norms", "norm_gemm"):
        _, plain = measure(kind, 40, 0, reps=2)
        for mode in pdl.TRIGGERS.values():
            _, with_pdl = measure(kind, 40, mode, reps=2)
            assert torch.equal(plain, with_pdl), (kind, mode)
