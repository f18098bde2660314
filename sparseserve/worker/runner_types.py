"""What the model runner hands between its halves and takes as options: a launched step, the options."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.batch import SequenceChunk
from ..step_types import SchedulerOutput


def is_run(values: list[int]) -> bool:
    """True when `values` are consecutive integers (a slice can stand for an index list)."""
    return values == list(range(values[0], values[0] + len(values)))


def logits_rows(chunk: SequenceChunk) -> int:
    """Rows of logits a chunk yields: every token's, its last token's, or none."""
    return len(chunk.token_ids) if chunk.want_logits == "all" else int(chunk.want_logits == "last")


@dataclass
class LaunchedStep:
    """A step whose device work is queued; `ModelRunner.collect` reads its results back."""

    sched: SchedulerOutput
    chunks: list[SequenceChunk]
    logits: torch.Tensor  # read again only by speculation, which collects right after launching
    describe: Callable[[], str]
    verify: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, first logits row)
    sample_reqs: list = field(default_factory=list)
    sampled: tuple[torch.Tensor, dict] | None = None  # device tokens, and each sampling request's row
    host_tokens: torch.Tensor | None = None  # the sampled tokens, copied to pinned host memory
    host_logprobs: tuple[torch.Tensor, ...] | None = None
    prompt_logprobs: list = field(default_factory=list)  # (request, start, host tensors)
    done: torch.cuda.Event | None = None  # recorded after the copies
    pending_sampling: tuple | None = None  # (rows, last_rows, all_greedy, any_logprobs, any_processing) until sampled
    spec_launched: object | None = None  # queued at launch: spec_step.FusedGreedy, or CAUGHT_UP (a plain step)


@dataclass
class RunnerOptions:
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    topk_backend: str = "auto"
    step_timeout_s: float = 60.0
    num_speculative_tokens: int = 0
    adaptive_speculation: bool = False  # graphs for every 1 + d, d <= k, and their step costs timed
    side_stream: str = "auto"  # one of SIDE_STREAM_MODES (EngineConfig.side_stream)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype (model/state.py)
    # Piecewise prefill graphs (worker/prefill_graphs.py): on unless EngineConfig.cudagraph_mode is
    # "full_decode_only"; their token-count buckets (None: the default list).
    prefill_graphs: bool = True
    prefill_graph_sizes: list[int] | None = None
