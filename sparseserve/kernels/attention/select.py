"""Which attention kernel runs a call, with which tiles and row splits: chosen from static shapes only.

A captured CUDA graph keeps the launch it recorded, so nothing here looks at the data (docs/design.md,
invariant 3): the inputs are the token count, the heads, the row-list width (from `max_model_len`), the head
dimension, the SM count and whether the Hopper kernel can serve the shapes.

The table, first matching row wins (`wide` = tokens x heads / 64, the (token, 64-head) programs):

| row | when                                               | kernel | heads/program | rows/tile | row splits          |
|-----|----------------------------------------------------|--------|---------------|-----------|---------------------|
| 1   | Hopper shapes (`hopper_supported`), wide >= 8      | hopper | 64            | 64        | fill one wave, <= 16, >= 32 rows each; a list of <= 3 tiles only into one-tile splits |
| 2   | heads >= 64, wide >= 3/4 of the SMs, D <= 128      | triton | 64            | 64        | none                |
| 3   | heads >= 64, wide >= 8 x the SMs (D > 128)         | triton | 64            | 64        | none                |
| 4   | heads >= 64, wide >= 3/4 of the SMs (D > 128)      | triton | 64            | 32        | none                |
| 5   | otherwise (small batches, few heads)               | triton | 16            | 64        | up to 2 programs per SM, <= 8, >= 64 rows each |

Packed FP8 rows (`kv_cache_dtype="fp8"`) have their own rows, ahead of these (`hopper_supported` is False for
them): the portable Triton kernel, which dequantizes each tile it gathers.

| row | when (FP8 rows)   | kernel | heads/program | rows/tile | warps, stages | row splits                                 |
|-----|-------------------|--------|---------------|-----------|---------------|--------------------------------------------|
| F1  | heads >= 64       | triton | 64            | 64        | 8, 2          | fill one wave, <= 16, >= 64 rows each      |
| F2  | otherwise         | triton | 16            | 32        | 4, 2          | fill one wave, <= 16, >= 64 rows each      |

Why: a tile is dequantized once per program, so all 64 heads share one program (with 16-head blocks each of a
token's four programs converted the same tile); the row splits then fill the chip at small batches instead.
At 64 heads, 64-row tiles in two stages beat 32-row tiles (two or three stages) by 15-20% on every decode cell of
`benchmarks/kv_fp8_bench.py` (batch 64 and 256, 32K and 128K context, CSA and HCA) at the same error; the 16-head
form keeps 32-row tiles. Registers: a few hundred bytes of spills at 64 heads under Triton 3.9 (as the bf16
64-head variants: the [64, 512] fp32 accumulator takes half the registers); `tools/kernel_resources.py
--fp8-engine` reports each launched form.

Named alternative, not in the engine's table (untimed against F1 until `benchmarks/kv_fp8_bench.py` has run on the
H200): `fp8_hopper_attention_config`, row FH, the role-split Hopper kernel's FP8 form (`hopper_fp8.py`: its output
warpgroups dequantize the rows into shared memory, the bf16 products unchanged), split or not, where
`hopper_fp8.hopper_fp8_supported` holds (bf16 q, V4's 592-byte rows).

| row | when (FP8 rows, named config) | kernel | heads/program | rows/tile | row splits                   |
|-----|-------------------------------|--------|---------------|-----------|------------------------------|
| FH  | `hopper_fp8_supported`        | hopper | 64            | 64        | as row 1 (the role-split kernel takes the splits too) |

The Hopper kernel is two Gluon kernels sharing `hopper_common.py`: unsplit calls (prefill, decode batches that fill
the chip) run the role-split kernel (`hopper.py`), split calls the lockstep kernel (`hopper_split.py`), whose short
units do not pay for the roles' hand-overs (docs/performance.md: each is the faster one on its calls).

Why: with many programs a 64-row KV tile feeds an M = 64 product and is read once for all heads; with few, the
rows are split across programs (flash-decoding) and merged, so small decode batches still spread over the chip.
Hopper splits of exactly one tile skip the band pre-pass (`needs_band_prepass`). A list of at most three tiles
(HCA at 4K) is split only where the splits become single tiles: cutting 3 tiles into 2 + 1 saves less than the
partials' traffic and the merge cost (batch 64: 1.15x slower than unsplit). The measurements behind each row
are in docs/performance.md ("Attention").
"""
from __future__ import annotations

from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (the launch path and start-up's warm-up plan call the table often:
    `triton.cdiv` is a far slower wrapper)."""
    return -(-a // b)


HOPPER_MIN_PROGRAMS = 8  # fewer (token, 64-head) programs keep the Triton 16-head path (row 5)
HOPPER_SPLIT_MAX = 16
HOPPER_SPLIT_MIN_ROWS = 32
TRITON_SPLIT_MAX = 8
TRITON_SPLIT_MIN_ROWS = 64
FP8_SPLIT_MAX = 16
FP8_SPLIT_MIN_ROWS = 64
MERGE_HEADS = 4  # heads per merge program (a batch-1 token gets 16 merge programs at 64 heads)
MERGE_COLS = 256  # value columns per merge program


@dataclass(frozen=True)
class AttnConfig:
    """One launch: `kernel` is "triton" (portable) or "hopper" (Gluon, sm_90). block_h heads and block_n rows per
    tile, num_splits pieces of the row list (merged after), band_prepass: each (token, split)'s valid band comes
    from a separate kernel (the 64-head variants keep their registers for the accumulator).
    The engine's configs come from `attention_config`; tests pass others to reach every path."""

    kernel: str
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    band_prepass: bool = False
    max_programs: int = 0  # hopper: at most this many persistent programs (0: one per SM)


