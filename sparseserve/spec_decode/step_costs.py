"""Step costs for adaptive speculation, measured once at start-up from the captured graphs.

A step that verifies d drafts and proposes d for the next step (what the adaptive policy runs)
is, on the device: the target graph of query length 1 + d, the drafter's catch-up graph of the
same length, its d - 1 single-token draft graphs and d draft heads (the MTP logits and argmax,
eager). A d = 0 step is the plain target graph and the drafter's single-token catch-up: its
state-only graph where one is captured (plain steps propose nothing), else its full one. Each
graph is replayed a few times between CUDA events right after capture (before any request: the
captures' dummy inputs write the dummy slot's rows only), so the table holds device time per
(bucket, d); the host's share of a step is about the same for every d.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .adaptive import StepCosts


def _replay_seconds(replay: Callable[[], None], reps: int) -> float:
    replay()  # warm: the first replay after capture uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


@torch.no_grad()
def measure_graph_costs(target_graphs: Mapping, mtp_graphs: Mapping, draft_head: Callable[[torch.Tensor], object],
                        k: int, reps: int = 3, catch_up_graphs: Mapping | None = None) -> StepCosts | None:
    """`target_graphs` / `mtp_graphs`: the runner's CudaGraphRunner per query length (each with
    `graphs` by key and `hidden`, the drafter's input rows); `draft_head(h)` runs the drafter's
    logits and argmax on rows h; `catch_up_graphs`: the drafter's state-only catch-up runners (a
    d = 0 step's, where they hold its bucket). None when the plain graphs are missing."""
    if 1 not in target_graphs or 1 not in mtp_graphs:
        return None

    def graph_time(runners: Mapping, q: int, batch: int) -> float | None:
        runner = runners.get(q)
        graph = None if runner is None else next((g for key, g in runner.graphs.items()
                                                  if key.batch_size == batch), None)
        return None if graph is None else _replay_seconds(graph.graph.replay, reps)

    buckets = sorted({key.batch_size for key in target_graphs[1].graphs})
    hidden = mtp_graphs[1].hidden
    seconds: dict[tuple[int, int], float] = {}
    torch.cuda.synchronize()
    for b in buckets:
        head = _replay_seconds(lambda: draft_head(hidden[:b]), reps)
        single = graph_time(mtp_graphs, 1, b)
        state_only = graph_time(catch_up_graphs or {}, 1, b)
        for d in range(k + 1):
            target, catch_up = graph_time(target_graphs, 1 + d, b), graph_time(mtp_graphs, 1 + d, b)
            if d == 0 and state_only is not None:
                catch_up = state_only
            if target is None or catch_up is None or single is None:
                continue  # no graph of that shape at this bucket (its tokens exceed a step's budget)
            seconds[(b, d)] = target + catch_up + max(d - 1, 0) * single + d * head
    return StepCosts(buckets, seconds, "measured")
