"""kv_cache_dtype="fp8" through the engine: the option's check, the byte counts (KV plan, `kv-plan`, the state
as allocated), and the accuracy of the demo model with FP8 KV against bf16 KV.

Accuracy bound: e4m3 keeps 3 mantissa bits, so a stored value is off by at most half a step, 2^-4 relative
(bf16: 2^-8). The rows' error reaches the logits through every attention layer, so the logits' error should
scale with the storage's step: against the bf16 cache's own error (vs the fp32 cache) it is at most about
2^-4 / 2^-8 = 16 times larger, and on its own a small fraction of the logits' spread. The test allows 24x
(half as much again) and 2^-4 of the logits' RMS for the mean absolute error; it measures ~7x and 0.02 of the RMS on the
demo model. The maximum error is not bounded: an indexer score that moves across the top-k cut swaps a whole
entry, a discrete change (bf16 KV shows it too).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig, ModelConfig
from sparseserve.engine.kv_cache import plan_kv
from sparseserve.entrypoints.cli import main
from sparseserve.errors import ConfigError
from sparseserve.kv_format import IndexFormat, KVFormat
from sparseserve.model.loader import CONFIGS_DIR, load_hf_config, load_model, resolve_model_dir
from sparseserve.model.state import ModelState, StateLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import Driver  # noqa: E402

DEMO = str(CONFIGS_DIR / "demo")


def test_kv_cache_dtype_is_checked_at_the_boundary():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of 'auto', 'bfloat16', 'fp8'; got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16").validate()
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM("tiny", device="cpu", kv_cache_dtype=8)


def test_flash_plan_counts_the_packed_bytes():
    model_dir, overrides = resolve_model_dir("deepseek-v4-flash")
    mc = ModelConfig(load_hf_config(model_dir, overrides))
    kv, idx = KVFormat(512, 64).row_bytes, IndexFormat(128).row_bytes
    fp8 = plan_kv(mc, 2, 128, 8192, kv_cache_dtype="fp8")
    bf16 = plan_kv(mc, 2, 128, 8192, kv_cache_dtype="bfloat16")
    assert bf16.bytes_per_token == 6880 and plan_kv(mc, 2, 128, 8192).bytes_per_token == 6880
    assert fp8.bytes_per_token_by_kind == {"csa": 21 * (kv + idx) / 4, "hca": 20 * kv / 128}
    assert fp8.bytes_per_block_by_kind == {"csa": 21 * 32 * (kv + idx), "hca": 20 * 1 * kv}
    # Window rings in FP8 rows; the compressor buffers (kv || gate, fixed per slot) stay bf16.
    ring = 128 * kv
    csa_comp = (2 * 4) * 2 * 2 * (512 + 128) * 2
    hca_comp = 128 * 2 * 512 * 2
    assert fp8.bytes_per_slot_by_kind == {"csa": 21 * (ring + csa_comp), "hca": 20 * (ring + hca_comp),
                                          "sliding": 2 * ring}
    report = fp8.report(131072, 40 * 1024**3)
    assert "kv_cache_dtype fp8: 592 B per KV row, 132 B per indexer key" in report
    assert fp8.max_concurrency(131072, 40 * 1024**3) >= 1.7 * bf16.max_concurrency(131072, 40 * 1024**3)


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8", torch.float32), ("fp8", torch.bfloat16),
                                                  ("bfloat16", torch.float32), ("auto", torch.float32)])
def test_state_allocates_what_the_plan_counts(kv_cache_dtype, dtype):
    model_dir, overrides = resolve_model_dir("tiny")
    mc = ModelConfig(load_hf_config(model_dir, overrides))
    plan = plan_kv(mc, torch.tensor([], dtype=dtype).element_size(), 16, 64, 2, kv_cache_dtype)
    layout = StateLayout(num_blocks=5, block_size=16, num_slots=3, max_step_tokens=64,
                         sliding_window=mc.hf_config.sliding_window, num_speculative_tokens=2)
    state = ModelState(mc, layout, torch.device("cpu"), dtype, kv_cache_dtype)
    assert state.nbytes() == plan.fixed_bytes + 5 * plan.bytes_per_block + 3 * plan.bytes_per_slot
    fp8 = kv_cache_dtype == "fp8"
    layer = state.layers[1]
    assert (layer.kv_pool.dtype == torch.uint8) == fp8 and (layer.kv_format is not None) == fp8


def test_engine_reports_and_allocates_the_fp8_bytes():
    llm = LLM("tiny", device="cpu", kv_cache_dtype="fp8", max_model_len=128, max_num_seqs=4)
    engine = llm.llm_engine
    row, key = KVFormat(64, 16).row_bytes, IndexFormat(32).row_bytes
    assert f"kv_cache_dtype fp8: {row} B per KV row, {key} B per indexer key" in engine.kv_report()
    # What is allocated is what the start-up report counts, plus the padded graph rows' dummy slot.
    assert engine.runner.state.nbytes() == engine.cache_bytes + engine.kv_plan.bytes_per_slot
    llm.shutdown()


def test_kv_plan_command_takes_the_option(capsys):
    assert main(["kv-plan", "--model", "deepseek-v4-flash", "--max-model-len", "131072",
                 "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "592 B per KV row, 132 B per indexer key" in out and "(fp8): compressed state" in out


@pytest.fixture(scope="module")
def demo_logits():
    """Logits of the demo model on held-out-like text, prefill then decode, per KV storage."""
    model, _, _ = load_model(DEMO, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    vocab = model.model_config.hf_config.vocab_size
    prompts = AutoTokenizer.from_pretrained(DEMO)(
        ["A class definition is an executable statement. The first line", "def fib(n):\n    if n < 2:"])["input_ids"]
    n = min(len(p) for p in prompts) + 8
    seqs = [(p + torch.randint(0, vocab, (8,), generator=gen).tolist())[:n] for p in prompts]
    cut = n // 2
    out = {}
    for kv in ("auto", "bfloat16", "fp8"):
        driver = Driver(model, kv_cache_dtype=kv)
        steps = [driver.step([(slot, 0, seq[:cut]) for slot, seq in enumerate(seqs)])]  # prefill, then decode
        steps += [driver.step([(slot, i, [seq[i]]) for slot, seq in enumerate(seqs)]) for i in range(cut, n)]
        out[kv] = torch.cat([logits for step in steps for logits in step])
    return out


def test_fp8_logits_error_is_bounded_by_e4m3_precision(demo_logits):
    full, bf16, fp8 = demo_logits["auto"], demo_logits["bfloat16"], demo_logits["fp8"]
    err_fp8 = (fp8 - bf16).abs().mean().item()
    err_bf16 = (bf16 - full).abs().mean().item()
    rms = full.pow(2).mean().sqrt().item()
    assert 0 < err_fp8 <= 2**-4 * rms, (err_fp8, rms)
    assert err_fp8 <= 24 * err_bf16, (err_fp8, err_bf16)
    agree = (fp8.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_fp8_greedy_tokens_mostly_identical():
    prompts = ["A class definition", "The function returns", "In Python, a list", "import os\n", "for i in range(",
               "The loop ends when"]
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(DEMO, device="cpu", dtype="float32", max_model_len=128, kv_cache_dtype=kv)
        tokens[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    same = sum(a == b for a, b in zip(tokens["bfloat16"], tokens["fp8"]))
    assert same >= 4, (same, tokens)


def _tiny_prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=gen).tolist()} for n in (4, 23, 41)]


@pytest.fixture(scope="module")
def fp8_reference() -> list[list[int]]:
    llm = LLM("tiny", device="cpu", dtype="float32", max_model_len=160, kv_cache_dtype="fp8")
    out = [o.outputs[0].token_ids for o in llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)]
    llm.shutdown()
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("k", [0, 2])
def test_fp8_speculation_and_graph_padding_keep_the_tokens(k, fp8_reference):
    """Speculative verify steps re-run positions (the rows are quantized the same each time) and padded
    graph-shaped steps write their padding rows into the dummy slot: neither changes an FP8 engine's tokens."""
    kw = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    llm = LLM("tiny", device="cpu", dtype="float32", max_model_len=160, kv_cache_dtype="fp8", max_num_seqs=8,
              cuda_graph_sizes=[2, 8], **kw)
    llm.llm_engine.runner.pad_like_graphs = True
    got = [o.outputs[0].token_ids for o in llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)]
    assert got == fp8_reference
    if k:
        assert llm.llm_engine.spec_metrics.num_verify_steps > 0
    assert llm.llm_engine.all_cache_free()
    llm.shutdown()


