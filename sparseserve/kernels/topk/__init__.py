"""Indexer top-k over fp32 score rows with per-row valid lengths.

Tie rule (all paths): a larger score wins; among equal scores the lower index wins.
Output: int32 [R, k]; the first min(length, k) slots hold the chosen indices (in no
promised order), the rest are -1. Columns >= length are ignored whatever they hold.
-0.0 counts as equal to +0.0; NaN scores are not supported (their rank is unspecified).

Engine interface
----------------
``IndexerTopK(max_rows, max_width, k, backend="auto", device=...)`` preallocates its
output and workspaces once; ``__call__(scores, lengths)`` returns a view ``[R, k]`` of that
output (R <= max_rows, W <= max_width). A call does no host sync, no data-dependent host
branch and no allocation, so it can be captured in a CUDA graph (docs/design.md, invariant 1).
``backend`` is "auto" | "standard" | "persistent" | "torch"; "auto" picks from the static
facts (max_rows, max_width) only (invariant 3), and ``.path`` says what it picked. The
returned view is overwritten by the next call. Calls must be stream-ordered (the standard
path's candidate buffer is shared by the instances on one device).

Both Triton paths compute the same function and write the chosen indices in increasing
index order, whichever branch below a row takes (deterministic, and the same on both paths).

Algorithm (both paths), for a row of n > k valid scores:
1. **Bound.** Split the row into G strided groups (column mod G) and take each group's
   maximum. The k-th largest group maximum ``lo`` is a lower bound of T: k distinct groups
   reach it, so at least k scores are >= lo. On random rows few scores pass it (about
   k * (1 + k / 2G)); strided groups keep that true when the large scores cluster in one
   stretch of positions (recent tokens). ``lo`` is found by a 2-bit-per-step search over
   the top 16 bits of the order-preserving int32 key (rounding it down keeps it a bound), or
   is the k-th group maximum itself where the search meets exactly k maxima.
2. **Compact.** One pass writes the entries with score > lo (value and column) to a
   candidate buffer of capacity C = max(1024, 4k), in index order.
3. **Select.** With ``total`` candidates:
   * total >= k (the usual case): a 32-bit search over the buffer for the k-th largest
     candidate (2 bits per step, starting below the leading bits that lo and the largest
     candidate share). It stops as soon as exactly k candidates reach its threshold: those
     are the top k, written in one pass (continuous scores: after ~10 of 16 steps, one
     block reduction each). Otherwise ties straddle T, the k-th score: the entries > T and
     the first ties by index. Rows whose candidates fit half the buffer (the usual ~1.25k
     of C >= 4k) do this on a half-width block.
   * total < k: T == lo (many equal scores): a scan of the row writes the entries > lo and
     the first k - total with score == lo, and stops once k are written.
   * total > C (adversarial rows, e.g. large scores on a period that divides G): an exact
     one-program radix select over the row (four 256-bin histogram passes and a write pass;
     correct, slow).

* standard: one program per row (grid-stride when rows exceed 2 programs per SM), BLOCK =
  G = 4096 columns (fewer for narrow rows, more for k > 4096), all steps inside one launch.
  Loads, scans and scatter stores share one layout (see ONE in the kernel): no shared-memory
  layout conversions in the per-block loop. The candidate buffers (one per
  program) are shared by every standard-path instance on the device.
* persistent: a resident grid (two programs per SM) that cuts every row into chunks and
  loops over (row, chunk) items, so a few long rows use the whole GPU; G = max(1024, 2k),
  two launches. Launch 1: each chunk folds its group maxima into the row's workspace with
  atomic max; the last chunk of the row to arrive (an atomic arrival counter; no program
  ever waits for another, so no hang is possible, also under TRITON_INTERPRET=1) computes
  ``lo``. Launch 2 (its items are one or more adjacent chunks of a row, so that the grid is
  one wave): each chunk compacts its entries > lo into the row's buffer at a base
  taken with an atomic add and records (count, base); the last chunk to arrive selects
  the top k among the candidates and writes them in index order through those records
  (deterministic output): straight from the buffer's arrival order by two in-register
  gathers when no tie straddles the k-th score, else by reordering the buffer through memory
  first. In items of two or more chunks the chunks go in pairs: loaded together, one atomic
  for the pair's base and one arrival per pair (both measured faster; docs/performance.md). The
  per-row workspace (arrival counters, candidate count, group maxima) MUST be zero at
  launch: the path zeroes it itself, unconditionally, right before the first kernel
  (docs/design.md, invariant 2), so any graph that captures the call records the zeroing. Stale
  counters are detected (an arrival count past the row's chunks or pairs) and the row is
  written as all -2, a detectable error value.
* torch: the plain-PyTorch reference (`ref.py`, stable sort), exact tie rule, slow.

Modules: `plan` (constants, block and chunk sizes, the "auto" path), `ref`, `search` (the Triton
building blocks both paths share), `standard`, `persistent`, `indexer_topk` (the engine object).

Roofline (bytes per row): the scores must be read once, 4n bytes (1 x 256K: 1 MiB, 0.25 us
at 4.2 TB/s), plus 4k bytes of output. Both paths read each row twice (bound, compact),
8n bytes, plus ~8 bytes per candidate written and read back (~8-11k bytes); the persistent
path's second read hits L2 when the rows fit in it (50 MiB). Rows with ties at T read up to
the needed ties a third time; overflowing rows (total > C) read the row five more times.
Few rows are latency-bound (launches, the bound and select searches: block reductions in
one program), many rows bandwidth-bound (the two reads).
"""
from __future__ import annotations

from .indexer_topk import IndexerTopK, topk_indices
from .plan import (_AUTO_MAX_ROWS_PERSISTENT, BACKENDS, BOUND_CHUNK_MAX, LB_STEPS, _bound_chunk, _persistent_config,
                   auto_path)
from .ref import topk_indices_ref

__all__ = ["BACKENDS", "BOUND_CHUNK_MAX", "LB_STEPS", "IndexerTopK", "auto_path", "topk_indices", "topk_indices_ref"]
