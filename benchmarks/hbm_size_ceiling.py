"""What share of HBM bandwidth a kernel of a given size can reach on this card: a device read (`ceilings.read_sum`,
block sums of bf16) and a device copy of the same bytes (half read, half written), each timed as the kernel benchmark times decode attention (`_bench_graph`: calls on
distinct buffers chained in one CUDA graph, >= 400 MB per cycle, so every byte comes from HBM).

    python -m benchmarks.hbm_size_ceiling [--out F.json]

Decode attention at batch 8 moves 2.4-11.6 MB (V4-Flash and V4-Pro, 4K-128K): this says whether 60% of HBM is
reachable at those sizes by any kernel, before asking it of attention. CUDA only.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from benchmarks import result_file
from benchmarks import kernels as kb

SIZES_MB = (1, 2, 4, 8, 12, 16, 32, 64, 128, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=result_file("hbm_size_ceiling"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hbm_size_ceiling needs a CUDA device")
    rows = []
    for mb in SIZES_MB:
        nbytes = int(mb * 1e6)
        read_us, copy_us = kb.same_size_read_us(nbytes), kb.same_size_copy_us(nbytes)
        row = dict(mbytes=mb, read_us=round(read_us, 2), read_hbm_frac=round(nbytes / (read_us * 1e-6) / kb.HBM_BPS, 3),
                   copy_us=round(copy_us, 2), copy_hbm_frac=round(nbytes / (copy_us * 1e-6) / kb.HBM_BPS, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    report = dict(card=torch.cuda.get_device_name(0), torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python -m benchmarks.hbm_size_ceiling", hbm_bytes_per_s=kb.HBM_BPS, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
