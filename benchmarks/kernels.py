"""Kernel benchmark for the sparse MQA attention and the Lightning Indexer (H200).

    python -m benchmarks.kernels [--out PATH] [--sweep] [--quick]

Cases (bf16, real V4 shapes, D = 512, window 128):
  attention decode : batch 1/8/64/256 x context 4K/32K/128K, V4-Flash (64 heads, top-k 512) and
                     V4-Pro (128 heads, top-k 1024); CSA rows = 128 + top-k, HCA rows = 128 + ctx/128.
  attention prefill: one sequence of 4K / 32K tokens, CSA and HCA row lists of each model.
  indexer decode   : batch 1/8/64/256 x context 4K/32K/128K, 64 heads x 128 dims, E = ctx/4 entries.
  indexer prefill  : one sequence of 4K / 32K tokens (E = P/4, causal).
Bytes and FLOPs per case are the minimum the operation needs (each gathered row read once per
token, q read once, output written once; FLOPs of the valid rows only), fixed before tuning.
Times: triton.testing.do_bench medians, L2 flushed before every run (so decode reads come
from HBM). The plain-PyTorch reference is timed in the same process (1 warm-up + 2 runs).
--sweep also times alternative kernel configs on representative cases (tuning data).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import torch
import triton
import triton.testing

from benchmarks import result_file, write_result
from benchmarks.ceilings import READ_BLOCK, read_sum
from sparseserve.kernels.indexer import IndexerConfig, indexer_config, indexer_scores_ref, indexer_scores_triton
from sparseserve.kernels.attention import (
    AttnConfig,
    attention_config,
    engine_attention_config,
    sparse_mqa_attention_ref,
    sparse_mqa_attention_triton,
)

HBM_BPS = 4.23e12  # measured device-to-device copy on the H200 (docs/performance.md, ceilings)
BF16_FLOPS = 790e12  # measured bf16 GEMM on random data
D, WINDOW, RATE_CSA, RATE_HCA = 512, 128, 4, 128
IDX_HEADS, IDX_DIM, EPB = 64, 128, 64
MODELS = {"flash": dict(heads=64, topk=512), "pro": dict(heads=128, topk=1024)}
BATCHES = (1, 8, 64, 256)
CONTEXTS = (4096, 32768, 131072)
PREFILLS = (4096, 32768)
DEV = "cuda"  # "cpu" under --smoke (TRITON_INTERPRET=1): checks the script itself, no timings
DTYPE = torch.bfloat16  # fp32 under --smoke: the interpreter's 16-bit dot is wrong (triton 3.9)


def _bench(fn) -> float:
    """Median kernel time in microseconds (L2 flushed between runs by do_bench)."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _bench_graph(calls) -> float:
    """Microseconds per call: all calls (one per input set) captured back to back in one CUDA
    graph, as the engine's decode step runs them; median of 5 replays. No host launch cost."""
    if DEV == "cpu":
        return _bench(calls[0])
    for c in calls[:2]:
        c()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del g
    return sorted(times)[2]


def _time_ref(fn, runs: int = 2) -> float:
    if DEV == "cpu":
        return _bench(fn)
    torch.cuda.synchronize()  # the correctness check just ran it: that is the warm-up
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return min(times)


# ------------------------------------------------------------------ case builders
def _num_sets(bytes_per_call: int) -> int:
    """Input sets cycled through in one captured graph, so that each call finds its rows out
    of L2 (as in a real step, where the other layers run in between): >= ~400 MB per cycle."""
    return 1 if DEV == "cpu" else max(2, min(1024, math.ceil(400e6 / bytes_per_call)))


