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

Algorithm (both paths): scores become order-preserving int32 keys; a radix select, one
byte (256 bins) per pass, finds the key T of the k-th largest valid entry with four
histogram passes (pass l counts only the entries whose higher bytes match the bytes chosen
so far; blocks without such entries skip the histogram), then one pass writes the entries
with key > T and the lowest-index entries with key == T. 256 bins, not 2048: on Triton 3.6
`tl.histogram` lowers to warp ballots whose cost grows with the bin count (a 2048-bin
version measured ~12 us per 4096-entry block on the H200; see docs/performance.md).

* standard: one program per row, all passes inside one launch. Good when there are
  enough rows to fill the GPU.
* persistent: a resident grid (one program per SM) that cuts every row into chunks and
  loops over (row, chunk) items, so a few long rows use the whole GPU. The passes are
  five launches (four level histograms, then the write); the kernel boundaries are the
  grid barriers, so nothing ever spin-waits (no hang is possible, also under
  TRITON_INTERPRET=1 where programs run one after another). Every item re-derives the
  chosen bytes from the finished histograms (256 bins, cheap). The last histogram pass also
  keeps each chunk's own last-byte histogram and its count above the 24-bit prefix, so the
  write pass places each chunk's entries from prefix sums over the earlier chunks (no
  count pass, deterministic order). The per-row histograms are device counters
  accumulated with atomics and MUST be zero at launch: the path zeroes them itself,
  unconditionally, right before the first kernel (DESIGN.md invariant 2), so any graph
  that captures the call records the zeroing. Each pass checks that the histograms sum to
  the counts the previous level expects; on a mismatch (counters that were not zero) the
  row is written as all -2, a detectable error value.
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

# Radix select over the 32-bit key, one byte (256 bins) per pass. The per-row workspace of
# the persistent path holds the four level histograms (the counters that must be zero).
_WS_STRIDE = 4 * 256

