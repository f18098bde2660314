"""The engine: requests in, scheduled steps through the runner, outputs back.

One step: scheduler picks chunks -> runner runs the model and samples -> the engine
appends tokens, detokenises, checks stops and frees finished requests.
"""
from __future__ import annotations

import gc
import itertools
import logging
import random
import sys
import time
from pathlib import Path

import torch

from ..config import CacheConfig, EngineConfig, ModelConfig
from ..config_checks import check_memory, check_model_limits, check_parallel_layout
from ..errors import ConfigError, EngineClosedError, InvalidRequestError, RequestTooLargeError
from ..model.fit_check import available_memory_bytes, check_weights_fit
from ..model.loader import load_hf_config, load_model, resolve_model_dir
from ..model.meta_model import weight_plan
from ..model.presets import DEFAULT_MODEL
from ..model.weight_bytes import ParallelLayout
from ..model.mtp import load_mtp
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from ..spec_decode.adaptive import attach_policy
from ..spec_decode.metrics import SpecDecodeMetrics
from ..step_types import RunnerOutput, SchedulerOutput
from ..validation import ModelLimits, parse_prompt
from ..worker.model_runner import ModelRunner
from ..worker.runner_types import LaunchedStep, RunnerOptions
from . import isolation, spec_async
from .detokenizer import detokenize_incrementally, fast_decode
from .graph_audit import audit_graph_replays
from .startup_report import audit_mode, log_startup
from .kv_cache import KVCacheManager, KVPlan, plan_kv
from .request import Request
from .sampling_checks import needs_host_state, prepare_logits_fields
from .scheduler import Scheduler
from .tokenizer_loading import load_tokenizer

logger = logging.getLogger("sparseserve")

CPU_DEFAULT_CACHE_BYTES = 4 * 1024**3
STARTUP_TIMEOUT_S = 1800.0  # workers' rendezvous and loading (a release checkpoint takes minutes)