def attn_decode_case(model: str, kind: str, batch: int, ctx: int, gen: torch.Generator) -> dict:
    heads, topk = MODELS[model]["heads"], MODELS[model]["topk"]
    entries = ctx // (RATE_CSA if kind == "csa" else RATE_HCA)
    chosen = min(topk, entries) if kind == "csa" else entries
    per_seq = WINDOW + entries  # pool region of one sequence: window ring + compressed entries
    L = WINDOW + chosen
    valid = batch * L
    nbytes = valid * D * 2 + 2 * batch * heads * D * 2 + valid * 4
    # One shared pool of >= 1 GiB (2^20 rows); every set places each sequence's region at a
    # random offset, so different sets read different rows.
    pool_rows = max(batch * per_seq, 1 << 20 if DEV == "cuda" else 4 * per_seq)
    kv = torch.randn(pool_rows, D, device=DEV, generator=gen).to(DTYPE)
    sinks = torch.randn(heads, device=DEV, generator=gen)
    sets = []
    for _ in range(_num_sets(nbytes)):
        base = torch.randint(0, pool_rows - per_seq + 1, (batch, 1), device=DEV, generator=gen)
        window = base + torch.arange(WINDOW, device=DEV)
        if kind == "csa":
            comp = torch.rand(batch, entries, device=DEV, generator=gen).topk(chosen, dim=1).indices
        else:
            comp = torch.arange(entries, device=DEV).expand(batch, -1)
        rows = torch.cat([window, base + WINDOW + comp], dim=1).int()
        q = torch.randn(batch, heads, D, device=DEV, generator=gen).to(DTYPE)
        sets.append((q, kv, rows, sinks, D**-0.5))
    return dict(args=sets[0], sets=sets, heads=heads, rows=L, tokens=batch, bytes=nbytes,
                flops=4 * heads * D * valid)


