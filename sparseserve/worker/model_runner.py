"""Runs the model for a scheduled step: metadata -> forward -> logits -> samples.

Owns the model, its state (the KV cache tensors) and the device. Knows nothing of the
scheduler's policies; it receives chunks and returns what was sampled.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..engine.kv_cache import KVPlan
from ..engine.scheduler import SchedulerOutput
from ..model.batch import BatchMetadata, SequenceChunk, build_batch
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.state import ModelState, StateLayout
from .sampler import SamplingTensors, sample, token_logprobs

logger = logging.getLogger("sparseserve")


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # request_id -> token
    # request_id -> [(position of the predicted prompt token, logprob, rank, top)]
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.state: ModelState | None = None
        self.max_blocks_per_seq = -(-max_model_len // block_size)

    # ---- memory ----
    def _layout(self, num_blocks: int) -> StateLayout:
        return StateLayout(num_blocks=num_blocks, block_size=self.block_size, num_slots=self.max_num_seqs,
                           max_step_tokens=self.max_num_batched_tokens,
                           sliding_window=self.model_config.hf_config.sliding_window)

    @torch.no_grad()
    def profile_peak_activation_bytes(self) -> int:
        """Peak memory of a worst-case step (a full token budget) above what is allocated now."""
        if self.device.type != "cuda":
            return 0
        length = min(self.max_num_batched_tokens, self.max_model_len)
        blocks = -(-length // self.block_size)
        state = ModelState(self.model_config, self._layout(blocks), self.device, self.dtype)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        chunk = SequenceChunk(slot=0, start_pos=0, token_ids=[1] * length, block_ids=list(range(blocks)))
        batch = build_batch([chunk], self.model_config.rates, self.device)
        streams = self.model(batch, state)
        rows = min(self.max_num_seqs, length)
        logits = self.model.compute_logits(streams[-rows:])
        torch.log_softmax(logits, dim=-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del state, streams, logits
        torch.cuda.empty_cache()
        return int(peak)

    def allocate_state(self, num_blocks: int) -> None:
        self.state = ModelState(self.model_config, self._layout(num_blocks), self.device, self.dtype)

    # ---- execution ----
    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        if not sched.chunks:
            return out
        chunks: list[SequenceChunk] = []
        prompt_lp_rows: list[tuple[int, int, int]] = []  # (request index, first position, count)
        for i, sc in enumerate(sched.chunks):
            req = sc.request
            start = req.num_computed_tokens
            want_prompt = (req.params.prompt_logprobs is not None and req.num_preemptions == 0
                           and start < len(req.prompt_token_ids) - 1)
            want = "all" if want_prompt else ("last" if sc.completes else "none")
            chunks.append(SequenceChunk(slot=req.slot, start_pos=start,
                                        token_ids=req.all_token_ids[start:start + sc.num_tokens],
                                        block_ids=req.block_ids, want_logits=want))
        batch = build_batch(chunks, self.model_config.rates, self.device, max_blocks=self.max_blocks_per_seq)
        streams = self.model(batch, self.state)
        logits = self.model.compute_logits(streams[batch.logits_indices])
        # Map each chunk to its rows of `logits`.
        row = 0
        sample_rows: list[int] = []
        sample_reqs = []
        for sc, chunk in zip(sched.chunks, chunks):
            n = {"all": len(chunk.token_ids), "last": 1, "none": 0}[chunk.want_logits]
            if chunk.want_logits == "all":
                prompt_lp_rows.append((row, chunk.start_pos, n))
                self._prompt_logprobs(sc.request, logits[row:row + n], chunk.start_pos, out)
            if sc.completes:
                sample_rows.append(row + n - 1)
                sample_reqs.append(sc.request)
            row += n
        if sample_reqs:
            self._sample(logits[torch.tensor(sample_rows, device=logits.device)], sample_reqs, out)
        return out

    def _sampling_tensors(self, reqs) -> SamplingTensors:
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        params = [r.params for r in reqs]
        return SamplingTensors(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t([r.sample_seed for r in reqs], torch.int64),
            counters=t([len(r.output_token_ids) for r in reqs], torch.int64),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            all_greedy=all(p.greedy for p in params),
        )

    def _sample(self, logits: torch.Tensor, reqs, out: RunnerOutput) -> None:
        tokens = sample(logits, self._sampling_tensors(reqs))
        num_top = max((r.params.logprobs or 0) for r in reqs)
        want_lp = any(r.params.logprobs is not None for r in reqs)
        if want_lp:
            chosen, rank, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
            chosen, rank, top_ids, top_lp = chosen.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist()
        token_list = tokens.tolist()
        for i, req in enumerate(reqs):
            st = SampledToken(token_list[i])
            if want_lp and req.params.logprobs is not None:
                k = req.params.logprobs
                st.logprob, st.rank = chosen[i], rank[i]
                st.top = list(zip(top_ids[i][:k], top_lp[i][:k]))
            out.sampled[req.request_id] = st

    def _prompt_logprobs(self, req, logits: torch.Tensor, start: int, out: RunnerOutput) -> None:
        prompt = req.prompt_token_ids
        # Row j predicts position start + j + 1; keep the ones inside the prompt.
        count = min(logits.shape[0], len(prompt) - 1 - start)
        if count <= 0:
            return
        targets = torch.tensor(prompt[start + 1:start + 1 + count], device=logits.device)
        k = req.params.prompt_logprobs
        chosen, rank, top_ids, top_lp = token_logprobs(logits[:count], targets, k)
        rows = out.prompt_logprobs.setdefault(req.request_id, [])
        for j, (lp, rk, ids, lps) in enumerate(zip(chosen.tolist(), rank.tolist(), top_ids.tolist(),
                                                   top_lp.tolist())):
            rows.append((start + 1 + j, lp, rk, list(zip(ids, lps))))
