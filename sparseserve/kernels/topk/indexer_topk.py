"""`IndexerTopK`, the engine's graph-safe top-k object, and the allocating `topk_indices`."""
from __future__ import annotations

import torch

from ... import envs
from .persistent import _p_bound_kernel, _p_select_kernel
from .plan import (BACKENDS, FALLBACK_BLOCK, LB_STEPS, PERSISTENT_PROGRAMS_PER_SM, STD_PROGRAMS_PER_SM, WS_GMAX,
                   _bound_chunk, _capacity, _next_pow2, _num_sms, _persistent_config, _persistent_groups, _warps,
                   auto_path)
from .ref import topk_indices_ref
from .search import _HAVE_TRITON
from .standard import _launch_standard, _shared_candidates


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
            per item (1: every chunk its own item).
        _pair_chunks: benchmark/test-only: True pairs the select kernel's chunks even in items of one
            chunk, False never; None (default): in items of two or more.
        _bound_chunk, _bound_warps: benchmark/test-only CHUNK and warps of the persistent bound kernel
            alone.
        _finish_gather: benchmark/test-only: True (default) writes tie-free rows straight from the
            candidate buffer's order (two in-register gathers); False reorders the buffer in memory
            first (slower on the H200).
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
        so that any graph capturing the call records it (docs/design.md, invariant 2). (The graph-audit
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

