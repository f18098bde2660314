"""A node of a multi-node layout that runs workers only (`--node-rank` > 0; docs/parallelism.md).

Node 0 runs the engine and its own ranks; every other node is started with the same options and
its `--node-rank`, joins torch.distributed's rendezvous at `--master-addr:--master-port`, and
serves its ranks until the driver shuts them down.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..config_checks import check_parallel_layout
from ..model.loader import load_hf_config, resolve_model_dir
from .multiproc import run_node
from .worker_proc import WorkerSpec

STARTUP_TIMEOUT_S = 1800.0  # as the driver's (llm_engine.STARTUP_TIMEOUT_S): node 0 may load for minutes


def serve_worker_node(config: EngineConfig) -> None:
    """Start this node's workers and wait for them (returns when the driver shuts them down)."""
    config.validate()
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine (LLM / sparseserve serve); serve_worker_node is for node_rank > 0")
    device = config.resolve_device()
    model_dir, preset = resolve_model_dir(config.model)
    hf = load_hf_config(model_dir, {**preset, **(config.hf_overrides or {})})
    import torch

    check_parallel_layout(config, hf, device, torch.cuda.device_count() if device.type == "cuda" else None)
    spec = WorkerSpec(config, device.type, config.resolve_dtype(device), config.world_size, config.master_addr,
                      config.master_port, STARTUP_TIMEOUT_S)
    run_node(spec)
