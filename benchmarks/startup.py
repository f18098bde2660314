"""Start-up time and where it goes, with the capture audit on and off.

    python -m benchmarks.startup [--model v4-flash-43l8e] [--load-format dummy] [--max-model-len 4096] [--out PATH]
    python -m benchmarks.startup --smoke    # CPU, the tiny model: checks the script (no kernels, no graphs)

Three starts, each in its own process: the audit on (the default) and off, each with an empty Triton cache
(as on a fresh machine), then the audit on again reusing the first start's cache (a second start). Each
records the wall time of `import sparseserve` + `LLM(...)`, the loading time, the runner's phases (kernel
warm-up, graph capture, capture audit) and the forwards start-up ran (the start-up report's lines). The
report gives the audit's share of a fresh start-up: the goal is at most 15% of the whole.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_file, write_result  # noqa: E402

STARTS = (("audit_on_fresh", True, "fresh"), ("audit_off_fresh", False, "fresh"), ("audit_on_second", True, "reuse"))


def child(args) -> None:
    """One start-up in this process; prints its JSON line last."""
    start = time.perf_counter()
    from sparseserve import LLM

    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              skip_tokenizer_init=True, cudagraph_audit=args.audit == "on",
              **({"device": "cpu"} if args.smoke else {}))
    total = time.perf_counter() - start
    engine = llm.llm_engine
    runner = engine.runner
    print(json.dumps({"import_and_llm_s": total, "load_s": engine.load_s,
                      "phases_s": dict(getattr(runner, "startup_phases", {}) or {}),
                      "forwards": [[what, s] for what, s in (getattr(runner, "startup_steps", None) or [])]}))
    llm.shutdown()


def run_start(args, audit: bool, cache_dir: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--audit", "on" if audit else "off",
           "--model", args.model, "--load-format", args.load_format, "--max-model-len", str(args.max_model_len)]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="v4-flash-43l8e")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--timeout-s", type=float, default=400.0, help="the longest one start may take")
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny model (a script check)")
    parser.add_argument("--out", default=None, help="the report's path (default: benchmarks/results/startup.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--audit", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.load_format, args.max_model_len = "tiny", "dummy", 256
    if args.child:
        child(args)
        return
    report: dict = {"model": args.model, "load_format": args.load_format, "max_model_len": args.max_model_len,
                    "starts": {}}
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        for name, audit, cache in STARTS:
            cache_dir = second if name == "audit_off_fresh" else first
            result = run_start(args, audit, cache_dir)
            report["starts"][name] = result
            print(name, json.dumps(result)[:400], flush=True)
    on, off = report["starts"]["audit_on_fresh"], report["starts"]["audit_off_fresh"]
    if "error" not in on and "error" not in off:
        audit_s = on["phases_s"].get("capture audit", 0.0)
        report["audit_share_of_fresh_start"] = audit_s / on["import_and_llm_s"]
        report["fresh_start_on_over_off"] = on["import_and_llm_s"] / off["import_and_llm_s"]
    try:
        import torch

        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        report["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the report is still useful without it
        pass
    out = args.out or (str(Path(tempfile.gettempdir()) / "startup_smoke.json") if args.smoke
                       else result_file("startup"))
    write_result(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
