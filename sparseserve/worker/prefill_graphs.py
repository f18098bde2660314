"""Piecewise CUDA graphs for prefill-sized steps, one set per token-count bucket.

A prefill or mixed step of T tokens is padded to the smallest bucket >= T and run as the model's pieces
and cores (model/pieces.py): each piece (everything between two attention cores: output projection,
mHC, MoE with its router and shared expert, the next layer's mHC and projections) is a CUDA graph
captured for the bucket; the cores (compressor emissions, indexer and top-k, sparse attention, ring
commits) run eagerly between the replays, over the real tokens only, from the step's metadata built as
for an eager step. A step then costs the host its metadata, one launch sequence per core and one replay
per piece, instead of every launch of the forward.

What makes the pieces capture-safe: they see only the bucket's token count (shapes, launch
configurations) and device tensors of fixed address (`PaddedInputs`: the token ids, positions and
real-token count; the attention-output buffer the cores write; the outputs of the previous piece); no
piece reads a host fact of the real batch, which the capture audit checks (below). The MoE is the
static-launch path the decode graphs use (kernels/moe.py); padding tokens route to no expert, stage
their rows to the trash rows and never reach a core.

Memory: all pieces of all buckets share the decode graphs' pool. The buckets are captured largest
first, in one forward each (`model.forward_padded` with the capture below), so a piece's outputs live
exactly as long as the eager forward keeps them: the pool holds about one forward's activations at the
largest bucket, not one per piece or per bucket. A piece keeps only non-owning views of its outputs
(`weak_ref`): they alias pool memory that a later piece of the same forward may reuse, which is safe
because replays run in the captured order, one step at a time, on one stream.

The capture audit (`cudagraph_audit`, on by default) captures the smallest and the largest bucket
(every bucket with `cudagraph_audit_replay`) a second time around another real batch (one token at
position 0, then a bucket's worth at `max_model_len`; recorded only) and compares each piece's nodes
(`graph_signature.py`): a difference is a host fact of the batch frozen into a piece.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels.jit_builds import TritonBuilds
from ..logger import progress_bar
from ..model.batch import BatchMetadata, SequenceChunk, build_batch
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.pieces import EagerPieces, LayerCarry, PaddedInputs
from ..model.state import ModelState
from ..model.step_context import TopKFn
from .cuda_graph import pick_bucket
from .graph_signature import GraphWalkError, graph_nodes, node_difference

logger = logging.getLogger("sparseserve")

# Above this a step's GPU time (a 43-layer V4-Flash step of 2,048 tokens: ~120 ms on the H200) is near
# or above the host time of the eager forward (~150 ms of launches at any size), so graphs would save
# little and padding would add GPU work: larger steps run eagerly unless the option asks for buckets.
DEFAULT_MAX_TOKENS = 2048


def default_prefill_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """The default token-count buckets: 16, 32, 64, 128, 256 (small steps are weight-bound, so padding
    them costs little), multiples of 128 to 1,024 and of 256 to 2,048 (padding adds at most half a
    step at 257 tokens, at most a quarter above 1,024), capped at `max_num_batched_tokens` (which is a
    bucket itself when below 2,048)."""
    limit = min(max_num_batched_tokens, DEFAULT_MAX_TOKENS)
    sizes = [16, 32, 64, 128, 256] + list(range(384, 1025, 128)) + list(range(1280, DEFAULT_MAX_TOKENS + 1, 256))
    sizes = [s for s in sizes if s <= limit]
    if limit not in sizes:
        sizes.append(limit)
    return sorted(sizes)


def prefill_graph_sizes(sizes: list[int] | None, max_num_batched_tokens: int) -> list[int]:
    """The buckets of `prefill_cuda_graph_sizes` (None: the default list), checked against the step
    budget; ConfigError names the bad value."""
    if sizes is None:
        return default_prefill_graph_sizes(max_num_batched_tokens)
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= max_num_batched_tokens]
    if bad or not sizes:
        raise ConfigError(f"prefill_cuda_graph_sizes must be a non-empty list of token counts in [1, "
                          f"max_num_batched_tokens={max_num_batched_tokens}]; got {sizes!r}"
                          + (f" (bad: {bad})" if bad else "") + "; lower them or raise max_num_batched_tokens")
    return sorted(set(sizes))


# ---------------------------------------------------------------- non-owning views of pool tensors

def weak_ref(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing t's memory without keeping it allocated (as vLLM's weak_ref_tensors): once t is
    freed, its memory may be reused and this view reads whatever is written there."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


def map_tensors(fn: Callable[[torch.Tensor], object], value):
    """`value` with every tensor inside its tuples, named tuples, lists, dicts and dataclasses mapped."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: map_tensors(fn, getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def tensor_addresses(value) -> list[int]:
    found: list[int] = []
    map_tensors(lambda t: found.append(t.data_ptr()), value)
    return found


