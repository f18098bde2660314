"""Benchmark of the compressor emission and the row-list builders (H200).

    python -m benchmarks.compressor_bench [--out PATH] [--sweep] [--smoke]

Compressor cases (bf16, V4-Flash shapes, rope dim 64):
  csa-kv      head_dim 512, rate 4, overlap (8 slots of 512 kv + 512 gate features)
  csa-indexer head_dim 128, rate 4, overlap
  hca-kv      head_dim 512, rate 128, no overlap (128 slots)
  decode : batch 1/8/64/256, every token offered as an emitter (the captured-step shape),
           ceil(batch / rate) of them closing a window; the others get out row -1 ("skip", what
           the kernel supports) or the trash row ("trash": every offered token pools a window).
  prefill: one sequence of 4K / 32K tokens from position 0, the closing tokens only.
Bytes per emitted entry (the minimum, fixed before tuning): S slots x (kv + gate) x head_dim x 2 B
+ the entry written (head_dim x 2 B) + its S source rows (8 B each). Roofline time = bytes of the
closing tokens / HBM rate. Times: triton.testing.do_bench medians, L2 flushed before every run.
The plain-PyTorch reference is timed in the same process.

Row builders (int64 out): window rows (T x 128), HCA visible rows (T x ctx/128), top-512 entry
rows, at decode batch 1/64/256 and prefill 4K / 32K; bytes = the int64 rows written + the ids read.
--sweep also times the compressor kernel's (BLOCK_S, num_warps) alternatives (tuning data).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
import triton.testing

from benchmarks import result_file
from sparseserve.kernels import rows as R
from sparseserve.kernels.compressor import compress_config, compress_windows_ref, compress_windows_triton
from sparseserve.model.layers.rope import rope_cos_sin, rope_inv_freq

HBM_BPS = 4.23e12  # measured device-to-device copy on the H200 (docs/performance.md, ceilings)
ROPE_DIM, WINDOW, BLOCK_SIZE = 64, 128, 128
CASES = {"csa-kv": (512, 4, True), "csa-indexer": (128, 4, True), "hca-kv": (512, 128, False)}
BATCHES = (1, 8, 64, 256)
PREFILLS = (4096, 32768)
DEV = "cuda"
DTYPE = torch.bfloat16


def _bench(fn) -> float:
    """Median time in microseconds (L2 flushed between runs by do_bench)."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _time_ref(fn, runs: int = 3) -> float:
    fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / runs * 1e6


def entry_bytes(head_dim: int, num_slots: int) -> int:
    return num_slots * 2 * head_dim * 2 + head_dim * 2 + num_slots * 8


