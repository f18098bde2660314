"""Bad inputs of every class, tried against one long-lived engine (the tiny model on the CPU).

Each case is run, must raise its typed error with a message that names the field, and is then
followed by a known good request that must return the same tokens as before, with nothing leaked
(`LLMEngine.debug_state_counts()` all zero). `run_all(llm, tmp_dir)` does that for every case and
returns the problems found (an empty list when everything holds).
"""
from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sparseserve import LLM, SamplingParams
from sparseserve.errors import (CheckpointError, ConfigError, ConfigTypeError, InvalidRequestError,
                                InvalidRequestTypeError, RequestTooLargeError, SamplingParamsError,
                                SamplingParamsTypeError)
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.model.release_writer import write_release_checkpoint

TINY = CONFIGS_DIR / "tiny"
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8)
GOOD_PROMPT = {"prompt_token_ids": [(5 + 7 * i) % 500 + 2 for i in range(12)]}


def good_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@dataclass
class Case:
    name: str
    run: Callable  # run(llm, tmp_dir)
    error: type[BaseException]
    match: str  # a regex the message must contain (the field's name)


def _sp(**kwargs) -> Callable:
    return lambda llm, tmp: SamplingParams(**kwargs)


def _gen(prompt, params: SamplingParams | None = None) -> Callable:
    return lambda llm, tmp: llm.generate(prompt, params if params is not None else good_params(), use_tqdm=False)


def _mutated(**changes) -> Callable:
    def run(llm, tmp):
        sp = good_params()
        for k, v in changes.items():
            setattr(sp, k, v)
        return llm.generate(GOOD_PROMPT, sp, use_tqdm=False)
    return run


def _add(request_id, prompt=GOOD_PROMPT, params=None) -> Callable:
    return lambda llm, tmp: llm.llm_engine.add_request(request_id, prompt, params or good_params())


def _llm(**kwargs) -> Callable:
    return lambda llm, tmp: LLM(str(kwargs.pop("model", TINY)), **{**ENGINE_KW, **kwargs})


def _duplicate_id(llm, tmp):
    engine = llm.llm_engine
    engine.add_request("dup", GOOD_PROMPT, good_params())
    try:
        engine.add_request("dup", GOOD_PROMPT, good_params())
    finally:
        engine.abort_request("dup")


def _checkpoint(edit_config: Callable[[dict], object] | None = None, edit_tensors: Callable[[dict], None] | None = None,
                tokenizer_text: str | None = None) -> Callable:
    """A copy of the tiny checkpoint with one thing broken, loaded as an engine."""
    def run(llm, tmp: Path):
        target = tmp / f"ckpt{len(list(tmp.iterdir()))}"
        shutil.copytree(TINY, target)
        if edit_config is not None:
            raw = json.loads((TINY / "config.json").read_text())
            new = edit_config(raw)
            (target / "config.json").write_text(json.dumps(raw if new is None else new))
        if edit_tensors is not None:
            tensors = load_file(str(TINY / "model.safetensors"))
            edit_tensors(tensors)
            save_file(tensors, str(target / "model.safetensors"))
        if tokenizer_text is not None:
            (target / "tokenizer.json").write_text(tokenizer_text)
        return LLM(str(target), **ENGINE_KW)
    return run


def _release(expert_dtype: str = "fp4", edit_config: Callable[[dict], object] | None = None,
             edit_tensors: Callable[[dict], None] | None = None) -> Callable:
    """A release-format tiny checkpoint (`write_release_checkpoint`, one shard) with one thing broken."""
    def run(llm, tmp: Path):
        target = write_release_checkpoint(tmp / f"ckpt{len(list(tmp.iterdir()))}", TINY, expert_dtype=expert_dtype)
        if edit_config is not None:
            raw = json.loads((target / "config.json").read_text())
            edit_config(raw)
            (target / "config.json").write_text(json.dumps(raw))
        if edit_tensors is not None:
            shard = target / "model-00001-of-00001.safetensors"
            tensors = load_file(str(shard))
            edit_tensors(tensors)
            save_file(tensors, str(shard))
        return LLM(str(target), **ENGINE_KW)
    return run


def _quant(**values) -> Callable[[dict], None]:
    return lambda raw: raw["quantization_config"].update(values)


def _edit(name: str, change: Callable[[torch.Tensor], torch.Tensor | None]) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        new = change(tensors[name])
        if new is None:
            del tensors[name]
        else:
            tensors[name] = new
    return edit


