"""Replay half of the graph audit: every captured graph, replayed on random realistic
decode (and speculative verify) batches, must give the eager step's logits (the drafter's
graphs: its streams; its state-only catch-up graphs: the state they write). It lives with
the engine because it takes its batches' blocks and slots from the engine's cache manager.

Lengths are spread over [2, max_model_len] and include the places where behaviour could
switch: compress-window boundaries and the top-k reach (index_topk * rate). Because state
writes are position-addressed, running the same decode step eagerly and then by replay
writes the same rows twice, so the comparison is fair.
"""
from __future__ import annotations

import logging
import random

import torch

from ..model.batch import SequenceChunk
from ..sampling_params import SamplingParams
from ..worker.cuda_graph import GraphCaptureError, logits_mode
from .kv_cache import KVCacheManager
from .request import Request

logger = logging.getLogger("sparseserve")


def interesting_lengths(max_model_len: int, rates: list[int], topk_reach: int) -> list[int]:
    points = {2, 3, max_model_len}
    for rate in rates:
        for mult in (1, 2, 5):
            points.update({rate * mult - 1, rate * mult, rate * mult + 1})
    if topk_reach:
        points.update({topk_reach - 1, topk_reach, topk_reach + 1, 2 * topk_reach + 3})
    return sorted(p for p in points if 2 <= p <= max_model_len)


@torch.no_grad()
def audit_graph_replays(runner, kv: KVCacheManager, seed: int = 0, batches_per_graph: int = 2) -> None:
    """Replay every target graph (plain decode, and verify steps of 1 + k tokens when speculation
    is on) on random batches and compare with the same step run eagerly."""
    rng = random.Random(seed)
    mc = runner.model_config
    csa = [mc.compress_rate(i) for i in range(mc.num_layers) if mc.is_csa(i)]
    reach = mc.hf_config.index_topk * min(csa) if csa else 0
    vocab = mc.hf_config.vocab_size
    failures = []
    for q, graphs in sorted(runner.graphs.items()):
        special = interesting_lengths(runner.max_model_len, mc.rates, reach)
        for size in graphs.sizes:
            for trial in range(batches_per_graph):
                budget_tokens = kv.num_free_blocks * kv.block_size // max(size, 1)
                cap = max(q + 1, min(runner.max_model_len, budget_tokens))
                lengths = [max(q + 1, min(rng.choice(special) if rng.random() < 0.5
                                          else rng.randint(2, runner.max_model_len), cap)) for _ in range(size)]
                failure = _compare_one(runner, graphs, kv, lengths, q, vocab, rng, f"{q}-{size}-{trial}")
                if failure:
                    failures.append(failure)
            logger.info("audit: graph batch=%d, query_len=%d replays match eager on %d random batches", size, q,
                        batches_per_graph)
    if failures:
        raise GraphCaptureError("CUDA graph replay differs from the eager step:\n" + "\n".join(failures))


def _compare_one(runner, graphs, kv: KVCacheManager, lengths: list[int], q: int, vocab: int, rng: random.Random,
                 tag: str) -> str | None:
    reqs = []
    for i, length in enumerate(lengths):
        req = Request(f"audit-{tag}-{i}", None, [rng.randrange(vocab) for _ in range(length)], SamplingParams(), 0, 0)
        kv.allocate(req, length)
        reqs.append(req)
    try:
        # Prefill all but the last q tokens, then run those as one decode (or verify) step.
        for req in reqs:
            toks = req.prompt_token_ids
            for start in range(0, len(toks) - q, runner.max_num_batched_tokens):
                piece = toks[start:min(start + runner.max_num_batched_tokens, len(toks) - q)]
                runner.forward([SequenceChunk(req.slot, start, piece, req.block_ids, "none")])
        step = [SequenceChunk(r.slot, len(r.prompt_token_ids) - q, r.prompt_token_ids[-q:], r.block_ids,
                              logits_mode(q)) for r in reqs]
        with runner.eager_only():
            eager = runner.forward(step)[0].clone()
            streams = runner.last_streams.clone() if runner.last_streams is not None else None
        replay = graphs.run(step)
        logits, graph = replay[0][0][: eager.shape[0]], replay[1]
        diff = float((logits - eager).abs().max())
        scale = float(eager.abs().max())
        same_argmax = bool(torch.equal(logits.argmax(-1), eager.argmax(-1)))
        if not same_argmax or diff > 1e-3 * max(scale, 1.0):
            return (f"graph {graph.key} (topk_path={graph.topk_path}) replayed on lengths {lengths}: "
                    f"max |logit diff| {diff:.3g} (scale {scale:.3g}), same argmax: {same_argmax}")
        if q in runner.mtp_graphs and streams is not None:
            # The drafter's graph of the same shape, fed the same target streams.
            with runner.eager_only():
                want = runner.mtp_forward(step, streams)[: len(step) * q].float().clone()
            got = runner.mtp_forward(step, streams)[: len(step) * q].float()
            diff = float((got - want).abs().max())
            scale = float(want.abs().max())
            if diff > 1e-3 * max(scale, 1.0):
                return (f"mtp graph batch={graph.key.batch_size}, query_len={q} replayed on lengths {lengths}: "
                        f"max |stream diff| {diff:.3g} (scale {scale:.3g})")
        if q in runner.mtp_state_graphs and streams is not None:
            problem = _compare_catch_up(runner, step, streams)
            if problem:
                return f"mtp_state graph batch={graph.key.batch_size}, query_len={q} on lengths {lengths}: {problem}"
        return None
    finally:
        for req in reqs:
            kv.free(req)


def _compare_catch_up(runner, step: list[SequenceChunk], streams: torch.Tensor) -> str | None:
    """The drafter's state-only catch-up by replay against the eager one: the KV pool each leaves
    (both write the same position-addressed rows)."""
    pool = runner.speculator.state.layers[0].kv_pool
    with runner.eager_only():
        runner.mtp_catch_up(step, streams)
    want = pool.clone()
    runner.mtp_catch_up(step, streams)
    if pool.dtype == torch.uint8:  # packed FP8 rows: bytes
        return None if torch.equal(pool, want) else "the KV rows it writes differ from the eager catch-up's"
    diff, scale = float((pool.float() - want.float()).abs().max()), float(want.float().abs().max())
    if diff > 1e-3 * max(scale, 1.0):
        return f"max |KV row diff| {diff:.3g} (scale {scale:.3g}) against the eager catch-up"
    return None
