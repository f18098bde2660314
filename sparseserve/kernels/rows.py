"""Row-list construction: from the step's metadata to the pool rows each kernel reads.

Every row is derived from a token's absolute position (docs/design.md, invariant 4):
- a position written in an earlier step lives in its sequence's ring:
  slot * ring_rows + position % ring_rows;
- a position of the current step lives in the staging region, at its token's index in
  the flat batch (so a chunk never reads a ring row it has itself overwritten);
- compressed entry w lives in a paged block: comp_base + block_table[seq, w // epb] * epb + w % epb.
All functions here are device-side tensor code with static output shapes.

Each builder has a plain-PyTorch reference (`*_ref`, the CPU path and the test oracle) and a
Triton kernel that builds the whole list in one launch; the public names dispatch on the
device (a static fact): Triton on CUDA, the reference elsewhere. No host sync anywhere, so
all of them can be captured in a CUDA graph. Outputs are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton
from .pdl import pdl_args, wait_for_prior_grid


# ---------------------------------------------------------------------------------------------
# References (CPU path, test oracle)
# ---------------------------------------------------------------------------------------------


def source_rows_ref(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_token_offset: torch.Tensor,
    seq_slots: torch.Tensor,
    offsets: torch.Tensor,
    ring_rows: int,
    staging_base: int,
) -> torch.Tensor:
    """Rows [T, n] of positions `positions[t] + offsets` of each token's sequence (-1 before 0)."""
    src = positions.unsqueeze(1) + offsets.unsqueeze(0)
    start = seq_start[token_seq].unsqueeze(1)
    staging = staging_base + seq_token_offset[token_seq].unsqueeze(1) + (src - start)
    ring = seq_slots[token_seq].unsqueeze(1) * ring_rows + src.remainder(ring_rows)
    rows = torch.where(src >= start, staging, ring)
    return torch.where(src >= 0, rows, torch.full_like(rows, -1))


def ring_write_rows_ref(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_num_tokens: torch.Tensor,
    seq_slots: torch.Tensor,
    ring_rows: int,
    trash_row: int,
) -> torch.Tensor:
    """Ring row [T] each token's state is committed to after the step; only the last
    `ring_rows` positions of a sequence's chunk are kept (earlier ones go to the trash row),
    so no two tokens of one step write the same ring row."""
    last = (seq_start + seq_num_tokens - 1)[token_seq]
    rows = seq_slots[token_seq] * ring_rows + positions.remainder(ring_rows)
    keep = positions > last - ring_rows
    return torch.where(keep, rows, torch.full_like(rows, trash_row))


