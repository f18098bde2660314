"""Start-up kernel builds: eager steps that meet every kernel specialisation the engine's limits admit,
so that no request waits for Triton to build a kernel.

Triton builds a kernel for each new combination of its `tl.constexpr` values and of the
specialisations of its plain integer arguments (== 1, divisible by 16) and pointers (16-byte
aligned). Lengths and counts that vary with the requests (token counts, row-list widths, their
strides) are `do_not_specialize` arguments of the kernels, and `build_batch` aligns every metadata
view, so what is left to vary is the launch configurations chosen from a step's sizes: tile sizes and
warps from the token count (`mhc.mix_config` / `row_config`, the MoE and quantized GEMM tables, the
rope blocks, the router and fused-mHC paths of small steps), and row splits, scan widths and top-k
chunks from the step's token count together with its longest sequence (`attention.select`, the
top-k plans, `rows._tiles`). Those choices are step functions with thresholds at powers of two (and at
fixed sizes below 16), so the plan runs:

- a token sweep: one prefill of T tokens from position 0 for every T in `token_buckets` (1 to 16,
  then each power of two p with p + 1 and 3p/2) up to `max_num_batched_tokens` (above
  `max_model_len`, several prompts of `max_model_len` tokens: the large-M tiles of the GEMMs and mixes);
- a length sweep: steps of T tokens ending at every power of two from `MIN_LENGTH` and at
  `max_model_len`, where the choices that depend on both sizes change (row splits, scan widths,
  indexer tiles: their thresholds are powers of two of the row widths, which are the length over a
  compress rate), for T the powers of two up to `CROSS_MAX_TOKENS`; then, with a `JointProfile` of
  the model's shapes (the attention launches over each layer kind's row widths, the indexer's tiles),
  a step for each (T up to `CROSS_MAX_TOKENS`, length T or where a row width crosses a tile) whose
  launch of some kernel no planned step has met yet (on V4-Flash shapes: 2 tokens at 48K take 8 splits of one
  tile, at 64K of two);
- a few steps of several sequences (mixed prefill and decode rows).

Decode-shaped steps (every sequence the same graph query length) are built by the graph captures.
With prefill graphs (worker/prefill_graphs.py) a step of up to the largest bucket runs padded, here as
after start-up: its pieces at the bucket's token count, its cores (attention, indexer, top-k,
compressor, commits) at its own, with the launches of an eager step of that size. The token sweep then
holds every bucket too, so the pieces' kernels are built here and the capture builds none.
The `gpu` test `tests/test_kernel_warmup_gpu.py` checks the claim: after start-up, random prompt lengths
and batch compositions build nothing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from ..kernels.argmax import greedy_tokens
from ..kernels.attention.select import attention_config, needs_band_prepass, split_length
from ..kernels.dispatch import num_sms
from ..kernels.indexer import indexer_config
from ..kernels.jit_builds import TritonBuilds
from ..model.batch import SequenceChunk

logger = logging.getLogger("sparseserve")

SMALL_TOKENS = 16  # every token count up to this: the fixed thresholds of small steps (4, 16)
CROSS_MAX_TOKENS = 256  # the length sweep's largest step: row splits only change for small steps
MIN_LENGTH = 16


@dataclass(frozen=True)
class WarmupStep:
    """One eager step of the warm-up: `num_seqs` sequences sharing `num_tokens` tokens, the first one
    ending at position `end` (the step's longest sequence); the others are one-token rows."""

    num_tokens: int
    end: int
    num_seqs: int = 1
    query_len: int = 0  # > 0: a decode-shaped step, every sequence of this many tokens
    packed: bool = False  # prompts from position 0, `end` tokens each but the last (more tokens than one sequence)

    def chunks(self, block_size: int, num_blocks: int) -> list[SequenceChunk]:
        blocks = list(range(min(num_blocks, -(-self.end // block_size))))
        if self.query_len:
            q = self.query_len
            return [SequenceChunk(i, self.end - q, [1] * q, blocks, "last" if q == 1 else "all")
                    for i in range(self.num_seqs)]
        if self.packed:
            sizes = [self.end] * (self.num_seqs - 1) + [self.num_tokens - self.end * (self.num_seqs - 1)]
            return [SequenceChunk(i, 0, [1] * n, blocks, "last") for i, n in enumerate(sizes)]
        first = self.num_tokens - (self.num_seqs - 1)
        chunks = [SequenceChunk(0, self.end - first, [1] * first, blocks, "last")]
        for i in range(1, self.num_seqs):  # decode rows of other sequences, shorter than the first
            chunks.append(SequenceChunk(i, max(self.end - 1 - i, 0), [1], blocks, "last"))
        return chunks


def _powers_with_halves(low: int, limit: int, plus_one: bool) -> list[int]:
    values, p = [], low
    while p <= limit:
        values += [p, p + 1, p + p // 2] if plus_one else [p, p + p // 2]
        p *= 2
    return [v for v in values if v <= limit]


def token_buckets(limit: int) -> list[int]:
    """Token counts of the token sweep: 1..SMALL_TOKENS, then p, p + 1 and 3p/2 for each power of two
    p above, and `limit` itself."""
    if limit < 1:
        return []
    values = set(range(1, min(SMALL_TOKENS, limit) + 1))
    values.update(_powers_with_halves(SMALL_TOKENS, limit, plus_one=True))
    values.add(limit)
    return sorted(values)


def length_buckets(limit: int) -> list[int]:
    """Sequence lengths of the length sweep: p and 3p/2 for each power of two p >= MIN_LENGTH, and
    `limit`."""
    values = set(_powers_with_halves(MIN_LENGTH, limit, plus_one=False))
    values.add(limit)
    return sorted(v for v in values if 1 <= v <= limit)


class JointProfile:
    """The launch choices of the kernels whose configuration depends on a step's token count and its
    longest sequence together (attention over each layer kind's row widths, the indexer's tiles), at a
    model's shapes: the length sweep's token counts are picked so that every profile is met."""

    def __init__(self, model_config, sms: int, num_speculative_tokens: int = 0) -> None:
        hf = model_config.hf_config
        self.heads, self.head_dim = hf.num_attention_heads, hf.head_dim
        self.index_heads = getattr(hf, "index_n_heads", 0)
        self.index_dim = getattr(hf, "index_head_dim", 0)
        window = hf.sliding_window
        self.windows = sorted({window, window + num_speculative_tokens})
        self.topk = getattr(hf, "index_topk", 0)
        layers = range(model_config.num_layers)
        self.csa_rates = sorted({model_config.compress_rate(i) for i in layers if model_config.is_csa(i)})
        self.hca_rates = sorted({model_config.compress_rate(i) for i in layers
                                 if model_config.compress_rate(i) and not model_config.is_csa(i)})
        self.sms = sms
        self._cache: dict[tuple[int, int], list[tuple]] = {}  # (tokens, rows) -> attention launches

    def _attention(self, tokens: int, rows: int) -> list[tuple]:
        cached = self._cache.get((tokens, rows))
        if cached is not None:
            return cached
        out = self._cache[(tokens, rows)] = []
        for hopper in (False, True):  # whichever the device serves: both are covered
            cfg = attention_config(tokens, self.heads, rows, self.head_dim, self.sms, hopper=hopper)
            per_split = split_length(rows, cfg)
            scan = min(256, 1 << (max(per_split, 16) - 1).bit_length())  # the launcher's next power of two
            out.append((cfg, scan, needs_band_prepass(cfg, per_split)))
        return out

    def candidate_lengths(self, max_model_len: int) -> list[int]:
        """Lengths at which a row width crosses a multiple of the 64-row tile (and just past them), and
        the 3/2 lengths: where the choices that depend on the length can change."""
        values = set(length_buckets(max_model_len))
        for rate in self.hca_rates:  # the attention row lists (CSA lists have the fixed top-k width)
            step = 64 * rate
            values.update(v for j in range(1, max_model_len // step + 1) for v in (j * step, j * step + rate))
        return sorted(v for v in values if MIN_LENGTH <= v <= max_model_len)

    def __call__(self, tokens: int, length: int) -> tuple:
        key = []
        for window in self.windows:
            widths = [window] + [window + self.topk for _ in self.csa_rates[:1]]
            widths += [window + length // rate for rate in self.hca_rates]
            for rows in widths:
                key += self._attention(tokens, rows)
        for rate in self.csa_rates:
            if self.index_heads:
                key.append(indexer_config(tokens, self.index_heads, self.index_dim, length // rate, self.sms))
        return tuple(key)


def packed_step(num_tokens: int, length: int) -> WarmupStep:
    """A prefill of `num_tokens` tokens over as few prompts of at most `length` tokens as hold them."""
    if num_tokens <= length:
        return WarmupStep(num_tokens, num_tokens)
    return WarmupStep(num_tokens, length, -(-num_tokens // length), packed=True)


def warmup_plan(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, decode_graphs: bool = True,
                eager_decode: dict[int, list[int]] | None = None, profile: JointProfile | None = None,
                prefill_buckets: list[int] | None = None) -> list[WarmupStep]:
    """The eager steps start-up runs (see the module's docstring). A step holds up to
    `max_num_batched_tokens` tokens, from several prompts where one sequence cannot hold them. With
    `decode_graphs` a step of one token is a decode graph's (its kernels are built by the capture), so
    none is planned. `eager_decode` (query length -> batch buckets): without graphs, decode-shaped steps
    run eagerly, padded to these buckets, so each bucket gets a step. `prefill_buckets`: the prefill
    graphs' token counts, each a step of its own (the pieces run at the bucket's size)."""
    max_tokens = min(max_num_batched_tokens, max_model_len * max_num_seqs)
    steps: set[WarmupStep] = set()

    def add(step: WarmupStep) -> bool:
        if step.num_tokens > max_tokens or step.end > max_model_len or step.num_seqs > max_num_seqs:
            return False
        if step.end < step.num_tokens and not step.packed:
            return False
        if decode_graphs and step.num_tokens == 1 and not step.query_len:
            return False
        steps.add(step)
        return True

    for t in sorted(set(token_buckets(max_tokens)) | set(prefill_buckets or ())):
        add(packed_step(t, max_model_len))
    sweep = [n for n in length_buckets(max_model_len) if n & (n - 1) == 0 or n == max_model_len]
    cross = [t for t in token_buckets(min(max_tokens, CROSS_MAX_TOKENS)) if t & (t - 1) == 0]
    for length in sweep:  # the 3/2 lengths only in the steps below
        for t in cross:
            add(WarmupStep(t, length))
    if profile is not None:  # lengths where a row width crosses a tile: steps that meet a new launch
        seen = [set(keys) for keys in zip(*(profile(s.num_tokens, s.end) for s in steps if s.num_seqs == 1))]
        lengths = profile.candidate_lengths(max_model_len)
        for t in range(1, min(max_tokens, CROSS_MAX_TOKENS) + 1):  # every count: thresholds follow the SMs
            for length in [t] + [n for n in lengths if n > t]:
                keys = profile(t, length)
                if any(key not in known for key, known in zip(keys, seen)) and add(WarmupStep(t, length)):
                    for key, known in zip(keys, seen):
                        known.add(key)
    for t in token_buckets(max_tokens):  # larger steps at the longest length and at 3/2 lengths
        if CROSS_MAX_TOKENS < t <= max_model_len and t & (t - 1) == 0:
            add(WarmupStep(t, max_model_len))
    for length in length_buckets(max_model_len):
        if length & (length - 1):
            add(WarmupStep(min(CROSS_MAX_TOKENS, length), length))
    for seqs in (2, 3, 8):
        if seqs <= max_num_seqs:
            for t in (seqs + 1, seqs + 15, min(max_tokens, 256)):
                if t > seqs:
                    add(WarmupStep(t, max_model_len, seqs))
                    add(WarmupStep(t, max(t, MIN_LENGTH), seqs))
    for q, buckets in sorted((eager_decode or {}).items()):
        for size in buckets:
            if size * q <= max_tokens and q + 1 <= max_model_len and size <= max_num_seqs:
                steps.add(WarmupStep(size * q, max_model_len, size, q))
    return sorted(steps, key=lambda s: (s.num_tokens, s.end, s.num_seqs, s.query_len))


def runner_plan(runner) -> list[WarmupStep]:
    """`warmup_plan` for a runner's limits; without graphs, its eager decode buckets too."""
    eager_decode = {} if runner.use_graphs else {q: runner.graph_sizes_for(q) for q in runner.query_lens}
    profile = JointProfile(runner.model_config, num_sms(runner.device), runner.options.num_speculative_tokens)
    return warmup_plan(runner.max_num_batched_tokens, runner.max_model_len, runner.max_num_seqs, runner.use_graphs,
                       eager_decode, profile, getattr(runner, "prefill_sizes", None))


@dataclass
class WarmupReport:
    steps: int
    seconds: float
    builds: int
    kernels: list[str]

    def line(self) -> str:
        names = ", ".join(self.kernels[:6]) + (", ..." if len(self.kernels) > 6 else "")
        return (f"kernel warm-up: built {self.builds} kernels in {self.seconds:.1f} s "
                f"({self.steps} eager steps{': ' + names if names else ''})")


def fit_to_cache(plan: list[WarmupStep], cache_tokens: int) -> list[WarmupStep]:
    """The plan for a cache that holds `cache_tokens` tokens of one sequence: a longer step cannot be
    scheduled (its rows would have no block), so it ends at the cache's length instead (a packed step keeps
    its prompt count, so its slots stay within the engine's)."""
    fitted = {step if step.end <= cache_tokens else
              packed_step(min(step.num_tokens, cache_tokens * step.num_seqs), cache_tokens) if step.packed else
              replace(step, end=cache_tokens, num_tokens=min(step.num_tokens, cache_tokens))
              for step in plan}
    return sorted((s for s in fitted if s.num_tokens >= max(s.num_seqs, 1) * max(s.query_len, 1)),
                  key=lambda s: (s.num_tokens, s.end, s.num_seqs, s.query_len))


@torch.no_grad()
def run_warmup(runner, plan: list[WarmupStep]) -> WarmupReport:
    """Run `plan` on the runner's state (slots and blocks are all free at start-up; every state write is
    position-addressed, so a request that takes them later overwrites what the warm-up wrote before it
    reads it). Each step samples greedily, as the engine's steps do."""
    num_blocks = runner.state.layout.num_blocks
    plan = fit_to_cache(plan, num_blocks * runner.block_size)
    start = time.perf_counter()
    with TritonBuilds() as builds:
        for step in plan:
            chunks = step.chunks(runner.block_size, num_blocks)
            logits, _ = runner.forward(chunks)
            greedy_tokens(logits)
            if runner.speculator is not None:  # the drafter's eager steps: its catch-up over prompts,
                hf = runner.model_config.hf_config  # full (a prompt's last chunk drafts) and state-only
                hidden = torch.zeros(step.num_tokens, hf.hc_mult, hf.hidden_size, device=runner.device,
                                     dtype=runner.dtype)
                runner.mtp_forward(chunks, hidden)
                runner.mtp_catch_up(chunks, hidden)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    report = WarmupReport(len(plan), time.perf_counter() - start, builds.count, builds.summary())
    logger.info("%s", report.line())
    return report
