"""Runs the model for a scheduled step: metadata -> forward -> logits -> samples.

Owns the model, its state (the KV cache tensors), the device and, with speculation on, the
`MTPSpeculator` it builds from the MTP layer. Knows nothing of the scheduler's policies; it
receives a `SchedulerOutput` and returns a `RunnerOutput` (sparseserve/step_types.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ..config import SIDE_STREAM_MODES, ModelConfig
from ..kernels.argmax import greedy_tokens
from ..kernels.topk import IndexerTopK
from ..model.batch import BlockTableCache, SequenceChunk, build_batch
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.host_copy import to_device, to_host
from ..model.mtp import MTPModule
from ..model.state import ModelState, StateLayout
from ..model.step_context import TopKFn, default_topk
from ..sample.sampler import SamplingTensors, sample, token_logprobs
from ..spec_decode.spec_step import MTPSpeculator
from ..step_types import PENDING_TOKEN_ID, RunnerOutput, SampledToken, SchedulerOutput
from . import drafter_steps
from .cuda_graph import (BufferSpec, CapturedGraph, CudaGraphRunner, GraphCaptureError, decode_batch,
                         default_graph_sizes, logits_mode, pad_chunks, pick_bucket)
from .drafter_steps import drafter_graph_runners
from ..sample.logits_processors import process_logits
from .kernel_warmup import run_warmup, runner_plan
from .prefill_graphs import PrefillGraphs, prefill_graph_sizes
from .runner_types import LaunchedStep, RunnerOptions, is_run, logits_rows
from .sampling_state import LogitsState, SamplingTensorCache
from .watchdog import StepWatchdog

logger = logging.getLogger("sparseserve")


class ModelRunner:
    # `launch(sched, defer_sampling=True)` and `launch_sampling` (the engine's split step).
    defers_sampling = True

    def __init__(self, model: DeepseekV4ForCausalLM, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, options: RunnerOptions | None = None, mtp: MTPModule | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.options = options or RunnerOptions()
        self.state: ModelState | None = None
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Block-table rows by slot (the dummy slot of padding sequences included), kept across steps.
        self.block_tables = BlockTableCache(max_num_seqs + 1, self.max_blocks_per_seq)
        # Static row widths of decode steps (eager and graph alike, so both compute the same).
        self.decode_entries = {r: max_model_len // r for r in model_config.rates}
        self.csa_rates = sorted({model_config.compress_rate(i) for i in range(model_config.num_layers)
                                 if model_config.is_csa(i)})
        self.watchdog = StepWatchdog(self.options.step_timeout_s)
        self.use_graphs = device.type == "cuda" and not self.options.enforce_eager
        # Every graph is warmed up and captured on this stream (see CudaGraphRunner.capture).
        self.capture_stream = torch.cuda.Stream(device=device) if self.use_graphs else None
        if self.use_graphs and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"CUDA graphs need the bf16/fp16 kernels, but dtype is {dtype}; "
                             "use dtype='bfloat16' or enforce_eager=True")
        self.graph_sizes = sorted(self.options.cuda_graph_sizes or default_graph_sizes(max_num_seqs))
        if any(s < 1 or s > max_num_seqs for s in self.graph_sizes):
            raise ValueError(f"cuda_graph_sizes must lie in [1, max_num_seqs={max_num_seqs}], got {self.graph_sizes}")
        # Decode-like steps (every sequence has the same number of tokens: 1, or 1 + k when verifying
        # k drafts) run as graphs; on CUDA their eager form is padded and built the same way, so
        # both modes compute the same function (docs/design.md, invariant 5).
        k = self.options.num_speculative_tokens
        verify_lens = list(range(2, k + 2)) if self.options.adaptive_speculation else [1 + k] if k else []
        self.query_lens = [1] + verify_lens
        # Captured graphs use the side stream ("auto" = "graphs"), except with speculation: its graphs
        # (verify, drafter) have not been measured with it on the GPU, so "auto" keeps them on one stream.
        mode = self.options.side_stream
        if mode not in SIDE_STREAM_MODES:
            raise ValueError(f"side_stream must be one of {SIDE_STREAM_MODES}, got {mode!r}")
        self.model.side_streams.mode = ("never" if k else "graphs") if mode == "auto" else mode
        self.pad_like_graphs = device.type == "cuda"
        self._topk: dict[int, IndexerTopK] = {}
        # Prefill and mixed steps up to the largest bucket run padded, as pieces and cores (prefill_graphs.py):
        # replayed pieces once captured, eager ones before (and with enforce_eager, like decode steps).
        self.prefill_sizes = (prefill_graph_sizes(self.options.prefill_graph_sizes, max_num_batched_tokens)
                              if self.options.prefill_graphs else [])
        self.prefill: PrefillGraphs | None = None  # made with the state
        self.graph_pool = None  # one memory pool for every graph (capture_graphs)
        self.graphs: dict[int, CudaGraphRunner] = {}  # target model, by query length
        self.mtp_graphs: dict[int, CudaGraphRunner] = {}  # the MTP drafter, by query length
        # Its state-only catch-up of plain steps (adaptive speculation's d = 0), by query length (1).
        self.mtp_state_graphs: dict[int, CudaGraphRunner] = {}
        # The chunks and graph of the last target forward replayed (None: it ran eagerly): a
        # catch-up over the same chunks copies that graph's metadata on the device.
        self.replayed: tuple[list[SequenceChunk], CapturedGraph] | None = None
        if k and mtp is None:
            raise ValueError("num_speculative_tokens > 0 needs the MTP layer (mtp=...)")
        self.mtp = mtp if k else None
        self.speculator: MTPSpeculator | None = None  # built with the state (allocate_state)
        self.step_costs = None  # adaptive speculation: StepCosts timed from the graphs (capture_graphs)
        self.last_streams: torch.Tensor | None = None
        # The last launched step's sampled tokens (device) and each request's row among them:
        # the next step reads its pending input tokens from there.
        self._last_sampled: tuple[torch.Tensor, dict] | None = None
        eos = model_config.hf_config.eos_token_id
        self.eos_token_id = eos if isinstance(eos, int) else None
        self.logits_state = LogitsState(self.eos_token_id)  # penalties, bans, biases, grammar masks
        self.sampling_cache = SamplingTensorCache()
        # The forwards start-up runs before any request, with their wall time (kernel builds included).
        self.startup_steps: list[tuple[str, float]] = []
        self.startup_phases: dict[str, float] = {}  # start-up phase -> seconds (the start-up report)
        self.startup_graphs: list[str] = []  # what capture_graphs captured, one line per graph family

    # ---- top-k paths: fixed per row bucket from static facts (docs/design.md, invariant 3) ----
    def topk_for(self, max_rows: int) -> tuple[TopKFn, str]:
        if not self.csa_rates or self.device.type != "cuda" or self.options.topk_backend == "torch":
            return default_topk, "torch"
        if max_rows not in self._topk:
            width = max(self.max_model_len // r for r in self.csa_rates)
            self._topk[max_rows] = IndexerTopK(
                max_rows, width, self.model_config.hf_config.index_topk, self.options.topk_backend, self.device)
        topk = self._topk[max_rows]

        def run(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
            return topk(scores, lengths)

        return run, topk.path

    # ---- memory ----
    def _layout(self, num_blocks: int) -> StateLayout:
        # One slot more than max_num_seqs: the dummy slot that padded graph rows write to.
        return StateLayout(num_blocks=num_blocks, block_size=self.block_size, num_slots=self.max_num_seqs + 1,
                           max_step_tokens=self.max_num_batched_tokens,
                           sliding_window=self.model_config.hf_config.sliding_window,
                           num_speculative_tokens=self.options.num_speculative_tokens)

    @torch.no_grad()
    def profile_peak_activation_bytes(self) -> int:
        """Peak memory of a worst-case step (a full token budget) above what is allocated now."""
        if self.device.type != "cuda":
            return 0
        length = min(self.max_num_batched_tokens, self.max_model_len)
        blocks = -(-length // self.block_size)
        kv = self.options.kv_cache_dtype
        state = ModelState(self.model_config, self._layout(blocks), self.device, self.dtype, kv)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        chunk = SequenceChunk(slot=0, start_pos=0, token_ids=[1] * length, block_ids=list(range(blocks)))
        batch = build_batch([chunk], self.model_config.rates, self.device)
        streams = self.model(batch, state, topk=self.topk_for(self.max_num_batched_tokens)[0])
        rows = min(self.max_num_seqs, length)
        logits = self.model.compute_logits(streams[-rows:])
        torch.log_softmax(logits, dim=-1)
        torch.cuda.synchronize()
        self.startup_steps.append((f"cache profiling: a {length}-token prefill to its logits",
                                   time.perf_counter() - start))
        peak = torch.cuda.max_memory_allocated() - base
        del state, streams, logits
        torch.cuda.empty_cache()
        return int(peak)

    def cache_bytes_available(self, gpu_memory_utilization: float) -> int:
        """CUDA: the bytes left for the cache under `gpu_memory_utilization`, after the weights, what
        else is allocated and a worst-case step's activations."""
        peak = self.profile_peak_activation_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(gpu_memory_utilization * total - (total - free) - peak)

    def allocate_state(self, num_blocks: int) -> None:
        kv = self.options.kv_cache_dtype
        self.state = ModelState(self.model_config, self._layout(num_blocks), self.device, self.dtype, kv)
        if self.prefill_sizes:
            self.prefill = PrefillGraphs(self.model, self.state, self.prefill_sizes, self.max_num_seqs,
                                         self.max_model_len, self.dtype, stream=self.capture_stream)
        if self.mtp is not None:
            mtp_state = ModelState(self.mtp.config, self._layout(0), self.device, self.dtype, kv)
            self.speculator = MTPSpeculator(self.mtp, self.model, mtp_state, self.options.num_speculative_tokens,
                                            self.mtp_forward, self.mtp_catch_up)

    def release(self) -> None:
        """Drop the model, the state, the graphs and the step buffers (the engine's shutdown frees them)."""
        self.graphs, self.mtp_graphs, self.mtp_state_graphs, self._topk = {}, {}, {}, {}
        self.prefill = self.graph_pool = None
        self.state = self.speculator = self.mtp = self._last_sampled = self.last_streams = self.replayed = None
        self.model = self.capture_stream = None
        self.logits_state, self.sampling_cache = LogitsState(self.eos_token_id), SamplingTensorCache()

    @property
    def draft_probs(self) -> dict:
        """The speculator's per-request draft distributions (empty without speculation)."""
        return self.speculator.draft_probs if self.speculator is not None else {}

    @property
    def prompt_masks(self) -> dict[str, torch.Tensor]:
        return self.logits_state.prompt_masks

    def forget(self, request_id: str) -> None:
        """Drop per-request state (the request finished, was aborted or preempted)."""
        self.logits_state.forget(request_id)
        self.sampling_cache.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def graph_sizes_for(self, query_len: int) -> list[int]:
        """The buckets a graph of this query length is captured for (its tokens fit one step's staging rows)."""
        return [size for size in self.graph_sizes if size * query_len <= self.max_num_batched_tokens]

    def _target_step(self, batch, topk, hidden, outputs) -> None:
        streams = self.model(batch, self.state, topk=topk)
        self.model.compute_logits(batch.logits_streams(streams), out=outputs[0])
        if len(outputs) > 1:  # the drafter reads every token's streams
            outputs[1].copy_(streams)

    def _new_graph_runners(self, pool_per_runner: bool = False) -> list[CudaGraphRunner]:
        hf = self.model_config.hf_config
        streams = BufferSpec((hf.hc_mult, hf.hidden_size), self.dtype)
        logits = BufferSpec((hf.vocab_size,), torch.float32)
        common = dict(state=self.state, max_blocks=self.max_blocks_per_seq, block_tables=self.block_tables,
                      dummy_slot=self.max_num_seqs, short_len=2, stream=self.capture_stream)
        pool = None if pool_per_runner else self.graph_pool  # None: each runner makes its own
        runners = []
        for q in self.query_lens:
            outputs = [logits, streams] if self.speculator is not None else [logits]
            runners.append(CudaGraphRunner("target", self._target_step, outputs, rates=self.model_config.rates,
                                           sizes=self.graph_sizes_for(q), query_len=q, num_entries=self.decode_entries,
                                           topk_for=self.topk_for, pool=pool, **common))
        if self.speculator is not None:
            runners += drafter_graph_runners(self, streams, runners[0], pool, common)
        return runners

    def warm_up_kernels(self) -> None:
        """Build the kernels of every eager step the limits admit before serving (kernel_warmup.py)."""
        if self.device.type != "cuda":
            return  # no Triton kernel runs off CUDA
        report = run_warmup(self, runner_plan(self))
        self.startup_phases["kernel warm-up"] = report.seconds
        self.startup_steps.append((f"kernel warm-up: {report.steps} eager steps, {report.builds} kernels built",
                                   report.seconds))

    def capture_graphs(self, audit: str = "off") -> None:
        """Capture every graph. `audit` ("off", "sample", "all"): compare the captures of those buckets
        with a second capture at max_model_len dummy lengths; GraphCaptureError on a difference."""
        if not self.use_graphs:
            return
        problems = []
        self.graph_pool = torch.cuda.graph_pool_handle()
        for runner in self._new_graph_runners():
            problems += runner.capture_all(audit, self.max_model_len)
            for phase, seconds in (("graph capture", runner.capture_s), ("capture audit", runner.audit_s)):
                self.startup_phases[phase] = self.startup_phases.get(phase, 0.0) + seconds
            if runner.sizes:
                self.startup_steps.append((f"first graph warm-up: {runner.name}, batch {max(runner.sizes)} of "
                                           f"{runner.query_len} token(s)", runner.first_warmup_s))
                self.startup_graphs.append(f"{runner.name} decode (query length {runner.query_len}): batch sizes "
                                           f"{runner.sizes} in {runner.capture_s:.1f} s")
            self._graph_families()[runner.name][runner.query_len] = runner
        if self.prefill is not None:  # after the decode graphs, in their pool
            self.prefill.pool = self.graph_pool
            problems += self.prefill.capture_all(self.topk_for(self.max_num_batched_tokens)[0], audit)
            for phase, seconds in (("prefill graph capture", self.prefill.capture_s),
                                   ("capture audit", self.prefill.audit_s)):
                self.startup_phases[phase] = self.startup_phases.get(phase, 0.0) + seconds
            self.startup_graphs.append(f"prefill (piecewise): {len(self.prefill.graphs)} token-count buckets "
                                       f"{self.prefill.sizes} x {self.prefill.num_pieces} pieces in "
                                       f"{self.prefill.capture_s:.1f} s")
        if problems:
            self.graphs, self.mtp_graphs, self.mtp_state_graphs = {}, {}, {}
            if self.prefill is not None:
                self.prefill.graphs = {}
            raise GraphCaptureError("CUDA graph audit failed:\n" + "\n".join(problems))
        if self.speculator is not None and self.options.adaptive_speculation:
            self.step_costs = self.speculator.measure_costs(self.graphs, self.mtp_graphs, self.mtp_state_graphs)

    def _graph_families(self) -> dict[str, dict[int, CudaGraphRunner]]:
        return {"target": self.graphs, "mtp": self.mtp_graphs, "mtp_state": self.mtp_state_graphs}

    @contextmanager
    def eager_only(self):
        """Run steps eagerly (padded as graphs would be) while inside; used by the replay audit."""
        kept = self.graphs, self.mtp_graphs, self.mtp_state_graphs
        self.graphs, self.mtp_graphs, self.mtp_state_graphs = {}, {}, {}
        if self.prefill is not None:
            self.prefill.use_graphs = False
        try:
            yield
        finally:
            self.graphs, self.mtp_graphs, self.mtp_state_graphs = kept
            if self.prefill is not None:
                self.prefill.use_graphs = True

    # ---- execution ----
    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run a step and read its results back (the synchronous form of launch + collect)."""
        return self.collect(self.launch(sched))

    @torch.no_grad()
    def launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        """Queue a step's device work: metadata, forward, sampling and the copies of its results to
        pinned host memory; nothing here waits for the GPU. Tokens of earlier steps not yet read back
        (pending) are taken from the device. Everything that reads the logits is queued before the
        next launch, since the next step's graph replay overwrites the shared logits buffer.

        `defer_sampling` queues only the forward: the caller reads the previous step back while the
        device runs it (host-side sampling state such as a grammar needs that step's tokens), then
        calls `launch_sampling` before launching anything else."""
        chunks: list[SequenceChunk] = []
        fix_dst: list[int] = []  # flat token index of each pending input token
        fix_src: list[int] = []  # its row among the last launched step's sampled tokens
        last_rows = self._last_sampled[1] if self._last_sampled is not None else {}
        sample_rows: list[int] = []
        sample_reqs: list = []
        verify: list[tuple[int, int]] = []
        prompt_rows: list[tuple] = []  # (request, first row, rows, start): prompt logprobs to queue
        offset = row = 0
        all_greedy, any_logprobs, any_processing = True, False, False
        # One pass over the chunks, reading fields directly: at batch 200 this loop is a good part of
        # a decode step's host time, which bounds the step when the GPU is faster.
        for i, sc in enumerate(sched.chunks):
            req = sc.request
            start, n, num_draft = sc.start_pos, sc.num_tokens, sc.num_draft
            # Prompt logprobs of every chunk with prompt positions: the engine keeps those it has not
            # recorded yet (a recompute after preemption repeats some; earlier chunks may still be in flight).
            want_prompt = req.params.prompt_logprobs is not None and start < len(req.prompt_token_ids) - 1
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            if n == 1 and start == known and not num_draft:
                tokens = [PENDING_TOKEN_ID]  # the steady decode case: the input is the token sampled last step
            else:
                tokens = req.token_ids_between(start, start + n, num_draft)
            if req.num_pending_tokens and start + n > known:
                if req not in last_rows:
                    raise RuntimeError(f"request {req.request_id} has a pending token that the last launched "
                                       "step did not sample; this is an engine bug")
                fix_dst.append(offset + known - start)
                fix_src.append(last_rows[req])
            want = "all" if (want_prompt or num_draft) else ("last" if sc.completes else "none")
            chunk = SequenceChunk(slot=req.slot, start_pos=start, token_ids=tokens, block_ids=req.block_ids,
                                  want_logits=want)
            chunks.append(chunk)
            rows = logits_rows(chunk)
            if num_draft:
                verify.append((i, row))
            else:
                if want == "all":
                    prompt_rows.append((req, row, rows, start))
                if sc.completes:
                    sample_rows.append(row + rows - 1)
                    sample_reqs.append(req)
                    params = req.params
                    all_greedy = all_greedy and params.greedy
                    any_logprobs = any_logprobs or params.logprobs is not None
                    any_processing = any_processing or params.needs_logits_processing
            offset += n
            row += rows
        logits, describe = self.forward(chunks, self._pending_fix(fix_dst, fix_src))
        step = LaunchedStep(sched, chunks, logits, describe, verify=verify, sample_reqs=sample_reqs)
        for req, first, rows, start in prompt_rows:
            self._queue_prompt_logprobs(req, logits[first:first + rows], start, step)
        rows = None
        if sample_reqs:
            first = sample_rows[0]
            rows = (logits[first:first + len(sample_rows)] if is_run(sample_rows)
                    else logits[to_device(sample_rows, logits.device)])
        # Deferred sampling runs after the previous step was read back: no token is pending then.
        # The index of each token being sampled, fixed now: the engine counts it as pending after launch.
        counters = None if all_greedy else [len(r.output_token_ids) + r.num_pending_tokens for r in sample_reqs]
        step.pending_sampling = (rows, {} if defer_sampling else last_rows, counters, any_logprobs, any_processing)
        if self.speculator is not None and verify:  # queued before the step's event is recorded
            step.spec_launched = self.speculator.launch_step(self, sched, chunks, logits, verify)
        if not defer_sampling:
            self.launch_sampling(step)
        return step

    @torch.no_grad()
    def launch_sampling(self, step: LaunchedStep) -> None:
        """Queue the sampling of a launched step's logits rows and the copies of its results."""
        rows, last_rows, counters, any_logprobs, any_processing = step.pending_sampling
        step.pending_sampling = None
        sample_reqs = step.sample_reqs
        if sample_reqs:
            # Logits processing (penalties, bias, bans, grammar masks) only when a request uses it;
            # logprobs stay those of the raw model, as vLLM's default.
            processed = self._process_logits(rows, sample_reqs, last_rows) if any_processing else rows
            tokens = (greedy_tokens(processed) if counters is None  # all greedy: no sampling tensors to copy
                      else sample(processed, self.sampling_tensors(sample_reqs, counters)))
            step.sampled = (tokens, {r: i for i, r in enumerate(sample_reqs)})
            step.host_tokens = to_host(tokens)
            lp = self._logprob_tensors(rows, tokens, sample_reqs) if any_logprobs else None
            step.host_logprobs = tuple(to_host(t) for t in lp) if lp is not None else None
        self._last_sampled = step.sampled
        if self.speculator is not None and not step.verify:  # a plain step's drafter catch-up, queued now
            step.spec_launched = self.speculator.launch_catch_up(self, step)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    @torch.no_grad()
    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step (with the watchdog's deadline) and read its results."""
        if step.done is not None:
            self.watchdog.wait(step.done, step.describe)
        out = RunnerOutput()
        for req, start, host in step.prompt_logprobs:
            chosen, rank, top_ids, top_lp = (t.tolist() for t in host)
            rows = out.prompt_logprobs.setdefault(req.request_id, [])
            for j, (lp, rk, ids, lps) in enumerate(zip(chosen, rank, top_ids, top_lp)):
                rows.append((start + 1 + j, lp, rk, list(zip(ids, lps))))
        if step.sample_reqs:
            tokens = step.host_tokens.tolist()
            if step.host_logprobs is None:
                out.sampled.update({req.request_id: [SampledToken(t)] for req, t in zip(step.sample_reqs, tokens)})
            else:
                lp = [t.tolist() for t in step.host_logprobs]
                for req, st in zip(step.sample_reqs, self._records(step.sample_reqs, tokens, lp)):
                    out.sampled[req.request_id] = [st]
        if self.speculator is not None:
            self.speculator.finish_step(self, step.sched, step.chunks, step.logits, step.verify, out,
                                        step.spec_launched)
        return out

    def _pending_fix(self, dst: list[int], src: list[int]) -> Callable[[torch.Tensor], None] | None:
        """A function that writes pending tokens (sampled by the last launched step, still on the
        device) into a step's flat input ids: ids[dst[i]] = sampled[src[i]]."""
        if not dst:
            return None
        sampled = self._last_sampled[0]
        n = len(dst)
        if is_run(dst) and is_run(src):
            d, s = dst[0], src[0]  # the steady decode case: same requests, same order

            def fix(ids: torch.Tensor) -> None:
                ids[d:d + n].copy_(sampled[s:s + n])
        else:
            dst_t, src_t = to_device(dst, sampled.device), to_device(src, sampled.device)

            def fix(ids: torch.Tensor) -> None:
                ids.index_copy_(0, dst_t, sampled.index_select(0, src_t))
        return fix

    def graph_shape(self, chunks: list[SequenceChunk], check_logits: bool = True) -> tuple[int, int] | None:
        """(bucket, query_len) when a graph of this step's shape exists: every sequence has the same
        number of tokens, a graph query length, and wants that length's logits; else None."""
        q = len(chunks[0].token_ids)
        if q not in self.query_lens or {len(c.token_ids) for c in chunks} != {q}:
            return None
        if check_logits and {c.want_logits for c in chunks} != {logits_mode(q)}:
            return None
        bucket = pick_bucket(self.graph_sizes_for(q), len(chunks))
        return None if bucket is None else (bucket, q)

    @torch.no_grad()
    def forward(self, chunks: list[SequenceChunk], fix_inputs: Callable[[torch.Tensor], None] | None = None
                ) -> tuple[torch.Tensor, Callable[[], str]]:
        """fp32 logits of the chunks' wanted tokens: by graph replay when a graph holds the
        step; otherwise eagerly. On CUDA an eager step of a graph's shape is padded to the same
        bucket and built the same way as the graph's, so both modes compute the same function.
        With speculation on, the step's residual streams are kept for the drafter (`last_streams`;
        rows of padding sequences, if any, follow the real ones).`fix_inputs` writes device-side
        input ids (pending tokens) into the step's flat input ids before the forward runs."""
        shape = self.graph_shape(chunks)
        streams = self.replayed = None
        if shape is not None:  # every chunk has the shape's query length and its logits mode
            rows = len(chunks) * (shape[1] if logits_mode(shape[1]) == "all" else 1)  # real logits rows
        if shape is not None and shape[1] in self.graphs:
            outputs, graph = self.graphs[shape[1]].run(chunks, fix_inputs=fix_inputs)
            logits = outputs[0][:rows]
            streams = outputs[1] if len(outputs) > 1 else None
            self.replayed = (chunks, graph)
            mode = f"graph {graph.key}, topk_path={graph.topk_path}"
        elif shape is not None and self.pad_like_graphs:
            bucket, q = shape
            topk_fn, path = self.topk_for(bucket * q)
            padded = pad_chunks(chunks, bucket, q, self.max_num_seqs, want_logits=logits_mode(q))
            batch = decode_batch(padded, self.model_config.rates, self.device, self.max_blocks_per_seq,
                                 self.decode_entries, self.block_tables)
            if fix_inputs is not None:
                fix_inputs(batch.input_ids)
            streams = self.model(batch, self.state, topk=topk_fn)
            logits = self.model.compute_logits(batch.logits_streams(streams))[:rows]
            mode = f"eager decode step (bucket {bucket}, query_len {q}), topk_path={path}"
        else:
            topk_fn, path = self.topk_for(self.max_num_batched_tokens)
            batch = build_batch(chunks, self.model_config.rates, self.device, max_blocks=self.max_blocks_per_seq,
                                tables=self.block_tables)
            if fix_inputs is not None:
                fix_inputs(batch.input_ids)
            n = batch.num_tokens
            if self.prefill is not None and (self.prefill.graphs or self.pad_like_graphs) and self.prefill.bucket_for(n):
                carry, mode = self.prefill.run(batch, topk_fn)  # padded: the pieces' rows past n are padding
                logits = self.model.logits_of(batch.logits_streams(carry.hidden[:n]))
                # The streams live in the graph pool, which the next replay overwrites: the drafter gets a copy.
                streams = carry.streams[:n].clone() if self.speculator is not None else None
                mode += f", topk_path={path}"
            else:
                streams = self.model(batch, self.state, topk=topk_fn)
                logits = self.model.compute_logits(batch.logits_streams(streams))
                mode = f"eager step, topk_path={path}"
        self.last_streams = streams if self.speculator is not None else None

        def describe() -> str:  # only called when a step is reported
            lengths = [c.start_pos + len(c.token_ids) for c in chunks]
            return (f"{mode}, {len(chunks)} sequences, lengths min/max {min(lengths)}/{max(lengths)}, "
                    f"{sum(len(c.token_ids) for c in chunks)} tokens")

        return logits, describe

    def mtp_forward(self, chunks: list[SequenceChunk], hidden: torch.Tensor,
                    input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The MTP block's streams for `chunks` (rows of the real tokens first). `hidden`: the
        per-token input streams (at least the real tokens' rows); `input_ids`: device token ids
        that replace the chunks' ids (drafts fed back); `positions`: device positions that replace
        those of one-token chunks. By graph replay when one holds the step (drafter_steps.py)."""
        return drafter_steps.mtp_forward(self, chunks, hidden, input_ids, positions)

    def mtp_catch_up(self, chunks: list[SequenceChunk], hidden: torch.Tensor,
                     input_ids: torch.Tensor | None = None) -> None:
        """The MTP layer's state-only catch-up over `chunks` (`MTPModule.forward_state`: its state
        written as `mtp_forward` would, nothing else computed), arguments as `mtp_forward`'s."""
        drafter_steps.mtp_catch_up(self, chunks, hidden, input_ids)

    def sampling_tensors(self, reqs, counters: list[int] | None = None) -> SamplingTensors:
        """`counters`: the index of the token each request samples (default: from its token counts,
        tokens still pending on the device included). The other parameters are copied once per batch."""
        if counters is None:
            counters = [len(r.output_token_ids) + r.num_pending_tokens for r in reqs]
        return self.sampling_cache.get(reqs, counters, self.device)

    def _process_logits(self, logits: torch.Tensor, reqs, last_rows: dict) -> torch.Tensor:
        """`logits` rows of `reqs` after their logits processing; a pending token (async scheduling)
        counts from the last launched step's device tokens."""
        plan = self.logits_state.plan(reqs, last_rows, logits.shape[1], logits.device)
        pending = self._last_sampled[0] if self._last_sampled is not None else None
        return process_logits(logits, plan, self.eos_token_id, pending)

    def wait(self, describe: Callable[[], str]) -> None:
        """Wait for the step with a deadline before any blocking read: a hung kernel becomes an error."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self.watchdog.wait(done, describe)

    @staticmethod
    def _logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, reqs) -> tuple[torch.Tensor, ...] | None:
        """Raw-model logprobs of `tokens` (rank and top entries), on the device; None if nobody asked."""
        if not any(r.params.logprobs is not None for r in reqs):
            return None
        return token_logprobs(logits, tokens, max(r.params.logprobs or 0 for r in reqs))

    @staticmethod
    def _records(reqs, tokens: list[int], logprobs: list[list] | None) -> list[SampledToken]:
        """Host records of sampled tokens, with their logprobs for the requests that asked."""
        if logprobs is None:
            return [SampledToken(token) for token in tokens]
        result = []
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            st = SampledToken(token)
            if req.params.logprobs is not None:
                chosen, rank, top_ids, top_lp = logprobs
                k = req.params.logprobs
                st.logprob, st.rank = chosen[i], rank[i]
                st.top = list(zip(top_ids[i][:k], top_lp[i][:k]))
            result.append(st)
        return result

    def sampled_tokens(self, logits: torch.Tensor, tokens: torch.Tensor, reqs) -> list[SampledToken]:
        """Host records (with raw-model logprobs when asked) of `tokens` drawn from `logits` rows; waits."""
        lp = self._logprob_tensors(logits, tokens, reqs)
        return self._records(reqs, tokens.tolist(), [t.tolist() for t in lp] if lp is not None else None)

    def _queue_prompt_logprobs(self, req, logits: torch.Tensor, start: int, step: LaunchedStep) -> None:
        prompt = req.prompt_token_ids
        # Row j predicts position start + j + 1; keep the ones inside the prompt.
        count = min(logits.shape[0], len(prompt) - 1 - start)
        if count <= 0:
            return
        targets = to_device(prompt[start + 1:start + 1 + count], logits.device)
        lp = token_logprobs(logits[:count], targets, req.params.prompt_logprobs)
        step.prompt_logprobs.append((req, start, tuple(to_host(t) for t in lp)))
