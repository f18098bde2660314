"""The persistent top-k path: a resident grid looping over (row, chunk) items, two launches."""
from __future__ import annotations

try:  # Triton is optional on the CPU path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False


if _HAVE_TRITON:
    from .search import (  # the jit helpers the kernels call
        _KEY_MIN,
        _WS_ARRIVE1,
        _WS_ARRIVE2,
        _WS_BOUND,
        _WS_GMAX,
        _WS_TOTAL,
        _bound_key,
        _bound_search,
        _exact_row,
        _fill,
        _key_float,
        _keys,
        _kth_search,
        _load_scores,
        _select_write,
        _write_chosen,
    )

    # ---- persistent path: a resident grid looping over (row, chunk) items, two launches.

    @triton.jit(do_not_specialize=["stride_s", "W", "n_items", "CPR"])
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

    @triton.jit(do_not_specialize=["stride_s", "W", "n_items", "CPR", "UPR", "IPR", "SUB", "ONE"])
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