def entry_pool_rows_ref(
    entry_ids: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    entries_per_block: int,
    comp_base: int,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool rows of compressed entries `entry_ids [T, K]` (-1 stays -1), after the `prefix` rows
    [T, P] if given (a layer's window rows: the row list attention reads)."""
    ids = entry_ids.long()
    safe = ids.clamp(min=0)
    block_col = (safe // entries_per_block).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[token_seq].long().gather(1, block_col)
    rows = comp_base + blocks * entries_per_block + safe % entries_per_block
    rows = torch.where((ids >= 0) & (blocks >= 0), rows, torch.full_like(rows, -1))
    return rows if prefix is None else torch.cat([prefix.long(), rows], dim=1)


def visible_entry_ids(positions: torch.Tensor, rate: int, num_entries: int) -> torch.Tensor:
    """Entry ids [T, num_entries]: w where w < (t + 1) // rate, else -1."""
    entries = torch.arange(num_entries, device=positions.device).unsqueeze(0)
    visible = entries < ((positions + 1) // rate).unsqueeze(1)
    return torch.where(visible, entries, torch.full_like(entries, -1))


def visible_counts_ref(positions: torch.Tensor, rate: int, num_entries: int) -> torch.Tensor:
    """Entries [T] visible to each token of a CSA layer (int32): those whose window closed at or
    before it, at most num_entries."""
    return ((positions + 1) // rate).clamp(max=num_entries).to(torch.int32)


def visible_pool_rows_ref(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    num_entries: int,
    entries_per_block: int,
    comp_base: int,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool rows [T, num_entries] of every entry visible to each token (HCA), -1 elsewhere; after
    the `prefix` rows [T, P] if given."""
    ids = visible_entry_ids(positions, rate, num_entries)
    return entry_pool_rows_ref(ids, token_seq, block_table, entries_per_block, comp_base, prefix)


def emit_pool_rows_ref(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    entries_per_block: int,
    comp_base: int,
    trash_row: int,
) -> torch.Tensor:
    """Pool row [M] each emitting token writes its entry to; tokens that close no window
    write the trash row (no host branch on whether a window closed). With trash_row = -1
    the compressor kernel skips them entirely (no reads, no write)."""
    closes = (positions + 1).remainder(rate) == 0
    entry = ((positions + 1) // rate - 1).clamp(min=0)
    rows = entry_pool_rows_ref(entry.unsqueeze(1), token_seq, block_table, entries_per_block, comp_base).squeeze(1)
    return torch.where(closes & (rows >= 0), rows, torch.full_like(rows, trash_row))


# ---------------------------------------------------------------------------------------------
# Triton kernels (one launch per list)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _floor_mod(a, b):
    # Python/torch `remainder` for b > 0, whatever the backend's sign rule for `%` is.
    r = a % b
    return tl.where(r < 0, r + b, r)


@triton.jit
def _entry_row(ids, seq, bt_ptr, stride_bt, max_blocks, epb, comp_base):
    """Pool row of entry ids (same rule as entry_pool_rows_ref; ids < 0 -> -1)."""
    safe = tl.maximum(ids, 0)
    col = tl.minimum(safe // epb, max_blocks - 1)
    block = tl.load(bt_ptr + seq * stride_bt + col).to(tl.int64)
    rows = comp_base + block * epb + safe % epb
    return tl.where((ids >= 0) & (block >= 0), rows, -1)


@triton.jit(do_not_specialize=["num_tokens"])
def _source_rows_kernel(
    pos_ptr, seq_ptr, start_ptr, tok_off_ptr, slots_ptr, offs_ptr, out_ptr,
    num_tokens, num_offs, ring_rows, staging_base, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_grid(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < num_tokens
    nmask = n < num_offs
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + t, mask=tmask, other=0).to(tl.int64)
    start = tl.load(start_ptr + seq, mask=tmask, other=0).to(tl.int64)
    tok_off = tl.load(tok_off_ptr + seq, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seq, mask=tmask, other=0).to(tl.int64)
    off = tl.load(offs_ptr + n, mask=nmask, other=0).to(tl.int64)
    src = pos[:, None] + off[None, :]
    staging = staging_base + tok_off[:, None] + (src - start[:, None])
    ring = slot[:, None] * ring_rows + _floor_mod(src, ring_rows)
    rows = tl.where(src >= start[:, None], staging, ring)
    rows = tl.where(src >= 0, rows, -1)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_out + n[None, :], rows,
             mask=tmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _ring_write_rows_kernel(
    pos_ptr, seq_ptr, start_ptr, ntok_ptr, slots_ptr, out_ptr,
    num_tokens, ring0, trash0, ring1, trash1, ring2, trash2, ring3, trash3,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    # Up to four rings in one launch: program_id(1) picks the ring, out is [rings, T].
    wait_for_prior_grid(PDL)
    r = tl.program_id(1)
    ring_rows = tl.where(r == 0, ring0, tl.where(r == 1, ring1, tl.where(r == 2, ring2, ring3))).to(tl.int64)
    trash_row = tl.where(r == 0, trash0, tl.where(r == 1, trash1, tl.where(r == 2, trash2, trash3))).to(tl.int64)
    out_ptr += r.to(tl.int64) * num_tokens
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + t, mask=tmask, other=0).to(tl.int64)
    last = (tl.load(start_ptr + seq, mask=tmask, other=0).to(tl.int64)
            + tl.load(ntok_ptr + seq, mask=tmask, other=0).to(tl.int64) - 1)
    slot = tl.load(slots_ptr + seq, mask=tmask, other=0).to(tl.int64)
    rows = slot * ring_rows + _floor_mod(pos, ring_rows)
    rows = tl.where(pos > last - ring_rows, rows, trash_row)
    tl.store(out_ptr + t, rows, mask=tmask)


@triton.jit(do_not_specialize=["num_tokens", "num_cols", "stride_out"])
def _entry_rows_kernel(
    ids_ptr, pos_ptr, seq_ptr, bt_ptr, out_ptr, pre_ptr,
    num_tokens, num_cols, stride_ids, stride_bt, max_blocks, epb, comp_base, rate, stride_out, pre_cols, stride_pre,
    VISIBLE: tl.constexpr,  # ids are the visible entries of each token's position (HCA)
    HAS_PREFIX: tl.constexpr,  # out = prefix rows [T, pre_cols], then the entries' rows
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_grid(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output column
    e = n - pre_cols  # entry column (< 0: a prefix column)
    tmask = t < num_tokens
    mask = tmask[:, None] & (e < num_cols)[None, :]
    emask = mask & (e >= 0)[None, :]
    seq = tl.load(seq_ptr + t, mask=tmask, other=0).to(tl.int64)
    if VISIBLE:
        pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
        p1 = pos + 1
        closed = (p1 - _floor_mod(p1, rate)) // rate  # floor((t + 1) / rate), exact division
        ids = tl.where((e[None, :] >= 0) & (e[None, :] < closed[:, None]), e[None, :].to(tl.int64), -1)
    else:
        ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * stride_ids + e[None, :], mask=emask, other=-1).to(tl.int64)
    # Masked-off lanes have ids -1 and seq 0: their (clamped) block-table read stays in bounds.
    rows = _entry_row(ids, seq[:, None], bt_ptr, stride_bt, max_blocks, epb, comp_base)
    if HAS_PREFIX:
        pmask = mask & (e < 0)[None, :]
        pre = tl.load(pre_ptr + t[:, None].to(tl.int64) * stride_pre + n[None, :], mask=pmask, other=-1)
        rows = tl.where((e < 0)[None, :], pre.to(tl.int64), rows)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_out + n[None, :], rows, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _emit_pool_rows_kernel(
    pos_ptr, seq_ptr, bt_ptr, out_ptr, out2_ptr,
    num_tokens, stride_bt, max_blocks, rate, epb, comp_base, base2, trash_row,
    BLOCK_T: tl.constexpr, HAS_SECOND: tl.constexpr,
    PDL: tl.constexpr,
):
    # HAS_SECOND: also the rows of a second pool with the same paging at base2 (out2).
    wait_for_prior_grid(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + t, mask=tmask, other=0).to(tl.int64)
    p1 = pos + 1
    rem = _floor_mod(p1, rate)
    entry = tl.maximum((p1 - rem) // rate - 1, 0)
    rows = _entry_row(entry, seq, bt_ptr, stride_bt, max_blocks, epb, comp_base)
    emits = (rem == 0) & (rows >= 0)
    tl.store(out_ptr + t, tl.where(emits, rows, trash_row), mask=tmask)
    if HAS_SECOND:
        tl.store(out2_ptr + t, tl.where(emits, rows - comp_base + base2, trash_row), mask=tmask)


@triton.jit(do_not_specialize=["num_tokens", "num_entries"])
def _visible_counts_kernel(pos_ptr, out_ptr, num_tokens, rate, num_entries, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < num_tokens
    closed = tl.load(pos_ptr + t, mask=mask, other=0) + 1
    count = (closed - _floor_mod(closed, rate)) // rate  # floor division for any sign
    tl.store(out_ptr + t, tl.minimum(count, num_entries).to(tl.int32), mask=mask)


_BLOCK_T = 8
_BLOCK_N = 128
_BLOCK_1D = 256


def _tiles(num_tokens: int, num_cols: int) -> tuple[int, int, tuple[int, int]]:
    block_n = min(_BLOCK_N, triton.next_power_of_2(max(num_cols, 1)))
    block_t = max(_BLOCK_T, 1024 // block_n)  # ~1K rows per program
    return block_t, block_n, (triton.cdiv(num_tokens, block_t), triton.cdiv(num_cols, block_n))


def _c(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def source_rows_triton(positions, token_seq, seq_start, seq_token_offset, seq_slots, offsets,
                       ring_rows: int, staging_base: int) -> torch.Tensor:
    num_tokens, num_offs = positions.shape[0], offsets.shape[0]
    out = torch.empty((num_tokens, num_offs), dtype=torch.int64, device=positions.device)
    if out.numel() == 0:
        return out
    block_t, block_n, grid = _tiles(num_tokens, num_offs)
    _source_rows_kernel[grid](
        _c(positions), _c(token_seq), _c(seq_start), _c(seq_token_offset), _c(seq_slots), _c(offsets), out,
        num_tokens, num_offs, int(ring_rows), int(staging_base), out.stride(0),
        BLOCK_T=block_t, BLOCK_N=block_n, **pdl_args(positions.device)
    )
    return out


MAX_RINGS_PER_LAUNCH = 4


def ring_write_rows_multi_triton(positions, token_seq, seq_start, seq_num_tokens, seq_slots,
                                 rings: list[tuple[int, int]]) -> list[torch.Tensor]:
    """ring_write_rows for each (ring_rows, trash_row) of `rings` (at most 4), in one launch."""
    if not 1 <= len(rings) <= MAX_RINGS_PER_LAUNCH:
        raise ValueError(f"one launch builds 1 to {MAX_RINGS_PER_LAUNCH} rings' rows, got {len(rings)}")
    num_tokens = positions.shape[0]
    out = torch.empty((len(rings), num_tokens), dtype=torch.int64, device=positions.device)
    if num_tokens:
        params = [int(v) for ring in rings for v in ring]
        params += [1, -1] * (MAX_RINGS_PER_LAUNCH - len(rings))
        _ring_write_rows_kernel[(triton.cdiv(num_tokens, _BLOCK_1D), len(rings))](
            _c(positions), _c(token_seq), _c(seq_start), _c(seq_num_tokens), _c(seq_slots), out,
            num_tokens, *params, BLOCK_T=_BLOCK_1D, **pdl_args(positions.device)
        )
    return list(out.unbind(0))


def ring_write_rows_triton(positions, token_seq, seq_start, seq_num_tokens, seq_slots,
                           ring_rows: int, trash_row: int) -> torch.Tensor:
    return ring_write_rows_multi_triton(positions, token_seq, seq_start, seq_num_tokens, seq_slots,
                                        [(ring_rows, trash_row)])[0]


def _entry_rows_launch(ids, positions, token_seq, block_table, num_cols: int, entries_per_block: int,
                       comp_base: int, rate: int, visible: bool, prefix: torch.Tensor | None) -> torch.Tensor:
    num_tokens = token_seq.shape[0]
    pre_cols = prefix.shape[1] if prefix is not None else 0
    out = torch.empty((num_tokens, pre_cols + num_cols), dtype=torch.int64, device=token_seq.device)
    if out.numel() == 0:
        return out
    if block_table.shape[1] == 0:  # the reference's gather cannot run either; nothing is paged
        raise ValueError("block_table has no columns")
    block_table = _c(block_table)
    prefix = _c(prefix) if prefix is not None else out
    block_t, block_n, grid = _tiles(num_tokens, pre_cols + num_cols)
    _entry_rows_kernel[grid](
        ids, positions, _c(token_seq), block_table, out, prefix,
        num_tokens, num_cols, ids.stride(0), block_table.stride(0), block_table.shape[1],
        int(entries_per_block), int(comp_base), int(rate), out.stride(0), pre_cols, prefix.stride(0),
        VISIBLE=visible, HAS_PREFIX=pre_cols > 0, BLOCK_T=block_t, BLOCK_N=block_n, **pdl_args(ids.device)
    )
    return out


def entry_pool_rows_triton(entry_ids, token_seq, block_table, entries_per_block: int, comp_base: int,
                           prefix: torch.Tensor | None = None) -> torch.Tensor:
    ids = _c(entry_ids)
    return _entry_rows_launch(ids, ids, token_seq, block_table, ids.shape[1], entries_per_block, comp_base, 1, False,
                              prefix)


def visible_pool_rows_triton(positions, token_seq, block_table, rate: int, num_entries: int,
                             entries_per_block: int, comp_base: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    pos = _c(positions)
    return _entry_rows_launch(pos.unsqueeze(1), pos, token_seq, block_table, num_entries, entries_per_block,
                              comp_base, rate, True, prefix)


def emit_pool_rows_triton(positions, token_seq, block_table, rate: int, entries_per_block: int,
                          comp_base: int, trash_row: int, second_base: int | None = None):
    """The rows at comp_base, and with `second_base` also those at second_base (a pair)."""
    num_tokens = positions.shape[0]
    out = torch.empty((num_tokens,), dtype=torch.int64, device=positions.device)
    out2 = torch.empty_like(out) if second_base is not None else out
    if num_tokens:
        block_table = _c(block_table)
        _emit_pool_rows_kernel[(triton.cdiv(num_tokens, _BLOCK_1D),)](
            _c(positions), _c(token_seq), block_table, out, out2,
            num_tokens, block_table.stride(0), block_table.shape[1], int(rate), int(entries_per_block),
            int(comp_base), int(second_base or 0), int(trash_row), BLOCK_T=_BLOCK_1D,
            HAS_SECOND=second_base is not None, **pdl_args(positions.device)
        )
    return (out, out2) if second_base is not None else out


def visible_counts_triton(positions, rate: int, num_entries: int) -> torch.Tensor:
    num_tokens = positions.shape[0]
    out = torch.empty((num_tokens,), dtype=torch.int32, device=positions.device)
    if num_tokens:
        _visible_counts_kernel[(triton.cdiv(num_tokens, _BLOCK_1D),)](
            _c(positions), out, num_tokens, int(rate), int(num_entries), BLOCK_T=_BLOCK_1D,
            **pdl_args(positions.device))
    return out


# ---------------------------------------------------------------------------------------------
# Dispatch (the names the model calls): Triton on CUDA, the reference elsewhere
# ---------------------------------------------------------------------------------------------


def source_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_token_offset: torch.Tensor,
    seq_slots: torch.Tensor,
    offsets: torch.Tensor,
    ring_rows: int,
    staging_base: int,
) -> torch.Tensor:
    """Rows [T, n] of positions `positions[t] + offsets` of each token's sequence (-1 before 0)."""
    fn = source_rows_triton if use_triton("rows", positions) else source_rows_ref
    return fn(positions, token_seq, seq_start, seq_token_offset, seq_slots, offsets, ring_rows, staging_base)


def ring_write_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_num_tokens: torch.Tensor,
    seq_slots: torch.Tensor,
    ring_rows: int,
    trash_row: int,
) -> torch.Tensor:
    """Ring row [T] each token's state is committed to after the step (see ring_write_rows_ref)."""
    fn = ring_write_rows_triton if use_triton("rows", positions) else ring_write_rows_ref
    return fn(positions, token_seq, seq_start, seq_num_tokens, seq_slots, ring_rows, trash_row)


def entry_pool_rows(
    entry_ids: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    entries_per_block: int,
    comp_base: int,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool rows of compressed entries `entry_ids [T, K]` (-1 stays -1), after the `prefix` rows
    [T, P] if given, in one launch (no cat after it)."""
    fn = entry_pool_rows_triton if use_triton("rows", entry_ids) else entry_pool_rows_ref
    return fn(entry_ids, token_seq, block_table, entries_per_block, comp_base, prefix)


def visible_pool_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    num_entries: int,
    entries_per_block: int,
    comp_base: int,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """entry_pool_rows(visible_entry_ids(positions, rate, num_entries), ..., prefix) in one launch."""
    fn = visible_pool_rows_triton if use_triton("rows", positions) else visible_pool_rows_ref
    return fn(positions, token_seq, block_table, rate, num_entries, entries_per_block, comp_base, prefix)


def emit_pool_rows(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    entries_per_block: int,
    comp_base: int,
    trash_row: int,
) -> torch.Tensor:
    """Pool row [M] each emitting token writes its entry to (trash_row if it closes no window)."""
    fn = emit_pool_rows_triton if use_triton("rows", positions) else emit_pool_rows_ref
    return fn(positions, token_seq, block_table, rate, entries_per_block, comp_base, trash_row)


def visible_counts(positions: torch.Tensor, rate: int, num_entries: int) -> torch.Tensor:
    """Entries [T] visible to each token of a CSA layer, int32, in one launch (the reference's
    four elementwise kernels sat on the decode step's side-stream chain)."""
    fn = visible_counts_triton if use_triton("rows", positions) else visible_counts_ref
    return fn(positions, rate, num_entries)


def emit_pool_rows_pair(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    rate: int,
    entries_per_block: int,
    bases: tuple[int, int],
    trash_row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """emit_pool_rows at two bases of pools paged alike (a layer's KV and indexer entries), in one launch."""
    if use_triton("rows", positions):
        return emit_pool_rows_triton(positions, token_seq, block_table, rate, entries_per_block, bases[0],
                                     trash_row, bases[1])
    return tuple(emit_pool_rows_ref(positions, token_seq, block_table, rate, entries_per_block, base, trash_row)
                 for base in bases)


def ring_write_rows_multi(
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    seq_start: torch.Tensor,
    seq_num_tokens: torch.Tensor,
    seq_slots: torch.Tensor,
    rings: list[tuple[int, int]],
) -> list[torch.Tensor]:
    """ring_write_rows for every (ring_rows, trash_row) in `rings`: one launch per four rings."""
    if not use_triton("rows", positions):
        return [ring_write_rows_ref(positions, token_seq, seq_start, seq_num_tokens, seq_slots, ring, trash)
                for ring, trash in rings]
    out = []
    for i in range(0, len(rings), MAX_RINGS_PER_LAUNCH):
        out += ring_write_rows_multi_triton(positions, token_seq, seq_start, seq_num_tokens, seq_slots,
                                            rings[i:i + MAX_RINGS_PER_LAUNCH])
    return out
