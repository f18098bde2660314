"""Triton building blocks shared by both top-k paths: order-preserving int32 keys, the 2-bit
threshold searches, candidate compaction and writes, and the exact radix-select fallback."""
from __future__ import annotations

try:  # Triton is optional on the CPU path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False

from .plan import KEY_NEG_INF, WS_ARRIVE1, WS_ARRIVE2, WS_BOUND, WS_GMAX, WS_TOTAL

if _HAVE_TRITON:
    _NEG_INF_KEY = tl.constexpr(KEY_NEG_INF)
    _KEY_MIN = tl.constexpr(-2147483648)  # u = key - _KEY_MIN maps int32 keys onto [0, 2**32)
    _WS_ARRIVE1 = tl.constexpr(WS_ARRIVE1)
    _WS_ARRIVE2 = tl.constexpr(WS_ARRIVE2)
    _WS_TOTAL = tl.constexpr(WS_TOTAL)
    _WS_BOUND = tl.constexpr(WS_BOUND)
    _WS_GMAX = tl.constexpr(WS_GMAX)



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
        continuous scores the exact search (STEPS = 16) stops after ~10 steps (each one block reduction). at_res: the count at res, kept exact from the start, so whether the
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

