"""Indexer top-k over fp32 score rows with per-row valid lengths.

Tie rule (all paths): a larger score wins; among equal scores the lower index wins.
Output: int32 [R, k]; the first min(length, k) slots hold the chosen indices (in no
promised order), the rest are -1. Columns >= length are ignored whatever they hold.
-0.0 counts as equal to +0.0; NaN scores are not supported (their rank is unspecified).

Engine interface
----------------
``IndexerTopK(max_rows, max_width, k, backend="auto", device=...)`` preallocates its
output (and, for the persistent path, its workspace) once; ``__call__(scores, lengths)``
returns a view ``[R, k]`` of that output (R <= max_rows, W <= max_width). A call does no
host sync, no data-dependent host branch and no allocation, so it can be captured in a
CUDA graph (DESIGN.md invariant 1). ``backend`` is "auto" | "standard" | "persistent" |
"torch"; "auto" picks from the static facts (max_rows, max_width) only (invariant 3),
and ``.path`` says what it picked. The returned view is overwritten by the next call.

Both Triton paths compute the same function, in the same output order: the indices with
score above the k-th score T in increasing index order, then the indices with score == T
in increasing index order (as many as fill k).

Algorithm (both paths): scores become order-preserving int32 keys; an 11/11/10-bit radix
select finds the key T of the k-th largest valid entry with three histogram passes
(each pass only counts entries that match the digits chosen so far), then one pass
writes the entries with key > T and the lowest-index entries with key == T.

* standard: one program per row, all passes inside one launch. Good when there are
  enough rows to fill the GPU.
* persistent: a resident grid (one program per SM) that cuts every row into chunks and
  loops over (row, chunk) items, so a few long rows use the whole GPU. The passes are
  five launches (hist1, hist2, hist3, count, write); the kernel boundaries are the grid
  barriers, so nothing ever spin-waits (no hang is possible, also under
  TRITON_INTERPRET=1 where programs run one after another). The per-row histograms are
  device counters accumulated with atomics and MUST be zero at launch: the path zeroes
  its workspace itself, unconditionally, right before the first kernel (DESIGN.md
  invariant 2), so any graph that captures the call records the zeroing. Each pass
  checks that its histogram sums to the count the previous pass expects; on a mismatch
  (counters that were not zero) the row is written as all -2, a detectable error value.
* torch: the plain-PyTorch reference below (stable sort), exact tie rule, slow.

Roofline: the data is read once at best, R*W*4 bytes at ~4.2 TB/s (1 x 256K = 1 MiB,
0.25 us); in practice both paths read each row up to 5 times (L2 absorbs the re-reads for
few rows) and are latency/launch-bound for few rows.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:  # Triton is optional on the CPU path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False

BACKENDS = ("auto", "standard", "persistent", "torch")

# Radix digits of the 32-bit key: 11 + 11 + 10 bits.
_NB1 = 2048
_NB2 = 2048
_NB3 = 1024
# Workspace layout per row (int32): three histograms, then the per-row state.
_H1_OFF = 0
_H2_OFF = _NB1
_H3_OFF = _NB1 + _NB2
_ST_OFF = _NB1 + _NB2 + _NB3
_WS_STRIDE = _ST_OFF + 16
assert _ST_OFF == 5120 and _H2_OFF == 2048 and _H3_OFF == 4096  # offsets hard-coded in the kernels
# State slots (written by the chunk-0 item of a row, read by the next launch).
_ST_P1, _ST_KR1, _ST_CNT1 = 0, 1, 2
_ST_P2, _ST_KR2, _ST_CNT2 = 3, 4, 5
_ST_T, _ST_NEQ, _ST_NGT = 6, 7, 8
_ST_ERR = 9

# "auto" crossover, measured on one H200 (docs/perf_topk.md): the persistent path is
# picked when a step has at most this many rows for its padded width.
_AUTO_MAX_ROWS_PERSISTENT = ((16384, 0), (65536, 8), (1 << 62, 64))


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


# ----------------------------------------------------------------------------- Triton
if _HAVE_TRITON:

    @triton.jit
    def _keys(x):
        """fp32 -> int32 key whose signed order is the float order (-0.0 folded into +0.0)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _pick_digit(h, NB: tl.constexpr, kr):
        """Largest bin d whose suffix count reaches kr; also the count above d and in d."""
        bins = tl.arange(0, NB)
        total = tl.sum(h, axis=0)
        prefix = tl.cumsum(h, axis=0)
        suffix = total - prefix + h  # entries in bins >= b
        d = tl.max(tl.where(suffix >= kr, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > d, h, 0), axis=0)
        in_d = tl.sum(tl.where(bins == d, h, 0), axis=0)
        return d, above, in_d, total

    @triton.jit
    def _fill(out_row, lo, hi, value, K: tl.constexpr, FB: tl.constexpr):
        """out_row[lo:hi] = value (hi <= K)."""
        for s in range(0, K, FB):
            o = s + tl.arange(0, FB)
            tl.store(out_row + o, tl.full([FB], value, tl.int32), mask=(o >= lo) & (o < hi))

    @triton.jit
    def _topk_standard_kernel(
        scores_ptr, stride_s, lengths_ptr, out_ptr, stride_o, W,
        K: tl.constexpr, BLOCK: tl.constexpr, FB: tl.constexpr,
    ):
        row = tl.program_id(0)
        srow = scores_ptr + row.to(tl.int64) * stride_s
        orow = out_ptr + row.to(tl.int64) * stride_o
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
        offs = tl.arange(0, BLOCK)
        if n > K:
            # Pass 1: top 11 bits.
            h1 = tl.zeros([2048], dtype=tl.int32)
            for s in range(0, n, BLOCK):
                c = s + offs
                m = c < n
                key = _keys(tl.load(srow + c, mask=m, other=0.0))
                h1 += tl.histogram((key >> 21) + 1024, 2048, mask=m)
            d1, above1, _c1, _t1 = _pick_digit(h1, 2048, K)
            p1 = d1 - 1024
            kr = K - above1
            # Pass 2: middle 11 bits of the entries whose top digit is p1.
            h2 = tl.zeros([2048], dtype=tl.int32)
            for s in range(0, n, BLOCK):
                c = s + offs
                m = c < n
                key = _keys(tl.load(srow + c, mask=m, other=0.0))
                m2 = m & ((key >> 21) == p1)
                h2 += tl.histogram((key >> 10) & 0x7FF, 2048, mask=m2)
            d2, above2, _c2, _t2 = _pick_digit(h2, 2048, kr)
            p2 = p1 * 2048 + d2
            kr = kr - above2
            # Pass 3: low 10 bits.
            h3 = tl.zeros([1024], dtype=tl.int32)
            for s in range(0, n, BLOCK):
                c = s + offs
                m = c < n
                key = _keys(tl.load(srow + c, mask=m, other=0.0))
                m3 = m & ((key >> 10) == p2)
                h3 += tl.histogram(key & 0x3FF, 1024, mask=m3)
            d3, above3, _c3, _t3 = _pick_digit(h3, 1024, kr)
            thr = p2 * 1024 + d3
            need_eq = kr - above3  # >= 1 entries equal to thr to take, lowest index first
            n_gt = K - need_eq
            # Write pass: deterministic slots from running counts.
            gt_run = 0
            eq_run = 0
            for s in range(0, n, BLOCK):
                c = s + offs
                m = c < n
                key = _keys(tl.load(srow + c, mask=m, other=0.0))
                is_gt = (m & (key > thr)).to(tl.int32)
                is_eq = (m & (key == thr)).to(tl.int32)
                rank_gt = gt_run + tl.cumsum(is_gt, axis=0)
                rank_eq = eq_run + tl.cumsum(is_eq, axis=0)
                tl.store(orow + rank_gt - 1, c, mask=(is_gt != 0) & (rank_gt <= n_gt))
                tl.store(orow + n_gt + rank_eq - 1, c, mask=(is_eq != 0) & (rank_eq <= need_eq))
                gt_run += tl.sum(is_gt, axis=0)
                eq_run += tl.sum(is_eq, axis=0)
        else:
            # Every valid entry is chosen: slot j holds column j; the rest is -1.
            for s in range(0, K, FB):
                o = s + tl.arange(0, FB)
                tl.store(orow + o, tl.where(o < n, o, -1), mask=o < K)

    # ---- persistent path: five launches over a resident grid of (row, chunk) items.

    @triton.jit
    def _p_hist1_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        bins = tl.arange(0, 2048)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            start = (item % CPR) * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if (n > K) & (start < n):
                c = start + offs
                m = c < n
                key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                h = tl.histogram((key >> 21) + 1024, 2048, mask=m)
                wrow = ws_ptr + row.to(tl.int64) * WS
                tl.atomic_add(wrow + 0 + bins, h, mask=h > 0, sem="relaxed")

    @triton.jit
    def _p_hist2_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        bins = tl.arange(0, 2048)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            chunk = item % CPR
            start = chunk * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                wrow = ws_ptr + row.to(tl.int64) * WS
                # Every item derives the pass-1 decision from the finished histogram.
                h1 = tl.load(wrow + 0 + bins)
                d1, above1, in_d1, total1 = _pick_digit(h1, 2048, K)
                p1 = d1 - 1024
                if chunk == 0:
                    st = wrow + 5120
                    tl.store(st + 0, p1)
                    tl.store(st + 1, K - above1)
                    tl.store(st + 2, in_d1)
                    tl.store(st + 9, (total1 != n).to(tl.int32))
                if start < n:
                    c = start + offs
                    m = c < n
                    key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                    m2 = m & ((key >> 21) == p1)
                    h = tl.histogram((key >> 10) & 0x7FF, 2048, mask=m2)
                    tl.atomic_add(wrow + 2048 + bins, h, mask=h > 0, sem="relaxed")

    @triton.jit
    def _p_hist3_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        bins2 = tl.arange(0, 2048)
        bins3 = tl.arange(0, 1024)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            chunk = item % CPR
            start = chunk * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                wrow = ws_ptr + row.to(tl.int64) * WS
                st = wrow + 5120
                p1 = tl.load(st + 0)
                kr1 = tl.load(st + 1)
                cnt1 = tl.load(st + 2)
                h2 = tl.load(wrow + 2048 + bins2)
                d2, above2, in_d2, total2 = _pick_digit(h2, 2048, kr1)
                p2 = p1 * 2048 + d2
                if chunk == 0:
                    tl.store(st + 3, p2)
                    tl.store(st + 4, kr1 - above2)
                    tl.store(st + 5, in_d2)
                    tl.store(st + 9, tl.load(st + 9) | (total2 != cnt1).to(tl.int32))
                if start < n:
                    c = start + offs
                    m = c < n
                    key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                    m3 = m & ((key >> 10) == p2)
                    h = tl.histogram(key & 0x3FF, 1024, mask=m3)
                    tl.atomic_add(wrow + 4096 + bins3, h, mask=h > 0, sem="relaxed")

    @triton.jit
    def _p_count_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, cnt_ptr, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr, CPR_P2: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        bins3 = tl.arange(0, 1024)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            chunk = item % CPR
            start = chunk * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                wrow = ws_ptr + row.to(tl.int64) * WS
                st = wrow + 5120
                p2 = tl.load(st + 3)
                kr2 = tl.load(st + 4)
                cnt2 = tl.load(st + 5)
                h3 = tl.load(wrow + 4096 + bins3)
                d3, above3, _in_d3, total3 = _pick_digit(h3, 1024, kr2)
                thr = p2 * 1024 + d3
                need_eq = kr2 - above3
                if chunk == 0:
                    tl.store(st + 6, thr)
                    tl.store(st + 7, need_eq)
                    tl.store(st + 8, K - need_eq)
                    tl.store(st + 9, tl.load(st + 9) | (total3 != cnt2).to(tl.int32))
                c = start + offs
                m = c < n
                key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                n_gt = tl.sum((m & (key > thr)).to(tl.int32), axis=0)
                n_eq = tl.sum((m & (key == thr)).to(tl.int32), axis=0)
                crow = cnt_ptr + row.to(tl.int64) * (2 * CPR_P2)
                tl.store(crow + chunk, n_gt)
                tl.store(crow + CPR_P2 + chunk, n_eq)

    @triton.jit
    def _p_write_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, cnt_ptr, out_ptr, stride_o, W, n_items, CPR,
        K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr, CPR_P2: tl.constexpr, FB: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        cidx = tl.arange(0, CPR_P2)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            chunk = item % CPR
            start = chunk * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            orow = out_ptr + row.to(tl.int64) * stride_o
            c = start + offs
            if n > K:
                st = ws_ptr + row.to(tl.int64) * WS + 5120
                err = tl.load(st + 9)
                if err != 0:
                    # Counters were not zero at launch: poison the row (detectable, never a hang).
                    if chunk == 0:
                        _fill(orow, 0, K, -2, K, FB)
                else:
                    thr = tl.load(st + 6)
                    need_eq = tl.load(st + 7)
                    n_gt = tl.load(st + 8)
                    crow = cnt_ptr + row.to(tl.int64) * (2 * CPR_P2)
                    before = cidx < chunk
                    gt_base = tl.sum(tl.load(crow + cidx, mask=before, other=0), axis=0)
                    eq_base = tl.sum(tl.load(crow + CPR_P2 + cidx, mask=before, other=0), axis=0)
                    if start < n:
                        m = c < n
                        key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                        is_gt = (m & (key > thr)).to(tl.int32)
                        is_eq = (m & (key == thr)).to(tl.int32)
                        rank_gt = gt_base + tl.cumsum(is_gt, axis=0)
                        rank_eq = eq_base + tl.cumsum(is_eq, axis=0)
                        tl.store(orow + rank_gt - 1, c, mask=(is_gt != 0) & (rank_gt <= n_gt))
                        tl.store(orow + n_gt + rank_eq - 1, c, mask=(is_eq != 0) & (rank_eq <= need_eq))
            else:
                # Every valid entry is chosen: slot j holds column j.
                tl.store(orow + c, c, mask=c < n)
                if chunk == 0:
                    _fill(orow, n, K, -1, K, FB)