def _set(**values) -> Callable[[dict], None]:
    return lambda raw: raw.update(values)


def _int32_head(tensors: dict) -> None:
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float().round().to(torch.int32)


SP, SPT = SamplingParamsError, SamplingParamsTypeError
IR, IRT = InvalidRequestError, InvalidRequestTypeError
CE, CET, CK = ConfigError, ConfigTypeError, CheckpointError
NAN, INF = math.nan, math.inf

CASES: list[Case] = [
    # SamplingParams: type, range and finiteness of every field
    Case("n=0", _sp(n=0), SP, "n must"), Case("n=-1", _sp(n=-1), SP, "n must"),
    Case("n=1.5", _sp(n=1.5), SPT, "n must"), Case("n=True", _sp(n=True), SPT, "n must"),
    Case("n='2'", _sp(n="2"), SPT, "n must"),
    Case("temperature=-0.5", _sp(temperature=-0.5), SP, "temperature"),
    Case("temperature=nan", _sp(temperature=NAN), SP, "temperature"),
    Case("temperature=inf", _sp(temperature=INF), SP, "temperature"),
    Case("temperature='0.5'", _sp(temperature="0.5"), SPT, "temperature"),
    Case("temperature=None", _sp(temperature=None), SPT, "temperature"),
    Case("top_p=0", _sp(top_p=0.0), SP, "top_p"), Case("top_p=5", _sp(top_p=5), SP, "top_p"),
    Case("top_p=nan", _sp(top_p=NAN), SP, "top_p"),
    Case("top_k=-3", _sp(top_k=-3), SP, "top_k"), Case("top_k=1.5", _sp(top_k=1.5), SPT, "top_k"),
    Case("top_k=True", _sp(top_k=True), SPT, "top_k"),
    Case("min_p=2", _sp(min_p=2.0), SP, "min_p"), Case("min_p=-0.1", _sp(min_p=-0.1), SP, "min_p"),
    Case("min_p=nan", _sp(min_p=NAN), SP, "min_p"),
    Case("seed=-1", _sp(seed=-1), SP, "seed"), Case("seed=1.5", _sp(seed=1.5), SPT, "seed"),
    Case("seed='x'", _sp(seed="x"), SPT, "seed"),
    Case("max_tokens=0", _sp(max_tokens=0), SP, "max_tokens"), Case("max_tokens=-1", _sp(max_tokens=-1), SP, "max_tokens"),
    Case("max_tokens=1.5", _sp(max_tokens=1.5), SPT, "max_tokens"),
    Case("max_tokens=True", _sp(max_tokens=True), SPT, "max_tokens"),
    Case("min_tokens=-1", _sp(min_tokens=-1), SP, "min_tokens"),
    Case("min_tokens>max_tokens", _sp(min_tokens=5, max_tokens=2), SP, "min_tokens"),
    Case("logprobs=-1", _sp(logprobs=-1), SP, "logprobs"), Case("logprobs=1.5", _sp(logprobs=1.5), SPT, "logprobs"),
    Case("prompt_logprobs=-1", _sp(prompt_logprobs=-1), SP, "prompt_logprobs"),
    Case("stop=5", _sp(stop=5), SPT, "stop"), Case("stop=['']", _sp(stop=[""]), SP, r"stop\[0\]"),
    Case("stop=[5]", _sp(stop=[5]), SPT, r"stop\[0\]"),
    Case("stop_token_ids=5", _sp(stop_token_ids=5), SPT, "stop_token_ids"),
    Case("stop_token_ids=[-1]", _sp(stop_token_ids=[-1]), SP, r"stop_token_ids\[0\]"),
    Case("stop_token_ids=[1.5]", _sp(stop_token_ids=[1.5]), SPT, r"stop_token_ids\[0\]"),
    Case("ignore_eos='yes'", _sp(ignore_eos="yes"), SPT, "ignore_eos"),
    Case("detokenize=1", _sp(detokenize=1), SPT, "detokenize"),
    # limits that come from the model, checked when the request is added
    Case("logprobs=600 (> vocab)", _gen(GOOD_PROMPT, SamplingParams(logprobs=600)), SP, "logprobs"),
    Case("logprobs=21 (> max_logprobs)", _gen(GOOD_PROMPT, SamplingParams(logprobs=21)), SP, "max_logprobs"),
    Case("prompt_logprobs=600", _gen(GOOD_PROMPT, SamplingParams(prompt_logprobs=600)), SP, "prompt_logprobs"),
    Case("stop_token_ids=[512]", _gen(GOOD_PROMPT, SamplingParams(stop_token_ids=[512])), SP, "stop_token_ids"),
    # fields changed after construction are checked again
    Case("mutated n=0", _mutated(n=0), SP, "n must"),
    Case("mutated max_tokens=0", _mutated(max_tokens=0), SP, "max_tokens"),
    Case("mutated top_p=5", _mutated(top_p=5), SP, "top_p"),
    Case("mutated temperature=nan", _mutated(temperature=NAN), SP, "temperature"),
    Case("mutated logprobs=600", _mutated(logprobs=600), SP, "logprobs"),
    Case("mutated stop=5", _mutated(stop=5), SPT, "stop"),
    # prompts
    Case("generate(None)", _gen(None), IRT, "prompts"), Case("generate(123)", _gen(123), IRT, "prompts"),
    Case("generate(b'...')", _gen(b"hello"), IRT, "decode bytes"),
    Case("generate([None])", _gen([None]), IRT, "prompt"), Case("generate([1.5])", _gen([1.5]), IRT, "prompt"),
    Case("generate([b'x'])", _gen([b"x"]), IRT, "decode bytes"),
    Case("empty token list", _gen({"prompt_token_ids": []}), IR, "empty"),
    Case("empty string", _gen(""), IR, "empty"),
    Case("token id 512", _gen({"prompt_token_ids": [3, 512]}), IR, r"prompt_token_ids\[1\]"),
    Case("token id -1", _gen([[-1, 4]]), IR, r"prompt\[0\]"),
    Case("token id True", _gen({"prompt_token_ids": [True, 4]}), IRT, r"prompt_token_ids\[0\]"),
    Case("token id 1.5", _gen({"prompt_token_ids": [4, 1.5]}), IRT, r"prompt_token_ids\[1\]"),
    Case("nested token ids", _gen({"prompt_token_ids": [[1, 2]]}), IRT, r"prompt_token_ids\[0\]"),
    Case("deeply nested junk", _gen([[[1]]]), IRT, r"prompt\[0\]"),
    Case("prompt_token_ids='abc'", _gen({"prompt_token_ids": "abc"}), IRT, "prompt_token_ids"),
    Case("prompt_token_ids=tensor", _gen({"prompt_token_ids": torch.tensor([1, 2])}), IRT, "tolist"),
    Case("dict with unknown key", _gen({"bogus": 1}), IRT, "bogus"),
    Case("empty dict", _gen({}), IR, "prompt_token_ids"),
    Case("prompt=5 in dict", _gen({"prompt": 5}), IRT, "prompt"),
    Case("prompt too long", _gen({"prompt_token_ids": [3] * 96}), RequestTooLargeError, "max_model_len"),
    Case("one bad prompt among good", _gen([GOOD_PROMPT, None]), IRT, "prompt"),
    Case("sampling_params='x'", _gen(GOOD_PROMPT, "x"), IRT, "sampling_params"),
    Case("params list too short", lambda llm, tmp: llm.generate([GOOD_PROMPT] * 2, [good_params()], use_tqdm=False),
         IR, "SamplingParams for 2 prompts"),
    Case("request_id=5", _add(5), IR, "request_id"),
    Case("duplicate request id", _duplicate_id, IR, "already in use"),
    # engine options
    Case("max_model_len=0", _llm(max_model_len=0), CE, "max_model_len"),
    Case("max_model_len=-5", _llm(max_model_len=-5), CE, "max_model_len"),
    Case("max_model_len=1.5", _llm(max_model_len=1.5), CET, "max_model_len"),
    Case("max_model_len=10**9", _llm(max_model_len=10**9), CE, "max_position_embeddings"),
    Case("max_num_seqs=0", _llm(max_num_seqs=0), CE, "max_num_seqs"),
    Case("max_num_seqs=1.5", _llm(max_num_seqs=1.5), CET, "max_num_seqs"),
    Case("max_num_seqs=True", _llm(max_num_seqs=True), CET, "max_num_seqs"),
    Case("max_num_seqs=10**7", _llm(max_num_seqs=10**7), CE, "max_num_seqs"),
    Case("block_size=0", _llm(block_size=0), CE, "block_size"),
    Case("block_size=-16", _llm(block_size=-16), CE, "block_size"),
    Case("block_size=24", _llm(block_size=24), CE, "block_size"),
    Case("max_num_batched_tokens=0", _llm(max_num_batched_tokens=0), CE, "max_num_batched_tokens"),
    Case("gpu_memory_utilization=0", _llm(gpu_memory_utilization=0), CE, "gpu_memory_utilization"),
    Case("gpu_memory_utilization=nan", _llm(gpu_memory_utilization=NAN), CE, "gpu_memory_utilization"),
    Case("kv_cache_memory_bytes=0", _llm(kv_cache_memory_bytes=0), CE, "kv_cache_memory_bytes"),
    Case("kv_cache_memory_bytes=1000", _llm(kv_cache_memory_bytes=1000), CE, "kv_cache_memory_bytes"),
    Case("num_gpu_blocks_override=0", _llm(num_gpu_blocks_override=0), CE, "num_gpu_blocks_override"),
    Case("dtype=torch.int8", _llm(dtype=torch.int8), CE, "dtype"),
    Case("dtype='int8'", _llm(dtype="int8"), CE, "dtype"),
    Case("device='tpu'", _llm(device="tpu"), CE, "device"),
    Case("device=0", _llm(device=0), CET, "device"),
    Case("seed=-1", _llm(seed=-1), CE, "seed"),
    Case("enforce_eager='yes'", _llm(enforce_eager="yes"), CET, "enforce_eager"),
    Case("step_timeout_s=0", _llm(step_timeout_s=0), CE, "step_timeout_s"),
    Case("max_logprobs=-1", _llm(max_logprobs=-1), CE, "max_logprobs"),
    Case("topk_backend='nope'", _llm(topk_backend="nope"), CE, "topk_backend"),
    Case("load_format='pt'", _llm(load_format="pt"), CE, "load_format"),
    Case("cuda_graph_sizes=[0]", _llm(cuda_graph_sizes=[0]), CE, "cuda_graph_sizes"),
    Case("prefill_cuda_graph_sizes=[0]", _llm(prefill_cuda_graph_sizes=[0]), CE, "prefill_cuda_graph_sizes"),
    Case("prefill_cuda_graph_sizes=16", _llm(prefill_cuda_graph_sizes=16), CET, "prefill_cuda_graph_sizes"),
    Case("prefill_cuda_graph_sizes above the budget", _llm(prefill_cuda_graph_sizes=[16, 1 << 20]), CE,
         "prefill_cuda_graph_sizes"),
    Case("cudagraph_mode='piecewise'", _llm(cudagraph_mode="piecewise"), CE, "cudagraph_mode"),
    Case("speculative_config='mtp'", _llm(speculative_config="mtp"), CET, "speculative_config"),
    Case("num_speculative_tokens=0", _llm(speculative_config={"method": "mtp", "num_speculative_tokens": 0}),
         CE, "num_speculative_tokens"),
    Case("unknown option", _llm(bogus=1), CET, "bogus"),
    Case("tokenizer='/nonexistent'", _llm(tokenizer="/nonexistent"), CK, "tokenizer"),
    Case("hf_overrides='x'", _llm(hf_overrides="x"), CET, "hf_overrides"),
    Case("hf_overrides unknown key", _llm(hf_overrides={"bogus": 1}), CE, "bogus"),
    Case("hf_overrides vocab_size=-1", _llm(hf_overrides={"vocab_size": -1}), CK, "vocab_size"),
    Case("hf_overrides index_topk=0", _llm(hf_overrides={"index_topk": 0}), CK, "index_topk"),
    Case("hf_overrides sliding_window=0", _llm(hf_overrides={"sliding_window": 0}), CK, "sliding_window"),
    Case("model='/nonexistent'", _llm(model="/nonexistent"), CK, "model"),
    # checkpoint files
    Case("config.json is []", _checkpoint(lambda raw: []), CK, "JSON object"),
    Case("config.json sliding_window 0", _checkpoint(_set(sliding_window=0)), CK, "sliding_window"),
    Case("config.json index_topk 0", _checkpoint(_set(index_topk=0)), CK, "index_topk"),
    Case("config.json negative vocab", _checkpoint(_set(vocab_size=-512)), CK, "vocab_size"),
    Case("config.json compress rate 0", _checkpoint(
        _set(compress_rates={"compressed_sparse_attention": 0, "heavily_compressed_attention": 16})), CK, "compress_rates"),
    Case("config.json layer_types too short", _checkpoint(_set(layer_types=["sliding_attention"])), CK, "layer_types"),
    Case("config.json eos outside vocab", _checkpoint(_set(eos_token_id=9999)), CK, "eos_token_id"),
    Case("config.json experts_per_tok > experts", _checkpoint(_set(num_experts_per_tok=99)), CK, "num_experts_per_tok"),
    Case("config.json head count 0", _checkpoint(_set(num_attention_heads=0)), CK, "num_attention_heads"),
    Case("config.json rms_norm_eps nan", _checkpoint(_set(rms_norm_eps="nan")), CK, "rms_norm_eps"),
    Case("int32 lm_head.weight", _checkpoint(edit_tensors=_int32_head), CK, "lm_head.weight"),
    Case("corrupt tokenizer.json", _checkpoint(tokenizer_text="{not json"), CK, "tokenizer"),
    # release-format (quantized) checkpoints
    Case("fp8 scale of the wrong shape", _release(edit_tensors=_edit("layers.1.attn.wq_b.scale", lambda s: s[:1])),
         CK, r"layers\.1\.attn\.wq_b\.scale has shape \(1, 1\).*needs a scale of shape \(2, 1\)"),
    Case("fp8 weight without its scale", _release(edit_tensors=_edit("layers.2.attn.wq_a.scale", lambda s: None)),
         CK, r"no layers\.2\.attn\.wq_a\.scale"),
    Case("fp4 expert scale of the wrong shape", _release(
        edit_tensors=_edit("layers.3.ffn.experts.5.w2.scale", lambda s: s[:, :1].contiguous())),
         CK, r"layers\.3\.ffn\.experts\.5\.w2\.scale"),
    Case("fp4 experts with an odd input dimension", _release(edit_config=_set(moe_intermediate_size=63)),
         CK, "moe_intermediate_size.*fp4"),
    Case("unknown quantization method", _release(edit_config=_quant(quant_method="awq")), CK, "quant_method"),
    Case("fp8 block size not two numbers", _release(edit_config=_quant(weight_block_size=[128])), CK,
         "weight_block_size"),
    Case("expert_dtype fp8 over fp4 experts", _release(edit_config=_set(expert_dtype="fp8")), CK,
         "expert_dtype.*'fp4'"),
    Case("expert_dtype fp4 over fp8 experts", _release("fp8", edit_config=_set(expert_dtype="fp4")), CK,
         "expert_dtype.*'fp8'"),
    Case("fp8 tensors without quantization_config", _release(
        edit_config=lambda raw: [raw.pop("quantization_config"), raw.pop("expert_dtype")]), CK, "quantization_config"),
    Case("ue8m0 scale that is no power of two", _release(
        "fp8", edit_tensors=_edit("layers.0.attn.wkv.scale", lambda s: s * 3)), CK, r"layers\.0\.attn\.wkv\.scale"),
]


