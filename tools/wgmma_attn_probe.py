"""H200 probe of the Gluon (wgmma) attention kernel against the Triton kernel and the reference.

    PYTHONPATH=. python tools/wgmma_attn_probe.py [--modes check,timing,matrix] [--out PATH] [--quick]

1. Correctness: random inputs with -1 holes and ragged valid counts, causal prefill lists, several
   (block_n, stages, splits), against `sparse_mqa_attention_ref` (relative Frobenius error).
2. Time: the benchmark's prefill cases and the 64-head decode cases (sparseserve.benchmarks.kernels
   harness: do_bench for prefill, a captured graph over >= 400 MB of input sets for decode), for
   the Triton kernel's default config and wgmma configs, in the same process.
Diagnostic; the kernel benchmark (`python -m sparseserve.benchmarks.kernels`) is the record.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sparseserve.benchmarks import kernels as kb
from sparseserve.kernels.sparse_attention import (AttnConfig, attention_config, sparse_mqa_attention_ref,
                                                  sparse_mqa_attention_triton)

WG = lambda bn, st, sp=1, mp=0, pr=False: AttnConfig(64, bn, 8, st, sp, band_prepass=True, wgmma=True, max_programs=mp, pair=pr)  # noqa: E731,E501


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def correctness(gen) -> list[dict]:
    rows_out = []
    dev = "cuda"
    for heads, tokens, L, holes in ((64, 37, 300, 0.3), (128, 19, 700, 0.1), (64, 5, 1152, 0.0), (128, 3, 64, 0.5)):
        q = torch.randn(tokens, heads, 512, device=dev, generator=gen).bfloat16()
        kv = torch.randn(5000, 512, device=dev, generator=gen).bfloat16()
        rows = torch.randint(0, 5000, (tokens, L), device=dev, generator=gen, dtype=torch.int32)
        rows[torch.rand(tokens, L, device=dev, generator=gen) < holes] = -1
        valid = torch.randint(0, L + 1, (tokens,), device=dev, generator=gen)  # ragged: trailing holes
        rows[torch.arange(L, device=dev)[None, :] >= valid[:, None]] = -1
        rows[0] = -1  # a token with no row at all: output must be exactly 0
        sinks = torch.randn(heads, device=dev, generator=gen) * 2
        ref = sparse_mqa_attention_ref(q, kv, rows, sinks, 512 ** -0.5)
        for cfg in (WG(64, 2), WG(32, 2), WG(64, 2, 1, 3), WG(64, 2, 2), WG(32, 2, 4, 7), WG(64, 2, 8), WG(64, 2, 2, 1 << 20),
                    WG(64, 2, 1, 0, True), WG(64, 2, 1, 3, True), WG(64, 2, 4, 7, True), WG(64, 2, 2, 1 << 20, True)):
            out = sparse_mqa_attention_triton(q, kv, rows, sinks, 512 ** -0.5, cfg)
            torch.cuda.synchronize()
            e = rel_err(out, ref)
            zero_ok = bool((out[0] == 0).all())
            rows_out.append(dict(heads=heads, tokens=tokens, L=L, cfg=repr(cfg), rel_err=e, empty_token_zero=zero_ok))
            print(f"check H{heads} T{tokens} L{L} {'pair ' if cfg.pair else ''}{cfg.block_n}/{cfg.num_stages}/S{cfg.num_splits}/P{cfg.max_programs}: "
                  f"err {e:.2e} empty->0 {zero_ok}", flush=True)
    # causal prefill lists (window holes at the start, compressed holes at the end)
    for model, kind in (("flash", "csa"), ("pro", "hca")):
        case = kb.attn_prefill_case(model, kind, 1024, gen)
        ref = sparse_mqa_attention_ref(*case["args"])
        for cfg in (WG(64, 2), WG(32, 2, 1, 5), WG(64, 2, 1, 0, True), WG(64, 2, 1, 5, True)):
            e = rel_err(sparse_mqa_attention_triton(*case["args"], cfg), ref)
            rows_out.append(dict(prefill=f"{model}-{kind}-1024", cfg=repr(cfg), rel_err=e))
            print(f"check prefill {model} {kind} 1024 {'pair ' if cfg.pair else ''}{cfg.block_n}/{cfg.num_stages}/P{cfg.max_programs}: "
                  f"err {e:.2e}", flush=True)
    return rows_out


def timing(gen, quick: bool) -> list[dict]:
    res = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prefill = [("flash", "csa", 4096), ("flash", "hca", 4096), ("pro", "csa", 4096), ("pro", "hca", 4096)]
    if not quick:
        prefill += [("flash", "csa", 32768), ("pro", "csa", 32768), ("flash", "hca", 32768)]
    for model, kind, tokens in prefill:
        case = kb.attn_prefill_case(model, kind, tokens, gen)
        q, kv, rows, sinks, scale = case["args"]
        base = attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms)
        for cfg in (base, WG(64, 2), WG(64, 2, 1, 0, True)):
            t = kb._bench(lambda c=cfg, a=case["args"]: sparse_mqa_attention_triton(*a, c))
            r = dict(phase="prefill", model=model, kind=kind, tokens=tokens, cfg=repr(cfg), us=round(t, 1),
                     tflops=round(case["flops"] / t / 1e6, 1), bf16_frac=round(case["flops"] / (t * 1e-6) / kb.BF16_FLOPS, 3))
            res.append(r)
            print(f"prefill {model} {kind} {tokens} {('pair' if cfg.pair else 'wgmma') if cfg.wgmma else 'triton'} {cfg.block_n}/"
                  f"{cfg.num_stages}/P{cfg.max_programs}: {t:.1f} us {r['tflops']} TF/s ({100 * r['bf16_frac']:.0f}%)", flush=True)
        del case
        torch.cuda.empty_cache()
    decode = [("flash", "csa", 256), ("flash", "csa", 64), ("pro", "csa", 64), ("pro", "csa", 256), ("flash", "hca", 256),
              ("flash", "csa", 8), ("pro", "csa", 8)]
    for model, kind, batch in decode:
        case = kb.attn_decode_case(model, kind, batch, 32768, gen)
        q, kv, rows, sinks, scale = case["args"]
        base = attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms)
        cands = [base]
        hb = q.shape[1] // 64
        for sp in (1, 2, 4, 8):
            if batch * hb * sp <= 4 * sms and (sp == 1 or batch * hb * sp // 2 < 2 * sms):
                cands += [WG(64, 2, sp, 0, True), WG(64, 2, sp)]
        for cfg in cands:
            t = kb._bench_graph([(lambda a=a, c=cfg: sparse_mqa_attention_triton(*a, c)) for a in case["sets"]])
            r = dict(phase="decode", model=model, kind=kind, batch=batch, cfg=repr(cfg), us=round(t, 2),
                     hbm_frac=round(case["bytes"] / (t * 1e-6) / kb.HBM_BPS, 3),
                     bf16_frac=round(case["flops"] / (t * 1e-6) / kb.BF16_FLOPS, 3))
            res.append(r)
            print(f"decode {model} {kind} b{batch} {('pair' if cfg.pair else 'wgmma') if cfg.wgmma else 'triton'} {cfg.block_h}/{cfg.block_n}/"
                  f"{cfg.num_stages}/S{cfg.num_splits}/P{cfg.max_programs}: {t:.1f} us  {100 * r['hbm_frac']:.0f}% HBM "
                  f"{100 * r['bf16_frac']:.0f}% bf16", flush=True)
        del case
        torch.cuda.empty_cache()
    return res


def matrix(gen) -> list[dict]:
    """Every decode case of the kernel benchmark: the default config against wgmma at each split."""
    res = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model in kb.MODELS:
        for kind in ("csa", "hca"):
            for ctx in kb.CONTEXTS:
                if kind == "csa" and ctx != 32768:
                    continue  # CSA rows do not depend on the context from 4K on
                for batch in kb.BATCHES:
                    case = kb.attn_decode_case(model, kind, batch, ctx, gen)
                    q, kv, rows, sinks, scale = case["args"]
                    base = attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms, wgmma=False)
                    hb = q.shape[1] // 64
                    cands = [base] + [WG(64, 2, sp) for sp in (1, 2, 4, 8, 16)
                                      if sp == 1 or (batch * hb * sp <= 2 * sms and rows.shape[1] >= 32 * sp)]
                    line = []
                    for cfg in cands:
                        t = kb._bench_graph([(lambda a=a, c=cfg: sparse_mqa_attention_triton(*a, c)) for a in case["sets"]])
                        res.append(dict(model=model, kind=kind, ctx=ctx, batch=batch, cfg=repr(cfg), us=round(t, 2),
                                        hbm_frac=round(case["bytes"] / (t * 1e-6) / kb.HBM_BPS, 3)))
                        line.append(f"{'W' if cfg.wgmma else 'T'}{cfg.block_h}S{cfg.num_splits}={t:.1f}")
                    print(f"decode {model} {kind} {ctx // 1024}K b{batch}: " + " ".join(line), flush=True)
                    del case
                    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="wgmma_attn_probe.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="check,timing", help="of check,timing,matrix")
    args = ap.parse_args()
    import triton
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    report = dict(card=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(sys.argv))
    modes = set(args.modes.split(","))
    for mode, fn in (("check", correctness), ("timing", lambda g: timing(g, args.quick)), ("matrix", matrix)):
        if mode in modes:
            try:
                report[mode] = fn(gen)
            except Exception as exc:  # noqa: BLE001 - keep the other modes' numbers
                print(f"{mode} failed: {type(exc).__name__}: {exc}", flush=True)
    report["wall_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", args.out, "in", report["wall_s"], "s")


if __name__ == "__main__":
    main()