def test_fp8_engine_equals_fake_quantized_fp32_cache(monkeypatch):
    """The FP8 state is wired at every write and read: the model with kv_cache_dtype="fp8" computes what the
    fp32 model computes when each row it writes (fresh window rows, compressed entries, indexer keys) is replaced
    by its quantized-then-dequantized value. A write site that skipped quantization, or a reader that skipped the
    scales, would differ by O(1) (the fp32 cache without quantization differs by 2.8 here); both compute in fp32
    from the same values, so they agree exactly."""
    from oracle import make_pair, tiny_config

    import sparseserve.model.layers.attention as attn_mod
    from sparseserve.kernels.compressor import compress_windows_ref
    from sparseserve.kernels.norm_rope import norm_rope_ref
    from sparseserve.kv_format import dequantize_index_rows, dequantize_kv_rows, quantize_index_rows, quantize_kv_rows

    cfg = tiny_config(index_topk=3, sliding_window=6)
    _, model = make_pair(cfg, seed=7)
    fmt = KVFormat(cfg.head_dim, cfg.qk_rope_head_dim)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=gen).tolist()

    def run(kv: str) -> torch.Tensor:
        driver = Driver(model, kv_cache_dtype=kv)
        steps = [driver.step([(0, 0, ids[:40])])[0]] + [driver.step([(0, i, [ids[i]])])[0] for i in range(40, 60)]
        return torch.cat(steps)

    fp8 = run("fp8")

    def fake_norm_rope(x, weight, eps, cos, sin, pool=None, pool_rows=None, kv_format=None):
        y = norm_rope_ref(x, weight, eps, cos, sin)
        if pool is None:
            return y
        y = dequantize_kv_rows(quantize_kv_rows(y, fmt), fmt, y.dtype)
        pool.index_copy_(0, pool_rows, y)
        return y

    def fake_compress(state, src_rows, bias, overlap, norm_w, eps, cos, sin, out_pool, out_rows, kv_format=None,
                      out_scale=None):
        scratch = out_pool.clone()
        compress_windows_ref(state, src_rows, bias, overlap, norm_w, eps, cos, sin, scratch, out_rows)
        dest = out_rows[out_rows >= 0].long()
        rows = scratch[dest]
        if out_pool.shape[1] == cfg.head_dim:
            rows = dequantize_kv_rows(quantize_kv_rows(rows, fmt), fmt)
        else:
            rows = dequantize_index_rows(*quantize_index_rows(rows))
        out_pool.index_copy_(0, dest, rows.to(out_pool.dtype))

    monkeypatch.setattr(attn_mod, "norm_rope", fake_norm_rope)
    monkeypatch.setattr(attn_mod, "compress_windows", fake_compress)
    fake = run("auto")
    err = (fp8 - fake).abs().max().item()
    assert err < 1e-5, err
