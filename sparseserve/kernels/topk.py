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
branch and no allocation, so it can be captured in a CUDA graph (DESIGN.md invariant 1).
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
  gathers when no tie straddles the k-th score (8 x 256K, k = 1024: 36.7 -> 34.2 us), else
  by reordering the buffer through memory first. In items of two or more chunks the chunks go in pairs: loaded together,
  one atomic for the pair's base and one arrival per pair (64 x 256K: 147 -> 139 us). The
  per-row workspace (arrival counters, candidate count, group maxima) MUST be zero at
  launch: the path zeroes it itself, unconditionally, right before the first kernel
  (DESIGN.md invariant 2), so any graph that captures the call records the zeroing. Stale
  counters are detected (an arrival count past the row's chunks or pairs) and the row is
  written as all -2, a detectable error value.
* torch: the plain-PyTorch reference below (stable sort), exact tie rule, slow.

Roofline (bytes per row): the scores must be read once, 4n bytes (1 x 256K: 1 MiB, 0.25 us
at 4.2 TB/s), plus 4k bytes of output. Both paths read each row twice (bound, compact),
8n bytes, plus ~8 bytes per candidate written and read back (~8-11k bytes); the persistent
path's second read hits L2 when the rows fit in it (50 MiB). Rows with ties at T read up to
the needed ties a third time; overflowing rows (total > C) read the row five more times.
Few rows are latency-bound (launches, the bound and select searches: block reductions in
one program), many rows bandwidth-bound (the two reads).
"""
from __future__ import annotations

import torch

try:  # Triton is optional on the CPU path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False

from .. import envs  # noqa: E402
from .dispatch import num_sms  # noqa: E402
from .pdl import pdl_args, wait_for_prior_grid  # noqa: E402 (after the optional Triton import)

BACKENDS = ("auto", "standard", "persistent", "torch")

# Persistent workspace, per row (int32, zeroed every call): two arrival counters, the
# candidate count, the bound, then the G group maxima.
WS_ARRIVE1, WS_ARRIVE2, WS_TOTAL, WS_BOUND, WS_GMAX = 0, 1, 2, 3, 16
LB_STEPS = 8  # the bound's search: 2 bits per step, so the top 16 bits of the key
FALLBACK_BLOCK = 1024  # the exact fallback's block (small: its histograms are register-hungry)
STD_PROGRAMS_PER_SM = 2  # standard-path grid cap (and candidate buffers) per SM
# Persistent-path grid cap per SM. Two, although the select kernel's registers fit one program
# per SM: at 8 x 256K (256 chunks) the second program of an SM is queued as its own item rather
# than looped over, and the call took 33.8 instead of 44.7 us (session 6, tools/topk_phases.py).
PERSISTENT_PROGRAMS_PER_SM = 2
BOUND_CHUNK_MAX = 32768  # the persistent bound kernel's longest chunk (see _bound_chunk)
KEY_NEG_INF = -2139095041  # the int32 key of -inf

# "auto" crossover (docs/performance.md; `topk_bench --sweep-ks 512,1024` prints the suggestion): the
# persistent path is picked when a step has at most this many rows for its padded width (width limits
# ascending; the last is unbounded), i.e. where it was >= 1.3x faster than the standard path at every
# row count up to the limit in the sweep, at k = 512 and 1024 (graph replay; one H200, 2026-11-30
# 05:01 UTC, session 14's kernels). Up to 16K columns it never was. 64 rows pass at 128K columns
# (1.39x / 1.36x) but not at 64K (1.27x / 1.20x), so widths between keep 32.
_AUTO_MAX_ROWS_PERSISTENT = ((16384, 0), (32768, 16), (131071, 32), (1 << 62, 64))


def topk_indices_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path)."""
    num_rows, width = scores.shape
    columns = torch.arange(width, device=scores.device)
    valid = columns.unsqueeze(0) < lengths.long().unsqueeze(1)
    masked = scores.float().masked_fill(~valid, float("-inf"))
    k_eff = min(k, width)
    # A stable descending sort keeps the lower index first among equal scores.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k_eff]
    slot = torch.arange(k_eff, device=scores.device).unsqueeze(0)
    order = torch.where(slot < lengths.long().clamp(max=k_eff).unsqueeze(1), order, torch.full_like(order, -1))
    out = torch.full((num_rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :k_eff] = order.to(torch.int32)
    return out


if _HAVE_TRITON:
    _NEG_INF_KEY = tl.constexpr(KEY_NEG_INF)
    _KEY_MIN = tl.constexpr(-2147483648)  # u = key - _KEY_MIN maps int32 keys onto [0, 2**32)
    _WS_ARRIVE1 = tl.constexpr(WS_ARRIVE1)
    _WS_ARRIVE2 = tl.constexpr(WS_ARRIVE2)
    _WS_TOTAL = tl.constexpr(WS_TOTAL)
    _WS_BOUND = tl.constexpr(WS_BOUND)
    _WS_GMAX = tl.constexpr(WS_GMAX)


# ----------------------------------------------------------------------------- Triton
if _HAVE_TRITON:

    @triton.jit
    def _keys(x):
        """fp32 -> int32 key whose signed order is the float order (-0.0 folded into +0.0)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _key_float(key):
        """int32 key -> fp32 (the inverse of _keys; key -1 decodes to -0.0)."""
        return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _search_steps(key, K, STEPS: tl.constexpr, low_key, high_key, n_counted):
        """(res, at_res): the largest res (u-space [0, 2**32), only its top 2*STEPS bits set) with
        count(key - KEY_MIN >= res) >= K, or the first res met with exactly K keys >= it, where the
        search stops early (at_res == K: those K keys are the top K, whatever their ties). On
        continuous scores the exact search (STEPS = 16) stops after ~10 steps; each step costs
        ~0.4 us on the H200. at_res: the count at res, kept exact from the start, so whether the
        search stops early depends on the keys only (at the K-th largest key T the count is K
        exactly when no tie straddles T), never on where it started. With STEPS = 16 and
        at_res != K, res is the K-th largest u exactly.

        key: int32 order-preserving keys (lanes to ignore hold KEY_MIN, below every res >= 1).
        low_key <= every counted key <= high_key: the bits the two share are the answer's, so
        the search starts below them. n_counted: how many keys lie in [low_key, high_key] (the
        rest hold KEY_MIN). Two bits per step: the three thresholds are compared in
        int32, and each key adds its level (how many thresholds it reaches) to three 21-bit
        counters packed in one int64, so a step costs a single block reduction. (A tuple
        reduction of two int32 counters would be leaner on the GPU, but the CPU interpreter runs
        custom reductions element by element, 40x slower.)
        """
        diff = (low_key ^ high_key).to(tl.int64) & 0xFFFFFFFF
        start = 0
        for i in tl.static_range(STEPS):
            if diff < (1 << (30 - 2 * i)):  # bits 31 - 2i and 30 - 2i are the same in low and high
                start = i + 1
        shared = (tl.full([], 1, tl.int64) << (32 - 2 * start)) - 1
        res = (high_key.to(tl.int64) - _KEY_MIN) & ~shared
        level0 = tl.full([], 0, tl.int64)
        level1 = tl.full([], 1, tl.int64)
        level2 = tl.full([], 1 + (1 << 21), tl.int64)
        level3 = tl.full([], 1 + (1 << 21) + (1 << 42), tl.int64)
        # Every counted key reaches the start; at u = 0 the ignored lanes do too.
        at_res = tl.where(res > 0, n_counted, key.numel).to(tl.int64)
        for i in range(STEPS):
            if i >= start:
                if at_res != K:
                    unit = tl.full([], 1, tl.int64) << (30 - 2 * i)  # int64 (3 << 30 is no int32)
                    t1 = (res + unit + _KEY_MIN).to(tl.int32)
                    t2 = (res + 2 * unit + _KEY_MIN).to(tl.int32)
                    t3 = (res + 3 * unit + _KEY_MIN).to(tl.int32)
                    level = tl.where(key >= t3, level3,
                                     tl.where(key >= t2, level2, tl.where(key >= t1, level1, level0)))
                    s = tl.sum(level, axis=0)
                    c1 = s & 0x1FFFFF
                    c2 = (s >> 21) & 0x1FFFFF
                    c3 = s >> 42
                    d = tl.where(c3 >= K, 3, tl.where(c2 >= K, 2, tl.where(c1 >= K, 1, 0)))
                    res = res + d.to(tl.int64) * unit
                    at_res = tl.where(d == 3, c3, tl.where(d == 2, c2, tl.where(d == 1, c1, at_res)))
        return res, at_res

    @triton.jit
    def _bound_search(key, K, STEPS: tl.constexpr):
        """A lower bound (u-space) of the K-th largest key, every int32 key possible: the
        STEPS-step search, or after an early stop the K-th largest itself (the minimum of the K
        keys that reach res: one reduction, and a tighter bound than res)."""
        res, at_res = _search_steps(key, K, STEPS, tl.full([], -2147483648, tl.int32),
                                    tl.full([], 2147483647, tl.int32), key.numel)
        if at_res == K:
            kth = tl.min(tl.where(key >= (res + _KEY_MIN).to(tl.int32), key, 2147483647), axis=0)
            res = kth.to(tl.int64) - _KEY_MIN
        return res

    @triton.jit
    def _bound_key(u_res):
        """Lower-bound key from a _bound_search result (u-space), clamped to the key of -inf."""
        return tl.maximum(u_res + _KEY_MIN, _NEG_INF_KEY).to(tl.int32)

    @triton.jit
    def _kth_search(key, n_valid, K, lo, STEPS: tl.constexpr):
        """The exact search over a block of n_valid >= K keys of scores > lo (the other lanes
        hold KEY_MIN): (t, exact_set) with t an int32 key. exact_set: the K keys >= t are the
        top K (the usual case; no tie to break); else t is the K-th largest key (ties straddle
        it). (STEPS < 16 only in timing experiments: the result is then not exact.)"""
        high = tl.max(key, axis=0)
        res, at_res = _search_steps(key, K, STEPS, _keys(lo), high, n_valid)
        return (res + _KEY_MIN).to(tl.int32), at_res == K

    @triton.jit
    def _write_set(sel, idx, orow):
        """Write the selected entries of one index-ordered block to slots 0.. in index order."""
        rank = tl.cumsum(sel.to(tl.int32), axis=0)
        tl.store(orow + rank - 1, idx, mask=sel)

    @triton.jit
    def _load_scores(ptr, c, s, n, BLOCK: tl.constexpr):
        """Scores ptr[c] for c = s + arange(BLOCK); -inf at columns >= n. Whole blocks load
        without a mask, so that the loads are 16-byte vectors."""
        if s + BLOCK <= n:
            x = tl.load(ptr + c)
        else:
            x = tl.load(ptr + c, mask=c < n, other=float("-inf"))
        return x

    @triton.jit
    def _compact(x, c, lo, total, cv, ci, C: tl.constexpr):
        """Append the entries x > lo (value, column) at cv/ci[total:] in index order; new total."""
        gt = x > lo  # -inf past the length never passes
        g32 = gt.to(tl.int32)
        count = tl.sum(g32, axis=0)
        if count > 0:
            rank = total + tl.cumsum(g32, axis=0) - 1
            keep = gt & (rank < C)
            tl.store(cv + rank, x, mask=keep)
            tl.store(ci + rank, c, mask=keep)
        return total + count

    @triton.jit
    def _select_write(key, idx, t, exact_set, K, orow):
        """Write the top K of one index-ordered block of keys (from _kth_search's t and
        exact_set) to slots 0.. in index order. Ignored lanes hold KEY_MIN, below every t here
        (t is a candidate's key, or a search threshold >= 1 in u-space)."""
        if exact_set:
            sel = key >= t
        else:  # ties straddle the K-th key t: the entries above it, then the lowest-index ties
            is_gt = key > t
            is_eq = key == t
            n_gt = tl.sum(is_gt.to(tl.int32), axis=0)
            rank_eq = tl.cumsum(is_eq.to(tl.int32), axis=0)
            sel = is_gt | (is_eq & (rank_eq <= K - n_gt))
        _write_set(sel, idx, orow)

    @triton.jit
    def _select_buffer(cv, ci, total, lo, orow, K, ONE, B: tl.constexpr):
        """Write a row from its first `total` (K <= total <= B) index-ordered candidates (each > lo)."""
        p = tl.arange(0, B) * ONE
        pm = p < total
        key = tl.where(pm, _keys(tl.load(cv + p, mask=pm, other=0.0)), _KEY_MIN)
        t, exact_set = _kth_search(key, total, K, lo, 16)
        idx = tl.load(ci + p, mask=pm, other=0)  # after the search: fewer live registers in it
        _select_write(key, idx, t, exact_set, K, orow)

    @triton.jit
    def _write_chosen(srow, offs, n, thr, need_eq, orow, K, THROUGH_TIES: tl.constexpr, BLOCK: tl.constexpr):
        """A scan of the row from column 0 that writes its entries > thr and its first need_eq
        entries == thr (the lower indices win) to slots 0.. in index order. It stops once K slots
        are written or, with THROUGH_TIES (rows whose K-th score is the bound thr itself and whose
        candidates > thr are in a buffer; need_eq >= 1), at the end of the block that holds the
        need_eq-th tie: ties are dense in such rows, so it stops early, and the caller writes the
        candidates it did not pass (index-order position i) to slot need_eq + i. Returns how many
        entries > thr it wrote. offs: arange(BLOCK) in the scan/scatter layout (see ONE)."""
        run = 0
        run_eq = 0
        n_gt = 0
        for s in range(0, n, BLOCK):
            if (run_eq < need_eq) if THROUGH_TIES else (run < K):
                c = s + offs
                m = c < n
                x = tl.load(srow + c, mask=m, other=0.0)
                is_gt = m & (x > thr)
                is_eq = m & (x == thr)
                rank_eq = run_eq + tl.cumsum(is_eq.to(tl.int32), axis=0)
                sel = is_gt | (is_eq & (rank_eq <= need_eq))
                rank = run + tl.cumsum(sel.to(tl.int32), axis=0)
                tl.store(orow + rank - 1, c, mask=sel)
                run += tl.sum(sel.to(tl.int32), axis=0)
                run_eq += tl.sum(is_eq.to(tl.int32), axis=0)
                n_gt += tl.sum(is_gt.to(tl.int32), axis=0)
        return n_gt

    @triton.jit
    def _fill(out_row, lo, hi, value, K: tl.constexpr, FB: tl.constexpr):
        """out_row[lo:hi] = value (hi <= K)."""
        for s in range(0, K, FB):
            o = s + tl.arange(0, FB)
            tl.store(out_row + o, tl.full([FB], value, tl.int32), mask=(o >= lo) & (o < hi))

    # ---- the exact fallback (radix select, one byte per pass): rows whose candidates overflow

    @triton.jit
    def _digit(key, LEVEL: tl.constexpr):
        """The LEVEL-th byte of the key (0 = top, signed, shifted to 0..255)."""
        if LEVEL == 0:
            return (key >> 24) + 128
        else:
            return (key >> (24 - 8 * LEVEL)) & 255

    @triton.jit
    def _pick_digit(h, kr):
        """Largest bin d whose suffix count reaches kr; also the count above d."""
        bins = tl.arange(0, 256)
        total = tl.sum(h, axis=0)
        suffix = total - tl.cumsum(h, axis=0) + h  # entries in bins >= b
        d = tl.max(tl.where(suffix >= kr, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > d, h, 0), axis=0)
        return d, above

    @triton.jit
    def _extend(prefix, d, LEVEL: tl.constexpr):
        """Append digit d (chosen at LEVEL) to the signed prefix."""
        if LEVEL == 0:
            return d - 128
        else:
            return prefix * 256 + d

    @triton.jit
    def _row_hist(srow, n, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram of byte LEVEL over the row's valid entries whose higher bytes equal prefix."""
        offs = tl.arange(0, BLOCK)
        h = tl.zeros([256], dtype=tl.int32)
        for s in range(0, n, BLOCK):
            c = s + offs
            m = c < n
            key = _keys(tl.load(srow + c, mask=m, other=0.0))
            if LEVEL == 0:
                h += tl.histogram(_digit(key, 0), 256, mask=m)
            else:
                m = m & ((key >> (32 - 8 * LEVEL)) == prefix)
                if tl.sum(m.to(tl.int32), axis=0) > 0:
                    h += tl.histogram(_digit(key, LEVEL), 256, mask=m)
        return h

    @triton.jit
    def _exact_row(srow, n, orow, K: tl.constexpr, BLOCK: tl.constexpr):
        """Exact top-K of one row by one program: four histogram passes, then a write pass."""
        h = _row_hist(srow, n, 0, 0, BLOCK)
        d, above = _pick_digit(h, K)
        prefix = _extend(0, d, 0)
        kr = K - above
        h = _row_hist(srow, n, prefix, 1, BLOCK)
        d, above = _pick_digit(h, kr)
        prefix = _extend(prefix, d, 1)
        kr = kr - above
        h = _row_hist(srow, n, prefix, 2, BLOCK)
        d, above = _pick_digit(h, kr)
        prefix = _extend(prefix, d, 2)
        kr = kr - above
        h = _row_hist(srow, n, prefix, 3, BLOCK)
        d, above = _pick_digit(h, kr)
        thr = _key_float(_extend(prefix, d, 3))  # the K-th largest score
        _write_chosen(srow, tl.arange(0, BLOCK), n, thr, kr - above, orow, K, False, BLOCK)

    # ---- standard path: one program per row (grid-stride when rows exceed the grid)

    @triton.jit(do_not_specialize=["R", "W", "ONE"])
    def _topk_standard_kernel(
        scores_ptr, stride_s, lengths_ptr, out_ptr, stride_o, cand_v_ptr, cand_i_ptr, R, W,
        ONE,
        K: tl.constexpr, BLOCK: tl.constexpr, C: tl.constexpr, FB: tl.constexpr, LB_STEPS: tl.constexpr,
        FALLBACK_BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """ONE: a runtime 1. Offsets multiplied by it look non-contiguous to Triton's axis
        analysis, so the loads that feed a scan and a scatter store get the scatter's layout
        (one element per thread) instead of 16-byte vectors: no shared-memory layout
        conversion per block (on Triton 3.6 those cost several us per 4K block). Pass 1 uses
        them too: the coalescing pass gives all memory ops of one def-use slice the widest
        vector found among them."""
        wait_for_prior_grid(PDL)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs1 = tl.arange(0, BLOCK) * ONE
        cv = cand_v_ptr + tl.cast(pid, tl.int64) * C
        ci = cand_i_ptr + tl.cast(pid, tl.int64) * C
        for row in range(pid, R, nprog):
            row64 = tl.cast(row, tl.int64)
            srow = scores_ptr + row64 * stride_s
            orow = out_ptr + row64 * stride_o
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                # Pass 1: maxima of the BLOCK strided groups (column mod BLOCK). The K-th largest
                # group maximum is a lower bound of the K-th largest score (K groups reach it).
                gmax = tl.full([BLOCK], float("-inf"), tl.float32)
                for s in range(0, n, 2 * BLOCK):  # two blocks per step: more loads in flight
                    x0 = _load_scores(srow, s + offs1, s, n, BLOCK)
                    x1 = _load_scores(srow, s + BLOCK + offs1, s + BLOCK, n, BLOCK)
                    gmax = tl.maximum(gmax, tl.maximum(x0, x1))
                lo = _key_float(_bound_key(_bound_search(_keys(gmax), K, LB_STEPS)))
                # Pass 2: compact the entries above the bound, in index order.
                total = 0
                tl.debug_barrier()  # the previous row's reads of the candidate buffer are done
                for s in range(0, n, 2 * BLOCK):
                    x0 = _load_scores(srow, s + offs1, s, n, BLOCK)
                    x1 = _load_scores(srow, s + BLOCK + offs1, s + BLOCK, n, BLOCK)
                    total = _compact(x0, s + offs1, lo, total, cv, ci, C)
                    total = _compact(x1, s + BLOCK + offs1, lo, total, cv, ci, C)
                tl.debug_barrier()
                if total > C:
                    _exact_row(srow, n, orow, K, FALLBACK_BLOCK)  # too many candidates: exact, slow
                elif total < K:
                    # The K-th score is the bound itself: the first ties by a scan, the candidates
                    # (> lo, index order in the buffer) that the scan did not reach after them.
                    passed = _write_chosen(srow, offs1, n, lo, K - total, orow, K, True, BLOCK)
                    p = tl.arange(0, C) * ONE
                    rest = (p >= passed) & (p < total)
                    tl.store(orow + (K - total) + p, tl.load(ci + p, mask=rest, other=0), mask=rest)
                elif total <= C // 2:
                    # The usual case (about 1.25 K candidates): half the block, half the select's work.
                    _select_buffer(cv, ci, total, lo, orow, K, ONE, C // 2)
                else:
                    _select_buffer(cv, ci, total, lo, orow, K, ONE, C)
            else:
                # Every valid entry is chosen: slot j holds column j; the rest is -1.
                for s in range(0, K, FB):
                    o = s + tl.arange(0, FB)
                    tl.store(orow + o, tl.where(o < n, o, -1), mask=o < K)

    # ---- persistent path: a resident grid looping over (row, chunk) items, two launches.

    @triton.jit(do_not_specialize=["W", "n_items", "CPR"])
    def _p_bound_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, LB_STEPS: tl.constexpr,
    ):
        """Launch 1: strided group maxima of every long row (atomic max into the zeroed
        workspace); the last chunk of a row to arrive turns them into the row's lower bound."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        gidx = tl.arange(0, G)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            start = (item % CPR) * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                wrow = ws_ptr + row.to(tl.int64) * WS
                if start < n:
                    x = _load_scores(scores_ptr + row.to(tl.int64) * stride_s, start + offs, start, n, CHUNK)
                    gm = tl.max(tl.reshape(x, [CHUNK // G, G]), axis=0)
                    # (key >> 1) + 2**30: monotone, >= 0, so zeroed counters mean "below everything".
                    mk = (_keys(gm) >> 1) + 1073741824
                    tl.atomic_max(wrow + _WS_GMAX + gidx, mk, mask=gm > float("-inf"), sem="relaxed")
                tl.debug_barrier()
                arrived = tl.atomic_add(wrow + _WS_ARRIVE1, 1, sem="acq_rel")
                if arrived % CPR == CPR - 1:
                    mk = tl.load(wrow + _WS_GMAX + gidx, cache_modifier=".cg")
                    # 2 * mk + KEY_MIN is a key <= the group's maximum (KEY_MIN: an empty group).
                    key = (mk.to(tl.int64) * 2 + _KEY_MIN).to(tl.int32)
                    tl.store(wrow + _WS_BOUND, _bound_key(_bound_search(key, K, LB_STEPS)))

    @triton.jit
    def _p_index_order(cnt, bas, first, cidx, cm, cinfo_ptr, idx, total, p, CHUNK: tl.constexpr):
        """(pos, pm): the index-order position of every candidate in the buffer (its rank in its
        chunk's run plus the candidates of the earlier chunks, through the chunk records in
        memory), and the mask of the buffer's first `total` slots."""
        tl.store(cinfo_ptr + (first + cidx) * 4 + 3, tl.cumsum(cnt, axis=0) - cnt - bas, mask=cm)
        tl.debug_barrier()
        pm = p < total
        return p + tl.load(cinfo_ptr + (first + idx // CHUNK) * 4 + 3, mask=pm, other=0, cache_modifier=".cg"), pm

    @triton.jit
    def _p_reorder_write(v, idx, pos, pm, p, t, exact_set, cv, ci, orow, K):
        """Put the candidates in index order in the buffer (in place), then write the top K."""
        tl.debug_barrier()
        tl.store(cv + pos, v, mask=pm)
        tl.store(ci + pos, idx, mask=pm)
        tl.debug_barrier()
        key = tl.where(pm, _keys(tl.load(cv + p, mask=pm, other=0.0, cache_modifier=".cg")), _KEY_MIN)
        idx = tl.load(ci + p, mask=pm, other=0, cache_modifier=".cg")
        _select_write(key, idx, t, exact_set, K, orow)

    @triton.jit
    def _p_write_by_records(v, idx, pm, t, cnt, bas, orow, B: tl.constexpr, CHUNK: tl.constexpr):
        """Write the candidates with key >= t (exactly the top K) to slots 0.. in index order,
        straight from buffer order: a chunk's candidates are one run, in index order, from its
        base, so a candidate's slot is the selected count of the earlier chunks (record order is
        index order) plus its rank among the selected of its run. Two in-register gathers instead
        of a round trip of the buffer through memory."""
        sel = pm & (_keys(v) >= t)
        s32 = sel.to(tl.int32)
        incl = tl.cumsum(s32, axis=0)  # buffer order
        excl = incl - s32
        has = cnt > 0
        start = tl.minimum(tl.where(has, bas, 0), B - 1)
        last = tl.minimum(tl.where(has, bas + cnt - 1, 0), B - 1)
        before_run = tl.gather(excl, start, 0)  # selected before the run's start, in buffer order
        run_sel = tl.where(has, tl.gather(incl, last, 0) - before_run, 0)
        shift = tl.cumsum(run_sel, axis=0) - run_sel - before_run  # per chunk: slot = shift + excl
        chunk = tl.minimum(tl.maximum(idx // CHUNK, 0), cnt.numel - 1)  # (lanes past the total hold garbage)
        slot = tl.gather(shift, chunk, 0) + excl
        tl.store(orow + slot, idx, mask=sel)

    @triton.jit
    def _p_finish(v, idx, total, cnt, bas, first, cidx, cm, cinfo_ptr, cv, ci, srow, orow, n, lo, K, offs, ONE,
                  CHUNK: tl.constexpr, B: tl.constexpr, EXACT_STEPS: tl.constexpr, GATHER: tl.constexpr):
        """The persistent path's row finish, by the row's last chunk: its `total` <= B candidates
        (v, idx: the buffer's first B slots; chunk runs in arrival order) are put in index order,
        the top K are found among them and written in index order. GATHER (the default): where no tie
        straddles the K-th score, write them straight from buffer order (_p_write_by_records), which
        skips the reordering through memory."""
        p = tl.arange(0, B) * ONE
        if GATHER:
            if total < K:
                pos, pm = _p_index_order(cnt, bas, first, cidx, cm, cinfo_ptr, idx, total, p, CHUNK)
                _p_write_bound_ties(srow, offs, n, lo, total, idx, pos, pm, orow, K, CHUNK)
            else:
                pm = p < total
                t, exact_set = _kth_search(tl.where(pm, _keys(v), _KEY_MIN), total, K, lo, EXACT_STEPS)
                if exact_set:
                    _p_write_by_records(v, idx, pm, t, cnt, bas, orow, B, CHUNK)
                else:
                    pos, pm = _p_index_order(cnt, bas, first, cidx, cm, cinfo_ptr, idx, total, p, CHUNK)
                    _p_reorder_write(v, idx, pos, pm, p, t, exact_set, cv, ci, orow, K)
        else:
            pos, pm = _p_index_order(cnt, bas, first, cidx, cm, cinfo_ptr, idx, total, p, CHUNK)  # overlaps the search
            if total < K:
                _p_write_bound_ties(srow, offs, n, lo, total, idx, pos, pm, orow, K, CHUNK)
            else:
                t, exact_set = _kth_search(tl.where(pm, _keys(v), _KEY_MIN), total, K, lo, EXACT_STEPS)
                _p_reorder_write(v, idx, pos, pm, p, t, exact_set, cv, ci, orow, K)

    @triton.jit
    def _p_write_bound_ties(srow, offs, n, lo, total, idx, pos, pm, orow, K, CHUNK: tl.constexpr):
        """Rows whose K-th score is the bound itself (rare: many equal scores): the first ties by a
        scan of the row, then the candidates (index-order positions pos) that the scan did not reach."""
        passed = _write_chosen(srow, offs, n, lo, K - total, orow, K, True, CHUNK)
        tl.store(orow + (K - total) + pos, idx, mask=pm & (pos >= passed))

    @triton.jit
    def _p_compact_store(x, c, g32, base, cv, ci, C: tl.constexpr):
        """Store one chunk's entries flagged in g32 (value, column) at cv/ci[base:], in index order."""
        rank = base + tl.cumsum(g32, axis=0) - 1
        keep = (g32 != 0) & (rank < C)
        tl.store(cv + rank, x, mask=keep)
        tl.store(ci + rank, c, mask=keep)

    @triton.jit
    def _p_select_unit(scores_ptr, stride_s, lengths_ptr, ws_ptr, cinfo_ptr, cand_v_ptr, cand_i_ptr, out_ptr, stride_o,
                       W, CPR, UPR, row, chunk, offs, p, cidx, ONE, K: tl.constexpr, CHUNK: tl.constexpr,
                       WS: tl.constexpr, C: tl.constexpr, FB: tl.constexpr, FALLBACK_BLOCK: tl.constexpr,
                       EXACT_STEPS: tl.constexpr, PAIR: tl.constexpr, GATHER: tl.constexpr):
        """One arrival unit of the select launch (see _p_select_kernel): PAIR adjacent chunks from
        `chunk` (the second may lie past the row: it is all -inf then), loaded together, one atomic
        for their candidates' base and one arrival (UPR units per row); the last unit of the row to
        arrive finishes it. Every chunk keeps its own (count, base) record."""
        start = chunk * CHUNK
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
        srow = scores_ptr + row.to(tl.int64) * stride_s
        orow = out_ptr + row.to(tl.int64) * stride_o
        c = start + offs
        c2 = c + CHUNK
        if n > K:
            wrow = ws_ptr + row.to(tl.int64) * WS
            cv = cand_v_ptr + row.to(tl.int64) * C
            ci = cand_i_ptr + row.to(tl.int64) * C
            info = cinfo_ptr + (row.to(tl.int64) * CPR + chunk) * 4
            lo = _key_float(tl.load(wrow + _WS_BOUND))
            x = _load_scores(srow, c, start, n, CHUNK)
            g32 = (x > lo).to(tl.int32)  # -inf past n never passes
            count = tl.sum(g32, axis=0)
            if PAIR == 2:
                x2 = _load_scores(srow, c2, start + CHUNK, n, CHUNK)
                g2 = (x2 > lo).to(tl.int32)
                count2 = tl.sum(g2, axis=0)
                base = tl.atomic_add(wrow + _WS_TOTAL, count + count2, sem="relaxed")
            else:
                base = tl.atomic_add(wrow + _WS_TOTAL, count, sem="relaxed")
            _p_compact_store(x, c, g32, base, cv, ci, C)
            tl.store(info, count)
            tl.store(info + 1, base)
            if PAIR == 2:
                _p_compact_store(x2, c2, g2, base + count, cv, ci, C)
                if chunk + 1 < CPR:  # (past the row, the record would be the next row's)
                    tl.store(info + 4, count2)
                    tl.store(info + 5, base + count)
            tl.debug_barrier()
            arrived = tl.atomic_add(wrow + _WS_ARRIVE2, 1, sem="acq_rel")
            if arrived % UPR == UPR - 1:
                if arrived >= UPR:
                    # Counters were not zero at launch: poison the row (detectable, never a hang).
                    _fill(orow, 0, K, -2, K, FB)
                else:
                    # Independent loads first (one round trip): the count, the chunk records
                    # and the buffer's first half (slots past the count are masked later).
                    first = row.to(tl.int64) * CPR
                    cm = cidx < CPR
                    total = tl.load(wrow + _WS_TOTAL, cache_modifier=".cg")
                    cnt = tl.load(cinfo_ptr + (first + cidx) * 4, mask=cm, other=0, cache_modifier=".cg")
                    bas = tl.load(cinfo_ptr + (first + cidx) * 4 + 1, mask=cm, other=0, cache_modifier=".cg")
                    ph = tl.arange(0, C // 2) * ONE
                    v = tl.load(cv + ph, cache_modifier=".cg")
                    idx = tl.load(ci + ph, cache_modifier=".cg")
                    if total <= C // 2:
                        # The usual case (about 1.25 K candidates): half the block, half the work.
                        _p_finish(v, idx, total, cnt, bas, first, cidx, cm, cinfo_ptr, cv, ci, srow, orow, n, lo,
                                  K, offs, ONE, CHUNK, C // 2, EXACT_STEPS, GATHER)
                    elif total <= C:
                        v_all = tl.load(cv + p, cache_modifier=".cg")
                        idx_all = tl.load(ci + p, cache_modifier=".cg")
                        _p_finish(v_all, idx_all, total, cnt, bas, first, cidx, cm, cinfo_ptr, cv, ci, srow, orow, n, lo,
                                  K, offs, ONE, CHUNK, C, EXACT_STEPS, GATHER)
                    else:
                        _exact_row(srow, n, orow, K, FALLBACK_BLOCK)  # too many candidates: exact, slow
        else:
            # Every valid entry is chosen: slot j holds column j.
            tl.store(orow + c, c, mask=c < n)
            if PAIR == 2:
                tl.store(orow + c2, c2, mask=c2 < n)
            if chunk == 0:
                _fill(orow, n, K, -1, K, FB)

    @triton.jit(do_not_specialize=["W", "n_items", "CPR", "UPR", "IPR", "SUB", "ONE"])
    def _p_select_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, cinfo_ptr, cand_v_ptr, cand_i_ptr, out_ptr, stride_o,
        W, n_items, CPR, UPR, IPR, SUB,
        ONE,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr, C: tl.constexpr, CPR_P2: tl.constexpr,
        FB: tl.constexpr, FALLBACK_BLOCK: tl.constexpr, EXACT_STEPS: tl.constexpr, PAIR: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        """Launch 2: every chunk compacts its entries above the row's bound into the row's
        candidate buffer (at a base taken with an atomic); the last unit of the row to arrive
        puts the candidates in index order, selects the K-th score among them and writes the row.
        A unit is PAIR adjacent chunks (UPR units per row); an item is SUB adjacent units of one
        row (IPR items per row), done one after another."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK) * ONE  # one layout for load, scan and scatter (see the standard kernel)
        p = tl.arange(0, C) * ONE
        cidx = tl.arange(0, CPR_P2)
        for item in range(pid, n_items, nprog):
            row = item // IPR
            for sub in range(SUB):
                unit = (item % IPR) * SUB + sub
                if unit < UPR:
                    _p_select_unit(scores_ptr, stride_s, lengths_ptr, ws_ptr, cinfo_ptr, cand_v_ptr, cand_i_ptr,
                                   out_ptr, stride_o, W, CPR, UPR, row, unit * PAIR, offs, p, cidx, ONE, K, CHUNK, WS,
                                   C, FB, FALLBACK_BLOCK, EXACT_STEPS, PAIR, GATHER)

# ----------------------------------------------------------------------------- planning


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _capacity(k: int) -> int:
    """Candidate buffer entries per row (a power of two >= 4k)."""
    return _next_pow2(max(4 * k, 1024))


def _persistent_groups(k: int) -> int:
    """G of the persistent path: strided groups per row (>= k so that the bound exists).
    Not G = k: the k-th largest of k maxima is their minimum, far below the k-th score, and
    rows overflow to the exact fallback (measured in session 6: 1 x 256K, k = 1024, 1,280 us
    instead of 26 us)."""
    return _next_pow2(max(2 * k, 1024))


def _warps(tile: int, cap: int) -> int:
    """Warps per program (H200: 8 beat 16 for 4K-8K tiles, and 4 for 2K chunks)."""
    return 8 if tile >= 2048 or cap >= 4096 else 4


def _standard_config(width: int, k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for the standard kernel, from the static width (BLOCK = G >= k).
    4096, not 8192: as fast at 256K columns, faster at 8K (more rows in flight per SM)."""
    block = max(min(4096, max(1024, _next_pow2(width))), _next_pow2(k))
    return block, _warps(block, _capacity(k))


def _persistent_config(rows: int, width: int, resident_programs: int, k: int) -> tuple[int, int, int, int]:
    """(CHUNK, chunks_per_row, chunks_per_item, num_warps) of the select kernel: about one item
    per resident program (its registers fit one per SM), chunks of 4K..8K (4K chunks beat 1K-2K
    ones at 1 x 256K: fewer items, fewer atomics per row). 8 x 128K: 8K chunks, one wave, 24.1 us;
    4K chunks, two waves, 28.6 us (session 6). Where 8K chunks still make more items than
    resident programs (8 x 256K: 256 for 132 SMs), an item is several adjacent chunks of one
    row, done in turn, so the grid is one wave: in a second wave the rows whose last chunk
    arrives late start their finish (~8 us in one program) only after it (session 12's phases)."""
    groups = _persistent_groups(k)
    resident = max(1, resident_programs)
    target = -(-rows * width // resident)
    chunk = max(groups, min(8192, max(4096, _next_pow2(target))))
    cpr = -(-width // chunk)
    per_item = -(-rows * cpr // resident)
    return chunk, cpr, min(per_item, cpr), _warps(chunk, _capacity(k))


def _bound_chunk(width: int, k: int, rows: int = 1, programs: int = 1 << 30, limit: int = BOUND_CHUNK_MAX) -> int:
    """CHUNK of the bound kernel: 16K columns, or up to `limit` where 16K chunks would make more
    items than `programs` (the grid). Every chunk does G atomic maxima into its row's workspace,
    and the atomics on the same G words contend, so fewer, longer chunks win (session 6: 8 x 256K
    9.6 -> 7.8 us, 1 x 256K 8.3 -> 6.1 us, 16K against 4K-8K chunks; session 14, L2 warm:
    64 x 256K 43.7 -> 31.4 us with 32K chunks, 153-162 registers, no spills; 64K chunks spill).
    With few rows, 32K chunks gained nothing with the scores in HBM (8 x 256K: 37.1 us either
    way) and halve the programs that read them."""
    groups = _persistent_groups(k)
    chunk = max(groups, min(16384, _next_pow2(width)))
    if rows * -(-width // chunk) > programs:
        chunk = max(groups, min(limit, _next_pow2(width)))
    return chunk


def auto_path(max_rows: int, max_width: int) -> str:
    """The path "auto" picks, from static facts only (never from lengths)."""
    for width_limit, rows_limit in _AUTO_MAX_ROWS_PERSISTENT:
        if max_width <= width_limit:
            return "persistent" if max_rows <= rows_limit else "standard"
    return "standard"


def _num_sms(device: torch.device) -> int:
    return num_sms(device, cpu_default=4)  # CPU under TRITON_INTERPRET=1: a few programs, to exercise the item loop


def _normalize_device(device: torch.device | str | None) -> torch.device:
    """'cuda' -> 'cuda:<current>', so that device checks compare like with like."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_triton_device(device: torch.device) -> None:
    if not _HAVE_TRITON:
        raise ValueError("the Triton top-k paths need triton installed; use backend='torch'")
    if device.type != "cuda" and not envs.triton_interpret():
        raise ValueError(
            f"the Triton top-k paths run on CUDA (or on the CPU under TRITON_INTERPRET=1); got device {device}"
        )


def _check_inputs(scores: torch.Tensor, lengths: torch.Tensor, max_rows: int, max_width: int) -> None:
    """Static (host-side, shape/dtype only) checks: no sync, fine inside graph capture."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [R, W], got {scores.dtype} {tuple(scores.shape)}")
    if scores.shape[1] > 0 and scores.stride(1) != 1:
        raise ValueError("scores rows must be contiguous (stride(1) == 1)")
    if lengths.dim() != 1 or lengths.dtype != torch.int32 or lengths.shape[0] != scores.shape[0]:
        raise ValueError(f"lengths must be int32 [R] with R = {scores.shape[0]}, got {lengths.dtype} {tuple(lengths.shape)}")
    if not lengths.is_contiguous():
        raise ValueError("lengths must be contiguous")
    if lengths.device != scores.device:
        raise ValueError(f"scores on {scores.device} but lengths on {lengths.device}")
    if scores.shape[0] > max_rows or scores.shape[1] > max_width:
        raise ValueError(
            f"scores {tuple(scores.shape)} exceed the preallocated max_rows={max_rows}, max_width={max_width}"
        )


# Standard-path candidate buffers, shared by the instances of one device (calls are
# stream-ordered, and every call writes the candidates it reads). Grown, never shrunk: an
# instance keeps the tensors it was built with, so captured graphs stay valid.
_SHARED_CANDIDATES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _shared_candidates(device: torch.device, programs: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), cap)
    have = _SHARED_CANDIDATES.get(key)
    if have is None or have[0].shape[0] < programs:
        have = (
            torch.empty((programs, cap), dtype=torch.float32, device=device),
            torch.empty((programs, cap), dtype=torch.int32, device=device),
        )
        _SHARED_CANDIDATES[key] = have
    return have


def _launch_standard(
    scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int, programs: int,
    cand_v: torch.Tensor, cand_i: torch.Tensor, block: int | None = None, cap: int | None = None,
    warps: int | None = None,
) -> None:
    rows, width = scores.shape
    if rows == 0:
        return
    cap = cap or _capacity(k)
    if block is None:
        block, default_warps = _standard_config(width, k)
    else:
        default_warps = _warps(block, cap)
    warps = warps or default_warps
    grid = min(rows, programs)
    assert cand_v.shape[0] >= grid and cand_v.shape[1] == cap and cand_i.shape == cand_v.shape
    _topk_standard_kernel[(grid,)](
        scores, scores.stride(0), lengths, out, out.stride(0), cand_v, cand_i, rows, width, 1,
        K=k, BLOCK=block, C=cap, FB=min(1024, _next_pow2(k)), LB_STEPS=LB_STEPS, FALLBACK_BLOCK=FALLBACK_BLOCK,
        num_warps=warps, **pdl_args(scores.device)
    )


# ----------------------------------------------------------------------------- engine object


class IndexerTopK:
    """Graph-safe top-k for the engine: preallocated output and workspace, static path.

    Args:
        max_rows, max_width: the largest [R, W] a call may pass (static, e.g. bucket size and
            the padded width from max_model_len).
        k: entries per row (512 or 1024 in the models; any positive int works).
        backend: "auto" | "standard" | "persistent" | "torch".
        device: where the output and workspace live.
        num_programs: grid size (default: the SM count for the persistent path, twice that
            for the standard one; tests shrink it).
        _tile: benchmark/test-only override of the standard BLOCK (= G) / persistent CHUNK.
        _cap: test-only override of the candidate capacity C (a power of two), to force the
            overflow fallback.
        _warps: benchmark-only override of the warps per program.
        _maxnreg: benchmark-only register cap of the persistent select kernel (two programs per
            SM fit at 128).
        _chunks_per_item: benchmark/test-only override of the persistent select kernel's chunks
            per item (1: every chunk its own item, as before session 13).
        _pair_chunks: benchmark/test-only: True pairs the select kernel's chunks even in items of one
            chunk, False never (as before session 14); None (default): in items of two or more.
        _bound_chunk, _bound_warps: benchmark/test-only CHUNK and warps of the persistent bound kernel
            alone.
        _finish_gather: benchmark/test-only: True (default since session 15) writes tie-free rows
            straight from the candidate buffer's order (two in-register gathers); False reorders the
            buffer in memory first (before session 15; 1-2.5 us slower on the H200).
        _select_chunk, _select_warps: benchmark/test-only CHUNK and warps of the persistent select
            kernel alone (the bound kernel keeps its own); one chunk per item unless
            _chunks_per_item says otherwise. At CHUNK 4096 and 4 warps the kernel takes 248
            registers: two programs fit an SM (give num_programs for them).

    Memory: the output (max_rows x k int32). Standard path: the shared candidate buffers,
    2 x SMs x C x 8 bytes per device (2.1 MiB for k = 512 on 132 SMs). Persistent path, per
    row: (16 + G) x 4 bytes of workspace and C x 8 bytes of candidates (24 KiB for k = 512),
    plus 16 bytes per chunk.

    Use::

        topk = IndexerTopK(max_rows=bucket, max_width=padded_width, k=512)  # once
        idx = topk(scores[:rows, :width], lengths[:rows])  # per step; capturable
    """

    def __init__(
        self,
        max_rows: int,
        max_width: int,
        k: int,
        backend: str = "auto",
        device: torch.device | str | None = None,
        num_programs: int | None = None,
        _tile: int | None = None,
        _cap: int | None = None,
        _warps: int | None = None,
        _maxnreg: int | None = None,
        _chunks_per_item: int | None = None,
        _pair_chunks: bool | None = None,
        _bound_chunk: int | None = None,
        _bound_warps: int | None = None,
        _finish_gather: bool = True,
        _select_chunk: int | None = None,
        _select_warps: int | None = None,
        _lb_steps: int = LB_STEPS,
        _exact_steps: int = 16,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, value in (("max_rows", max_rows), ("max_width", max_width), ("k", k)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_width >= 2**31 - 1:
            raise ValueError(f"max_width must fit int32 indices, got {max_width}")
        if num_programs is not None and (not isinstance(num_programs, int) or num_programs <= 0):
            raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
        self.device = _normalize_device(device)
        self.max_rows, self.max_width, self.k = max_rows, max_width, k
        self.backend = backend
        if backend == "auto":
            # Static facts only; on the CPU auto means the reference (the CPU path), while
            # "standard"/"persistent" run Triton there only under TRITON_INTERPRET=1 (tests).
            on_gpu = _HAVE_TRITON and self.device.type == "cuda"
            self.path = auto_path(max_rows, max_width) if on_gpu else "torch"
        else:
            self.path = backend
        if self.path in ("standard", "persistent"):
            _check_triton_device(self.device)
        # Benchmark/test-only knobs: the standard BLOCK or the persistent CHUNK, and the capacity.
        if _tile is not None and (_tile not in (1024, 2048, 4096, 8192, 16384)):
            raise ValueError(f"_tile must be one of 1024, 2048, 4096, 8192, 16384, got {_tile!r}")
        if _cap is not None and (not isinstance(_cap, int) or _cap < 16 or _cap & (_cap - 1)):
            raise ValueError(f"_cap must be a power of two >= 16, got {_cap!r}")
        if _warps is not None and _warps not in (4, 8, 16):
            raise ValueError(f"_warps must be 4, 8 or 16, got {_warps!r}")
        self._tile = _tile
        if _chunks_per_item is not None and (not isinstance(_chunks_per_item, int) or _chunks_per_item < 1):
            raise ValueError(f"_chunks_per_item must be a positive int, got {_chunks_per_item!r}")
        self._chunks_per_item = _chunks_per_item
        self._pair_chunks = _pair_chunks
        if _bound_chunk is not None and (not isinstance(_bound_chunk, int) or _bound_chunk not in
                                         tuple(1 << e for e in range(10, 17))):
            raise ValueError(f"_bound_chunk must be a power of two in 1024 .. 65536, got {_bound_chunk!r}")
        if _bound_warps is not None and _bound_warps not in (4, 8, 16):
            raise ValueError(f"_bound_warps must be 4, 8 or 16, got {_bound_warps!r}")
        self._bound_chunk, self._bound_warps = _bound_chunk, _bound_warps
        self._finish_gather = bool(_finish_gather)
        if _select_chunk is not None and _select_chunk not in (1024, 2048, 4096, 8192, 16384):
            raise ValueError(f"_select_chunk must be one of 1024, 2048, 4096, 8192, 16384, got {_select_chunk!r}")
        if _select_warps is not None and _select_warps not in (4, 8, 16):
            raise ValueError(f"_select_warps must be 4, 8 or 16, got {_select_warps!r}")
        self._select_chunk, self._select_warps = _select_chunk, _select_warps
        self._warps = _warps
        if _maxnreg is not None and _maxnreg not in (64, 96, 128, 168):
            raise ValueError(f"_maxnreg must be 64, 96, 128 or 168, got {_maxnreg!r}")
        self._select_launch_options = {} if _maxnreg is None else {"maxnreg": _maxnreg}
        # Timing experiments only (persistent path): fewer search steps cost less and are not exact.
        if not (1 <= _lb_steps <= LB_STEPS and 1 <= _exact_steps <= 16):
            raise ValueError(f"_lb_steps must be in 1..{LB_STEPS} and _exact_steps in 1..16")
        self._lb_steps, self._exact_steps = _lb_steps, _exact_steps
        self.cap = _cap or _capacity(k)
        self.out = torch.full((max_rows, k), -1, dtype=torch.int32, device=self.device)
        self.num_programs = 0
        if self.path == "standard":
            self.num_programs = num_programs or STD_PROGRAMS_PER_SM * _num_sms(self.device)
            grid = min(max_rows, self.num_programs)
            if _cap is None:
                self.cand_v, self.cand_i = _shared_candidates(self.device, grid, self.cap)
            else:
                self.cand_v = torch.empty((grid, self.cap), dtype=torch.float32, device=self.device)
                self.cand_i = torch.empty((grid, self.cap), dtype=torch.int32, device=self.device)
        elif self.path == "persistent":
            self._sms = _num_sms(self.device)
            self.num_programs = num_programs or PERSISTENT_PROGRAMS_PER_SM * self._sms
            self.groups = _persistent_groups(k)
            for name, value in (("_tile", _tile), ("_select_chunk", _select_chunk), ("_bound_chunk", _bound_chunk)):
                if value is not None and value < self.groups:
                    raise ValueError(f"{name}={value} is below the persistent path's {self.groups} groups for k={k}")
            self._ws_stride = WS_GMAX + self.groups
            max_cpr = -(-max_width // max(1024, self.groups))  # the smallest chunk gives the most chunks
            self._cpr_p2 = max(256, _next_pow2(max_cpr))  # 256 up to 256K columns: one compiled variant
            # Chunk records of any call: chunks >= 1024 and about one chunk per program until chunks
            # reach 8192, so at most num_programs + max_rows * (ceil(max_width / 8192) + 1); a
            # _tile or _select_chunk override may need more.
            tile = _tile or _select_chunk or 8192
            self._chunks_cap = max(
                self.num_programs + max_rows * (-(-max_width // 8192) + 1), max_rows * -(-max_width // tile)
            )
            # Arrival counters, candidate count and group maxima: must be zero at launch (zeroed per call).
            self.workspace = torch.zeros((max_rows, self._ws_stride), dtype=torch.int32, device=self.device)
            # Per-chunk (count, base, unused, offset) and the candidates: written before they are read.
            self.chunk_info = torch.zeros((self._chunks_cap, 4), dtype=torch.int32, device=self.device)
            self.cand_v = torch.empty((max_rows, self.cap), dtype=torch.float32, device=self.device)
            self.cand_i = torch.empty((max_rows, self.cap), dtype=torch.int32, device=self.device)

    def __call__(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Top-k indices int32 [R, k] (a view of the preallocated output)."""
        _check_inputs(scores, lengths, self.max_rows, self.max_width)
        if scores.device != self.device:
            raise ValueError(f"scores on {scores.device}, IndexerTopK on {self.device}")
        out = self.out[: scores.shape[0]]
        if self.path == "torch":
            out.copy_(topk_indices_ref(scores, lengths, self.k))
        elif self.path == "standard":
            _launch_standard(
                scores, lengths, out, self.k, self.num_programs, self.cand_v, self.cand_i, self._tile, self.cap,
                self._warps,
            )
        else:
            self._persistent(scores, lengths, out)
        return out

    def chunks_per_item(self, rows: int, width: int) -> int:
        """The persistent select kernel's chunks per item for a call of rows x width (1 on other paths)."""
        return self._persistent_plan(rows, width)[2] if self.path == "persistent" else 1

    def chunks_per_unit(self, rows: int, width: int) -> int:
        """The persistent select kernel's chunks per arrival unit (1 or 2; 1 on other paths)."""
        return self._persistent_plan(rows, width)[5] if self.path == "persistent" else 1

    def _persistent_plan(self, rows: int, width: int) -> tuple[int, int, int, int, int, int]:
        """(select CHUNK, chunks per row, chunks per item, select warps, bound CHUNK, chunks per
        unit) of a call, the benchmark/test overrides applied. Items of two or more chunks are
        done as pairs of chunks (loaded together, one candidate-count atomic and one arrival per
        pair) unless _pair_chunks=False."""
        chunk, cpr, per_item, warps = _persistent_config(rows, width, min(self.num_programs, self._sms), self.k)
        bound_chunk = _bound_chunk(width, self.k, rows, self.num_programs)
        if self._tile is not None:
            chunk = bound_chunk = self._tile
            cpr, per_item, warps = -(-width // chunk), 1, _warps(chunk, self.cap)
        if self._select_chunk is not None:
            chunk = self._select_chunk
            cpr, per_item = -(-width // chunk), 1
        bound_chunk = self._bound_chunk or bound_chunk
        per_item = self._chunks_per_item or per_item
        pair = 2 if (self._pair_chunks is None and per_item >= 2 and cpr >= 2) or self._pair_chunks else 1
        return chunk, cpr, per_item, self._select_warps or self._warps or warps, bound_chunk, pair

    def _reset_workspace(self, ws: torch.Tensor) -> None:
        """Zero the persistent path's per-row workspace before its first kernel: unconditionally,
        so that any graph capturing the call records it (DESIGN.md invariant 2). (The graph-audit
        tests patch this step to reproduce the historical bug of a host-guarded zeroing.)"""
        ws.zero_()

    def _persistent(self, scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        rows, width = scores.shape
        if rows == 0:
            return
        ws = self.workspace[:rows]
        self._reset_workspace(ws)
        if width == 0:
            out.fill_(-1)
            return
        chunk, cpr, per_item, warps, bound_chunk, pair = self._persistent_plan(rows, width)
        if rows * cpr > self._chunks_cap or cpr > self._cpr_p2:
            raise ValueError(f"{rows} x {width} needs {rows * cpr} chunks, more than the {self._chunks_cap} planned")
        units_per_row = -(-cpr // pair)
        units_per_item = -(-per_item // pair)
        items_per_row = -(-units_per_row // units_per_item)
        n_items = rows * items_per_row
        bound_cpr = -(-width // bound_chunk)
        bound_items = rows * bound_cpr
        _p_bound_kernel[(min(self.num_programs, bound_items),)](
            scores, scores.stride(0), lengths, ws, width, bound_items, bound_cpr,
            K=self.k, CHUNK=bound_chunk, G=self.groups, WS=self._ws_stride, LB_STEPS=self._lb_steps,
            num_warps=self._bound_warps or self._warps or 8,
        )
        grid = (min(self.num_programs, n_items),)
        _p_select_kernel[grid](
            scores, scores.stride(0), lengths, ws, self.chunk_info, self.cand_v, self.cand_i, out, out.stride(0),
            width, n_items, cpr, units_per_row, items_per_row, units_per_item, 1,
            K=self.k, CHUNK=chunk, WS=self._ws_stride, C=self.cap, CPR_P2=self._cpr_p2,
            FB=min(1024, _next_pow2(self.k)), FALLBACK_BLOCK=FALLBACK_BLOCK, EXACT_STEPS=self._exact_steps,
            PAIR=pair, GATHER=self._finish_gather, num_warps=warps,
            **self._select_launch_options,
        )


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Dispatch: the standard Triton path on CUDA, the reference elsewhere (allocates per call)."""
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if scores.is_cuda and _HAVE_TRITON:
        _check_inputs(scores, lengths, scores.shape[0], scores.shape[1])
        rows = scores.shape[0]
        out = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
        programs = STD_PROGRAMS_PER_SM * _num_sms(scores.device)
        cap = _capacity(k)
        grid = max(1, min(rows, programs))
        cand_v = torch.empty((grid, cap), dtype=torch.float32, device=scores.device)
        cand_i = torch.empty((grid, cap), dtype=torch.int32, device=scores.device)
        _launch_standard(scores, lengths, out, k, programs, cand_v, cand_i)
        return out
    return topk_indices_ref(scores, lengths, k)
