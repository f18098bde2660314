"""H200 probe of the role-split attention kernel (kernels/sparse_attention_wgmma_roles.py): correctness against the
reference, then time against the kernel the engine picks, in one process.

    PYTHONPATH=. python tools/roles_probe.py --modes check|timing [--out PATH]

check: ragged row lists with holes, an all-holes token (exactly 0), 64 and 128 heads, 1-4 splits, 1-7 persistent
programs or one per SM, a sink of 200 (a split whose row sum underflows), causal prefill lists, and a CUDA-graph
replay. timing: the kernel benchmark's prefill cases (do_bench, L2 flushed) and 64-head decode cases at batch 64 and
256 (graph over >= 400 MB of input sets), the engine's config and the wgmma kernel in the same process.
Diagnostic; the kernel benchmark is the record.
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


def roles(splits: int = 1, programs: int = 0) -> AttnConfig:
    return AttnConfig(64, 64, 8, 2, splits, band_prepass=True, wgmma=True, max_programs=programs, roles=True)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(gen, variant: str | None = None) -> list[dict]:
    """The checks below, with the launcher of `variant` (a name of VARIANTS; None: the default launcher)."""
    import sparseserve.kernels.sparse_attention as sa
    original = sa.launch_roles_attention
    if variant:
        _with_launch(**_variant_kw(variant))
    try:
        return _check(gen)
    finally:
        sa.launch_roles_attention = original


def _check(gen) -> list[dict]:
    res = []
    dev = "cuda"
    for heads, tokens, L, holes in ((64, 37, 300, 0.3), (128, 19, 700, 0.1), (64, 5, 1152, 0.0), (128, 3, 64, 0.5),
                                    (64, 300, 160, 0.2)):
        q = torch.randn(tokens, heads, 512, device=dev, generator=gen).bfloat16()
        kv = torch.randn(5000, 512, device=dev, generator=gen).bfloat16()
        rows = torch.randint(0, 5000, (tokens, L), device=dev, generator=gen, dtype=torch.int32)
        rows[torch.rand(tokens, L, device=dev, generator=gen) < holes] = -1
        valid = torch.randint(0, L + 1, (tokens,), device=dev, generator=gen)
        rows[torch.arange(L, device=dev)[None, :] >= valid[:, None]] = -1
        rows[0] = -1  # no row at all: the output must be exactly 0
        sinks = torch.randn(heads, device=dev, generator=gen) * 2
        sinks[1] = 200.0  # outweighs every logit: split row sums underflow to 0
        ref = sparse_mqa_attention_ref(q, kv, rows, sinks, 512 ** -0.5)
        for cfg in (roles(), roles(1, 1), roles(1, 3), roles(2), roles(4, 7), roles(2, 1 << 20)):
            out = sparse_mqa_attention_triton(q, kv, rows, sinks, 512 ** -0.5, cfg)
            torch.cuda.synchronize()
            e = rel_err(out, ref)
            zero = bool((out[0] == 0).all())
            nan = bool(out.isnan().any())
            res.append(dict(heads=heads, tokens=tokens, L=L, splits=cfg.num_splits, programs=cfg.max_programs,
                            rel_err=e, empty_token_zero=zero, nan=nan))
            print(f"check H{heads} T{tokens} L{L} S{cfg.num_splits} P{cfg.max_programs}: err {e:.2e} empty->0 {zero} "
                  f"nan {nan}", flush=True)
        # q as a strided view (every other head of a wider tensor): the kernel loads it by cp.async, not TMA
        q_view = torch.stack([q, torch.randn_like(q)], 2).flatten(1, 2)[:, ::2]
        out = sparse_mqa_attention_triton(q_view, kv, rows, sinks, 512 ** -0.5, roles(2, 5))
        e = rel_err(out, ref)
        res.append(dict(heads=heads, tokens=tokens, L=L, q_strided=True, rel_err=e, nan=bool(out.isnan().any())))
        print(f"check H{heads} T{tokens} L{L} strided q: err {e:.2e}", flush=True)
    for model, kind in (("flash", "csa"), ("flash", "hca"), ("pro", "hca")):
        case = kb.attn_prefill_case(model, kind, 1024, gen)
        ref = sparse_mqa_attention_ref(*case["args"])
        for cfg in (roles(), roles(1, 5)):
            e = rel_err(sparse_mqa_attention_triton(*case["args"], cfg), ref)
            res.append(dict(prefill=f"{model}-{kind}-1024", programs=cfg.max_programs, rel_err=e))
            print(f"check prefill {model} {kind} 1024 P{cfg.max_programs}: err {e:.2e}", flush=True)
    # graph replay: captured once, replayed on new inputs written into the same buffers
    case = kb.attn_decode_case("flash", "csa", 64, 32768, gen)
    q, kv, rows, sinks, scale = case["args"]
    q2, rows2 = case["sets"][1][0], case["sets"][1][2]
    qb, rb = q.clone(), rows.clone()
    sparse_mqa_attention_triton(qb, kv, rb, sinks, scale, roles(2))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sparse_mqa_attention_triton(qb, kv, rb, sinks, scale, roles(2))
    qb.copy_(q2)
    rb.copy_(rows2)
    g.replay()
    torch.cuda.synchronize()
    e = rel_err(out, sparse_mqa_attention_ref(q2, kv, rows2, sinks, scale))
    res.append(dict(graph_replay="flash-csa-b64-S2", rel_err=e))
    print(f"check graph replay flash csa b64 S2: err {e:.2e}", flush=True)
    return res


# Launcher variants to time beside the engine's (keyword arguments of launch_roles_attention; "regs" sets
# worker_regs): "old" is session 23's kernel (q by cp.async, one regather after the output's TMA reads).
# "direct": outputs stored from registers (no TMA store), so a unit's last slot is regathered at once.
VARIANTS = {"old": dict(q_tma=False, epi_chunks=False), "qtma": dict(q_tma=True, epi_chunks=False),
            "chunks": dict(q_tma=False, epi_chunks=True), "direct": dict(tma_store=False)}


def _with_launch(**kw):
    """The dispatch's launcher with these keyword arguments (probe knobs); none: the default launcher."""
    import sparseserve.kernels.sparse_attention as sa
    from sparseserve.kernels import sparse_attention_wgmma_roles as rk
    sa.launch_roles_attention = lambda *a, **k: rk.launch_roles_attention(*a, **k, **kw)