def reference_tokens(llm: LLM) -> list[int]:
    return llm.generate(GOOD_PROMPT, good_params(), use_tqdm=False)[0].outputs[0].token_ids


def leaks(llm: LLM) -> dict[str, int]:
    """The non-zero per-request counts of an idle engine (an empty dict: nothing leaked)."""
    return {k: v for k, v in llm.llm_engine.debug_state_counts().items() if v}


def check_case(llm: LLM, case: Case, tmp: Path, expected_tokens: list[int]) -> str | None:
    """None when the case raised its typed error naming the field and the engine is unharmed."""
    try:
        case.run(llm, tmp)
    except case.error as exc:
        if not re.search(case.match, str(exc)):
            return f"{case.name}: message {str(exc)!r} does not name {case.match!r}"
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        return f"{case.name}: raised {type(exc).__name__} ({exc}), expected {case.error.__name__}"
    else:
        return f"{case.name}: no error, expected {case.error.__name__}"
    if leaks(llm):
        return f"{case.name}: left engine state behind: {leaks(llm)}"
    tokens = reference_tokens(llm)
    if tokens != expected_tokens:
        return f"{case.name}: the good request now gives {tokens}, expected {expected_tokens}"
    if leaks(llm):
        return f"{case.name}: the good request left state behind: {leaks(llm)}"
    return None


def run_all(llm: LLM, tmp: Path, cases: list[Case] = CASES) -> list[str]:
    expected = reference_tokens(llm)
    return [p for p in (check_case(llm, case, tmp, expected) for case in cases) if p is not None]