def attn_prefill_case(model: str, kind: str, tokens: int, gen: torch.Generator) -> dict:
    heads, topk = MODELS[model]["heads"], MODELS[model]["topk"]
    rate = RATE_CSA if kind == "csa" else RATE_HCA
    entries = tokens // rate
    t = torch.arange(tokens, device=DEV)
    window = t.unsqueeze(1) - (WINDOW - 1) + torch.arange(WINDOW, device=DEV)
    window = torch.where(window >= 0, window, -1)
    visible = ((t + 1) // rate).unsqueeze(1)
    if kind == "csa":
        k = min(topk, entries)
        comp = torch.empty(tokens, k, dtype=torch.long, device=DEV)
        for s in range(0, tokens, 4096):  # bound the [chunk, entries] score matrix
            sc = torch.rand(min(4096, tokens - s), entries, device=DEV, generator=gen)
            vis = torch.arange(entries, device=DEV) < visible[s : s + 4096]
            vals, idx = sc.masked_fill(~vis, -1.0).topk(k, dim=1)
            comp[s : s + 4096] = torch.where(vals >= 0, idx, -1)
    else:
        comp = torch.arange(entries, device=DEV).expand(tokens, -1)
        comp = torch.where(comp < visible, comp, -1)
    rows = torch.cat([window, torch.where(comp >= 0, comp + tokens, -1)], dim=1).int()
    q = torch.randn(tokens, heads, D, device=DEV, generator=gen).to(DTYPE)
    kv = torch.randn(tokens + entries, D, device=DEV, generator=gen).to(DTYPE)
    sinks = torch.randn(heads, device=DEV, generator=gen)
    valid = int((rows >= 0).sum())
    return dict(
        args=(q, kv, rows, sinks, D**-0.5), heads=heads, rows=rows.shape[1], tokens=tokens,
        bytes=(tokens + entries) * D * 2 + 2 * tokens * heads * D * 2 + rows.numel() * 4,
        flops=4 * heads * D * valid,
    )


def indexer_decode_case(batch: int, ctx: int, gen: torch.Generator) -> dict:
    entries = ctx // RATE_CSA
    blocks = entries // EPB
    vis = batch * entries  # position ctx - 1: every entry is visible
    nbytes = vis * IDX_DIM * 2 + batch * entries * 4 + batch * IDX_HEADS * (IDX_DIM * 2 + 4) + batch * blocks * 4
    # Shared pool of >= 512 MiB; each set maps its sequences onto random blocks of it.
    pool_blocks = max(batch * blocks, (1 << 21) // EPB if DEV == "cuda" else 2 * batch * blocks)
    pool = torch.randn(pool_blocks * EPB, IDX_DIM, device=DEV, generator=gen).to(DTYPE)
    seq = torch.arange(batch, device=DEV)
    pos = torch.full((batch,), ctx - 1, device=DEV)
    sets = []
    for _ in range(_num_sets(nbytes)):
        q = torch.randn(batch, IDX_HEADS, IDX_DIM, device=DEV, generator=gen).to(DTYPE)
        w = torch.randn(batch, IDX_HEADS, device=DEV, generator=gen)
        bt = torch.randint(0, pool_blocks, (batch, blocks), device=DEV, generator=gen).int()
        sets.append((q, w, pool, bt, seq, pos, RATE_CSA, EPB, IDX_DIM**-0.5, entries))
    return dict(args=sets[0], sets=sets, tokens=batch, entries=entries, bytes=nbytes,
                flops=vis * (2 * IDX_HEADS * IDX_DIM + 2 * IDX_HEADS))


def indexer_prefill_case(tokens: int, gen: torch.Generator) -> dict:
    entries = tokens // RATE_CSA
    blocks = triton.cdiv(entries, EPB)
    q = torch.randn(tokens, IDX_HEADS, IDX_DIM, device=DEV, generator=gen).to(DTYPE)
    w = torch.randn(tokens, IDX_HEADS, device=DEV, generator=gen)
    pool = torch.randn(blocks * EPB, IDX_DIM, device=DEV, generator=gen).to(DTYPE)
    bt = torch.randperm(blocks, device=DEV, generator=gen).view(1, blocks).int()
    seq = torch.zeros(tokens, dtype=torch.long, device=DEV)
    pos = torch.arange(tokens, device=DEV)
    vis = int(((pos + 1) // RATE_CSA).clamp(max=entries).sum())
    return dict(
        args=(q, w, pool, bt, seq, pos, RATE_CSA, EPB, IDX_DIM**-0.5, entries), tokens=tokens, entries=entries,
        bytes=entries * IDX_DIM * 2 + tokens * entries * 4 + tokens * IDX_HEADS * (IDX_DIM * 2 + 4),
        flops=vis * (2 * IDX_HEADS * IDX_DIM + 2 * IDX_HEADS),
    )


# ------------------------------------------------------------------ configs tried by --sweep
def attn_sweep_configs(prefill: bool) -> list[AttnConfig]:
    """Configs timed by --sweep besides the chosen one. (The wider sweep that chose the
    heuristics is in git history: `git show 4cb78d2:benchmarks/results/kernels.json`, "tuning_sweep".)"""
    def A(*a):  # noqa: E306 - (block_h, block_n, warps, stages, splits) of the Triton kernel
        return AttnConfig("triton", *a, band_prepass=a[0] == 64)
    if prefill:
        return [A(64, 32, 8, 3), A(64, 64, 8, 1), A(64, 128, 8, 1)]
    return [A(64, 64, 8, 2), A(64, 32, 8, 2), A(16, 64, 4, 2, 2), A(16, 64, 4, 3, 1)]


def indexer_sweep_configs() -> list[IndexerConfig]:
    I = IndexerConfig  # (block_e, tiles, warps, stages)
    return [I(128, 8, 4, 2), I(128, 16, 4, 2), I(256, 4, 8, 2), I(64, 4, 4, 2), I(128, 1, 4, 2)]


def warm(part: int, nparts: int) -> None:
    """Compile every config the benchmark may launch (one slice per process), on tiny inputs
    with the same specialisation (divisibility) as the real cases, into Triton's disk cache."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    jobs = []
    for heads in (64, 128):
        cfgs = set(attn_sweep_configs(True) + attn_sweep_configs(False))
        for T in (1, 8, 64, 256, 4096):  # heuristic choices
            for L in (160, 384, 640, 1152):
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                cfgs.add(attention_config(T, heads, L, D, sms))
                cfgs.add(attention_config(T, heads, L, D, sms, hopper=torch.cuda.get_device_capability()[0] == 9))
        jobs += [("attn", heads, c) for c in sorted(cfgs, key=repr)]
    icfgs = set(indexer_sweep_configs())
    for T, E in [(b, c // 4) for b in BATCHES for c in CONTEXTS] + [(p, p // 4) for p in PREFILLS]:
        icfgs.add(indexer_config(T, IDX_HEADS, IDX_DIM, E, torch.cuda.get_device_properties(0).multi_processor_count))
    jobs += [("idx", 0, c) for c in sorted(icfgs, key=repr)]
    for kind, heads, cfg in jobs[part::nparts]:
        try:
            if kind == "attn":
                q = torch.randn(2, heads, D, device=DEV, generator=gen).to(DTYPE)
                kv = torch.randn(1000, D, device=DEV, generator=gen).to(DTYPE)
                rows = torch.randint(0, 1000, (2, 640), device=DEV, generator=gen, dtype=torch.int32)
                sparse_mqa_attention_triton(q, kv, rows, torch.zeros(heads, device=DEV), 0.05, cfg)
            else:
                case = indexer_decode_case(2, 4096, gen)
                indexer_scores_triton(*case["args"], config=cfg)
        except Exception as exc:  # noqa: BLE001 - record and go on (e.g. out of shared memory)
            print(f"warm {kind} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    if DEV == "cuda":
        torch.cuda.synchronize()


def measure_ceilings() -> dict:
    if DEV == "cpu":
        return {}
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    copy_us = _bench(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, device=DEV).to(DTYPE)
    b = torch.randn(8192, 8192, device=DEV).to(DTYPE)
    mm_us = _bench(lambda: a @ b)
    return dict(copy_bytes_per_s=2 * x.numel() * 2 / (copy_us * 1e-6), bf16_gemm_flops=2 * 8192**3 / (mm_us * 1e-6))


def same_size_copy_us(nbytes: int) -> float:
    """Microseconds of a device copy that moves nbytes (half read, half written), timed like the decode
    cases (`_bench_graph` over distinct buffers of >= 400 MB per cycle, so every source is out of L2).
    The HBM rate a kernel of this size can reach: at small sizes launch and ramp-up dominate."""
    n = max(1, nbytes // 4)  # bf16 elements read (and written) per call
    sets = _num_sets(nbytes)
    src = torch.empty(sets, n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    return _bench_graph([(lambda i=i: dst[i].copy_(src[i])) for i in range(sets)])


def same_size_read_us(nbytes: int) -> float:
    """Microseconds of a device read of nbytes (`ceilings.read_sum`: block sums of bf16 into fp32, writes 1/4096 of
    the bytes), timed as `same_size_copy_us`. Decode attention mostly reads (rows and q; its output is 8-30% of its
    bytes), so its ceiling at a given size lies between this and the copy's."""
    n = max(1, nbytes // 2)  # bf16 elements read per call
    sets = _num_sets(nbytes)
    src = torch.empty(sets, n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty(sets, triton.cdiv(n, READ_BLOCK), dtype=torch.float32, device=DEV)
    return _bench_graph([(lambda i=i: read_sum(src[i], dst[i])) for i in range(sets)])


def kernel_report() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant (best effort: the cache
    layout is Triton-internal)."""
    from sparseserve.kernels import indexer as idx_mod
    from sparseserve.kernels.attention import hopper, hopper_common, hopper_split, triton_kernel as attn_mod

    rows = []
    kernels = [attn_mod._sparse_mqa_fwd_kernel, attn_mod._sparse_mqa_merge_kernel, idx_mod._indexer_scores_kernel]
    if hopper_common.HAVE_GLUON:
        kernels += [hopper._sparse_mqa_hopper_kernel, hopper_split._sparse_mqa_split_kernel]
    for fn in kernels:
        try:
            for entry in getattr(fn, "device_caches", {}).values():
                for key, k in entry[0].items():
                    md = k.metadata
                    rows.append(dict(kernel=fn.__name__, key=str(key)[:300], n_regs=k.n_regs, n_spills=k.n_spills,
                                     shared=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None),
                                     num_stages=getattr(md, "num_stages", None)))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(kernel=fn.__name__, error=repr(exc)[:200]))
    for r in rows:
        print("kernel", r)
    return rows


def _record(results, kernel, phase, meta, case, t_us, ref_us, cfg) -> None:
    bps = case["bytes"] / (t_us * 1e-6)
    fps = case["flops"] / (t_us * 1e-6)
    results.append(dict(
        kernel=kernel, phase=phase, **meta, config=repr(cfg),
        bytes=case["bytes"], flops=case["flops"], time_us=round(t_us, 2),
        bytes_per_s=bps, flops_per_s=fps, hbm_frac=round(bps / HBM_BPS, 3), bf16_frac=round(fps / BF16_FLOPS, 3),
        roofline_us=round(max(case["bytes"] / HBM_BPS, case["flops"] / BF16_FLOPS) * 1e6, 2),
        ref_time_us=None if ref_us is None else round(ref_us, 1),
        speedup_vs_ref=None if ref_us is None else round(ref_us / t_us, 1),
    ))
    r = results[-1]
    print(f"{kernel:5s} {phase:7s} {json.dumps(meta):70s} {t_us:9.1f} us  {bps/1e12:5.2f} TB/s ({r['hbm_frac']:.2f})"
          f"  {fps/1e12:6.1f} TF/s ({r['bf16_frac']:.2f})  ref {r['ref_time_us']} us  x{r['speedup_vs_ref']}  {cfg}",
          flush=True)


def _check_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> float:
    """Relative Frobenius error over the finite entries; -inf patterns must match. No boolean
    indexing (its int64 index tensors need tens of GB at the 32K-token prefill shapes)."""
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin), what
    diff = torch.where(fin, out.float() - ref.float(), 0.0)
    err = (diff.norm() / torch.where(fin, ref.float(), 0.0).norm()).item()
    assert err < tol, (what, err)
    return err


def run(args) -> dict:
    card = torch.cuda.get_device_properties(0).name if DEV == "cuda" else "cpu (interpreter smoke run)"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132
    gen = torch.Generator(device=DEV).manual_seed(0)
    results, sweep = [], []
    ceilings = measure_ceilings()
    if ceilings:
        print(f"ceilings: copy {ceilings['copy_bytes_per_s']/1e12:.2f} TB/s, "
              f"bf16 GEMM {ceilings['bf16_gemm_flops']/1e12:.0f} TF/s")
    with_ref = not args.no_ref

    def timed(case, launch) -> float:
        """Decode cases: CUDA-graph replay over the input sets; prefill: do_bench."""
        if "sets" in case:
            return _bench_graph([(lambda a=a: launch(a)) for a in case["sets"]])
        return _bench(lambda: launch(case["args"]))

    def sweep_run(kernel, phase, meta, case, configs, launch):
        for c in configs:
            try:
                tc = timed(case, lambda a, c=c: launch(a, c))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory on this chip
                print(f"  sweep {c}: {type(exc).__name__} {str(exc)[:120]}")
                continue
            sweep.append(dict(kernel=kernel, phase=phase, **meta, config=repr(c), time_us=round(tc, 2),
                              hbm_frac=round(case["bytes"] / (tc * 1e-6) / HBM_BPS, 3),
                              bf16_frac=round(case["flops"] / (tc * 1e-6) / BF16_FLOPS, 3)))
            print(f"  sweep {c}: {tc:.1f} us", flush=True)

    def attn(phase, meta, case):
        q, kv, rows, sinks, scale = case["args"]
        cfg = engine_attention_config(q, kv, rows.shape[1])
        launch = lambda a, c=cfg: sparse_mqa_attention_triton(*a, c)  # noqa: E731
        ref_fn = lambda: sparse_mqa_attention_ref(*case["args"])  # noqa: E731
        meta["rel_err_vs_bf16_ref"] = _check_close(launch(case["args"]), ref_fn(), 2e-2, repr(meta))
        t = timed(case, launch)
        if cfg.kernel == "hopper":
            # Same-run baseline: the Triton kernel with the config it takes when the Hopper kernel is off.
            alt = attention_config(q.shape[0], q.shape[1], rows.shape[1], D, num_sms)
            _check_close(sparse_mqa_attention_triton(*case["args"], alt), ref_fn(), 2e-2, repr(meta) + repr(alt))
            meta["triton_config"] = repr(alt)
            meta["triton_time_us"] = round(timed(case, lambda a, c=alt: sparse_mqa_attention_triton(*a, c)), 2)
        if "sets" in case and DEV == "cuda":  # decode: what HBM delivers at this size, measured in the same run
            copy_us = same_size_copy_us(case["bytes"])
            meta["copy_same_bytes_us"] = round(copy_us, 2)
            meta["frac_of_same_size_copy"] = round(copy_us / t, 3)
            read_us = same_size_read_us(case["bytes"])
            meta["read_same_bytes_us"] = round(read_us, 2)
            meta["read_same_bytes_hbm_frac"] = round(case["bytes"] / (read_us * 1e-6) / HBM_BPS, 3)
        ref_t = _time_ref(ref_fn) if with_ref else None
        _record(results, "attn", phase, meta, case, t, ref_t, cfg)
        if args.sweep and meta.get("sweep"):
            sweep_run("attn", phase, meta, case, attn_sweep_configs(phase == "prefill"), launch)

    def idx(phase, meta, case):
        a = case["args"]
        cfg = indexer_config(a[0].shape[0], IDX_HEADS, IDX_DIM, a[-1], num_sms)
        launch = lambda a, c=cfg: indexer_scores_triton(*a, config=c)  # noqa: E731
        ref_fn = lambda: indexer_scores_ref(*a)  # noqa: E731
        meta["rel_err_vs_bf16_ref"] = _check_close(launch(a), ref_fn(), 1e-3, repr(meta))
        t = timed(case, launch)
        ref_t = _time_ref(ref_fn) if with_ref else None
        _record(results, "index", phase, meta, case, t, ref_t, cfg)
        if args.sweep and meta.get("sweep"):
            sweep_run("index", phase, meta, case, indexer_sweep_configs(), launch)

    attn_sweep = {("flash", "csa", b, 32768) for b in (8, 64, 256)} | {("pro", "csa", 64, 32768)}
    for model in (MODELS if "attn-decode" in args.only else ()):
        for kind in ("csa", "hca"):
            for ctx in CONTEXTS:
                for batch in BATCHES:
                    case = attn_decode_case(model, kind, batch, ctx, gen)
                    meta = dict(model=model, kind=kind, batch=batch, ctx=ctx, rows=case["rows"])
                    meta["sweep"] = (model, kind, batch, ctx) in attn_sweep
                    attn("decode", meta, case)
                    del case
                    torch.cuda.empty_cache() if DEV == "cuda" else None
    for model in (MODELS if "attn-prefill" in args.only else ()):
        for kind in ("csa", "hca"):
            for tokens in PREFILLS:
                case = attn_prefill_case(model, kind, tokens, gen)
                meta = dict(model=model, kind=kind, tokens=tokens, rows=case["rows"])
                meta["sweep"] = tokens == 4096 and model == "flash" and kind == "csa"
                attn("prefill", meta, case)
                del case
                torch.cuda.empty_cache() if DEV == "cuda" else None
    idx_sweep = {(8, 131072), (256, 131072), (64, 4096)}
    for ctx in (CONTEXTS if "index-decode" in args.only else ()):
        for batch in BATCHES:
            case = indexer_decode_case(batch, ctx, gen)
            meta = dict(batch=batch, ctx=ctx, entries=case["entries"], sweep=(batch, ctx) in idx_sweep)
            idx("decode", meta, case)
            del case
            torch.cuda.empty_cache() if DEV == "cuda" else None
    for tokens in (PREFILLS if "index-prefill" in args.only else ()):
        case = indexer_prefill_case(tokens, gen)
        meta = dict(tokens=tokens, entries=case["entries"], sweep=tokens == 4096)
        idx("prefill", meta, case)
        del case
    for r in results + sweep:
        r.pop("sweep", None)
    compiled = kernel_report() if DEV == "cuda" else []
    return dict(
        card=card, sms=num_sms, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, triton=triton.__version__,
        command="python -m benchmarks.kernels " + " ".join(sys.argv[1:]),
        roofline=dict(hbm_bytes_per_s=HBM_BPS, bf16_flops=BF16_FLOPS, measured_now=ceilings),
        timing=("decode: CUDA graph of one call per input set (sets cycle >= 400 MB so rows come from HBM), median of 5 "
                "replays / calls; prefill: triton.testing.do_bench median (L2 flushed each run); reference: min of 2 "
                "event-timed runs after the correctness check's warm-up run"),
        results=results, sweep=sweep, compiled=compiled,
    )


CASE_GROUPS = ("attn-decode", "attn-prefill", "index-decode", "index-prefill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=result_file("kernels"))
    ap.add_argument("--sweep", action="store_true", help="also time alternative configs (tuning data)")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch reference")
    ap.add_argument("--warm", default=None, help="i/n: only compile slice i of n of the configs")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (script check)")
    ap.add_argument("--only", default=",".join(CASE_GROUPS),
                    help=f"comma-separated case groups to run, of {','.join(CASE_GROUPS)} (default: all)")
    args = ap.parse_args()
    args.only = {g.strip() for g in args.only.split(",") if g.strip()}
    if not args.only or args.only - set(CASE_GROUPS):
        ap.error(f"--only takes case groups from {', '.join(CASE_GROUPS)}; got {sorted(args.only)}")
    if args.smoke:
        global DEV, DTYPE, BATCHES, CONTEXTS, PREFILLS
        DEV, DTYPE, BATCHES, CONTEXTS, PREFILLS = "cpu", torch.float32, (1, 2), (1024,), (128,)
        args.sweep = False
    if args.warm:
        i, n = (int(x) for x in args.warm.split("/"))
        t0 = time.time()
        warm(i, n)
        print(f"warm {args.warm}: {time.time() - t0:.1f} s")
        return
    report = run(args)
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
