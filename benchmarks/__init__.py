"""Kernel and step micro-benchmarks, outside the wheel. Run them from the repository root as
`python -m benchmarks.<name>`; `sparseserve bench` runs the ones in `sparseserve/benchmarks/`.
Each writes its one current result to `benchmarks/results/<name>.json` (index: `benchmarks/results/README.md`)."""
import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_file(name: str) -> str:
    """The one current result file of a benchmark: `benchmarks/results/<name>.json`."""
    return str(RESULTS / f"{name}.json")


def write_result(path: str, report: dict) -> None:
    """Write a benchmark's report as JSON to `path`, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
