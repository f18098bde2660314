"""The standard top-k path: one program per row, all steps in one launch."""
from __future__ import annotations

import torch

try:  # Triton is optional on the CPU path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False

from ..pdl import pdl_args, wait_for_prior_grid
from .plan import FALLBACK_BLOCK, LB_STEPS, _capacity, _next_pow2, _standard_config, _warps

if _HAVE_TRITON:
    from .search import (  # the jit helpers the kernels call
        _bound_key,
        _bound_search,
        _compact,
        _exact_row,
        _key_float,
        _keys,
        _load_scores,
        _select_buffer,
        _write_chosen,
    )

    # ---- standard path: one program per row (grid-stride when rows exceed the grid)

    @triton.jit(do_not_specialize=["stride_s", "R", "W", "ONE"])
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