# ----------------------------------------------------------------------------- planning


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _standard_config(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for the standard kernel, from the static width."""
    block = min(4096, max(1024, _next_pow2(width)))
    return block, (8 if block >= 4096 else 4)


def _persistent_config(rows: int, width: int, num_programs: int) -> tuple[int, int, int]:
    """(CHUNK, chunks_per_row, num_warps): about one item per program, chunks of 1K..8K."""
    target = -(-rows * width // max(1, num_programs))
    chunk = min(8192, max(1024, _next_pow2(target)))
    return chunk, -(-width // chunk), (8 if chunk >= 4096 else 4)


def auto_path(max_rows: int, max_width: int) -> str:
    """The path "auto" picks, from static facts only (never from lengths)."""
    for width_limit, rows_limit in _AUTO_MAX_ROWS_PERSISTENT:
        if max_width <= width_limit:
            return "persistent" if max_rows <= rows_limit else "standard"
    return "standard"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU under TRITON_INTERPRET=1: a few programs, to exercise the item loop


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
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
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


def _launch_standard(
    scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int, block: Optional[int] = None
) -> None:
    rows, width = scores.shape
    if rows == 0:
        return
    block, warps = _standard_config(width) if block is None else (block, 8 if block >= 4096 else 4)
    _topk_standard_kernel[(rows,)](
        scores, scores.stride(0), lengths, out, out.stride(0), width,
        K=k, BLOCK=block, FB=min(1024, _next_pow2(k)), num_warps=warps,
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
        num_programs: persistent grid size (default: the SM count; tests shrink it).
        _tile: benchmark-only override of the standard BLOCK / persistent CHUNK.
        _debug_skip_reset_when_short: TEST ONLY. Restores the historical vLLM bug: the
            workspace zeroing is guarded by a host ``if`` on the caller's ``max_seq_len``
            (skipped when it is <= k), so a graph captured at a short length records no
            zeroing and its replays at long lengths run on stale counters. Never set it
            outside the regression test.
    """

    def __init__(
        self,
        max_rows: int,
        max_width: int,
        k: int,
        backend: str = "auto",
        device: torch.device | str | None = None,
        num_programs: Optional[int] = None,
        _debug_skip_reset_when_short: bool = False,
        _tile: Optional[int] = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, value in (("max_rows", max_rows), ("max_width", max_width), ("k", k)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_width >= 2**31 - 1:
            raise ValueError(f"max_width must fit int32 indices, got {max_width}")
        self.device = _normalize_device(device)
        self.max_rows, self.max_width, self.k = max_rows, max_width, k
        self.backend = backend
        self.path = auto_path(max_rows, max_width) if backend == "auto" else backend
        if self.path == "persistent" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            self.path = "torch" if backend == "auto" else self.path
        if self.path == "standard" and backend == "auto" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            self.path = "torch"
        if self.path in ("standard", "persistent"):
            _check_triton_device(self.device)
        self._debug_skip_reset_when_short = bool(_debug_skip_reset_when_short)
        # Benchmark-only tuning knob: the standard BLOCK or the persistent CHUNK (power of 2, 1K..8K).
        if _tile is not None and (_tile not in (1024, 2048, 4096, 8192)):
            raise ValueError(f"_tile must be one of 1024, 2048, 4096, 8192, got {_tile!r}")
        self._tile = _tile
        self.out = torch.full((max_rows, k), -1, dtype=torch.int32, device=self.device)
        self.num_programs = 0
        if self.path == "persistent":
            if num_programs is not None and (not isinstance(num_programs, int) or num_programs <= 0):
                raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
            self.num_programs = num_programs or _num_sms(self.device)
            max_cpr = -(-max_width // 1024)  # the smallest chunk gives the most chunks per row
            self._cpr_p2 = max(16, _next_pow2(max_cpr))
            # Counters (histograms) must be zero at launch; the per-row state needs no zero but
            # shares the buffer, so one fill covers both.
            self.workspace = torch.zeros((max_rows, _WS_STRIDE), dtype=torch.int32, device=self.device)
            self.chunk_counts = torch.zeros((max_rows, 2 * self._cpr_p2), dtype=torch.int32, device=self.device)

    def __call__(self, scores: torch.Tensor, lengths: torch.Tensor, max_seq_len: Optional[int] = None) -> torch.Tensor:
        """Top-k indices int32 [R, k] (a view of the preallocated output).

        max_seq_len: host int, consulted only by the test-only bug switch.
        """
        _check_inputs(scores, lengths, self.max_rows, self.max_width)
        if scores.device != self.device:
            raise ValueError(f"scores on {scores.device}, IndexerTopK on {self.device}")
        rows, width = scores.shape
        out = self.out[:rows]
        if self.path == "torch":
            out.copy_(topk_indices_ref(scores, lengths, self.k))
        elif self.path == "standard":
            _launch_standard(scores, lengths, out, self.k, self._tile)
        else:
            self._persistent(scores, lengths, out, max_seq_len)
        return out

    def _persistent(self, scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, max_seq_len: Optional[int]) -> None:
        rows, width = scores.shape
        if rows == 0:
            return
        ws = self.workspace[:rows]
        skip = self._debug_skip_reset_when_short and max_seq_len is not None and max_seq_len <= self.k
        if not skip:
            # Unconditional in the real path (invariant 2): recorded in any captured graph.
            ws.zero_()
        if width == 0:
            out.fill_(-1)
            return
        chunk, cpr, warps = _persistent_config(rows, width, self.num_programs)
        if self._tile is not None:
            chunk, warps = self._tile, (8 if self._tile >= 4096 else 4)
            cpr = -(-width // chunk)
        n_items = rows * cpr
        grid = (min(self.num_programs, n_items),)
        k = self.k
        common = dict(K=k, CHUNK=chunk, WS=_WS_STRIDE, num_warps=warps)
        args = (scores, scores.stride(0), lengths, ws)
        _p_hist1_kernel[grid](*args, width, n_items, cpr, **common)
        _p_hist2_kernel[grid](*args, width, n_items, cpr, **common)
        _p_hist3_kernel[grid](*args, width, n_items, cpr, **common)
        _p_count_kernel[grid](*args, self.chunk_counts, width, n_items, cpr, CPR_P2=self._cpr_p2, **common)
        _p_write_kernel[grid](
            *args, self.chunk_counts, out, out.stride(0), width, n_items, cpr,
            CPR_P2=self._cpr_p2, FB=min(1024, _next_pow2(k)), **common,
        )


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Dispatch: the standard Triton path on CUDA, the reference elsewhere."""
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if scores.is_cuda and _HAVE_TRITON:
        _check_inputs(scores, lengths, scores.shape[0], scores.shape[1])
        out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
        _launch_standard(scores, lengths, out, k)
        return out
    return topk_indices_ref(scores, lengths, k)
