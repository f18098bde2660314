"""Shared by the quantized-kernel tests: random expert inputs, the experts' closeness to the reference and a
launch recorder."""
from __future__ import annotations

from collections.abc import Callable

import torch


def assert_moe_close(y: torch.Tensor, want: torch.Tensor) -> None:
    """float32: each row to fp32 summation order, except rare rows where a one-ulp difference before a
    re-quantization moved one activation code by an e4m3 step (at most 1% of rows, and 1e-4 in norm)."""
    assert torch.isfinite(y).all()
    y, want = y.float().cpu(), want.float().cpu()
    tol = 2.0 ** -18 * want.abs().amax(dim=-1, keepdim=True)
    bad_rows = ((y - want).abs() > tol).any(dim=1).sum().item()
    assert bad_rows <= max(1, y.shape[0] // 100), f"{bad_rows} of {y.shape[0]} rows differ"
    assert ((y - want).norm() / want.norm()).item() < 1e-4


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's grid and constexprs (upper-case keywords), then
    launches the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((tuple(grid), tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_expert_launches(monkeypatch) -> tuple[LaunchRecorder, LaunchRecorder]:
    """LaunchRecorders in place of moe_quant's gate-up and down kernels (undone by monkeypatch)."""
    from sparseserve.kernels.quant import moe_quant

    gate_up = LaunchRecorder(moe_quant._moe_q_gate_up_kernel)
    down = LaunchRecorder(moe_quant._moe_q_down_kernel)
    monkeypatch.setattr(moe_quant, "_moe_q_gate_up_kernel", gate_up)
    monkeypatch.setattr(moe_quant, "_moe_q_down_kernel", down)
    return gate_up, down


def launches_match_across_routings(monkeypatch, cfg, experts_case: Callable, num_tokens: int, limit: float):
    """Graph safety: the experts with `cfg` on a skewed and on a uniform routing (experts_case(num_tokens,
    "even", skewed) -> x, w_gu, w_dn, weights, ids) launch the same grids and constexprs. Returns the recorders
    and the uniform case's inputs."""
    from sparseserve.kernels.quant.moe_quant import fused_moe_quant_triton

    gate_up, down = record_expert_launches(monkeypatch)
    for skewed in (True, False):
        case = experts_case(num_tokens, "even", skewed)
        x, w_gu, w_dn, weights, ids = case
        fused_moe_quant_triton(x, w_gu, w_dn, weights, ids, limit, config=cfg)
    assert len(gate_up.launches) == len(down.launches) == 2
    assert gate_up.launches[0] == gate_up.launches[1] and down.launches[0] == down.launches[1]
    return gate_up, down, case


def scaled_rows(gen: torch.Generator, num_tokens: int, hidden: int) -> torch.Tensor:
    """Random activation rows, each scaled by its own power of two over 15 binades."""
    return torch.randn(num_tokens, hidden, generator=gen) * torch.exp2(
        torch.randint(-8, 7, (num_tokens, 1), generator=gen).float())


def expert_routing(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int,
                   skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights, expert ids) [T, top_k]. skewed: expert 0 takes every token, the others come from
    experts 1-5 (so the last experts of 8 get none); else a uniform random routing."""
    if skewed:
        others = torch.stack([torch.randperm(5, generator=gen)[: top_k - 1] + 1 for _ in range(num_tokens)])
        ids = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.long), others], dim=1)
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights, ids