def timing(gen, variants=("old",), prefill_only=False, decode_only=False) -> list[dict]:
    """The timed cases (below), with the dispatch's launcher restored afterwards."""
    import sparseserve.kernels.sparse_attention as sa
    original = sa.launch_roles_attention
    try:
        return _timing(gen, variants, prefill_only, decode_only)
    finally:
        sa.launch_roles_attention = original


def _variant_kw(name: str) -> dict:
    return dict(worker_regs=int(name[4:])) if name.startswith("regs") else VARIANTS[name]


def _timing(gen, variants, prefill_only, decode_only) -> list[dict]:
    res = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prefill = (("flash", "hca", 4096), ("flash", "csa", 4096), ("pro", "hca", 4096), ("pro", "csa", 4096),
               ("flash", "hca", 32768), ("flash", "csa", 32768))
    for model, kind, tokens in () if decode_only else prefill:
        case = kb.attn_prefill_case(model, kind, tokens, gen)
        q, kv, rows, sinks, scale = case["args"]
        base = attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms, wgmma=True)
        for name, cfg in [("engine", base)] + [(v, roles()) for v in variants] + [("engine2", base)]:
            if name.startswith("engine"):
                _with_launch()
            else:
                _with_launch(**_variant_kw(name))
            t = kb._bench(lambda c=cfg, a=case["args"]: sparse_mqa_attention_triton(*a, c))
            r = dict(phase="prefill", model=model, kind=kind, tokens=tokens, kernel=name, cfg=repr(cfg), us=round(t, 1),
                     bf16_frac=round(case["flops"] / (t * 1e-6) / kb.BF16_FLOPS, 3))
            res.append(r)
            print(f"prefill {model} {kind} {tokens} {name}: {t:.1f} us ({100 * r['bf16_frac']:.1f}% bf16)", flush=True)
        del case
        torch.cuda.empty_cache()
    if prefill_only:
        return res
    for model, kind, batch, ctx in (("flash", "csa", 256, 32768), ("flash", "csa", 64, 32768),
                                    ("flash", "hca", 256, 32768), ("flash", "hca", 64, 32768),
                                    ("flash", "hca", 64, 4096), ("flash", "hca", 64, 131072),
                                    ("flash", "hca", 256, 131072), ("pro", "hca", 64, 32768),
                                    ("pro", "csa", 256, 32768)):
        case = kb.attn_decode_case(model, kind, batch, ctx, gen)
        q, kv, rows, sinks, scale = case["args"]
        base = attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms, wgmma=True)
        runs = ([("engine", base, None), ("roles", roles(), None), ("roles-S2", roles(2), None)]
                + [(f"roles-{v}", roles(), v) for v in variants])
        for name, cfg, variant in runs:
            if variant is None:
                _with_launch()
            else:
                _with_launch(**_variant_kw(variant))
            t = kb._bench_graph([(lambda a=a, c=cfg: sparse_mqa_attention_triton(*a, c)) for a in case["sets"]])
            r = dict(phase="decode", model=model, kind=kind, batch=batch, ctx=ctx, kernel=name, cfg=repr(cfg),
                     us=round(t, 2), hbm_frac=round(case["bytes"] / (t * 1e-6) / kb.HBM_BPS, 3))
            res.append(r)
            print(f"decode {model} {kind} {ctx // 1024}K b{batch} {name}: {t:.2f} us ({100 * r['hbm_frac']:.1f}% HBM)",
                  flush=True)
        del case
        torch.cuda.empty_cache()
    return res


