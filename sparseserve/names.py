"""Names the configuration and its checks share: the layer kinds of a DeepSeek-V4 config and the
side-stream modes of `EngineConfig.side_stream`."""
from __future__ import annotations

LAYER_SLIDING = "sliding_attention"
LAYER_CSA = "compressed_sparse_attention"
LAYER_HCA = "heavily_compressed_attention"
QUANTIZATION_MODES = ("auto", "fp8", "none")  # EngineConfig.quantization (model/quantize.py)
SIDE_STREAM_MODES = ("auto", "graphs", "always", "never")
