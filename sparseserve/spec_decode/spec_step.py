"""Speculative decoding as the model runner owns it: verify the drafts that a step fed to the
target, then let the MTP drafter catch up on the step's positions and propose the next drafts.

`MTPSpeculator` is built by the runner (with the MTP layer, its own state and the runner's MTP
forward) and called after each step's sampling; it reads the runner only through `RunnerView`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..model.batch import SequenceChunk
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.host_copy import to_device, to_host
from ..model.mtp import MTPModule
from ..model.state import ModelState
from ..sample.sampler import SamplingTensors, filtered_probs, uniform_noise
from ..step_types import RunnerOutput, SampledToken, SchedulerOutput
from .mtp_proposer import DraftRequest, MTPCatchUp, MTPForward, MTPProposer
from .rejection_sampler import verify

ACCEPT_SALT = 0x68E31DA4
CAUGHT_UP = object()  # a plain step's drafter catch-up was queued at launch (launch_catch_up)


class RunnerView(Protocol):
    """What speculation reads from the runner that owns it."""

    last_streams: torch.Tensor | None  # the last forward's residual streams (every token's rows)

    def sampling_tensors(self, reqs) -> SamplingTensors: ...

    def sampled_tokens(self, logits: torch.Tensor, tokens: torch.Tensor, reqs) -> list[SampledToken]: ...


class MTPSpeculator:
    """The MTP drafter and draft verification of one runner."""

    def __init__(self, mtp: MTPModule, target: DeepseekV4ForCausalLM, state: ModelState, num_tokens: int,
                 forward: MTPForward, catch_up: MTPCatchUp | None = None) -> None:
        self.k = num_tokens
        self.state = state  # the MTP layer's own window state
        self.proposer = MTPProposer(mtp, target, state, num_tokens, forward, catch_up)
        self.draft_probs: dict[str, torch.Tensor] = {}  # request_id -> [k, V] q of its pending drafts

    def measure_costs(self, target_graphs: dict, mtp_graphs: dict, catch_up_graphs: dict | None = None):
        """Adaptive speculation's step costs, timed from the captured graphs (step_costs.py);
        `catch_up_graphs`: the drafter's state-only catch-up graphs (plain steps)."""
        from .step_costs import measure_graph_costs

        mtp, target = self.proposer.mtp, self.proposer.target
        return measure_graph_costs(target_graphs, mtp_graphs,
                                   lambda h: mtp.compute_logits(h, target).argmax(dim=-1), self.k,
                                   catch_up_graphs=catch_up_graphs)

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request's pending drafts (finished, aborted or preempted)."""
        self.draft_probs.pop(request_id, None)

    def launch_step(self, runner: RunnerView, sched: SchedulerOutput, chunks: list[SequenceChunk],
                    logits: torch.Tensor, verify_rows: list[tuple[int, int]]) -> FusedGreedy | None:
        """At launch, right after the target forward: queue a fused greedy step's verify and drafts
        (`fused_greedy_launch`), so they run on the device while the host does other work; None
        when the step is not of that kind (`finish_step` then takes the general path)."""
        if len(verify_rows) != len(chunks):
            return None
        return fused_greedy_launch(self, runner, sched, chunks, logits)

    def launch_catch_up(self, runner: RunnerView, step) -> object | None:
        """A plain step of adaptive speculation (nothing verified, nothing to propose, every sequence
        sampling after one token): queue the MTP layer's state-only catch-up over the step's
        positions with the tokens just sampled, still on the device, so that `finish_step` has
        nothing left to do (no host pass over the requests). Returns CAUGHT_UP, or None, having
        done nothing."""
        chunks = step.chunks
        if (step.sched.num_propose != 0 or step.sampled is None or len(step.sample_reqs) != len(chunks)
                or not isinstance(self.proposer, MTPProposer) or any(len(c.token_ids) != 1 for c in chunks)):
            return None
        # The step's own chunks (slots, positions, blocks): their token ids are replaced by the sampled
        # ones, and the runner recognises them as the step it just ran (its graph's metadata is reused).
        self.proposer.catch_up(chunks, runner.last_streams, step.sampled[0])
        return CAUGHT_UP

    def finish_step(self, runner: RunnerView, sched: SchedulerOutput, chunks: list[SequenceChunk],
                    logits: torch.Tensor, verify_rows: list[tuple[int, int]], out: RunnerOutput,
                    launched: FusedGreedy | None = None) -> None:
        """After a step's sampling: accept drafts, emit tokens and propose the next drafts into `out`.
        `launched`: the step's fused greedy work queued at launch (read back here), or CAUGHT_UP."""
        if launched is CAUGHT_UP:
            return
        if launched is not None:
            fused_greedy_finish(self, launched, out)
            return
        if verify_rows:
            verify_drafts(self, runner, sched, verify_rows, logits, out)
        draft_next(self, runner, sched, chunks, out)


