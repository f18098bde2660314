"""Random weights of the right shapes (`load_format="dummy"`; for benchmarks at real shapes, never zeros).

One seeded generator draws every parameter in `named_parameters` order, then the router buffers in
`named_buffers` order. The streamed parallel load (`model/streamed_load.py`) draws part after part
from the same generator (parameters first, buffers after the last part), so its values are the
whole-model draw's, bit for bit.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..logger import progress_bar


def dummy_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def init_dummy_params(params: Iterable[tuple[str, torch.Tensor]], gen: torch.Generator, device: torch.device) -> None:
    for name, p in params:
        if "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 0.1)


@torch.no_grad()
def init_dummy_buffers(buffers: Iterable[tuple[str, torch.Tensor]], gen: torch.Generator, device: torch.device,
                       n_routed_experts: int) -> None:
    for name, b in buffers:
        if name.endswith("tid2eid"):
            # Distinct experts per token: a random start walking modulo the expert count.
            first = torch.randint(0, n_routed_experts, (b.shape[0], 1), generator=gen, device=device)
            b.copy_((first + torch.arange(b.shape[1], device=device)) % n_routed_experts)
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen, device=device) * 0.01)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, hf_config=None, progress: bool = True) -> None:
    """Every parameter and router buffer of `model`, drawn on the parameters' device (billions of
    values take seconds on a GPU)."""
    device = next(model.parameters()).device
    gen = dummy_generator(device, seed)
    hf = hf_config if hf_config is not None else model.model_config.hf_config
    params = list(model.named_parameters())
    init_dummy_params(progress_bar(params, enabled=progress, desc="Initializing dummy weights", unit="tensor"),
                      gen, device)
    init_dummy_buffers(model.named_buffers(), gen, device, hf.n_routed_experts)
