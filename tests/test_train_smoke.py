"""The demo model's training script runs end to end (a few steps) and writes a loadable checkpoint."""
import subprocess
import sys
from pathlib import Path

from sparseserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_train_script_smoke(tmp_path):
    out = tmp_path / "model"
    subprocess.run([sys.executable, str(ROOT / "tools/train_tiny.py"), "--steps", "2", "--batch-size", "2",
                    "--seq-len", "32", "--out", str(out)], check=True, capture_output=True, timeout=300)
    llm = LLM(str(out), device="cpu", dtype="float32", max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    result = llm.generate(["The import statement"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(result.outputs[0].token_ids) == 4