@dataclass
class FusedGreedy:
    """A fused greedy step's device work, queued: per request [accepted, target tokens, next drafts]."""

    reqs: list
    q: int  # 1 + d (the drafts verified)
    host: torch.Tensor  # [B, 1 + q + drafts proposed], copied to host memory (read once the step's event is done)


def fused_greedy_launch(spec: MTPSpeculator, runner: RunnerView, sched: SchedulerOutput,
                        chunks: list[SequenceChunk], logits: torch.Tensor) -> FusedGreedy | None:
    """A step where every request is greedy and verifies the same number d >= 1 of drafts:
    acceptance, the MTP layer's catch-up and the next drafts (`sched.num_propose`, default k) are
    queued on the device from the step's logits, with a copy of the results to host memory, so
    that the host reads everything back once (the general path waits after verifying and again
    after drafting). None, having done nothing, when the step is not of that kind."""
    proposer = spec.proposer
    if not isinstance(proposer, MTPProposer):
        return None
    k = sched.chunks[0].num_draft
    reqs = [sc.request for sc in sched.chunks]
    if k < 1 or any(sc.num_draft != k for sc in sched.chunks) or any(
            not r.params.greedy or r.params.logprobs is not None or r.params.needs_logits_processing for r in reqs):
        return None
    device = logits.device
    batch, q = len(reqs), k + 1
    target = logits[: batch * q].view(batch, q, -1).argmax(dim=-1)  # [B, 1 + d]
    drafts = to_device([r.draft_token_ids[:k] for r in reqs], device).view(batch, k)
    accepted = (drafts == target[:, :k]).long().cumprod(dim=1).sum(dim=1)
    # The token after position start + j: an accepted draft (= the target's argmax) for j < a, the
    # bonus token at j = a, and a placeholder (re-run later) past it: target[min(j, a)] in all cases.
    steps = torch.arange(q, device=device).unsqueeze(0)
    next_tokens = target.gather(1, torch.minimum(steps, accepted.unsqueeze(1)))
    catch_up = [SequenceChunk(c.slot, c.start_pos, [0] * q, c.block_ids, "none") for c in chunks]
    rows = torch.arange(batch, device=device) * q + accepted  # each request's last accepted position
    positions = to_device([c.start_pos for c in chunks], device) + accepted
    new_drafts, _ = proposer.draft(catch_up, runner.last_streams, next_tokens.reshape(-1), rows, chunks,
                                   positions, None, sched.num_propose)
    return FusedGreedy(reqs, q, to_host(torch.cat([accepted.unsqueeze(1), target, new_drafts], dim=1)))


def fused_greedy_finish(spec: MTPSpeculator, launched: FusedGreedy, out: RunnerOutput) -> None:
    """Read a fused greedy step back into `out`: emitted tokens, accepted counts, next drafts."""
    host, q = launched.host.tolist(), launched.q
    for n, req in enumerate(launched.reqs):
        a = host[n][0]
        out.sampled[req.request_id] = [SampledToken(t) for t in host[n][1:a + 2]]
        out.num_accepted[req.request_id] = a
        out.drafts[req.request_id] = host[n][1 + q:]
        spec.forget(req.request_id)


