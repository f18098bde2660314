"""benchmarks/serve_overhead.py --smoke: the offline run, a real server on a free port and the load
generator at two concurrencies, on the CPU with the tiny model, in seconds; the server is stopped."""
import json
import time

import benchmarks.serve_overhead as so


def test_serve_overhead_smoke_writes_one_report_and_stops_the_server(tmp_path, monkeypatch):
    started = []
    real = so.running_server

    def recording(*args, **kwargs):
        cm = real(*args, **kwargs)

        class Wrapper:
            def __enter__(self):
                url, proc = cm.__enter__()
                started.append(proc)
                return url, proc

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Wrapper()

    monkeypatch.setattr(so, "running_server", recording)
    out = tmp_path / "serve_overhead.json"
    t0 = time.monotonic()
    report = so.main(["--smoke", "--out", str(out), "--phase-timeout-s", "120"])
    assert time.monotonic() - t0 < 240
    saved = json.loads(out.read_text())
    assert saved["by_concurrency"].keys() == report["by_concurrency"].keys() == {"1", "4"}
    assert saved["offline"]["output_tok_s"] > 0
    for c, row in saved["by_concurrency"].items():
        assert row["output_tok_s"] > 0 and row["num_prompts"] == dict(so.SMOKE_RUNS)[int(c)]
        assert row["ttft_ms"]["median"] > 0 and row["tpot_ms"]["p99"] >= row["tpot_ms"]["median"] > 0
        expected = 1e6 / row["output_tok_s"] - 1e6 / saved["offline"]["output_tok_s"]
        assert abs(row["extra_us_per_output_token"] - expected) < 1e-6 * max(1.0, abs(expected))
        assert row["client_cpu_us_per_output_token"] > 0
    assert len(started) == 1 and started[0].poll() is not None  # the server process was stopped
