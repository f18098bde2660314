"""Top-k launch planning from static facts: constants, block and chunk sizes, the "auto" path."""
from __future__ import annotations

import torch

from ..dispatch import num_sms

BACKENDS = ("auto", "standard", "persistent", "torch")

# Persistent workspace, per row (int32, zeroed every call): two arrival counters, the
# candidate count, the bound, then the G group maxima.
WS_ARRIVE1, WS_ARRIVE2, WS_TOTAL, WS_BOUND, WS_GMAX = 0, 1, 2, 3, 16
LB_STEPS = 8  # the bound's search: 2 bits per step, so the top 16 bits of the key
FALLBACK_BLOCK = 1024  # the exact fallback's block (small: its histograms are register-hungry)
STD_PROGRAMS_PER_SM = 2  # standard-path grid cap (and candidate buffers) per SM
# Persistent-path grid cap per SM. Two, although the select kernel's registers fit one program
# per SM: with many chunks (8 x 256K: 256) the second program of an SM is queued as its own item
# rather than looped over, which is faster (tools/topk_phases.py times it).
PERSISTENT_PROGRAMS_PER_SM = 2
BOUND_CHUNK_MAX = 32768  # the persistent bound kernel's longest chunk (see _bound_chunk)
KEY_NEG_INF = -2139095041  # the int32 key of -inf

# "auto" crossover (docs/performance.md; `topk_bench --sweep-ks 512,1024` prints the suggestion): the
# persistent path is picked when a step has at most this many rows for its padded width (width limits
# ascending; the last is unbounded), i.e. where it was >= 1.3x faster than the standard path at every
# row count up to the limit in the sweep, at k = 512 and 1024 (graph replay on the H200). Up to 16K
# columns it never was; 64 rows pass at 128K columns but not at 64K, so widths between keep 32.
_AUTO_MAX_ROWS_PERSISTENT = ((16384, 0), (32768, 16), (131071, 32), (1 << 62, 64))


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _capacity(k: int) -> int:
    """Candidate buffer entries per row (a power of two >= 4k)."""
    return _next_pow2(max(4 * k, 1024))


def _persistent_groups(k: int) -> int:
    """G of the persistent path: strided groups per row (>= k so that the bound exists).
    Not G = k: the k-th largest of k maxima is their minimum, far below the k-th score, and
    rows overflow to the exact fallback, about 50x slower (1 x 256K, k = 1024, on the H200)."""
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
    ones at 1 x 256K: fewer items, fewer atomics per row; at 8 x 128K one wave of 8K chunks beats
    two waves of 4K ones). Where 8K chunks still make more items than resident programs (8 x 256K:
    256 for 132 SMs), an item is several adjacent chunks of one row, done in turn, so the grid is
    one wave: in a second wave the rows whose last chunk arrives late would start their finish (a
    one-program phase) only after it."""
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
    and the atomics on the same G words contend, so fewer, longer chunks win (16K beat 4K-8K
    chunks; with many rows 32K chunks beat 16K, without spills; 64K chunks spill). With few rows,
    32K chunks gained nothing with the scores in HBM and halve the programs that read them."""
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