def verify_drafts(spec: MTPSpeculator, runner: RunnerView, sched: SchedulerOutput,
                  verify_rows: list[tuple[int, int]], logits: torch.Tensor, out: RunnerOutput) -> None:
    """Accept a prefix of each request's drafts and draw its next token (lossless)."""
    device = logits.device
    k = max(sched.chunks[i].num_draft for i, _ in verify_rows)
    reqs = [sched.chunks[i].request for i, _ in verify_rows]
    rows = []
    drafts = torch.full((len(reqs), k), -1, dtype=torch.long)
    for n, (i, first) in enumerate(verify_rows):
        nd = sched.chunks[i].num_draft
        # Pad requests with fewer drafts by repeating their last row (their extra drafts are -1).
        rows.append([first + min(j, nd) for j in range(k + 1)])
        drafts[n, :nd] = torch.tensor(reqs[n].draft_token_ids[:nd])
    rows_t = to_device(rows, device)
    host_drafts = drafts
    drafts = to_device(drafts, device)
    processing = any(r.params.needs_logits_processing for r in reqs)
    if processing:
        # Position j of a request sees its outputs and its first j drafts (penalties, bans, the
        # grammar's state), so verification samples from what plain decoding would: a draft the
        # grammar rejects has probability 0 and is rejected.
        target = verify_logits(runner, reqs, logits[rows_t], host_drafts, [sched.chunks[i].num_draft
                                                                           for i, _ in verify_rows])
    if all(r.params.greedy for r in reqs):
        # Greedy: accept while the draft is the target's argmax; every emitted token is an argmax.
        target_greedy = target.argmax(dim=-1) if processing else logits.argmax(dim=-1)[rows_t]  # [B, k+1]
        accepted_t = (drafts == target_greedy[:, :k]).long().cumprod(dim=1).sum(dim=1)
        tokens_t = target_greedy
    else:
        accepted_t, tokens_t = _rejection_sample(spec, runner, reqs, target if processing else logits[rows_t], drafts,
                                                 k)
    host = torch.cat([accepted_t.unsqueeze(1), tokens_t], dim=1).tolist()  # the step's one sync
    want_lp = any(r.params.logprobs is not None for r in reqs)
    for n, req in enumerate(reqs):
        a = host[n][0]
        emitted = host[n][1:a + 2]
        if want_lp:
            records = runner.sampled_tokens(logits[rows_t[n, :a + 1]],
                                            to_device(emitted, device), [req] * (a + 1))
        else:
            records = [SampledToken(t) for t in emitted]
        out.sampled[req.request_id] = records
        out.num_accepted[req.request_id] = a
        spec.forget(req.request_id)


def verify_logits(runner, reqs, target_logits: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: list[int]) -> torch.Tensor:
    """The verify rows [B, k + 1, V] after logits processing, row j with the drafts before it counted."""
    from ..sample.logits_processors import LogitsRow, process_logits

    batch, q, vocab = target_logits.shape
    rows = []
    for n, req in enumerate(reqs):
        own = drafts[n, :num_drafts[n]].tolist()
        for j in range(q):
            prefix = own[:min(j, len(own))]
            rows.append(LogitsRow(req.params, req.prompt_token_ids, req.output_token_ids + prefix, None,
                                  req.grammar, prefix))
    return process_logits(target_logits.reshape(-1, vocab), rows, runner.eos_token_id).view(batch, q, vocab)


