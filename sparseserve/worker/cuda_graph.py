"""CUDA graphs for decode steps: one per (batch-size bucket, query length), sharing a pool.

The captured step is static (DESIGN.md invariants 1-3): shapes come from the bucket, every
per-request fact lives in the static input buffers ("bridge tensors") that `run` fills
before each replay, padded sequences use a dummy slot and an empty block table so they
touch nothing real, and the top-k path of a graph is fixed when it is built.

The audit captures every graph a second time under other dummy lengths and compares the
two kernel sequences: a difference means a host branch on data was frozen into a capture.
"""
from __future__ import annotations

import difflib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.batch import BatchMetadata, SequenceChunk, build_batch
from ..model.deepseek_v4 import DeepseekV4ForCausalLM
from ..model.state import ModelState
from ..model.step_context import TopKFn

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
               dummy_len: int | None = None) -> list[SequenceChunk]:
    """Pad a decode batch to `batch_size` sequences. Padding sequences live in the dummy slot
    with no blocks, so their reads and writes land in rows no real sequence uses."""
    start = max((dummy_len or query_len) - query_len, 0)
    pad = SequenceChunk(slot=dummy_slot, start_pos=start, token_ids=[0] * query_len, block_ids=[],
                        want_logits="last")
    return list(chunks) + [pad] * (batch_size - len(chunks))


def decode_batch(chunks: list[SequenceChunk], rates: list[int], device, max_blocks: int,
                 num_entries: dict[int, int]) -> BatchMetadata:
    """The metadata of a (padded) decode step, built the same way for eager and graph runs so
    that both compute the same function on the same shapes (DESIGN.md invariant 5): static
    row widths, and every token treated as possibly closing a window (kernels mask the rest)."""
    batch = build_batch(chunks, rates, device, max_blocks=max_blocks, num_entries=num_entries)
    all_tokens = torch.arange(batch.num_tokens, device=device)
    batch.emit_tokens = {r: all_tokens for r in rates}
    return batch


class StaticBatch:
    """Device buffers with a fixed address for every tensor of a graph's BatchMetadata."""

    def __init__(self, template: BatchMetadata) -> None:
        self.batch = BatchMetadata(
            input_ids=template.input_ids.clone(), positions=template.positions.clone(),
            token_seq=template.token_seq.clone(), seq_slots=template.seq_slots.clone(),
            seq_start=template.seq_start.clone(), seq_num_tokens=template.seq_num_tokens.clone(),
            seq_token_offset=template.seq_token_offset.clone(), block_table=template.block_table.clone(),
            logits_indices=template.logits_indices.clone(), num_entries=dict(template.num_entries),
            emit_tokens={r: t.clone() for r, t in template.emit_tokens.items()},
            max_seq_len=template.max_seq_len)

    def fill(self, src: BatchMetadata) -> None:
        dst = self.batch
        for name in ("input_ids", "positions", "token_seq", "seq_slots", "seq_start", "seq_num_tokens",
                     "seq_token_offset", "block_table", "logits_indices"):
            getattr(dst, name).copy_(getattr(src, name), non_blocking=True)
        dst.max_seq_len = src.max_seq_len


@dataclass
class CapturedGraph:
    key: GraphKey
    graph: torch.cuda.CUDAGraph
    static: StaticBatch
    logits: torch.Tensor  # [batch_size, vocab] fp32, written by every replay
    topk_path: str
    capture_len: int
    kernels: list[str] = field(default_factory=list)  # filled when the graph is audited


class GraphCaptureError(RuntimeError):
    """The audit found two captures of one graph that differ, or a replay that differs from eager."""


def _dot_kernel_sequence(path: str) -> list[str]:
    """Node sequence of a CUDA-graph DOT dump: 'KERNEL <name>' / 'MEMSET' / ... in node order."""
    text = open(path, encoding="utf-8", errors="replace").read()
    nodes = []
    for match in re.finditer(r'^\s*"?([\w]+)"?\s*\[(.*?)\];?\s*$', text, flags=re.M | re.S):
        attrs = match.group(2)
        label = re.search(r'label="(.*?)"\s*(?:,|\]|$)', attrs, flags=re.S)
        if not label:
            continue
        body = label.group(1)
        kind = re.search(r"\b(KERNEL|MEMSET|MEMCPY|HOST|EVENT_RECORD|WAIT_EVENT|EMPTY|GRAPH|MEM_ALLOC|MEM_FREE)\b",
                         body)
        if not kind:
            continue
        entry = kind.group(1)
        if entry == "KERNEL":
            name = re.search(r"(?:\\n|\|)\s*([A-Za-z_][\w:<>,\s]*?)\s*(?:\\n|\||\\l|$)", body[kind.end():])
            entry += " " + (name.group(1).strip() if name else body[kind.end():kind.end() + 80].strip())
        nodes.append(entry)
    return nodes


class CudaGraphRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, state: ModelState, sizes: list[int], query_len: int,
                 max_blocks: int, num_entries: dict[int, int], dummy_slot: int,
                 topk_for: Callable[[int], tuple[TopKFn, str]], short_len: int) -> None:
        self.model = model
        self.state = state
        self.sizes = sorted(sizes)
        self.query_len = query_len
        self.max_blocks = max_blocks
        self.num_entries = dict(num_entries)
        self.dummy_slot = dummy_slot
        self.topk_for = topk_for
        self.short_len = short_len
        self.rates = model.model_config.rates
        self.device = state.layers[0].kv_pool.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, CapturedGraph] = {}

    def _template(self, batch_size: int, dummy_len: int) -> BatchMetadata:
        chunks = pad_chunks([], batch_size, self.query_len, self.dummy_slot, dummy_len)
        return decode_batch(chunks, self.rates, self.device, self.max_blocks, self.num_entries)

    @torch.no_grad()
    def capture(self, batch_size: int, dummy_len: int, debug_dump: bool = False) -> CapturedGraph:
        key = GraphKey(batch_size, self.query_len)
        static = StaticBatch(self._template(batch_size, dummy_len))
        topk_fn, topk_path = self.topk_for(batch_size * self.query_len)
        logger.debug("Capturing CUDA graph: batch=%d, query_len=%d, topk_path=%s, dummy max_seq_len=%d",
                     batch_size, self.query_len, topk_path, dummy_len)

        def step() -> torch.Tensor:
            streams = self.model(static.batch, self.state, topk=topk_fn)
            return self.model.compute_logits(streams[static.batch.logits_indices])

        # Warm up eagerly (Triton compilation, library handles) on a side stream, then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if debug_dump else torch.cuda.CUDAGraph()
        if debug_dump:
            graph.enable_debug_mode()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        captured = CapturedGraph(key, graph, static, logits, topk_path, dummy_len)
        if debug_dump:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "graph.dot")
                graph.debug_dump(path)
                captured.kernels = _dot_kernel_sequence(path)
        return captured

    def capture_all(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        for size in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its pool
            graph = self.capture(size, self.short_len)
            self.graphs[graph.key] = graph
        torch.cuda.synchronize(self.device)
        logger.info("Captured %d CUDA graphs (query_len=%d, batch sizes %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.query_len, self.sizes, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(self.device) - before) / 1024**3)

    def bucket_for(self, num_seqs: int) -> int | None:
        return pick_bucket(self.sizes, num_seqs)

    def run(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, CapturedGraph]:
        """Replay the graph of the smallest bucket holding `chunks`; logits [len(chunks), V]."""
        size = self.bucket_for(len(chunks))
        graph = self.graphs[GraphKey(size, self.query_len)]
        padded = pad_chunks(chunks, size, self.query_len, self.dummy_slot)
        host = build_batch(padded, self.rates, "cpu", max_blocks=self.max_blocks, num_entries=self.num_entries)
        graph.static.fill(host)
        graph.graph.replay()
        return graph.logits[: len(chunks)], graph

    def audit_captures(self, long_len: int) -> list[str]:
        """Capture every graph under short and long dummy lengths; return the differences found."""
        problems = []
        for size in self.sizes:
            short = self.capture(size, self.short_len, debug_dump=True)
            long = self.capture(size, long_len, debug_dump=True)
            if not short.kernels:
                problems.append(f"graph {short.key}: the DOT dump held no nodes; cannot audit")
                continue
            if short.kernels != long.kernels:
                diff = "\n".join(difflib.unified_diff(short.kernels, long.kernels,
                                                      f"capture at max_seq_len={self.short_len}",
                                                      f"capture at max_seq_len={long_len}", lineterm="", n=1))
                problems.append(f"graph {short.key} (topk_path={short.topk_path}) recorded different kernels "
                                f"when captured at other lengths: a host branch on data was frozen into the "
                                f"capture.\n{diff}")
            else:
                logger.info("audit: graph %s captures identically (%d nodes)", short.key, len(short.kernels))
        return problems
