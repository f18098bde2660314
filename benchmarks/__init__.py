"""Kernel and step micro-benchmarks, outside the wheel. Run them from the repository root as
`python -m benchmarks.<name>`; `sparseserve bench` runs the ones in `sparseserve/benchmarks/`.
Each writes its one current result to `benchmarks/results/<name>.json` (index: `benchmarks/results/README.md`)."""
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_file(name: str) -> str:
    """The one current result file of a benchmark: `benchmarks/results/<name>.json`."""
    return str(RESULTS / f"{name}.json")