def _rejection_sample(spec: MTPSpeculator, runner: RunnerView, reqs, target_logits: torch.Tensor, drafts: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled (or mixed) requests: rejection sampling against each request's draft distribution."""
    device = target_logits.device
    vocab = target_logits.shape[-1]
    st = runner.sampling_tensors(reqs)
    flat_st = _repeat_rows(st, k + 1)
    target_probs = filtered_probs(target_logits.view(-1, vocab), flat_st).view(len(reqs), k + 1, vocab)
    draft_probs = torch.stack([_draft_q(spec, r, k, vocab, device) for r in reqs])
    counters = st.counters.unsqueeze(1) + torch.arange(k + 1, device=device).unsqueeze(0)
    accept_u = uniform_noise((st.seeds ^ ACCEPT_SALT).repeat_interleave(k), counters[:, :k].reshape(-1), 1)
    accept_u = accept_u.view(len(reqs), k)
    next_noise = -torch.log(uniform_noise(st.seeds.repeat_interleave(k + 1), counters.reshape(-1), vocab))
    result = verify(target_probs, target_logits.argmax(-1), drafts, draft_probs, st.temperature == 0, accept_u,
                    next_noise.view(len(reqs), k + 1, vocab))
    return result.num_accepted, result.tokens


def _repeat_rows(st: SamplingTensors, times: int) -> SamplingTensors:
    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(times)

    counters = st.counters.unsqueeze(1) + torch.arange(times, device=st.counters.device).unsqueeze(0)
    return replace(st, temperature=rep(st.temperature), top_k=rep(st.top_k), top_p=rep(st.top_p),
                   min_p=rep(st.min_p), seeds=rep(st.seeds), counters=counters.reshape(-1))


def _draft_q(spec: MTPSpeculator, req, k: int, vocab: int, device) -> torch.Tensor:
    q = spec.draft_probs.get(req.request_id)
    if q is None:  # greedy drafts: q is one-hot on each draft
        q = torch.zeros(k, vocab, device=device)
        for j, d in enumerate(req.draft_token_ids[:k]):
            q[j, d] = 1.0
    if q.shape[0] < k:
        q = torch.cat([q, torch.full((k - q.shape[0], vocab), 1.0 / vocab, device=device)])
    return q[:k]


def draft_next(spec: MTPSpeculator, runner: RunnerView, sched: SchedulerOutput, chunks: list[SequenceChunk],
               out: RunnerOutput) -> None:
    """Run the MTP layer over the step's positions and propose drafts from the last accepted one."""
    streams = runner.last_streams
    requests = []
    for sc, chunk in zip(sched.chunks, chunks):
        req = sc.request
        emitted = [t.token_id for t in out.sampled.get(req.request_id, [])]
        # The token after each chunk position in the sequence after this step (prompt + outputs +
        # emitted), its last token past the end; sliced without copying the whole sequence, since
        # plain (d = 0) steps of adaptive speculation take this path at every batch size.
        before = len(req.prompt_token_ids) + len(req.output_token_ids)
        total, start, n = before + len(emitted), chunk.start_pos, len(chunk.token_ids)
        lo, hi = start + 1, min(start + n + 1, total)
        next_tokens = req.token_ids_between(lo, min(hi, before)) if lo < before else []
        next_tokens += emitted[max(lo - before, 0):max(hi - before, 0)]
        last = emitted[-1] if emitted else (req.output_token_ids or req.prompt_token_ids)[-1]
        next_tokens += [last] * (n - len(next_tokens))
        draft_from = (total - 2 - start) if emitted else None
        requests.append(DraftRequest(req.request_id, chunk, next_tokens, draft_from))
    num = sched.num_propose
    drafting_reqs = ([sc.request for sc, r in zip(sched.chunks, requests) if r.draft_from is not None]
                     if num != 0 else [])
    greedy = all(r.params.greedy for r in drafting_reqs)
    st = runner.sampling_tensors(drafting_reqs) if drafting_reqs and not greedy else None
    if st is not None:
        # Drafts are the tokens after the ones just emitted.
        st.counters = st.counters + to_device([len(out.sampled[r.request_id]) for r in drafting_reqs],
                                              st.counters.device)
    # `num` only when set: a drafter without a draft count (the tests' known drafters) proposes k.
    args = (requests, streams, st) if num is None else (requests, streams, st, num)
    drafts, probs, drafting = spec.proposer.propose(*args)
    draft_list = drafts.tolist() if drafting else []  # a catch-up alone is not waited for
    for n, i in enumerate(drafting):
        req = sched.chunks[i].request
        out.drafts[req.request_id] = draft_list[n]
        if probs is not None:
            spec.draft_probs[req.request_id] = probs[n]
