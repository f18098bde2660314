"""The environment variables sparseserve reads: the one place that reads them.

Engine choices are `LLM(...)` options, not variables; what is here serves diagnosis.

    SPARSESERVE_LOGGING_LEVEL    the package logger's level (DEBUG, INFO, WARNING, ERROR; default INFO)
    SPARSESERVE_DISABLE_KERNELS  comma-separated kernel names (or `all`) that run their plain-PyTorch
                                 reference on CUDA too (names: kernels/dispatch.py); read at import
    SPARSESERVE_API_KEY          the key `sparseserve serve` requires when --api-key is not given (vLLM's
                                 VLLM_API_KEY); unset: no key
    TRITON_INTERPRET             Triton's own switch (1: kernels run on the CPU in its interpreter);
                                 read here so that kernels can tell, never set here
    GROUP_RANK                   torchrun's node rank: under torchrun the command's --node-rank default
    GROUP_WORLD_SIZE             torchrun's node count: the --nnodes default
    LOCAL_WORLD_SIZE             torchrun's processes per node: must be 1 (sparseserve starts its own ranks)
    MASTER_ADDR                  torchrun's rendezvous host: the --master-addr default
    MASTER_PORT                  torchrun's rendezvous port; sparseserve's ranks meet at MASTER_PORT + 1 (the
                                 port itself is torchrun's own store)
"""
from __future__ import annotations

import os


def logging_level() -> str:
    """SPARSESERVE_LOGGING_LEVEL, upper-case ("INFO" when unset)."""
    return os.environ.get("SPARSESERVE_LOGGING_LEVEL", "INFO").strip().upper() or "INFO"


def disabled_kernels() -> frozenset[str]:
    """SPARSESERVE_DISABLE_KERNELS as a set of names."""
    raw = os.environ.get("SPARSESERVE_DISABLE_KERNELS", "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def triton_interpret() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET set to anything but 0)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def api_key() -> str | None:
    """SPARSESERVE_API_KEY, or None when unset or empty."""
    return os.environ.get("SPARSESERVE_API_KEY", "").strip() or None


def torchrun_layout() -> dict | None:
    """The node layout torchrun gives its processes (None outside torchrun): nnodes, node_rank,
    master_addr, master_port (MASTER_PORT + 1) and local_world_size."""
    node_rank, addr = os.environ.get("GROUP_RANK"), os.environ.get("MASTER_ADDR")
    if node_rank is None or addr is None:
        return None
    return {"nnodes": int(os.environ.get("GROUP_WORLD_SIZE") or 1), "node_rank": int(node_rank),
            "master_addr": addr, "master_port": int(os.environ.get("MASTER_PORT") or 29500) + 1,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE") or 1)}
