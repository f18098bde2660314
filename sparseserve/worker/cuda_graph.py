"""CUDA graphs for decode steps: one per (batch-size bucket, query length), sharing a pool.

Query length 1 is plain decode; with speculation, 1 + k is a verify step (every token's
logits), and the MTP drafter has graphs of both lengths too (its catch-up over the verified
positions, and each single-token draft step). With adaptive speculation the drafter also has
graphs of its state-only catch-up at query length 1 (plain steps, which propose nothing).

The captured step is static (docs/design.md, invariants 1-3): shapes come from the bucket, every
per-request fact lives in the static input buffers ("bridge tensors") that `run` fills
before each replay, padded sequences use a dummy slot and an empty block table so they
touch nothing real, and the top-k path of a graph is fixed when it is built.

The capture audit (on by default) captures some graphs a second time under another dummy length
and compares the nodes both captures recorded (`graph_signature.py`): a difference means a host
branch on data was frozen into a capture. The second capture is only recorded (never instantiated
or run) and reuses the first one's warm-up, so it costs a fraction of the capture time.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..kernels.jit_builds import TritonBuilds
from ..logger import progress_bar
from ..model.batch import INT64_FIELDS, BatchMetadata, BlockTableCache, SequenceChunk, build_batch
from ..model.state import ModelState
from ..model.step_context import TopKFn
from .graph_signature import GraphWalkError, graph_nodes, node_difference

logger = logging.getLogger("sparseserve")


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def pick_bucket(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` sequences (None if none does)."""
    for size in sorted(sizes):
        if size >= batch_size:
            return size
    return None


@dataclass(frozen=True)
class GraphKey:
    batch_size: int
    query_len: int

    def __str__(self) -> str:
        return f"batch={self.batch_size}, query_len={self.query_len}"


def pad_chunks(chunks: list[SequenceChunk], batch_size: int, query_len: int, dummy_slot: int,
               dummy_len: int | None = None, want_logits: str = "last") -> list[SequenceChunk]:
    """Pad a decode batch to `batch_size` sequences. Padding sequences live in the dummy slot
    with no blocks, so their reads and writes land in rows no real sequence uses."""
    start = max((dummy_len or query_len) - query_len, 0)
    pad = SequenceChunk(slot=dummy_slot, start_pos=start, token_ids=[0] * query_len, block_ids=[],
                        want_logits=want_logits)
    return list(chunks) + [pad] * (batch_size - len(chunks))


def logits_mode(query_len: int) -> str:
    """Which logits a graph of this query length yields: the last token's for plain decode, every
    token's for a speculative verify step (1 + k tokens per sequence)."""
    return "last" if query_len == 1 else "all"


def decode_batch(chunks: list[SequenceChunk], rates: list[int], device, max_blocks: int,
                 num_entries: dict[int, int], tables: BlockTableCache | None = None) -> BatchMetadata:
    """The metadata of a (padded) decode step, built the same way for eager and graph runs so
    that both compute the same function on the same shapes (docs/design.md, invariant 5): static
    row widths, and every token treated as possibly closing a window (kernels mask the rest)."""
    batch = build_batch(chunks, rates, device, max_blocks=max_blocks, num_entries=num_entries, tables=tables)
    all_tokens = torch.arange(batch.num_tokens, device=device)
    batch.emit_tokens = {r: all_tokens for r in rates}
    batch.emit_all_tokens = True
    return batch


def set_positions(batch: BatchMetadata, positions: torch.Tensor) -> None:
    """Give the first sequences of a one-token-per-sequence batch device-side positions (the
    drafter's steps, whose positions follow the acceptance counts still on the device)."""
    if batch.num_tokens != batch.seq_start.shape[0]:
        raise ValueError("device-side positions need one token per sequence")
    batch.positions[: positions.shape[0]].copy_(positions)
    batch.seq_start[: positions.shape[0]].copy_(positions)


