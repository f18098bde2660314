"""Where the time of a small-batch decode attention call goes (H200 probe, not a test).

    PYTHONPATH=. python tools/attn_latency_probe.py [--out PATH]

For the kernel benchmark's small-batch decode cases (batch 1 and 8) it times, in the benchmark's
CUDA-graph harness (one call per input set, >= 400 MB of distinct rows per cycle):
  full      the engine's call (config from `attention_config`: forward kernel, then the split merge);
  no_merge  the same call with the merge kernel not launched (its output is wrong: timing only);
  unsplit   the forward kernel with one split (no partials, no merge);
  copy      a device copy of the case's bytes (`kernels.same_size_copy_us`);
  no_scan   (calls with a band pre-pass: since session 22 not the wgmma kernel's one-tile splits) the pre-pass
            replaced by a kernel that writes each split's whole range without reading the row ids (the
            benchmark's lists are full, so the bands and the output are the same);
  noop      a one-program Triton kernel with the PDL wait, once per call (the graph's per-node floor).
So full - no_merge is the merge's share of the chain, full - no_scan the pre-pass's row-id reads, and full - copy
what the call loses to latency. Folding the pre-pass into the kernel could save at most about
(full - no_scan) + noop.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import triton
import triton.language as tl

from sparseserve.benchmarks import kernels as kb
from sparseserve.kernels import sparse_attention as sa
from sparseserve.kernels.dispatch import num_sms
from sparseserve.kernels.pdl import pdl_args, wait_for_prior_grid


@triton.jit
def _noop_kernel(x_ptr, PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


@triton.jit
def _full_band_kernel(rows_ptr, band_ptr, num_rows, rows_per_split, stride_rt,
                      NUM_SPLITS: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr):
    """Stands in for `_valid_band_kernel` (same arguments): each split's whole range, no row ids read."""
    wait_for_prior_grid(PDL)
    pid = tl.program_id(0)
    start = (pid % NUM_SPLITS) * rows_per_split
    tl.store(band_ptr + pid * 2, tl.minimum(start, num_rows))
    tl.store(band_ptr + pid * 2 + 1, tl.minimum(start + rows_per_split, num_rows))


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_latency_probe.json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    scratch = torch.zeros(1, device="cuda")
    res = []
    t0 = time.time()
    for model, kind, ctx, batch in [("flash", "csa", 32768, 1), ("flash", "csa", 32768, 8), ("flash", "hca", 32768, 8),
                                    ("flash", "hca", 131072, 8), ("pro", "csa", 32768, 8), ("pro", "hca", 4096, 8)]:
        cs = kb.attn_decode_case(model, kind, batch, ctx, gen)
        q, kv, rows, sinks, scale = cs["args"]
        cfg = sa.attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms,
                                  wgmma=sa.wgmma_supported(q, kv))
        unsplit = dataclasses.replace(cfg, num_splits=1)
        calls = lambda c, sets=cs["sets"]: [(lambda a=a: sa.sparse_mqa_attention_triton(*a, c)) for a in sets]  # noqa: E731
        r = dict(model=model, kind=kind, ctx=ctx, batch=batch, cfg=repr(cfg), sets=len(cs["sets"]))
        r["full"] = kb._bench_graph(calls(cfg))
        merge = sa._sparse_mqa_merge_kernel
        sa._sparse_mqa_merge_kernel = _NoLaunch()
        try:
            r["no_merge"] = kb._bench_graph(calls(cfg))
        finally:
            sa._sparse_mqa_merge_kernel = merge
        if sa.needs_band_prepass(cfg, sa.split_length(cs["args"][2].shape[1], cfg)):
            scanned = sa.sparse_mqa_attention_triton(*cs["args"], cfg)
            scan = sa._valid_band_kernel
            sa._valid_band_kernel = _full_band_kernel
            try:
                r["no_scan_same_output"] = bool(torch.equal(scanned, sa.sparse_mqa_attention_triton(*cs["args"], cfg)))
                r["no_scan"] = kb._bench_graph(calls(cfg))
            finally:
                sa._valid_band_kernel = scan
        r["unsplit"] = kb._bench_graph(calls(unsplit))
        r["copy"] = kb.same_size_copy_us(cs["bytes"])
        r["noop"] = kb._bench_graph([(lambda: _noop_kernel[(1,)](scratch, **pdl_args(scratch.device)))
                                     for _ in cs["sets"]])
        res.append(r)
        print(f"{model} {kind} {ctx // 1024}K b{batch} S{cfg.num_splits} {'wgmma' if cfg.wgmma else 'triton'}: "
              + "  ".join(f"{k} {r[k]:.2f}" for k in ("full", "no_merge", "no_scan", "unsplit", "copy", "noop") if k in r)
            + " us" + ("" if r.get("no_scan_same_output", True) else "  (no_scan changed the output)"),
              flush=True)
        del cs
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(card=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       torch=torch.__version__, triton=triton.__version__, results=res), f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
