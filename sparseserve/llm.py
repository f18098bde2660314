"""`LLM`: the offline entry point, with vLLM's names and semantics."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from tqdm import tqdm

from .config import EngineConfig
from .engine.llm_engine import InvalidRequestError, LLMEngine
from .logger import init_logger
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline inference: `LLM(model).generate(prompts, sampling_params)`.

    `model` is a checkpoint directory, a preset name (see `sparseserve.model.loader.PRESETS`)
    or None for the embedded default model.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, skip_tokenizer_init: bool = False,
                 dtype: str = "auto", device: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_chunked_prefill: bool = True, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, block_size: int | None = None,
                 enforce_eager: bool = False, tensor_parallel_size: int = 1, load_format: str = "auto",
                 hf_overrides: dict | None = None, speculative_config: dict | None = None,
                 topk_backend: str = "auto", num_gpu_blocks_override: int | None = None, **kwargs) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unsupported arguments: {', '.join(unknown)}")
        init_logger()
        self.engine_config = EngineConfig(
            model=model, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init, dtype=dtype, device=device,
            seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            block_size=block_size, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            load_format=load_format, hf_overrides=hf_overrides, speculative_config=speculative_config,
            topk_backend=topk_backend, num_gpu_blocks_override=num_gpu_blocks_override, **kwargs)
        self.llm_engine = LLMEngine(self.engine_config)
        self._next_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        # generate() returns finished requests only: ask the engine for nothing else.
        final_only: dict[int, SamplingParams] = {}
        for i, sp in enumerate(params_list):
            if isinstance(sp, SamplingParams) and sp.output_kind is not RequestOutputKind.FINAL_ONLY:
                if id(sp) not in final_only:
                    final_only[id(sp)] = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                params_list[i] = final_only[id(sp)]
        engine = self.llm_engine
        # Validate everything first: a bad prompt raises before anything is queued.
        validated = [engine.validate_request(p, sp) for p, sp in zip(prompts, params_list)]
        ids = []
        for (text, token_ids), sp in zip(validated, params_list):
            request_id = str(self._next_id)
            self._next_id += 1
            engine._add_validated(request_id, text, token_ids, sp)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished or output.request_id not in wanted:
                        continue
                    results[output.request_id] = output
                    in_tokens += len(output.prompt_token_ids)
                    out_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                        f"output: {out_tokens / elapsed:.2f} toks/s")
                    bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[i] for i in request_ids]
