"""One GEMM for several bias-free `nn.Linear`s that read the same input.

`PackedWeight.pack(linears)` copies their weights into one contiguous [sum(out), in] matrix
and makes each `linear.weight` a Parameter viewing its rows. Nothing else changes: parameter
names and `state_dict()` are as before, in-place loading (`copy_`, `load_state_dict`) writes
into the packed matrix, and no memory is doubled. `shared_input_linear` then runs one
GEMM (`kernels/gemv.decode_linear`: the weight-stream kernel for one row on CUDA, else `F.linear`)
and returns views of its output, one per span of consecutive linears (a span of
several linears, e.g. a compressor's kv and gate, comes out already adjacent).

Packing is an optimisation, never a requirement: without it (or when a packed group's
weights were replaced afterwards, e.g. by `.to()` with another dtype or device, `p.data = ...`
or `load_state_dict(assign=True)`, which `PackedWeight.holds` detects on the host) the linears
run one by one, spans of several linears joined by `torch.cat`. Under autograd with trainable
weights the per-linear path is used too, so gradients reach the parameters.

The one place that packs a whole model is `pack_projections(model)`, called once by the
loader after the weights are loaded and cast (casting after packing would undo it).

Quantized linears (`model/quantize.py`: a `qweight` QuantWeight, an empty `weight`) run through
`kernels.quant.quant_linear`. A group whose members are all quantized packs when every member's
row count is a multiple of 128 (the block-FP8 scale rows then concatenate member by member); a
group that mixes formats or has other row counts runs its linears one by one.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...kernels.gemv import decode_linear
from ...kernels.quant import QuantWeight, quant_linear
from ...kernels.quant.formats import BLOCK

Span = tuple[int, int]


def qweight_of(lin: nn.Module) -> QuantWeight | None:
    """The linear's QuantWeight, if it is held quantized (a dict lookup: nothing for bf16 models)."""
    return lin.__dict__.get("qweight")


def apply_quant(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """quant_linear over x's leading dimensions."""
    y = quant_linear(x.reshape(-1, x.shape[-1]).contiguous(), w)
    return y.view(*x.shape[:-1], y.shape[-1])


def linear_weight_or_quant(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """A bias-free linear: the quantized kernel when held quantized, else `decode_linear`."""
    qw = qweight_of(lin)
    return decode_linear(x, lin.weight) if qw is None else apply_quant(x, qw)


class PackedWeight:
    """The packed [sum(out), in] matrix of a group of linears and each one's first row."""

    def __init__(self, weight: torch.Tensor, bounds: list[int], quant: QuantWeight | None = None) -> None:
        self.weight = weight  # the quantized group: quant.data
        self.bounds = bounds  # bounds[i]:bounds[i + 1] are linear i's rows (and output columns)
        self.quant = quant

    @classmethod
    def _pack_quant(cls, linears: Sequence[nn.Linear]) -> PackedWeight | None:
        qws = [qweight_of(lin) for lin in linears]
        if any(q is None or q.data.dim() != 2 or q.shape[0] % BLOCK or q.shape[1] != qws[0].shape[1]
               or q.scale.dtype != qws[0].scale.dtype for q in qws):
            return None
        bounds = [0]
        for q in qws:
            bounds.append(bounds[-1] + q.shape[0])
        data = torch.cat([q.data for q in qws]).contiguous()
        scale = torch.cat([q.scale for q in qws]).contiguous()
        for lin, lo, hi in zip(linears, bounds, bounds[1:]):
            lin.qweight = QuantWeight(data[lo:hi], scale[lo // BLOCK:hi // BLOCK], "fp8_block")
        return cls(data, bounds, QuantWeight(data, scale, "fp8_block"))

    @classmethod
    @torch.no_grad()
    def pack(cls, linears: Sequence[nn.Linear]) -> PackedWeight | None:
        """Pack the linears' weights (in order) and rebind each weight as a view; None (nothing
        changed) when they cannot share one matrix (bias, different in_features/dtype/device)."""
        if len(linears) >= 2 and any(qweight_of(lin) is not None for lin in linears):
            return cls._pack_quant(linears)
        weights = [lin.weight for lin in linears]
        first = weights[0]
        if (len(linears) < 2 or any(lin.bias is not None for lin in linears)
                or first.device.type == "meta"
                or any(w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype
                       or w.device != first.device for w in weights)):
            return None
        bounds = [0]
        for w in weights:
            bounds.append(bounds[-1] + w.shape[0])
        packed = torch.empty(bounds[-1], first.shape[1], dtype=first.dtype, device=first.device)
        for lin, w, lo, hi in zip(linears, weights, bounds, bounds[1:]):
            packed[lo:hi].copy_(w)
            lin.weight = nn.Parameter(packed[lo:hi], requires_grad=w.requires_grad)
        return cls(packed, bounds)

    def rows(self, first: int, last: int) -> PackedWeight:
        """The packed matrix of linears first..last - 1 alone: a view of their consecutive rows (and of
        their block scales when quantized), for a GEMM over only some of the group's outputs."""
        lo, hi = self.bounds[first], self.bounds[last]
        bounds = [b - lo for b in self.bounds[first:last + 1]]
        if self.quant is None:
            return PackedWeight(self.weight[lo:hi], bounds)
        quant = QuantWeight(self.quant.data[lo:hi], self.quant.scale[lo // BLOCK:hi // BLOCK], self.quant.fmt)
        return PackedWeight(quant.data, bounds, quant)

    def holds(self, linears: Sequence[nn.Linear]) -> bool:
        """Whether every linear's weight is still the view of its rows of the packed matrix."""
        if len(linears) != len(self.bounds) - 1:
            return False
        base, row_bytes = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size()
        for lin, lo, hi in zip(linears, self.bounds, self.bounds[1:]):
            w = lin.weight if self.quant is None else getattr(qweight_of(lin), "data", None)
            if w is None:
                return False
            if (w.data_ptr() != base + lo * row_bytes or w.dtype != self.weight.dtype
                    or w.shape != (hi - lo, self.weight.shape[1]) or not w.is_contiguous()):
                return False
        return True


def shared_input_linear(x: torch.Tensor, linears: Sequence[nn.Linear], packed: PackedWeight | None,
                        spans: Sequence[Span]) -> list[torch.Tensor]:
    """[linears[i](x) .. linears[j-1](x) side by side, for (i, j) in spans]: one GEMM and views
    of its output when `packed` holds the linears, else one GEMM per linear (and a cat per span
    of several). Callers check `packed.holds(linears)`."""
    if packed is not None and not (torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears)):
        # batch-1 rows: the weight-stream kernel
        y = decode_linear(x, packed.weight) if packed.quant is None else apply_quant(x, packed.quant)
        b = packed.bounds
        return [y[..., b[i]:b[j]] for i, j in spans]
    outs = []
    for i, j in spans:
        # A lone bias-free linear (e.g. an HCA layer's q_b, which shares its input with nothing) also
        # takes the batch-1 weight-stream kernel.
        parts = [lin(x) if lin.bias is not None else linear_weight_or_quant(x, lin) for lin in linears[i:j]]
        outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
    return outs


def pack_projections(model: nn.Module) -> int:
    """Pack the shared-input projections of `model` and every module in it that has some (those
    that define a `_pack_projections()` hook, e.g. the attention layers); returns the number of
    groups packed now. Call once after the weights are loaded and cast; calling it again
    re-packs only the groups whose packing was undone."""
    count = 0
    for module in model.modules():
        hook = getattr(module, "_pack_projections", None)
        if callable(hook):
            count += hook()
    return count
