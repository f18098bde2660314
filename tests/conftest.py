import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter on CPU tensors. This must be set
# before anything imports triton, so it lives here rather than in the test modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


class HistoricalTopKBug:
    """The historical vLLM top-k bug, as a test-only patch: the persistent path's workspace
    zeroing sits behind a host `if` on the step's longest sequence (skipped when it is <= k).
    A graph captured at a short dummy length then records no zeroing, and its replays at long
    lengths run on stale counters (rows of -2); both halves of the graph audit must catch it.

    `host_max_len` is the host fact the `if` reads: the longest sequence of the batch built last
    (as the engine builds a step's metadata right before running it), or what a test sets."""

    def __init__(self) -> None:
        self.host_max_len: int | None = None

    def skips_reset(self, k: int) -> bool:
        return self.host_max_len is not None and self.host_max_len <= k


@pytest.fixture
def historical_topk_bug(monkeypatch) -> HistoricalTopKBug:
    from sparseserve.kernels import topk
    from sparseserve.model import batch as batch_module
    from sparseserve.worker import cuda_graph, model_runner

    bug = HistoricalTopKBug()
    reset = topk.IndexerTopK._reset_workspace

    def guarded_reset(self, ws):
        if not bug.skips_reset(self.k):
            reset(self, ws)

    build = batch_module.build_batch

    def recording_build(chunks, *args, **kwargs):
        bug.host_max_len = max((c.start_pos + len(c.token_ids) for c in chunks), default=0)
        return build(chunks, *args, **kwargs)

    monkeypatch.setattr(topk.IndexerTopK, "_reset_workspace", guarded_reset)
    for module in (batch_module, cuda_graph, model_runner):
        monkeypatch.setattr(module, "build_batch", recording_build)
    return bug
