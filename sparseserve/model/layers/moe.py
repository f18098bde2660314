"""Sparse MoE block: routed experts (top-k by score + correction bias, or hash-routed
through the frozen tid2eid table) plus one shared expert; clamped SwiGLU everywhere.
Names follow `transformers`' DeepseekV4SparseMoeBlock."""
from __future__ import annotations

import torch
from torch import nn

from ...kernels.moe import fused_moe, swiglu_fused
from ...kernels.quant import QuantWeight, fused_moe_quant
from ...kernels.router import router_select
from ...distributed.communicator import ParallelGroup
from ..side_stream import SideStream
from .fused_linear import PackedWeight, linear_weight_or_quant, shared_input_linear


class Router(nn.Module):
    def __init__(self, hf, is_hash: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hf.n_routed_experts, hf.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(hf.vocab_size, hf.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(hf.n_routed_experts))


class Experts(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        inter = hf.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(hf.n_routed_experts, 2 * inter, hf.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hf.n_routed_experts, hf.hidden_size, inter))
        # Held quantized (model/quantize.py): the QuantWeights, and the two Parameters left empty.
        self.q_gate_up: QuantWeight | None = None
        self.q_down: QuantWeight | None = None


class SharedExpert(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        inter = hf.moe_intermediate_size
        self.gate_proj = nn.Linear(hf.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(hf.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, hf.hidden_size, bias=False)
        self.limit = hf.swiglu_limit
        self._packed: PackedWeight | None = None  # gate | up as one matrix: one GEMM, then one swiglu pass

    def _gate_up(self) -> list[nn.Linear]:
        return [self.gate_proj, self.up_proj]

    def _pack_projections(self) -> int:
        if self._packed is not None and self._packed.holds(self._gate_up()):
            return 0
        self._packed = PackedWeight.pack(self._gate_up())
        return int(self._packed is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        linears = self._gate_up()
        packed = self._packed if self._packed is not None and self._packed.holds(linears) else None
        gate_up = shared_input_linear(x, linears, packed, [(0, 2)])[0]
        return linear_weight_or_quant(swiglu_fused(gate_up, self.limit), self.down_proj)


class SparseMoE(nn.Module):
    def __init__(self, hf, is_hash: bool) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.top_k = hf.num_experts_per_tok
        self.scoring_func = hf.scoring_func
        self.routed_scaling_factor = hf.routed_scaling_factor
        self.limit = hf.swiglu_limit
        self.gate = Router(hf, is_hash)
        self.experts = Experts(hf)
        self.shared_experts = SharedExpert(hf)
        # Tensor/expert parallel (model/sharding.py): the partial output (this rank's share of the
        # shared expert and of the routed experts) is summed over the ranks. `local_experts`:
        # (first global id, count) of the experts this rank holds under expert parallelism.
        self.tp: ParallelGroup | None = None
        self.local_experts: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, side: SideStream | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]. The shared expert runs on `side` (the step's side stream, if any),
        beside the router and the routed experts; the combine waits for it. `valid` [T] bool: the
        other tokens (a prefill graph's padding) route to no expert, so they read no expert weights."""
        shared = (side or SideStream()).run(self.shared_experts, x)
        # The router's logits and selection (small steps: two small launches beside the shared
        # expert's GEMMs instead of a cuBLAS GEMM that waits for SMs; kernels/router.py).
        if self.is_hash:
            weights, ids = router_select(x, self.gate.weight, self.top_k, self.scoring_func,
                                         self.routed_scaling_factor, hash_ids=self.gate.tid2eid, token_ids=input_ids)
        else:
            weights, ids = router_select(x, self.gate.weight, self.top_k, self.scoring_func,
                                         self.routed_scaling_factor, correction_bias=self.gate.e_score_correction_bias)
        if self.local_experts is not None:
            weights, ids = self._local_assignments(weights, ids)
        if valid is not None:  # a negative id skips the assignment (kernels/moe_align.py)
            ids = torch.where(valid.unsqueeze(1), ids, -1)
        experts = self.experts
        if experts.q_gate_up is None:
            out = fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, self.limit, shared=shared.result)
        else:
            out = fused_moe_quant(x, experts.q_gate_up, experts.q_down, weights, ids, self.limit,
                                  shared=shared.result)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _local_assignments(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: every rank holds every token (attention leaves them replicated), so the
        dispatch is local: assignments to this rank's experts get local ids, the others weight 0
        (on local expert 0) and add nothing; the combine is the all-reduce after the MoE."""
        first, count = self.local_experts
        local = ids - first
        mine = (local >= 0) & (local < count)
        return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, torch.zeros_like(local))
