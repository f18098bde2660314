"""An experimental knob: leave some SMs out of cuBLAS GEMMs (SPARSESERVE_SM_CARVEOUT=n).

At batch 1 a decode step's small kernels on the side stream (model/side_stream.py) only start
when a GEMM beside them frees SMs: the q_b GEMM (171 tiles on 132 SMs) holds every SM for ~24
us, and the CSA layer's KV and indexer chain waits (docs/performance.md, "Decode steps / Session
9"). A GEMM that reads weights at batch 1 needs far fewer than 132 SMs to reach the HBM rate, so
leaving n SMs free may let that chain run beside it. torch applies the carveout only on its
cuBLASLt paths (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), and plain bf16 GEMMs take the cuBLAS path
by default, so setting the knob also makes cuBLASLt torch's preferred BLAS library; n = 0 gives
that backend alone, with no SMs left out (session 10's first call ran 8/16/32 without the switch:
the decode steps did not move at all). Both settings are process-wide and read at each GEMM's
launch, captured graphs included: set once, at start-up, so eager and graph steps pick the same
GEMM kernels (the same numbers)."""
from __future__ import annotations

import os

import torch

ENV = "SPARSESERVE_SM_CARVEOUT"


def apply_sm_carveout(device: torch.device) -> int:
    """Read SPARSESERVE_SM_CARVEOUT and apply it (cuBLASLt, leaving that many SMs out); returns the
    SMs left out (0: unset, or set to 0)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0
    try:
        carveout = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of SMs, got {raw!r}") from None
    if device.type != "cuda":  # no cuBLAS: nothing to leave out
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 <= carveout < sms:
        raise ValueError(f"{ENV} must lie in [0, {sms}) on this GPU ({sms} SMs), got {carveout}")
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        raise RuntimeError(f"{ENV} needs torch._C._set_sm_carveout_experimental (torch >= 2.6); unset it")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    if carveout:
        torch._C._set_sm_carveout_experimental(carveout)
    return carveout