def compressor_case(name: str, phase: str, n: int, mode: str, gen: torch.Generator) -> dict:
    """Inputs of one compress_windows call: n decode sequences or one n-token prefill."""
    head_dim, rate, overlap = CASES[name]
    width = (2 if overlap else 1) * head_dim
    span = (2 if overlap else 1) * rate
    if phase == "decode":
        closing = math.ceil(n / rate)
        # Token b sits at a position that closes a window for b < closing, else one past it.
        win = torch.randint(1, 32768 // rate, (n,), generator=gen)
        pos = win * rate - 1 + (torch.arange(n) >= closing).long()
        seq = torch.arange(n)
        starts, chunks = pos.clone(), torch.ones(n, dtype=torch.long)
    else:
        pos = torch.arange(rate - 1, n, rate)  # eager prefill: the closing tokens only
        seq = torch.zeros_like(pos)
        starts, chunks = torch.zeros(1, dtype=torch.long), torch.tensor([n])
    tok_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), chunks[:-1]]), 0)
    num_seqs = starts.shape[0]
    slots = torch.randperm(num_seqs, generator=gen)
    ring = span + 3
    staging_base = num_seqs * ring
    num_tokens = int(chunks.sum())
    state = torch.randn(staging_base + num_tokens + 1, 2 * width, generator=gen).to(DEV, DTYPE)
    src = R.source_rows_ref(pos, seq, starts, tok_off, slots, torch.arange(-span + 1, 1), ring, staging_base)
    epb = BLOCK_SIZE // rate
    max_blocks = (int(pos.max()) // rate) // epb + 1
    table = torch.randperm(num_seqs * max_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    pool_rows = num_seqs * max_blocks * epb + 1
    out_rows = R.emit_pool_rows_ref(pos, seq, table, rate, epb, 0, pool_rows - 1 if mode == "trash" else -1)
    cos, sin = rope_cos_sin(pos + 1 - rate, rope_inv_freq({"rope_theta": 160000.0}, ROPE_DIM))
    closes = ((pos + 1) % rate == 0).sum().item()
    return dict(
        args=(state, src.to(DEV), (0.1 * torch.randn(rate, width, generator=gen)).to(DEV, DTYPE), overlap,
              (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(DEV, DTYPE), 1e-6, cos.to(DEV), sin.to(DEV),
              torch.zeros(pool_rows, head_dim, device=DEV, dtype=DTYPE), out_rows.to(DEV)),
        emitted=closes, offered=pos.shape[0], bytes=closes * entry_bytes(head_dim, span),
    )


def rows_case(phase: str, n: int, ctx: int, gen: torch.Generator) -> dict:
    if phase == "decode":
        pos = torch.randint(ctx // 2, ctx, (n,), generator=gen)
        seq, starts, chunks = torch.arange(n), pos.clone(), torch.ones(n, dtype=torch.long)
    else:
        pos, seq = torch.arange(n), torch.zeros(n, dtype=torch.long)
        starts, chunks = torch.zeros(1, dtype=torch.long), torch.tensor([n])
    num_seqs = starts.shape[0]
    tok_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), chunks[:-1]]), 0)
    rate_hca, rate_csa = 128, 4
    max_blocks = ctx // BLOCK_SIZE + 1
    table = torch.randperm(num_seqs * max_blocks, generator=gen).view(num_seqs, max_blocks).int()
    lengths = ((pos + 1) // rate_csa).clamp(min=1)
    ids = (torch.rand(pos.shape[0], 512, generator=gen) * lengths.unsqueeze(1)).int()
    d = lambda x: x.to(DEV)  # noqa: E731
    return dict(
        window=(d(pos), d(seq), d(starts), d(tok_off), d(torch.randperm(num_seqs, generator=gen)),
                d(torch.arange(-WINDOW + 1, 1)), WINDOW + 3, num_seqs * (WINDOW + 3)),
        visible=(d(pos), d(seq), d(table), rate_hca, ctx // rate_hca, 1, 1000),
        topk=(d(ids), d(seq), d(table), BLOCK_SIZE // rate_csa, 1000),
        tokens=pos.shape[0], ctx=ctx,
    )


def run(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    results = []
    batches, prefills = (BATCHES, PREFILLS) if not args.smoke else ((1, 8), (256,))
    for name, (head_dim, rate, overlap) in CASES.items():
        if args.smoke and rate == 128:
            continue
        plan = [("decode", b, m) for b in batches for m in ("skip", "trash")] + [("prefill", p, "skip") for p in prefills]
        for phase, n, mode in plan:
            case = compressor_case(name, phase, n, mode, gen)
            a = case["args"]
            t = _bench(lambda: compress_windows_triton(*a))
            ref = None if args.no_ref else _time_ref(lambda: compress_windows_ref(*a))
            # Check the kernel against the reference on this case (kept rows only).
            out, want = a[8].clone(), a[8].clone()
            compress_windows_triton(*a[:8], out, a[9])
            compress_windows_ref(*a[:8], want, a[9])
            err = ((out.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
            roof = case["bytes"] / HBM_BPS * 1e6
            r = dict(kernel="compressor", case=name, phase=phase, n=n, mode=mode, emitted=case["emitted"],
                     offered=case["offered"], us=round(t, 2), ref_us=None if ref is None else round(ref, 1),
                     bytes=case["bytes"], gbps=round(case["bytes"] / t / 1e3, 1), roofline_us=round(roof, 2),
                     frac_roofline=round(roof / t, 3), rel_err=err, block_s=compress_config(head_dim, a[1].shape[1])[0])
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.sweep and mode == "skip":
                for bs in (2, 4, 8, 16, 32):
                    for nw in (2, 4, 8):
                        if bs > a[1].shape[1]:
                            continue
                        tb = _bench(lambda: compress_windows_triton(*a, block_s=bs, num_warps=nw))
                        r = dict(kernel="compressor-sweep", case=name, phase=phase, n=n, block_s=bs, num_warps=nw,
                                 us=round(tb, 2), frac_roofline=round(roof / tb, 3))
                        results.append(r)
                        print(json.dumps(r), flush=True)
    row_plan = [("decode", b, c) for b in ((1, 64, 256) if not args.smoke else (1, 8)) for c in (32768, 131072)]
    row_plan += [("prefill", p, p) for p in (PREFILLS if not args.smoke else (256,))]
    for phase, n, ctx in row_plan:
        case = rows_case(phase, n, ctx, gen)
        T = case["tokens"]
        for what, tri, ref_fn, cols in (
            ("window", R.source_rows_triton, R.source_rows_ref, WINDOW),
            ("hca-visible", R.visible_pool_rows_triton, R.visible_pool_rows_ref, ctx // 128),
            ("csa-topk", R.entry_pool_rows_triton, R.entry_pool_rows_ref, 512),
        ):
            a = case["window" if what == "window" else "visible" if what == "hca-visible" else "topk"]
            assert torch.equal(tri(*a), ref_fn(*a))
            t = _bench(lambda: tri(*a))
            ref = None if args.no_ref else _time_ref(lambda: ref_fn(*a))
            nbytes = T * cols * 8 + (T * cols * 4 if what == "csa-topk" else 0)
            r = dict(kernel="rows", case=what, phase=phase, n=n, ctx=ctx, us=round(t, 2),
                     ref_us=None if ref is None else round(ref, 1), bytes=nbytes,
                     gbps=round(nbytes / t / 1e3, 1), frac_roofline=round(nbytes / HBM_BPS * 1e6 / t, 3))
            results.append(r)
            print(json.dumps(r), flush=True)
    return dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, results=results)


def main() -> None:
    global DEV, DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/compressor.json (--smoke: not written)")
    ap.add_argument("--sweep", action="store_true", help="also time (BLOCK_S, num_warps) alternatives")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch reference")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (script check)")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment (set before triton loads)")
        DEV, DTYPE = "cpu", torch.float32
    report = run(args)
    out = args.out or (None if args.smoke else result_file("compressor"))
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
