"""Kernels that compute on FP8 (block-scaled e4m3) and FP4 (e2m1, per-32 scales) weights as the DeepSeek-V4
release stores them (docs/quantization.md): activation quantization, the block-scaled linear (tensor-core and
weight-streaming forms) and the routed-expert grouped GEMMs; `reference.py` is the CPU path and the oracle."""
