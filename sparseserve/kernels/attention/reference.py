"""Plain-PyTorch reference of gathered-row MQA with a sink: the CPU path and the kernels' test oracle.

Every query token attends over an explicit list of rows of a KV pool (window rows and chosen compressed rows;
-1 marks an unused slot). All heads share the row (K = V). The softmax denominator also holds exp(sink[h]), and the
sink contributes no value; a token whose rows are all -1 gets exactly 0. With an FP8 KV cache the pool holds
packed rows (sparseserve/kv_format.py), dequantized as they are gathered.
"""
from __future__ import annotations

import torch

from ...kv_format import KVFormat, dequantize_kv_rows


def sparse_mqa_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    token_chunk: int = 256,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference (and CPU path).

    q: [T, H, D]; kv_pool: [N, D] (kv_format: packed FP8 rows [N, row_bytes] uint8); rows: [T, L] int
    (-1 = unused); sinks: [H] (fp32).
    Returns [T, H, D] in q's dtype. Computed in fp32, in chunks of tokens to bound memory.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    sink_logits = sinks.float().view(1, num_heads, 1)
    for start in range(0, num_tokens, token_chunk):
        end = min(start + token_chunk, num_tokens)
        chunk_rows = rows[start:end].long()
        valid = chunk_rows >= 0  # [t, L]
        gathered = kv_pool[chunk_rows.clamp(min=0)]
        keys = gathered.float() if kv_format is None else dequantize_kv_rows(gathered, kv_format)  # [t, L, D]
        logits = torch.einsum("thd,tld->thl", q[start:end].float(), keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        row_max = torch.maximum(logits.amax(dim=-1, keepdim=True), sink_logits.expand(end - start, -1, -1))
        probs = torch.exp(logits - row_max)
        denom = probs.sum(dim=-1, keepdim=True) + torch.exp(sink_logits - row_max)
        out[start:end] = torch.einsum("thl,tld->thd", probs / denom, keys).to(q.dtype)
    return out


