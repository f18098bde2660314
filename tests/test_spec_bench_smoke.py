"""benchmarks/spec_bench.py end to end on the tiny checkpoint (--smoke): every phase runs and the
report holds the cells, with the oracle drafter's drafts verified (some accepted, some not)."""
import json
import sys

from benchmarks import spec_bench
from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM


def test_spec_bench_smoke_writes_its_report(tmp_path, monkeypatch):
    out = tmp_path / "spec_bench.json"
    monkeypatch.setattr(sys, "argv", ["spec_bench", "--smoke", "--p", "0.5", "--out", str(out)])
    compute_logits = DeepseekV4ForCausalLM.compute_logits
    spec_bench.main()
    assert DeepseekV4ForCausalLM.compute_logits is compute_logits  # the forced token's patch is undone
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["plain"]] == [2]
    assert [(c["batch"], c["d"]) for c in report["cells"]] == [(2, 1), (2, 2)]
    for cell in report["cells"]:
        assert cell["step_ratio"] > 0 and cell["tokens_per_s"] > 0
        assert cell["drafts_per_verify"] == cell["d"]  # the forced number of drafts was verified
        assert 0.0 < cell["acceptance_measured"] < 1.0  # p = 0.5: drafts right and wrong
    assert {r["drafter"] for r in report["adaptive"]} == {"oracle", "mtp"}
    assert report["step_costs"]["source"] == "model" and not report["skipped"]
    assert report["forced_token"] == spec_bench.FORCED_TOKEN


def test_forced_token_makes_greedy_decoding_emit_it():
    """The oracle's continuation is exact only if the target emits the forced token whatever the weights."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.model.loader import CONFIGS_DIR

    with spec_bench.force_greedy_token():
        llm = LLM(str(CONFIGS_DIR / "tiny"), device="cpu", dtype="float32", enforce_eager=True,
                  max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=64 * 1024**2)
        out = llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": list(range(20, 40))}],
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == [[spec_bench.FORCED_TOKEN] * 5] * 2
