"""Programmatic dependent launch (PDL) for the small kernels of a decode step (Hopper and later).

A decode step at batch 1 is a chain of ~100 latency-bound kernels, each 1-10 us. Without PDL a
kernel's programs are scheduled only after the previous kernel has completed and flushed: every
edge of the chain pays the launch and ramp-up (benchmarks/pdl_bench.py times it per edge of a
captured chain). With PDL a kernel is launched with the programmatic-serialization attribute (`launch_pdl=True`); its programs may start
as soon as every program of the previous kernel on the stream has signalled (or exited), and they
wait inside the kernel (`griddepcontrol.wait`) until that kernel has completed and its writes are
visible. CUDA graph capture keeps these edges (programmatic graph edges).

The rule that keeps it safe: every kernel launched with PDL calls `wait_for_prior_grid(PDL)` as
its first statement, before any load or store and before any early return. So no program touches
memory before the previous kernel is complete, and a kernel completes only after its predecessor
did (completion stays transitive along the stream, as without PDL). One exception, listed in
tests/test_pdl.py (READS_BEFORE_WAIT): a kernel may load its weight before the wait (kernels/gemv.py,
the router's partials), since nothing in a step writes weights; it stores nothing before the wait.

A kernel lets its dependents launch at the end of each program (the implicit trigger, `TRIGGER`
= "exit"): the next kernel's launch overlaps this one's tail and completion, and waiting programs
never hold SM slots that work on another stream could use. Triggering right after the wait
("start", kept for benchmarks/pdl_bench.py) makes the next kernel's programs resident early; on the
H200 decode steps gained less with it than with "exit" at every batch, and at batch 1 lost time
against no PDL at all (docs/performance.md): waiting MoE down-projection programs held the SM slots
that the shared expert's GEMM beside them needed.

On the CPU, under the Triton interpreter, below sm_90, and with SPARSESERVE_DISABLE_KERNELS=pdl,
kernels launch as before (PDL=0 compiles the wait out)."""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType

import torch

from .. import envs
from .dispatch import capability, enabled_on

_INTERPRET = envs.triton_interpret()
TRIGGERS = {"exit": 1, "start": 2}  # the PDL constexpr: 0 off, 1 wait, 2 wait then trigger
TRIGGER = "exit"

try:  # triton >= 3.4 (the stacks we support: 3.6 and 3.9); without Triton every path is a reference
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GDC = True
except ImportError:  # pragma: no cover
    _HAVE_GDC = False


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (a static fact of the device and the
    environment, the same for every step and every graph capture)."""
    if _INTERPRET or not _HAVE_GDC or not enabled_on("pdl", device):
        return False
    return capability(device) >= (9, 0)


def pdl_args(device: torch.device) -> Mapping[str, object]:
    """Launch keyword arguments: the kernel's PDL constexpr and, when on, Triton's launch option.
    Decided once per device (every launch of a step asks)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _pdl_args(device)


@lru_cache(maxsize=None)
def _pdl_args(device: torch.device) -> Mapping[str, object]:
    on = {"PDL": TRIGGERS[TRIGGER], "launch_pdl": True}
    return MappingProxyType(on if pdl_enabled(device) else {"PDL": 0})


if _HAVE_GDC:

    @triton.jit
    def wait_for_prior_grid(PDL: tl.constexpr):
        """First statement of every PDL kernel: wait for the previous kernel on the stream to
        complete (PDL >= 1); PDL == 2: then let the next one launch."""
        if PDL >= 1:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

else:  # pragma: no cover - no Triton (or one without GDC): nothing launches with PDL
    wait_for_prior_grid = None
