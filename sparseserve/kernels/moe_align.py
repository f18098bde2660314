"""MoE alignment: the (token, slot) assignments sorted by expert on the device, each expert's
segment padded to BLOCK_M rows, in a buffer sized for the worst case (graph-capturable).

An assignment whose expert id is negative is skipped: it gets no row, so no expert computes it and
its output row is never written (the padding tokens of a prefill graph's bucket, which must not
make the experts read more weights)."""
from __future__ import annotations

import torch

try:  # Triton is optional: without it every path is the reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

from .. import envs  # noqa: E402 (after the optional Triton import)
from .pdl import pdl_args, wait_for_prior_grid  # noqa: E402

# Read once, at import, which is when Triton decides whether the kernels below are interpreted.
_INTERPRET = envs.triton_interpret()


def moe_align_sizes(num_assignments: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """Static worst-case (padded rows, tiles): only experts with >= 1 assignment are padded."""
    worst = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    num_blocks = (worst + block_m - 1) // block_m
    return num_blocks * block_m, num_blocks


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*k assignments by expert into a padded layout (device ops only, graph-safe).

    The reference of _moe_align_kernel, and the path for large batches (one sort beats the
    single-program kernel there).

    Returns sorted_ids int32 [padded rows]: the flat assignment index t*k+j of each row, or
    T*k for a padding row; block_expert int32 [tiles]: the expert of each BLOCK_M tile, -1
    for tiles past the used length. Within an expert, assignments keep their flat order; a
    negative expert id gets no row.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_assign = flat.numel()
    padded_rows, num_blocks = moe_align_sizes(num_assign, num_experts, block_m)
    sorted_e, order = torch.sort(flat, stable=True)  # skipped (negative) ids first
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=device))  # segment starts
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    expert = sorted_e.clamp(min=0)
    rank = torch.arange(num_assign, device=device) - bounds[expert]
    # Skipped assignments land in one extra row past the buffer, cut off below.
    pos = torch.where(sorted_e >= 0, padded_start[expert] + rank, padded_rows)
    sorted_ids = torch.full((padded_rows + 1,), num_assign, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    sorted_ids = sorted_ids[:padded_rows]
    tile_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


# One program does the whole alignment for small batches: at decode the dozen launches of
# moe_align_torch cost more than the kernel (about a third of the MoE's time at T=1 on the H200).
ALIGN_CHUNK = 32


def align_kernel_max_assign(num_experts: int) -> int:
    """Up to how many (token, slot) assignments the one-program kernel beats the torch ops.

    Its time grows with assignments x experts (a [CHUNK, E] one-hot per chunk); the torch ops
    (a sort and a dozen small launches) take a flat ~70 us up to ~3K assignments. On the H200,
    inside CUDA graphs (`moe_bench --align`), the kernel's time is a line in the padded expert
    count: ~0.025 us per assignment at 16 experts and ~0.070 us at 256; the crossover is where
    that line meets the torch ops' 70 us."""
    e_pad = max(16, triton.next_power_of_2(num_experts)) if HAS_TRITON else num_experts
    return int(70.0 / (0.0224 + 0.000187 * e_pad))


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_assign", "padded_rows", "num_blocks"])
    def _moe_align_kernel(
        ids_ptr, sorted_ids_ptr, block_expert_ptr,
        num_assign, num_experts, padded_rows, num_blocks,
        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_prior_grid(PDL)
        experts = tl.arange(0, E_PAD)
        lanes = tl.arange(0, CHUNK)
        # Pass 1: tokens per expert, via a [CHUNK, E] one-hot per chunk.
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for start in range(0, num_assign, CHUNK):
            offs = start + lanes
            e = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1).to(tl.int32)
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        padded_start = padded_end - padded
        for start in range(0, padded_rows, CHUNK):
            offs = start + lanes
            tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_assign, mask=offs < padded_rows)
        tl.debug_barrier()  # the padding fill lands before the scatter below overwrites it
        # Pass 2: row = segment start + earlier same-expert assignments (stable, in flat order).
        seen = tl.zeros([E_PAD], dtype=tl.int32)
        for start in range(0, num_assign, CHUNK):
            offs = start + lanes
            e = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1).to(tl.int32)
            onehot = (e[:, None] == experts[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0) - 1 + (padded_start + seen)[None, :]
            pos = tl.sum(onehot * rank, axis=1)
            tl.store(sorted_ids_ptr + pos, offs, mask=(offs < num_assign) & (e >= 0))  # e < 0: skipped
            seen += tl.sum(onehot, axis=0)
        # Tile -> expert: the number of segments that end at or before the tile's first row.
        for start in range(0, num_blocks, CHUNK):
            tiles = start + lanes
            ended = (padded_end[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32)
            expert = tl.sum(ended, axis=1)
            expert = tl.where(expert < num_experts, expert, -1)
            tl.store(block_expert_ptr + tiles, expert, mask=tiles < num_blocks)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as moe_align_torch, in one single-program launch."""
    num_assign = topk_ids.numel()
    padded_rows, num_blocks = moe_align_sizes(num_assign, num_experts, block_m)
    sorted_ids = torch.empty(padded_rows, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=topk_ids.device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert,
        num_assign, num_experts, padded_rows, num_blocks,
        BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, E_PAD=e_pad, num_warps=8 if e_pad >= 256 else 4, **pdl_args(topk_ids.device)
    )
    return sorted_ids, block_expert


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static choice (by T*k): the single-program kernel for small batches, torch ops otherwise."""
    if HAS_TRITON and (topk_ids.is_cuda or _INTERPRET) and topk_ids.numel() <= align_kernel_max_assign(num_experts):
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)