class StaticBatch:
    """Device buffers with a fixed address for every tensor of a graph's BatchMetadata.

    The int64 fields are views of one flat device buffer, so a replay's inputs arrive in two
    copies (the flat buffer and the block table) from pinned host memory instead of nine."""

    INT64_FIELDS = INT64_FIELDS

    def __init__(self, template: BatchMetadata) -> None:
        device = template.input_ids.device
        parts = [getattr(template, name) for name in self.INT64_FIELDS]
        self.flat = torch.cat(parts).to(torch.int64)
        views, offset = {}, 0
        for name, part in zip(self.INT64_FIELDS, parts):
            views[name] = self.flat[offset:offset + part.numel()]
            offset += part.numel()
        pin = device.type == "cuda"
        self.host_flat = torch.empty(self.flat.shape, dtype=torch.int64, pin_memory=pin)
        self.host_table = torch.empty(template.block_table.shape, dtype=torch.int32, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # the last fill's copies, before the host buffers are reused
        self.batch = BatchMetadata(
            block_table=template.block_table.clone(), num_entries=dict(template.num_entries),
            emit_tokens={r: t.clone() for r, t in template.emit_tokens.items()},
            emit_all_tokens=template.emit_all_tokens, **views)

    def fill_like(self, other: StaticBatch) -> bool:
        """Copy another graph's metadata, device to device, when both lay it out alike (a graph of
        another step function, same bucket and query length, that has just run the same chunks).
        False, having copied nothing, when the layouts differ."""
        if (other.flat.shape != self.flat.shape or other.batch.block_table.shape != self.batch.block_table.shape
                or other.batch.num_tokens != self.batch.num_tokens):
            return False
        self.flat.copy_(other.flat)
        self.batch.block_table.copy_(other.batch.block_table)
        return True

    def fill(self, src: BatchMetadata) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # an earlier fill's copy may still be reading the host buffers
        torch.cat([getattr(src, name) for name in self.INT64_FIELDS], out=self.host_flat)
        self.host_table.copy_(src.block_table)
        self.flat.copy_(self.host_flat, non_blocking=True)
        self.batch.block_table.copy_(self.host_table, non_blocking=True)
        if self.flat.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


@dataclass
class CapturedGraph:
    key: GraphKey
    graph: torch.cuda.CUDAGraph
    static: StaticBatch
    outputs: tuple[torch.Tensor, ...]  # views of the runner's shared output buffers, written by every replay
    topk_path: str
    capture_len: int


# step(batch, topk, hidden, outputs): writes its results into `outputs` (the shared static buffers,
# sliced to this graph's rows); `hidden` is the static input rows [T, ...] or None.
StepFn = Callable[[BatchMetadata, TopKFn | None, torch.Tensor | None, tuple[torch.Tensor, ...]], None]


@dataclass(frozen=True)
class BufferSpec:
    """A per-token tensor of a graph family: shape [tokens, *tail]."""

    tail: tuple[int, ...]
    dtype: torch.dtype


class GraphCaptureError(RuntimeError):
    """The audit found two captures of one graph that differ, or a replay that differs from eager."""


class CudaGraphRunner:
    """The graphs of one step function at one query length, one per batch-size bucket.

    Every graph of a runner writes into the same output buffers (sized for the largest bucket)
    and, where the step takes a per-token input (`hidden`), reads it from one shared buffer: the
    runner's memory does not grow with the number of buckets. All runners of a model share one
    memory pool, so graphs must be replayed one at a time (they are: one stream)."""

    def __init__(self, name: str, step: StepFn, outputs: list[BufferSpec], state: ModelState, rates: list[int],
                 sizes: list[int], query_len: int, max_blocks: int, num_entries: dict[int, int], dummy_slot: int,
                 topk_for: Callable[[int], tuple[TopKFn, str]] | None, short_len: int,
                 hidden: BufferSpec | None = None, pool=None, block_tables: BlockTableCache | None = None,
                 stream: torch.cuda.Stream | None = None, hidden_buffer: torch.Tensor | None = None) -> None:
        self.name = name
        self.step = step
        self.sizes = sorted(sizes)
        self.query_len = query_len
        self.want_logits = logits_mode(query_len)
        self.max_blocks = max_blocks
        self.block_tables = block_tables
        self.num_entries = dict(num_entries)
        self.dummy_slot = dummy_slot
        self.topk_for = topk_for
        self.short_len = short_len
        self.rates = rates
        self.device = state.layers[0].kv_pool.device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
        rows = max(self.sizes) * query_len
        self.outputs = tuple(torch.zeros((rows, *o.tail), dtype=o.dtype, device=self.device) for o in outputs)
        # `hidden_buffer`: an existing buffer of at least `rows` rows (another runner's output) read in
        # place; a run whose input rows are that buffer copies nothing.
        if hidden_buffer is not None and (hidden is None or hidden_buffer.shape[0] < rows
                                          or tuple(hidden_buffer.shape[1:]) != hidden.tail):
            raise ValueError(f"hidden_buffer {tuple(hidden_buffer.shape)} must hold {rows} rows of {hidden}")
        self.hidden = (hidden_buffer if hidden_buffer is not None else
                       torch.zeros((rows, *hidden.tail), dtype=hidden.dtype, device=self.device)
                       if hidden is not None else None)
        self.graphs: dict[GraphKey, CapturedGraph] = {}
        self.first_warmup_s: float | None = None  # wall time of the first eager warm-up step
        self.capture_s = self.audit_s = 0.0  # capture_all's capture time and its capture audit's

    def _rows(self, batch_size: int) -> int:
        """Output rows of a graph: one per sequence, or one per token of a verify step."""
        return batch_size * (1 if self.want_logits == "last" else self.query_len)

    def _template(self, batch_size: int, dummy_len: int) -> BatchMetadata:
        chunks = pad_chunks([], batch_size, self.query_len, self.dummy_slot, dummy_len, self.want_logits)
        return decode_batch(chunks, self.rates, self.device, self.max_blocks, self.num_entries)

    @torch.no_grad()
    def capture(self, batch_size: int, dummy_len: int, keep_graph: bool = False, warm_up: bool = True,
                instantiate: bool = True) -> CapturedGraph:
        """Capture the graph of one bucket with the padding sequences at `dummy_len`. `keep_graph`:
        keep the captured node list readable (`graph_signature.graph_nodes`); `warm_up=False` skips
        the eager warm-up step (the audit's second capture of a bucket that was just warmed up);
        `instantiate=False` (with keep_graph) leaves the graph uninstantiated (never replayed)."""
        key = GraphKey(batch_size, self.query_len)
        static = StaticBatch(self._template(batch_size, dummy_len))
        topk_fn, topk_path = self.topk_for(batch_size * self.query_len) if self.topk_for else (None, "none")
        logger.debug("Capturing CUDA graph: %s, batch=%d, query_len=%d, topk_path=%s, dummy length=%d",
                     self.name, batch_size, self.query_len, topk_path, dummy_len)
        outputs = tuple(o[: self._rows(batch_size)] for o in self.outputs)
        hidden = self.hidden[: batch_size * self.query_len] if self.hidden is not None else None

        def step() -> None:
            self.step(static.batch, topk_fn, hidden, outputs)

        # Warm up eagerly (Triton compilation, library handles), then capture, on the same stream:
        # cuBLAS makes a workspace per stream at its first GEMM there and keeps it for the process.
        # Made inside a capture, it would come from the graph pool and outlive the graphs, and
        # torch refuses to capture into a pool whose graphs are all gone but which still holds memory.
        self.stream.wait_stream(torch.cuda.current_stream())
        if warm_up:
            start = time.perf_counter()
            with torch.cuda.stream(self.stream):
                step()
            if self.first_warmup_s is None:  # the start-up report's first warm-up step (kernel builds included)
                self.stream.synchronize()
                self.first_warmup_s = time.perf_counter() - start
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            step()
        if keep_graph and instantiate and hasattr(graph, "instantiate"):
            graph.instantiate()  # with keep_graph torch would otherwise instantiate at the first replay
        torch.cuda.current_stream().wait_stream(self.stream)
        return CapturedGraph(key, graph, static, outputs, topk_path, dummy_len)

    def audit_sizes(self, every: bool) -> list[int]:
        """The buckets whose capture is audited: every one, or the smallest, the largest and the first
        of each top-k path (the captures' code differs only by path and shape, not by bucket)."""
        if every or not self.sizes:
            return list(self.sizes)
        chosen, paths = {self.sizes[0], self.sizes[-1]}, set()
        for size in self.sizes:
            path = self.topk_for(size * self.query_len)[1] if self.topk_for else "none"
            if path not in paths:
                paths.add(path)
                chosen.add(size)
        return sorted(chosen)

    def capture_all(self, audit: str = "off", long_len: int = 0) -> list[str]:
        """Capture every bucket. `audit`: "off", "sample" (the buckets `audit_sizes` picks) or "all":
        each audited bucket is captured a second time with its dummy sequences at `long_len` and the
        two captures' nodes are compared; returns the differences found (`capture_s` and `audit_s`
        hold the times)."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        audited = set(self.audit_sizes(audit == "all")) if audit != "off" else set()
        problems: list[str] = []
        self.audit_s = 0.0
        sizes = sorted(self.sizes, reverse=True)  # largest first: smaller ones reuse its pool
        with TritonBuilds() as builds:  # the decode-shaped steps' kernels, built by the warm-up steps
            for size in progress_bar(sizes, desc=f"Capturing CUDA graphs ({self.name}, query_len={self.query_len})",
                                     unit="graph"):
                graph = self.capture(size, self.short_len, keep_graph=size in audited)
                self.graphs[graph.key] = graph
                if size in audited:
                    audit_start = time.perf_counter()
                    problem = self.audit_capture(graph, long_len)
                    if problem:
                        problems.append(problem)
                    self.audit_s += time.perf_counter() - audit_start
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start - self.audit_s
        logger.info("Captured %d CUDA graphs (%s, query_len=%d, batch sizes %s) in %.1f s (%d kernels built), "
                    "%.2f GiB%s", len(self.graphs), self.name, self.query_len, self.sizes, self.capture_s, builds.count,
                    (torch.cuda.memory_reserved(self.device) - before) / 1024**3,
                    f"; capture audit of batch sizes {sorted(audited)}: {self.audit_s:.2f} s" if audited else "")
        return problems

    def audit_capture(self, graph: CapturedGraph, long_len: int) -> str | None:
        """Capture `graph`'s bucket again with its dummy sequences at `long_len` (recorded only) and
        compare the nodes; the description of a difference, or None."""
        name = f"{self.name} graph {graph.key} (topk_path={graph.topk_path})"
        other = self.capture(graph.key.batch_size, long_len, keep_graph=True, warm_up=False, instantiate=False)
        try:
            short_nodes, long_nodes = graph_nodes(graph.graph), graph_nodes(other.graph)
        except GraphWalkError as exc:  # the driver's API, not the graph: serve, but say the audit did not run
            logger.warning("capture audit skipped for %s: its nodes could not be read (%s)", name, exc)
            return None
        finally:
            del other
        if not short_nodes:
            return f"{name}: the capture holds no nodes; cannot audit"
        diff = node_difference(short_nodes, long_nodes, f"capture at dummy length {self.short_len}",
                               f"capture at dummy length {long_len}")
        if diff is None:
            logger.debug("audit: %s captures identically (%d nodes)", name, len(short_nodes))
            return None
        return (f"{name} recorded different kernels when captured at other lengths: a host branch on data was "
                f"frozen into the capture.\n{diff}")

    def bucket_for(self, num_seqs: int) -> int | None:
        return pick_bucket(self.sizes, num_seqs)

    def run(self, chunks: list[SequenceChunk], hidden: torch.Tensor | None = None,
            input_ids: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, fix_inputs: Callable[[torch.Tensor], None] | None = None,
            like: CapturedGraph | None = None) -> tuple[tuple[torch.Tensor, ...], CapturedGraph]:
        """Replay the graph of the smallest bucket holding `chunks` (each of `query_len` tokens).
        `hidden`: the per-token input rows (at least the real tokens'); `input_ids`: device token ids
        that replace the chunks' first ids; `positions`: device positions that replace the chunks'
        (one-token chunks only); `fix_inputs`: writes device-side ids into the flat input ids;
        `like`: a graph (of another runner) whose last replay ran these same chunks: its metadata is
        copied on the device instead of built on the host (`StaticBatch.fill_like`).
        Returns the outputs' rows (padding rows included last)."""
        size = self.bucket_for(len(chunks))
        graph = self.graphs[GraphKey(size, self.query_len)]
        if like is None or like.key != graph.key or not graph.static.fill_like(like.static):
            chunks = [c if c.want_logits == self.want_logits else replace(c, want_logits=self.want_logits)
                      for c in chunks]
            padded = pad_chunks(chunks, size, self.query_len, self.dummy_slot, want_logits=self.want_logits)
            host = build_batch(padded, self.rates, "cpu", max_blocks=self.max_blocks, num_entries=self.num_entries,
                               tables=self.block_tables)
            graph.static.fill(host)
        if input_ids is not None:
            graph.static.batch.input_ids[: input_ids.shape[0]].copy_(input_ids)
        if fix_inputs is not None:
            fix_inputs(graph.static.batch.input_ids)
        if positions is not None:
            set_positions(graph.static.batch, positions)
        if hidden is not None and not (hidden.data_ptr() == self.hidden.data_ptr()
                                       and hidden.stride() == self.hidden.stride()):
            n = min(hidden.shape[0], size * self.query_len)
            self.hidden[:n].copy_(hidden[:n])
        graph.graph.replay()
        return graph.outputs, graph