# "auto" crossover (docs/performance.md): the persistent path is picked when a step has at most
# this many rows for its padded width. Measured on one H200: the v1 kernels' sweep had the
# persistent path >= 2x the standard one up to 64 rows and ~1.15x at 128-256 rows; the v2
# kernels sped the standard path up 3.4-3.8x and the persistent one 1.6-1.8x at the shapes
# measured, which moves the 2x point to about 32 rows. Up to 4096 columns a row is at most
# a few chunks, so the persistent path has nothing to split.
_AUTO_MAX_ROWS_PERSISTENT = ((4096, 0), (16384, 8), (1 << 62, 32))


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
    def _digit(key, LEVEL: tl.constexpr):
        """The LEVEL-th byte of the key (0 = top, signed, shifted to 0..255)."""
        if LEVEL == 0:
            return (key >> 24) + 128
        else:
            return (key >> (24 - 8 * LEVEL)) & 255

    @triton.jit
    def _matches(key, prefix, LEVEL: tl.constexpr):
        """Whether the key's top LEVEL bytes equal prefix (LEVEL >= 1; prefix is signed)."""
        return (key >> (32 - 8 * LEVEL)) == prefix

    @triton.jit
    def _pick_digit(h, kr):
        """Largest bin d whose suffix count reaches kr; also the count above d, in d, and the total."""
        bins = tl.arange(0, 256)
        total = tl.sum(h, axis=0)
        suffix = total - tl.cumsum(h, axis=0) + h  # entries in bins >= b
        d = tl.max(tl.where(suffix >= kr, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > d, h, 0), axis=0)
        in_d = tl.sum(tl.where(bins == d, h, 0), axis=0)
        return d, above, in_d, total

    @triton.jit
    def _extend(prefix, d, LEVEL: tl.constexpr):
        """Append digit d (chosen at LEVEL) to the signed prefix."""
        if LEVEL == 0:
            return d - 128
        else:
            return prefix * 256 + d

    @triton.jit
    def _fill(out_row, lo, hi, value, K: tl.constexpr, FB: tl.constexpr):
        """out_row[lo:hi] = value (hi <= K)."""
        for s in range(0, K, FB):
            o = s + tl.arange(0, FB)
            tl.store(out_row + o, tl.full([FB], value, tl.int32), mask=(o >= lo) & (o < hi))

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
                m = m & _matches(key, prefix, LEVEL)
                # Later levels match few entries: skip the (costly) histogram on empty blocks.
                if tl.sum(m.to(tl.int32), axis=0) > 0:
                    h += tl.histogram(_digit(key, LEVEL), 256, mask=m)
        return h

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
            # Radix select, one byte per pass: prefix = the top bytes of the k-th key so far,
            # kr = how many entries still to take from inside that prefix.
            h = _row_hist(srow, n, 0, 0, BLOCK)
            d, above, _c, _t = _pick_digit(h, K)
            prefix = _extend(0, d, 0)
            kr = K - above
            h = _row_hist(srow, n, prefix, 1, BLOCK)
            d, above, _c, _t = _pick_digit(h, kr)
            prefix = _extend(prefix, d, 1)
            kr = kr - above
            h = _row_hist(srow, n, prefix, 2, BLOCK)
            d, above, _c, _t = _pick_digit(h, kr)
            prefix = _extend(prefix, d, 2)
            kr = kr - above
            h = _row_hist(srow, n, prefix, 3, BLOCK)
            d, above, _c, _t = _pick_digit(h, kr)
            thr = _extend(prefix, d, 3)  # the k-th largest key
            need_eq = kr - above  # >= 1 entries equal to thr to take, lowest index first
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

    # ---- persistent path: a resident grid looping over (row, chunk) items, five launches.

    @triton.jit
    def _derive(wrow, n, K: tl.constexpr, LEVELS: tl.constexpr):
        """Prefix, remaining count and error flag after LEVELS finished histograms of the row.

        The error flag is set when a histogram does not sum to the count the previous level
        expects, i.e. the counters were not zero at launch.
        """
        bins = tl.arange(0, 256)
        prefix = 0
        kr = K
        expected = n
        bad = n < 0  # False, as a tensor
        for lvl in tl.static_range(LEVELS):
            h = tl.load(wrow + lvl * 256 + bins)
            d, above, in_d, total = _pick_digit(h, kr)
            bad = bad | (total != expected)
            prefix = _extend(prefix, d, lvl)
            kr = kr - above
            expected = in_d
        return prefix, kr, bad

    @triton.jit
    def _p_hist_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, cinfo_ptr, chist_ptr, W, n_items, CPR,
        LEVEL: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, WS: tl.constexpr,
    ):
        """Level-LEVEL histogram of every long row, accumulated over its chunks with atomics.

        Level 3 (the last byte) also keeps each chunk's own histogram and its count of entries
        above the 24-bit prefix, so the write pass can place every chunk without a count pass.
        """
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK)
        bins = tl.arange(0, 256)
        for item in range(pid, n_items, nprog):
            row = item // CPR
            chunk = item % CPR
            slot = row.to(tl.int64) * CPR + chunk  # == item, as a 64-bit tensor
            start = chunk * CHUNK
            n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), W)
            if n > K:
                wrow = ws_ptr + row.to(tl.int64) * WS
                prefix, _kr, _bad = _derive(wrow, n, K, LEVEL)
                c = start + offs
                m = c < n
                key = _keys(tl.load(scores_ptr + row.to(tl.int64) * stride_s + c, mask=m, other=0.0))
                if LEVEL > 0:
                    m = m & _matches(key, prefix, LEVEL)
                count = tl.sum(m.to(tl.int32), axis=0)
                if count > 0:
                    h = tl.histogram(_digit(key, LEVEL), 256, mask=m)
                    tl.atomic_add(wrow + LEVEL * 256 + bins, h, mask=h > 0, sem="relaxed")
                    if LEVEL == 3:
                        suffix = count - tl.cumsum(h, axis=0) + h
                        tl.store(chist_ptr + slot * 256 + bins, suffix)
                if LEVEL == 3:
                    above = tl.sum(((c < n) & ((key >> 8) > prefix)).to(tl.int32), axis=0)
                    tl.store(cinfo_ptr + slot * 2, above)
                    tl.store(cinfo_ptr + slot * 2 + 1, count)

    @triton.jit
    def _p_write_kernel(
        scores_ptr, stride_s, lengths_ptr, ws_ptr, cinfo_ptr, chist_ptr, out_ptr, stride_o, W, n_items, CPR,
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
                thr, need_eq, bad = _derive(ws_ptr + row.to(tl.int64) * WS, n, K, 4)
                if bad:
                    # Counters were not zero at launch: poison the row (detectable, never a hang).
                    if chunk == 0:
                        _fill(orow, 0, K, -2, K, FB)
                else:
                    n_gt = K - need_eq
                    d4 = thr & 255
                    # Entries above / equal to thr in the earlier chunks of this row.
                    before = cidx < chunk
                    first = row.to(tl.int64) * CPR
                    above24 = tl.load(cinfo_ptr + (first + cidx) * 2, mask=before, other=0)
                    has4 = before & (tl.load(cinfo_ptr + (first + cidx) * 2 + 1, mask=before, other=0) > 0)
                    suf_d = tl.load(chist_ptr + (first + cidx) * 256 + d4, mask=has4, other=0)
                    suf_next = tl.load(chist_ptr + (first + cidx) * 256 + d4 + 1, mask=has4 & ((cidx * 0 + d4) < 255), other=0)
                    gt_base = tl.sum(above24 + suf_next, axis=0)
                    eq_base = tl.sum(suf_d - suf_next, axis=0)
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
    block = min(8192, max(1024, _next_pow2(width)))
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
            zeroing and its replays at long lengths run on stale counters (the rows then
            come out as -2). Never set it outside the regression test.

    Memory: the output (max_rows x k int32); for the persistent path also 4 KiB of counters
    per row and 1 KiB per chunk (at most num_programs + max_rows * (ceil(max_width / 8192) + 1)
    chunks, e.g. ~9 MiB for 256 rows x 256K columns).

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
        if backend == "auto":
            # Static facts only; on the CPU auto means the reference (the CPU path), while
            # "standard"/"persistent" run Triton there only under TRITON_INTERPRET=1 (tests).
            on_gpu = _HAVE_TRITON and self.device.type == "cuda"
            self.path = auto_path(max_rows, max_width) if on_gpu else "torch"
        else:
            self.path = backend
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
            # Items of any call: chunks >= 1024 and about one item per program until chunks reach
            # 8192, so at most num_programs + max_rows * (ceil(max_width / 8192) + 1); a _tile
            # override may need more.
            tile = _tile or 8192
            self._items_cap = max(
                self.num_programs + max_rows * (-(-max_width // 8192) + 1), max_rows * -(-max_width // tile)
            )
            # The level histograms are the counters that must be zero at launch (zeroed per call).
            self.workspace = torch.zeros((max_rows, _WS_STRIDE), dtype=torch.int32, device=self.device)
            # Per-chunk facts for the write pass; written before they are read, never zeroed.
            self.chunk_info = torch.zeros((self._items_cap, 2), dtype=torch.int32, device=self.device)
            self.chunk_hist = torch.zeros((self._items_cap, 256), dtype=torch.int32, device=self.device)

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
        if n_items > self._items_cap or cpr > self._cpr_p2:
            raise ValueError(f"{rows} x {width} needs {n_items} chunks, more than the {self._items_cap} planned")
        grid = (min(self.num_programs, n_items),)
        common = dict(K=self.k, CHUNK=chunk, WS=_WS_STRIDE, num_warps=warps)
        args = (scores, scores.stride(0), lengths, ws, self.chunk_info, self.chunk_hist)
        for level in range(4):
            _p_hist_kernel[grid](*args, width, n_items, cpr, LEVEL=level, **common)
        _p_write_kernel[grid](
            *args, out, out.stride(0), width, n_items, cpr,
            CPR_P2=self._cpr_p2, FB=min(1024, _next_pow2(self.k)), **common,
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
