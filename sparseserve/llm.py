"""`LLM`: the offline entry point, with vLLM's names and semantics."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from tqdm import tqdm

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .errors import ConfigTypeError, InvalidRequestError, InvalidRequestTypeError
from .logger import init_logger
from .outputs import RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from .validation import split_prompts


class LLM:
    """Offline inference: `LLM(model).generate(prompts, sampling_params)`.

    `model` is a checkpoint directory, a preset name (see `sparseserve.model.loader.PRESETS`)
    or None for the embedded default model.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`model` (positional, as in vLLM) and any `EngineConfig` field as a keyword."""
        known = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ConfigTypeError(f"LLM() got unsupported arguments: {', '.join(unknown)}; "
                                  f"the supported ones are model and {', '.join(known)}")
        init_logger()
        self.engine_config = EngineConfig(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_config)
        self._next_id = 0

    def shutdown(self) -> None:
        """Free what this engine holds: its workers (tensor_parallel_size > 1), the model, the KV state,
        the CUDA graphs and the runner's buffers, so another `LLM` can start in this process. Later
        calls to `generate` raise `EngineClosedError`; a second `shutdown()` does nothing. Deleting the
        last reference to the engine (`del llm`) frees it too (`LLMEngine.__del__`)."""
        engine = self.__dict__.get("llm_engine")
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self.llm_engine.check_open()
        prompts = split_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise InvalidRequestTypeError(f"sampling_params must be a SamplingParams, a list of them (one per "
                                              f"prompt) or None; got {type(sampling_params).__name__}")
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

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of
        them, encoded with the model's chat format (the encoding the server uses)."""
        from .chat import render_chat

        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; this LLM was started without one")
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequestError(f"messages must be a list of message dicts (or a list of such lists), "
                                      f"got {type(messages).__name__}")
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = render_chat(list(conversation), tokenizer, tools=tools, add_generation_prompt=add_generation_prompt,
                               chat_template_kwargs=chat_template_kwargs)
            # The rendered text carries its own special tokens: encode it without adding more.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False):
        """vLLM's offline beam search: a list of `BeamSearchOutput` (best beams first) per prompt.
        `use_tqdm` is accepted for vLLM compatibility; the steps show no progress bar."""
        from .beam_search import beam_search

        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        probe = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width)
        ids = [engine.validate_request(p, probe)[1] for p in prompts]
        tokenizer = self.get_tokenizer()
        decode = tokenizer.decode if tokenizer is not None else None
        return beam_search(ids, params, engine.eos_token_id,
                           lambda batch, sp: self.generate(batch, sp, use_tqdm=False), decode)

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