def trace(gen, variant: str | None = None) -> list[dict]:
    """Mean cycles per tile between the kernel's clock marks (TRACE: score warpgroup marks 0-4, output warpgroup 0
    marks 5-8 and 11-15), over every traced tile of every program; `variant`: the launcher of that VARIANTS name."""
    from sparseserve.kernels import sparse_attention_wgmma_roles as rk
    from sparseserve.kernels.sparse_attention import launch_roles_attention  # noqa: F401 (the dispatch's import)
    res = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("prefill", "flash", "hca", 4096, 0), ("prefill", "flash", "csa", 4096, 0), ("decode", "flash", "csa", 256, 0),
             ("prefill", "flash", "csa", 4096, 1)]
    orig = rk.launch_roles_attention
    for phase, model, kind, n, ablate in cases:
        case = (kb.attn_prefill_case(model, kind, n, gen) if phase == "prefill"
                else kb.attn_decode_case(model, kind, n, 32768, gen))
        buf = torch.full((sms, rk.TRACE_TILES, rk.TRACE_SLOTS), -1, dtype=torch.int64, device="cuda")
        import sparseserve.kernels.sparse_attention as sa
        extra = _variant_kw(variant) if variant else {}
        sa.launch_roles_attention = lambda *a, **k: orig(*a, **k, trace=buf, ablate=ablate, **extra)
        try:
            sparse_mqa_attention_triton(*case["args"], roles())
            torch.cuda.synchronize()
            buf.fill_(-1)
            sparse_mqa_attention_triton(*case["args"], roles())
            torch.cuda.synchronize()
        finally:
            sa.launch_roles_attention = orig
        t = buf.double()
        ok = (t[:, :-1, 0] >= 0) & (t[:, 1:, 0] >= 0) & (t[:, :-1, 11] >= 0)
        last = t[:, 1:, 9] != t[:, :-1, 9]  # the unit changes after this tile

        def mean(a, b, nxt=False, sel=None):
            x = (t[:, 1:, b] if nxt else t[:, :-1, b]) - t[:, :-1, a]
            m = ok if sel is None else ok & sel
            return round(float(x[m].mean()), 1) if bool(m.any()) else None
        row = dict(phase=phase, model=model, kind=kind, n=n, ablate=ablate, tiles=int(ok.sum()),
                   score=dict(landed_wait=mean(0, 1), qk=mean(1, 2), softmax=mean(2, 3), p_free_and_store=mean(3, 4),
                              to_next_last=mean(4, 0, True, last), to_next_other=mean(4, 0, True, ~last),
                              period=mean(0, 0, True)),
                   output=dict(p_wait=mean(5, 6), pv=mean(6, 7), epilogue_last=mean(7, 12, sel=last),
                               gather_issue=mean(12, 8), to_next=mean(8, 5, True),
                               period=mean(5, 5, True)),
                   # A unit's last tile, from its PV to its regather issued: l from the score warpgroup, the output
                   # scaled into the slot, the four TMA stores issued, the regather behind their reads.
                   epilogue=dict(l_wait=mean(7, 13, sel=last), stage=mean(13, 14, sel=last),
                                 tma_issue=mean(14, 15, sel=last), regather=mean(15, 12, sel=last)))
        res.append(row)
        print(json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="roles_probe.json")
    ap.add_argument("--modes", default="check")
    ap.add_argument("--variants", default="old",
                    help="timing: launcher variants beside the engine's (names of VARIANTS, or regsN: N registers per "
                         "output warpgroup)")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--variant", default=None, help="check and trace: this launcher variant (a name of VARIANTS)")
    args = ap.parse_args()
    import triton
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = dict(card=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(sys.argv))
    for mode in args.modes.split(","):
        modes = {"check": lambda g: check(g, args.variant),
                 "timing": lambda g: timing(g, tuple(args.variants.split(",")), args.prefill_only, args.decode_only),
                 "trace": lambda g: trace(g, args.variant)}
        report[mode] = modes[mode](gen)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