def attention_config(num_tokens: int, num_heads: int, num_rows: int, head_dim: int, num_sms: int,
                     hopper: bool = False, fp8: bool = False) -> AttnConfig:
    """The tables above. `hopper`: the Hopper kernel can serve these tensors (`hopper.hopper_supported`); `fp8`:
    the pool holds packed FP8 rows (rows F1, F2)."""
    if fp8:
        return fp8_attention_config(num_tokens, num_heads, num_rows, num_sms)
    wide = num_tokens * _cdiv(num_heads, 64)
    if hopper and num_heads % 64 == 0 and head_dim == 512 and wide >= HOPPER_MIN_PROGRAMS:
        return AttnConfig("hopper", 64, 64, 4, 2, _hopper_splits(wide, num_rows, num_sms), band_prepass=True)
    if num_heads >= 64 and 4 * wide >= 3 * num_sms:
        if head_dim <= 128 or wide >= 8 * num_sms:
            return AttnConfig("triton", 64, 64, 4 if head_dim <= 128 else 8, 2, band_prepass=True)
        return AttnConfig("triton", 64, 32, 8, 3, band_prepass=True)
    programs = num_tokens * _cdiv(num_heads, 16)
    max_splits = min(TRITON_SPLIT_MAX, max(1, num_rows // TRITON_SPLIT_MIN_ROWS))
    splits = 1
    while splits * 2 <= max_splits and programs * splits * 2 <= 2 * num_sms:  # powers of 2: few compiles
        splits *= 2
    return AttnConfig("triton", 16, 64, 4, 2, splits)


def fp8_attention_config(num_tokens: int, num_heads: int, num_rows: int, num_sms: int) -> AttnConfig:
    """Rows F1 and F2 of the table (packed FP8 rows)."""
    block_h = 64 if num_heads >= 64 else 16
    programs = num_tokens * _cdiv(num_heads, block_h)
    splits = _splits(programs, num_rows, FP8_SPLIT_MAX, FP8_SPLIT_MIN_ROWS, num_sms)
    if block_h == 64:
        return AttnConfig("triton", 64, 64, 8, 2, splits, band_prepass=True)
    return AttnConfig("triton", 16, 32, 4, 2, splits)


def fp8_hopper_attention_config(num_tokens: int, num_heads: int, num_rows: int, num_sms: int) -> AttnConfig:
    """Row FH (named, not the engine's: see the module docstring): the role-split Hopper kernel's FP8 form, with
    row 1's splits. For calls where `hopper_fp8.hopper_fp8_supported` holds (64-head multiples, D = 512)."""
    wide = num_tokens * _cdiv(num_heads, 64)
    return AttnConfig("hopper", 64, 64, 4, 2, _hopper_splits(wide, num_rows, num_sms), band_prepass=True)


def _hopper_splits(wide: int, num_rows: int, num_sms: int) -> int:
    """Row 1's splits: fill one wave, a list of at most three tiles only into one-tile splits."""
    splits = _splits(wide, num_rows, HOPPER_SPLIT_MAX, HOPPER_SPLIT_MIN_ROWS, num_sms)
    if _cdiv(num_rows, 64) <= 3 and _cdiv(_cdiv(num_rows, splits), 64) > 1:
        splits = 1  # a short list splits only into one-tile splits (see the table)
    return splits


def _splits(programs: int, num_rows: int, max_splits: int, min_rows: int, num_sms: int) -> int:
    """The largest power of two <= max_splits that keeps programs x splits within one wave and >= min_rows rows
    per split."""
    splits = 1
    while splits * 2 <= max_splits and programs * splits * 2 <= num_sms and num_rows >= splits * 2 * min_rows:
        splits *= 2
    return splits


def split_length(num_rows: int, cfg: AttnConfig) -> int:
    """Row slots per split: the list cut into cfg.num_splits pieces, each a whole number of tiles."""
    return _cdiv(_cdiv(max(num_rows, 1), cfg.num_splits), cfg.block_n) * cfg.block_n


def needs_band_prepass(cfg: AttnConfig, rows_per_split: int) -> bool:
    """Whether the launch runs the band pre-pass first. Hopper splits of one tile need none: the tile masks its
    holes anyway and an all-holes split is known from its row ids, so the pre-pass and its graph node are saved."""
    if cfg.kernel == "hopper" and rows_per_split == cfg.block_n:
        return False
    return cfg.band_prepass