@dataclass
class PieceGraph:
    graph: torch.cuda.CUDAGraph
    outputs: object  # the piece's outputs as non-owning views (same addresses at every replay)
    input_addresses: list[int]


class _CapturePieces:
    """Captures each piece of one padded forward into its graph (cores run eagerly in between)."""

    def __init__(self, owner: "PrefillGraphs", bucket: int, keep_graph: bool, instantiate: bool) -> None:
        self.owner, self.bucket = owner, bucket
        self.keep_graph, self.instantiate = keep_graph, instantiate
        self.graphs: list[PieceGraph] = []

    def run(self, index: int, fn, *args):
        owner = self.owner
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=owner.pool, stream=owner.stream):
            side = owner.model.side_streams.for_step(owner.device, self.bucket)
            value = fn(side, *args)
            side.join()  # no piece ends with a fork open
        if self.keep_graph and self.instantiate and hasattr(graph, "instantiate"):
            graph.instantiate()
        self.graphs.append(PieceGraph(graph, map_tensors(weak_ref, value), tensor_addresses(args)))
        return value  # owning: the forward drops it when an eager forward would


class _ReplayPieces:
    def __init__(self, graphs: list[PieceGraph], check: bool) -> None:
        self.graphs, self.check = graphs, check

    def run(self, index: int, fn, *args):
        piece = self.graphs[index]
        if self.check and tensor_addresses(args) != piece.input_addresses:
            raise RuntimeError(f"prefill graph piece {index}: its inputs are not at the captured addresses (a core "
                               "returned a new tensor to a piece?); this is an engine bug")
        piece.graph.replay()
        return piece.outputs


