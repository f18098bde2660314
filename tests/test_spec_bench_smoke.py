"""benchmarks/spec_bench.py end to end on the tiny checkpoint (--smoke): every phase runs and the
report holds the cells, with the oracle drafter's drafts verified (some accepted, some not)."""
import json
import sys

from benchmarks import spec_bench


def test_spec_bench_smoke_writes_its_report(tmp_path, monkeypatch):
    out = tmp_path / "spec_bench.json"
    monkeypatch.setattr(sys, "argv", ["spec_bench", "--smoke", "--p", "0.5", "--out", str(out)])
    spec_bench.main()
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["plain"]] == [2]
    assert [(c["batch"], c["d"]) for c in report["cells"]] == [(2, 1), (2, 2)]
    for cell in report["cells"]:
        assert cell["step_ratio"] > 0 and cell["tokens_per_s"] > 0
        assert cell["drafts_per_verify"] == cell["d"]  # the forced number of drafts was verified
        assert 0.0 < cell["acceptance_measured"] < 1.0  # p = 0.5: drafts right and wrong
    assert {r["drafter"] for r in report["adaptive"]} == {"oracle", "mtp"}
    assert report["step_costs"]["source"] == "model" and not report["skipped"]
