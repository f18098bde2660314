"""Replay half of the graph audit: every captured graph, replayed on random realistic
decode batches, must give the eager step's logits.

Lengths are spread over [2, max_model_len] and include the places where behaviour could
switch: compress-window boundaries and the top-k reach (index_topk * rate). Because state
writes are position-addressed, running the same decode step eagerly and then by replay
writes the same rows twice, so the comparison is fair.
"""
from __future__ import annotations

import logging
import random

import torch

from ..engine.kv_cache import KVCacheManager
from ..engine.request import Request
from ..model.batch import SequenceChunk
from ..sampling_params import SamplingParams
from .cuda_graph import GraphCaptureError

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
    if runner.graphs is None:
        return
    rng = random.Random(seed)
    mc = runner.model_config
    csa = [mc.compress_rate(i) for i in range(mc.num_layers) if mc.is_csa(i)]
    reach = mc.hf_config.index_topk * min(csa) if csa else 0
    special = interesting_lengths(runner.max_model_len, mc.rates, reach)
    vocab = mc.hf_config.vocab_size
    failures = []
    for size in runner.graphs.sizes:
        for trial in range(batches_per_graph):
            budget_tokens = kv.num_free_blocks * kv.block_size // max(size, 1)
            cap = max(2, min(runner.max_model_len, budget_tokens))
            lengths = [min(rng.choice(special) if rng.random() < 0.5 else rng.randint(2, runner.max_model_len), cap)
                       for _ in range(size)]
            reqs = []
            for i, length in enumerate(lengths):
                req = Request(f"audit-{size}-{trial}-{i}", None, [rng.randrange(vocab) for _ in range(length)],
                              SamplingParams(), 0, 0)
                kv.allocate(req, length)
                reqs.append(req)
            try:
                # Prefill all but the last token, then run the last one as a decode step.
                for req in reqs:
                    toks = req.prompt_token_ids
                    for start in range(0, len(toks) - 1, runner.max_num_batched_tokens):
                        piece = toks[start:min(start + runner.max_num_batched_tokens, len(toks) - 1)]
                        runner.forward([SequenceChunk(req.slot, start, piece, req.block_ids, "none")])
                decode = [SequenceChunk(r.slot, len(r.prompt_token_ids) - 1, r.prompt_token_ids[-1:], r.block_ids,
                                        "last") for r in reqs]
                graphs, runner.graphs = runner.graphs, None
                try:
                    eager = runner.forward(decode)[0].clone()
                finally:
                    runner.graphs = graphs
                replay, graph = runner.graphs.run(decode)
                diff = float((replay - eager).abs().max())
                scale = float(eager.abs().max())
                same_argmax = bool(torch.equal(replay.argmax(-1), eager.argmax(-1)))
                if not same_argmax or diff > 1e-3 * max(scale, 1.0):
                    failures.append(f"graph {graph.key} (topk_path={graph.topk_path}) replayed on lengths {lengths}: "
                                    f"max |logit diff| {diff:.3g} (scale {scale:.3g}), same argmax: {same_argmax}")
            finally:
                for req in reqs:
                    kv.free(req)
        logger.info("audit: graph batch=%d replays match eager on %d random batches", size, batches_per_graph)
    if failures:
        raise GraphCaptureError("CUDA graph replay differs from the eager step:\n" + "\n".join(failures))
