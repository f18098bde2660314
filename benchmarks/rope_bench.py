"""In-place rope kernel against its plain-PyTorch reference and the memory roofline (CUDA).

    python -m benchmarks.rope_bench [--out PATH]

Roofline: the kernel reads and writes only the rope channels, 2 * rows * rope_dim * bytes, plus the
fp32 cos/sin rows (tokens * rope_dim * 4), at the measured device-copy bandwidth. Shapes are V4-Flash's:
q (64 heads x 512), the indexer's q (64 x 128) and the kv row (512), at prefill and decode sizes.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from benchmarks import result_file
from sparseserve.kernels.rope import apply_rope_, apply_rope_ref
from benchmarks.ceilings import hbm_bandwidth

SHAPES = {  # name: (tokens, heads or None, dim)
    "q prefill 8192 x 64 x 512": (8192, 64, 512),
    "indexer q prefill 8192 x 64 x 128": (8192, 64, 128),
    "kv prefill 8192 x 512": (8192, None, 512),
    "q decode 200 x 64 x 512": (200, 64, 512),
    "q decode 1 x 64 x 512": (1, 64, 512),
}
ROPE_HALF = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=result_file("rope"))
    args = parser.parse_args()
    bandwidth = hbm_bandwidth()
    results = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "copy_bandwidth_bytes_per_s": bandwidth, "cases": []}
    for name, (tokens, heads, dim) in SHAPES.items():
        shape = (tokens, heads, dim) if heads else (tokens, dim)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(tokens, ROPE_HALF, device="cuda") * 6.28
        cos, sin = angles.cos(), angles.sin()
        rows = tokens * (heads or 1)
        moved = 2 * rows * 2 * ROPE_HALF * x.element_size() + 2 * tokens * ROPE_HALF * 4
        kernel_ms = triton.testing.do_bench(lambda: apply_rope_(x, cos, sin))
        ref_ms = triton.testing.do_bench(lambda: apply_rope_ref(x, cos, sin))
        floor_us = moved / bandwidth * 1e6
        case = {"case": name, "kernel_us": kernel_ms * 1e3, "reference_us": ref_ms * 1e3, "floor_us": floor_us,
                "kernel_over_floor": kernel_ms * 1e3 / floor_us, "speedup_vs_reference": ref_ms / kernel_ms}
        results["cases"].append(case)
        print(f"{name:<36} kernel {case['kernel_us']:8.1f} us  reference {case['reference_us']:8.1f} us  "
              f"floor {floor_us:7.1f} us  ({case['kernel_over_floor']:.1f}x floor, "
              f"{case['speedup_vs_reference']:.1f}x reference)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
