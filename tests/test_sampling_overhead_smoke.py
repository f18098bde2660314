"""The sampling-overhead benchmark runs on the CPU with tiny sizes and writes its report."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_sampling_overhead_smoke(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "sampling_overhead.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampling_overhead.py"), "--smoke", "--profile", "--out", str(out)],
                   check=True, timeout=300, cwd=ROOT, capture_output=True)
    report = json.loads(out.read_text())
    for name in ("none", "quarter_penalties", "quarter_json", "quarter_penalties_and_json"):
        assert report["results"][name]["steps"] > 0 and report["results"][name]["median_ms"] > 0
        assert report["results"][name]["host_profile"][0]["us_per_step"] > 0