__all__ = ["LLMEngine", "InvalidRequestError"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.closed = False
        started = time.perf_counter()
        config.validate()
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        model_dir, overrides = resolve_model_dir(config.model)
        hf = load_hf_config(model_dir, {**overrides, **(config.hf_overrides or {})})
        self.parallel = config.world_size > 1  # the workers hold the model (executor/); the driver none
        if self.parallel:
            visible = torch.cuda.device_count() if self.device.type == "cuda" else None
            check_parallel_layout(config, hf, self.device, visible)
        self.weight_plan = weight_plan(ModelConfig(hf, dtype=self.dtype), self.dtype,
                                       include_mtp=config.num_speculative_tokens > 0,
                                       quantization=config.quantization)
        # Before anything is allocated: the weights (and the MTP layer with speculation) as held, per GPU.
        self.parallel_layout = ParallelLayout(config.tensor_parallel_size, config.enable_expert_parallel)
        self.weight_bytes = check_weights_fit(self.weight_plan, self.parallel_layout,
                                              available_memory_bytes(self.device),
                                              str(config.model or DEFAULT_MODEL), str(self.device))
        loading = time.perf_counter()
        if self.parallel:
            self.model, self.mtp_tensors = None, {}
            self.model_config = ModelConfig(hf, dtype=self.dtype, path=str(model_dir))
        else:
            self.model, self.model_config, self.mtp_tensors = load_model(
                config.model, self.dtype, self.device, config.load_format, config.hf_overrides, config.seed,
                config.quantization, config.use_tqdm_on_load)
        self.load_s = time.perf_counter() - loading  # the workers load their own shards
        hf = self.model_config.hf_config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(  # before the state is allocated
            Path(config.tokenizer) if config.tokenizer else model_dir, explicit=config.tokenizer is not None)
        self._decode = fast_decode(self.tokenizer) if self.tokenizer is not None else None  # per-token detokenizing
        self.vocab_size = hf.vocab_size
        self.max_model_len = check_model_limits(config, hf)
        if config.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = config.max_num_batched_tokens
        else:
            self.max_num_batched_tokens = 8192 if config.enable_chunked_prefill else self.max_model_len
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); enable chunked prefill or raise the budget")
        self.block_size = config.block_size or max(self.model_config.lcm_rate, 16)
        dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        spec_k = config.num_speculative_tokens
        self.kv_plan: KVPlan = plan_kv(self.model_config, dtype_bytes, self.block_size, self.max_num_batched_tokens,
                                       spec_k, config.kv_cache_dtype)
        try:
            self._check_state_fits()
            self.runner = self._start_executor() if self.parallel else self._make_runner()
            self.spec_metrics = SpecDecodeMetrics()
            self._finish_init()
            self._log_startup(time.perf_counter() - started)
        except BaseException:
            self.shutdown()  # neither the workers nor the model outlive a failed start
            raise

    def _make_runner(self) -> ModelRunner:
        config, spec_k = self.config, self.config.num_speculative_tokens
        mtp = (load_mtp(self.model_config, self.mtp_tensors, self.device, self.dtype, config.load_format,
                        config.seed) if spec_k else None)
        return ModelRunner(self.model, self.model_config, self.device, self.dtype, config.max_num_seqs,
                           self.max_num_batched_tokens, self.max_model_len, self.block_size,
                           RunnerOptions(enforce_eager=config.enforce_eager, cuda_graph_sizes=config.cuda_graph_sizes,
                                         topk_backend=config.topk_backend, step_timeout_s=config.step_timeout_s,
                                         num_speculative_tokens=spec_k, side_stream=config.side_stream,
                                         kv_cache_dtype=config.kv_cache_dtype,
                                         adaptive_speculation=config.adaptive_speculation_on(self.device.type),
                                         prefill_graphs=config.cudagraph_mode == "full_and_piecewise",
                                         prefill_graph_sizes=config.prefill_cuda_graph_sizes),
                           mtp=mtp)

    def _start_executor(self):
        """One worker process per local rank (executor/multiproc.py); rank 0 hosts the rendezvous."""
        from ..distributed.process_group import free_port
        from ..executor.multiproc import MultiprocExecutor
        from ..executor.worker_proc import RunnerLimits, WorkerSpec

        config = self.config
        addr = config.master_addr or "127.0.0.1"
        spec = WorkerSpec(config, self.device.type, self.dtype, config.world_size, addr,
                          config.master_port or free_port(addr), STARTUP_TIMEOUT_S,
                          RunnerLimits(self.max_model_len, self.max_num_batched_tokens, self.block_size))
        return MultiprocExecutor(spec, config.max_num_seqs)

    def shutdown(self) -> None:
        """Stop the workers of a parallel layout, drop the model, the KV state, the CUDA graphs and the
        runner's buffers, and hand the freed device memory back (`gc.collect()`, then CUDA's cache), so
        that another engine can start in this process. Requests still queued are dropped; every later
        call raises `EngineClosedError`. A second call does nothing."""
        if self.__dict__.get("closed", True):
            return  # shut down already, or __init__ failed before anything was made
        self.closed = True
        runner = self.__dict__.get("runner")
        try:
            if runner is not None and self.parallel:
                runner.shutdown()
            elif runner is not None:
                runner.release()
        finally:
            made = self.__dict__  # a failed start may not have made them all
            dropped = ("runner", "model", "kv", "scheduler", "_in_flight", "_grammars")
            made.update({n: None for n in dropped if n in made})
            made.update({n: {} for n in ("mtp_tensors", "requests", "groups", "prompts") if n in made})
            self._suspects = set()
            runner = None  # this frame's reference too, before the collection
            gc.collect()  # the model's modules hold reference cycles
            device = self.__dict__.get("device")
            if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def __del__(self) -> None:
        # The last reference is gone (`del llm`): free the engine. At interpreter exit modules may be
        # torn down already: then only a parallel layout's workers are stopped, with no collection.
        try:
            if sys.is_finalizing():
                runner = self.__dict__.get("runner")
                if self.__dict__.get("parallel") and runner is not None and not self.__dict__.get("closed", True):
                    runner.shutdown()
            else:
                self.shutdown()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass

    def _log_startup(self, seconds: float) -> None:
        log_startup(seconds, self.load_s, self.runner)

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine was shut down (LLM.shutdown() or the end of its `with` block) and "
                                    "its model is freed; create a new LLM to run more requests")

    def _finish_init(self) -> None:
        config, hf = self.config, self.model_config.hf_config
        # Async scheduling: launch step n + 1 before reading step n back (on by default on CUDA).
        # With speculation (opt-in, async_scheduling=True, until checked on a GPU), step n + 1 is
        # scheduled once n is read back and n's bookkeeping overlaps n + 1 (engine/spec_async.py).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda" and not config.num_speculative_tokens)
        self._in_flight: LaunchedStep | None = None
        self._advanced_step: LaunchedStep | None = None  # see spec_async.advance
        num_blocks, cache_bytes = self._size_cache()
        self.cache_bytes = cache_bytes  # the one source of the cache figures (start-up report, kv_report)
        self.runner.allocate_state(num_blocks)
        self.cache_config = CacheConfig(
            block_size=self.block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0,
            num_slots=config.max_num_seqs,
            bytes_per_block_by_kind=dict(self.kv_plan.bytes_per_block_by_kind),
            bytes_per_slot_by_kind=dict(self.kv_plan.bytes_per_slot_by_kind))
        self.kv = KVCacheManager(num_blocks, self.block_size, config.max_num_seqs)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.max_model_len)
        logger.info("%s", self.weight_plan.report(self.parallel_layout))
        logger.info("%s", self.kv_plan.report(self.max_model_len, cache_bytes))
        logger.info("cache: %d blocks of %d tokens, %d slots (%.2f GiB)", num_blocks, self.block_size,
                    config.max_num_seqs, cache_bytes / 1024**3)
        if self.parallel:  # one shared KV head (MQA): every rank holds the whole state
            logger.info("the KV state is replicated on each of the %d tensor-parallel ranks: the figures above "
                        "are per GPU", config.world_size)
        self.runner.warm_up_kernels()
        self.runner.capture_graphs(audit_mode(config))
        self.spec_policy = attach_policy(self.scheduler, config, self.device.type, self.runner, self.spec_metrics)
        if config.cudagraph_audit_replay and not self.parallel:  # the replay half reads the runner in this process
            audit_graph_replays(self.runner, self.kv, seed=config.seed)
        self.eos_token_id = hf.eos_token_id if isinstance(hf.eos_token_id, int) else None
        self.limits = ModelLimits(self.vocab_size, self.max_model_len, config.max_logprobs)
        self._suspects: set[Request] = set()  # requests of a failed async step: they run synchronously
        self._applying = 0  # index of the chunk whose results _apply is recording (see isolation.py)
        self._rng = random.Random(config.seed)
        self._counter = itertools.count()
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self.prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._grammars = None  # GrammarCompilerCache, made at the first structured-output request
        self._num_host_state = 0  # running requests whose sampling needs the host's token lists

    def _grammar_compiler(self):
        if self._grammars is None:
            from ..structured_output import GrammarCompilerCache

            self._grammars = GrammarCompilerCache(self.tokenizer, self.vocab_size)
        return self._grammars

    # ---- sizing ----
    def _size_cache(self) -> tuple[int, int]:
        plan = self.kv_plan
        slots_bytes = self.config.max_num_seqs * plan.bytes_per_slot + plan.fixed_bytes
        if self.config.kv_cache_memory_bytes is not None:
            cache_bytes = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            cache_bytes = self.runner.cache_bytes_available(self.config.gpu_memory_utilization)
        else:
            full = self.config.max_num_seqs * plan.sequence_bytes(self.max_model_len) + plan.fixed_bytes
            cache_bytes = min(full, max(CPU_DEFAULT_CACHE_BYTES, slots_bytes + plan.sequence_bytes(self.max_model_len)))
        num_blocks = (cache_bytes - slots_bytes) // max(plan.bytes_per_block, 1)
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif plan.bytes_per_block == 0:  # sliding-window-only model: no growing state
            num_blocks = self.config.max_num_seqs * plan.blocks_for(self.max_model_len)
        if num_blocks < 1:
            given = self.config.kv_cache_memory_bytes
            raise ConfigError(
                (f"kv_cache_memory_bytes={given}: " if given is not None else "")
                + f"no memory left for the KV cache: {cache_bytes / 1024**3:.2f} GiB available, "
                f"{slots_bytes / 1024**3:.2f} GiB needed for {self.config.max_num_seqs} sequence slots; "
                "lower max_num_seqs or max_num_batched_tokens, or raise gpu_memory_utilization "
                "(or kv_cache_memory_bytes)")
        # What is allocated: the slots and fixed rows plus whole blocks.
        return int(num_blocks), int(slots_bytes + num_blocks * plan.bytes_per_block)

    def _check_state_fits(self) -> None:
        """The per-slot state and the fixed rows must fit before anything is allocated for them."""
        plan, seqs = self.kv_plan, self.config.max_num_seqs
        tables = (seqs + 1) * -(-self.max_model_len // self.block_size) * 8
        check_memory(f"max_num_seqs={seqs} (sequence slots, block tables) with max_num_batched_tokens="
                     f"{self.max_num_batched_tokens}", seqs * plan.bytes_per_slot + plan.fixed_bytes + tables,
                     self._free_memory(), "lower max_num_seqs or max_num_batched_tokens")

    def _free_memory(self) -> int | None:
        """Free memory for the state; None for GPUs of a parallel layout (the driver holds no GPU: each
        rank sizes its cache from its own free memory)."""
        if self.parallel and self.device.type == "cuda":
            return None
        return available_memory_bytes(self.device)

    # ---- requests ----
    def validate_request(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Everything that can be checked before a request is queued; raises with a clear message."""
        self.check_open()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.limits)  # again: fields may have changed since construction
        text, ids = parse_prompt(prompt, self.tokenizer, self.vocab_size)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestTooLargeError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt or raise max_model_len")
        if self.parallel and params.structured_outputs is not None:
            raise InvalidRequestError("structured_outputs are not supported with tensor_parallel_size > 1 yet (the "
                                      "grammar state stays in the driver); use tensor_parallel_size=1 for them")
        if params.stop_strings and (self.tokenizer is None or not params.detokenize):
            raise InvalidRequestError("stop strings need detokenize=True and a tokenizer; use stop_token_ids instead")
        if params.needs_logits_processing:
            prepare_logits_fields(params, self.vocab_size, self.tokenizer, self._grammar_compiler, InvalidRequestError)
        longest = self._max_total_tokens(len(ids), params)
        if self.kv.blocks_for(longest) > self.kv.num_blocks:
            raise RequestTooLargeError(
                f"the request may reach {longest} tokens, which needs {self.kv.blocks_for(longest)} cache blocks; "
                f"the cache has {self.kv.num_blocks}. Lower max_tokens or give the cache more memory")
        return text, ids

    def _max_total_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if params.max_tokens is None:
            return self.max_model_len
        return min(prompt_len + params.max_tokens, self.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.groups or request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; give each request its own id")
        text, ids = self.validate_request(prompt, params)
        self._add_validated(request_id, text, ids, params)

    def _add_validated(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        if params.n > 1 and any(f"{request_id}#{i}" in self.requests for i in range(params.n)):
            raise InvalidRequestError(f"request id {request_id!r} with n={params.n} collides with a running "
                                      "request's id; give each request its own id")
        children = []
        for index in range(params.n):
            if params.seed is not None:
                seed = (params.seed * 1_000_003 + index) & 0xFFFFFFFF
            else:
                seed = self._rng.getrandbits(32)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            req = Request(child_id, text, list(ids), params, seed, next(self._counter))
            if params.logprobs is not None:
                req.logprobs = []
            if params.structured_outputs is not None:
                req.grammar = self._grammar_compiler().new_state(params.structured_outputs,
                                                                 self.config.num_speculative_tokens)
            if params.needs_logits_processing and needs_host_state(params):
                req.needs_host_state = True
                self._num_host_state += 1
            self.requests[child_id] = req
            children.append(req)
            self.scheduler.add(req)
        self.groups[request_id] = children
        self.prompts[request_id] = (text, list(ids))

    def abort_request(self, request_id: str) -> None:
        if self.closed:
            return  # shutdown dropped every request
        for req in self.groups.pop(request_id, []):
            if not req.is_finished:
                self._release(req)
                self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self.runner.forget(req.request_id)
            self._suspects.discard(req)
        self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        if self.closed:
            return False  # shutdown dropped every request
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and return the new output of every request that advanced, as its
        `SamplingParams.output_kind` asks (CUMULATIVE, DELTA or FINAL_ONLY). With async scheduling
        the step launched here is read back by the next call, so the host's bookkeeping and the next
        schedule overlap the GPU's work (outputs arrive one call later)."""
        self.check_open()
        if self.async_scheduling and self.config.num_speculative_tokens:
            if self._suspects:
                self._suspects = {r for r in self._suspects if not r.is_finished}
            return spec_async.step(self)
        early: list[RequestOutput] = []
        # A request's sampling needs its previous token on the host (a grammar, a bad word's prefix):
        # the next step's forward is launched first, the in-flight step is read back while the device
        # runs it, and the sampling is queued after that.
        defer_sampling = self._in_flight is not None and self._num_host_state > 0
        if defer_sampling and (self._suspects or not self.runner.defers_sampling):
            early, self._in_flight = self._collect(self._in_flight), None
            defer_sampling = False
        sched = self.scheduler.schedule()
        if self._suspects:
            self._suspects = {r for r in self._suspects if not r.is_finished}
        if not self.async_scheduling or self._suspects:
            return early + isolation.run_step(self, sched)  # a failure is narrowed to its request(s)
        previous = self._in_flight
        try:
            launched = self._launch(sched, defer_sampling) if sched.chunks else None
            self._in_flight = launched
            outputs = self._collect(previous) if previous is not None else []
            if defer_sampling and launched is not None:
                self.runner.launch_sampling(launched)
        except Exception as exc:  # noqa: BLE001 - isolation.py re-raises engine faults
            return early + isolation.requeue_after_failure(self, exc, [sched, previous.sched if previous else None])
        if previous is None and launched is None and self.scheduler.has_unfinished() and not early:
            raise RuntimeError("the scheduler could schedule nothing while requests wait; this is a bug")
        return early + outputs

    def _launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        for req in sched.preempted:
            self.runner.forget(req.request_id)
        launched = self.runner.launch(sched, defer_sampling)
        for chunk in sched.chunks:
            # Drafts count once verified (in _collect); a sampled token is pending until read back.
            chunk.request.num_computed_tokens += chunk.num_tokens - chunk.num_draft
            if chunk.completes:
                chunk.request.num_pending_tokens += 1
        return launched

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        return isolation.apply_isolated(self, launched, self.runner.collect(launched))

    def _apply(self, launched: LaunchedStep, result: RunnerOutput, chunks) -> list[RequestOutput]:
        """Record a collected step's results for `chunks` (appends, stops, frees) and return the
        outputs of the groups it finished."""
        finished_groups: set[str] = set()
        self._applying = -1  # -1 outside the per-request loop: an error there is no request's
        advanced_groups: set[str] = set()
        # Speculation and prompt logprobs need the full bookkeeping below; plain steps skip it.
        plain = not (result.num_accepted or result.drafts or result.prompt_logprobs)
        sampled_by_id = result.sampled
        # spec_async.advance recorded the counts, tokens and drafts before the next launch.
        advanced = launched is self._advanced_step
        for i, chunk in enumerate(chunks):
            self._applying = i
            req = chunk.request
            if chunk.completes and not advanced:
                req.num_pending_tokens -= 1
            if req.is_finished:
                if not plain:
                    self.runner.forget(req.request_id)  # drafts proposed for a request that had finished
                continue  # finished or aborted while this step ran: what it computed is dropped
            if advanced:
                appended = len(sampled_by_id.get(req.request_id, ()))
                if appended:
                    del req.output_token_ids[-appended:]  # re-appended below, with the stop checks
                self._record_prompt_logprobs(req, result)
            elif chunk.num_draft or not plain:
                accepted = result.num_accepted.get(req.request_id, 0)
                # Verified drafts that were rejected leave positions to be re-run (position-addressed).
                req.num_computed_tokens += accepted
                req.draft_token_ids = []
                if chunk.num_draft:
                    self.spec_metrics.record(chunk.num_draft, accepted)
                self._record_prompt_logprobs(req, result)
            elif req.draft_token_ids:
                req.draft_token_ids = []
            finished = False
            samples = sampled_by_id.get(req.request_id, ())
            if samples and req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                advanced_groups.add(self._group_of(req))
            for sampled in samples:
                new_text = self._append_token(req, sampled)
                if self._check_stop(req, len(new_text)):
                    finished = True
                    break
            if finished:
                self._release(req)
                self.scheduler.finish(req)
                self.runner.forget(req.request_id)
                finished_groups.add(self._group_of(req))
            elif not plain and not advanced:
                req.draft_token_ids = result.drafts.get(req.request_id, [])
        self._applying = -1
        self.spec_metrics.maybe_log()
        outputs = []
        for group_id in finished_groups:
            if all(r.is_finished for r in self.groups[group_id]):
                outputs.append(self._make_output(group_id))
                advanced_groups.discard(group_id)
        for group_id in advanced_groups:
            if group_id in self.groups:
                outputs.append(self._make_output(group_id, final=False))
        return outputs

    def _release(self, req: Request) -> None:
        if req.needs_host_state:
            req.needs_host_state = False
            self._num_host_state -= 1

    def _group_of(self, req: Request) -> str:
        return req.request_id.rsplit("#", 1)[0] if req.params.n > 1 else req.request_id

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _record_prompt_logprobs(self, req: Request, result: RunnerOutput) -> None:
        rows = result.prompt_logprobs.get(req.request_id)
        if not rows:
            return
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        for position, lp, rank, top in rows:
            if position != len(req.prompt_logprobs):
                continue  # already recorded (a recompute after preemption)
            entry = {tid: Logprob(v, r + 1, self._decode_token(tid)) for r, (tid, v) in enumerate(top)}
            target = req.prompt_token_ids[position]
            entry[target] = Logprob(lp, rank, self._decode_token(target))
            req.prompt_logprobs.append(entry)

    def _append_token(self, req: Request, sampled) -> str:
        req.output_token_ids.append(sampled.token_id)
        if req.grammar is not None:
            req.grammar.accept(sampled.token_id)
        if req.logprobs is not None:
            entry = {tid: Logprob(v, r + 1, self._decode_token(tid)) for r, (tid, v) in enumerate(sampled.top)}
            entry[sampled.token_id] = Logprob(sampled.logprob, sampled.rank, self._decode_token(sampled.token_id))
            req.logprobs.append(entry)
            req.cumulative_logprob += sampled.logprob
        if req.params.detokenize and self._decode is not None:
            return detokenize_incrementally(self._decode, req, req.params.skip_special_tokens)
        return ""

    def _check_stop(self, req: Request, new_text_len: int) -> bool:
        params = req.params
        token = req.output_token_ids[-1]
        num_out = len(req.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
                return self._finish(req, "stop", None)
            if params.stop_token_ids and token in params.stop_token_ids:
                return self._finish(req, "stop", token)
            for stop in params.stop_strings:
                # A new match must overlap the text added by this token.
                idx = req.text.find(stop, max(0, len(req.text) - new_text_len - len(stop) + 1)) if new_text_len else -1
                if idx != -1:
                    req.text = req.text[:idx + len(stop)] if params.include_stop_str_in_output else req.text[:idx]
                    return self._finish(req, "stop", stop)
        if req.reaches_length_limit(self.max_model_len):
            return self._finish(req, "length", None)
        return False

    @staticmethod
    def _finish(req: Request, reason: str, stop_reason) -> bool:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        return True

    def _make_output(self, group_id: str, final: bool = True) -> RequestOutput:
        """The group's output; `final` pops its state. A DELTA output carries what is new since the last
        one (children that did not advance are left out); text that may still become part of a stop
        string is held back until the request finishes."""
        if final:
            children = self.groups.pop(group_id)
            text, ids = self.prompts.pop(group_id)
        else:
            children = self.groups[group_id]
            text, ids = self.prompts[group_id]
        delta = children[0].params.output_kind is RequestOutputKind.DELTA
        completions = []
        for index, req in enumerate(children):
            if final:
                self.requests.pop(req.request_id, None)
            end = len(req.text)  # the text shown ends here (held back: what may still start a stop string)
            if not req.is_finished and req.params.stop_strings:
                end = max(0, end - max(map(len, req.params.stop_strings)) + 1)
            tokens, logprobs = req.output_token_ids, req.logprobs
            if delta:
                if req.num_emitted_tokens < 0:
                    continue  # finished earlier; its last delta is out
                start, start_chars = req.num_emitted_tokens, req.num_emitted_chars
                if start == len(tokens) and start_chars == end and not req.is_finished:
                    continue
                tokens = tokens[start:]
                logprobs = logprobs[start:] if logprobs is not None else None
                out_text = req.text[start_chars:end]  # only the new characters are copied
                req.num_emitted_tokens, req.num_emitted_chars = len(req.output_token_ids), end
                if req.is_finished:
                    req.num_emitted_tokens = -1  # its final delta is out
            else:
                out_text = req.text if end == len(req.text) else req.text[:end]
            completions.append(CompletionOutput(  # a DELTA's slices are new lists already
                index=index, text=out_text, token_ids=tokens if delta else list(tokens),
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None and not final and not delta else logprobs,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason))
        return RequestOutput(request_id=group_id, prompt=text, prompt_token_ids=ids, outputs=completions,
                             finished=final, prompt_logprobs=children[0].prompt_logprobs,
                             metrics={"num_preemptions": sum(r.num_preemptions for r in children)})

    def kv_report(self, max_model_len: int | None = None) -> str:
        return self.kv_plan.report(max_model_len or self.max_model_len, self.cache_bytes)

    def all_cache_free(self) -> bool:
        return self.kv.all_free()

    def debug_state_counts(self) -> dict[str, int]:
        """Counts of every per-request structure (all zero when the engine is idle: nothing leaked)."""
        kv = self.kv
        return {"requests": len(self.requests), "groups": len(self.groups), "prompts": len(self.prompts),
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "used_blocks": kv.num_blocks - len(set(kv.free_blocks)),
                "used_slots": kv.num_slots - len(set(kv.free_slots)),
                "double_freed": len(kv.free_blocks) - len(set(kv.free_blocks))
                + len(kv.free_slots) - len(set(kv.free_slots)),
                "draft_probs": len(self.runner.draft_probs), "in_flight": int(self._in_flight is not None),
                "prompt_masks": len(getattr(self.runner, "prompt_masks", ())),
                "suspects": sum(not r.is_finished for r in self._suspects)}