class PrefillGraphs:
    """The prefill graphs of one model and state: the buckets' pieces and the static buffers they share.
    Without captured graphs (`enforce_eager`, CPU tests) `run` runs the same padded forward eagerly."""

    def __init__(self, model: DeepseekV4ForCausalLM, state: ModelState, sizes: list[int], dummy_slot: int,
                 max_model_len: int, dtype: torch.dtype, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.state = model, state
        self.sizes = sorted(sizes)
        self.dummy_slot, self.max_model_len = dummy_slot, max_model_len
        self.device = state.layers[0].kv_pool.device
        self.pool, self.stream = pool, stream
        attn = model.model.layers[0].self_attn
        self.buffers = PaddedInputs.allocate(self.sizes[-1], attn.num_heads, attn.head_dim, dtype, self.device)
        self.graphs: dict[int, list[PieceGraph]] = {}
        self._checked: set[int] = set()  # buckets whose first replay checked its pieces' input addresses
        self.use_graphs = True  # False: run eagerly even when captured (the replay audit's eager side)
        self.capture_s = self.audit_s = 0.0

    def bucket_for(self, num_tokens: int) -> int | None:
        return pick_bucket(self.sizes, num_tokens)

    @property
    def num_pieces(self) -> int:
        return len(self.model.model.layers) + 1

    def run(self, batch: BatchMetadata, topk: TopKFn | None) -> tuple[LayerCarry, str]:
        """The step padded to its bucket: replayed pieces when captured, else eager ones. Returns the last
        piece's carry (streams and the LM head's input over the bucket, real rows first) and a description."""
        bucket = self.bucket_for(batch.num_tokens)
        inputs = self.buffers.narrow(bucket)
        graphs = self.graphs.get(bucket) if self.use_graphs else None
        if graphs is None:
            pieces = EagerPieces(self.model.side_streams, self.device, bucket)
            return self.model.forward_padded(batch, self.state, inputs, pieces, topk), f"eager padded prefill, bucket {bucket}"
        check = bucket not in self._checked
        self._checked.add(bucket)
        carry = self.model.forward_padded(batch, self.state, inputs, _ReplayPieces(graphs, check), topk)
        return carry, f"prefill graph, bucket {bucket} ({len(graphs)} pieces)"

    # ---- capture ----
    def _dummy_batch(self, num_tokens: int, end: int) -> BatchMetadata:
        """`num_tokens` real tokens in the dummy slot, ending at `end`, with no blocks: the cores' writes
        land in rows no request uses (chunks of at most max_model_len positions)."""
        chunks, left = [], num_tokens
        while left:
            n = min(left, end)
            chunks.append(SequenceChunk(self.dummy_slot, end - n, [0] * n, [], "last"))
            left -= n
        return build_batch(chunks, self.model.model_config.rates, self.device)

    def _capture(self, bucket: int, batch: BatchMetadata, topk: TopKFn | None, keep_graph: bool = False,
                 instantiate: bool = True) -> list[PieceGraph]:
        pieces = _CapturePieces(self, bucket, keep_graph, instantiate)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):  # the cores run eagerly between the captures, on the same stream
            self.model.forward_padded(batch, self.state, self.buffers.narrow(bucket), pieces, topk)
        torch.cuda.current_stream().wait_stream(self.stream)
        return pieces.graphs

    @torch.no_grad()
    def capture_all(self, topk: TopKFn | None, audit: str = "off") -> list[str]:
        """Capture every bucket, largest first. `audit` ("off", "sample": the smallest and the largest
        bucket, "all"): compare those buckets' pieces with a second capture around another real batch;
        returns the differences found (`capture_s`, `audit_s`: the times)."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        audited = set(self.sizes if audit == "all" else (self.sizes[0], self.sizes[-1])) if audit != "off" else set()
        problems: list[str] = []
        self.audit_s = 0.0
        # The pieces' kernels were built by the kernel warm-up (its token sweep holds every bucket); one
        # eager step on the capture stream makes what a capture must not (cuBLAS's workspace for it).
        torch.cuda.empty_cache()  # the warm-up's cached blocks: the pool allocates from the driver
        with torch.cuda.stream(self.stream):
            self.model.forward_padded(self._dummy_batch(2, 2), self.state, self.buffers.narrow(self.sizes[0]),
                                      EagerPieces(self.model.side_streams, self.device, self.sizes[0]), topk)
        torch.cuda.current_stream().wait_stream(self.stream)
        # Two real tokens (a one-token step is a decode graph's: the kernel warm-up plans none).
        one = self._dummy_batch(min(2, self.sizes[0]), 2)
        with TritonBuilds() as builds:
            for bucket in progress_bar(sorted(self.sizes, reverse=True), desc="Capturing prefill CUDA graphs",
                                       unit="bucket"):
                self.graphs[bucket] = self._capture(bucket, one, topk, keep_graph=bucket in audited)
                if bucket in audited:
                    audit_start = time.perf_counter()
                    problems += self._audit(bucket, topk)
                    self.audit_s += time.perf_counter() - audit_start
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start - self.audit_s
        logger.info("Captured prefill CUDA graphs: %d buckets of %d pieces (token counts %s) in %.1f s (%d kernels "
                    "built), %.2f GiB%s", len(self.graphs), self.num_pieces, self.sizes, self.capture_s, builds.count,
                    (torch.cuda.memory_reserved(self.device) - before) / 1024**3,
                    f"; capture audit of buckets {sorted(audited)}: {self.audit_s:.2f} s" if audited else "")
        return problems

    def _audit(self, bucket: int, topk: TopKFn | None) -> list[str]:
        """Capture the bucket's pieces again around a real batch of another size and length (recorded only)
        and compare each piece's nodes with the first capture's."""
        other_batch = self._dummy_batch(min(bucket, 64, self.max_model_len), self.max_model_len)
        other = self._capture(bucket, other_batch, topk, keep_graph=True, instantiate=False)
        problems = []
        for index, (mine, theirs) in enumerate(zip(self.graphs[bucket], other)):
            name = f"prefill graph bucket {bucket}, piece {index}"
            try:
                first, second = graph_nodes(mine.graph), graph_nodes(theirs.graph)
            except GraphWalkError as exc:
                logger.warning("capture audit skipped for %s: its nodes could not be read (%s)", name, exc)
                return problems
            if not first:
                problems.append(f"{name}: the capture holds no nodes; cannot audit")
                continue
            diff = node_difference(first, second, "capture around 1 real token",
                                   f"capture around {other_batch.num_tokens} real tokens at max_model_len")
            if diff is not None:
                problems.append(f"{name} recorded different kernels around another real batch: a host fact of the "
                                f"batch was frozen into the piece.\n{diff}")
        del other
        return problems
