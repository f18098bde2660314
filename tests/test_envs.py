"""sparseserve/envs.py is the one registry of environment variables: no other module reads a
SPARSESERVE_* variable, and every variable it reads is documented in its docstring."""
from __future__ import annotations

import ast
import re
from pathlib import Path


from sparseserve import envs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparseserve"


def _environment_reads(tree: ast.AST) -> list[str]:
    """Names of SPARSESERVE_* variables the module reads: os.environ[...] / .get / os.getenv with
    a literal name, or any call given a literal SPARSESERVE_ name (a reader helper)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("SPARSESERVE_"):
                    found.append(arg.value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            key = node.slice
            if isinstance(key, ast.Constant) and str(key.value).startswith("SPARSESERVE_"):
                found.append(key.value)
    return found


def test_no_module_but_envs_reads_a_sparseserve_variable():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "sparseserve/envs.py":
            continue
        reads = _environment_reads(ast.parse(path.read_text(), rel))
        if reads:
            offenders[rel] = reads
    assert not offenders, f"read SPARSESERVE_* variables through sparseserve/envs.py instead: {offenders}"


def test_the_checker_catches_a_read():
    tree = ast.parse("import os\nx = os.environ.get('SPARSESERVE_X', '')\ny = os.environ['SPARSESERVE_Y']\n")
    assert _environment_reads(tree) == ["SPARSESERVE_X", "SPARSESERVE_Y"]


def test_every_variable_read_is_documented():
    source = (PACKAGE / "envs.py").read_text()
    read = set(re.findall(r"os\.environ\.get\(\"([A-Z_]+)\"", source))
    assert read == {"SPARSESERVE_LOGGING_LEVEL", "SPARSESERVE_DISABLE_KERNELS", "SPARSESERVE_API_KEY", "TRITON_INTERPRET",
                    "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    doc = envs.__doc__
    for name in read:
        assert re.search(rf"^\s+{name}\s+\S", doc, re.M), f"{name} lacks its line in envs.py's docstring"
    docs = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "README.md").read_text()
    for name in read:
        assert name in docs, f"{name} is not listed in docs/architecture.md or README.md"


def test_readers(monkeypatch):
    monkeypatch.setenv("SPARSESERVE_DISABLE_KERNELS", " moe, gemv ,,")
    assert envs.disabled_kernels() == {"moe", "gemv"}
    monkeypatch.setenv("SPARSESERVE_LOGGING_LEVEL", "debug")
    assert envs.logging_level() == "DEBUG"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not envs.triton_interpret()


def test_torchrun_layout(monkeypatch):
    for name in ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert envs.torchrun_layout() is None
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert envs.torchrun_layout() == {"nnodes": 2, "node_rank": 1, "master_addr": "node0", "master_port": 29501,
                                      "local_world_size": 1}
